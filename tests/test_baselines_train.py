"""The self-distillation baselines train from their tiny configs
(configs/methods/{rlsd,sdpo,sdar,sod}.py) through `python -m turnsight_jax.train` on the built-in
tasks, 3 RL steps each from the shared warm-start (tests/_train_runs.py), and each method's
mechanism shows in the logged metrics. Only sizes are overridden, plus SDPO's sibling threshold:
on this weak warm-start few rollouts solve a task fully, so any sibling with a higher reward than
0 counts. (PPO, PiCA and ToolOmni: tests/test_signal_train.py.)"""

from __future__ import annotations

import pytest

from _train_runs import any_of as _any
from _train_runs import train

# RLSD's run also carries the studies' options (docs/experiments.md): its privileged block at a
# fixed length (privileged.block_budget), faulty tools and the turn records the calibration reads.
EXTRA = {"sdpo": ["--config.privileged.sibling_min_reward=0.01"],
         "rlsd": ["--config.privileged.block_budget=40", "--config.faults.unavailable_rate=0.25",
                  "--config.log.turn_records=True"]}
METHODS = ("rlsd", "sdpo", "sdar", "sod")
RECORDS = "--config.log.records_every=1"  # trajectory records of every step: the privileged gaps and gates


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("baselines")


@pytest.fixture(scope="module")
def runs(root, warm_start):
    return {method: train(method, root / method, warm_start, RECORDS, *EXTRA.get(method, [])) for method in METHODS}


def test_every_baseline_trains_three_steps_with_its_mechanism_acting(runs):
    for method, records in runs.items():
        assert [r["step"] for r in records] == [0, 1, 2], method
        assert all(r["train/skipped_updates"] == 0.0 and r["perf/update_flops_necessary"] > 0 for r in records)
        # the teacher forward's FLOPs, a share of the update's
        assert all(0 < r["perf/teacher_flops_necessary"] <= r["perf/teacher_flops_executed"] for r in records)
        assert all(0 < r["perf/teacher_flops_share"] < 1 for r in records)
        # the teacher's views were scored and differ from the student somewhere (the privileged
        # block, or SOD's other model once the policy has moved away from it)
        assert _any(records, "teacher/gap_abs_mean", lambda v: v > (1e-4 if method == "sod" else 1e-3)), method
    rlsd = runs["rlsd"]
    # MatchTIR's turn rewards give non-zero advantages; some tokens strengthened (w > 1), some
    # weakened (w < 1), within the clip [1 - eps_w, 1 + eps_w] = [0.5, 1.5]
    assert _any(rlsd, "train/adv_abs_mean", lambda v: v > 0)
    assert _any(rlsd, "rlsd/weight_max", lambda v: 1.0 < v <= 1.5 + 1e-6)
    assert _any(rlsd, "rlsd/weight_min", lambda v: 0.5 - 1e-6 <= v < 1.0)
    assert all(0 < r["rlsd/frac_strengthened"] < 1 and 0 < r["rlsd/frac_weakened"] < 1 for r in rlsd
               if r["train/adv_abs_mean"] > 0)
    sdpo = runs["sdpo"]
    assert all(r["teacher/views_built"] + r["teacher/views_skipped"] == 8 for r in sdpo)  # one per trajectory
    # a step whose group has a sibling with reward > 0 builds views, and their KL is positive
    assert _any(sdpo, "teacher/views_built", lambda v: v > 0)
    assert all((r["train/sdpo_kl"] > 0) == (r["teacher/views_built"] > 0) for r in sdpo)
    sdar = runs["sdar"]
    # the gate sigmoid(beta * gap) is strictly inside (0, 1), the auxiliary NLL positive
    assert all(0.0 < r["train/sdar_gate"] < 1.0 and r["train/sdar_nll"] > 0 for r in sdar)
    assert all(r["teacher/covered_frac"] == 1.0 for r in sdar)  # a skill for every category
    sod = runs["sod"]
    # the teacher starts as the policy's warm-start (KL 0 and weight 1 to float rounding, ~1e-9 and
    # ~1e-6); once the policy has moved (the learning rate warms up from 0), per-turn weights
    # exp(-divergence / tau) fall below 1 and the KL is positive
    assert all(0.0 < r["train/sod_weight"] <= 1.0 + 1e-5 for r in sod)  # a token mean of weights <= 1
    assert abs(sod[0]["train/sod_kl"]) < 1e-7 and abs(sod[0]["train/sod_weight"] - 1.0) < 3e-6
    assert sod[-1]["train/sod_kl"] > 1e-6 and sod[-1]["train/sod_weight"] < 1.0 - 3e-6


