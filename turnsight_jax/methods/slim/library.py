"""SLIM: the skill library as a training variable (docs/signal_methods.md, "SLIM").

Pure host-side state and rules; no model, no JAX. The trainer's side (the audits, the writer,
checkpoint files) is turnsight_jax/methods/slim/runner.py, the prompt and writer texts
turnsight_jax/methods/slim/text.py.

The library S = {s_1..s_K} holds short natural-language skills; the active ones (status keep or
watch) are shown to the policy in its system prompt, each to the tasks of its task type (a task's
`category`), a skill without a type to every task. Periodic audits measure each active skill's
marginal contribution on validation tasks by leave-one-out,

    Δ_k = Eval(S) − Eval(S \\ {s_k})     (means over the audit tasks s_k is shown on),

smooth it, ema_k ← Δ_k at the first audit, then ema_k ← d·ema_k + (1 − d)·Δ_k (d = `ema_decay`),
and put the skill in a band:

* keep:    ema_k ≥ keep_above;
* retire:  ema_k < retire_below AND exposures_k ≥ min_exposures (audit tasks it was measured on,
           summed over audits) AND low_rounds_k ≥ min_low_rounds (consecutive audits with
           ema_k < retire_below, this one included);
* watch:   otherwise (between the bounds, or low but not yet exposed or low long enough).

A retired skill leaves the prompt for good; it stays in the library's history. Expansion: a task
type whose failure rate at an audit is ≥ expand_fail_rate for expand_patience consecutive audits
gets a new skill written from its failed trajectories (`failing_types`, `add_skill`), while the
library holds fewer than max_skills active skills.

Every function returns a new `SkillLibrary` (the inputs are never changed), and `to_json` /
`from_json` round-trip it with its history: every audit's Δ's and every add / retire / failed
expansion event.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Mapping, Sequence

from turnsight_jax.errors import ConfigError
from turnsight_jax.rl.config import section_settings

STATUSES = ("keep", "watch", "retired")
ACTIVE = ("keep", "watch")
FORMAT = 1  # the JSON layout's version


@dataclasses.dataclass(frozen=True)
class SlimConfig:
    """The `slim.*` keys (each documented below; the section `config.base_config` generates from these fields); `validate` raises a
    ConfigError naming the key."""

    initial: str = "builtin"  # the starting skills: builtin (the bundled skills file) | "" (none) | a JSON file {task type or "default": text}
    audit_every: int = 1  # RL steps between leave-one-out audits
    audit_tasks: int = 8  # validation tasks per audit (stratified by task type; a fixed set for the run)
    audit_temperature: float = 0.0  # audits: 0 = greedy; > 0 = audit_samples samples per task, one fixed seed per audit
    audit_samples: int = 1  # rollouts per audit task when audit_temperature > 0
    ema_decay: float = 0.5  # ema <- decay * ema + (1 - decay) * delta (the first audit sets ema = delta)
    keep_above: float = 0.05  # band keep: ema >= keep_above
    retire_below: float = 0.0  # band retire: ema < retire_below, after min_exposures and min_low_rounds (else watch)
    min_exposures: int = 4  # audit tasks a skill must have been measured on before it can retire
    min_low_rounds: int = 2  # consecutive audits with ema < retire_below before it can retire
    solved_reward: float = 1.0  # an audit rollout with a reward below this failed (expansion's failure rate)
    expand_fail_rate: float = 0.5  # a task type fails an audit when this share of its rollouts failed
    expand_patience: int = 2  # consecutive failing audits before the writer writes a skill for the type
    writer: str = ""  # the model that writes new skills: "" = the current policy; or a Hugging Face Qwen3 folder (the policy's tokenizer)
    writer_temperature: float = 0.0  # the writer's sampling: 0 = greedy
    writer_trajectories: int = 3  # failed trajectories of the type quoted in the writer's prompt
    transcript_chars: int = 1200  # each quoted trajectory cut to this many characters
    max_skill_tokens: int = 96  # the writer's decode cap; a cleaned skill is cut to this many tokens
    min_skill_chars: int = 16  # a cleaned text with fewer non-space characters is a failed expansion
    max_skills: int = 12  # active skills at most (expansion waits while the library is full)

    def validate(self) -> "SlimConfig":
        def need(ok: bool, key: str, what: str):
            if not ok:
                raise ConfigError(f"slim.{key} {what}, got {getattr(self, key)!r}")

        for key in ("audit_every", "audit_tasks", "audit_samples", "min_low_rounds", "expand_patience",
                    "writer_trajectories", "transcript_chars", "max_skill_tokens", "max_skills"):
            v = getattr(self, key)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, key, "must be an int >= 1")
        for key in ("min_exposures", "min_skill_chars"):
            v = getattr(self, key)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 0, key, "must be an int >= 0")
        need(0.0 <= self.ema_decay < 1.0, "ema_decay", "must be in [0, 1)")
        need(0.0 <= self.expand_fail_rate <= 1.0, "expand_fail_rate", "must be in [0, 1]")
        need(self.audit_temperature >= 0.0, "audit_temperature", "must be >= 0 (0: greedy)")
        need(self.writer_temperature >= 0.0, "writer_temperature", "must be >= 0 (0: greedy)")
        for key in ("keep_above", "retire_below", "solved_reward"):
            need(math.isfinite(getattr(self, key)), key, "must be a finite number")
        if self.retire_below > self.keep_above:
            raise ConfigError(f"slim.retire_below={self.retire_below} is above slim.keep_above={self.keep_above}: "
                              f"the retire bound must not exceed the keep bound (the watch band lies between)")
        return self


@dataclasses.dataclass(frozen=True)
class Skill:
    """One skill. task_type None: shown to every task. ema None until its first audit.
    exposures: audit tasks it was measured on; low_rounds: consecutive audits with ema below
    retire_below; audits: audits that measured it."""

    id: str
    text: str
    task_type: str | None
    origin: str  # "initial" | "writer"
    created_step: int
    status: str = "watch"
    ema: float | None = None
    last_delta: float | None = None
    exposures: int = 0
    low_rounds: int = 0
    audits: int = 0
    retired_step: int | None = None

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    def shown_to(self, task_type: str) -> bool:
        return self.active and (self.task_type is None or self.task_type == task_type)


@dataclasses.dataclass(frozen=True)
class SkillLibrary:
    """The skills (active and retired, in creation order), the event history, and per task type
    the consecutive audits at or above the expansion failure rate."""

    skills: tuple[Skill, ...] = ()
    history: tuple[dict, ...] = ()
    fail_rounds: tuple[tuple[str, int], ...] = ()  # sorted (task type, rounds)
    next_id: int = 1

    @property
    def active(self) -> tuple[Skill, ...]:
        return tuple(s for s in self.skills if s.active)

    def shown_to(self, task_type: str, *, without: str | None = None) -> tuple[Skill, ...]:
        """The active skills a task of `task_type` sees, in library order (optionally less one id)."""
        return tuple(s for s in self.skills if s.shown_to(task_type) and s.id != without)

    def skill(self, skill_id: str) -> Skill:
        for s in self.skills:
            if s.id == skill_id:
                return s
        raise KeyError(f"no skill {skill_id!r} in the library")

    def counts(self) -> dict[str, int]:
        """Metrics' counters: active, retired, added by the writer, failed expansions, audits."""
        events = [e["event"] for e in self.history]
        return {"library_size": len(self.active), "retired_total": sum(s.status == "retired" for s in self.skills),
                "expanded_total": sum(s.origin == "writer" for s in self.skills),
                "expand_failed_total": events.count("expand_failed"), "audits_total": events.count("audit")}


