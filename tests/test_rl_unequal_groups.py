"""Groups of unequal size in one batch (a rollout controller that forms its own groups: BAR's early
stops, AKBE's exemplars; rl.batch "Rows and groups"): every registered advantage estimator that
uses group statistics gives a group of n rows the same values whether the batch also holds other
groups of other sizes, rows in no group (exemplars) and padding rows, or that group alone; rows in
no group get advantage 0; and estimators without groups (PPO's GAE) are unchanged by padding rows.
The loss side: the RL terms aggregate over the policy tokens of grouped rows only, a term with its
own rows (AKBE's CE) over those alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnsight_jax.methods.akbe import AkbeConfig
from turnsight_jax.rl.advantages import ESTIMATORS, make_advantage_fn
from turnsight_jax.rl.config import AlgoConfig, LossConfig, StepConfig
from turnsight_jax.rl.losses import aggregation_weights, get_loss_term, loss_weights, weighted_losses
from turnsight_jax.rl.methods import REWARDS
from turnsight_jax.rl.step import advantage_knobs

PROP = settings(max_examples=10, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
B, T, K, D = 16, 12, 4, 3  # every batch is padded to B rows, so each estimator compiles once per shape
PER_ROW = {r.output for r in REWARDS.values() if r.per == "trajectory"} | {"num_turns"}
PER_TURN = {r.output for r in REWARDS.values() if r.per == "turn"}
PER_TOKEN = {"values", "process_rewards"}


def _package_estimators():
    """(estimator, base) pairs of the package's registered estimators (a test may register its own):
    those reading group_ids, each wrapping one over GRPO and over MatchTIR; and those without groups."""
    own = {n: e for n, e in ESTIMATORS.items() if e.fn.__module__.startswith("turnsight_jax")}
    grouped, free = [], []
    for name, est in sorted(own.items()):
        if est.wraps_base:
            grouped += [(name, "grpo"), (name, "matchtir")]
        elif "group_ids" in est.inputs:
            grouped.append((name, None))
        else:
            free.append((name, None))
    return grouped, free


GROUPED, GROUP_FREE = _package_estimators()


def _rows(rng, n: int, kind: str) -> dict[str, np.ndarray]:
    """Arrays of n rows: "real" (1..K turns of 1-2 policy tokens with observation gaps), "padding"
    (no policy token, no turn)."""
    turn_ids = np.full((n, T), -1, np.int32)
    num_turns = np.zeros(n, np.int32)
    if kind == "real":
        for i in range(n):
            num_turns[i] = rng.integers(1, K + 1)
            pos = 0
            for k in range(num_turns[i]):
                pos += int(rng.integers(0, 2))
                length = int(rng.integers(1, 3))
                turn_ids[i, pos:pos + length] = k
                pos += length
    pol = turn_ids >= 0
    grid = lambda *shape: (rng.integers(-16, 17, shape) / 8).astype(np.float32)  # noqa: E731  (ties happen)
    out = {"policy_mask": pol, "turn_ids": turn_ids, "num_turns": num_turns,
           "delta": grid(D, n, T), "teacher_covered": pol & (rng.random((n, T)) < 0.7)}
    for name in PER_ROW - {"num_turns"}:
        out[name] = rng.choice(np.float32([0.0, 0.5, 1.0]), n)
    real_turn = np.arange(K)[None] < num_turns[:, None]
    for name in PER_TURN:
        out[name] = np.where(real_turn, rng.choice(np.float32([0.0, 0.5, 1.0]), (n, K)), 0.0).astype(np.float32)
    for name in PER_TOKEN:
        out[name] = np.where(pol, grid(n, T), 0.0).astype(np.float32)
    return out


def _cat(parts):
    return {k: np.concatenate([p[k] for p in parts], axis=1 if k == "delta" else 0) for k in parts[0]}


def _take(arrays, idx):
    return {k: (v[:, idx] if k == "delta" else v[idx]) for k, v in arrays.items()}


@functools.lru_cache(maxsize=None)
def _compiled(name, base, num_groups):
    """The composed estimator, jitted once per (estimator, base, num_groups) and shape."""
    return jax.jit(make_advantage_fn(name, base=base, knobs=advantage_knobs(StepConfig(max_turns=K), num_groups)))


def _advantages(name, base, arrays, group_ids, num_groups):
    """The composed estimator's outputs; every array input from `arrays`."""
    est = ESTIMATORS[name]
    needed = set(est.inputs) | (set(ESTIMATORS[base].inputs) if base else set())
    known = {"group_ids", "base_advantages", "delta", "policy_mask", "turn_ids", "teacher_covered"} | PER_ROW | \
        PER_TURN | PER_TOKEN
    assert needed <= known, f"estimator {name!r} reads {sorted(needed - known)}: teach this test to draw them"
    out = _compiled(name, base, num_groups)({**{k: jnp.asarray(v) for k, v in arrays.items()},
                                             "group_ids": jnp.asarray(group_ids, jnp.int32)})
    # the per-token outputs [rows, N] (advantages, TurnSight's weights and gaps, ...); not the
    # diagnostics (scalars, [D] histograms, [num_groups] statistics)
    return {k: np.asarray(v) for k, v in out.items() if np.ndim(v) == 2}


