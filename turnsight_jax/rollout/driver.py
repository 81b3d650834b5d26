"""The multi-turn rollout driver: policy turns interleaved with tool execution.

For B tasks x G rollouts the driver renders each prompt, lets the policy generate a turn for
every live rollout, parses the calls on the host, executes them concurrently in the
environments, appends the observation tokens behind the policy's own tokens, and repeats up to
`max_turns`. It returns `Trajectory` records (token ids, policy mask, turn ids, old log-probs,
turn records with calls and results) with rewards and metrics from the environments.

The policy is an interface (`TurnPolicy`): `ModelPolicy` decodes with the KV-cached sampler;
`ReplayPolicy` replays fixed turn texts, so evaluation and the driver are testable without a
trained model.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import sys
import time
from typing import Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from turnsight_jax.chat import template as tmpl
from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.chat.parsing import parse_turn
from turnsight_jax.chat.trajectory import ElidedContexts, Trajectory, TrajectoryBuilder
from turnsight_jax.chat.types import CallError, Task
from turnsight_jax.distributed import to_host
from turnsight_jax.envs.base import Environment, VectorEnv
from turnsight_jax.models.qwen3 import KVCache
from turnsight_jax.rollout.control import EpisodeStart, RolloutHooks
from turnsight_jax.rollout.sampler import SamplingParams, append_tokens, decode_turn, global_rows, pow2_bucket

log = logging.getLogger(__name__)

TOOL_ERROR_PREFIX = "an error occured when call"


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Budgets of a rollout.

    max_turns: policy turns per episode. max_prompt_tokens: longer prompts are an error (they
    would otherwise be silently cut). max_response_tokens: policy + observation tokens after the
    prompt (the last turn's results, recorded without tokens when the episode ends after its calls,
    do not count). max_turn_tokens: decode cap of one turn; a turn that reaches it ends its episode
    as truncated; 0: no per-turn cap, a turn may use all the response budget left (`turn_cap`; the
    released code's behaviour, the paper names no such cap). Static: one compiled decode loop.
    Parse semantics (both False by default; True is the released code's behaviour, docs/spec.md §3):
    end_on_unparsable_turn: a turn that wrote call blocks none of which parses ends the episode
    (finish reason "unparsable") instead of returning the parse errors to the policy;
    calls_in_think: call blocks inside <think> are executed (chat.parsing.parse_turn).
    observation_template: the text appended after a turn that made tool calls
    (chat.template.observation_suffix): "project" (default), the official Qwen3 chat template's;
    "released", the released MatchTIR rollout's (docs/reproducing.md "Observation text").
    """

    max_turns: int = 10
    max_prompt_tokens: int = 10_000
    max_response_tokens: int = 13_000
    max_turn_tokens: int = 1024
    enable_thinking: bool = False
    end_on_unparsable_turn: bool = False
    calls_in_think: bool = False
    observation_template: str = "project"

    def __post_init__(self):
        tmpl.check_observation_template(self.observation_template)
        for name in ("max_turns", "max_prompt_tokens", "max_response_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.{name} must be positive, got {getattr(self, name)}")
        if self.max_turn_tokens < 0:
            raise ValueError(f"rollout.max_turn_tokens must be >= 0 (0: no per-turn cap), got {self.max_turn_tokens}")

    @property
    def turn_cap(self) -> int:
        """The most tokens one turn may generate: max_turn_tokens, or the whole response budget
        when it is 0 (no per-turn cap)."""
        return self.max_turn_tokens or self.max_response_tokens


@dataclasses.dataclass(frozen=True)
class ObservationWindow:
    """The policy's context keeps only the most recent `size` observations in full (>= 1); each
    older one is replaced by `placeholder_ids`, a whole observation suffix (`placeholder_suffix`).
    An observation is the suffix appended after a turn (its tool responses or user message, then
    the next assistant header); a turn without one counts none."""

    size: int
    placeholder_ids: tuple[int, ...]

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"an observation window keeps at least the newest observation, got size {self.size}")
        if not self.placeholder_ids:
            raise ValueError("an observation window needs placeholder ids")

    def slack(self, max_turns: int) -> int:
        """Tokens a context may hold beyond its trajectory's (a placeholder can be longer than the
        observation it replaces): at most max_turns - 1 - size observations are ever elided."""
        return max(0, max_turns - 1 - self.size) * len(self.placeholder_ids)


def placeholder_suffix(tokenizer, text: str, *, enable_thinking: bool, template: str = "project") -> tuple[int, ...]:
    """The ids that replace an elided observation: a tool-response message holding `text`, then
    the next assistant header, as `template.observation_suffix_ids` renders one result (in the
    rollout's `observation_template`)."""
    return tuple(tmpl.observation_suffix_ids(tokenizer, [text], enable_thinking=enable_thinking, template=template).ids)


