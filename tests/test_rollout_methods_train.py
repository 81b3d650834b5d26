"""T2PO and APPO, the engine-level rollout controllers (docs/rollout_methods.md), train from their
tiny configs (configs/methods/{t2po,appo}.py) through the trainer on the built-in tasks from the
shared warm-start (tests/_train_runs.py), under GRPO and under TurnSight over GRPO (`rl.rollout`
composes the controller with either): one run each, 3 steps of GRPO and then 3 of TurnSight (the
two-stage switch, `rl.switch_step`), each stage's assertions on its own steps, each controller's
mechanism showing in the logged metrics (issue 24, acceptance 3). Rollouts are kept short (2 turns
of at most 24 tokens) for CI time."""

from __future__ import annotations

import math
import shutil

import pytest

from _train_runs import train

SHORT = ["--config.rollout.max_turns=2", "--config.rollout.max_turn_tokens=24",
         "--config.rollout.max_response_tokens=96"]
# steps 1-3 GRPO, 4-6 TurnSight over GRPO
STAGES = ["--config.train.steps=6", "--config.rl.switch_step=3", "--config.rl.switch_method=turnsight",
          "--config.rl.base=grpo"]


def _stages(records):
    """[("grpo", the first stage's 3 records), ("turnsight", the second's)]."""
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["rl/stage"] for r in records] == [1.0] * 3 + [2.0] * 3
    return [("grpo", records[:3]), ("turnsight", records[3:])]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rollout_methods")


def _common(records):
    assert all(r["train/skipped_updates"] == 0.0 and math.isfinite(r["train/pg_loss"]) for r in records)


def test_t2po_trains_under_grpo_and_turnsight(root, warm_start):
    """TTI forces </think> in both runs and TDS samples turns again; the tokens they threw away (a
    cut chunk's tail, a re-sampled turn) are counted; TurnSight's weights run over GRPO's
    advantage. (The warm-start was trained without thinking: in thinking mode it solves none of
    the tasks, so the advantages are 0 here; the test is of the mechanism and its composition.)
    TDS needs a second turn to compare with the first; whether TTI's forced </think> leaves one
    depends on the warm-start's rounding (on one CPU the policy then answers at once, every episode
    one turn), so TDS is also run with TTI off, where every episode gets its second turn."""
    both = _stages(train("t2po", root / "t2po", warm_start, *SHORT, *STAGES))
    tds = train("t2po", root / "t2po_tds", warm_start, *SHORT, "--config.t2po.tti=False")
    assert [r["step"] for r in tds] == [0, 1, 2]
    for expect, records in both + [("tds", tds)]:
        _common(records)
        total = lambda key: sum(r[key] for r in records)  # noqa: E731
        assert total("t2po/recompute_tokens") == total("t2po/tti_triggers")  # one per cut chunk
        assert total("t2po/discarded_tokens") > total("t2po/tds_resamples")
        assert total("t2po/tds_resamples") <= total("t2po/tds_checked")  # only a checked turn is sampled again
        assert all(0 < r["t2po/phi_mean"] <= 1 for r in records)
        assert all((r["t2po/gamma_mean"] > 0) == (r["t2po/tds_checked"] > 0) for r in records)
        if expect == "tds":
            assert total("t2po/tti_triggers") == 0
            assert total("t2po/tds_checked") > 0 and total("t2po/tds_resamples") > 0
        else:
            assert total("t2po/tti_triggers") > 0, expect
        if expect == "turnsight":
            assert all("turnsight/weight_max" in r for r in records)


def test_appo_trains_under_grpo_and_turnsight(root, warm_start):
    """APPO branches every initial rollout once (configs/methods/appo.py: appo.branches = 1; here 2
    prompts x 2 rollouts, for time): 4 branches a step, two groups per prompt, the branches' prefixes reused (shared prefix tokens,
    no prefill of them: the prefill is the prompts'), Omega non-constant once the policy has moved
    (steps 2 and 3) and the amplification acting on the final advantage, GRPO's or TurnSight's;
    a run resumed from its step-5 checkpoint (the previous policy restored with it, in the TurnSight
    stage) repeats step 6."""
    records = train("appo", root / "appo", warm_start, *SHORT, "--config.train.group_size=2", *STAGES,
                    "--config.checkpoint.every=1")
    for expect, stage in _stages(records):
        _common(stage)
        for r in stage:
            assert r["appo/branches"] == 4 and r["appo/rollouts"] == 4 and r["rollout/groups"] == 4
            assert r["appo/shared_prefix_tokens"] > 0 and r["appo/branch_tokens"] > 0
            assert r["appo/replay_mismatches"] == 0
            assert r["rollout/prefill_tokens"] < r["appo/shared_prefix_tokens"]
        assert any(r["appo/amplify_max"] > 1 > r["appo/amplify_min"] for r in stage[1:])
        assert any(r["train/adv_abs_mean"] > 0.1 for r in stage)
        if expect == "turnsight":
            assert all("turnsight/weight_max" in r for r in stage)
    # the first step has no earlier policy (rho = 1); then the policy has moved
    assert records[0]["appo/omega_log_sq_mean"] == 0 and records[0]["appo/amplify_max"] == 1
    assert all(r["appo/omega_log_sq_mean"] > 0 and math.isfinite(r["appo/omega_log_mean"]) for r in records[1:])
    # resumed from step 5 (TurnSight's second): the checkpointed previous policy gives step 6 the same Omega
    resumed = root / "appo_resumed"
    shutil.copytree(root / "appo", resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    again = train("appo", resumed, warm_start, *SHORT, "--config.train.group_size=2", *STAGES,
                  "--config.checkpoint.every=1")
    for key in ("appo/omega_log_mean", "appo/omega_log_sq_mean", "appo/branch_score_mean", "train/grad_norm"):
        assert again[5][key] == records[5][key], key