@st.composite
def layouts(draw):
    """(group sizes, exemplar rows, an order of the B rows): groups of 1 (no spread), 2 or 5 rows
    (three sizes: each estimator compiles once per size alone), up to 2 rows in no group with
    policy tokens, padding for the rest, the rows shuffled."""
    sizes = draw(st.lists(st.sampled_from([1, 2, 5]), min_size=1, max_size=3))
    exemplars = draw(st.integers(0, min(2, B - sum(sizes))))
    order = draw(st.permutations(range(B)))
    return sizes, exemplars, np.asarray(order), draw(st.integers(0, 2**31 - 1))


def _batch(sizes, exemplars, order, seed):
    rng = np.random.default_rng(seed)
    real = sum(sizes) + exemplars
    arrays = _cat([_rows(rng, real, "real"), _rows(rng, B - real, "padding")])
    groups = np.concatenate([np.repeat(np.arange(len(sizes)), sizes), np.full(B - sum(sizes), -1)]).astype(np.int32)
    return _take(arrays, order), groups[order]


@pytest.mark.parametrize("name,base", GROUPED, ids=[f"{n}({b})" if b else n for n, b in GROUPED])
@PROP
@given(layout=layouts())
def test_a_group_gets_the_same_values_in_a_batch_of_unequal_groups_as_alone(name, base, layout):
    sizes, exemplars, order, seed = layout
    arrays, groups = _batch(sizes, exemplars, order, seed)
    together = _advantages(name, base, arrays, groups, num_groups=B)
    for g in range(len(sizes)):
        rows = np.flatnonzero(groups == g)
        alone = _advantages(name, base, _take(arrays, rows), np.zeros(len(rows), np.int32), num_groups=len(rows))
        for key, value in alone.items():
            np.testing.assert_allclose(together[key][rows], value, rtol=1e-5, atol=1e-6, err_msg=f"{key}, group {g}")
    # exemplars and padding: no group advantage (SDPO's advantage form adds its per-token teacher
    # gap c * delta to the base's 0 there; the RL terms do not train those rows either way)
    outside = together["advantages"][groups < 0]
    if name == "sdpo_advantage":
        covered = (arrays["policy_mask"] & arrays["teacher_covered"])[groups < 0]
        outside = outside - np.where(covered, StepConfig().algo.section("sdpo").coef * arrays["delta"][0][groups < 0], 0.0)
    np.testing.assert_array_equal(outside, 0.0)