@dataclasses.dataclass
class GeneratedTurn:
    """One policy turn: token ids as generated (stop token included when `stopped`), their
    sampling log-probs, the decoded text, and the per-token signals a rollout controller declared
    ({name: one float per token}, rollout.control.DecodeSignals; None when none was)."""

    ids: list[int]
    logprobs: list[float]
    text: str
    stopped: bool
    signals: dict[str, list[float]] | None = None


class TurnPolicy(Protocol):
    def begin(self, prompts: Sequence[Sequence[int]], group_size: int) -> None:
        """Start len(prompts) * group_size rollouts; row r continues prompt r // group_size."""

    def generate(self, active: np.ndarray, budgets: np.ndarray) -> list[GeneratedTurn | None]:
        """One turn for every active row (at most budgets[r] tokens); None for inactive rows."""

    def append(self, suffixes: Sequence[Sequence[int] | None]) -> None:
        """Append observation tokens to the rows given (None: nothing)."""

    def rewind(self, counts: Sequence[int]) -> None:
        """Drop the last counts[r] tokens of row r's context (before an `append` that re-renders
        them: an observation window; `rollout(window=...)`). Needed only with a window."""


class ModelPolicy:
    """Decodes with the compiled KV-cached sampler.

    The prompts of a group are prefilled once and the cache is repeated G times. Rows, prompt
    lengths and observation lengths are bucketed to powers of two so a run compiles a bounded
    number of programs (`compilations()` reports how many).
    """

    def __init__(self, graphdef, state, tokenizer, *, sampling: SamplingParams, config: RolloutConfig,
                 seed: int = 0, cache_dtype=jnp.float32, forced_scripts: Sequence[Sequence[str]] | None = None,
                 row_offset: int = 0, context_slack: int = 0):
        """forced_scripts: optional turn texts per row that override sampling (a scripted policy
        run through the real decode loop and cache; log-probs remain the model's). Row r's draws
        come from fold_in(key(seed), row_offset + r), token by token, as the paged engine's: the
        same episodes sample the same tokens whatever the batch they share (row_offset: the
        rows' global index, when a step's episodes are split over calls or processes; or one
        global row per episode, `global_rows`). context_slack: cache slots beyond prompt +
        max_response_tokens (an observation window's contexts may outgrow the trajectory:
        `ObservationWindow.slack`)."""
        self.graphdef, self.state = graphdef, state
        self.tokenizer = tokenizer
        self.sampling = sampling
        self.config = config
        self.key = jax.random.key(seed)
        self.row_offset = row_offset
        self.cache_dtype = cache_dtype
        ids = tok_lib.special_ids(tokenizer)
        self.stop_ids = jnp.array([ids.im_end, ids.endoftext], jnp.int32)
        self.timings = {"prefill": 0.0, "decode": 0.0, "append": 0.0}
        self.decoded_tokens = 0
        self.forced_scripts = forced_scripts
        self.context_slack = int(context_slack)
        self.turn = 0

    @staticmethod
    def compilations() -> int:
        return decode_turn._cache_size() + append_tokens._cache_size()

    def begin(self, prompts, group_size):
        t0 = time.perf_counter()
        cfg = self.graphdef_config()
        n_prompts = len(prompts)
        self.rows = n_prompts * group_size
        self.padded_rows = pow2_bucket(self.rows, 1)
        longest = max(len(p) for p in prompts)
        width = pow2_bucket(longest, 64)
        # Cache: the prompt bucket plus the response budget (+ one turn of slack for padded appends).
        max_len = width + self.config.max_response_tokens + self.context_slack + 1
        prompt_rows = pow2_bucket(n_prompts, 1)
        toks = np.zeros((prompt_rows, width), np.int32)
        lens = np.zeros((prompt_rows,), np.int32)
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = p
            lens[i] = len(p)
        cache = KVCache.zeros(cfg, prompt_rows, max_len, self.cache_dtype)
        hidden = jnp.zeros((prompt_rows, cfg.hidden_size), self.cache_dtype)
        cache, hidden = append_tokens(self.graphdef, self.state, jnp.asarray(toks), jnp.asarray(lens), cache, hidden,
                                      window=width, from_empty=True)  # the cache was just made: empty
        # Repeat each prompt's cache G times, then pad the rows to the bucket with empty rows.
        take = np.minimum(np.arange(self.padded_rows) // group_size, prompt_rows - 1)
        take = jnp.asarray(take)
        self.cache = KVCache(cache.k[:, take], cache.v[:, take], cache.lengths[take])
        self.hidden = hidden[take]
        self.turn = 0
        self.lengths = np.asarray(lens)[np.asarray(take)]  # host copy of the filled slots per row
        self.row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
            self.key, jnp.asarray(global_rows(self.row_offset, self.rows, self.padded_rows)))
        self.sampled = np.zeros(self.padded_rows, np.int32)  # tokens each row drew so far
        # the prefill's own time, not the decode's: the decode that follows waits for it anyway
        jax.block_until_ready(self.hidden)
        self.timings["prefill"] += time.perf_counter() - t0

    def _window(self, needed: int) -> int:
        """Attention window for `needed` filled slots: a power of two (bounded compilations),
        at most the cache size."""
        return min(self.cache.max_len, pow2_bucket(needed, 64))

    def graphdef_config(self):
        from flax import nnx

        return nnx.merge(self.graphdef, self.state).config

    def generate(self, active, budgets):
        t0 = time.perf_counter()
        act = np.zeros(self.padded_rows, bool)
        act[: self.rows] = active
        bud = np.zeros(self.padded_rows, np.int32)
        bud[: self.rows] = np.minimum(budgets, self.config.turn_cap)
        act &= bud > 0
        forced = None
        if self.forced_scripts is not None:
            forced = np.full((self.padded_rows, self.config.turn_cap), -1, np.int32)
            for r in range(self.rows):
                script = self.forced_scripts[r]
                if self.turn < len(script):
                    ids = (tok_lib.encode(self.tokenizer, script[self.turn]) + [int(self.stop_ids[0])])
                    ids = ids[: self.config.turn_cap]
                    forced[r, : len(ids)] = ids
            forced = jnp.asarray(forced)
        self.turn += 1
        out, self.cache, self.hidden, _ = decode_turn(
            self.graphdef, self.state, self.cache, self.hidden, self.row_keys, self.config.turn_cap,
            self.sampling, self.stop_ids, jnp.asarray(act), jnp.asarray(bud), forced, jnp.asarray(self.sampled),
            window=self._window(int(self.lengths.max()) + int(bud.max())),  # a row decodes at most its budget
        )
        tokens, logprobs = to_host(out.tokens), to_host(out.logprobs)
        lengths, stopped = to_host(out.lengths), to_host(out.stopped)
        self.lengths = self.lengths + lengths
        self.sampled = self.sampled + lengths.astype(np.int32)
        self.timings["decode"] += time.perf_counter() - t0
        result: list[GeneratedTurn | None] = []
        for r in range(self.rows):
            if not act[r]:
                result.append(None if not active[r] else GeneratedTurn([], [], "", False))
                continue
            n = int(lengths[r])
            ids = tokens[r, :n].tolist()
            self.decoded_tokens += n
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            result.append(GeneratedTurn(ids, logprobs[r, :n].tolist(), text, bool(stopped[r])))
        return result

    def append(self, suffixes):
        if not any(s for s in suffixes):
            return
        t0 = time.perf_counter()
        width = pow2_bucket(max(len(s) for s in suffixes if s), 16)
        toks = np.zeros((self.padded_rows, width), np.int32)
        lens = np.zeros((self.padded_rows,), np.int32)
        for r, s in enumerate(suffixes):
            if s:
                toks[r, : len(s)] = s
                lens[r] = len(s)
        self.cache, self.hidden = append_tokens(
            self.graphdef, self.state, jnp.asarray(toks), jnp.asarray(lens), self.cache, self.hidden,
            window=self._window(int((self.lengths + lens).max())),
        )
        self.lengths = self.lengths + lens
        jax.block_until_ready(self.hidden)  # the append's own time (the next decode waits for it anyway)
        self.timings["append"] += time.perf_counter() - t0

    def rewind(self, counts):
        """Row r's cache forgets its last counts[r] slots (the next append overwrites them)."""
        drop = np.zeros(self.padded_rows, np.int32)
        drop[: len(counts)] = counts
        if np.any(drop > self.lengths):
            raise ValueError(f"rewind past the start of a row: {drop.tolist()} > {self.lengths.tolist()}")
        self.cache = KVCache(self.cache.k, self.cache.v, self.cache.lengths - jnp.asarray(drop))
        self.lengths = self.lengths - drop


