"""Sampler benchmark: KV-cached decode vs transformers `generate`, and a 10-turn rollout.

    python benchmarks/sampler.py                  # CPU: bench-100m, 16 x 256 new tokens + rollout
    python benchmarks/sampler.py --repeats 3 --rollout-tasks 4   # the recorded run (16 rollout rows)
    python benchmarks/sampler.py --no-rollout     # only the decode comparison
    python benchmarks/sampler.py --device-check   # H200: qwen3-0.6b bf16, batch 64, HBM-bound share
    python benchmarks/sampler.py --prefill        # long-prompt prefill: chunk groups bounded vs all keys

1. Decode: a random ~100M-parameter Qwen3 (real 151,936 vocabulary), saved with
   `save_pretrained` so that JAX and torch run the same weights; 16 sequences of a 64-token
   prompt, 256 greedy new tokens each (ours: stop ids that never occur and a budget of 256;
   transformers: `min_new_tokens = max_new_tokens = 256`, KV cache on). Both timings include
   the prefill; compilation (ours) and first-call overhead (torch) are excluded by a warm-up
   call and reported separately. tokens/s = 16 * 256 / median time.
2. Rollout: 10-turn multi-hop synthetic tasks (SyntheticConfig(hops=9): 9 tool turns + the
   answer) through `ModelPolicy` with the gold turn texts forced through the real decode loop,
   FTRLEnv with 2 workers. The first rollout compiles; the second (same shapes) is warm. Wall time
   is split into decode / append / prefill / tools / compile / other (compile measured with JAX's
   compile-time monitoring events and charged to the phase it happened in).
3. Prefill (`--prefill`): 4 prompts of 5,120 tokens (FTRL's tool blocks are 4-6k tokens) into an
   empty cache, as `ModelPolicy.begin` does: `from_empty=True` (query-chunk groups score only the
   keys up to their own end) against every chunk scoring all keys, same compiled shapes otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine, table, time_fn  # noqa: E402

from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.qwen3 import KVCache, RuntimeOptions, init_model  # noqa: E402
from turnsight_jax.rollout.sampler import SamplingParams, append_tokens, decode_turn  # noqa: E402

# ---- compile-time accounting (JAX monitoring events) ----
_COMPILE_S = [0.0]
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


def _on_duration(event, duration, **_):
    if event in _COMPILE_EVENTS:
        _COMPILE_S[0] += duration


jax.monitoring.register_event_duration_secs_listener(_on_duration)


def load() -> str:
    return "%.1f" % os.getloadavg()[0]


# ---------------------------------------------------------------------------------------------
# 1. decode: ours vs transformers generate
# ---------------------------------------------------------------------------------------------
def make_decode(gd, st, cfg, batch, prompt_len, new_tokens, cache_dtype, max_len=None):
    """A function running prefill + one decode turn of `new_tokens` for `batch` rows; returns
    the tokens [batch, new_tokens]. Allocates a fresh cache per call (the sampler donates it)."""
    max_len = max_len or prompt_len + new_tokens
    params = SamplingParams(greedy=True)
    stop_ids = jnp.array([-1], jnp.int32)  # never sampled: every row decodes its full budget
    active = jnp.ones((batch,), bool)
    budget = jnp.full((batch,), new_tokens, jnp.int32)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    key = jax.random.key(0)

    def run(prompt):
        cache = KVCache.zeros(cfg, batch, max_len, cache_dtype)
        hidden = jnp.zeros((batch, cfg.hidden_size), cache_dtype)
        cache, hidden = append_tokens(gd, st, prompt, lens, cache, hidden)
        out, cache, hidden, _ = decode_turn(gd, st, cache, hidden, key, new_tokens, params, stop_ids, active, budget)
        return out.tokens

    return run


def decode_comparison(args, rows):
    from turnsight_jax.models.weights import load_pretrained, save_pretrained

    cfg = get_preset(args.preset)
    b, p, n = args.batch, args.prompt_len, args.new_tokens
    print(f"decode: {args.preset} ({cfg.num_params() / 1e6:.0f}M parameters), batch {b}, prompt {p}, "
          f"{n} new tokens, greedy, f32")
    prompt_np = np.random.default_rng(0).integers(0, 151_000, (b, p)).astype(np.int32)
    prompt = jnp.asarray(prompt_np)
    ntok = b * n
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(init_model(cfg, seed=0), d)
        model = load_pretrained(d)
        gd, st = nnx.split(model)
        run = make_decode(gd, st, cfg, b, p, n, jnp.float32)
        c0 = _COMPILE_S[0]
        t0 = time.perf_counter()
        ours_tokens = np.asarray(jax.block_until_ready(run(prompt)))
        first = time.perf_counter() - t0
        compile_s = _COMPILE_S[0] - c0
        ours = time_fn(lambda: run(prompt), repeats=args.repeats, warmup=0)
        rows.append(["ours: append_tokens + decode_turn (JAX, f32)", f"{ours:.2f} s", f"{ntok / ours:,.0f}",
                     f"first call {first:.1f} s, of which compile {compile_s:.1f} s", load()])
        if args.long_cache:
            # the same decode with the cache sized for a long rollout budget: attention and the
            # cache update touch every slot each step, filled or not
            run_long = make_decode(gd, st, cfg, b, p, n, jnp.float32, max_len=args.long_cache)
            jax.block_until_ready(run_long(prompt))
            t_long = time_fn(lambda: run_long(prompt), repeats=args.repeats, warmup=0)
            rows.append([f"ours, cache sized {args.long_cache} slots (same work)", f"{t_long:.2f} s",
                         f"{ntok / t_long:,.0f}", f"{t_long / ours:.2f}x the time of a {p + n}-slot cache", load()])
        del run
        if not args.no_torch:
            import torch
            from transformers import Qwen3ForCausalLM

            hf = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            ids = torch.tensor(prompt_np, dtype=torch.long)
            mask = torch.ones_like(ids)

            def gen(k):
                with torch.inference_mode():
                    return hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=k,
                                       min_new_tokens=k, use_cache=True, pad_token_id=0)

            t0 = time.perf_counter()
            gen(4)  # first-call overhead (lazy init, allocator warm-up)
            warm = time.perf_counter() - t0
            theirs = time_fn(lambda: gen(n), repeats=args.torch_repeats, warmup=0)
            their_tokens = gen(n)[:, p:].numpy()
            assert their_tokens.shape == (b, n), their_tokens.shape
            # greedy agreement (random weights have near-flat logits, so rows may diverge at a near-tie)
            same_prefix = [int(np.argmax(np.r_[ours_tokens[i] != their_tokens[i], True])) for i in range(b)]
            rows.append([f"transformers generate (torch {torch.__version__}, {torch.get_num_threads()} threads)",
                         f"{theirs:.2f} s" + (" (1 run)" if args.torch_repeats == 1 else ""), f"{ntok / theirs:,.0f}",
                         f"first call (4 tokens) {warm:.1f} s; **ours {theirs / ours:.2f}x faster**", load()])
            rows.append(["greedy agreement (same weights)", "", "",
                         f"identical tokens: first {min(same_prefix)}–{max(same_prefix)} of {n} per row "
                         f"(median {int(np.median(same_prefix))})", ""])
        del model, gd, st


# ---------------------------------------------------------------------------------------------
# 2. multi-turn rollout
# ---------------------------------------------------------------------------------------------
def rollout_benchmark(args):
    from turnsight_jax.assets import default_tokenizer
    from turnsight_jax.envs.ftrl import FTRLEnv
    from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
    from turnsight_jax.rollout.driver import ModelPolicy, RolloutConfig, rollout

    class TimedPolicy(ModelPolicy):
        """ModelPolicy that records the compile seconds spent inside each phase."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.compile = {"prefill": 0.0, "decode": 0.0, "append": 0.0}

        def _charged(self, phase, fn, *a):
            c0 = _COMPILE_S[0]
            out = fn(*a)
            self.compile[phase] += _COMPILE_S[0] - c0
            return out

        def begin(self, prompts, group_size):
            return self._charged("prefill", super().begin, prompts, group_size)

        def generate(self, active, budgets):
            return self._charged("decode", super().generate, active, budgets)

        def append(self, suffixes):
            return self._charged("append", super().append, suffixes)

    tok = default_tokenizer()
    cfg = get_preset(args.preset)
    model = init_model(cfg, seed=0)
    gd, st = nnx.split(model)
    scfg = SyntheticConfig(hops=9, prompt_style="ftrl")
    tasks = [generate_task("multi_hop", s, scfg) for s in range(args.rollout_tasks)]
    g = args.rollout_group
    scripts = [gold_turn_texts(t) for t in tasks for _ in range(g)]
    assert all(len(s) == 10 for s in scripts)
    rc = RolloutConfig(max_turns=10, max_prompt_tokens=4096, max_response_tokens=args.rollout_response_tokens,
                       max_turn_tokens=64)
    env = FTRLEnv(num_workers=2)
    results = []
    try:
        for _ in range(2):  # cold (compiles), warm
            policy = TimedPolicy(gd, st, tok, sampling=SamplingParams(), config=rc, seed=0, forced_scripts=scripts)
            c0 = _COMPILE_S[0]
            res = rollout(policy, env, tasks, tokenizer=tok, group_size=g, config=rc)
            results.append((res, policy, _COMPILE_S[0] - c0, load()))
    finally:
        env.close()
    trajs = results[0][0].trajectories
    assert all(t.num_turns == 10 and t.finish_reason == "answer" for t in trajs), \
        [(t.num_turns, t.finish_reason) for t in trajs]
    prompt_len = int(np.mean([t.prompt_len for t in trajs]))
    pol = np.mean([t.policy_mask.sum() for t in trajs])
    resp = np.mean([t.length - t.prompt_len for t in trajs])
    print(f"\nrollout: {args.preset}, {len(tasks)} multi_hop tasks (hops=9, ftrl prompt) x group {g} = "
          f"{len(trajs)} rows, 10 turns each; prompt {prompt_len} tokens, {pol:.0f} policy + "
          f"{resp - pol:.0f} observation tokens per trajectory; cache {policy.cache.max_len} slots "
          f"(prompt bucket + max_response_tokens {rc.max_response_tokens} + 1); max_turn_tokens {rc.max_turn_tokens}")
    rows = []
    for name, (res, policy, compile_s, ld) in zip(("cold (first rollout)", "warm (second rollout)"), results):
        s = res.stats
        wall = s["rollout_s"]
        phases = {k: s[f"{k}_s"] - policy.compile[k] for k in ("decode", "append", "prefill")}
        share = lambda x: f"{x / wall:.0%}"
        other = wall - sum(phases.values()) - s["tool_s"] - compile_s
        rows.append([name, f"{wall:.2f} s", f"{s['decoded_tokens'] / wall:,.0f}", f"{s['tokens'] / wall:,.0f}",
                     share(phases["decode"]), share(phases["append"]), share(phases["prefill"]),
                     share(s["tool_s"]), f"{share(compile_s)} ({compile_s:.1f} s)", share(other), ld])
    print(table(rows, ["rollout", "wall", "policy tok/s", "policy+obs tok/s", "decode", "append", "prefill",
                       "tools", "compile", "other", "load"]))
    warm = results[1][0].stats
    print(f"warm run: {warm['decoded_tokens']:.0f} policy tokens decoded in {warm['decode_s']:.2f} s of decode = "
          f"{warm['decoded_tokens'] / warm['decode_s']:,.0f} tok/s inside the decode loop; "
          f"compilations {warm['compilations']:.0f} (process total)")


