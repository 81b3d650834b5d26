"""The typed configs of the RL step: which method, its loss, the optimizer, the batch split.

A leaf module (dataclasses and structural checks only): host code imports these types without
importing the jitted step. Checks that need the registries (is this method known, does its
advantage get the inputs it needs) are in turnsight_jax.rl.methods.resolve_method.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

from turnsight_jax.chat.hindsight_template import DEFAULT_FILLER
from turnsight_jax.chat.hindsight_template import HindsightTemplate, check_template
from turnsight_jax.errors import ConfigError

LOSS_AGGREGATIONS = ("seq_mean_token_mean", "seq_mean_token_sum", "token_mean")
KL_ESTIMATORS = ("k1", "k3", "low_var_kl")
HINDSIGHT_SOURCES = ("tool_results", "tool_results_answer", "answer")
# TurnSight's depth selection by name (or an int depth index): the paper's vote, the fusion, and the
# adaptive horizons (rl.horizon).
SELECTIONS = ("vote", "mean", "dependency", "saturation")
# MatchTIR turn rewards (turnsight_jax.rewards): how predicted calls are matched to gold calls, and
# whose conventions (similarity, transport normalisation, answer F1) apply.
MATCHTIR_MATCHINGS = ("greedy", "assignment", "transport")
MATCHTIR_SEMANTICS = ("clean", "released")
# MatchTIR advantage, a (group) or (group, turn) pool of one trajectory: "zero" gives it advantage
# 0 (no sibling to compare with); "raw" normalises it with mean 0, std 1 (the released code).
MATCHTIR_SINGLETONS = ("zero", "raw")
NORM_POOLS = ("turn_mean", "token_gap", "per_turn")
# TurnSight, turns whose hindsight block is empty (the answer turn under source tool_results):
# "weighted" like every other turn; "excluded": weight 1, out of the group statistics.
EMPTY_BLOCK_TURNS = ("weighted", "excluded")
# The teacher (docs/baselines.md): whose weights score the teacher views. What a privileged view
# shows is the `privileged.*` section of methods.privileged_views.
TEACHER_WEIGHTS = ("reference", "policy", "ema", "external")


def section_settings(cls, section, key: str, what: str, *, validate: bool = True):
    """A run config's `key.*` section (a ConfigDict or any mapping of its keys) -> cls(**keys)
    checked by its `validate()` (unless `validate=False`: the keys only); a ConfigError naming an
    unknown key (`what`: the method, for the message)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(section.keys()) - fields)
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]} is not {what} key; keys: {', '.join(sorted(fields))}")
    settings = cls(**dict(section.items()))
    return settings.validate() if validate else settings


def always_checked(name: str, schema: type, what: str) -> Callable:
    """A section check (register_config_section's `check`) that validates the run config's `name.*`
    against `schema` whatever method runs: a bad value never waits unseen."""
    def check(cfg, stages, check_data: bool) -> None:
        section_settings(schema, cfg[name], name, what)
    return check


def parse_turn_coverage(turns: str) -> tuple[str, int]:
    """"all" | "first:N" | "last:N" (N >= 1) -> ("all", 0) | ("first", N) | ("last", N)."""
    if turns == "all":
        return "all", 0
    kind, _, num = str(turns).partition(":")
    if kind in ("first", "last") and num.isascii() and num.isdigit() and int(num) >= 1:  # "²".isdigit()
        return kind, int(num)
    raise ConfigError(f"turns must be 'all', 'first:N' or 'last:N' with N >= 1, got {turns!r}")


# ---- method config sections ----

@dataclasses.dataclass(frozen=True)
class ConfigSection:
    """A method's own config section `<name>.*` (docs/configuration.md). Its keys and defaults are
    the fields of `schema`, a dataclass: the one source of truth (`config.base_config` generates
    the section from it, so `--config.<name>.<key>=...` works as for any key). `check(cfg, stages,
    check_data)` validates the section for a run, raising ConfigError: `config.validate` calls it
    with the run config, the run's [(StepConfig, ResolvedMethod)] stages, and whether data and
    folders are checked too (False for a dry run's plan)."""

    name: str
    schema: type
    check: Callable[[Any, Sequence[tuple[Any, Any]], bool], None] | None = None