class ReplayPolicy:
    """Replays fixed turn texts: `scripts[r]` is the list of turn texts of row r. Each turn is
    tokenised and ends with <|im_end|>; a row out of script answers with an empty answer."""

    def __init__(self, tokenizer, scripts: Sequence[Sequence[str]]):
        self.tokenizer = tokenizer
        self.scripts = [list(s) for s in scripts]
        self.im_end = tok_lib.im_end_id(tokenizer)
        self.timings: dict[str, float] = {}

    def begin(self, prompts, group_size):
        rows = len(prompts) * group_size
        if len(self.scripts) != rows:
            raise ValueError(f"ReplayPolicy has {len(self.scripts)} scripts for {rows} rollouts")
        self.turn = [0] * rows

    def generate(self, active, budgets):
        out: list[GeneratedTurn | None] = []
        for r, live in enumerate(active):
            if not live:
                out.append(None)
                continue
            script = self.scripts[r]
            text = script[self.turn[r]] if self.turn[r] < len(script) else "<answer></answer>"
            self.turn[r] += 1
            ids = tok_lib.encode(self.tokenizer, text) + [self.im_end]
            stopped = len(ids) <= budgets[r]
            ids = ids[: max(int(budgets[r]), 0)]
            out.append(GeneratedTurn(ids, [0.0] * len(ids), self.tokenizer.decode(ids, skip_special_tokens=False),
                                     stopped))
        return out

    def append(self, suffixes):
        pass

    def rewind(self, counts):
        pass


