"""Rollout benchmark: the lockstep sampler (ModelPolicy) vs the paged engine, same workload, same run.

    python benchmarks/rollout.py                      # CPU: 4 prompts x 8 siblings, small model
    python benchmarks/rollout.py --model head         # the head-dominated small model
    python benchmarks/rollout.py --prompts 8 --group 16 --preset qwen3-0.6b --dtype bfloat16   # a device

Workload: built-in multi-hop tasks with 9-hop gold chains. Each sibling follows the gold chain for
k tool turns (k drawn per sibling, 1..9) and then answers, so episodes last 2-10 turns; every turn
starts with a <think> block of lognormal length (median 40 tokens, sigma 0.8, capped by the turn
budget), so turn lengths spread as sampled reasoning does. Tool results come from the real
environment (varying length). The turns are forced through each backend's real decode loop (the
model's log-probs are computed and recorded; the tokens are the script's), so both backends do
identical work token for token and must produce identical trajectories (checked).

Reported per backend: wall time (warm: a first run compiles, the second is timed), decode
tokens/s, prefill tokens computed (real prompt tokens vs G x prompt), KV memory allocated vs the
peak in use, slot occupancy (decoding row-steps / slot-steps), compilations.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine, table  # noqa: E402

from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.envs.ftrl import FTRLEnv  # noqa: E402
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts  # noqa: E402
from turnsight_jax.models.config import Qwen3Config, get_preset  # noqa: E402
from turnsight_jax.models.paged_cache import bytes_per_token  # noqa: E402
from turnsight_jax.models.qwen3 import RuntimeOptions, init_model  # noqa: E402
from turnsight_jax.rollout.driver import ModelPolicy, RolloutConfig, rollout  # noqa: E402
from turnsight_jax.rollout.engine import EngineConfig, PagedEngine  # noqa: E402
from turnsight_jax.rollout.sampler import SamplingParams  # noqa: E402

WORDS = "so the next step is to look up the value then compare it with what the question asks".split()


def scripts_for(tasks, group: int, rng: np.random.Generator, turn_cap: int) -> list[list[str]]:
    out = []
    for task in tasks:
        gold = gold_turn_texts(task)  # tool turns ..., answer
        for _ in range(group):
            k = int(rng.integers(1, len(gold)))  # tool turns before answering
            turns = gold[:k] + [gold[-1]]
            texts = []
            for t in turns:
                n = int(min(np.exp(rng.normal(np.log(40), 0.8)), turn_cap - 60))
                think = " ".join(rng.choice(WORDS, size=n))
                texts.append(f"<think>\n{think}\n</think>\n\n{t}")
            out.append(texts)
    return out


def small_model(kind: str = "kv") -> Qwen3Config:
    """Two small shapes with the real 151,936 vocabulary (the tokenizer's ids).

    "kv": 4 layers, 2 KV heads x 64 (4 KiB of f32 KV per token). Its decode reads about 1.4x as
    many KV bytes as weight bytes per step at this workload's lengths (16 rows x ~1,700 tokens),
    as Qwen3-8B does at the paper's (16 rows per device x ~10k tokens x 144 KiB vs 16 GB of bf16
    weights), so it weighs KV reads and the head as a paper-scale decode does.
    "head": 2 layers, 2 KV heads x 32 (1 KiB per token): the 78 MB output head is ~95% of the
    decode, which the two backends compute alike per row-step; a lower bound on the engine's gain."""
    if kind == "head":
        return Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=32)
    if kind == "kv":
        return Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=384, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=64)
    raise ValueError(f"--model must be 'kv' or 'head', got {kind!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--model", default="kv", help="the small model's shape when no --preset: kv or head "
                    "(small_model's docstring)")
    ap.add_argument("--preset", default="", help="a model preset (default: --model's small 151,936-vocabulary model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--slots", type=int, default=0, help="engine slots (0: every row)")
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--turn-tokens", type=int, default=160)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default="", choices=["", "engine"],
                    help="engine: time the paged engine alone (for iterating on it; no ratio)")
    ap.add_argument("--repeats", type=int, default=1, help="warm runs per backend (the median is reported)")
    args = ap.parse_args()
    dt = jnp.dtype(args.dtype)
    cfg = get_preset(args.preset) if args.preset else small_model(args.model)
    model = init_model(cfg, seed=0, param_dtype=dt, options=RuntimeOptions(compute_dtype=dt))
    graphdef, state = nnx.split(model)
    tok = default_tokenizer()
    rng = np.random.default_rng(args.seed)
    tasks = [generate_task("multi_hop", 100 + i, SyntheticConfig(hops=9)) for i in range(args.prompts)]
    scripts = scripts_for(tasks, args.group, rng, args.turn_tokens)
    rc = RolloutConfig(max_turns=10, max_prompt_tokens=1024, max_response_tokens=3072,
                       max_turn_tokens=args.turn_tokens)
    rows = args.prompts * args.group
    sampling = SamplingParams(greedy=True)
    env = FTRLEnv(num_workers=2, timeout_s=10.0)

    def lockstep():
        return ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=0, cache_dtype=dt,
                           forced_scripts=scripts)

    def paged():
        return PagedEngine(graphdef, state, tok, sampling=sampling, config=rc, seed=0, cache_dtype=dt,
                           engine=EngineConfig(slots=args.slots or rows, block_size=args.block,
                                               decode_chunk=args.chunk), forced_scripts=scripts)

    makers = {"paged engine": paged, "lockstep (ModelPolicy)": lockstep}
    if args.only == "engine":
        makers = {"paged engine": paged}
    firsts, walls, results = {}, {n: [] for n in makers}, {}
    for name, make in makers.items():  # first runs compile
        t0 = time.perf_counter()
        rollout(make(), env, tasks, tokenizer=tok, group_size=args.group, config=rc)
        firsts[name] = time.perf_counter() - t0
        print(f"{name}: first run (compiles) {firsts[name]:.1f} s", flush=True)
    for rep in range(args.repeats):  # warm runs alternate, so machine noise hits both alike
        for name, make in makers.items():
            policy = make()
            t0 = time.perf_counter()
            res = rollout(policy, env, tasks, tokenizer=tok, group_size=args.group, config=rc)
            walls[name].append(time.perf_counter() - t0)
            results[name] = (float(np.median(walls[name])), firsts[name], res, policy)
            print(f"{name}: warm run {rep + 1}: {walls[name][-1]:.1f} s", flush=True)
    env.close()
    if args.only == "engine":
        _, _, b, pb = results["paged engine"]
        print(f"paged engine alone: warm walls {[round(w, 2) for w in walls['paged engine']]} s; "
              f"{int(pb.counters['decode_chunks'])} decode chunks; phases " +
              " / ".join(f"{b.stats.get(k, 0):.1f}" for k in ("decode_s", "append_s", "prefill_s", "tool_s")) + " s")
        return

    (t_b, _, b, pb), (t_a, _, a, pa) = results.values()
    for x, y in zip(a.trajectories, b.trajectories):
        assert np.array_equal(x.tokens, y.tokens), "the backends disagree"
        assert np.allclose(x.old_logprobs, y.old_logprobs, atol=1e-3 if dt == jnp.bfloat16 else 1e-5)
    prompt_lens = [len(p) for p in pb.prompts]
    kvb = bytes_per_token(cfg, dt)
    turns = [t.num_turns for t in b.trajectories]
    decoded = sum(int(t.policy_mask.sum()) for t in b.trajectories)
    st = b.stats
    lock_prefill = pa.cache.k.shape[1]  # rows the lockstep cache holds
    lock_kv = 2 * pa.cache.k.nbytes
    model_name = args.preset or f"small '{args.model}' model ({cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x {cfg.head_dim})"
    print(f"\nmodel: {model_name}, {args.dtype}")
    print(f"workload: {args.prompts} prompts x {args.group} siblings, turns per episode {min(turns)}-{max(turns)} "
          f"(mean {np.mean(turns):.1f}), {decoded} policy tokens, prompts {min(prompt_lens)}-{max(prompt_lens)} "
          f"tokens; {machine()}")
    rows_out = [
        [f"wall (warm, median of {args.repeats})", f"{t_a:.2f} s", f"{t_b:.2f} s", f"{t_a / t_b:.2f}x faster"],
        ["wall (first run, compiles)", f"{firsts['lockstep (ModelPolicy)']:.1f} s", f"{firsts['paged engine']:.1f} s", ""],
        ["decode tokens/s (policy tokens / wall)", f"{decoded / t_a:.0f}", f"{decoded / t_b:.0f}",
         f"{t_a / t_b:.2f}x"],
        ["prompt tokens prefilled (G x prompt = %d)" % (args.group * sum(prompt_lens)),
         f"{sum(prompt_lens)} (+ padding to {a.stats.get('prefill_s', 0) and 'pow2'})",
         f"{int(st['engine/prefill_tokens'])}", f"{st['engine/prefill_tokens'] / (args.group * sum(prompt_lens)):.3f} = 1/G"],
        ["KV allocated", f"{lock_kv / 2**20:.1f} MiB ({lock_prefill} rows x {pa.cache.max_len} slots)",
         f"{st['engine/kv_pool_bytes_per_shard'] / 2**20:.1f} MiB", ""],
        ["KV in use at peak", "= allocated", f"{st['engine/kv_in_use_bytes_peak_per_shard'] / 2**20:.1f} MiB",
         f"{st['engine/kv_in_use_bytes_peak_per_shard'] / st['engine/kv_pool_bytes_per_shard']:.2f} of the pool"],
        ["slot occupancy (decoding row-steps / slot-steps)", "", f"{st['engine/decode_row_steps'] / st['engine/decode_slot_steps']:.2f}", ""],
        ["decode KV blocks read (live / with padding)", "",
         f"{int(st['engine/decode_blocks_listed'])} / {int(st['engine/decode_blocks_computed'])}",
         f"{st['engine/decode_blocks_listed'] / st['engine/decode_blocks_computed']:.2f} live"],
        ["decode row-steps computed", "", f"{int(st['engine/decode_row_steps_computed'])}",
         f"{st['engine/decode_row_steps'] / st['engine/decode_row_steps_computed']:.2f} live"],
        ["compiled programs (cumulative in the process)", f"{int(a.stats.get('compilations', 0))}",
         f"{int(b.stats.get('compilations', 0))}", ""],
        ["phases (decode / append / prefill / tools)",
         " / ".join(f"{a.stats.get(k, 0):.1f}" for k in ("decode_s", "append_s", "prefill_s", "tool_s")),
         " / ".join(f"{b.stats.get(k, 0):.1f}" for k in ("decode_s", "append_s", "prefill_s", "tool_s")), "s"],
    ]
    print(table(rows_out, ["", "lockstep", "paged engine", "ratio"]))
    print(f"KV bytes per token: {kvb}; trajectories identical token for token: yes")


if __name__ == "__main__":
    main()
