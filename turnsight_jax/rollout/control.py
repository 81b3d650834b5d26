"""The rollout-controller interface of the paged engine (docs/rollout_methods.md, "The interface").

A rollout method that changes *what is sampled* acts at two levels:

* **In the engine** (`EngineController`, given to `rollout.engine.PagedEngine(controller=...)`):
  it declares the per-token signals it reads (`DecodeSignals`), which the compiled decode computes
  from each step's logits, and only then (static flags: a controller that declares none leaves the
  decode's program as it is). After every decode chunk the engine hands it each row's new tokens
  with their log-probs and signals (`Chunk`, host arrays); it may answer with an `Edit`: keep only
  the first tokens of the chunk (the sequence is rolled back, its KV slots rewritten by what
  follows) and force tokens next (they go through the decode like drawn ones: their log-probs are
  the policy's). When a turn completes, `turn_done` may ask for the turn to be sampled again from
  the state it started in (the sequence rolled back to the turn's first slot: no prefill).
* **Around the driver** (`RolloutHooks`, given to `rollout.driver.rollout(hooks=...)`): when the
  last live episode of a prompt ends, `after_group` sees the prompt's finished trajectories (built
  and scored) and may start more episodes of that prompt before its KV is released
  (`EpisodeStart`): fresh rollouts of the prompt, which reuse the prompt's prefilled blocks, or
  branches, which continue a finished episode from one of its policy tokens and share the blocks
  of that prefix (only the block holding the branch point is copied).

What is computed where: the vocabulary-sized math (entropy, top-j log-probs, the sampled token's
log-prob) runs inside the compiled decode, per step; the host sees [steps] arrays per row and
chunk and keeps whatever running statistics a controller needs (a window, a running min/max).
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

# The per-token signals the decode can compute, by name (GeneratedTurn.signals, Trajectory.token_values).
ENTROPY = "entropy"  # H_t = -sum_v p_t(v) log p_t(v) of the tempered, untruncated distribution
TOP_J_NLL = "top_j_nll"  # C_t = -(1/j) sum of the j largest log p_t(v), same distribution


@dataclasses.dataclass(frozen=True)
class DecodeSignals:
    """What the compiled decode computes per token besides the token and its log-prob (static:
    part of the decode program's cache key). entropy: H_t; top_j: j > 0 computes C_t over the j
    most likely tokens (0: off). Both are of the distribution the log-probs are of, softmax(logits
    / T) over the whole vocabulary (rollout.sampler; top-k / top-p only restrict the draw)."""

    entropy: bool = False
    top_j: int = 0

    def __post_init__(self):
        if isinstance(self.top_j, bool) or not isinstance(self.top_j, int) or self.top_j < 0:
            raise ValueError(f"DecodeSignals.top_j must be an int >= 0, got {self.top_j!r}")

    @property
    def names(self) -> tuple[str, ...]:
        return (ENTROPY,) * self.entropy + (TOP_J_NLL,) * (self.top_j > 0)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One row's part of a decode chunk, as the engine hands it to `EngineController.on_chunk`.

    row: the episode; turn: its turn index (0-based); attempt: how many times this turn was sampled
    again before (`turn_done`); start: tokens of the turn kept before this chunk (0: the turn, or
    this attempt of it, starts here); room: tokens the turn may still emit before this chunk (its
    budget); tokens, logprobs [n] and signals {name: [n]} float32: the n tokens the chunk emitted
    for the row, in order (a stop token included, last)."""

    row: int
    turn: int
    attempt: int
    start: int
    room: int
    tokens: np.ndarray
    logprobs: np.ndarray
    signals: dict[str, np.ndarray]


@dataclasses.dataclass(frozen=True)
class Edit:
    """A controller's answer to a chunk: keep the chunk's first `keep` tokens (0 <= keep <= n) and
    drop the rest (the sequence is rolled back: their KV slots are rewritten by what follows, their
    draws are re-used, so the result does not depend on the chunk size), then force `force` as the
    turn's next tokens; each forced token is recorded with the policy's log-prob of it in its
    context (the decode scores it like a drawn token). With keep < n and nothing forced the turn
    ends after the kept tokens, unstopped (truncated); to stop a turn, force the stop token."""

    keep: int
    force: tuple[int, ...] = ()


class EngineController:
    """Hooks the paged engine calls while it decodes (module docstring). The defaults do nothing;
    a controller overrides what it needs. One controller object serves one engine (one rollout):
    it may keep per-row state keyed by `Chunk.row`."""

    signals: DecodeSignals = DecodeSignals()

    def on_chunk(self, chunk: Chunk) -> Edit | None:
        """Called after every decode chunk, for each row that emitted tokens; None keeps them all."""
        return None

    def turn_done(self, row: int, turn: int, attempt: int, ids: np.ndarray, logprobs: np.ndarray,
                  signals: dict[str, np.ndarray]) -> bool:
        """Called when a turn completed (stop token or budget), with the whole turn's tokens,
        log-probs and signals; True: discard it and sample the turn again from the state it started
        in (its first slot: the sequence is rolled back, nothing is prefilled again)."""
        return False


@dataclasses.dataclass(frozen=True)
class EpisodeStart:
    """An episode a `RolloutHooks.after_group` adds to a running rollout.

    key_row: the episode's global row: its sampling key is fold_in(key(seed), key_row) and its
    environment's seed derives from it (a number no other episode of the step uses). group_id: its
    `Trajectory.group_id`. parent: None for a fresh rollout of the prompt (it reuses the prompt's
    prefilled blocks when the prompt is still held); else a finished row of the same prompt to
    branch from, keeping the parent's tokens [0, position), position the index (in the parent's
    tokens) of a policy token: the branch draws that token anew and continues the episode from
    there (its environment replays the parent's calls of the earlier turns)."""

    key_row: int
    group_id: int
    parent: int | None = None
    position: int = 0


class RolloutHooks(Protocol):
    def after_group(self, prompt: int, rows: Sequence[int], trajectories: Sequence) -> Sequence[EpisodeStart]:
        """Called when every episode of prompt `prompt` (an index into the rollout's tasks) ended:
        `rows` all its episodes so far (the first G and those added before), `trajectories` their
        built, scored Trajectory records, in the same order. The returned episodes start now; an
        empty answer closes the prompt (its KV blocks are released)."""