def user_suffix(tokenizer, results: Sequence[str], user_message: str | None, *, enable_thinking: bool,
                template: str = "project"):
    """(ids, result_spans, header_offset) appended after a completed policy turn: the tool
    responses (if any, in `template`: chat.template.observation_suffix), then a user message (if
    any), then the next assistant header."""
    if results and user_message is None:
        suf = tmpl.observation_suffix_ids(tokenizer, results, enable_thinking=enable_thinking, template=template)
        return suf.ids, suf.result_spans, suf.header_offset
    text = ""
    char_spans = []
    if results:
        head, char_spans, _ = tmpl._observation_parts(results, enable_thinking, template)
        cut = head.rindex(tok_lib.IM_START)  # drop the assistant header; the user turn follows
        text = head[:cut]
    text += ("" if text else "\n") + tok_lib.IM_START + "user\n" + (user_message or "") + tok_lib.IM_END + "\n"
    header_char = len(text)
    text += tmpl.generation_prompt(enable_thinking=enable_thinking)
    ids, spans, (header,) = tok_lib.encode_with_plain_spans(tokenizer, text, char_spans, [header_char])
    return ids, spans, header


@dataclasses.dataclass(frozen=True)
class RolloutProgress:
    """Where a running `rollout` stands, reported after every policy turn and once at the end.

    finished/total: episodes ended / len(tasks) * group_size. turn: policy turns run so far.
    tokens: policy tokens generated so far. elapsed_s: seconds since the rollout started.
    done: the final report of this rollout (finished == total)."""

    finished: int
    total: int
    turn: int
    tokens: int
    elapsed_s: float
    done: bool = False


ProgressCallback = Callable[[RolloutProgress], None]


@dataclasses.dataclass
class RolloutResult:
    """trajectories: len(tasks) * G, siblings adjacent (a controller that forms its own groups:
    len(tasks) * R in prompt blocks, rl.methods.RolloutController). stats: this process's counts
    and seconds.
    tasks: the task of each group when a controller rolled out other prompts than it was given
    (dynamic sampling's refills), else None. metrics: a controller's own diagnostics, logged as
    they are (already over every process)."""

    trajectories: list[Trajectory]
    stats: dict[str, float]
    tasks: list[Task] | None = None
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def all_unparsable(calls) -> bool:
    """Every call block of the turn failed to parse (an empty list: False)."""
    return bool(calls) and all(isinstance(c, CallError) for c in calls)


def _turn_metrics(traj: Trajectory) -> dict[str, float]:
    calls = [c for t in traj.turns for c in t.calls]
    results = [r for t in traj.turns for r in t.results]
    errors = sum(isinstance(c, CallError) for c in calls) + sum(r.startswith(TOOL_ERROR_PREFIX) for r in results)
    return {
        "num_turns": float(traj.num_turns),
        "num_calls": float(len(calls)),
        "tool_error_rate": errors / max(len(calls), 1),
        "response_tokens": float(traj.length - traj.prompt_len),
        "policy_tokens": float(traj.policy_mask.sum()),
        "truncated": float(traj.truncated),
    }


class RolloutBackend(Protocol):
    """What the driver needs from a generator (`PagedEngine`; `LockstepBackend` over a TurnPolicy).

    The driver owns the episodes; a row is *with the backend* from `begin` (or `append`) until
    `generate` returns its turn, and the driver calls `generate` only while some row is."""

    def begin(self, prompts: Sequence[Sequence[int]], group_size: int) -> None:
        """Queue len(prompts) * group_size episodes; row r continues prompt r // group_size and
        its first turn may emit min(max_response_tokens, turn_cap) tokens."""

    def generate(self) -> dict[int, GeneratedTurn]:
        """Advance decoding; return the turns that completed (possibly none)."""

    def append(self, row: int, ids: Sequence[int], budget: int, rewind: int = 0) -> None:
        """Observation tokens behind row's last turn; its next turn emits at most `budget` tokens.
        rewind > 0: first drop that many tokens from the end of the row's context (an observation
        window re-renders what follows an elided observation; never into the prompt)."""

    def finish(self, row: int) -> None:
        """The episode is over: release what it holds (a backend with `retain` keeps it until
        `release`)."""

    # Optional, for rollout hooks (rollout.control.RolloutHooks; the paged engine has them, with
    # `retain = True`): episodes added to a running rollout, and the release of finished ones.
    # add_episode(row, prompt, key_row): a new episode of prompt `prompt`, row the next row number.
    # branch(row, parent, position, budget, key_row): continue finished row `parent` after its
    # first `position` tokens, the continued turn emitting at most `budget` tokens.
    # release(row): free a finished episode kept for the hooks.