# ---------------------------------------------------------------------------------------------
# 3. device check (H200)
# ---------------------------------------------------------------------------------------------
def device_check(args):
    """qwen3-0.6b-shaped random model, bf16 params / activations / cache, batch 64: decode tok/s
    and its share of the HBM-bandwidth bound (bytes that must be read per step x steps/s / peak)."""
    cfg = get_preset(args.device_preset)
    b, p, n = args.device_batch, args.prompt_len, args.new_tokens
    model = init_model(cfg, seed=0, param_dtype=jnp.bfloat16, options=RuntimeOptions(compute_dtype=jnp.bfloat16))
    gd, st = nnx.split(model)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, 151_000, (b, p)).astype(np.int32))
    max_len = p + n
    run = make_decode(gd, st, cfg, b, p, n, jnp.bfloat16, max_len=max_len)
    # prefill alone, to subtract it from the prefill + decode time
    lens = jnp.full((b,), p, jnp.int32)

    def prefill():
        cache = KVCache.zeros(cfg, b, max_len, jnp.bfloat16)
        return append_tokens(gd, st, prompt, lens, cache, jnp.zeros((b, cfg.hidden_size), jnp.bfloat16))

    t0 = time.perf_counter()
    jax.block_until_ready(run(prompt))
    first = time.perf_counter() - t0
    t_all = time_fn(lambda: run(prompt), repeats=args.repeats, warmup=0)
    t_pre = time_fn(prefill, repeats=args.repeats)
    t_dec = t_all - t_pre
    steps_s = n / t_dec
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(st))
    # KV read per step: every layer's k and v of each row's filled slots (p .. p+n-1, mean p + n/2)
    kv_slot = cfg.num_layers * b * cfg.num_kv_heads * cfg.head_dim * 2 * 2  # k+v, bf16
    kv_mean = kv_slot * (p + n / 2)
    kv_static = kv_slot * max_len  # what a kernel reading the whole static cache touches
    bw = args.hbm_tbps * 1e12
    need = param_bytes + kv_mean
    rows = [
        ["decode tokens/s (prefill excluded)", f"{b * n / t_dec:,.0f}",
         f"{t_dec / n * 1e3:.2f} ms/step; prefill {t_pre * 1e3:.0f} ms; first call {first:.0f} s"],
        ["bytes per step: params + mean filled KV", f"{need / 1e9:.2f} GB",
         f"params {param_bytes / 1e9:.2f} GB + KV {kv_mean / 1e9:.2f} GB "
         f"(whole static cache {kv_static / 1e9:.2f} GB)"],
        ["HBM-bound decode tokens/s", f"{b * bw / need:,.0f}", f"at {args.hbm_tbps} TB/s"],
        ["share of the HBM bound", f"{need * steps_s / bw:.1%}",
         f"counting the whole static cache: {(param_bytes + kv_static) * steps_s / bw:.1%}"],
    ]
    print(f"device check: {args.device_preset} shape ({cfg.num_params() / 1e6:.0f}M), bf16, batch {b}, prompt {p}, "
          f"{n} new tokens, greedy; cache {max_len} slots")
    print(table(rows, ["quantity", "value", "notes"]))