def initial_library(texts: Mapping[str, str], categories: Sequence[str] | None = None, *, step: int = 0
                    ) -> SkillLibrary:
    """A library from {task type: text} (the bundled skills file's layout; its "default" entry is
    a skill for every task type). `categories`: keep only the skills of these task types (and the
    "default" one); None keeps every entry."""
    lib = SkillLibrary()
    for key, text in texts.items():
        task_type = None if key == "default" else key
        if task_type is not None and categories is not None and task_type not in categories:
            continue
        lib = add_skill(lib, text, task_type, step=step, origin="initial", max_skills=None)
    return lib


def add_skill(library: SkillLibrary, text: str, task_type: str | None, *, step: int, origin: str = "writer",
              max_skills: int | None = None, detail: Mapping[str, Any] | None = None) -> SkillLibrary:
    """The library with a new active skill (id "s<n>", status watch) and an "add" event; the
    task type's failure-round counter restarts. ValueError when `max_skills` active skills are
    already there or the text is empty."""
    if not text.strip():
        raise ValueError("a skill's text must not be empty")
    if max_skills is not None and len(library.active) >= max_skills:
        raise ValueError(f"the library already holds slim.max_skills={max_skills} active skills")
    sid = f"s{library.next_id}"
    skill = Skill(sid, text, task_type, origin, step)
    event = {"step": step, "event": "add", "id": sid, "task_type": task_type, "origin": origin, "text": text,
             **dict(detail or {})}
    return dataclasses.replace(library, skills=library.skills + (skill,), history=library.history + (event,),
                               fail_rounds=_set_rounds(library.fail_rounds, task_type, 0),
                               next_id=library.next_id + 1)