class LockstepBackend:
    """A TurnPolicy (one turn for every ready row per call) as a RolloutBackend."""

    def __init__(self, policy: TurnPolicy, config: RolloutConfig):
        self.policy, self.config = policy, config
        self.timings = getattr(policy, "timings", {})

    def begin(self, prompts, group_size):
        self.policy.begin(prompts, group_size)
        n = len(prompts) * group_size
        self.ready = np.ones(n, bool)
        self.budgets = np.full(n, self.config.max_response_tokens, np.int64)
        self.suffixes: list = [None] * n
        self.rewinds = np.zeros(n, np.int64)
        self.first = True

    def append(self, row, ids, budget, rewind=0):
        self.suffixes[row] = list(ids)
        self.ready[row] = True
        self.budgets[row] = budget
        self.rewinds[row] = rewind

    def finish(self, row):
        pass

    def generate(self):
        if not self.first:
            if self.rewinds.any():
                self.policy.rewind(self.rewinds.tolist())
                self.rewinds[:] = 0
            self.policy.append(self.suffixes)
        self.first = False
        self.suffixes = [None] * len(self.suffixes)
        active = self.ready.copy()
        outs = self.policy.generate(active, self.budgets)
        self.ready[:] = False
        return {int(r): outs[r] for r in np.flatnonzero(active)}


class _WindowedContexts:
    """Each row's context as the backend holds it under an observation window: its tokens, where
    each observation sits in them, how many are elided, and what every turn saw (`rollout`)."""

    def __init__(self, window: ObservationWindow, prompts: Sequence[Sequence[int]]):
        self.window = window
        self.tokens = [list(p) for p in prompts]
        self.spans: list[list[tuple[int, int]]] = [[] for _ in prompts]  # each observation's [start, end)
        self.elided = [0] * len(prompts)
        self.counts: list[list[int]] = [[] for _ in prompts]
        self.elisions = 0
        self.reprefill = 0

    def turn(self, r: int, ids: Sequence[int]) -> None:
        self.counts[r].append(self.elided[r])
        self.tokens[r].extend(ids)

    def observation(self, r: int, ids: Sequence[int]) -> tuple[list[int], int]:
        """(ids to append, tokens to rewind first) for row r's new observation `ids`: when the
        window now elides an older observation, the context from that observation on is
        re-rendered (the placeholder, then what followed it, then the new observation)."""
        ctx, spans = self.tokens[r], self.spans[r]
        end = len(ctx)
        spans.append((end, end + len(ids)))
        ctx.extend(ids)
        elide = max(0, len(spans) - self.window.size)
        if elide <= self.elided[r]:
            return list(ids), 0
        first = spans[self.elided[r]][0]
        placeholder = list(self.window.placeholder_ids)
        for j in range(self.elided[r], elide):
            a, b = spans[j]
            ctx[a:b] = placeholder
            shift = len(placeholder) - (b - a)
            spans[j] = (a, a + len(placeholder))
            spans[j + 1:] = [(x + shift, y + shift) for x, y in spans[j + 1:]]
        self.elisions += elide - self.elided[r]
        self.elided[r] = elide
        out = ctx[first:]
        self.reprefill += len(out) - len(ids)
        return out, end - first

    def contexts(self, r: int) -> ElidedContexts | None:
        if not any(self.counts[r]):
            return None
        return ElidedContexts(tuple(self.counts[r]), tuple(self.window.placeholder_ids))


def as_backend(policy, config: RolloutConfig):
    return policy if hasattr(policy, "finish") else LockstepBackend(policy, config)


