"""MM-GRPO's rollout controller (methods.mm_grpo, rl.rollout=mm_grpo): the observation window's elisions
and contexts, dynamic sampling's drops and refills on scripted rollouts (hand-computed), refill
draws that depend on the refill index only, the window's exactness (the sampler's log-probs equal
a teacher-forced forward of each turn under its own context, and the trainer's student forward
equals the sampler), and a window of max_turns or more being the plain path bit for bit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections as mlc
import numpy as np
import pytest
from flax import nnx

from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.trajectory import turn_context
from turnsight_jax.config import base_config, default_config, step_config, validate
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.batch import DEFAULT_BUCKETS, make_train_batch, worst_case_geometry
from turnsight_jax.rl.context_rows import context_row
from turnsight_jax.rl.logprobs import policy_logprobs, student_logprobs
from turnsight_jax.rl.views import pick_bucket
from turnsight_jax.rl.methods import ROLLOUTS, RolloutContext, resolve_method, sampler_rollout
from turnsight_jax.methods.mm_grpo import MMGRPOSettings, dynamic_rollout, refill_stream
from turnsight_jax.rollout import engine as E
from turnsight_jax.rollout.driver import (ModelPolicy, ObservationWindow, ReplayPolicy, RolloutConfig,
                                          placeholder_suffix, rollout)
from turnsight_jax.rollout.sampler import SamplingParams

from _replayed import WRONG_CALL

PLACEHOLDER = "[earlier tool output omitted]"


def _window(tok, size):
    return ObservationWindow(size, placeholder_suffix(tok, PLACEHOLDER, enable_thinking=False))


def _three_hop(seeds=(1, 2)):
    return [generate_task("multi_hop", s, SyntheticConfig(hops=3)) for s in seeds]


def test_window_elides_the_older_observations_as_hand_computed(tok, env):
    """Gold 3-hop chains (3 tool turns, then the answer): a window of 1 elides observation 0 from
    turn 2's context and observations 0, 1 from turn 3's; a window of 2 only observation 0 from
    turn 3's. The contexts, the re-prefilled tokens and the rows are as written out here."""
    tasks = _three_hop()
    rc = RolloutConfig(max_turns=5, max_response_tokens=1024)
    scripts = [gold_turn_texts(t) for t in tasks]
    placeholder = list(_window(tok, 1).placeholder_ids)
    assert tok.decode(placeholder) == ("\n<|im_start|>user\n<tool_response>\n" + PLACEHOLDER +
                                       "\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    res = {n: rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=1, config=rc,
                      window=_window(tok, n)) for n in (1, 2, 4)}
    for n, counts in ((1, (0, 0, 1, 2)), (2, (0, 0, 0, 1))):
        assert [t.contexts.counts for t in res[n].trajectories] == [counts, counts]
        assert all(t.reward == pytest.approx(1.0) for t in res[n].trajectories)
    assert all(t.contexts is None for t in res[4].trajectories)  # the window never fills: the plain path
    assert "elided_observations" not in rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=1,
                                                config=rc).stats
    # the trajectory itself is what happened, whatever the window
    for a, b in zip(res[1].trajectories, res[4].trajectories):
        np.testing.assert_array_equal(a.tokens, b.tokens)
    t = res[1].trajectories[0]
    X, (t0, t1, t2, t3) = t.tokens, t.turns
    seg = lambda a, b: [int(x) for x in X[a:b]]  # noqa: E731
    # turn 2 saw observation 0 as the placeholder, observation 1 in full; turn 3 saw 0 and 1 elided
    assert turn_context(t, 2)[0].tolist() == seg(0, t0.obs_start) + placeholder + seg(t0.obs_end, t2.policy_start)
    assert turn_context(t, 3)[0].tolist() == (seg(0, t0.obs_start) + placeholder + seg(t1.policy_start, t1.obs_start)
                                              + placeholder + seg(t1.obs_end, t3.policy_start))
    ctx, header = turn_context(t, 3)
    assert ctx[header:].tolist() == seg(t3.header_start, t3.policy_start)  # the same assistant header
    assert turn_context(t, 1)[0].tolist() == seg(0, t1.policy_start)
    # two elisions per trajectory; each re-prefilled the placeholder and the turn after the elided
    # observation (then the new observation, which the plain path appends too)
    stats = res[1].stats
    assert stats["elided_observations"] == 4
    assert stats["reprefill_tokens"] == sum(2 * len(placeholder) + x.turns[1].num_policy_tokens
                                            + x.turns[2].num_policy_tokens for x in res[1].trajectories)
    assert res[2].stats["elided_observations"] == 2 and t.metrics["elided_observations"] == 2.0
    # the row: segment 0 = turn 3's context + turn 3 (turn 0 scored there too); turn 1 under its
    # full context from observation 0 on, turn 2 from observation 1 on, each reading segment 0
    # up to where that observation's placeholder starts
    row = context_row(t)
    seg0 = turn_context(t, 3)[0].tolist() + seg(t3.policy_start, t3.policy_end)
    s1 = seg(t0.obs_start, t1.policy_end)
    s2 = seg(t1.obs_start, t2.policy_end)
    assert row.tokens.tolist() == seg0 + s1 + s2
    assert row.segment_ids.tolist() == [0] * len(seg0) + [1] * len(s1) + [2] * len(s2)
    p0, p1 = t0.obs_start, t0.obs_start + len(placeholder) + (t1.obs_start - t1.policy_start)
    assert row.ctx1_end.tolist() == [0] * len(seg0) + [p0] * len(s1) + [p1] * len(s2)
    assert row.positions.tolist() == (list(range(len(seg0))) + list(range(p0, p0 + len(s1)))
                                      + list(range(p1, p1 + len(s2))))
    pol = np.flatnonzero(t.policy_mask)
    assert row.index[pol].tolist() == (list(range(t0.policy_start, t0.policy_end))
                                       + list(range(len(seg0) + len(s1) - t1.num_policy_tokens, len(seg0) + len(s1)))
                                       + list(range(row.length - t2.num_policy_tokens, row.length))
                                       + list(range(len(seg0) - t3.num_policy_tokens, len(seg0))))
    assert (row.tokens[row.index[pol]] == X[pol]).all()


