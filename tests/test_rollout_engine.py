"""The paged engine against today's lockstep sampler: same tokens (greedy, forced replays), sampled
log-probs equal to a teacher-forced forward, determinism, prefix sharing, memory accounting and
the sharding of the KV pool on 8 (fake) devices."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.models.paged_cache import LiveBlocks, live_blocks
from turnsight_jax.models.sharding import make_mesh, state_shardings
from turnsight_jax.rl.logprobs import student_logprobs
from turnsight_jax.rollout import engine as E
from turnsight_jax.rollout.driver import ModelPolicy, RolloutConfig, rollout
from turnsight_jax.rollout.sampler import SamplingParams

from conftest import TINY_POLICY

CATEGORIES = ("single_hop", "parallel_single_hop", "multi_hop", "parallel_multi_hop")


def _engine(model, tok, rc, sampling, *, slots=3, block=16, chunk=8, seed=0, scripts=None, mesh=None, state=None):
    graphdef, st = model
    return E.PagedEngine(graphdef, st if state is None else state, tok, sampling=sampling, config=rc,
                         engine=E.EngineConfig(slots=slots, block_size=block, decode_chunk=chunk), seed=seed,
                         mesh=mesh, forced_scripts=scripts)


def _same(a, b, lp_tol=1e-5):
    assert len(a.trajectories) == len(b.trajectories)
    for ta, tb in zip(a.trajectories, b.trajectories):
        np.testing.assert_array_equal(ta.tokens, tb.tokens)
        np.testing.assert_array_equal(ta.policy_mask, tb.policy_mask)
        assert ta.finish_reason == tb.finish_reason and ta.reward == tb.reward
        np.testing.assert_allclose(ta.old_logprobs, tb.old_logprobs, atol=lp_tol)


def test_ten_turn_replay_equals_the_lockstep_sampler(tok, env, model):
    """FTRL-format 10-turn episodes (9 tool turns + answer) forced through the real decode loops:
    more rows than slots (episodes queue), prompts not a multiple of the block size (the shared
    prompt's last block is copied per sibling), observations of varying length."""
    tasks = [generate_task("multi_hop", s, SyntheticConfig(hops=9)) for s in (1, 2)]
    G = 3
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(G)]
    rc = RolloutConfig(max_turns=10, max_prompt_tokens=1024, max_response_tokens=1536, max_turn_tokens=96)
    sampling = SamplingParams(greedy=True)
    graphdef, state = model
    ref = rollout(ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=0, forced_scripts=scripts),
                  env, tasks, tokenizer=tok, group_size=G, config=rc)
    eng = _engine(model, tok, rc, sampling, slots=4, scripts=scripts)
    got = rollout(eng, env, tasks, tokenizer=tok, group_size=G, config=rc)
    _same(ref, got)
    assert all(t.num_turns == 10 and t.reward == pytest.approx(1.0) for t in got.trajectories)
    assert len(tasks[0].messages) and all(len(p) % 16 for p in eng.prompts)  # the partial-block path ran
    # each prompt prefilled once per shard it ran on (one shard): the prompt part is 1/G of G prefills
    assert got.stats["engine/prefill_tokens"] == sum(len(p) for p in eng.prompts)
    # everything released at the end: free lists full, nothing committed
    assert all(len(f) == eng.pool_blocks - 1 for f in eng.free) and eng.committed == [0] * eng.shards


def test_greedy_builtin_tasks_equal_the_lockstep_sampler(tok, env, model):
    """Unforced greedy decoding on the built-in categories: the model's own turns (budget-cut)."""
    tasks = [generate_task(c, 7 + i) for i, c in enumerate(CATEGORIES)]
    rc = RolloutConfig(max_turns=3, max_prompt_tokens=1024, max_response_tokens=120, max_turn_tokens=40)
    sampling = SamplingParams(greedy=True)
    graphdef, state = model
    ref = rollout(ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=0), env, tasks,
                  tokenizer=tok, group_size=2, config=rc)
    got = rollout(_engine(model, tok, rc, sampling, slots=5, chunk=16), env, tasks, tokenizer=tok, group_size=2,
                  config=rc)
    _same(ref, got)