CONFIG_SECTIONS: dict[str, ConfigSection] = {}


def register_config_section(name: str, schema: type, check: Callable | None = None) -> ConfigSection:
    """Register a method's config section `name`, whose keys and defaults are dataclass `schema`'s."""
    if not dataclasses.is_dataclass(schema):
        raise ValueError(f"config section {name!r}: its schema must be a dataclass, got {schema!r}")
    if name in CONFIG_SECTIONS:
        raise ValueError(f"config section {name!r} already registered")
    CONFIG_SECTIONS[name] = ConfigSection(name, schema, check)
    return CONFIG_SECTIONS[name]


@dataclasses.dataclass(frozen=True)
class AlgoConfig:
    """The method (turnsight_jax.rl.methods) and its knobs.

    method: a registered method ("grpo", "matchtir", "turnsight", or one added with
    rl.methods.register_method). A method whose advantage wraps a base (TurnSight) wraps the
    method named by `base` (its rewards and its advantage). rollout: a registered rollout
    controller that replaces the method's own, with the rewards and loss terms it brings
    (rl.methods.RolloutController); "": the method's.
    TurnSight switches (docs/spec.md §1.10 ablations): lam, eps_w, selection ("vote" | "mean" | depth
    index, or an adaptive horizon, rl.horizon: "dependency" | "saturation" with horizon_tol), aggregation ("turn" | "token"), group_norm, turns ("all" | "first:N" | "last:N"),
    depths (the hindsight depth set D_H), source ("tool_results" | "tool_results_answer" |
    "answer"). Choices the paper leaves open (docs/spec.md §1.6, §1.7, §1.2): norm_pool
    ("turn_mean" | "token_gap" | "per_turn": what the group statistics pool), uncovered_in_stats
    (turns outside `turns` enter the group statistics), empty_block_turns ("weighted" |
    "excluded": turns whose hindsight block is empty get weight 1 and leave the group
    statistics), hindsight_template (the hindsight message's format
    strings). hindsight_budget / hindsight_filler: the equal-length control (chat.budget): every
    non-empty hindsight message exactly that many tokens (0: off), padded with the filler text.
    student_sees_observations: False masks observation tokens out of the student's
    training forward, as the released code does (docs/spec.md §1.9). MatchTIR: matchtir_matching
    ("greedy" | "assignment" | "transport") and matchtir_semantics ("clean" | "released") of the
    turn rewards (turnsight_jax.rewards), matchtir_singleton ("zero" | "raw") of the advantage
    (rl.advantages.matchtir_advantage_parts). toolrl_format: the ToolRL reward adds its format
    term (rewards.toolrl_reward); RLSD (methods.self_distillation) reuses lam and eps_w. sections:
    the run config's method sections (register_config_section: `sdpo.*`, `gae.*`, `orchard.*`,
    `appo.*`, ...), as (name, settings dataclass) pairs; a method's loss term, estimator knob
    ("<section>.<key>") or transform reads its own with `section(name)`. args: free-form
    knobs of plug-in methods, as (key, value) pairs.
    """

    method: str = "turnsight"
    base: str = "grpo"
    rollout: str = ""
    gamma: float = 0.9
    eps: float = 1e-6
    lam: float = 0.5
    eps_w: float = 0.5
    selection: Any = "vote"
    horizon_tol: float = 0.05
    aggregation: str = "turn"
    group_norm: bool = True
    turns: str = "all"
    depths: tuple[int, ...] = (1, 2, 3)
    source: str = "tool_results"
    norm_pool: str = "turn_mean"
    uncovered_in_stats: bool = True
    empty_block_turns: str = "weighted"
    hindsight_template: HindsightTemplate = HindsightTemplate()
    hindsight_budget: int = 0
    hindsight_filler: str = DEFAULT_FILLER
    student_sees_observations: bool = True
    matchtir_matching: str = "assignment"
    matchtir_semantics: str = "clean"
    matchtir_singleton: str = "zero"
    toolrl_format: bool = True
    sections: tuple[tuple[str, Any], ...] = ()
    args: tuple[tuple[str, Any], ...] = ()

    def arg(self, key: str, default: Any = None) -> Any:
        return dict(self.args).get(key, default)

    def section(self, name: str) -> Any:
        """The run's `name.*` settings (the dataclass its method registered): the run config's,
        or the dataclass's defaults when this config carries none (a StepConfig built by hand)."""
        for key, settings in self.sections:
            if key == name:
                return settings
        if name not in CONFIG_SECTIONS:
            raise KeyError(f"no method registered the config section {name!r}; registered: {sorted(CONFIG_SECTIONS)}")
        return CONFIG_SECTIONS[name].schema()

    def with_section(self, name: str, **values) -> "AlgoConfig":
        """This config with section `name`'s settings changed to `values` (the other keys as they
        were, e.g. `AlgoConfig(method="sdpo").with_section("sdpo", coef=0.1)`); unchecked, like a
        hand-built config (the run config's values are checked by the section's registered check)."""
        settings = dataclasses.replace(self.section(name), **values)
        return dataclasses.replace(self, sections=tuple((k, v) for k, v in self.sections if k != name)
                                   + ((name, settings),))

    def section_knobs(self) -> dict[str, Any]:
        """{"<section>.<key>": value} over every registered section: the knobs an estimator or
        transform may name (rl.advantages; its keyword argument is "<section>_<key>")."""
        return {f"{name}.{f.name}": getattr(self.section(name), f.name)
                for name in CONFIG_SECTIONS for f in dataclasses.fields(self.section(name))}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Clipped surrogate: ratio clipped to [1 - clip_eps, 1 + (clip_eps_high or clip_eps)];
    dual clip (clip_ratio_c, None = off): for A < 0 the per-token loss is capped at -A·c;
    optional KL to the reference (kl_coef, kl_estimator, clipped to ±kl_clip for low_var_kl);
    entropy bonus (entropy_coef, 0 = off: loss -= coef · aggregated token entropy);
    aggregation (see rl.losses.aggregation_weights); temperature of the log-probs;
    sampler/trainer mismatch correction (tis_threshold, None = off: the ratio's π_old is the
    sampler's recorded log-probs; C > 0: π_old is the trainer's own step-start log-probs and each
    token's surrogate loss is multiplied by min(exp(π_old_trainer − π_sampler), C), rl.losses.tis_weights)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    clip_ratio_c: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: str = "low_var_kl"
    kl_clip: float = 10.0
    aggregation: str = "seq_mean_token_mean"
    temperature: float = 1.0
    tis_threshold: float | None = None


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    schedule: str = "constant"  # constant | cosine (both after linear warm-up)
    warmup_steps: int = 0
    total_steps: int = 1000
    min_lr_ratio: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """Who scores the teacher views (what a privileged view shows: methods.privileged_views'
    `privileged.*` section).

    weights: "reference" (the frozen initial policy, TurnSight's teacher), "policy" (the current
    policy at the step's start, no gradient), "ema" (an exponential moving average of the policy,
    `ema_decay` per step, kept by the trainer and checkpointed), "external" (another Hugging Face
    Qwen3 with the same tokenizer, `checkpoint`). top_k: how many of the teacher's top tokens its
    forward returns (`StageInputs.teacher_pass`), for the loss terms that read them."""

    weights: str = "reference"
    ema_decay: float = 0.99
    checkpoint: str = ""
    top_k: int = 20

    def validate(self) -> None:
        if self.weights not in TEACHER_WEIGHTS:
            raise ConfigError(f"teacher.weights must be one of {TEACHER_WEIGHTS}, got {self.weights!r}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError(f"teacher.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.weights == "external" and not self.checkpoint:
            raise ConfigError("teacher.weights='external' needs teacher.checkpoint: a Hugging Face Qwen3 folder "
                              "with the policy's tokenizer (or 'warm_start': the run's own warm-start)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1:
            raise ConfigError(f"teacher.top_k must be an int >= 1, got {self.top_k!r}")


def check_budget(budget: Any, filler: Any, key: str, filler_key: str) -> None:
    """ConfigError unless `budget` is an int >= 0 and `filler` a non-empty (chat.budget)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ConfigError(f"{key} must be an int >= 0 (tokens per block; 0: off), got {budget!r}")
    if not isinstance(filler, str) or not filler:
        raise ConfigError(f"{filler_key} must be a non-empty string (the text that pads a block), got {filler!r}")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    algo: AlgoConfig = AlgoConfig()
    teacher: TeacherConfig = TeacherConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    group_size: int = 16
    micro_batches: int = 1  # gradient accumulation inside one mini-batch
    mini_batches: int = 1  # optimizer updates per epoch
    ppo_epochs: int = 1
    teacher_micro_batches: int = 1
    logprob_chunk: int = 1024  # rows per head chunk of the update's forward/backward
    score_chunk: int = 0  # rows per head chunk of the no-gradient forwards (teacher, reference, π_old); 0: logprob_chunk
    max_turns: int = 10
    length_classes: int = 1  # rows run in this many length groups, each padded to its own width (rl.length_classes)
    pack_rows: bool = False  # forwards run several trajectories (teacher: packed views) per row (rl.packing)
    pack_width: int = 0  # with pack_rows: packed rows at least this wide (0: the batch's bucketed width)
    teacher_pack_width: int = 0  # with pack_rows: the teacher's packed hindsight rows at least this wide (0: pack_width)
    micro_batch_groups: int = 1  # micro-batches ordered by length, in this many groups each at its own width (rl.micro_groups)
    record_teacher: bool = False  # the step also returns the teacher's log-probs [R, B, N] (log.turn_records)
    # Batch rows per prompt when the rollout controller forms its own groups (rl.methods.
    # RolloutController.rows_per_prompt: BAR's cap, AKBE's G + 1); 0: group_size, the fixed layout.
    prompt_rows: int = 0

    @property
    def rows_per_prompt(self) -> int:
        """Batch rows per prompt: prompt_rows, or group_size in the fixed layout."""
        return self.prompt_rows or self.group_size

    @property
    def scoring_chunk(self) -> int:
        """Rows per head chunk of the no-gradient forwards (score_chunk, or logprob_chunk when 0)."""
        return self.score_chunk or self.logprob_chunk

    def validate(self, batch_size: int | None = None) -> None:
        """Raise ConfigError (one line) for any structurally invalid value or combination."""
        algo, loss, opt = self.algo, self.loss, self.optim
        if self.logprob_chunk < 1 or self.score_chunk < 0:
            raise ConfigError(f"train.logprob_chunk must be >= 1 and train.score_chunk >= 0 (0: logprob_chunk), got "
                              f"{self.logprob_chunk} and {self.score_chunk}")
        if not algo.depths:
            raise ConfigError("rl.depths is empty: TurnSight needs at least one hindsight depth")
        if any(int(d) < 1 for d in algo.depths):
            raise ConfigError(f"rl.depths must be >= 1, got {tuple(algo.depths)}")
        if not 0.0 <= algo.eps_w < 1.0:
            raise ConfigError(f"rl.eps_w must be in [0, 1) so the weight keeps the advantage's sign, got {algo.eps_w}")
        if not 0.0 <= algo.lam <= 1.0:
            raise ConfigError(f"rl.lam must be in [0, 1], got {algo.lam}")
        if isinstance(algo.selection, bool) or (isinstance(algo.selection, int)
                                                and not 0 <= algo.selection < len(algo.depths)):
            raise ConfigError(f"rl.selection={algo.selection} is not an index into depths {tuple(algo.depths)}")
        if not isinstance(algo.selection, int) and algo.selection not in SELECTIONS:
            raise ConfigError(f"rl.selection must be one of {SELECTIONS} or a depth index, got {algo.selection!r}")
        if isinstance(algo.horizon_tol, bool) or not isinstance(algo.horizon_tol, (int, float)) \
                or not (math.isfinite(algo.horizon_tol) and algo.horizon_tol >= 0):
            raise ConfigError(f"rl.horizon_tol must be a finite number >= 0 (nats per token), got {algo.horizon_tol!r}")
        if algo.aggregation not in ("turn", "token"):
            raise ConfigError(f"rl.aggregation must be 'turn' or 'token', got {algo.aggregation!r}")
        if algo.source not in HINDSIGHT_SOURCES:
            raise ConfigError(f"rl.source must be one of {HINDSIGHT_SOURCES}, got {algo.source!r}")
        if algo.matchtir_matching not in MATCHTIR_MATCHINGS:
            raise ConfigError(f"rl.matchtir_matching must be one of {MATCHTIR_MATCHINGS}, got {algo.matchtir_matching!r}")
        if algo.matchtir_semantics not in MATCHTIR_SEMANTICS:
            raise ConfigError(f"rl.matchtir_semantics must be one of {MATCHTIR_SEMANTICS}, "
                              f"got {algo.matchtir_semantics!r}")
        if algo.matchtir_singleton not in MATCHTIR_SINGLETONS:
            raise ConfigError(f"rl.matchtir_singleton must be one of {MATCHTIR_SINGLETONS}, "
                              f"got {algo.matchtir_singleton!r}")
        if not isinstance(algo.toolrl_format, bool):
            raise ConfigError(f"rl.toolrl_format must be True or False, got {algo.toolrl_format!r}")
        parse_turn_coverage(algo.turns)
        if algo.norm_pool not in NORM_POOLS:
            raise ConfigError(f"rl.norm_pool must be one of {NORM_POOLS}, got {algo.norm_pool!r}")
        if algo.empty_block_turns not in EMPTY_BLOCK_TURNS:
            raise ConfigError(f"rl.empty_block_turns must be one of {EMPTY_BLOCK_TURNS}, got {algo.empty_block_turns!r}")
        for name in ("uncovered_in_stats", "student_sees_observations"):
            if not isinstance(getattr(algo, name), bool):
                raise ConfigError(f"rl.{name} must be True or False, got {getattr(algo, name)!r}")
        check_template(algo.hindsight_template, "rl.hindsight_template")
        check_budget(algo.hindsight_budget, algo.hindsight_filler, "rl.hindsight_budget", "rl.hindsight_filler")
        self.teacher.validate()
        if loss.aggregation not in LOSS_AGGREGATIONS:
            raise ConfigError(f"loss.aggregation {loss.aggregation!r} unknown; expected one of {LOSS_AGGREGATIONS}")
        if loss.kl_estimator not in KL_ESTIMATORS:
            raise ConfigError(f"loss.kl_estimator {loss.kl_estimator!r} unknown; expected one of {KL_ESTIMATORS}")
        if loss.clip_eps <= 0 or (loss.clip_eps_high is not None and loss.clip_eps_high <= 0):
            raise ConfigError("loss.clip_eps (and clip_eps_high) must be > 0")
        if loss.clip_ratio_c is not None and not loss.clip_ratio_c > 1.0:
            # c <= 1 would cap the loss below the unclipped surrogate at ratio 1 (verl asserts c > 1)
            raise ConfigError(f"loss.clip_ratio_c must be None (off) or > 1, got {loss.clip_ratio_c}")
        c = loss.tis_threshold
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0):
            raise ConfigError(f"loss.tis_threshold must be None (off) or a number > 0 (e.g. 2.0), got {c!r}")
        if not (math.isfinite(loss.entropy_coef) and loss.entropy_coef >= 0):
            raise ConfigError(f"loss.entropy_coef must be finite and >= 0, got {loss.entropy_coef}")
        if loss.kl_coef < 0:
            raise ConfigError(f"loss.kl_coef must be >= 0, got {loss.kl_coef}")
        if opt.schedule not in ("constant", "cosine"):
            raise ConfigError(f"optim.schedule must be 'constant' or 'cosine', got {opt.schedule!r}")
        if not (math.isfinite(opt.lr) and opt.lr > 0):
            raise ConfigError(f"optim.lr must be finite and > 0, got {opt.lr}")
        if self.group_size < 1:
            raise ConfigError(f"group_size must be >= 1, got {self.group_size}")
        for name in ("micro_batches", "mini_batches", "ppo_epochs", "teacher_micro_batches", "max_turns",
                     "length_classes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not isinstance(self.pack_rows, bool):
            raise ConfigError(f"train.pack_rows must be True or False, got {self.pack_rows!r}")
        for name, zero in (("pack_width", "the batch's width"), ("teacher_pack_width", "train.pack_width")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"train.{name} must be an int >= 0 (0: {zero}), got {value!r}")
        if self.pack_rows and self.length_classes > 1:
            raise ConfigError(f"train.pack_rows=True and train.length_classes={self.length_classes}: choose one "
                              "(both cut the padding of the forwards; packing leaves less)")
        g = self.micro_batch_groups
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ConfigError(f"train.micro_batch_groups must be an int >= 1 (1: off), got {g!r}")
        if g > 1:
            if g > self.micro_batches:
                raise ConfigError(f"train.micro_batch_groups={g} groups the micro-batches, but train.micro_batches="
                                  f"{self.micro_batches}: at most that many groups (set train.micro_batch_groups <= "
                                  f"{self.micro_batches}; 1: off)")
            if self.mini_batches != 1:
                raise ConfigError(f"train.micro_batch_groups={g} needs train.mini_batches=1 (rows are ordered by length "
                                  f"across the micro-batches of one mini-batch), got {self.mini_batches}")
            if self.pack_rows or self.length_classes > 1:
                raise ConfigError(f"train.micro_batch_groups={g} with train.pack_rows / train.length_classes: choose "
                                  "one (groups serve micro-batches of one row per device, which neither can cut)")
            if self.teacher_micro_batches not in (1, self.micro_batches):
                raise ConfigError(f"train.micro_batch_groups={g} needs train.teacher_micro_batches 1 or equal to "
                                  f"train.micro_batches ({self.micro_batches}), got {self.teacher_micro_batches}")
        if isinstance(self.prompt_rows, bool) or not isinstance(self.prompt_rows, int) or self.prompt_rows < 0:
            raise ConfigError(f"prompt_rows must be an int >= 0 (0: group_size), got {self.prompt_rows!r}")
        if batch_size is not None:
            if batch_size % self.rows_per_prompt:
                what = f"prompt_rows {self.prompt_rows}" if self.prompt_rows else f"group_size {self.group_size}"
                raise ConfigError(f"batch of {batch_size} trajectories is not divisible by {what}")
            per_mini = batch_size // self.mini_batches
            if batch_size % self.mini_batches or per_mini % self.micro_batches:
                raise ConfigError(
                    f"batch {batch_size} must split into {self.mini_batches} mini-batches of "
                    f"{self.micro_batches} equal micro-batches"
                )
            if batch_size % self.teacher_micro_batches:
                raise ConfigError(f"batch {batch_size} is not divisible by teacher_micro_batches {self.teacher_micro_batches}")