# ---- dynamic sampling on scripted rewards ----

G = 2
KINDS = {"ones": lambda gold: [gold, gold], "zeros": lambda gold: [WRONG_CALL, WRONG_CALL],
         "mixed": lambda gold: [gold, WRONG_CALL]}


def _scripted_sample(tok, env, kind_of):
    """A sampler whose group of task t replays KINDS[kind_of[t.task_id]]: reward 1 for a gold
    chain, 0 for the wrong call; rows numbered from ctx.group_offset as the real sampler's."""
    calls = []

    def sample(ctx, tasks, seed, window):
        calls.append((ctx.group_offset, [t.task_id for t in tasks]))
        scripts = [s for t in tasks for s in KINDS[kind_of[t.task_id]](gold_turn_texts(t))]
        return rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=G, config=ctx.config,
                       seed=seed, group_offset=ctx.group_offset, window=window)

    return sample, calls


def test_dynamic_sampling_drops_and_refills_as_hand_computed(tok, env):
    """Slots [all solved, mixed, all failed] with 2 refill rounds: round 1 drops slots 0 and 2 and
    refills them with refill draws 0 (mixed: kept) and 1 (all failed); round 2 drops slot 2 again,
    refill 2 is all solved, and the cap keeps it (zero variance). Refill j is the task at
    position j of the step's stream, its rows those of group prompts + j."""
    hop2 = SyntheticConfig(hops=2)
    step = [generate_task("multi_hop", s, hop2) for s in (40, 41, 42)]
    pool = [generate_task("multi_hop", s, hop2) for s in range(100, 106)]
    seed = 7
    stream = refill_stream(seed, len(pool))
    assert stream.tolist() == refill_stream(seed, len(pool)).tolist() and sorted(stream.tolist()) == list(range(6))
    assert stream.tolist() != refill_stream(seed + 1, len(pool)).tolist()  # a step's own stream
    refill = [pool[int(i)] for i in stream]
    kind_of = {step[0].task_id: "ones", step[1].task_id: "mixed", step[2].task_id: "zeros",
               refill[0].task_id: "mixed", refill[1].task_id: "zeros", refill[2].task_id: "ones",
               refill[3].task_id: "mixed", refill[4].task_id: "mixed", refill[5].task_id: "mixed"}
    sample, calls = _scripted_sample(tok, env, kind_of)
    rc = RolloutConfig(max_turns=4, max_response_tokens=1024)
    ctx = RolloutContext(None, None, tok, env, SamplingParams(), rc, G, task_pool=pool)
    res = dynamic_rollout(ctx, step, seed, sample=sample, settings=MMGRPOSettings(window=1, refill_rounds=2))
    assert calls == [(0, [t.task_id for t in step]), (3, [refill[0].task_id, refill[1].task_id]),
                     (5, [refill[2].task_id])]
    assert [t.task_id for t in res.tasks] == [refill[0].task_id, step[1].task_id, refill[2].task_id]
    assert [t.group_id for t in res.trajectories] == [3, 3, 1, 1, 5, 5]
    assert [t.reward for t in res.trajectories] == pytest.approx([1, 0, 1, 0, 1, 1])
    # every gold 2-hop chain (3 turns) had observation 0 elided from its last turn's context: 7
    # gold trajectories sampled (2 + 1 + 0, then 1 + 0, then 2), 5 of them in the batch
    gold_sampled = 2 + 1 + 1 + 2
    placeholder = _window(tok, 1).placeholder_ids
    turn1 = lambda t: len(tok_lib.encode(tok, gold_turn_texts(t)[1])) + 1  # noqa: E731  (its <|im_end|> too)
    assert res.metrics == {
        "mm_grpo/dropped_groups": 3.0, "mm_grpo/refill_rounds": 2.0, "mm_grpo/extra_rollouts": 6.0,
        "mm_grpo/zero_variance_kept": 1.0, "mm_grpo/elided_observations": float(gold_sampled),
        "mm_grpo/reprefill_tokens": float(gold_sampled * len(placeholder) + 2 * turn1(step[0]) + turn1(step[1])
                                          + turn1(refill[0]) + 2 * turn1(refill[2]))}
    assert sum(t.contexts is not None for t in res.trajectories) == 4
    # nothing to drop: one round, the plain sampler's groups
    calls.clear()
    flat_free = dynamic_rollout(ctx, [step[1]], seed, sample=sample, settings=MMGRPOSettings(refill_rounds=2))
    assert len(calls) == 1 and flat_free.metrics["mm_grpo/dropped_groups"] == 0.0
    # refill_rounds=0: dynamic sampling off, the zero-variance groups stay
    off = dynamic_rollout(ctx, step, seed, sample=sample, settings=MMGRPOSettings(refill_rounds=0))
    assert [t.task_id for t in off.tasks] == [t.task_id for t in step]
    assert off.metrics["mm_grpo/zero_variance_kept"] == 2.0 and off.metrics["mm_grpo/extra_rollouts"] == 0.0
    with pytest.raises(ValueError, match="task_pool"):
        dynamic_rollout(dataclasses.replace(ctx, task_pool=()), step, seed, sample=sample, settings=MMGRPOSettings())


