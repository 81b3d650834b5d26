"""Hindsight-scoring benchmark: packed 3-depth teacher views vs (a) one plain teacher forward and
(b) naive per-(turn, depth) scoring, on real 8-turn trajectories.

    python benchmarks/hindsight.py                 # CPU defaults: 8 trajectories, 2-layer model
    python benchmarks/hindsight.py --layers 8      # the full bench-100m shape (slower)

Trajectories: built-in multi_hop tasks with SyntheticConfig(hops=7, prompt_style="ftrl") (7 tool
turns + the answer = 8 turns) run through the rollout driver with `ReplayPolicy` (gold turn
texts) and the real FTRL environment, so prompts, observations and turn records are the real ones.

Scoring (all jitted, f32, log-probs of the policy tokens only, via `logprobs_at`):
  (a) plain   one causal forward over the original trajectories (what the student pass costs);
  packed      `teacher_logprobs` over `build_views(depths=(1, 2, 3))`: all turns and depths in one
              packed row per trajectory;
  (b) naive   every (turn, depth) view of `teacher_view_ids` as its own sequence, in fixed-shape
              batches padded to the same bucket rule.
Rows are padded to a multiple of --bucket tokens (all three alike); `--pow2` adds plain and packed
rows padded to powers of two. Packed and naive log-probs are checked against each other.
Timings are the median of --repeats rounds after a warm-up (compilation excluded); each round times
every method once, so load drift on a shared machine hits all of them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import machine, table  # noqa: E402

from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.chat.hindsight import hindsight_pieces, teacher_view_ids  # noqa: E402
from turnsight_jax.envs.ftrl import FTRLEnv  # noqa: E402
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts  # noqa: E402
from turnsight_jax.models.attention import Layout  # noqa: E402
from turnsight_jax.models.config import get_preset  # noqa: E402
from turnsight_jax.models.qwen3 import init_model  # noqa: E402
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout  # noqa: E402
from turnsight_jax.rl.logprobs import logprobs_at, teacher_logprobs  # noqa: E402
from turnsight_jax.rl.views import ViewOptions, build_views, policy_bucket, policy_positions  # noqa: E402

DEPTHS = (1, 2, 3)


def load() -> str:
    return "%.1f" % os.getloadavg()[0]


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pow2(n: int) -> int:
    return max(256, 1 << max(0, int(n - 1).bit_length()))


def attention_pairs(width: int, q_chunk: int) -> int:
    """(query, key) pairs the attention kernel scores for one row of `width` tokens: rows longer
    than a chunk are cut into q_chunk-query chunks, chunk c scoring keys [0, (c+1) * q_chunk)
    (`chunked_attention(causal_bound=True)`, as `layout_attention` calls it); masked pairs inside
    those ranges are still computed."""
    if width <= q_chunk:
        return width * width
    return sum(q_chunk * min((c + 1) * q_chunk, width) for c in range(-(-width // q_chunk)))


def gflop(cfg, q_chunk: int, rows: int, width: int, lm_rows: int) -> str:
    """Forward GFLOP as computed: decoder matmuls over rows x width tokens (padding included),
    attention scores + values over the key ranges the kernel visits, and the lm_head at lm_rows
    scored positions. Returned as 'total (body / attention / lm_head)'."""
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    body = 2 * cfg.num_layers * (d * dh * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * f) * rows * width
    attn = 4 * cfg.num_layers * cfg.num_heads * dh * rows * attention_pairs(width, q_chunk)
    head = 2 * d * cfg.vocab_size * lm_rows
    return f"{(body + attn + head) / 1e9:,.0f} ({body / 1e9:,.0f} / {attn / 1e9:,.0f} / {head / 1e9:,.0f})"


def make_trajectories(tok, n: int, hops: int):
    tasks = [generate_task("multi_hop", s, SyntheticConfig(hops=hops, prompt_style="ftrl")) for s in range(n)]
    env = FTRLEnv(num_workers=2)
    try:
        res = rollout(ReplayPolicy(tok, [gold_turn_texts(t) for t in tasks]), env, tasks, tokenizer=tok,
                      group_size=1, config=RolloutConfig(max_turns=hops + 1, max_response_tokens=8192))
    finally:
        env.close()
    trajs = res.trajectories
    assert all(t.num_turns == hops + 1 and t.finish_reason == "answer" for t in trajs)
    return trajs


def naive_views(tok, trajs, pol_pos):
    """Every (b, k, d) view: (ids, predictor indices, targets, packed-output index (d, b, j0..))."""
    views = []
    for b, traj in enumerate(trajs):
        where = {int(p): j for j, p in enumerate(pol_pos[b])}
        for k, turn in enumerate(traj.turns):
            npol = turn.policy_end - turn.policy_start
            for di, d in enumerate(DEPTHS):
                ids = teacher_view_ids(tok, traj, k, d, max_depth=max(DEPTHS))
                pred = len(ids) - npol - 1 + np.arange(npol)
                views.append((ids, pred, ids[-npol:], di, b, where[turn.policy_start]))
    return views


def batch_naive(views, bs: int, width: int, npol: int):
    batches = []
    for s in range(0, len(views), bs):
        chunk = views[s: s + bs]
        tok = np.zeros((bs, width), np.int32)
        valid = np.zeros((bs, width), bool)
        pred = np.zeros((bs, npol), np.int32)
        tgt = np.zeros((bs, npol), np.int32)
        for i, (ids, p, t, *_) in enumerate(chunk):
            tok[i, : len(ids)] = ids
            valid[i, : len(ids)] = True
            pred[i, : len(p)] = p
            tgt[i, : len(t)] = t
        batches.append(tuple(jnp.asarray(a) for a in (tok, valid, pred, tgt)))
    return batches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trajs", type=int, default=8)
    ap.add_argument("--hops", type=int, default=7, help="tool turns (the answer turn is added)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers of the bench-100m shape")
    ap.add_argument("--bucket", type=int, default=256, help="rows padded to a multiple of this")
    ap.add_argument("--naive-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pow2", action="store_true", help="also time plain/packed padded to powers of two")
    args = ap.parse_args()
    print(f"machine: {machine()}; load average {load()} at start")

    tok = default_tokenizer()
    trajs = make_trajectories(tok, args.trajs, args.hops)
    B = len(trajs)
    cfg = dataclasses.replace(get_preset("bench-100m"), num_layers=args.layers)
    model = init_model(cfg, seed=0)
    gd, st = nnx.split(model)
    QC = model.options.attn_q_chunk

    # ---- geometry ----
    pol_pos_np, pol_valid_np = policy_positions(trajs)
    lengths = np.array([t.length for t in trajs])
    prompt = np.array([t.prompt_len for t in trajs])
    pol_turn = np.array([[tt.policy_end - tt.policy_start for tt in t.turns] for t in trajs])
    obs_turn = np.array([[tt.obs_end - tt.obs_start for tt in t.turns[:-1]] for t in trajs])
    trunk_tokens = branch_tokens = 0
    for t in trajs:
        for k, turn in enumerate(t.turns):
            pc = hindsight_pieces(tok, t, k, max_depth=max(DEPTHS))
            if pc.is_empty:
                continue
            trunk_tokens += len(pc.open_ids) + sum(len(i) for i in pc.item_ids)
            nbr = len({min(d, pc.num_items) for d in DEPTHS})
            branch_tokens += nbr * (len(pc.close_ids) + len(pc.header_ids) + turn.policy_end - turn.policy_start - 1)
    print(f"model: bench-100m shape with {cfg.num_layers} layers ({cfg.num_params() / 1e6:.0f}M parameters, "
          f"{cfg.vocab_size * cfg.hidden_size / 1e6:.0f}M of them the embedding), f32")
    print(f"trajectories: {B} x {trajs[0].num_turns} turns (multi_hop, hops={args.hops}, ftrl prompt); "
          f"prompt {prompt.min()}–{prompt.max()} tokens, policy tokens per turn {pol_turn.min()}–{pol_turn.max()} "
          f"(mean {pol_turn.mean():.1f}; the answer turn {pol_turn[:, -1].mean():.0f}), observation tokens per "
          f"tool turn {obs_turn.min()}–{obs_turn.max()} (mean {obs_turn.mean():.1f}), total length "
          f"{lengths.min()}–{lengths.max()} (mean {lengths.mean():.0f}), {pol_valid_np.sum() / B:.0f} policy tokens "
          f"per trajectory")

    # ---- build_views host time ----
    def bv(buckets=None):
        kw = {} if buckets is None else {"buckets": buckets}
        return build_views(trajs, tok, options=ViewOptions(depths=DEPTHS), **kw)

    packed_buckets = tuple(args.bucket * i for i in range(1, 513))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        views_np, vstats = bv(packed_buckets)
        ts.append(time.perf_counter() - t0)
    build_s = float(np.median(ts))
    P = views_np.tokens.shape[1]
    print(f"packed rows: {vstats['view_tokens'] / B:.0f} tokens per row on average = L {lengths.mean():.0f} + "
          f"trunks {trunk_tokens / B:.0f} + branches {branch_tokens / B:.0f} "
          f"(x{vstats['view_overhead']:.2f} the trajectory tokens); width {P}")
    print(f"build_views host time: {build_s * 1e3:.0f} ms per batch of {B} trajectories "
          f"({build_s / B * 1e3:.1f} ms per trajectory, median of 5), load {load()}")

    # ---- (a) plain ----
    def plain_inputs(width):
        toks = np.zeros((B, width), np.int32)
        valid = np.zeros((B, width), bool)
        for b, t in enumerate(trajs):
            toks[b, : t.length] = t.tokens
            valid[b, : t.length] = True
        return jnp.asarray(toks), jnp.asarray(valid)

    pol_pos = jnp.asarray(pol_pos_np)
    NP = pol_pos_np.shape[1]  # policy-position bucket: the lm_head runs on B x NP rows per depth
    targets_np = np.take_along_axis(np.stack([np.pad(t.tokens, (0, lengths.max() - t.length)) for t in trajs]),
                                    pol_pos_np, axis=1)
    targets = jnp.asarray(targets_np)

    @jax.jit
    def plain_fn(st, tokens, valid, pol_pos, targets):
        m = nnx.merge(gd, st)
        hidden = m.hidden_states(tokens, Layout.causal(valid))
        return logprobs_at(m, hidden, jnp.maximum(pol_pos - 1, 0), targets, chunk=1024)

    # the teacher projects each distinct (predictor, target) pair of a row once (views.pred)
    lm_rows_packed = int(np.prod(views_np.pred.shape))

    @jax.jit
    def packed_fn(st, views):
        return teacher_logprobs(nnx.merge(gd, st), views)

    @jax.jit
    def naive_fn(st, tokens, valid, pred, tgt):
        m = nnx.merge(gd, st)
        return logprobs_at(m, m.hidden_states(tokens, Layout.causal(valid)), pred, tgt, chunk=1024)

    print(f"lm_head rows: (a) {B} x {NP} policy slots ({pol_valid_np.sum() / B:.0f} real per trajectory); "
          f"packed {B} x {views_np.pred.shape[1]} distinct (predictor, target) pairs "
          f"({vstats['teacher_distinct_rows']:.0f} real, of {vstats['teacher_rows']:.0f} depth x policy slots)")
    # ---- inputs of every method ----
    W = round_up(int(lengths.max()), args.bucket)
    tokens_a, valid_a = plain_inputs(W)
    views = jax.tree.map(jnp.asarray, views_np)
    nviews = naive_views(tok, trajs, pol_pos_np)
    nlen = np.array([len(v[0]) for v in nviews])
    Wn = round_up(int(nlen.max()), args.bucket)
    npol = policy_bucket(int(pol_turn.max()))
    batches = batch_naive(nviews, args.naive_batch, Wn, npol)
    npad = len(batches) * args.naive_batch
    own = int(lengths.sum())
    # name -> (fn, GFLOP as computed); all share one warm-up and are timed round by round
    methods = {
        "plain": (lambda: plain_fn(st, tokens_a, valid_a, pol_pos, targets), gflop(cfg, QC, B, W, B * NP)),
        "packed": (lambda: packed_fn(st, views), gflop(cfg, QC, B, P, lm_rows_packed)),
        "naive": (lambda: [naive_fn(st, *bt) for bt in batches], gflop(cfg, QC, npad, Wn, npad * npol)),
    }
    if args.pow2:
        Wp = pow2(int(lengths.max()))
        tokens_p, valid_p = plain_inputs(Wp)
        views2_np, _ = bv(tuple(256 * 2**i for i in range(10)))
        Pp = views2_np.tokens.shape[1]
        views2 = jax.tree.map(jnp.asarray, views2_np)
        methods["plain_pow2"] = (lambda: plain_fn(st, tokens_p, valid_p, pol_pos, targets),
                                 gflop(cfg, QC, B, Wp, B * NP))
        methods["packed_pow2"] = (lambda: packed_fn(st, views2), gflop(cfg, QC, B, Pp, lm_rows_packed))

    outs = {}
    for name, (fn, _) in methods.items():  # warm-up: compile (naive: one batch; all share its shape)
        outs[name] = jax.block_until_ready(naive_fn(st, *batches[0]) if name == "naive" else fn())
    times = {name: [] for name in methods}
    loads = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, (fn, _) in methods.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
            loads[name].append(os.getloadavg()[0])
    med = {k: float(np.median(v)) for k, v in times.items()}
    ld = {k: f"{min(v):.1f}–{max(v):.1f}" for k, v in loads.items()}
    gf = {k: float(v[1].split()[0].replace(",", "")) for k, v in methods.items()}
    rate = lambda k: f"{gf[k] / med[k]:.0f}"
    t_plain, t_packed, t_naive = med["plain"], med["packed"], med["naive"]
    packed_out = np.asarray(outs["packed"])
    naive_out = [np.asarray(x) for x in jax.block_until_ready(methods["naive"][0]())]
    plain_out = np.asarray(outs["plain"])
    distinct = len({tuple(v[0]) for v in nviews})

    rows = [
        [f"(a) plain causal forward, {B} x {W}", f"{t_plain:.2f} s", f"{B * W:,}", f"{own:,}",
         methods["plain"][1], rate("plain"), "1.00x", ld["plain"]],
        [f"packed 3-depth views, {B} x {P}", f"{t_packed:.2f} s", f"{B * P:,}", f"{int(vstats['view_tokens']):,}",
         methods["packed"][1], rate("packed"), f"**{t_packed / t_plain:.2f}x (a)**", ld["packed"]],
        [f"(b) naive: {len(nviews)} (turn, depth) views ({distinct} distinct), {len(batches)} x {args.naive_batch} "
         f"x {Wn}", f"{t_naive:.2f} s", f"{npad * Wn:,}", f"{int(nlen.sum()):,}", methods["naive"][1],
         rate("naive"), f"{t_naive / t_plain:.2f}x (a); **packed {t_naive / t_packed:.2f}x faster**", ld["naive"]],
    ]
    if args.pow2:
        rows.append([f"(a) plain, power-of-two bucket: {B} x {Wp}", f"{med['plain_pow2']:.2f} s", f"{B * Wp:,}",
                     f"{own:,}", methods["plain_pow2"][1], rate("plain_pow2"),
                     f"{med['plain_pow2'] / t_plain:.2f}x (a)", ld["plain_pow2"]])
        rows.append([f"packed, power-of-two bucket: {B} x {Pp}", f"{med['packed_pow2']:.2f} s", f"{B * Pp:,}",
                     f"{int(vstats['view_tokens']):,}", methods["packed_pow2"][1], rate("packed_pow2"),
                     f"{med['packed_pow2'] / med['plain_pow2']:.2f}x pow2 (a); {med['packed_pow2'] / t_plain:.2f}x (a)",
                     ld["packed_pow2"]])

    # ---- check: packed == naive (and the answer turn == plain) ----
    diffs = []
    for i, (ids, pred, tgt, di, b, j0) in enumerate(nviews):
        got = naive_out[i // args.naive_batch][i % args.naive_batch, : len(tgt)]
        diffs.append(np.abs(got - packed_out[di, b, j0: j0 + len(tgt)]).max())
    ans_diff = 0.0
    for b, t in enumerate(trajs):  # the answer turn: the last policy tokens of each row
        cnt = int(pol_valid_np[b].sum())
        n_ans = t.turns[-1].policy_end - t.turns[-1].policy_start
        span = slice(cnt - n_ans, cnt)
        ans_diff = max(ans_diff, float(np.abs(plain_out[b, span] - packed_out[:, b, span]).max()))

    print()
    print(table(rows, ["scoring", "time (median)", "tokens incl. padding", "tokens w/o padding",
                       "GFLOP (body / attention / lm_head)", "GFLOP/s", "ratio", "load"]))
    print(f"\ncheck: max |packed - naive| over all {len(nviews)} views = {max(diffs):.2e}; answer turn "
          f"(empty block, scored on the original) max |packed - plain| = {ans_diff:.2e}")
    print(f"goals: packed <= 1.5x (a): {'met' if t_packed <= 1.5 * t_plain else 'MISSED'} "
          f"({t_packed / t_plain:.2f}x); packed >= 3x faster than (b): "
          f"{'met' if t_naive >= 3 * t_packed else 'MISSED'} ({t_naive / t_packed:.2f}x)")


if __name__ == "__main__":
    main()
