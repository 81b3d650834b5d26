"""Trajectories: the token stream of one multi-turn rollout, its masks and per-turn records.

A trajectory is ``prompt + turn_0 + obs_0 + turn_1 + obs_1 + ... + turn_{K-1}``:

- ``prompt``: ``template.prompt_ids`` (ends with the generation prompt = turn 0's assistant header);
- ``turn_k``: the policy's sampled tokens, appended as sampled (never re-tokenised), ending with the
  sampled ``<|im_end|>`` unless the turn was cut at the length limit;
- ``obs_k``: ``template.observation_suffix_ids`` of turn k's tool results; it ends with turn k+1's
  assistant header. The last turn has none: when the episode ended after its calls ran (max_turns,
  the response budget) their results are recorded on its TurnRecord only (no policy token reads
  them; the hindsight blocks do), so the token stream never ends in an observation.

Only ``turn_k`` tokens are policy tokens (``policy_mask``; ``turn_ids`` = k there, -1 elsewhere).
The training batch built from trajectories is turnsight_jax.rl.batch.

The tokens are what happened, every observation in full. When the policy generated its turns
under an observation window (methods.mm_grpo: only the most recent observations in full, older ones
replaced by a placeholder), ``Trajectory.contexts`` records what each turn saw
(`ElidedContexts`) and `turn_context` rebuilds it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from turnsight_jax.chat.types import Call

# Qwen3 vocabulary ids of <|im_start|> / <|im_end|>; tests check them against the fixture tokenizer.
# Pass `tokenizer.special_ids(tok)` values for any other tokenizer.
QWEN3_IM_START_ID = 151644
QWEN3_IM_END_ID = 151645

# multiples of 128 up to 2048 (little padding on short rollouts), then powers of two up to 32768


@dataclasses.dataclass(frozen=True)
class TurnRecord:
    """Where one policy turn and its observation sit in the trajectory (token indices).

    header_start: first token of this turn's assistant header ``<|im_start|>assistant\\n...``.
    policy_start, policy_end: the policy tokens [start, end), including the sampled <|im_end|>.
    text: decoded policy text. calls: parsed calls. answer: parsed final answer (or None).
    results: one observation text per call, in order. The last turn's results are recorded even
      when the episode ended after its calls ran (TrajectoryBuilder.add_final_results): then they
      have no observation suffix (obs_start == obs_end) and no result spans.
    obs_start, obs_end: the observation suffix appended after this turn ([e, e) when none).
    result_spans: token span [start, end) of each result's text inside the trajectory.
    env_info: what the environment reported about this turn beyond its observations
      (envs.base.StepResult.info; e.g. "faults": the faults envs.faults injected, per call).
    """

    header_start: int
    policy_start: int
    policy_end: int
    text: str
    calls: list[Call]
    results: list[str] = dataclasses.field(default_factory=list)
    obs_start: int = -1
    obs_end: int = -1
    result_spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    answer: str | None = None
    env_info: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_policy_tokens(self) -> int:
        return self.policy_end - self.policy_start

    @property
    def has_observation(self) -> bool:
        return self.obs_end > self.obs_start


@dataclasses.dataclass(frozen=True)
class ElidedContexts:
    """What each turn's context showed when some observations were elided (an observation window).

    counts: per turn k, how many of the trajectory's observations (the non-empty observation
    suffixes, in order) were replaced when turn k was generated: always the first counts[k] of
    them, non-decreasing in k. placeholder_ids: the ids that replaced each of them, a whole
    observation suffix (it ends with the same assistant header as every observation suffix).
    """

    counts: tuple[int, ...]
    placeholder_ids: tuple[int, ...]


@dataclasses.dataclass
class Trajectory:
    """One rollout.

    tokens: int32 [L]; policy_mask: bool [L]; turn_ids: int32 [L] (turn index on policy tokens,
    -1 elsewhere); old_logprobs: float32 [L] (sampling log-probs on policy tokens, 0 elsewhere);
    prompt_len: number of prompt tokens; turns: K TurnRecords; reward: outcome reward;
    metrics: free-form per-episode numbers (the environment's scores, turn statistics);
    truncated / finish_reason: how the rollout ended ("answer", "max_turns", "length", ...).
    contexts: None when every turn saw the trajectory itself before it; else which observations
    were elided from each turn's context (ElidedContexts; `turn_context`).
    token_values: per-token float32 [L] values recorded with the rollout, 0 off the policy tokens:
    the decode's signals a rollout controller declared ("entropy", "top_j_nll";
    rollout.control), and values a controller attaches (APPO's "appo_omega", methods.appo).
    """

    tokens: np.ndarray
    policy_mask: np.ndarray
    turn_ids: np.ndarray
    old_logprobs: np.ndarray
    prompt_len: int
    turns: list[TurnRecord]
    group_id: int
    task_id: Any
    reward: float = 0.0
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    truncated: bool = False
    finish_reason: str = ""
    contexts: ElidedContexts | None = None
    token_values: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        n = self.tokens.shape[0]
        for name, dtype in (("tokens", np.int32), ("policy_mask", np.bool_), ("turn_ids", np.int32), ("old_logprobs", np.float32)):
            arr = getattr(self, name)
            if arr.ndim != 1 or arr.shape[0] != n or arr.dtype != dtype:
                raise ValueError(f"Trajectory.{name} must be {np.dtype(dtype).name}[{n}], got {arr.dtype}{list(arr.shape)}")
        for name, arr in self.token_values.items():
            if arr.ndim != 1 or arr.shape[0] != n or arr.dtype != np.float32:
                raise ValueError(f"Trajectory.token_values[{name!r}] must be float32[{n}], got {arr.dtype}{list(arr.shape)}")
        if self.contexts is not None:
            _check_contexts(self)

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def num_turns(self) -> int:
        return len(self.turns)


def observation_turns(traj: Trajectory) -> list[int]:
    """The turns whose observation suffix is non-empty, in order: observation j is that of turn
    observation_turns(traj)[j] (what ElidedContexts.counts counts)."""
    return [k for k, t in enumerate(traj.turns) if t.has_observation]


def _check_contexts(traj: Trajectory) -> None:
    c = traj.contexts
    counts = list(c.counts)
    if len(counts) != traj.num_turns:
        raise ValueError(f"Trajectory.contexts has {len(counts)} counts for {traj.num_turns} turns")
    obs = observation_turns(traj)
    for k, e in enumerate(counts):
        before = sum(j < k for j in obs)
        if not 0 <= e <= before or (k and e < counts[k - 1]):
            raise ValueError(f"Trajectory.contexts: turn {k} elides {e} observation(s) but {before} precede it "
                             f"(counts must be non-decreasing, each at most the observations before its turn)")
    if counts and counts[-1] and not c.placeholder_ids:
        raise ValueError("Trajectory.contexts: observations are elided but placeholder_ids is empty")


def turn_context(traj: Trajectory, k: int) -> tuple[np.ndarray, int]:
    """The ids [n] int32 the policy had before turn k's policy tokens (its assistant header
    included), and where that header starts in them: ``tokens[:policy_start]`` with the first
    ``contexts.counts[k]`` observation suffixes replaced by the placeholder. Without `contexts`,
    ``(tokens[:policy_start], header_start)``."""
    turn = traj.turns[k]
    if traj.contexts is None or traj.contexts.counts[k] == 0:
        return traj.tokens[: turn.policy_start], turn.header_start
    placeholder = np.asarray(traj.contexts.placeholder_ids, np.int32)
    parts, at = [], 0
    for j in observation_turns(traj)[: traj.contexts.counts[k]]:
        t = traj.turns[j]
        parts += [traj.tokens[at: t.obs_start], placeholder]
        at = t.obs_end
    parts.append(traj.tokens[at: turn.policy_start])
    ids = np.concatenate(parts)
    return ids, len(ids) - (turn.policy_start - turn.header_start)


# finish_reason of a padding row (`padding_trajectory`).
PADDING = "padding"


def padding_trajectory(like: Trajectory) -> Trajectory:
    """A row that fills a prompt's block of the batch when a rollout controller forms groups of
    unequal size (rl.batch): one token (the first of `like`, so every forward has a real token to
    attend to), no policy tokens, no turns, in no group (group_id -1), reward 0."""
    return Trajectory(tokens=like.tokens[:1].copy(), policy_mask=np.zeros(1, bool), turn_ids=np.full(1, -1, np.int32),
                      old_logprobs=np.zeros(1, np.float32), prompt_len=1, turns=[], group_id=-1,
                      task_id=like.task_id, finish_reason=PADDING)


def is_padding(traj: Trajectory) -> bool:
    return traj.finish_reason == PADDING


class TrajectoryBuilder:
    """Assembles a Trajectory turn by turn during a rollout.

    Call order: ``add_policy_turn`` then ``add_observation``, alternating; optionally
    ``add_final_results`` after the last policy turn (its calls ran but the episode ends: results
    without tokens); optionally ``mark_truncated`` (after which nothing more may be added); then
    ``build``.

    Args:
      prompt_ids: token ids of the rendered prompt, ending with the generation prompt.
      group_id: index of the prompt group (siblings share it).
      task_id: the task's id (any value).
      im_start_id / im_end_id: ids of <|im_start|> / <|im_end|> (defaults: the Qwen3 vocabulary).
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        group_id: int,
        task_id: Any,
        *,
        im_start_id: int = QWEN3_IM_START_ID,
        im_end_id: int = QWEN3_IM_END_ID,
    ):
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"prompt_ids must be a non-empty 1-D id sequence, got shape {prompt.shape}")
        starts = np.flatnonzero(prompt == im_start_id)
        if starts.size == 0:
            raise ValueError(
                f"prompt has no <|im_start|> (id {im_start_id}); it must end with the generation prompt "
                "(pass im_start_id=special_ids(tokenizer).im_start for a non-Qwen3 tokenizer)"
            )
        self.group_id = int(group_id)
        self.task_id = task_id
        self._im_start_id = int(im_start_id)
        self._im_end_id = int(im_end_id)
        self._prompt_len = int(prompt.size)
        self._tokens: list[np.ndarray] = [prompt.astype(np.int32)]
        self._logprobs: list[np.ndarray] = [np.zeros(prompt.size, np.float32)]
        self._turn_ids: list[np.ndarray] = [np.full(prompt.size, -1, np.int32)]
        self._values: list[dict[str, np.ndarray]] = [{}]  # per segment: the policy turn's signals
        self._length = int(prompt.size)
        self._next_header = int(starts[-1])  # turn 0's header = the prompt's generation prompt
        self._turns: list[TurnRecord] = []
        self._expect_policy = True
        self._truncated = False
        self._truncation_reason = ""
        self._closed = False  # add_final_results: the episode ended after its last turn's calls

    @property
    def length(self) -> int:
        """Current number of tokens (prompt + everything appended so far)."""
        return self._length

    @property
    def num_turns(self) -> int:
        return len(self._turns)

    @property
    def turns(self) -> list[TurnRecord]:
        return list(self._turns)

    def _append(self, ids: np.ndarray, logprobs: np.ndarray, turn: int, values=None) -> tuple[int, int]:
        start = self._length
        self._tokens.append(ids)
        self._logprobs.append(logprobs)
        self._turn_ids.append(np.full(ids.size, turn, np.int32))
        self._values.append(values or {})
        self._length += int(ids.size)
        return start, self._length

    def _check_open(self, what: str) -> None:
        if self._truncated:
            raise RuntimeError(f"cannot {what}: the trajectory was marked truncated ({self._truncation_reason})")

    def add_policy_turn(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        text: str,
        calls: Sequence[Call],
        answer: str | None = None,
        signals: dict[str, Sequence[float]] | None = None,
    ) -> TurnRecord:
        """Append the policy's sampled tokens for the next turn.

        Args:
          token_ids: int [n >= 1], as sampled (including the sampled <|im_end|>, if any).
          logprobs: float [n], the sampler's log-probabilities of those tokens.
          text: decoded text of the turn; calls / answer: from ``parsing.parse_turn``.
          signals: optional {name: float [n]} per-token values of the turn (Trajectory.token_values).
        """
        self._check_open("add a policy turn")
        if self._closed:
            raise RuntimeError("cannot add a policy turn: the last turn's results were recorded as final")
        if not self._expect_policy:
            raise RuntimeError(
                f"turn {len(self._turns)}: add_observation must follow turn {len(self._turns) - 1} before "
                "the next policy turn (the next assistant header is part of the observation suffix)"
            )
        ids = np.asarray(token_ids, dtype=np.int64)
        lp = np.asarray(logprobs, dtype=np.float32)
        k = len(self._turns)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"turn {k}: a policy turn needs at least one token, got shape {ids.shape}")
        if lp.shape != ids.shape:
            raise ValueError(f"turn {k}: {ids.size} tokens but logprobs has shape {lp.shape}")
        if not np.all(np.isfinite(lp)):
            raise ValueError(f"turn {k}: non-finite sampling log-probs")
        values = {name: np.asarray(v, np.float32) for name, v in (signals or {}).items()}
        for name, v in values.items():
            if v.shape != ids.shape:
                raise ValueError(f"turn {k}: {ids.size} tokens but signal {name!r} has shape {v.shape}")
        start, end = self._append(ids.astype(np.int32), lp, k, values)
        record = TurnRecord(
            header_start=self._next_header,
            policy_start=start,
            policy_end=end,
            text=text,
            calls=list(calls),
            obs_start=end,
            obs_end=end,
            answer=answer,
        )
        self._turns.append(record)
        self._expect_policy = False
        return record

    def add_observation(
        self,
        suffix_ids: Sequence[int],
        results: Sequence[str],
        result_spans: Sequence[tuple[int, int]],
        header_offset: int,
        env_info: dict[str, Any] | None = None,
    ) -> TurnRecord:
        """Append the observation suffix after the last policy turn.

        Args:
          suffix_ids: int [S], from ``template.observation_suffix_ids`` (starts with the newline
            after <|im_end|>, ends with the next assistant header).
          results: one observation text per call of the last turn, in order.
          result_spans: each result's token span [start, end) within ``suffix_ids``.
          header_offset: index in ``suffix_ids`` of the next assistant header's <|im_start|>.
          env_info: what the environment reported about the turn (TurnRecord.env_info).
        """
        self._check_open("add an observation")
        if self._closed:
            raise RuntimeError("cannot add an observation: the last turn's results were recorded as final")
        if self._expect_policy:
            raise RuntimeError("add_observation must follow a policy turn")
        k = len(self._turns) - 1
        turn = self._turns[k]
        ids = np.asarray(suffix_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"turn {k}: observation suffix must be a non-empty 1-D id sequence")
        last_token = int(self._tokens[-1][-1])
        if last_token != self._im_end_id:
            raise ValueError(
                f"turn {k} ended with token {last_token}, not <|im_end|> ({self._im_end_id}); an observation "
                "can only follow a completed turn"
            )
        if len(results) != len(turn.calls):
            raise ValueError(f"turn {k}: {len(turn.calls)} calls but {len(results)} results")
        if len(result_spans) != len(results):
            raise ValueError(f"turn {k}: {len(results)} results but {len(result_spans)} result spans")
        if not 0 <= header_offset < ids.size or int(ids[header_offset]) != self._im_start_id:
            raise ValueError(
                f"turn {k}: header_offset {header_offset} does not point at <|im_start|> ({self._im_start_id}) "
                f"in the {ids.size}-token suffix"
            )
        for a, b in result_spans:
            if not 0 <= a <= b <= ids.size:
                raise ValueError(f"turn {k}: result span ({a}, {b}) outside the {ids.size}-token suffix")
        start, end = self._append(ids.astype(np.int32), np.zeros(ids.size, np.float32), -1)
        record = dataclasses.replace(
            turn,
            results=list(results),
            obs_start=start,
            obs_end=end,
            result_spans=[(start + a, start + b) for a, b in result_spans],
            env_info=dict(env_info or {}),
        )
        self._turns[k] = record
        self._next_header = start + int(header_offset)
        self._expect_policy = True
        return record

    def add_final_results(self, results: Sequence[str], env_info: dict[str, Any] | None = None) -> TurnRecord:
        """Record the results of the last turn's calls when the episode ends after them (max_turns,
        the response budget, the environment's done): no observation tokens are appended (no policy
        token follows to read them), the turn keeps obs_start == obs_end and no result spans, and
        its `results` hold the texts, so the hindsight blocks of this turn and the turns before it
        (docs/spec.md §1.1: H holds the results up to min(k + d − 1, K)), the records and the
        viewer show them. Nothing may be added after it but `mark_truncated`.
        """
        self._check_open("add final results")
        if self._closed or self._expect_policy:
            raise RuntimeError("add_final_results must follow a policy turn")
        k = len(self._turns) - 1
        turn = self._turns[k]
        if len(results) != len(turn.calls):
            raise ValueError(f"turn {k}: {len(turn.calls)} calls but {len(results)} results")
        self._turns[k] = dataclasses.replace(turn, results=list(results), env_info=dict(env_info or {}))
        self._closed = True
        return self._turns[k]

    def mark_truncated(self, reason: str = "length") -> None:
        """Record that the rollout was cut (e.g. "length": a turn cut without <|im_end|>)."""
        self._check_open("mark truncated")
        self._truncated = True
        self._truncation_reason = reason

    def build(self, *, reward: float = 0.0, metrics: dict[str, Any] | None = None, finish_reason: str | None = None,
              contexts: ElidedContexts | None = None) -> Trajectory:
        """Concatenate everything into a Trajectory and check it.

        finish_reason: required unless the trajectory was marked truncated (its reason is used) or
        the last turn gave an answer ("answer"). contexts: what the turns saw when an observation
        window elided some observations (Trajectory.contexts).
        """
        if self._truncated:
            if finish_reason is not None and finish_reason != self._truncation_reason:
                raise ValueError(
                    f"finish_reason {finish_reason!r} conflicts with the truncation reason {self._truncation_reason!r}"
                )
            finish_reason = self._truncation_reason
        elif finish_reason is None:
            if self._turns and self._turns[-1].answer is not None:
                finish_reason = "answer"
            else:
                raise ValueError("build(): finish_reason is required when the last turn gave no answer")
        tokens = np.concatenate(self._tokens)
        turn_ids = np.concatenate(self._turn_ids)
        # Observation tokens carry turn id -1 from _append; policy tokens their turn index.
        policy_mask = turn_ids >= 0
        traj = Trajectory(
            tokens=tokens,
            policy_mask=policy_mask,
            turn_ids=turn_ids,
            old_logprobs=np.concatenate(self._logprobs),
            prompt_len=self._prompt_len,
            turns=list(self._turns),
            group_id=self.group_id,
            task_id=self.task_id,
            reward=float(reward),
            metrics=dict(metrics or {}),
            truncated=self._truncated,
            finish_reason=finish_reason,
            contexts=contexts,
            token_values={name: np.concatenate([seg.get(name, np.zeros(ids.size, np.float32))
                                                for seg, ids in zip(self._values, self._tokens)])
                          for name in dict.fromkeys(k for seg in self._values for k in seg)},
        )
        check_trajectory(traj, segments=self._tokens)
        return traj