def _run_config(**mm) -> mlc.ConfigDict:
    cfg = base_config()
    for k, v in mm.items():
        cfg.mm_grpo[k] = v
    return cfg


def test_refill_draws_depend_on_the_refill_index_only(tok, env, model):
    """A random model solves nothing: every group is dropped and refilled. The refills' rollouts
    are the sampler's for the refill tasks at group index prompts + j, whatever the chunking."""
    graphdef, state = model
    pool = [generate_task("single_hop", s) for s in range(200, 205)]
    step = [generate_task("single_hop", s) for s in (300, 301)]
    rc = RolloutConfig(max_turns=2, max_prompt_tokens=1024, max_response_tokens=32, max_turn_tokens=8)
    ctx = RolloutContext(graphdef, state, tok, env, SamplingParams(temperature=1.0, top_k=20), rc, G,
                         cache_dtype=jnp.float32, run_config=_run_config(refill_rounds=1, window=1), task_pool=pool)
    seed = 11
    res = ROLLOUTS["mm_grpo"].fn(ctx, step, seed)
    assert res.metrics["mm_grpo/dropped_groups"] == 2.0 and res.metrics["mm_grpo/refill_rounds"] == 1.0
    stream = refill_stream(seed, len(pool))
    refills = [pool[int(i)] for i in stream[:2]]
    assert [t.task_id for t in res.tasks] == [t.task_id for t in refills]
    direct = sampler_rollout(dataclasses.replace(ctx, group_offset=2), refills, seed, window=_window(tok, 1))
    for a, b in zip(res.trajectories, direct.trajectories):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.old_logprobs, b.old_logprobs)
    assert len({t.tokens.tobytes() for t in res.trajectories}) > 1  # the draws differ between rows


