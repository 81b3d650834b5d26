"""The paged rollout engine: continuous batching over a sharded, paged KV pool (docs/rollout_engine.md).

`PagedEngine` is a `RolloutBackend` (rollout.driver): the driver queues episodes with `begin`,
hands back observations with `append` and ends episodes with `finish`; each `generate` call
admits queued episodes into free slots, runs the pending prompt prefills and observation
appends, decodes one chunk of up to `decode_chunk` tokens for every slot whose turn is under way,
and returns the turns that completed. An episode keeps its slot (and its blocks) from admission to
`finish`, tool waits included; a slot freed by `finish` takes the next queued episode.

* **Prefix sharing.** The G siblings of a prompt on a shard reference the prompt's full blocks,
  prefilled once; each sibling gets a copy of the prompt's last, partly filled block (the slots
  after the prompt are its own). A prompt's blocks are freed when its last sibling finishes.
* **Admission** reserves the most blocks an episode can need (prompt + max_response_tokens), so
  decoding never runs out of blocks and nothing is ever preempted; the pool default holds every
  slot at full length.
* **Compact decode rows.** A decode chunk runs only the slots that are decoding, gathered into
  rows bucketed to a quarter-power-of-two step per shard: the batch shrinks as episodes end or
  wait for tools.
* **Ragged attention.** Each decode step reads only the rows' live blocks, listed per chunk
  (models.paged_cache.LiveBlocks, padded to a quarter-power-of-two length).
* **Determinism.** Row r's i-th sampled token uses key fold_in(fold_in(seed key, r), i), so an
  episode's draws do not depend on which slot, shard or batch it ran in; scheduling depends on
  nothing but the episodes' own events.
* **Rollout controllers** (rollout.control; docs/rollout_methods.md). A controller's declared
  signals (entropy, top-j log-probs) are computed inside the compiled decode; after each chunk it
  may keep only part of a row's tokens and force the next ones, and at a turn's end ask for the
  turn again. Both roll the sequence back in place (`_rewind`: the length set back, the hidden
  state after the last kept token recomputed by a one-token extend; nothing is prefilled again).
  With `retain`, finished episodes keep their blocks until `release`, so the driver may add
  episodes of a prompt (`add_episode`: the prompt's blocks, when still held) or branch one from a
  finished episode's prefix (`branch`: the prefix's full blocks shared, refcounted; the block
  holding the branch point copied).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.distributed import to_host
from turnsight_jax.models.paged_cache import LiveBlocks, PagedKV, bytes_per_token, empty_pool, live_blocks, paged_extend
from turnsight_jax.models.sharding import BATCH, fit_spec
from turnsight_jax.rollout.control import Chunk, DecodeSignals, EngineController
from turnsight_jax.rollout.sampler import SamplingParams, global_rows, pow2_bucket, sample_rows, token_signals

_FREE, _DECODE, _WAIT = 0, 1, 2
_NO_SIGNALS = DecodeSignals()


def _quarter_pow2(n: int, minimum: int = 8) -> int:
    """n rounded up to a multiple of a quarter of its power of two (4 sizes per octave: at most 25%
    padding, a bounded number of compiled shapes)."""
    n = max(n, minimum)
    step = max(1, pow2_bucket(n) // 8)
    return -(-n // step) * step


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """slots: sequences decoded concurrently, in total over the row shards (rounded up to a
    multiple of them). block_size: KV slots per block. decode_chunk: decode steps between
    scheduling points (a finished turn waits at most this long for the next admission).
    pool_blocks: blocks per shard, the trash block included; 0 = enough for every slot at
    prompt + response length (no sharing needed)."""

    slots: int = 64
    block_size: int = 16
    decode_chunk: int = 16
    pool_blocks: int = 0

    def __post_init__(self):
        for name in ("slots", "block_size", "decode_chunk"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.{name} must be positive, got {getattr(self, name)}")
        if self.pool_blocks < 0:
            raise ValueError(f"rollout.kv_pool_blocks must be >= 0, got {self.pool_blocks}")


def blocks_per_episode(prompt_len: int, max_response: int, block_size: int) -> tuple[int, int]:
    """(shared prompt blocks, own blocks at most) of one episode: the prompt's blocks are shared
    by its siblings on a shard; its own are the copy of the prompt's last block and the response."""
    shared = -(-prompt_len // block_size)
    own = -(-(prompt_len + max_response) // block_size) - prompt_len // block_size
    return shared, own


def check_pool(engine: EngineConfig, shards: int, prompt_len: int, max_response: int, group_size: int) -> None:
    """ValueError, with the numbers, when a shard's pool cannot hold one group at these lengths:
    the prompt's blocks plus min(G, slots per shard) siblings at full length."""
    per_shard = -(-engine.slots // shards)
    blocks = engine.pool_blocks or default_pool_blocks(per_shard, prompt_len, max_response, engine.block_size)
    shared, own = blocks_per_episode(prompt_len, max_response, engine.block_size)
    live = min(group_size, per_shard)
    if shared + live * own > blocks - 1:
        raise ValueError(
            f"the KV pool holds {blocks - 1} blocks of {engine.block_size} slots per shard; one group ({live} live "
            f"siblings of a {prompt_len}-token prompt, {max_response} response tokens each) needs {shared} + {live} x "
            f"{own} = {shared + live * own}: raise rollout.kv_pool_blocks or lower rollout.decode_slots / the lengths")


def default_pool_blocks(slots_per_shard: int, max_prompt: int, max_response: int, block_size: int) -> int:
    """Blocks per shard for every slot at full length with no sharing, plus the trash block."""
    shared, own = blocks_per_episode(max_prompt, max_response, block_size)
    return slots_per_shard * (shared + own) + 1


# ---- compiled programs ----

@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("window_blocks", "from_empty"),
                   donate_argnames=("kv", "hidden"))
def _extend_rows(graphdef, state, kv: PagedKV, hidden, tokens, num_new, start, tables, dst, *, window_blocks: int,
                 from_empty: bool = False):
    """Prefill / append for compact rows: tokens [R', N] into the sequences given by tables [R', MB]
    and start [R']; each row's hidden state after its last token goes to slot dst[r'] of hidden
    [R, D] (dst out of range: dropped) and is also returned ([R', D])."""
    model = nnx.merge(graphdef, state)
    h, kv = paged_extend(model, tokens, num_new, start, tables, kv, window_blocks=window_blocks, from_empty=from_empty)
    last = jnp.take_along_axis(h, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0].astype(hidden.dtype)
    return kv, hidden.at[dst].set(last, mode="drop"), last


@functools.partial(jax.jit, donate_argnames=("kv", "hidden"))
def _fork(kv: PagedKV, hidden, src, dst, hid_dst, hid_val):
    """Copy block src[s, i] to dst[s, i] in every shard s (all layers; vmapped over the shard axis,
    so each device copies its own) and set hidden[hid_dst[j]] = hid_val[j]."""
    copy = jax.vmap(lambda p, a, b: p.at[:, b].set(p[:, a]))
    return kv.replace(k=copy(kv.k, src, dst), v=copy(kv.v, src, dst)), hidden.at[hid_dst].set(
        hid_val.astype(hidden.dtype), mode="drop")


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("steps", "params", "signals"),
                   donate_argnames=("kv",))
def _decode(graphdef, state, kv: PagedKV, hidden, tables, live: LiveBlocks, lengths, budget, keys, counts, stop_ids,
            forced, *, steps: int, params: SamplingParams, signals: DecodeSignals = _NO_SIGNALS):
    """Up to `steps` tokens for compact rows. hidden [R', D] after each row's last token; tables
    [R', MB]; live: the rows' blocks up to their length after the chunk (attention reads only
    those); lengths [R'] filled slots; budget [R'] tokens the row may emit (0: padding row);
    keys [R'] the episodes' keys, counts [R'] tokens they sampled before; forced [R', steps]
    tokens replacing the draw (-1: draw; a forced token's log-prob is the model's). signals
    (static): the per-token signals a rollout controller declared (rollout.control), computed
    from each step's logits only when declared. Returns (tokens, logprobs [R', steps], emitted
    [R'], stopped [R'], kv, hidden, {signal name: [R', steps] float32})."""
    model = nnx.merge(graphdef, state)
    w = model.output_weight()
    r = hidden.shape[0]

    def cond(c):
        return (c[0] < steps) & ~jnp.all(c[1])

    def body(c):
        step, done, stopped, emitted, out_tok, out_lp, out_sig, kv, hid, lengths = c
        logits = jnp.einsum("bd,dv->bv", hid, w.astype(hid.dtype), preferred_element_type=jnp.float32)
        row_keys = jax.vmap(jax.random.fold_in)(keys, counts + emitted)
        tok, lp = sample_rows(logits, row_keys, params, forced[:, step])
        run = ~done
        out_tok = out_tok.at[:, step].set(jnp.where(run, tok, 0))
        out_lp = out_lp.at[:, step].set(jnp.where(run, lp, 0.0))
        if signals.names:
            sig = token_signals(logits, params, entropy=signals.entropy, top_j=signals.top_j)
            out_sig = {k: out_sig[k].at[:, step].set(jnp.where(run, sig[k], 0.0)) for k in out_sig}
        h, kv = paged_extend(model, tok[:, None], run.astype(jnp.int32), lengths, tables, kv, live=live)
        hid = jnp.where(run[:, None], h[:, 0].astype(hid.dtype), hid)
        is_stop = jnp.any(tok[:, None] == stop_ids[None, :], axis=-1) & run
        emitted = emitted + run.astype(jnp.int32)
        lengths = lengths + run.astype(jnp.int32)
        return (step + 1, done | is_stop | (emitted >= budget), stopped | is_stop, emitted, out_tok, out_lp, out_sig,
                kv, hid, lengths)

    zeros = jnp.zeros((r,), jnp.int32)
    init = (jnp.int32(0), budget <= 0, jnp.zeros((r,), bool), zeros, jnp.zeros((r, steps), jnp.int32),
            jnp.zeros((r, steps), jnp.float32), {k: jnp.zeros((r, steps), jnp.float32) for k in signals.names}, kv,
            hidden, lengths)
    _, _, stopped, emitted, out_tok, out_lp, out_sig, kv, hidden, _ = jax.lax.while_loop(cond, body, init)
    return out_tok, out_lp, emitted, stopped, kv, hidden, out_sig


def compilations() -> int:
    return _extend_rows._cache_size() + _fork._cache_size() + _decode._cache_size()


# ---- host-side bookkeeping ----

@dataclasses.dataclass
class _Prompt:
    """A prompt's blocks on one shard, shared by its siblings there."""

    blocks: list[int]
    length: int
    hidden: jax.Array | None = None  # [D] after the prompt's last token, once prefilled
    users: int = 0  # sibling slots using it + 1 while siblings of the group are still queued
    held: bool = True


@dataclasses.dataclass
class _Slot:
    """One sequence: its block table, what of it is shared, and its current turn."""

    row: int = -1
    state: int = _FREE
    length: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)  # the table: shared prompt blocks, then refcounted
    prompt_blocks: int = 0  # blocks[:prompt_blocks] are the prompt's (freed with the prompt, _Prompt.users)
    own_from: int = 0  # blocks[own_from:] are written by this sequence only (before: shared, read-only)
    budget: int = 0
    turn_ids: list[int] = dataclasses.field(default_factory=list)
    turn_lps: list[float] = dataclasses.field(default_factory=list)
    turn_sig: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    reserved: int = 0
    history: list[int] = dataclasses.field(default_factory=list)  # the sequence's tokens [0, length)
    turn_start: int = 0  # slot where the current turn (attempt) began; a re-sample rolls back to it
    attempt: int = 0  # re-samples of the current turn so far
    force_next: list[int] = dataclasses.field(default_factory=list)  # tokens the next decode steps must emit
    stale: str = ""  # the device hidden state is not after token length-1: "turn" (restore the turn start's) | "recompute"
    forks: int = 0  # a retained (finished) episode: branches of it still queued
    release: bool = False  # ... release asked while they were