def check_trajectory(traj: Trajectory, *, segments: Sequence[np.ndarray] | None = None) -> None:
    """Assert the token layout invariants; raise AssertionError naming the first violation.

    tokens = prompt + (policy turn, observation)* in order, with turn records tiling [prompt_len, L)
    exactly; policy_mask / turn_ids / old_logprobs agree with the records. With ``segments`` (the
    appended id arrays, in order), also checks that every segment appears unchanged at its place.
    """
    L = traj.length
    pos = traj.prompt_len
    for k, t in enumerate(traj.turns):
        if t.policy_start != pos:
            raise AssertionError(f"turn {k} starts at {t.policy_start}, expected {pos} (gap or overlap)")
        if not t.header_start < t.policy_start:
            raise AssertionError(f"turn {k}: header_start {t.header_start} not before policy_start {t.policy_start}")
        if not (t.policy_start < t.policy_end <= t.obs_start <= t.obs_end) or t.obs_start != t.policy_end:
            raise AssertionError(f"turn {k}: inconsistent spans {t}")
        for a, b in t.result_spans:
            if not t.obs_start <= a <= b <= t.obs_end:
                raise AssertionError(f"turn {k}: result span ({a}, {b}) outside its observation")
        pos = t.obs_end
    if pos != L:
        raise AssertionError(f"turn records end at {pos} but the trajectory has {L} tokens")
    expected_ids = np.full(L, -1, np.int32)
    for k, t in enumerate(traj.turns):
        expected_ids[t.policy_start : t.policy_end] = k
    if not np.array_equal(traj.turn_ids, expected_ids):
        raise AssertionError("turn_ids disagree with the turn records")
    if not np.array_equal(traj.policy_mask, expected_ids >= 0):
        raise AssertionError("policy_mask disagrees with the turn records")
    if np.any(traj.old_logprobs[~traj.policy_mask] != 0):
        raise AssertionError("old_logprobs must be 0 off policy tokens")
    if segments is not None:
        offset = 0
        for i, seg in enumerate(segments):
            if not np.array_equal(traj.tokens[offset : offset + seg.size], seg):
                raise AssertionError(f"segment {i} was altered in the concatenated tokens")
            offset += seg.size
        if offset != L:
            raise AssertionError(f"segments hold {offset} tokens but the trajectory has {L}")