# one geometry for every engine run of this file, tests/test_rollout_engine.py's 10-turn replay's
# (the same compiled programs, from the session's compilation cache): the pool's size is its
# default there, fixed here, so a window's slack changes no shape
RC = RolloutConfig(max_turns=10, max_prompt_tokens=1024, max_response_tokens=1536, max_turn_tokens=96)
ENGINE = E.EngineConfig(slots=4, block_size=16, decode_chunk=8,
                        pool_blocks=E.default_pool_blocks(4, 1024, 1536, 16))
SAMPLING = SamplingParams(greedy=True)  # forced turns: the log-probs are the model's at temperature 1


def _paged(model, tok, scripts, window=None, seed=0):
    graphdef, state = model
    return E.PagedEngine(graphdef, state, tok, sampling=SAMPLING, config=RC, engine=ENGINE, forced_scripts=scripts,
                         seed=seed, context_slack=0 if window is None else window.slack(RC.max_turns))


@pytest.fixture(scope="module")
def windowed(tok, env, model):
    """Gold 3-hop chains forced through both engines' decode loops under a window of 1."""
    graphdef, state = model
    tasks = _three_hop()
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(G)]
    window = _window(tok, 1)
    lockstep = ModelPolicy(graphdef, state, tok, sampling=SAMPLING, config=RC, forced_scripts=scripts,
                           context_slack=window.slack(RC.max_turns))
    return tasks, {name: rollout(policy, env, tasks, tokenizer=tok, group_size=G, config=RC, window=window)
                   for name, policy in (("lockstep", lockstep), ("paged", _paged(model, tok, scripts, window)))}