def record_failed_expansion(library: SkillLibrary, task_type: str, *, step: int, reason: str, raw: str
                            ) -> SkillLibrary:
    """An "expand_failed" event (the writer's text was empty or degenerate: `reason`, its raw
    output kept for the report); the type's counter restarts, so it is retried after
    expand_patience more failing audits, not at every one."""
    event = {"step": step, "event": "expand_failed", "task_type": task_type, "reason": reason, "raw": raw}
    return dataclasses.replace(library, history=library.history + (event,),
                               fail_rounds=_set_rounds(library.fail_rounds, task_type, 0))


def update_audit(library: SkillLibrary, deltas: Mapping[str, tuple[float, int]], cfg: SlimConfig, *, step: int,
                 eval_full: float, n_tasks: int) -> SkillLibrary:
    """One audit's result: `deltas[id] = (Δ, n)`, Δ the mean over the n audit tasks the skill was
    shown on of (reward with S − reward without it). Each measured active skill's EMA, exposures,
    consecutive low rounds and band are updated (module docstring); a skill the audit did not
    measure (no audit task of its type; n = 0) is left as it was. The "audit" event records
    Eval(S), every Δ and n, and each retirement gets a "retire" event."""
    skills, events = [], []
    for s in library.skills:
        if not s.active or s.id not in deltas or deltas[s.id][1] <= 0:
            skills.append(s)
            continue
        delta, n = float(deltas[s.id][0]), int(deltas[s.id][1])
        ema = delta if s.ema is None else cfg.ema_decay * s.ema + (1.0 - cfg.ema_decay) * delta
        low = ema < cfg.retire_below
        low_rounds = s.low_rounds + 1 if low else 0
        exposures = s.exposures + n
        if ema >= cfg.keep_above:
            status = "keep"
        elif low and exposures >= cfg.min_exposures and low_rounds >= cfg.min_low_rounds:
            status = "retired"
        else:
            status = "watch"
        skills.append(dataclasses.replace(s, ema=ema, last_delta=delta, exposures=exposures, low_rounds=low_rounds,
                                          audits=s.audits + 1, status=status,
                                          retired_step=step if status == "retired" else None))
        if status == "retired":
            events.append({"step": step, "event": "retire", "id": s.id, "ema": ema, "exposures": exposures,
                           "low_rounds": low_rounds})
    audit = {"step": step, "event": "audit", "eval": float(eval_full), "n_tasks": int(n_tasks),
             "deltas": {k: float(v[0]) for k, v in deltas.items()}, "n": {k: int(v[1]) for k, v in deltas.items()}}
    return dataclasses.replace(library, skills=tuple(skills), history=library.history + (audit, *events))