def rollout(
    policy: TurnPolicy | RolloutBackend,
    env: Environment,
    tasks: Sequence[Task],
    *,
    tokenizer,
    group_size: int,
    config: RolloutConfig,
    seed: int = 0,
    group_offset: int = 0,
    progress: ProgressCallback | None = None,
    row_ids: Sequence[int] | None = None,
    window: ObservationWindow | None = None,
    hooks: RolloutHooks | None = None,
) -> RolloutResult:
    """Run len(tasks) * group_size episodes to the end. Trajectory r belongs to group
    group_offset + r // group_size. `progress` (optional) receives a `RolloutProgress` after
    every `generate` and a final one with done=True (it throttles its own output). row_ids:
    the global row of each episode, which seeds its environment (default: group_offset *
    group_size + r; give the policy the same rows, `row_offset`, so its draws match).

    `window` (methods.mm_grpo): each turn sees only the most recent `window.size` observations in full.
    When an observation leaves the window the backend rewinds to it and re-prefills the placeholder
    and everything after it (`stats["reprefill_tokens"]`, beyond the new observation itself); the
    trajectory keeps every observation in full and records what each turn saw
    (`Trajectory.contexts`; `stats["elided_observations"]` counts the elisions). The budgets
    (max_response_tokens) count the trajectory's tokens, as without a window; the backend must hold
    `window.slack(max_turns)` more slots per episode.

    With a continuous backend (`continuous = True`: the paged engine) the tool calls of the turns
    one `generate` returns run in a worker thread while the next `generate` decodes the other rows;
    their observations are appended after it, so what runs when depends only on the episodes, never
    on timing. A lockstep backend steps the tools right after its turns, as a turn loop does.

    hooks (rollout.control.RolloutHooks; a backend with `retain`, the paged engine): when every
    episode of a prompt ended, its trajectories are built and scored and `hooks.after_group` may
    start more episodes of it (fresh, or branched from a finished one: `_start_branch`); they get
    rows len(tasks) * group_size, ... in the order they were started, and the result lists every
    row in row order."""
    t_start = time.perf_counter()
    ids = tok_lib.special_ids(tokenizer)
    prompts = []
    for task in tasks:
        p = tmpl.prompt_ids(tokenizer, task.messages, task.tools, enable_thinking=config.enable_thinking)
        if len(p) > config.max_prompt_tokens:
            raise ValueError(
                f"task {task.task_id}: prompt has {len(p)} tokens, over rollout.max_prompt_tokens="
                f"{config.max_prompt_tokens}"
            )
        prompts.append(p)
    backend = as_backend(policy, config)
    if hooks is not None and not getattr(backend, "retain", False):
        raise ValueError("rollout hooks need a backend that keeps finished episodes for them "
                         "(rollout.engine.PagedEngine(retain=True)); the lockstep sampler has none")
    n = len(tasks) * group_size
    prompt_of = [r // group_size for r in range(n)]
    builders = [
        TrajectoryBuilder(prompts[p], group_offset + p, tasks[p].task_id, im_start_id=ids.im_start,
                          im_end_id=ids.im_end)
        for p in prompt_of
    ]
    if hooks is not None and window is not None:
        raise ValueError("rollout hooks and an observation window together are not supported (a branch would need "
                         "its parent's windowed contexts)")
    ctxs = None if window is None else _WindowedContexts(window, [prompts[p] for p in prompt_of])
    overlap = getattr(backend, "continuous", False)  # tool calls run while other rows decode
    vec = VectorEnv(env)
    tools = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout-tools")
    tool_s = [0.0]
    env_errors: list[str] = []
    used = [0] * n
    turn_of = [0] * n
    final_text: list[str | None] = [None] * n
    finish: list[str | None] = [None] * n
    # Episode seeds depend on (seed, global row), not on how rows were batched.
    env_seed = [seed * 1_000_003 + int(g)
                for g in global_rows(group_offset * group_size if row_ids is None else row_ids, n)]
    partial: list[tuple | None] = [None] * n  # a branch's first turn: the parent's tokens before the branch point
    live = set(range(n))
    live_in_prompt = collections.Counter(prompt_of)
    ready: list[int] = []  # prompts whose episodes all ended, for hooks.after_group
    built: dict[int, Trajectory] = {}
    released: set[int] = set()  # rows whose blocks the backend was told to free (hooks)
    added = {"added_episodes": 0.0, "branches": 0.0, "replay_mismatches": 0.0}
    generated = 0

    def end(r: int, reason: str | None, truncated: bool = False) -> None:
        if truncated:
            builders[r].mark_truncated("length")
        finish[r] = "length" if truncated else reason
        live.discard(r)
        backend.finish(r)
        live_in_prompt[prompt_of[r]] -= 1
        if hooks is not None and live_in_prompt[prompt_of[r]] == 0:
            ready.append(prompt_of[r])

    def build(rows) -> None:
        for r, score in zip(rows, vec.score([final_text[r] for r in rows], rows)):
            b = builders[r]
            if score.metrics.get("env_error", 0.0) > 0 and finish[r] != "env_error":
                env_errors.append(f"row {r}, scoring failed")  # VectorEnv.score: reward 0, metric env_error
            traj = b.build(reward=score.reward, metrics=dict(score.metrics),
                           finish_reason=None if b._truncated else (finish[r] or "max_turns"),
                           contexts=None if ctxs is None else ctxs.contexts(r))
            traj.metrics.update(_turn_metrics(traj))
            if ctxs is not None:
                traj.metrics["elided_observations"] = float(max(ctxs.counts[r], default=0))  # from its last turn
            built[r] = traj

    def new_row(p: int, builder: TrajectoryBuilder, seed_of_env: int) -> int:
        r = len(builders)
        builders.append(builder)
        prompt_of.append(p)
        for lst, v in ((used, 0), (turn_of, 0), (final_text, None), (finish, None), (partial, None),
                       (env_seed, seed_of_env)):
            lst.append(v)
        live.add(r)
        live_in_prompt[p] += 1
        if vec.add(tasks[p], seed_of_env) != r:
            raise RuntimeError(f"rollout: environment episode {len(vec.episodes) - 1} for row {r}")
        return r

    def start(p: int, st: EpisodeStart) -> None:
        builder = TrajectoryBuilder(prompts[p], st.group_id, tasks[p].task_id, im_start_id=ids.im_start,
                                    im_end_id=ids.im_end)
        if st.parent is None:
            r = new_row(p, builder, seed * 1_000_003 + st.key_row)
            backend.add_episode(r, p, st.key_row)
            added["added_episodes"] += 1
        else:
            if prompt_of[st.parent] != p or st.parent not in built:
                raise ValueError(f"prompt {p}: branch from row {st.parent}, not a finished episode of this prompt")
            parent = built[st.parent]
            r = new_row(p, builder, env_seed[st.parent])  # the parent's environment, replayed below
            added["replay_mismatches"] += _start_branch(parent, st.position, builder, vec, r)
            k = int(parent.turn_ids[st.position])
            head = slice(parent.turns[k].policy_start, st.position)
            partial[r] = (parent.tokens[head].tolist(), parent.old_logprobs[head].tolist(),
                          {name: v[head].tolist() for name, v in parent.token_values.items()})
            used[r], turn_of[r] = st.position - parent.prompt_len, k
            budget = min(config.turn_cap - len(partial[r][0]), config.max_response_tokens - used[r])
            backend.branch(r, st.parent, st.position, max(budget, 0), st.key_row)
            added["branches"] += 1
        with_backend.add(r)

    def run_hooks() -> None:
        """The prompts whose episodes all ended: build, score, ask the hooks (no tool call in flight)."""
        while ready:
            p = ready.pop(0)
            rows = [r for r in range(len(builders)) if prompt_of[r] == p]
            build([r for r in rows if r not in built])
            starts = list(hooks.after_group(p, rows, [built[r] for r in rows]))
            for st in starts:
                start(p, st)
            for r in rows:  # branches keep the blocks they share; a fresh episode the prompt's
                if r not in released:
                    backend.release(r)
                    released.add(r)

    def timed_step(calls_per_row):
        t0 = time.perf_counter()
        try:
            return vec.step(calls_per_row)
        finally:
            tool_s[0] += time.perf_counter() - t0

    def resolve(future, calls_per_row) -> None:
        steps = future.result()
        for r in [i for i, c in enumerate(calls_per_row) if c is not None]:
            step, calls = steps[r], calls_per_row[r]
            if step is None:  # the environment had nothing to do: the policy speaks again
                if turn_of[r] >= config.max_turns:
                    end(r, "max_turns")
                else:
                    backend.append(r, [], int(max(config.max_response_tokens - used[r], 0)))
                    with_backend.add(r)
                continue
            if step.error is not None:
                env_errors.append(f"row {r}, turn {int(turn_of[r]) - 1}: {step.error}")
                end(r, "env_error")
                continue
            # The episode ends after this turn: its calls ran, so their results are recorded on the
            # turn (no tokens: no policy token follows; its hindsight blocks and the records read
            # them). They do not count against max_response_tokens (docs/spec.md §1.1).
            if step.done or (not calls and step.user_message is None):
                _final_results(builders[r], calls, step)
                end(r, "answer" if not calls else "env_done")
                continue
            if turn_of[r] >= config.max_turns:
                _final_results(builders[r], calls, step)
                end(r, "max_turns")
                continue
            sid, spans, header = user_suffix(tokenizer, list(step.observations), step.user_message,
                                             enable_thinking=config.enable_thinking,
                                             template=config.observation_template)
            if used[r] + len(sid) >= config.max_response_tokens:
                _final_results(builders[r], calls, step)
                end(r, None, truncated=True)
                continue
            builders[r].add_observation(sid, list(step.observations), spans, header, env_info=dict(step.info))
            used[r] += len(sid)
            if ctxs is None:
                backend.append(r, sid, int(config.max_response_tokens - used[r]))
            else:
                ids, rewind = ctxs.observation(r, sid)
                backend.append(r, ids, int(config.max_response_tokens - used[r]), rewind=rewind)
            with_backend.add(r)

    try:
        vec.start([tasks[p] for p in prompt_of], env_seed)
        backend.begin(prompts, group_size)
        with_backend = set(range(n))
        pending = None  # (future, calls per row) of the tool calls in flight
        while live or ready:
            if live and not with_backend and pending is None and not ready:
                raise RuntimeError(f"rollout: rows {sorted(live)[:8]} are neither generating nor in a tool call")
            outs = backend.generate() if with_backend else {}
            with_backend -= outs.keys()
            if pending is not None:
                resolve(*pending)
                pending = None
            run_hooks()
            calls_per_row: list = [None] * len(builders)
            for r in sorted(outs):
                out = outs[r]
                turn_of[r] += 1
                head_len = 0  # tokens of a branch's first turn that its parent sampled (counted there)
                if partial[r] is not None:  # a branch's first turn: the parent's part, then its own
                    head_ids, head_lps, head_sig = partial[r]
                    partial[r] = None
                    sig = None if out.signals is None and not head_sig else {
                        k: head_sig.get(k, [0.0] * len(head_ids)) + (out.signals or {}).get(k, [0.0] * len(out.ids))
                        for k in dict.fromkeys([*head_sig, *(out.signals or {})])}
                    ids_all, head_len = head_ids + list(out.ids), len(head_ids)
                    out = GeneratedTurn(ids_all, head_lps + list(out.logprobs),
                                        tokenizer.decode(ids_all, skip_special_tokens=False), out.stopped, sig)
                if not out.ids:  # no budget left for even one token
                    end(r, None, truncated=True)
                    continue
                parsed = parse_turn(out.text, calls_in_think=config.calls_in_think)
                builders[r].add_policy_turn(out.ids, out.logprobs, out.text, parsed.calls, parsed.answer,
                                            signals=out.signals)
                if ctxs is not None:
                    ctxs.turn(r, out.ids)
                used[r] += len(out.ids) - head_len
                generated += len(out.ids) - head_len
                final_text[r] = out.text
                if not out.stopped:
                    end(r, None, truncated=True)
                    continue
                if config.end_on_unparsable_turn and parsed.calls and all_unparsable(parsed.calls):
                    end(r, "unparsable")  # the released code ends the episode when no call parses
                    continue
                calls_per_row[r] = list(parsed.calls)
            if any(c is not None for c in calls_per_row):
                pending = (tools.submit(timed_step, calls_per_row), calls_per_row)
                if not overlap:  # a lockstep backend has nothing to decode meanwhile
                    resolve(*pending)
                    pending = None
            if progress is not None:
                progress(RolloutProgress(len(builders) - len(live), len(builders), max(turn_of), generated,
                                         time.perf_counter() - t_start))
        turns_run = max(turn_of)
        if len(built) < len(builders):
            build([r for r in range(len(builders)) if r not in built])
    finally:
        tools.shutdown(wait=True)
        vec.close()

    trajectories = [built[r] for r in range(len(builders))]
    elapsed = time.perf_counter() - t_start
    if progress is not None:
        progress(RolloutProgress(len(builders), len(builders), turns_run, generated, elapsed, done=True))
    if env_errors:
        print(f"rollout: {len(env_errors)} episode(s) ended by an environment error; first: "
              f"{env_errors[0]}", file=sys.stderr, flush=True)
    # episodes: every one run, those the hooks added included; tokens: after the prompts (a branch's
    # prefix counted again: what it decoded itself is the backend's decoded_tokens)
    stats = {"rollout_s": elapsed, "tool_s": tool_s[0], "env_errors": float(len(env_errors)),
             "episodes": float(len(builders)), "tokens": float(sum(t.length - t.prompt_len for t in trajectories))}
    if hooks is not None:
        stats.update(added)
    if ctxs is not None:
        stats["elided_observations"] = float(ctxs.elisions)
        stats["reprefill_tokens"] = float(ctxs.reprefill)
    for k, v in getattr(policy, "timings", {}).items():
        stats[f"{k}_s"] = v
    if isinstance(policy, ModelPolicy):
        stats["compilations"] = float(policy.compilations())
        stats["decoded_tokens"] = float(policy.decoded_tokens)
    if hasattr(policy, "stats"):
        stats.update({f"engine/{k}": v for k, v in policy.stats().items()})
        stats["compilations"] = float(policy.compilations())
        stats["decoded_tokens"] = stats.get("engine/decoded_tokens", 0.0)
    return RolloutResult(trajectories, stats)


def _final_results(builder: TrajectoryBuilder, calls, step) -> None:
    """The results of the last turn's calls when its episode ends after them (TrajectoryBuilder.
    add_final_results); nothing when the turn made no call."""
    if calls and len(step.observations) == len(calls):
        builder.add_final_results(list(step.observations), env_info=dict(step.info))


def _start_branch(parent: Trajectory, position: int, builder: TrajectoryBuilder, vec: VectorEnv, r: int) -> int:
    """Set up a branch of `parent` at its policy token `position` (in turn k): `builder` gets the
    parent's turns 0..k-1 and their observations as recorded, and environment episode r (started
    with the parent's seed) replays their calls, so it stands where the parent's stood before turn
    k. Returns how many replayed observations differ from the recorded ones (0 for a deterministic
    environment; the branch keeps the recorded ones, which its KV holds)."""
    if not 0 <= position < parent.length or not parent.policy_mask[position]:
        raise ValueError(f"branch position {position} is not a policy token of the parent ({parent.length} tokens)")
    k = int(parent.turn_ids[position])
    mismatches = 0
    for j, t in enumerate(parent.turns[:k]):
        span = slice(t.policy_start, t.policy_end)
        builder.add_policy_turn(parent.tokens[span], parent.old_logprobs[span], t.text, t.calls, t.answer,
                                signals={name: v[span] for name, v in parent.token_values.items()})
        steps = vec.step([None] * r + [list(t.calls)] + [None] * (len(vec.episodes) - r - 1))
        if steps[r] is None or list(steps[r].observations) != list(t.results):
            mismatches += 1
        if t.has_observation:
            builder.add_observation(parent.tokens[t.obs_start:t.obs_end], t.results,
                                    [(a - t.obs_start, b - t.obs_start) for a, b in t.result_spans],
                                    parent.turns[j + 1].header_start - t.obs_start)
    return mismatches