def _record_turns(run):
    """{step: [turn records]} of a run's trajectory records."""
    from turnsight_jax import records

    out = {}
    for path in records.run_record_files(run):
        header, trajs = records.read_records(path)
        out[header["step"]] = [t for tr in trajs for t in tr["turns"]]
    return out


def _extreme(value, which):
    """A recorded per-turn value's min or max (the value itself when constant over the turn)."""
    return value if isinstance(value, float) else value[which]


def test_the_privileged_methods_record_their_gaps_and_gates(runs, root):
    """The records of every step hold each turn's teacher-student gap on the privileged view and the
    method's own per-token quantity, equal to the step's metrics where those are extremes."""
    for method, records in runs.items():
        turns = _record_turns(root / method)
        assert sorted(turns) == [0, 1, 2], method
        for step, ts in turns.items():
            covered = [t for t in ts if t.get("gap") is not None]
            assert covered or records[step]["teacher/covered_frac"] == 0, (method, step)
            if method == "rlsd":  # w_t = clip(exp(sign(A) gap)): the turn extremes give the step's
                assert max(_extreme(t["rlsd_weight"], "max") for t in ts) == records[step]["rlsd/weight_max"]
                assert min(_extreme(t["rlsd_weight"], "min") for t in ts) == records[step]["rlsd/weight_min"]
            if method == "sdar":  # the gate of the first (only) update, per turn, strictly in (0, 1)
                assert all(0 < _extreme(t["terms"]["sdar_gate"], "min") <= _extreme(t["terms"]["sdar_gate"], "max") < 1
                           for t in covered)
            if method == "sod":  # one attenuation per turn: constant over its tokens, in (0, 1]
                assert all(isinstance(t["terms"]["sod_weight"], float) and 0 < t["terms"]["sod_weight"] <= 1 + 1e-6
                           for t in ts)
            if method == "sdpo":
                assert all("sdpo_kl" in t["terms"] for t in ts)


def test_turn_records_faults_and_the_calibration_report(runs, root):
    """The RLSD run's turn records (log.turn_records) feed `python -m turnsight_jax.calibration`;
    its tools were unavailable at the configured rate, recorded per turn and in the metrics."""
    from turnsight_jax import calibration
    from turnsight_jax.rl import turn_outcomes

    rlsd = runs["rlsd"]
    steps = turn_outcomes.load(root / "rlsd")
    assert [s for s, _ in steps] == [1, 2, 3]
    rec = steps[0][1]
    assert rec["token_views"].tolist() == ["privileged"] and rec["token_teacher"].shape[1] == rec["token_student"].size
    assert rec["has_calls"].shape == (8, 4)  # 2 prompts x 4 rollouts, rollout.max_turns = 4
    faulted = sum(int((r["fault_unavailable"] & r["has_calls"]).sum()) for _, r in steps)
    tool = sum(int(r["has_calls"].sum()) for _, r in steps)
    assert 0 < faulted < tool
    assert all(0 <= r["faults/fault_unavailable_turns"] <= 1 for r in rlsd) and any(r["faults/faulted_turns"] > 0
                                                                                      for r in rlsd)
    assert all("credit/advantage_clean" in r and "recovery/success_faulted" in r or r["faults/faulted_turns"] == 0
               for r in rlsd)
    # the viewer's trajectory records carry each call's faults too
    assert any(t.get("faults") and "unavailable" in sum(t["faults"], []) for ts in _record_turns(root / "rlsd").values()
               for t in ts)
    assert calibration.main([str(root / "rlsd")]) == 0
    table = (root / "rlsd" / "calibration" / "calibration.md").read_text()
    assert "| privileged |" in table and (root / "rlsd" / "calibration" / "reliability.png").is_file()