class PagedEngine:
    """Continuous-batching rollout backend over a paged KV pool (module docstring).

    state: the policy's parameters (an nnx.State, possibly mesh-sharded); the engine decodes with
    a copy cast to `cache_dtype` when they differ (the decode copy, sharded like the parameters).
    mesh: rows and the pool are split over its (data, fsdp) axes; None: one shard.
    forced_scripts: optional turn texts per row replacing the draws (the model's log-probs are
    still recorded), as `ModelPolicy`'s. row_offset: the rows' global index (episode r draws
    from fold_in(key(seed), row_offset + r)), or one global row per episode, as `ModelPolicy`'s
    (rollout.sampler.global_rows). context_slack: KV slots an episode may hold beyond prompt +
    max_response_tokens, reserved at admission (an observation window's contexts may outgrow the
    trajectory: rollout.driver.ObservationWindow.slack). controller: a
    rollout.control.EngineController (its signals computed in the decode, its edits and re-samples
    applied); retain: finished episodes keep their blocks until `release` (the driver's
    RolloutHooks add episodes of their prompt or branch from them)."""

    def __init__(self, graphdef, state, tokenizer, *, sampling: SamplingParams, config, engine: EngineConfig,
                 seed: int = 0, cache_dtype=jnp.float32, mesh=None, forced_scripts: Sequence[Sequence[str]] | None = None,
                 row_offset: int = 0, context_slack: int = 0, controller: EngineController | None = None,
                 retain: bool = False):
        self.graphdef, self.tokenizer, self.sampling, self.config = graphdef, tokenizer, sampling, config
        self.engine, self.mesh, self.cache_dtype = engine, mesh, jnp.dtype(cache_dtype)
        self.state = _decode_copy(state, self.cache_dtype)
        self.model_config = nnx.merge(graphdef, state).config
        self.shards = 1 if mesh is None else math.prod(mesh.shape[a] for a in BATCH)
        self.slots_per_shard = -(-engine.slots // self.shards)
        bs = engine.block_size
        # the most KV slots an episode's context holds after its prompt
        self.max_context = config.max_response_tokens + int(context_slack)
        self.max_len = config.max_prompt_tokens + self.max_context
        self.table_width = pow2_bucket(-(-self.max_len // bs) + 1)
        self.pool_blocks = engine.pool_blocks or default_pool_blocks(
            self.slots_per_shard, config.max_prompt_tokens, self.max_context, bs)
        self.kv = empty_pool(self.model_config, self.shards, self.pool_blocks, bs, self.cache_dtype, mesh)
        self.trash = self.pool_blocks - 1
        n_slots = self.shards * self.slots_per_shard
        self.hidden = self._put(jnp.zeros((n_slots, self.model_config.hidden_size), self.cache_dtype))
        ids = tok_lib.special_ids(tokenizer)
        self.stop_ids = jnp.array([ids.im_end, ids.endoftext], jnp.int32)
        self.stop_set = frozenset((ids.im_end, ids.endoftext))
        self.im_end = ids.im_end
        self.base_key = jax.random.key(seed)
        self.row_offset = row_offset
        self.forced_scripts = forced_scripts
        self._forced_ids: dict[tuple[int, int], list[int]] = {}
        self.controller, self.retain = controller, retain
        self.signals = controller.signals if controller is not None else DecodeSignals()
        # the hidden state at each slot's turn start, for a controller's re-sample (rolled back to it)
        self.turn_hidden = self._put(jnp.zeros_like(self.hidden)) if controller is not None else None
        self.timings = {"prefill": 0.0, "decode": 0.0, "append": 0.0, "recompute": 0.0}
        self.counters = collections.Counter()
        self.kv_bytes_per_token = bytes_per_token(self.model_config, self.cache_dtype)

    # ---- the backend interface ----
    def begin(self, prompts: Sequence[Sequence[int]], group_size: int) -> None:
        for p in prompts:
            if len(p) > self.config.max_prompt_tokens:
                raise ValueError(f"prompt of {len(p)} tokens over rollout.max_prompt_tokens="
                                 f"{self.config.max_prompt_tokens}")
        check_pool(dataclasses.replace(self.engine, pool_blocks=self.pool_blocks), self.shards,
                   max(len(p) for p in prompts), self.max_context, group_size)
        self.prompts = [list(p) for p in prompts]
        self.group_size = group_size
        n = len(prompts) * group_size
        self.rows = n
        self.group_of = [r // group_size for r in range(n)]  # each episode's prompt
        # each episode's global row: its sampling key is fold_in(key, global row)
        self.key_rows = global_rows(self.row_offset, n).tolist()
        self.queue = collections.deque(range(n))
        self.queued_in_group = collections.Counter(self.group_of)
        self.slots = [[_Slot() for _ in range(self.slots_per_shard)] for _ in range(self.shards)]
        self.where: dict[int, tuple[int, int]] = {}
        self.free = [list(range(self.pool_blocks - 2, -1, -1)) for _ in range(self.shards)]
        self.refs = [collections.Counter() for _ in range(self.shards)]  # users of each non-prompt block
        self.committed = [0] * self.shards
        self.on_shard: list[dict[int, _Prompt]] = [{} for _ in range(self.shards)]
        self.pending_appends: dict[int, tuple[list[int], int]] = {}
        self.retained: dict[int, tuple[int, _Slot]] = {}  # finished episodes whose blocks are kept (retain)
        self.pending_branches: dict[int, tuple[int, int, int]] = {}  # queued branch row -> (parent, position, budget)
        self.turn_of = [0] * n
        self.sampled = [0] * n  # tokens each episode drew so far (its key stream position)
        self.first_budget = min(self.config.max_response_tokens, self.config.turn_cap)

    def append(self, row: int, ids: Sequence[int], budget: int, rewind: int = 0) -> None:
        s, j = self.where[row]
        slot = self.slots[s][j]
        if slot.state != _WAIT:
            raise RuntimeError(f"append to row {row}, which is not waiting for an observation")
        if not 0 <= rewind <= slot.length - max(len(self.prompts[self.group_of[row]]), slot.own_from * self.engine.block_size):
            raise ValueError(f"row {row}: rewind {rewind} reaches into the shared prompt (context {slot.length})")
        # The slots after the rewound length are the slot's own and are overwritten by the append
        # (attention reads none past a query's own slot).
        slot.length -= int(rewind)
        del slot.history[slot.length:]
        self.pending_appends[row] = (list(ids), int(budget))

    def finish(self, row: int) -> None:
        s, j = self.where.pop(row)
        slot = self.slots[s][j]
        self.slots[s][j] = _Slot()
        if self.retain:  # kept until `release`: the driver may add episodes of its prompt or branch from it
            slot.state = _FREE
            self.retained[row] = (s, slot)
            return
        self._drop(s, slot)

    def release(self, row: int) -> None:
        """Free a finished episode kept by `retain` (after the branches queued from it started)."""
        s, slot = self.retained[row]
        if slot.forks:
            slot.release = True
            return
        del self.retained[row]
        self._drop(s, slot)

    def add_episode(self, row: int, prompt: int, key_row: int) -> None:
        """Queue a new episode of prompt `prompt` (an index into begin's prompts) as row `row` (the
        next row number), drawing from fold_in(key(seed), key_row). On a shard where the prompt is
        still held (a sibling running or retained) it reuses the prompt's blocks: no prefill."""
        self._new_row(row, prompt, key_row)
        self.queue.append(row)
        self.queued_in_group[prompt] += 1
        for s in range(self.shards):
            p = self.on_shard[s].get(prompt)
            if p is not None and not p.held:  # hold it again until the new sibling is admitted
                p.held, p.users = True, p.users + 1
        self.counters["added_episodes"] += 1

    def branch(self, row: int, parent: int, position: int, budget: int, key_row: int) -> None:
        """Queue row `row` (the next row number) continuing the retained episode `parent` after its
        first `position` tokens: it shares the parent's blocks before the one holding slot
        position - 1, copies that one, recomputes the hidden state after token position - 1 (one
        token, no prefill) and decodes at most `budget` tokens of the turn it continues; draws from
        fold_in(key(seed), key_row)."""
        if parent not in self.retained:
            raise RuntimeError(f"branch from row {parent}, which is not a finished episode kept by retain=True")
        _, pslot = self.retained[parent]
        plen = len(self.prompts[self.group_of[parent]])
        if not plen <= position <= pslot.length or position < 1:
            raise ValueError(f"branch of row {parent} at {position}: outside its response [{plen}, {pslot.length}]")
        self._new_row(row, self.group_of[parent], key_row)
        self.turn_of[row] = self.turn_of[parent]
        self.pending_branches[row] = (parent, position, int(budget))
        pslot.forks += 1
        self.queue.append(row)

    def generate(self) -> dict[int, "GeneratedTurn"]:  # noqa: F821 (driver.GeneratedTurn)
        self._admit()
        self._run_appends()
        self._restore_stale()
        return self._decode_chunk()

    # ---- scheduling ----
    def _new_row(self, row: int, prompt: int, key_row: int) -> None:
        if row != self.rows:
            raise ValueError(f"new episodes are numbered in order: expected row {self.rows}, got {row}")
        self.rows += 1
        self.group_of.append(prompt)
        self.key_rows.append(int(key_row))
        self.turn_of.append(0)
        self.sampled.append(0)

    def _alloc(self, s: int) -> int:
        b = self.free[s].pop()
        self.refs[s][b] = 1
        return b

    def _unref(self, s: int, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.refs[s][b] -= 1
            if self.refs[s][b] == 0:
                del self.refs[s][b]
                self.free[s].append(b)

    def _drop(self, s: int, slot: _Slot) -> None:
        """Release an episode's blocks: its refcounted ones, its reservation, its use of the prompt."""
        self._unref(s, slot.blocks[slot.prompt_blocks:])
        self.committed[s] -= slot.reserved
        g = self.group_of[slot.row]
        self.on_shard[s][g].users -= 1
        self._maybe_release(s, g)

    def _maybe_release(self, s: int, group: int) -> None:
        prompt = self.on_shard[s].get(group)
        if prompt is not None and prompt.users == 0:
            self.free[s].extend(prompt.blocks)
            self.committed[s] -= len(prompt.blocks)
            del self.on_shard[s][group]

    def _pick(self, s: int) -> int | None:
        """Queue position of the next episode for shard s: a branch of an episode there or a
        sibling of a prompt already there, else the first queued episode that is not a branch
        pinned to another shard."""
        first = None
        for i, row in enumerate(self.queue):
            branch = self.pending_branches.get(row)
            if branch is not None:
                if self.retained[branch[0]][0] == s:
                    return i
                continue
            if self.group_of[row] in self.on_shard[s]:
                return i
            if first is None:
                first = i
        return first

    def _admit(self) -> None:
        bs = self.engine.block_size
        prefills: list[tuple[int, int, _Prompt]] = []  # (shard, group, prompt)
        forks: list[tuple[int, int, int]] = []  # (shard, slot, row): new siblings, the prompt's hidden state
        copies = [[] for _ in range(self.shards)]  # (src, dst) blocks per shard
        dropped: list[tuple[int, _Slot]] = []  # parents released once their blocks are copied
        for s in range(self.shards):
            for j, slot in enumerate(self.slots[s]):
                if slot.state != _FREE or not self.queue:
                    continue
                i = self._pick(s)
                if i is None:
                    break
                row = self.queue[i]
                g = self.group_of[row]
                plen = len(self.prompts[g])
                if row in self.pending_branches:
                    parent, position, budget = self.pending_branches[row]
                    _, pslot = self.retained[parent]
                    b = (position - 1) // bs  # the block holding the last kept token: copied
                    prompt_blocks = min(b, pslot.prompt_blocks)
                    # conservative: its reservation also covers the parent's blocks it shares, which
                    # it keeps when the parent is released
                    need = -(-(plen + self.max_context) // bs) - prompt_blocks
                    if self.committed[s] + need > self.pool_blocks - 1:
                        break
                    del self.queue[i], self.pending_branches[row]
                    self.committed[s] += need
                    self.on_shard[s][g].users += 1
                    table = pslot.blocks[:b]
                    for blk in table[prompt_blocks:]:
                        self.refs[s][blk] += 1
                    table.append(self._alloc(s))
                    copies[s].append((pslot.blocks[b], table[-1]))
                    self.slots[s][j] = _Slot(row=row, state=_DECODE, length=position, blocks=table,
                                             prompt_blocks=prompt_blocks, own_from=b,
                                             budget=min(budget, self.config.turn_cap), reserved=need,
                                             history=pslot.history[:position], turn_start=position, stale="recompute")
                    self.where[row] = (s, j)
                    self.counters["branches"] += 1
                    self.counters["branch_shared_tokens"] += position
                    pslot.forks -= 1
                    if pslot.release and not pslot.forks:
                        del self.retained[parent]
                        dropped.append((s, pslot))
                    continue
                shared, own = blocks_per_episode(plen, self.max_context, bs)
                new_prompt = g not in self.on_shard[s]
                need = own + (shared if new_prompt else 0)
                if self.committed[s] + need > self.pool_blocks - 1:
                    break  # this shard is full until an episode finishes
                del self.queue[i]
                self.committed[s] += need
                if new_prompt:
                    prompt = _Prompt([self.free[s].pop() for _ in range(shared)], plen, users=1)
                    self.on_shard[s][g] = prompt
                    prefills.append((s, g, prompt))
                prompt = self.on_shard[s][g]
                prompt.users += 1
                self.queued_in_group[g] -= 1
                if self.queued_in_group[g] == 0:  # no sibling left to admit: drop the holds
                    for ss in range(self.shards):
                        if g in self.on_shard[ss] and self.on_shard[ss][g].held:
                            self.on_shard[ss][g].held = False
                            self.on_shard[ss][g].users -= 1
                            self._maybe_release(ss, g)
                full = plen // bs
                blocks = list(prompt.blocks[:full])
                if plen % bs:
                    blocks.append(self._alloc(s))
                    copies[s].append((prompt.blocks[-1], blocks[-1]))
                self.slots[s][j] = _Slot(row=row, state=_DECODE, length=plen, blocks=blocks, prompt_blocks=full,
                                         own_from=full, budget=self.first_budget, reserved=own,
                                         history=list(self.prompts[g]), turn_start=plen)
                self.where[row] = (s, j)
                forks.append((s, j, row))
        if prefills:
            self._prefill(prefills)
        if forks or any(copies):
            m = pow2_bucket(max(len(c) for c in copies))
            pairs = np.array([c + [(self.trash, self.trash)] * (m - len(c)) for c in copies], np.int32)
            h = pow2_bucket(max(len(forks), 1))
            hid_dst = [s * self.slots_per_shard + j for s, j, _ in forks] + [len(self.hidden)] * (h - len(forks))
            vals = [self.on_shard[s][self.group_of[row]].hidden for s, _, row in forks]
            vals = vals + [vals[0] if vals else jnp.zeros_like(self.hidden[0])] * (h - len(forks))
            src, dst = self._put_rows(pairs[..., 0], pairs[..., 1])
            self.kv, self.hidden = _fork(self.kv, self.hidden, src, dst, jnp.asarray(np.array(hid_dst, np.int32)),
                                         jnp.stack(vals))
        for s, pslot in dropped:
            self._drop(s, pslot)

    def _compact(self, per_shard: list[list], fine: bool = False) -> tuple[int, list]:
        """Rows per shard (a power of two; fine: a quarter-power-of-two step above 4, for the decode
        whose cost is per row) and the shard-major row list with None padding."""
        most = max(len(x) for x in per_shard)
        width = _quarter_pow2(most, 1) if fine and most > 4 else pow2_bucket(most)
        rows = []
        for x in per_shard:
            rows.extend(x + [None] * (width - len(x)))
        return width, rows

    def _table(self, blocks: list[int]) -> np.ndarray:
        t = np.full(self.table_width, self.trash, np.int32)
        t[: len(blocks)] = blocks
        return t

    def _extend(self, items: list, per_shard_key, timing: str, dst_of) -> jax.Array:
        """Run _extend_rows on items grouped by shard: item -> (shard, tokens, start, blocks)."""
        per_shard = [[] for _ in range(self.shards)]
        for it in items:
            per_shard[per_shard_key(it)[0]].append(it)
        _, rows = self._compact(per_shard)
        width = pow2_bucket(max(len(per_shard_key(it)[1]) for it in items), 16)
        toks = np.zeros((len(rows), width), np.int32)
        num = np.zeros(len(rows), np.int32)
        start = np.zeros(len(rows), np.int32)
        tables = np.full((len(rows), self.table_width), self.trash, np.int32)
        dst = np.full(len(rows), len(self.hidden), np.int32)
        end = 1
        for i, it in enumerate(rows):
            if it is None:
                continue
            _, ids, st, blocks = per_shard_key(it)
            toks[i, : len(ids)] = ids
            num[i], start[i] = len(ids), st
            tables[i] = self._table(blocks)
            dst[i] = dst_of(it)
            end = max(end, st + len(ids))
            self.counters[f"{timing}_tokens"] += len(ids)
        self.counters[f"{timing}_tokens_computed"] += toks.size
        window = min(self.table_width, pow2_bucket(-(-end // self.engine.block_size), 4))
        t0 = time.perf_counter()
        self.kv, self.hidden, last = _extend_rows(
            self.graphdef, self.state, self.kv, self.hidden, *self._put_rows(toks, num, start, tables, dst),
            window_blocks=window, from_empty=timing == "prefill")
        jax.block_until_ready(self.hidden)  # its own time, not the next decode's (which waits for it anyway)
        self.timings[timing] += time.perf_counter() - t0
        return last, rows

    def _prefill(self, prefills) -> None:
        last, rows = self._extend(prefills, lambda it: (it[0], self.prompts[it[1]], 0, it[2].blocks), "prefill",
                                  lambda it: len(self.hidden))
        for i, it in enumerate(rows):
            if it is not None:
                it[2].hidden = last[i]

    def _run_appends(self) -> None:
        if not self.pending_appends:
            return
        items = []
        for row, (ids, budget) in self.pending_appends.items():
            s, j = self.where[row]
            slot = self.slots[s][j]
            self._grow(s, slot, slot.length + len(ids))
            items.append((s, j, row, ids, slot.length, list(slot.blocks)))
        self._extend(items, lambda it: (it[0], it[3], it[4], it[5]), "append",
                     lambda it: it[0] * self.slots_per_shard + it[1])
        for s, j, row, ids, _, _ in items:
            slot = self.slots[s][j]
            slot.length += len(ids)
            slot.history += ids
            slot.turn_start = slot.length
            slot.state = _DECODE
            slot.budget = min(self.pending_appends[row][1], self.config.turn_cap)
        self.pending_appends.clear()

    def _restore_stale(self) -> None:
        """Hidden states after a rollback (rollout.control.Edit, a re-sampled turn, a branch): the
        turn start's, saved when the turn began; or recomputed by extending the last kept token
        again (its KV slot, in a block the sequence owns, is rewritten with the same value)."""
        live = [(s, j, slot) for s in range(self.shards) for j, slot in enumerate(self.slots[s])
                if slot.state == _DECODE and slot.stale]
        at_start = [s * self.slots_per_shard + j for s, j, slot in live if slot.stale == "turn"]
        if at_start:
            idx = jnp.asarray(np.array(at_start, np.int32))
            self.hidden = self.hidden.at[idx].set(self.turn_hidden[idx])
        redo = [(s, j, slot) for s, j, slot in live if slot.stale == "recompute"]
        for s, j, slot in redo:
            if (slot.length - 1) // self.engine.block_size < slot.own_from:
                raise RuntimeError(f"row {slot.row}: rolling back to slot {slot.length} would rewrite a shared block")
        if redo:
            self._extend(redo, lambda it: (it[0], [it[2].history[it[2].length - 1]], it[2].length - 1, it[2].blocks),
                         "recompute", lambda it: it[0] * self.slots_per_shard + it[1])
        for _, _, slot in live:
            slot.stale = ""

    def _grow(self, s: int, slot: _Slot, length: int) -> None:
        """Own blocks until the table covers `length` slots (within the admission reservation)."""
        need = -(-length // self.engine.block_size)
        while len(slot.blocks) < need:
            if len(slot.blocks) - slot.prompt_blocks >= slot.reserved:
                raise RuntimeError(f"row {slot.row} outgrew its reservation of {slot.reserved} blocks")
            slot.blocks.append(self._alloc(s))

    def _forced(self, slot: _Slot, steps: int) -> np.ndarray:
        """[steps] tokens replacing the draws of the row's next decode steps (-1: draw): a
        controller's forced tokens, else the forced script's (forced_scripts)."""
        out = np.full(steps, -1, np.int32)
        row, offset = slot.row, len(slot.turn_ids)
        if self.forced_scripts is not None and row < len(self.forced_scripts):
            script = self.forced_scripts[row]
            turn = self.turn_of[row]
            if turn < len(script):
                key = (row, turn)
                if key not in self._forced_ids:  # tokenised once per turn, not once per chunk
                    ids = tok_lib.encode(self.tokenizer, script[turn]) + [self.im_end]
                    self._forced_ids[key] = ids[: self.config.turn_cap]
                part = self._forced_ids[key][offset: offset + steps]
                out[: len(part)] = part
        if slot.force_next:
            part = slot.force_next[:steps]
            out[: len(part)] = part
        return out

    def _decode_chunk(self) -> dict:
        from turnsight_jax.rollout.driver import GeneratedTurn

        steps = self.engine.decode_chunk
        per_shard = [[(s, j) for j, slot in enumerate(self.slots[s]) if slot.state == _DECODE]
                     for s in range(self.shards)]
        done: dict[int, GeneratedTurn] = {}
        for s, j in [x for xs in per_shard for x in xs]:  # a zero budget: an empty, unstopped turn
            slot = self.slots[s][j]
            if slot.budget <= 0:
                slot.state = _WAIT
                done[slot.row] = GeneratedTurn([], [], "", False)
        per_shard = [[x for x in xs if self.slots[x[0]][x[1]].state == _DECODE] for xs in per_shard]
        if not any(per_shard):
            return done
        _, rows = self._compact(per_shard, fine=True)
        n = len(rows)
        tables = np.full((n, self.table_width), self.trash, np.int32)
        lengths = np.zeros(n, np.int32)
        budget = np.zeros(n, np.int32)
        counts = np.zeros(n, np.int32)
        forced = np.full((n, steps), -1, np.int32)
        key_rows = np.zeros(n, np.int32)
        src = np.full(n, 0, np.int32)
        starting = []  # compact rows whose turn (attempt) starts with this chunk
        for i, it in enumerate(rows):
            if it is None:
                continue
            s, j = it
            slot = self.slots[s][j]
            left = slot.budget - len(slot.turn_ids)
            self._grow(s, slot, slot.length + min(steps, left))
            tables[i] = self._table(slot.blocks)
            lengths[i], budget[i], counts[i] = slot.length, left, self.sampled[slot.row]
            key_rows[i] = self.key_rows[slot.row]
            src[i] = s * self.slots_per_shard + j
            forced[i] = self._forced(slot, steps)
            if not slot.turn_ids:
                starting.append(i)
        per = n // self.shards
        listed = [[] if it is None else
                  self.slots[it[0]][it[1]].blocks[: -(-int(lengths[i] + min(steps, budget[i])) // self.engine.block_size)]
                  for i, it in enumerate(rows)]
        size = _quarter_pow2(max(sum(len(b) for b in listed[s * per:(s + 1) * per]) for s in range(self.shards)))
        self.counters["decode_blocks_listed"] += sum(len(b) for b in listed) * steps
        self.counters["decode_blocks_computed"] += size * self.shards * steps
        live_np = live_blocks(listed, per, self.trash, self.engine.block_size, size)
        live_blocks_arg = LiveBlocks(**{k: self._put(jnp.asarray(v)) for k, v in live_np.items()})
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(self.base_key, jnp.asarray(key_rows))
        t0 = time.perf_counter()
        hid_in = self.hidden[jnp.asarray(src)]
        if self.turn_hidden is not None and starting:  # what a re-sample of the turn rolls back to
            at = jnp.asarray(np.array(starting, np.int32))
            self.turn_hidden = self.turn_hidden.at[jnp.asarray(src[starting])].set(hid_in[at])
        out_tok, out_lp, emitted, stopped, self.kv, hid, out_sig = _decode(
            self.graphdef, self.state, self.kv, hid_in, *self._put_rows(tables), live_blocks_arg,
            *self._put_rows(lengths, budget), keys, *self._put_rows(counts), self.stop_ids, *self._put_rows(forced),
            steps=steps, params=self.sampling, signals=self.signals)
        live = np.array([it is not None for it in rows])
        dst = np.where(live, src, len(self.hidden)).astype(np.int32)
        self.hidden = self.hidden.at[jnp.asarray(dst)].set(hid, mode="drop")
        out_tok, out_lp = to_host(out_tok), to_host(out_lp)
        emitted, stopped = to_host(emitted), to_host(stopped)
        out_sig = {k: to_host(v) for k, v in out_sig.items()}
        self.timings["decode"] += time.perf_counter() - t0
        self.counters["decode_chunks"] += 1
        self.counters["decode_row_steps"] += int(live.sum()) * steps
        self.counters["decode_row_steps_computed"] += n * steps
        # occupancy's denominator: the slots that could be busy (no more than there are episodes)
        self.counters["decode_slot_steps"] += min(self.shards * self.slots_per_shard, self.rows) * steps
        self.counters["decoded_tokens"] += int(emitted.sum())
        in_use = max(self.pool_blocks - 1 - len(f) for f in self.free)
        self.counters["kv_blocks_in_use_peak"] = max(self.counters["kv_blocks_in_use_peak"], in_use)
        for i, it in enumerate(rows):
            if it is None:
                continue
            slot = self.slots[it[0]][it[1]]
            e = int(emitted[i])
            turn = self._take(slot, out_tok[i, :e], out_lp[i, :e], {k: v[i, :e] for k, v in out_sig.items()},
                              bool(stopped[i]))
            if turn is not None:
                done[slot.row] = turn
        return done

    def _take(self, slot: _Slot, ids: np.ndarray, lps: np.ndarray, sig: dict[str, np.ndarray], stopped: bool):
        """Record a row's chunk (after the controller's edit, if any); the completed turn
        (driver.GeneratedTurn) or None while it goes on."""
        from turnsight_jax.rollout.driver import GeneratedTurn

        e = len(ids)
        del slot.force_next[:e]
        keep, force = e, ()
        if self.controller is not None and e:
            room = slot.budget - len(slot.turn_ids)
            edit = self.controller.on_chunk(Chunk(slot.row, self.turn_of[slot.row], slot.attempt, len(slot.turn_ids),
                                                  room, ids, lps, sig))
            if edit is not None:
                keep, force = int(edit.keep), tuple(int(t) for t in edit.force)
                if not 0 <= keep <= e:
                    raise ValueError(f"row {slot.row}: the controller keeps {keep} of the chunk's {e} tokens")
                if keep + len(force) > room:
                    raise ValueError(f"row {slot.row}: the controller forces {len(force)} token(s) after {keep}, past "
                                     f"the turn's {room} tokens left")
                if force and keep and int(ids[keep - 1]) in self.stop_set:
                    raise ValueError(f"row {slot.row}: the controller forces tokens after the turn's stop token")
        slot.turn_ids += ids[:keep].tolist()
        slot.turn_lps += lps[:keep].tolist()
        for k, v in sig.items():
            slot.turn_sig.setdefault(k, []).extend(v[:keep].tolist())
        slot.history += ids[:keep].tolist()
        slot.length += keep
        self.sampled[slot.row] += keep  # dropped draws are drawn again: the chunk size changes nothing
        if keep < e:
            self.counters["discarded_tokens"] += e - keep
            slot.stale = "turn" if slot.length == slot.turn_start else "recompute"
        if force:
            slot.force_next = list(force)
            self.counters["forced_tokens"] += len(force)
        stopped = stopped if keep == e else bool(keep and int(ids[keep - 1]) in self.stop_set)
        if not (stopped or len(slot.turn_ids) >= slot.budget or (keep < e and not force)):
            return None
        turn = self.turn_of[slot.row]
        if self.controller is not None and self.controller.turn_done(
                slot.row, turn, slot.attempt, np.asarray(slot.turn_ids, np.int32),
                np.asarray(slot.turn_lps, np.float32), {k: np.asarray(v, np.float32) for k, v in slot.turn_sig.items()}):
            # sampled again from the turn's start: the draws go on (new tokens), the KV slots are rewritten
            self.counters["resampled_turns"] += 1
            self.counters["discarded_tokens"] += len(slot.turn_ids)
            slot.length = slot.turn_start
            del slot.history[slot.turn_start:]
            slot.turn_ids, slot.turn_lps, slot.turn_sig, slot.force_next = [], [], {}, []
            slot.attempt += 1
            slot.stale = "turn"
            return None
        ids_out = slot.turn_ids
        text = self.tokenizer.decode(ids_out, skip_special_tokens=False)
        out = GeneratedTurn(ids_out, slot.turn_lps, text, stopped, signals=slot.turn_sig or None)
        self.turn_of[slot.row] += 1
        slot.turn_ids, slot.turn_lps, slot.turn_sig, slot.state, slot.attempt = [], [], {}, _WAIT, 0
        return out

    # ---- placement ----
    def _put(self, x):
        if self.mesh is None:
            return x
        spec = fit_spec(jax.sharding.PartitionSpec(BATCH, *([None] * (x.ndim - 1))), x.shape, self.mesh)
        return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))

    def _put_rows(self, *arrays):
        return [self._put(jnp.asarray(a)) for a in arrays]

    compilations = staticmethod(compilations)
    continuous = True  # the driver overlaps tool calls with decoding (rollout.driver.rollout)

    def stats(self) -> dict[str, float]:
        """Counters of this engine's work: prefill/append tokens (real, computed with padding),
        decode row steps (live, computed, slots x steps), decode blocks read per step (listed,
        with padding; summed over steps), KV bytes per shard: the pool allocated
        and the peak of the blocks in use (a block in use is counted whole)."""
        out = {k: float(v) for k, v in self.counters.items()}
        out["kv_pool_bytes_per_shard"] = float(self.kv.nbytes_per_shard())
        per_block = self.kv_bytes_per_token * self.engine.block_size
        out["kv_in_use_bytes_peak_per_shard"] = out.get("kv_blocks_in_use_peak", 0.0) * per_block
        return out


def _decode_copy(state, dtype):
    """The parameters cast to the decode dtype (same shardings); the state itself when equal."""
    leaves = jax.tree.leaves(state)
    if all(x.dtype == dtype or not jnp.issubdtype(x.dtype, jnp.floating) for x in leaves):
        return state
    return jax.jit(lambda s: jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                                          s))(state)