def test_sampled_logprobs_equal_each_turn_under_its_own_context(model, windowed):
    """Both engines re-prefill after an elision: each turn's recorded log-probs equal a
    teacher-forced forward of that turn under its windowed context (and not under the
    trajectory's own prefix, which holds the elided observations)."""
    graphdef, state = model
    m = nnx.merge(graphdef, state)
    _, runs = windowed
    cases = []  # (engine, turn, own context?, sequence, its policy tokens, their recorded log-probs)
    for name, res in runs.items():
        assert res.stats["elided_observations"] == 2 * 4, name
        for t in res.trajectories:
            assert t.contexts.counts == (0, 0, 1, 2)
            for k, turn in enumerate(t.turns):
                policy = t.tokens[turn.policy_start:turn.policy_end]
                for own, ctx in ((True, turn_context(t, k)[0]), (False, t.tokens[:turn.policy_start]))[:1 + (k >= 2)]:
                    cases.append((name, k, own, np.concatenate([ctx, policy]), policy.size,
                                  t.old_logprobs[turn.policy_start:turn.policy_end]))
    width, most = -(-max(c[3].size for c in cases) // 64) * 64, 32  # every sequence in one padded batch
    x = np.zeros((len(cases), width), np.int32)
    mask = np.zeros((len(cases), width), bool)
    pos = np.zeros((len(cases), most), np.int32)
    for i, (*_, seq, n, _) in enumerate(cases):
        x[i, :seq.size], mask[i, :seq.size] = seq, True
        pos[i, :n] = np.arange(seq.size - n, seq.size)
    lp = np.asarray(student_logprobs(m, jnp.asarray(x), jnp.asarray(mask), jnp.asarray(pos), chunk=256))
    gaps = [(name, k, own, np.abs(lp[i, :n] - old).max()) for i, (name, k, own, _, n, old) in enumerate(cases)]
    for name in runs:
        assert max(g for e, _, own, g in gaps if e == name and own) < 1e-4, name
        assert min(g for e, k, own, g in gaps if e == name and not own and k >= 2) > 1e-4, name  # the window mattered


@pytest.mark.parametrize("layout", ["plain", "packed", "classes"])
def test_the_student_forward_scores_each_turn_as_the_sampler(tok, model, windowed, layout):
    """The trainer's student forward on the batch (rl.context_rows rows; packed several per row;
    in length classes) gives the sampler's log-probs, turn by turn; observations masked out of the
    student's context, the trajectory itself is its row."""
    graphdef, state = model
    m = nnx.merge(graphdef, state)
    tasks, runs = windowed
    trajs = runs["paged"].trajectories
    cfg = base_config()
    cfg.rl.method, cfg.rl.base, cfg.rollout.max_turns = "grpo", "grpo", 10
    cfg.train.prompts_per_step, cfg.train.group_size = 2, G
    cfg.train.pack_rows, cfg.train.length_classes = layout == "packed", 2 if layout == "classes" else 1
    sc = step_config(cfg)
    row_tasks = [t for t in tasks for _ in range(G)]
    batch, stats = make_train_batch(trajs, row_tasks, tok, sc, resolve_method(sc))
    assert batch.layout is not None and stats["context_segments"] == 2 * len(trajs)
    lp = np.asarray(policy_logprobs(m, batch, chunk=64))
    valid = np.asarray(batch.pol_valid)
    assert np.abs(np.where(valid, lp - np.asarray(batch.old_logprobs), 0)).max() < 1e-4
    if layout == "plain":  # the released code's masked context reads no observation: plain rows
        sc2 = dataclasses.replace(sc, algo=dataclasses.replace(sc.algo, student_sees_observations=False))
        masked, _ = make_train_batch(trajs, row_tasks, tok, sc2, resolve_method(sc2))
        assert masked.layout is None and masked.tokens.shape[1] <= batch.tokens.shape[1]


def test_a_window_of_max_turns_is_the_plain_path(tok, env, model):
    """mm_grpo.window >= max_turns (and no refills): the sampler's rollouts and batch, bit for bit."""
    graphdef, state = model
    tasks = _three_hop((5, 6))
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(G)]
    ctx = RolloutContext(graphdef, state, tok, env, SAMPLING, RC, G, run_config=_run_config(window=10, refill_rounds=0))

    def sample(c, t, s, w):
        assert w is not None and w.slack(RC.max_turns) == 0
        return rollout(_paged(model, tok, scripts, w, seed=s), env, t, tokenizer=tok, group_size=G, config=RC, seed=s,
                       window=w)

    got = dynamic_rollout(ctx, tasks, 3, sample=sample)
    ref = rollout(_paged(model, tok, scripts, seed=3), env, tasks, tokenizer=tok, group_size=G, config=RC, seed=3)
    assert got.metrics["mm_grpo/elided_observations"] == 0.0 and got.metrics["mm_grpo/reprefill_tokens"] == 0.0
    cfg = base_config()
    cfg.rl.method, cfg.rl.base, cfg.rollout.max_turns = "turnsight", "grpo", 10
    cfg.train.prompts_per_step, cfg.train.group_size = 2, G
    sc = step_config(cfg)
    row_tasks = [t for t in tasks for _ in range(G)]
    a, _ = make_train_batch(got.trajectories, row_tasks, tok, sc, resolve_method(sc))
    b, _ = make_train_batch(ref.trajectories, row_tasks, tok, sc, resolve_method(sc))
    for x, y in zip(got.trajectories, ref.trajectories):
        assert x.contexts is None and x.num_turns == 4
        np.testing.assert_array_equal(x.tokens, y.tokens)
        assert x.old_logprobs.tobytes() == y.old_logprobs.tobytes()
    assert a.layout is None and a.views is not None
    leaves_a, leaves_b = (jax.tree_util.tree_leaves_with_path(x) for x in (a, b))
    assert len(leaves_a) == len(leaves_b)
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), jax.tree_util.keystr(path)


