"""SLIM's trainer side: the audits, the writer, and the library's files (docs/signal_methods.md).

`SlimRunner.start` is called by the trainer for a method whose rollout controller is "slim"
(`rl.method=slim`); it builds the library (`slim.initial`, or the one saved with the checkpoint
the run resumes from) and the fixed set of validation tasks the audits run on. After every
`slim.audit_every`-th step, `after_step`:

1. rolls out the audit tasks with the full library S (greedy, or `slim.audit_samples` samples at
   `slim.audit_temperature`, one fixed seed per audit) and, for every active skill s_k, again
   with S \\ {s_k} on the tasks s_k is shown on (greedy: only those tasks, the others' prompts
   are unchanged; sampled: every task, so each task keeps its position's random numbers:
   common random numbers);
2. Eval = the mean outcome reward (Solve-F1) per task; Δ_k = mean over s_k's tasks of
   reward(S) − reward(S \\ {s_k}); `slim.update_audit` updates EMAs and bands;
3. counts each task type's failure rate in the full-library rollouts (`slim.failing_types`) and,
   for a type failing for `slim.expand_patience` audits while the library has room, has the
   writer (`slim.writer`: the current policy, or a Hugging Face Qwen3 folder) write a skill from
   up to `slim.writer_trajectories` failed trajectories of that type (slim_text.writer_prompt),
   cleaned and checked (slim_text.clean_skill, degenerate, the prompt budget); a rejected text is
   a failed expansion in the history, never an error.

The audits read only the validation tasks and the policy, which every process holds whole, so
every process computes the same library (no per-process rollouts are involved). The validation
tasks: built-in tasks from a seed stream of their own (disjoint from the run's training and
held-out tasks), or for file sources a seeded sample of the training rows; either way stratified
by task type (types in turn), so every type is audited.
"""

from __future__ import annotations

import dataclasses
import pathlib
import random
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections as mlc
import numpy as np

from turnsight_jax.chat import template as tmpl
from turnsight_jax.chat import tokenizer as tok_lib
from turnsight_jax.methods.privileged_blocks import default_skills_path, load_skills
from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError
from turnsight_jax.methods.slim import library as slim, text as slim_text
from turnsight_jax.methods.slim.library import SkillLibrary, SlimConfig, check_writer
from turnsight_jax.rl.methods import TrainerHook

LIBRARY_FILE = "slim_library.json"  # in each checkpoint step folder, and the latest in the run folder
VALIDATION_SEED_OFFSET = 2  # built-in validation tasks: seed 2*seed + 2 (training 2*seed, held-out 2*seed + 1)


def validation_tasks(cfg: mlc.ConfigDict, scfg: SlimConfig, train_tasks: Sequence[Task]) -> list[Task]:
    """`slim.audit_tasks` validation tasks, stratified by task type (module docstring)."""
    if cfg.data.source == "builtin":
        from turnsight_jax.envs.synthetic import generate_tasks  # cycles through the categories: stratified
        from turnsight_jax.sources import synthetic_config

        return generate_tasks(scfg.audit_tasks, seed=2 * cfg.seed + VALIDATION_SEED_OFFSET,
                              categories=tuple(cfg.data.categories), config=synthetic_config(cfg))
    pool = list(train_tasks)
    random.Random(cfg.seed).shuffle(pool)
    by_type: dict[str, list[Task]] = {}
    for t in pool:
        by_type.setdefault(t.category, []).append(t)
    out: list[Task] = []
    queues = [list(v) for _, v in sorted(by_type.items())]
    while len(out) < scfg.audit_tasks and any(queues):
        for q in queues:
            if q and len(out) < scfg.audit_tasks:
                out.append(q.pop(0))
    return out


def initial_texts(scfg: SlimConfig) -> dict[str, str]:
    """{task type or "default": text} of `slim.initial`: "builtin" (the bundled skills), "" (an
    empty library) or a JSON file of that layout; ConfigError naming the problem."""
    if scfg.initial == "":
        return {}
    path = default_skills_path() if scfg.initial == "builtin" else pathlib.Path(scfg.initial)
    try:
        return load_skills(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"slim.initial: {e}") from None


@dataclasses.dataclass
class AuditResult:
    """One audit's numbers: Eval(S), each measured skill's (Δ, n), the failure rate per type."""

    eval_full: float
    deltas: dict[str, tuple[float, int]]
    fail_rates: dict[str, float]
    seconds: float