def prefill_comparison(args):
    cfg = get_preset(args.prefill_preset)
    graphdef, state = nnx.split(init_model(cfg, seed=0, options=RuntimeOptions(attn_q_chunk=512)))
    b, w = args.prefill_batch, args.prefill_len
    toks = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (b, w)), jnp.int32)
    lens = jnp.full((b,), w - 100, jnp.int32)
    rows, times = [], {}
    for bounded in (False, True):
        def run():
            cache = KVCache.zeros(cfg, b, w + 200)
            return append_tokens(graphdef, state, toks, lens, cache, jnp.zeros((b, cfg.hidden_size)), window=w,
                                 from_empty=bounded)
        times[bounded] = time_fn(run, repeats=args.repeats, warmup=1)
    for bounded in (False, True):
        rows.append([("from_empty (keys up to each chunk group)" if bounded else "every chunk over all keys"),
                     f"{times[bounded]:.2f} s", f"{b * w / times[bounded]:,.0f}",
                     f"{times[False] / times[bounded]:.2f}x", load()])
    print(f"prefill: preset {args.prefill_preset}, {b} x {w} tokens, q_chunk 512")
    print(table(rows, ["prefill", "time (median)", "tokens/s", "speed-up", "load"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench-100m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--torch-repeats", type=int, default=1, help="transformers is slow on a CPU: 1 by default")
    ap.add_argument("--long-cache", type=int, default=0,
                    help="also time the decode with the cache sized for this many slots")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--no-rollout", action="store_true")
    ap.add_argument("--rollout-tasks", type=int, default=2)
    ap.add_argument("--rollout-group", type=int, default=4)
    ap.add_argument("--rollout-response-tokens", type=int, default=1024)
    ap.add_argument("--device-check", action="store_true", help="H200: qwen3-0.6b bf16 decode at batch 64")
    ap.add_argument("--prefill", action="store_true", help="only the long-prompt prefill comparison")
    ap.add_argument("--prefill-preset", default="tiny")
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=5120)
    ap.add_argument("--device-batch", type=int, default=64)
    ap.add_argument("--device-preset", default="qwen3-0.6b", help="(a small preset smoke-tests the path on a CPU)")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth (H200: 4.8 TB/s)")
    args = ap.parse_args()
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f} at start")
    if args.device_check:
        device_check(args)
        return
    if args.prefill:
        prefill_comparison(args)
        return
    rows = []
    decode_comparison(args, rows)
    print(table(rows, ["case", "time (median)", "tokens/s", "notes", "load"]))
    if not args.no_rollout:
        rollout_benchmark(args)


if __name__ == "__main__":
    main()
