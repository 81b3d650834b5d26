"""A judge model: batched greedy judging of trajectories (or of prepared prompts) with the
project's KV-cached sampler (`rollout.driver.ModelPolicy`, one turn per prompt, up to
`judge.max_new_tokens` tokens), parsed strictly (turnsight_jax.judge.parse)."""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from turnsight_jax.assets import default_tokenizer_dir
from turnsight_jax.chat.tokenizer import check_vocab_fits, load_tokenizer
from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.judge import prompt as judge_prompt
from turnsight_jax.judge.parse import Verdict, parse_verdict
from turnsight_jax.judge.settings import JudgeSettings
from turnsight_jax.rollout.driver import ModelPolicy, RolloutConfig
from turnsight_jax.rollout.sampler import SamplingParams

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class Judgment:
    """One judged prompt. text: the judge's output as decoded (stop token included when it
    stopped); verdict: the parse; label: verdict.label, or the default when malformed;
    generated_tokens / prompt_tokens: its cost; prompt_truncated: the transcript's middle was cut."""

    text: str
    verdict: Verdict
    label: int
    generated_tokens: int
    prompt_tokens: int
    prompt_truncated: bool = False


class Judge:
    """A Qwen3 judge (graphdef, params, its tokenizer) with its settings.

    `judge_trajectories(trajs, tasks)` -> one Judgment per trajectory; `judge_users(texts)` for
    prepared user messages (distillation's held-out rows). Greedy, `settings.batch_size` prompts
    per decode; `mesh`: run under that mesh (parameters sharded on it), None: one device."""

    def __init__(self, graphdef, params, tokenizer, settings: JudgeSettings, *, mesh=None):
        self.graphdef, self.params, self.tokenizer, self.settings, self.mesh = graphdef, params, tokenizer, settings, mesh
        self.seconds = 0.0  # time spent judging, for the caller's cost report

    @classmethod
    def load(cls, settings: JudgeSettings, *, mesh=None, path: str | pathlib.Path | None = None) -> "Judge":
        """The judge of `settings.checkpoint` (or `path`): weights in settings.dtype, its folder's
        tokenizer when it has one, else the bundled Qwen3 tokenizer."""
        from turnsight_jax.models.weights import load_pretrained

        folder = pathlib.Path(path or settings.checkpoint)
        model = load_pretrained(folder, dtype=DTYPES[settings.dtype], mesh=mesh)
        tok = load_tokenizer(folder if (folder / "tokenizer.json").is_file() else default_tokenizer_dir())
        check_vocab_fits(tok, model.config.vocab_size)
        return cls(*nnx.split(model), tok, settings, mesh=mesh)

    def prompts(self, users: Sequence[str]) -> list[judge_prompt.JudgePrompt]:
        s = self.settings
        return [judge_prompt.prompt_ids(self.tokenizer, u, rationale=s.rationale, max_prompt_tokens=s.max_prompt_tokens)
                for u in users]

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[tuple[str, int]]:
        """Greedy outputs (text, generated tokens) of prompt token ids, `batch_size` at a time."""
        s = self.settings
        rc = RolloutConfig(max_turns=1, max_prompt_tokens=s.max_prompt_tokens, max_response_tokens=s.max_new_tokens,
                           max_turn_tokens=s.max_new_tokens, enable_thinking=False)
        greedy = SamplingParams(greedy=True, logprobs=False)
        out: list[tuple[str, int]] = []
        t0 = time.perf_counter()
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            for i in range(0, len(prompts), s.batch_size):
                part = prompts[i:i + s.batch_size]
                policy = ModelPolicy(self.graphdef, self.params, self.tokenizer, sampling=greedy, config=rc,
                                     cache_dtype=self.params_dtype)
                policy.begin(part, 1)
                turns = policy.generate(np.ones(len(part), bool), np.full(len(part), s.max_new_tokens, np.int64))
                out.extend((t.text, len(t.ids)) for t in turns)
        self.seconds += time.perf_counter() - t0
        return out

    @property
    def params_dtype(self) -> Any:
        return DTYPES[self.settings.dtype]

    def judge_users(self, users: Sequence[str]) -> list[Judgment]:
        """Judge prepared user messages (prompt.user_text)."""
        prompts = self.prompts(users)
        outs = self.generate([p.ids for p in prompts])
        judgments = []
        for p, (text, n) in zip(prompts, outs):
            v = parse_verdict(text, rationale=self.settings.rationale)
            judgments.append(Judgment(text, v, v.label_or(self.settings.default_label), n, len(p.ids), p.truncated))
        return judgments

    def users(self, trajs: Sequence[Trajectory], tasks: Sequence[Task]) -> list[str]:
        if len(trajs) != len(tasks):
            raise ValueError(f"{len(trajs)} trajectories but {len(tasks)} tasks")
        return [judge_prompt.user_text(task, traj, reference=self.settings.reference) for traj, task in zip(trajs, tasks)]

    def judge_trajectories(self, trajs: Sequence[Trajectory], tasks: Sequence[Task]) -> list[Judgment]:
        """One Judgment per trajectory (row i is a trajectory of tasks[i])."""
        return self.judge_users(self.users(trajs, tasks))


_CACHE: dict[tuple, Judge] = {}


def cached_judge(settings: JudgeSettings, mesh=None) -> Judge:
    """The judge of `settings`, loaded once per process (a training run judges every step); one
    judge is kept, a different one replaces it."""
    key = (str(pathlib.Path(settings.checkpoint).resolve()), settings.dtype, None if mesh is None else id(mesh))
    judge = _CACHE.get(key)
    if judge is None:
        _CACHE.clear()
        judge = _CACHE[key] = Judge.load(settings, mesh=mesh)
    elif judge.settings != settings:  # same weights, other knobs (rationale, limits): no reload
        judge = _CACHE[key] = Judge(judge.graphdef, judge.params, judge.tokenizer, settings, mesh=mesh)
    return judge