def test_sampled_logprobs_equal_teacher_forced_and_are_deterministic(tok, env, model):
    tasks = [generate_task(c, 20 + i) for i, c in enumerate(CATEGORIES[:2])]
    rc = RolloutConfig(max_turns=2, max_prompt_tokens=1024, max_response_tokens=96, max_turn_tokens=48)
    sampling = SamplingParams(temperature=1.0, top_k=20)
    graphdef, state = model
    a = rollout(_engine(model, tok, rc, sampling, slots=3, chunk=8, seed=5), env, tasks, tokenizer=tok,
                group_size=3, config=rc)
    # another slot count and chunk: the draws are per episode, so the same rollouts
    b = rollout(_engine(model, tok, rc, sampling, slots=6, chunk=16, seed=5), env, tasks, tokenizer=tok,
                group_size=3, config=rc)
    _same(a, b, lp_tol=1e-6)
    c = rollout(_engine(model, tok, rc, sampling, slots=3, chunk=8, seed=6), env, tasks, tokenizer=tok,
                group_size=3, config=rc)
    assert any(not np.array_equal(x.tokens, y.tokens) for x, y in zip(a.trajectories, c.trajectories))
    m = nnx.merge(graphdef, state)
    for t in a.trajectories:
        pos = np.flatnonzero(t.policy_mask)
        toks = jnp.asarray(t.tokens)[None]
        lp = student_logprobs(m, toks, jnp.ones_like(toks, bool), jnp.asarray(pos)[None], chunk=64,
                              temperature=1.0)
        np.testing.assert_allclose(np.asarray(lp)[0], t.old_logprobs[pos], atol=1e-4)


def test_pool_too_small_for_one_group_is_refused(tok, model):
    rc = RolloutConfig(max_turns=2, max_prompt_tokens=1024, max_response_tokens=512, max_turn_tokens=48)
    graphdef, state = model
    eng = E.PagedEngine(graphdef, state, tok, sampling=SamplingParams(), config=rc,
                        engine=E.EngineConfig(slots=4, block_size=16, pool_blocks=40))
    prompt = list(range(300))
    with pytest.raises(ValueError, match=r"holds 39 blocks of 16 slots per shard; one group \(4 live siblings of a "
                                         r"300-token prompt, 512 response tokens each\) needs 19 \+ 4 x 33 = 151"):
        eng.begin([prompt], 4)


def test_blocks_per_episode():
    assert E.blocks_per_episode(32, 16, 16) == (2, 1)  # prompt fills 2 blocks; the response one more
    assert E.blocks_per_episode(33, 16, 16) == (3, 2)  # a partial block: copied, then the response spills
    assert E.default_pool_blocks(2, 33, 16, 16) == 2 * 5 + 1


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (fake) devices; see tests/conftest.py")
def test_pool_is_sharded_and_decode_stays_on_device(tok, env, model):
    """fsdp = 8: each device holds 1/8 of the pool (its rows' blocks); the compiled decode has no
    collective on the pool or on the gathered KV window; results equal one shard's."""
    tasks = [generate_task("multi_hop", s, SyntheticConfig(hops=2)) for s in (1, 2)]
    G = 8
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(G)]
    rc = RolloutConfig(max_turns=4, max_prompt_tokens=1024, max_response_tokens=512, max_turn_tokens=64)
    graphdef, state = model
    mesh = make_mesh(1, -1, 1)
    sharded = jax.device_put(state, state_shardings(state, mesh))
    sampling = SamplingParams(greedy=True)
    eng = _engine(model, tok, rc, sampling, slots=16, block=8, scripts=scripts, mesh=mesh, state=sharded)
    with jax.set_mesh(mesh):
        got = rollout(eng, env, tasks, tokenizer=tok, group_size=G, config=rc)
    shards = eng.kv.k.addressable_shards
    assert len(shards) == 8 and all(s.data.shape[0] == 1 for s in shards)  # 1 of 8 row shards per device
    assert shards[0].data.nbytes * 8 == eng.kv.k.nbytes
    ref = rollout(_engine(model, tok, rc, sampling, slots=16, block=8, scripts=scripts), env, tasks, tokenizer=tok,
                  group_size=G, config=rc)
    _same(ref, got)

    n, steps, size = 16, 4, 24  # 2 rows per shard, 24 listed blocks per shard
    rows = eng._put_rows(np.zeros((n, eng.table_width), np.int32), np.zeros(n, np.int32), np.ones(n, np.int32))
    listed = live_blocks([[0, 1, 2]] * n, n // 8, eng.trash, 8, size)
    live = LiveBlocks(**{k: eng._put(jnp.asarray(v)) for k, v in listed.items()})
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(0), jnp.arange(n))
    with jax.set_mesh(mesh):
        hlo = E._decode.lower(graphdef, eng.state, eng.kv, eng._put(jnp.zeros((n, TINY_POLICY["hidden_size"]))), rows[0], live,
                              *rows[1:], keys, *eng._put_rows(np.zeros(n, np.int32)), eng.stop_ids,
                              *eng._put_rows(np.full((n, steps), -1, np.int32)), steps=steps,
                              params=sampling).compile().as_text()
    collectives = re.findall(r"= (\(?[a-z0-9]+\[[0-9,]*\][^=]*?) (?:all-gather|all-reduce|all-to-all|"
                             r"collective-permute|reduce-scatter)(?:-start)?\(", hlo)
    assert collectives, "expected the FSDP weight gathers"
    for shape in collectives:
        dims = [tuple(int(x) for x in d.split(",") if x) for d in re.findall(r"\[([0-9,]*)\]", shape)]
        for d in dims:
            assert eng.pool_blocks not in d, f"a collective on the KV pool: {shape}"
            assert size not in d and size * 8 not in d, f"a collective on the gathered live blocks: {shape}"