@pytest.mark.parametrize("name", [n for n, _ in GROUP_FREE])
@PROP
@given(order=st.permutations(range(B)), seed=st.integers(0, 2**31 - 1))
def test_padding_rows_change_no_value_of_an_estimator_without_groups(name, order, seed):
    """GAE whitens over the batch's policy tokens: padding rows (none) change nothing. Ten rows
    in two groups of 4 and 2 exemplars, six padding rows, shuffled."""
    arrays, groups = _batch([4, 4], 2, np.asarray(order), seed)
    real = np.flatnonzero(arrays["policy_mask"].any(axis=1))
    together = _advantages(name, None, arrays, groups, num_groups=B)
    alone = _advantages(name, None, _take(arrays, real), groups[real], num_groups=len(real))
    for key, value in alone.items():
        np.testing.assert_allclose(together[key][real], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_every_package_estimator_is_covered():
    """A new estimator that reads group_ids joins the property above by registering; these are today's."""
    assert {n for n, _ in GROUPED} >= {"grpo", "matchtir", "turnsight", "toolomni", "judge_grpo", "rlsd",
                                       "sdpo_advantage", "base"}
    assert {n for n, _ in GROUP_FREE} == {"gae", "gae_process"}


@pytest.mark.parametrize("how", ["seq_mean_token_mean", "seq_mean_token_sum", "token_mean"])
def test_rl_terms_aggregate_over_grouped_rows_and_a_term_with_rows_over_its_own(how):
    """Rows 0-2 in groups, row 3 an exemplar (no group, flagged), row 4 padding: the clipped
    surrogate's aggregated loss equals the one on rows 0-2 alone; AKBE's CE (rows =
    akbe_exemplar) is λ times the exemplar's mean NLL (its own aggregation), whatever the others."""
    rng = np.random.default_rng(0)
    pol = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], bool)
    lp = jnp.asarray(np.where(pol, -rng.random(pol.shape), 0.0), jnp.float32)
    x = {"logprobs": lp, "old_logprobs": lp - 0.1, "advantages": jnp.asarray(rng.normal(size=pol.shape), jnp.float32),
         "pol_valid": jnp.asarray(pol), "akbe_exemplar": jnp.asarray([0.0, 0.0, 0.0, 1.0, 0.0])}
    groups = jnp.asarray([0, 0, 1, -1, -1])
    terms = (get_loss_term("clipped_surrogate"), get_loss_term("akbe_ce"))
    algo = AlgoConfig(sections=(("akbe", AkbeConfig(coef=0.05)),))
    w = loss_weights(terms, x["pol_valid"], groups, x, how)
    total, sums = weighted_losses(terms, x, w, LossConfig(), algo)
    first = {k: v[:3] for k, v in x.items()}
    pg_alone, pg_sums = weighted_losses(terms[:1], first, {"": aggregation_weights(first["pol_valid"], how)},
                                        LossConfig(), algo)
    np.testing.assert_allclose(sums["pg_loss"], pg_sums["pg_loss"], rtol=1e-6)
    nll = -np.asarray(lp)[3]
    ce = {"seq_mean_token_mean": nll.mean(), "seq_mean_token_sum": nll.sum(), "token_mean": nll.mean()}[how]
    np.testing.assert_allclose(sums["akbe_ce"], ce, rtol=1e-6)
    np.testing.assert_allclose(total, pg_alone + 0.05 * ce, rtol=1e-6)
    # the gradient of the CE reaches the exemplar's tokens only; the surrogate's never reaches it
    grad = jax.grad(lambda l: weighted_losses(terms, {**x, "logprobs": l}, w, LossConfig(), algo)[0])(lp)
    np.testing.assert_array_equal(np.asarray(grad)[4], 0.0)
    expected_row3 = {"seq_mean_token_mean": -0.05 / 4, "seq_mean_token_sum": -0.05, "token_mean": -0.05 / 4}[how]
    np.testing.assert_allclose(np.asarray(grad)[3], expected_row3, rtol=1e-6)
