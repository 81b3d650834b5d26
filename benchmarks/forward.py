"""Forward-pass benchmark: our Flax Qwen3 vs transformers (torch) on the same weights, and the
packed-view layout vs a plain causal layout over the same number of tokens.

    python benchmarks/forward.py                 # CPU defaults: bench-100m, batch 4 x 1024
    python benchmarks/forward.py --mfu           # bf16 MFU of a 0.6B-shaped model (for a GPU)

Prints a Markdown table; ratios > 1 mean ours is faster.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine, table, time_fn  # noqa: E402

from turnsight_jax.flops import causal_pairs, chunked_pairs, forward_flops  # noqa: E402
from turnsight_jax.models.attention import NO_SEGMENT, Layout  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.qwen3 import RuntimeOptions, init_model  # noqa: E402
from turnsight_jax.models.weights import load_pretrained, save_pretrained  # noqa: E402


def packed_layout(batch: int, length: int, orig: int, block: int) -> Layout:
    """A packed-view layout: an original of `orig` tokens, then blocks of `block` tokens, each
    reading the original up to a different prefix limit."""
    idx = np.arange(length)
    seg = np.where(idx < orig, 0, 1 + (idx - orig) // block)
    start = orig + (seg - 1) * block
    limit = np.where(seg > 0, (seg * 37) % orig + 1, 0)
    pos = np.where(seg > 0, limit + idx - start, idx)
    c1s = np.where(seg > 0, 0, NO_SEGMENT)
    f = lambda a: jnp.asarray(np.broadcast_to(a, (batch, length)).astype(np.int32))
    return Layout(f(pos), f(seg), f(c1s), f(limit), f(np.full(length, NO_SEGMENT)), f(np.zeros(length)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="bench-100m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--q-chunk", type=int, default=RuntimeOptions.attn_q_chunk,
                    help="attention query chunk (RuntimeOptions.attn_q_chunk)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--attention", action="store_true",
                    help="also time attention alone (all layers) per query chunk vs torch SDPA")
    ap.add_argument("--mfu", action="store_true", help="bf16 MFU of qwen3-0.6b at 4096 tokens (GPU)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="device bf16 dense peak for MFU")
    args = ap.parse_args()
    print(f"machine: {machine()}")
    rows = []

    if args.mfu:
        cfg = get_preset("qwen3-0.6b")
        model = init_model(cfg, param_dtype=jnp.bfloat16,
                           options=RuntimeOptions(compute_dtype=jnp.bfloat16, attn_q_chunk=1024))
        gd, st = nnx.split(model)
        tokens = jnp.zeros((args.batch, 4096), jnp.int32)
        f = jax.jit(lambda s, t: nnx.merge(gd, s).hidden_states(t))
        t = time_fn(lambda: f(st, tokens), repeats=args.repeats)
        # the hidden states only: no head rows; causal pairs (turnsight_jax.flops, the one counter)
        n = args.batch * 4096
        flops = forward_flops(cfg, n, args.batch * causal_pairs(4096), 0)
        executed = forward_flops(cfg, n, args.batch * chunked_pairs(4096, 1024), 0)
        rows.append([f"qwen3-0.6b bf16 forward, hidden states (executed/necessary {executed / flops:.2f}x)",
                     f"{t * 1e3:.1f} ms", f"{flops / t / 1e12:.1f} TFLOP/s",
                     f"MFU {flops / t / 1e12 / args.peak_tflops:.1%}"])
        print(table(rows, ["case", "time", "throughput", "ratio"]))
        return

    cfg = get_preset(args.preset)
    print(f"model: {args.preset}, {cfg.num_params() / 1e6:.0f}M parameters; batch {args.batch} x {args.length}; "
          f"attention query chunk {args.q_chunk}")
    tokens_np = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.length)).astype(np.int32)
    tokens = jnp.asarray(tokens_np)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(init_model(cfg, seed=0), d)
        model = load_pretrained(d, options=RuntimeOptions(attn_q_chunk=args.q_chunk))
        gd, st = nnx.split(model)
        fwd = jax.jit(lambda s, t: nnx.merge(gd, s)(t))
        t0 = time.perf_counter()
        jax.block_until_ready(fwd(st, tokens))
        compile_s = time.perf_counter() - t0
        ours = time_fn(lambda: fwd(st, tokens), repeats=args.repeats)
        ntok = args.batch * args.length
        rows.append(["ours (JAX, f32 logits)", f"{ours * 1e3:.0f} ms", f"{ntok / ours:,.0f} tok/s",
                     f"(compile {compile_s:.1f} s)"])
        if not args.no_torch:
            import torch
            from transformers import Qwen3ForCausalLM

            hf = Qwen3ForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            tt = torch.tensor(tokens_np, dtype=torch.long)

            def torch_fwd():
                with torch.inference_mode():
                    return hf(tt).logits

            theirs = time_fn(torch_fwd, repeats=args.repeats)
            rows.append([f"transformers (torch {torch.__version__}, {torch.get_num_threads()} threads)",
                         f"{theirs * 1e3:.0f} ms", f"{ntok / theirs:,.0f} tok/s",
                         f"ours {theirs / ours:.2f}x faster"])
        # packed vs plain layout, hidden states only (the layout changes attention, not the head)
        hid = jax.jit(lambda s, t, lay: nnx.merge(gd, s).hidden_states(t, lay))
        plain = Layout.full(args.batch, args.length)
        packed = packed_layout(args.batch, args.length, orig=args.length // 2, block=64)
        t_plain = time_fn(lambda: hid(st, tokens, plain), repeats=args.repeats)
        t_packed = time_fn(lambda: hid(st, tokens, packed), repeats=args.repeats)
        rows.append(["plain causal layout (hidden states)", f"{t_plain * 1e3:.0f} ms", f"{ntok / t_plain:,.0f} tok/s", ""])
        rows.append(["packed-view layout (hidden states)", f"{t_packed * 1e3:.0f} ms", f"{ntok / t_packed:,.0f} tok/s",
                     f"packed/plain = {t_packed / t_plain:.2f}x time"])
    print(table(rows, ["case", "time (median)", "throughput", "ratio"]))
    if args.attention:
        print(table(attention_rows(cfg, args), ["attention only, all layers", "time (median)", "ratio"]))


def attention_rows(cfg, args) -> list[list[str]]:
    """Where the decoder body's time goes on this backend: causal attention alone, per query
    chunk, against torch's fused scaled_dot_product_attention on the same shapes."""
    from turnsight_jax.models.attention import layout_attention

    rng = np.random.default_rng(0)
    b, t, hq, hkv, dh = args.batch, args.length, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_np = rng.standard_normal((b, t, hq, dh), dtype=np.float32)
    k_np = rng.standard_normal((b, t, hkv, dh), dtype=np.float32)
    v_np = rng.standard_normal((b, t, hkv, dh), dtype=np.float32)
    q, k, v = map(jnp.asarray, (q_np, k_np, v_np))
    lay = Layout.full(b, t)
    rows, base = [], None
    if not args.no_torch:
        import torch

        tq = torch.from_numpy(q_np).transpose(1, 2)
        tk = torch.from_numpy(k_np).transpose(1, 2).repeat_interleave(hq // hkv, 1)
        tv = torch.from_numpy(v_np).transpose(1, 2).repeat_interleave(hq // hkv, 1)
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        base = time_fn(sdpa, repeats=args.repeats) * cfg.num_layers
        rows.append(["torch scaled_dot_product_attention (causal)", f"{base * 1e3:.0f} ms", "1.00x"])
    for chunk in (128, 256, 512):
        f = jax.jit(lambda q, k, v, c=chunk: layout_attention(q, k, v, lay, q_chunk=c))
        ours = time_fn(lambda: f(q, k, v), repeats=args.repeats) * cfg.num_layers
        rows.append([f"ours, query chunk {chunk}", f"{ours * 1e3:.0f} ms",
                     f"{ours / base:.2f}x torch's time" if base else ""])
    return rows


if __name__ == "__main__":
    main()