def test_config_keys_and_methods_the_window_cannot_serve():
    cfg = default_config()
    cfg.rl.method, cfg.rl.rollout, cfg.data.num_eval = "grpo", "mm_grpo", 0
    sc, method = validate(cfg, check_data=False)
    assert method.rollout.name == "mm_grpo" and method.advantage.name == "grpo"
    assert cfg.loss.clip_eps_high > cfg.loss.clip_eps
    bad = cfg.copy_and_resolve_references()
    bad.mm_grpo.window = -1
    with pytest.raises(ConfigError, match=r"mm_grpo.window must be an int >= 0, got -1"):
        validate(bad, check_data=False)
    bad = cfg.copy_and_resolve_references()
    bad.mm_grpo.placeholder = " "
    with pytest.raises(ConfigError, match=r"mm_grpo.placeholder must be a non-empty string"):
        validate(bad, check_data=False)
    sdpo = cfg.copy_and_resolve_references()
    sdpo.rl.method = "sdpo"
    with pytest.raises(ConfigError, match=r"rl.rollout=mm_grpo with mm_grpo.window=1: rl.method='sdpo' reads its "
                                          r"privileged teacher views"):
        validate(sdpo, check_data=False)
    sdpo.mm_grpo.window = 0  # no window: every turn saw the trajectory itself
    validate(sdpo, check_data=False)
    ts = cfg.copy_and_resolve_references()
    ts.rl.method, ts.rl.base = "turnsight", "grpo"
    assert validate(ts, check_data=False)[1].rollout.name == "mm_grpo"
    # the dry-run plan: rows hold each response token at most twice (window 1) plus segment 0's
    # placeholders (max_turns - 2 of them, each at most its rendered text's bytes)
    text = ("\n<|im_start|>user\n<tool_response>\n" + PLACEHOLDER + "\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    r = cfg.rollout
    assert (r.max_prompt_tokens, r.max_response_tokens, r.max_turns, r.enable_thinking) == (1024, 256, 4, False)
    plain = cfg.copy_and_resolve_references()
    plain.mm_grpo.window = 0
    length = lambda c: worst_case_geometry(c, *validate(c, check_data=False)[::-1], 1).length  # noqa: E731
    assert length(plain) == pick_bucket(1024 + 256, DEFAULT_BUCKETS, "")
    assert length(cfg) == pick_bucket(1024 + 2 * 256 + 2 * len(text.encode()), DEFAULT_BUCKETS, "") > length(plain)
