"""MM-GRPO (configs/methods/mm_grpo.py: rl.method=grpo, rl.rollout=mm_grpo) trains 3 steps through
`python -m turnsight_jax.train` on the built-in tasks from the shared warm-start
(tests/_train_runs.py): one run, 3 steps with GRPO and then 3 with TurnSight over GRPO as the
method (the two-stage switch, `rl.switch_step`), each stage's assertions on its own steps; in both,
groups are dropped and refilled, observations are elided from later turns' contexts, and the
trainer's student forward scores every turn as the sampler did. Groups of 2 (2 prompts x 2 per
step): the warm-start solves some tasks, and a group of 2 often agrees, so groups get dropped."""

from __future__ import annotations

import pytest

from _train_runs import any_of as _any
from _train_runs import train


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("mm_grpo")


G = ("--config.train.group_size=2",)


@pytest.fixture(scope="module")
def stages(root, warm_start):
    records = train("mm_grpo", root / "run", warm_start, *G, "--config.train.steps=6", "--config.rl.switch_step=3",
                    "--config.rl.switch_method=turnsight", "--config.rl.base=grpo")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert [r["rl/stage"] for r in records] == [1.0] * 3 + [2.0] * 3
    return records[:3], records[3:]


@pytest.fixture(scope="module")
def grpo(stages):
    return stages[0]


@pytest.fixture(scope="module")
def turnsight(stages):
    return stages[1]


def _check_mechanism(records):
    assert all(r["train/skipped_updates"] == 0.0 for r in records)
    # dynamic sampling: zero-variance groups dropped and refilled (2 rollouts each)
    assert _any(records, "mm_grpo/dropped_groups", lambda v: v > 0)
    assert all(r["mm_grpo/extra_rollouts"] == 2 * r["mm_grpo/dropped_groups"] for r in records)
    assert all(r["mm_grpo/refill_rounds"] <= 2 for r in records)
    # the window (1 observation): 2-hop chains elide their first tool response from the third turn's
    # context, and the context after it is re-prefilled
    assert _any(records, "mm_grpo/elided_observations", lambda v: v > 0)
    assert _any(records, "mm_grpo/reprefill_tokens", lambda v: v > 0)
    # the student's forward on the windowed rows gives the sampler's log-probs (one update per
    # step: the step compares them on every policy token)
    assert all(r["tis/logprob_diff_max_abs"] < 1e-3 for r in records)
    assert _any(records, "train/adv_abs_mean", lambda v: v > 0)


def test_mm_grpo_over_grpo_trains(grpo):
    _check_mechanism(grpo)


def test_mm_grpo_with_turnsight_trains(turnsight):
    _check_mechanism(turnsight)
    # the teacher's hindsight views, built on each turn's windowed context, weight the advantage
    assert all(r["perf/view_overhead"] > 1.0 for r in turnsight)
    assert _any(turnsight, "turnsight/weight_max", lambda v: v > 1.0)
