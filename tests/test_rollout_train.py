"""BAR and AKBE (rl.rollout=bar / akbe) train 3 steps from their tiny configs
(configs/methods/{bar,akbe}.py) through the trainer on the built-in tasks, from the shared
warm-start (tests/_train_runs.py), under GRPO and under TurnSight over GRPO: one run each, 3 steps
of GRPO and then 3 of TurnSight (the two-stage switch, `rl.switch_step`), each stage's assertions
on its own steps; their mechanism shows in the logged metrics (BAR: early stops, groups of unequal
size; AKBE: a quadrant besides (0, 0), exemplars and their CE)."""

from __future__ import annotations

from _train_runs import train

# steps 1-3 GRPO, 4-6 TurnSight over GRPO, with trajectory records of every step (groups of
# unequal size in them)
STAGES = ["--config.train.steps=6", "--config.rl.switch_step=3", "--config.rl.switch_method=turnsight",
          "--config.rl.base=grpo", "--config.log.records_every=1"]
# small enough for CI: 2 prompts, BAR 2 rollouts a round up to 4, AKBE groups of 2 (+ 2 no-tool)
BAR = ["--config.bar.chunk=2", "--config.bar.cap=4"]
AKBE = ["--config.train.group_size=2"]


def _stages(records):
    """{"grpo": the first stage's 3 records, "turnsight": the second's}."""
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["rl/stage"] for r in records] == [1.0] * 3 + [2.0] * 3
    return {"grpo": records[:3], "turnsight": records[3:]}


def _common(records, rows):
    assert all(r["train/skipped_updates"] == 0.0 for r in records)
    assert all(r["shape/T"] > 0 for r in records)
    # the static row count: every step of a stage ran the same program
    assert len({r["perf/step_compilations"] for r in records}) == 1, rows


def _recorded(run, records, steps):
    """Each step's records file against its metrics: the rows in groups all there (padding rows
    never), rows in no group without group statistics, every group's rows of one group id."""
    from turnsight_jax import records as rec

    files = rec.run_record_files(run)
    assert len(files) == 6
    for path in files:
        header, trajs = rec.read_records(path)
        if header["step"] not in steps:
            continue
        metrics = records[header["step"]]
        grouped = [t for t in trajs if t["group"] >= 0]
        assert len(grouped) == metrics["rollout/rows_in_groups"] and header["dropped"] == 0
        assert all("group_mean" not in t for t in trajs if t["group"] < 0)
        assert all(t["turns"] and "weight" in t["turns"][0] for t in trajs)


def test_bar_trains_under_grpo_and_turnsight(tmp_path, warm_start):
    stages = _stages(train("bar", tmp_path, warm_start, *BAR, *STAGES))
    for name, records in stages.items():
        _common(records, 8)
        # BAR acted: some prompt stopped in the band after one round of 2 (a group of 2, the cap 4)
        assert sum(r["bar/early_stops"] for r in records) > 0, name
        assert any(r["rollout/group_size_min"] < r["rollout/group_size_max"] or r["rollout/group_size_max"] < 4
                   for r in records), name
        for r in records:
            assert r["bar/rollouts"] == r["bar/rows_in_groups"] == r["rollout/rows_in_groups"]
            assert r["bar/early_stops"] + r["bar/cap_mixed"] + r["bar/fallbacks"] + r["bar/in_band"] >= 2
        assert any(r["train/adv_abs_mean"] > 0 for r in records), name
        if name == "turnsight":
            assert any(r["turnsight/weight_max"] > 1.0 for r in records)
            _recorded(tmp_path, dict(enumerate(stages["grpo"] + records)), (3, 4, 5))


def test_akbe_trains_under_grpo_and_turnsight(tmp_path, warm_start):
    stages = _stages(train("akbe", tmp_path, warm_start, *AKBE, *STAGES))
    for name, records in stages.items():
        _common(records, 6)
        for r in records:
            assert sum(r[f"akbe/q{q}"] for q in ("11", "10", "01", "00")) == 2
            assert r["akbe/no_tool_rollouts"] == 4 and r["rollout/rows_in_groups"] == 4
        # a quadrant besides (0, 0), its exemplar imitated: the CE is a positive NLL
        assert any(r["akbe/q11"] + r["akbe/q10"] + r["akbe/q01"] > 0 for r in records), name
        assert any(r["akbe/exemplars"] > 0 and r["train/akbe_ce"] > 0 and r["akbe/exemplar_tokens_mean"] > 0
                   for r in records), name
        assert all((r["akbe/exemplars"] > 0) == (r["train/akbe_ce"] > 0) for r in records), name
        if name == "turnsight":
            _recorded(tmp_path, dict(enumerate(stages["grpo"] + records)), (3, 4, 5))