class SlimRunner(TrainerHook):
    """The skill library of a run and what acts on it (module docstring): the "slim" controller's
    trainer hook (rl.methods.TrainerHook; registered in methods.slim.method)."""

    def __init__(self, cfg: mlc.ConfigDict, scfg: SlimConfig, tok, tasks: Sequence[Task], library: SkillLibrary,
                 workdir: pathlib.Path, mesh, log: Callable[[str], None], base_lengths: dict[str, int]):
        self.cfg, self.scfg, self.tok, self.tasks = cfg, scfg, tok, list(tasks)
        self.library = library
        self.workdir, self.mesh, self.log = workdir, mesh, log
        self.base_lengths = base_lengths  # task type -> the longest prompt without skills
        self._writer = None  # (graphdef, params) of a slim.writer folder, loaded at the first expansion

    # ---- construction ----

    @classmethod
    def start(cls, cfg: mlc.ConfigDict, scfg: SlimConfig, tok, train_tasks: Sequence[Task], workdir: pathlib.Path,
              mesh, *, vocab_size: int, resume_text: str | None, log: Callable[[str], None]) -> "SlimRunner":
        """The run's library: the one saved with the resumed checkpoint (`resume_text`), else
        `slim.initial` (only the skills of the training tasks' types, and the "default" one)."""
        check_writer(scfg, vocab_size)
        tasks = validation_tasks(cfg, scfg, train_tasks)
        if not tasks:
            raise ConfigError("slim: no validation tasks for the audits (no training tasks?)")
        lengths: dict[str, int] = {}
        for t in list(train_tasks) + tasks:
            n = len(tmpl.prompt_ids(tok, t.messages, t.tools, enable_thinking=cfg.rollout.enable_thinking))
            lengths[t.category] = max(lengths.get(t.category, 0), n)
        if resume_text is not None:
            library = slim.from_json(resume_text, where=f"checkpoint {LIBRARY_FILE}")
            log(f"slim: resumed the skill library ({len(library.active)} active, {len(library.skills)} in all)")
        else:
            categories = sorted({t.category for t in train_tasks})
            library = slim.initial_library({k: clean for k, v in initial_texts(scfg).items()
                                            if (clean := slim_text.clean_skill(v, tok, max_tokens=10_000))},
                                           categories)
            if len(library.active) > scfg.max_skills:
                raise ConfigError(f"slim.initial has {len(library.active)} skills for the run's task types, over "
                                  f"slim.max_skills={scfg.max_skills}")
        runner = cls(cfg, scfg, tok, tasks, library, workdir, mesh, log, lengths)
        for task_type in lengths:
            over = runner.prompt_overflow(library, task_type)
            if over:
                raise ConfigError(f"slim: {over}")
        log(f"slim: {len(library.active)} active skills ({', '.join(s.id for s in library.active) or 'none'}); "
            f"audits every {scfg.audit_every} step(s) on {len(tasks)} validation tasks "
            f"({'greedy' if scfg.audit_temperature <= 0 else f'{scfg.audit_samples} samples at T={scfg.audit_temperature:g}'}); "
            f"writer: {scfg.writer or 'the current policy'}")
        return runner

    def prompt_overflow(self, library: SkillLibrary, task_type: str) -> str | None:
        """Why the longest prompt of `task_type` with the library's skills would not fit
        rollout.max_prompt_tokens (None when it fits): the driver refuses such a prompt."""
        block = slim_text.skills_block([s.text for s in library.shown_to(task_type)])
        if not block:
            return None
        # +8: the block's boundary with the system text may tokenise a few ids differently
        need = self.base_lengths.get(task_type, 0) + len(tok_lib.encode(self.tok, block)) + 8
        limit = self.cfg.rollout.max_prompt_tokens
        return None if need <= limit else (f"task type {task_type!r}: prompt with skills ~{need} tokens, over "
                                           f"rollout.max_prompt_tokens={limit}")

    # ---- the step hook ----

    def rollout_state(self) -> SkillLibrary:
        """The library the "slim" controller puts in the prompts (`RolloutContext.state`)."""
        return self.library

    def after_step(self, step: int, graphdef, params, env) -> dict[str, float]:
        """Audit (and expand) after 0-based step `step` when it is due; the slim/* metrics."""
        metrics: dict[str, float] = {}
        before = self.library.counts()
        if (step + 1) % self.scfg.audit_every == 0:
            t0 = time.perf_counter()
            audit, full = self.audit(step, graphdef, params, env)
            self.library = slim.update_audit(self.library, audit.deltas, self.scfg, step=step,
                                             eval_full=audit.eval_full, n_tasks=len(self.tasks))
            self.library, due = slim.failing_types(self.library, audit.fail_rates, self.scfg)
            for task_type in due:
                self.expand(step, task_type, full, graphdef, params)
            metrics["slim/audit_eval"] = audit.eval_full
            metrics["slim/audit_s"] = time.perf_counter() - t0
            if audit.deltas:
                metrics["slim/delta_mean"] = float(np.mean([d for d, _ in audit.deltas.values()]))
            for sid, (d, _) in audit.deltas.items():
                metrics[f"slim/delta/{sid}"] = d
            for s in self.library.skills:
                if s.ema is not None and (s.active or s.retired_step == step):
                    metrics[f"slim/ema/{s.id}"] = s.ema
            for task_type, rate in audit.fail_rates.items():
                metrics[f"slim/fail_rate/{task_type or 'none'}"] = rate
            self.write_latest()
        after = self.library.counts()
        metrics.update({f"slim/{k}": float(v) for k, v in after.items()})
        metrics["slim/expanded"] = float(after["expanded_total"] - before["expanded_total"])
        metrics["slim/retired"] = float(after["retired_total"] - before["retired_total"])
        metrics["slim/bands_keep"] = float(sum(s.status == "keep" for s in self.library.skills))
        metrics["slim/bands_watch"] = float(sum(s.status == "watch" for s in self.library.skills))
        return metrics

    # ---- the audit ----

    def _rollouts(self, graphdef, params, tasks: Sequence[Task], env, seed: int) -> list[list[Any]]:
        """Per task its trajectories (1 greedy, slim.audit_samples sampled), via the held-out
        evaluation's batching and seeding (eval.runner.run_batches)."""
        from turnsight_jax.config import rollout_config
        from turnsight_jax.eval.runner import run_batches
        from turnsight_jax.model_setup import DTYPES
        from turnsight_jax.rollout.driver import ModelPolicy
        from turnsight_jax.rollout.sampler import SamplingParams

        c, s = self.cfg, self.scfg
        greedy = s.audit_temperature <= 0
        sampling = (SamplingParams(greedy=True, logprobs=False) if greedy else
                    SamplingParams(temperature=s.audit_temperature, top_k=int(c.eval.top_k), top_p=float(c.eval.top_p),
                                   logprobs=False))
        rc = rollout_config(c, max_turns=c.eval.max_turns)
        per_task, _ = run_batches(
            lambda chunk, g, sd: ModelPolicy(graphdef, params, self.tok, sampling=sampling, config=rc, seed=sd,
                                             cache_dtype=DTYPES[c.model.compute_dtype]),
            env, list(tasks), tokenizer=self.tok, config=rc, group_size=1 if greedy else s.audit_samples,
            batch_size=c.eval.batch_size, seed=seed)
        return per_task

    def audit(self, step: int, graphdef, params, env) -> tuple[AuditResult, list[list[Any]]]:
        """Eval(S), the leave-one-out Δ's and the failure rates (module docstring); also the
        full-library trajectories per task (the writer's material)."""
        t0 = time.perf_counter()
        seed = self.cfg.seed * 1_000_003 + step  # one seed per audit: every evaluation in it shares it
        lib, tasks = self.library, self.tasks
        full = self._rollouts(graphdef, params, [slim_text.with_skills(t, lib) for t in tasks], env, seed)
        r_full = np.array([np.mean([tr.reward for tr in trajs]) for trajs in full], np.float64)
        greedy = self.scfg.audit_temperature <= 0
        deltas: dict[str, tuple[float, int]] = {}
        for skill in lib.active:
            shown = [i for i, t in enumerate(tasks) if skill.shown_to(t.category)]
            if not shown:
                continue  # no audit task of its type: not measured this time
            run = shown if greedy else list(range(len(tasks)))
            without = self._rollouts(graphdef, params,
                                     [slim_text.with_skills(tasks[i], lib, without=skill.id) for i in run], env, seed)
            r_wo = dict(zip(run, (np.mean([tr.reward for tr in trajs]) for trajs in without)))
            deltas[skill.id] = (float(np.mean([r_full[i] - r_wo[i] for i in shown])), len(shown))
        fails: dict[str, list[float]] = {}
        for t, trajs in zip(tasks, full):
            fails.setdefault(t.category, []).extend(float(tr.reward < self.scfg.solved_reward) for tr in trajs)
        rates = {k: float(np.mean(v)) for k, v in fails.items()}
        return AuditResult(float(r_full.mean()), deltas, rates, time.perf_counter() - t0), full

    # ---- expansion ----

    def expand(self, step: int, task_type: str, full: list[list[Any]], graphdef, params) -> None:
        """A new skill for `task_type` from its failed audit trajectories, or a failed-expansion
        event; nothing when the library is full (the type's counter keeps running)."""
        s = self.scfg
        if len(self.library.active) >= s.max_skills:
            return
        failed = [(t, tr) for t, trajs in zip(self.tasks, full) if t.category == task_type
                  for tr in trajs if tr.reward < s.solved_reward][:s.writer_trajectories]
        prompt = slim_text.writer_prompt(task_type, failed, transcript_chars=s.transcript_chars)
        raw = self.generate(prompt, graphdef, params, seed=self.cfg.seed * 1_000_003 + step)
        text = slim_text.clean_skill(raw, self.tok, max_tokens=s.max_skill_tokens)
        why = slim_text.degenerate(text, tok_lib.encode_plain(self.tok, text), [x.text for x in self.library.active],
                                   min_chars=s.min_skill_chars)
        if why is None:
            candidate = slim.add_skill(self.library, text, task_type, step=step, max_skills=s.max_skills,
                                       detail={"from_trajectories": len(failed)})
            why = self.prompt_overflow(candidate, task_type)
        if why is not None:
            self.library = slim.record_failed_expansion(self.library, task_type, step=step, reason=why, raw=raw)
            self.log(f"slim: step {step + 1}: expansion for {task_type!r} failed: {why}")
            return
        self.library = candidate
        self.log(f"slim: step {step + 1}: added {self.library.skills[-1].id} for {task_type!r} "
                 f"({len(text)} characters, from {len(failed)} failed trajectories)")

    def generate(self, prompt: str, graphdef, params, *, seed: int) -> str:
        """The writer's reply to the user message `prompt` (thinking off), at most
        slim.max_skill_tokens tokens, with the project's KV-cached sampler (one row)."""
        from turnsight_jax.model_setup import DTYPES
        from turnsight_jax.rollout.driver import ModelPolicy, RolloutConfig
        from turnsight_jax.rollout.sampler import SamplingParams

        s = self.scfg
        if s.writer:
            graphdef, params = self._writer_model()
        ids = slim_text.writer_prompt_ids(self.tok, prompt)
        sampling = (SamplingParams(greedy=True, logprobs=False) if s.writer_temperature <= 0 else
                    SamplingParams(temperature=s.writer_temperature, logprobs=False))
        rc = RolloutConfig(max_turns=1, max_prompt_tokens=len(ids) + 1, max_response_tokens=s.max_skill_tokens + 1,
                           max_turn_tokens=s.max_skill_tokens)
        policy = ModelPolicy(graphdef, params, self.tok, sampling=sampling, config=rc, seed=seed,
                             cache_dtype=DTYPES[self.cfg.model.compute_dtype])
        policy.begin([ids], 1)
        out = policy.generate(np.ones(1, bool), np.full(1, s.max_skill_tokens, np.int64))[0]
        return "" if out is None else out.text

    def _writer_model(self):
        if self._writer is None:
            from flax import nnx

            from turnsight_jax.model_setup import DTYPES, runtime_options
            from turnsight_jax.models.weights import load_pretrained

            model = load_pretrained(self.scfg.writer, dtype=DTYPES[self.cfg.model.ref_dtype], mesh=self.mesh,
                                    options=runtime_options(self.cfg))
            self._writer = nnx.split(model)
            self.log(f"slim: loaded the writer {self.scfg.writer}")
        return self._writer

    # ---- files ----

    def checkpoint_files(self) -> dict[str, str]:
        """The files a checkpoint step folder holds for SLIM: {LIBRARY_FILE: the library's JSON}."""
        return {LIBRARY_FILE: slim.to_json(self.library)}

    def write_latest(self) -> None:
        """The library after the latest audit as `<workdir>/slim_library.json` (the report reads it)."""
        if jax.process_index() == 0:
            tmp = self.workdir / (LIBRARY_FILE + ".tmp")
            tmp.write_text(slim.to_json(self.library))
            tmp.replace(self.workdir / LIBRARY_FILE)