def test_sampled_draws_depend_on_the_episode_only(tok, env, model):
    """Both backends key episode r's n-th draw by fold_in(fold_in(key(seed), r), n): a step's
    episodes rolled out all at once or split in two calls (as two processes split them) sample
    the same tokens. Top-k 20: over all 151,936 tokens a random model's distribution is so flat
    that the last-bit differences between batch shapes move a draw to a neighbouring token id."""
    from turnsight_jax.rl.episodes import run_episodes
    from turnsight_jax.rl.methods import RolloutContext, sampler_rollout

    tasks = [generate_task(c, 40 + i) for i, c in enumerate(CATEGORIES)]
    rc = RolloutConfig(max_turns=2, max_prompt_tokens=1024, max_response_tokens=64, max_turn_tokens=32)
    sampling = SamplingParams(temperature=1.0, top_k=20)
    graphdef, state = model
    G = 2

    def run(part, first, engine=None):
        ctx = RolloutContext(graphdef, state, tok, env, sampling, rc, G, engine=engine, group_offset=first)
        return sampler_rollout(ctx, part, seed=11).trajectories

    eng = E.EngineConfig(slots=3, block_size=16, decode_chunk=8)
    for engine in (None, eng):
        whole = run(tasks, 0, engine)
        split = run(tasks[:1], 0, engine) + run(tasks[1:3], 1, engine) + run(tasks[3:], 3, engine)
        assert sum(int(t.policy_mask.sum()) for t in whole) > 8 * 20  # real sampled turns
        for a, b in zip(whole, split, strict=True):
            assert a.group_id == b.group_id
            np.testing.assert_array_equal(a.tokens, b.tokens)
            np.testing.assert_allclose(a.old_logprobs, b.old_logprobs, atol=1e-6)
        # a controller's own numbering of the episodes (rl.episodes.run_episodes rows=, e.g. BAR's
        # prompt * cap + k): the episodes of rows 2G, 2G+1, 0, 1 in one call, in that order
        ctx = RolloutContext(graphdef, state, tok, env, sampling, rc, 1, engine=engine)
        picked = run_episodes(ctx, [tasks[2], tasks[2], tasks[0], tasks[0]], 11, rows=[2 * G, 2 * G + 1, 0, 1])
        for a, b in zip(picked.trajectories, whole[2 * G:2 * G + 2] + whole[:2], strict=True):
            np.testing.assert_array_equal(a.tokens, b.tokens)
        # siblings (same prompt, other rows) and other groups draw differently
        assert not np.array_equal(whole[0].tokens, whole[1].tokens)


@pytest.mark.parametrize("cap", [64, 0])
def test_last_turn_results_are_recorded_on_both_backends(tok, env, model, cap):
    """Issue 58: an episode that stops at max_turns after a turn whose calls ran records their
    results on that turn, on the paged engine as on the lockstep sampler (the driver does it for
    every backend); no tokens follow the last turn. cap 0: no per-turn cap (the paper configs')."""
    tasks = [generate_task("multi_hop", s, SyntheticConfig(hops=3)) for s in (1, 2)]
    G = 2
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(G)]
    rc = RolloutConfig(max_turns=2, max_prompt_tokens=1024, max_response_tokens=512, max_turn_tokens=cap)
    sampling = SamplingParams(greedy=True)
    graphdef, state = model
    ref = rollout(ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=0, forced_scripts=scripts),
                  env, tasks, tokenizer=tok, group_size=G, config=rc)
    got = rollout(_engine(model, tok, rc, sampling, slots=4, scripts=scripts), env, tasks, tokenizer=tok,
                  group_size=G, config=rc)
    _same(ref, got)
    for a, b in zip(ref.trajectories, got.trajectories, strict=True):
        assert a.num_turns == 2 and a.finish_reason == "max_turns" and len(a.turns[-1].calls) == 1
        assert len(a.turns[-1].results) == 1 and a.turns[-1].results == b.turns[-1].results
        assert not b.turns[-1].has_observation and b.length == b.turns[-1].policy_end