def failing_types(library: SkillLibrary, fail_rates: Mapping[str, float], cfg: SlimConfig
                  ) -> tuple[SkillLibrary, list[str]]:
    """Count the audit's failing task types: a type's counter grows by one when its failure rate
    (the share of its audit rollouts with reward < solved_reward) is ≥ expand_fail_rate and
    restarts at 0 otherwise; a type the audit did not see keeps its counter. Returns the library
    with the counters and the types due for expansion (counter ≥ expand_patience), sorted."""
    rounds = dict(library.fail_rounds)
    for task_type, rate in fail_rates.items():
        rounds[task_type] = rounds.get(task_type, 0) + 1 if rate >= cfg.expand_fail_rate else 0
    due = sorted(t for t, r in rounds.items() if r >= cfg.expand_patience)
    return dataclasses.replace(library, fail_rounds=tuple(sorted(rounds.items()))), due


def _set_rounds(rounds: tuple[tuple[str, int], ...], task_type: str | None, value: int):
    if task_type is None:
        return rounds
    out = dict(rounds)
    out[task_type] = value
    return tuple(sorted(out.items()))


# ---- JSON: the library with its history, saved with every checkpoint ----

def to_json(library: SkillLibrary) -> str:
    return json.dumps({"format": FORMAT, "next_id": library.next_id, "fail_rounds": dict(library.fail_rounds),
                       "skills": [dataclasses.asdict(s) for s in library.skills],
                       "history": list(library.history)}, indent=1, ensure_ascii=False)


def from_json(text: str, *, where: str = "skill library") -> SkillLibrary:
    """The library `to_json` wrote; ValueError naming `where` and the problem."""
    try:
        raw = json.loads(text)
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r}, expected {FORMAT}")
        fields = {f.name for f in dataclasses.fields(Skill)}
        skills = []
        for i, s in enumerate(raw["skills"]):
            unknown = set(s) - fields
            if unknown:
                raise ValueError(f"skill {i}: unknown fields {sorted(unknown)}")
            skill = Skill(**s)
            if skill.status not in STATUSES:
                raise ValueError(f"skill {skill.id!r}: status {skill.status!r}, expected one of {STATUSES}")
            skills.append(skill)
        return SkillLibrary(tuple(skills), tuple(raw["history"]),
                            tuple(sorted((str(k), int(v)) for k, v in raw["fail_rounds"].items())),
                            int(raw["next_id"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: not a SLIM skill library ({e})") from None


def slim_settings(section) -> SlimConfig:
    """The run config's `slim` ConfigDict (or any mapping of its keys) -> a checked SlimConfig (a
    ConfigError naming the key)."""
    return section_settings(SlimConfig, section, "slim", "a SLIM")


def check_writer(scfg: SlimConfig, vocab_size: int) -> None:
    """A `slim.writer` folder must be a Hugging Face Qwen3 folder with the policy's vocabulary
    (the writer reads and writes the policy's token ids); ConfigError otherwise."""
    if not scfg.writer:
        return
    from turnsight_jax.models.config import Qwen3Config

    if not (pathlib.Path(scfg.writer) / "config.json").is_file():
        raise ConfigError(f"slim.writer={scfg.writer!r} is not a Hugging Face Qwen3 folder (no config.json); "
                          f"\"\" writes skills with the current policy")
    try:
        writer = Qwen3Config.from_pretrained(scfg.writer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"slim.writer={scfg.writer!r}: {e}") from None
    if writer.vocab_size != vocab_size:
        raise ConfigError(f"slim.writer={scfg.writer!r} has a {writer.vocab_size}-id vocabulary, the policy "
                          f"{vocab_size}: the writer must share the policy's tokenizer")
