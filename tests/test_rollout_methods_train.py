"""T2PO and APPO, the engine-level rollout controllers (docs/rollout_methods.md), train from their
tiny configs (configs/methods/{t2po,appo}.py) through `python -m turnsight_jax.train` on the
built-in tasks, 3 RL steps each from the shared warm-start (tests/_train_runs.py), once under
GRPO and once under TurnSight over GRPO (`rl.rollout` composes the controller with either), each
controller's mechanism showing in the logged metrics (issue 24, acceptance 3). Rollouts are kept
short (2 turns of at most 24 tokens) for CI time."""

from __future__ import annotations

import math
import shutil

import pytest

from _train_runs import train

SHORT = ["--config.rollout.max_turns=2", "--config.rollout.max_turn_tokens=24",
         "--config.rollout.max_response_tokens=96"]
TURNSIGHT = ["--config.rl.method=turnsight", "--config.rl.base=grpo"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("rollout_methods")


def _common(records):
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["train/skipped_updates"] == 0.0 and math.isfinite(r["train/pg_loss"]) for r in records)


def test_t2po_trains_under_grpo_and_turnsight(root, warm_start):
    """TTI forces </think> in both runs and TDS samples turns again; the tokens they threw away (a
    cut chunk's tail, a re-sampled turn) are counted; TurnSight's weights run over GRPO's
    advantage. (The warm-start was trained without thinking: in thinking mode it solves none of
    the tasks, so the advantages are 0 here; the test is of the mechanism and its composition.)
    TDS needs a second turn to compare with the first; whether TTI's forced </think> leaves one
    depends on the warm-start's rounding (on one CPU the policy then answers at once, every episode
    one turn), so TDS is also run with TTI off, where every episode gets its second turn."""
    for extra, expect in (([], "grpo"), (TURNSIGHT, "turnsight"), (["--config.t2po.tti=False"], "tds")):
        records = train("t2po", root / f"t2po_{expect}", warm_start, *SHORT, *extra)
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
    a run resumed from its step-2 checkpoint (the previous policy restored with it) repeats step 3."""
    for extra, expect in ((["--config.checkpoint.every=1"], "grpo"), (TURNSIGHT, "turnsight")):
        records = train("appo", root / f"appo_{expect}", warm_start, *SHORT, "--config.train.group_size=2", *extra)
        _common(records)
        for r in records:
            assert r["appo/branches"] == 4 and r["appo/rollouts"] == 4 and r["rollout/groups"] == 4
            assert r["appo/shared_prefix_tokens"] > 0 and r["appo/branch_tokens"] > 0
            assert r["appo/replay_mismatches"] == 0
            assert r["rollout/prefill_tokens"] < r["appo/shared_prefix_tokens"]
        # the first step has no earlier policy (rho = 1); then the policy has moved
        assert records[0]["appo/omega_log_sq_mean"] == 0 and records[0]["appo/amplify_max"] == 1
        assert all(r["appo/omega_log_sq_mean"] > 0 and math.isfinite(r["appo/omega_log_mean"]) for r in records[1:])
        assert any(r["appo/amplify_max"] > 1 > r["appo/amplify_min"] for r in records[1:])
        assert any(r["train/adv_abs_mean"] > 0.1 for r in records)
        if expect == "turnsight":
            assert all("turnsight/weight_max" in r for r in records)
        if expect == "grpo":  # resumed from step 2: the checkpointed previous policy gives step 3 the same Omega
            resumed = root / "appo_resumed"
            shutil.copytree(root / "appo_grpo", resumed)
            shutil.rmtree(resumed / "checkpoints" / "3")
            again = train("appo", resumed, warm_start, *SHORT, "--config.train.group_size=2", *extra)
            for key in ("appo/omega_log_mean", "appo/omega_log_sq_mean", "appo/branch_score_mean", "train/grad_norm"):
                assert again[2][key] == records[2][key], key
