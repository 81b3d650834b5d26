"""Methods: what a training method is made of, registered by name (docs/adding_an_algorithm.md).

A method names one entry of each of the four pipeline interfaces:

* a **rollout controller** (`register_rollout`): what is sampled; `fn(ctx, tasks, seed) ->
  RolloutResult` with `len(tasks) * ctx.group_size` trajectories, siblings of task i in rows
  i*G .. i*G+G-1; or, for a controller that forms its own groups (`rows_per_prompt`), R rows per
  task in prompt blocks, groups of any size, rows in no group (`RolloutController`);
* **rewards** (`register_reward`): computed on the host from the rollout record, per trajectory,
  `fn(trajectory, task, algo) -> value`; each fills one batch array (`output`), per trajectory
  [B] or per turn [B, K];
* an **advantage estimator** (turnsight_jax.rl.advantages.register_advantage);
* **loss terms** (turnsight_jax.rl.losses.register_loss_term), summed inside the jitted step;

and may bring **step auxiliaries** (turnsight_jax.rl.auxiliaries: a critic, a step-PRM, a
retrospective teacher), stages of the step that feed the advantage or the loss terms.

`rl.method` selects a method; a method whose advantage wraps a base estimator (TurnSight) wraps
the method `rl.base` names, taking its rewards and its advantage as the base. Every input is
declared, so `resolve_method` can refuse a combination whose arrays nobody provides before
anything compiles. The KL term is added when `loss.kl_coef > 0`, whatever the method.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from turnsight_jax.chat.trajectory import Trajectory
from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError
from turnsight_jax.rewards import matchtir_turn_rewards, toolrl_reward
from turnsight_jax.rl.advantages import Estimator, get_estimator, get_transform
from turnsight_jax.rl.auxiliaries import AUXILIARIES, StepAuxiliary
from turnsight_jax.rl.config import CONFIG_SECTIONS, AlgoConfig, ConfigSection, StepConfig, register_config_section  # noqa: F401
from turnsight_jax.rl.episodes import run_episodes
from turnsight_jax.rl.losses import LossTerm, get_loss_term
from turnsight_jax.rl.views import VIEW_BUILDERS
from turnsight_jax.rollout.driver import ObservationWindow, RolloutConfig, RolloutResult
from turnsight_jax.rollout.sampler import SamplingParams

# Arrays every batch has, in the compact layout of turnsight_jax.rl.batch.
CORE_ARRAYS = ("policy_mask", "turn_ids", "group_ids", "num_turns")
# What a loss term may read besides the core arrays and the rewards' outputs ("entropy": the
# student's token entropy, computed in the step only when a term reads it).
LOSS_ARRAYS = ("logprobs", "old_logprobs", "advantages", "ref_logprobs", "pol_valid", "entropy")
# What the teacher's views give a loss term (the step computes each only when a term reads it):
# "teacher_logprobs" [B, N] (view 0, no gradient), "teacher_covered" [B, N] bool (a privileged block
# was shown), "teacher_topk_logprobs" [B, N, K] (the teacher's top-K tokens' log-probs) and
# "topk_logprobs" [B, N, K] (the student's log-probs of those tokens, differentiated).
TEACHER_ARRAYS = ("teacher_logprobs", "teacher_covered", "teacher_topk_logprobs", "topk_logprobs")
TEACHER_KINDS = ("hindsight", "privileged")


# ---- rollout controllers ----

@dataclasses.dataclass(frozen=True)
class RolloutContext:
    """Everything a rollout controller needs: the current policy and the environment."""

    graphdef: Any
    params: Any
    tokenizer: Any
    env: Any
    sampling: SamplingParams
    config: RolloutConfig
    group_size: int
    prompts_per_chunk: int = 0  # 0: all prompts at once
    cache_dtype: Any = None
    progress: Callable[[Any], None] | None = None  # rollout.driver.ProgressCallback, e.g. a ProgressLine
    engine: Any = None  # rollout.engine.EngineConfig: the paged engine; None: the lockstep ModelPolicy
    mesh: Any = None  # the device mesh the paged engine splits its rows and KV pool over (None: one shard)
    group_offset: int = 0  # global index of the first prompt (a process rolls out its share of a step's prompts)
    run_config: Any = None  # the run's ConfigDict, for a controller with its own section (the judge: judge.*)
    state: Any = None  # the trainer's host-side state a controller reads (SLIM: its methods.slim.library.SkillLibrary)
    task_pool: Sequence[Task] = ()  # the training tasks a controller may draw more prompts from (methods.mm_grpo's refills)
    # the earlier policy a controller with `old_policy` scores with (same graphdef): the policy before
    # the last update (None at the first step) or the frozen reference (APPO's pi_old)
    old_params: Any = None


@dataclasses.dataclass(frozen=True)
class RolloutController:
    """A registered rollout controller. A controller that acts on the rollout may bring the rest of
    its mechanism with it: `rewards` (registered rewards whose outputs its other parts read, e.g.
    a per-trajectory flag it set on the record) and `loss_terms` (registered loss terms, e.g. an
    auxiliary CE on exemplars it chose). `resolve_method` adds both to whatever method runs with
    the controller, so `rl.rollout=NAME` composes with GRPO, MatchTIR, TurnSight or any method.

    The batch layout it returns (docs/rollout_methods.md, "Unequal groups in the batch"):

    * `rows_per_prompt` None (the fixed layout): len(tasks) * G trajectories, siblings of task i
      in rows i*G .. i*G+G-1, every group exactly G rows.
    * `rows_per_prompt(run_config) -> R` (a controller that forms its own groups): exactly
      len(tasks) * R trajectories, rows i*R .. i*R+R-1 about task i (the rewards read task i),
      each with `Trajectory.group_id` its group (any id >= 0, the batch renumbers them; a group's
      rows in one block) or -1: in no group, so no advantage and no policy-gradient loss (an
      exemplar a loss term of the controller trains on, or a padding row,
      chat.trajectory.padding_trajectory). R is static (the compiled step's row count), so
      `rl.episodes.pad_prompt_rows` fills each block to R.

    The controller's own diagnostics go in `RolloutResult.metrics`, over every process
    (distributed.summed), under its name ("<name>/...").

    Controllers that act inside the decode (rollout.control; docs/rollout_methods.md):
    `engine_only` (they need rollout.engine=paged: `config.validate` refuses the lockstep sampler);
    `advantage_transform` (a registered rl.advantages transform the step applies to the method's
    final advantage, reading arrays the controller's rewards fill, e.g. APPO's Ω [B, N]);
    `old_policy(run_config) -> "previous" | "reference" | ""` (the earlier policy the controller
    scores with, `RolloutContext.old_params`: "previous", the parameters before the last update,
    which the trainer then keeps a copy of and checkpoints; "reference", the frozen initial policy)."""

    name: str
    fn: Callable[[RolloutContext, Sequence[Task], int], RolloutResult]
    rewards: tuple[str, ...] = ()
    loss_terms: tuple[str, ...] = ()
    rows_per_prompt: Callable[[Any], int] | None = None
    engine_only: bool = False
    advantage_transform: str = ""
    old_policy: Callable[[Any], str] | None = None
    # episodes one rollout call samples per prompt, when not train.group_size (BAR's bar.chunk): the
    # paged engine's KV pool is checked against it before anything runs
    episodes_per_call: Callable[[Any], int] | None = None
    # For the dry-run plan (rl.plan; rl.batch.worst_case_geometry): `plan_extra(run_config) ->
    # (KV slots per episode, tokens per training row)` the controller's episodes may need beyond
    # prompt + max_response_tokens (MM-GRPO's window), and `plan_pool_blocks(engine_config,
    # rollout_config, run_config, shards) -> blocks per shard` when its paged engine needs more than
    # the default pool (APPO keeps a call's initial rollouts for their branches).
    plan_extra: Callable[[Any], tuple[int, int]] | None = None
    plan_pool_blocks: Callable[[Any, Any, Any, int], int] | None = None
    # host-side state the controller keeps across steps beside the policy (SLIM's skill library):
    # `trainer_hook(TrainerHookStart) -> TrainerHook`, started once per run by the trainer
    trainer_hook: Callable[["TrainerHookStart"], "TrainerHook"] | None = None

    def planned_extra(self, run_config: Any) -> tuple[int, int]:
        """(KV slots per episode, tokens per training row) beyond prompt + max_response_tokens."""
        return (0, 0) if self.plan_extra is None else tuple(self.plan_extra(run_config))

    def old_policy_kind(self, run_config: Any) -> str:
        """"previous", "reference" or "" (none): what `RolloutContext.old_params` must hold."""
        return "" if self.old_policy is None else self.old_policy(run_config)

    def prompt_rows(self, run_config: Any, group_size: int) -> int:
        """Batch rows per prompt: `group_size` in the fixed layout, else the controller's R."""
        return group_size if self.rows_per_prompt is None else int(self.rows_per_prompt(run_config))


ROLLOUTS: dict[str, RolloutController] = {}


def register_rollout(name: str, *, rewards: Sequence[str] = (), loss_terms: Sequence[str] = (),
                     rows_per_prompt: Callable[[Any], int] | None = None, engine_only: bool = False,
                     advantage_transform: str = "", old_policy: Callable[[Any], str] | None = None,
                     episodes_per_call: Callable[[Any], int] | None = None,
                     plan_extra: Callable[[Any], tuple[int, int]] | None = None,
                     plan_pool_blocks: Callable[[Any, Any, Any, int], int] | None = None,
                     trainer_hook: Callable[["TrainerHookStart"], "TrainerHook"] | None = None):
    """Decorator: register `fn(ctx: RolloutContext, tasks, seed) -> RolloutResult`, with the rewards
    and loss terms the controller's mechanism adds to any method it runs under, for a controller
    that forms its own groups `rows_per_prompt(run_config) -> R`, for one acting in the decode
    `engine_only`, `advantage_transform` and `old_policy`, and for one keeping state across steps
    `trainer_hook` (RolloutController)."""

    def deco(fn):
        if name in ROLLOUTS:
            raise ValueError(f"rollout controller {name!r} already registered")
        ROLLOUTS[name] = RolloutController(name, fn, tuple(rewards), tuple(loss_terms), rows_per_prompt, engine_only,
                                           advantage_transform, old_policy, episodes_per_call, plan_extra,
                                           plan_pool_blocks, trainer_hook)
        return fn

    return deco


# ---- trainer hooks ----

@dataclasses.dataclass(frozen=True)
class TrainerHookStart:
    """What the trainer starts a controller's hook with, once per run: the run config, the
    tokenizer, the training tasks, the run folder, the device mesh, the policy's vocabulary size,
    `checkpoint_file(name) -> text | None` (a file the hook saved in the checkpoint the run resumes
    from; None on a fresh run or when absent) and the run's log function."""

    run_config: Any
    tokenizer: Any
    train_tasks: Sequence[Task]
    workdir: Any
    mesh: Any
    vocab_size: int
    checkpoint_file: Callable[[str], str | None]
    log: Callable[[str], None]


class TrainerHook:
    """A controller's state across the steps of a run (SLIM's skill library, audited after steps).
    The trainer calls, for the steps whose stage runs the controller: `rollout_state()` before the
    rollout (what the controller reads as `RolloutContext.state`) and `after_step(step, graphdef,
    params, env) -> metrics` after the update (0-based `step`; the metrics join the step's line);
    at every checkpoint `checkpoint_files() -> {file name: text}`, saved in the step folder and
    handed back on resume through `TrainerHookStart.checkpoint_file`."""

    def rollout_state(self) -> Any:
        return None

    def after_step(self, step: int, graphdef: Any, params: Any, env: Any) -> dict[str, float]:
        return {}

    def checkpoint_files(self) -> dict[str, str]:
        return {}


def start_trainer_hooks(methods: Sequence[Any], start: TrainerHookStart) -> dict[str, TrainerHook]:
    """{controller name: its started hook} for the controllers of a run's stages (`methods`: the
    resolved methods, None for an absent stage) that have one."""
    out: dict[str, TrainerHook] = {}
    for m in methods:
        if m is not None and m.rollout.trainer_hook is not None and m.rollout.name not in out:
            out[m.rollout.name] = m.rollout.trainer_hook(start)
    return out


@register_rollout("sampler")
def sampler_rollout(ctx: RolloutContext, tasks: Sequence[Task], seed: int, *,
                    window: ObservationWindow | None = None) -> RolloutResult:
    """The default: G samples per prompt, `prompts_per_chunk` prompts at a time (0: all), from the
    paged engine or the lockstep `ModelPolicy` (`rl.episodes.run_episodes`). Every episode's draws
    depend on (seed, its global row) only: chunking and the split of a step over processes
    (`ctx.group_offset`) change no token. `window`: the policy's context keeps only the most recent
    observations (rollout.driver.rollout; methods.mm_grpo)."""
    return run_episodes(ctx, tasks, seed, window=window)


def run_section(ctx: RolloutContext, name: str):
    """The run config's `name.*` section, for a controller with its own settings."""
    if ctx.run_config is None or name not in ctx.run_config:
        raise ValueError(f"the {name!r} rollout controller reads the run config's {name}.* section: "
                         f"RolloutContext.run_config must hold it")
    return ctx.run_config[name]


# ---- config sections ----

# The sections themselves (ConfigSection, CONFIG_SECTIONS, register_config_section) live in
# rl.config, beside the configs that read them; imported here so a method registers everything
# from this one module.

# checks of a run config a method adds that belong to no section of its own (e.g. a file a core key
# names, read only when the method runs): `check(cfg, stages, check_data)`, run by config.validate
CONFIG_CHECKS: list[Callable[[Any, Sequence[tuple[StepConfig, Any]], bool], None]] = []


def register_config_check(check: Callable[[Any, Sequence[tuple[StepConfig, Any]], bool], None]):
    """Run `check(cfg, stages, check_data)` (raising ConfigError) when a run config is validated."""
    if check not in CONFIG_CHECKS:
        CONFIG_CHECKS.append(check)
    return check


# ---- report sections ----

@dataclasses.dataclass(frozen=True)
class ReportSection:
    """A method's part of `python -m turnsight_jax.report RUN_DIR`: `lines(run_dir) -> markdown
    lines | None` appended to index.md (None: the folder is not a run of the method, nothing
    added), and, when `lines` gave some and metrics.jsonl holds one of `plot_keys`, the figure
    `plot_name` drawn by `plot(metrics, path, kit)`; `kit` holds the report's drawing helpers
    (`kit.figure(nrows, ncols)`, `kit.line(ax, metrics, key, label, **kw)`, `kit.finish(ax, title,
    ylabel)`, `kit.save(fig, path)`), so the method's module imports nothing of the report."""

    name: str
    lines: Callable[[Any], list[str] | None]
    plot_name: str = ""
    plot_keys: tuple[str, ...] = ()
    plot: Callable[[Any, Any, Any], None] | None = None


REPORT_SECTIONS: dict[str, ReportSection] = {}


def register_report_section(section: ReportSection) -> ReportSection:
    """Add a method's section to every training report (ReportSection)."""
    if section.name in REPORT_SECTIONS:
        raise ValueError(f"report section {section.name!r} already registered")
    REPORT_SECTIONS[section.name] = section
    return section


def runs_controller(stages, name: str) -> bool:
    """Whether a stage of the run samples with rollout controller `name`."""
    return any(m.rollout.name == name for _, m in stages)


# ---- the progress line ----

# metric key -> its label on the training progress line: the metric that shows a method's own
# mechanism acting (shown when a step's metrics hold it; a run shows its method's and TurnSight's)
PROGRESS_METRICS: dict[str, str] = {}


def register_progress_metrics(labels: dict[str, str]) -> None:
    """Show each metric key of `labels` on the progress line under its label."""
    for key, label in labels.items():
        if PROGRESS_METRICS.get(key, label) != label:
            raise ValueError(f"progress metric {key!r} already shown as {PROGRESS_METRICS[key]!r}")
        PROGRESS_METRICS[key] = label


register_progress_metrics({"turnsight/weight_max": "w_max"})


# ---- rewards ----

@dataclasses.dataclass(frozen=True)
class Reward:
    """A registered reward: fills batch array `output`, one value per trajectory (`per="trajectory"`,
    a float), per turn (`per="turn"`, [num_turns] floats; the batch pads to [B, K] with 0) or per
    token (`per="token"`, [trajectory length] floats; the batch takes the policy tokens', [B, N],
    e.g. a value a rollout controller recorded in Trajectory.token_values).
    `needs`: Task fields the reward reads. `config.validate` refuses a `data.source` whose
    `TaskSource.provides` lacks one, and `sources.load_tasks(cfg, "train")` a training row without
    one (rl.batch.compute_signals, called on tasks from elsewhere, leaves such a row's output 0)."""

    name: str
    fn: Callable[[Trajectory, Task, AlgoConfig], Any]
    output: str
    per: str = "trajectory"
    needs: tuple[str, ...] = ()


REWARDS: dict[str, Reward] = {}


def register_reward(name: str, output: str, *, per: str = "trajectory", needs: tuple[str, ...] = ()):
    """Decorator: register `fn(trajectory, task, algo_cfg) -> float | [num_turns] | [length]` as reward `name`."""
    if per not in ("trajectory", "turn", "token"):
        raise ValueError(f"reward {name!r}: per must be 'trajectory', 'turn' or 'token', got {per!r}")

    def deco(fn):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} already registered")
        REWARDS[name] = Reward(name, fn, output, per, tuple(needs))
        return fn

    return deco


@register_reward("outcome", "rewards")
def outcome_reward(traj: Trajectory, task: Task, algo: AlgoConfig) -> float:
    """The environment's own score of the episode (FTRL/built-in: Solve-F1; ToolHop: answer match)."""
    return float(traj.reward)


@register_reward("matchtir_turns", "turn_rewards", per="turn", needs=("gold_calls",))
def matchtir_turn_reward(traj: Trajectory, task: Task, algo: AlgoConfig) -> np.ndarray:
    """MatchTIR turn rewards (docs/spec.md §1.11): each tool turn's calls matched to the gold calls
    (`rl.matchtir_matching`), the answer turn scored against the gold answer, with the conventions
    of `rl.matchtir_semantics` (the released ones read the answer from the turn's raw text, which
    must hold <answer> tags; the clean ones from the parsed answer)."""
    last = traj.turns[-1] if traj.turns else None
    if last is None:
        answer = None
    else:
        answer = last.text if algo.matchtir_semantics == "released" else last.answer
    return matchtir_turn_rewards([t.calls for t in traj.turns], task.gold_calls, answer, task.answer,
                                 method=algo.matchtir_matching, semantics=algo.matchtir_semantics)


@register_reward("toolrl", "rewards", needs=("gold_calls",))
def toolrl_trajectory_reward(traj: Trajectory, task: Task, algo: AlgoConfig) -> float:
    """ToolRL's R_format + R_correct of the whole trajectory (rewards.toolrl_reward; R_correct
    alone when rl.toolrl_format is False)."""
    last_text = traj.turns[-1].text if traj.turns else None
    return toolrl_reward([t.calls for t in traj.turns], last_text, task.gold_calls, with_format=algo.toolrl_format)


# ---- methods ----

@dataclasses.dataclass(frozen=True)
class Method:
    """A training method: names of a rollout controller, rewards, an advantage and loss terms."""

    name: str
    advantage: str
    rewards: tuple[str, ...] = ("outcome",)
    loss_terms: tuple[str, ...] = ("clipped_surrogate",)
    rollout: str = "sampler"
    description: str = ""
    teacher: str = "hindsight"  # the views the teacher scores, when anything reads them (TEACHER_KINDS)
    # The learned step auxiliaries it trains next to the policy (rl.auxiliaries, by name: PPO's
    # "critic", whose values reach the advantage as "values"; PiCA's "prm", "process_rewards").
    # An auxiliary that only gives loss-term arrays runs whenever a term reads them; not listed.
    auxiliaries: tuple[str, ...] = ()


METHODS: dict[str, Method] = {}


def register_method(method: Method) -> Method:
    if method.teacher not in TEACHER_KINDS:
        raise ValueError(f"method {method.name!r}: teacher must be one of {TEACHER_KINDS}, got {method.teacher!r}")
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} already registered")
    METHODS[method.name] = method
    return method


register_method(Method("grpo", advantage="grpo", description="outcome reward, group-normalised"))
register_method(Method("matchtir", advantage="matchtir", rewards=("outcome", "matchtir_turns"),
                       description="turn rewards from matched gold calls, dual-level advantage"))
register_method(Method("toolrl", advantage="grpo", rewards=("toolrl",),
                       description="ToolRL's format + call-match reward, group-normalised"))
register_method(Method("turnsight", advantage="turnsight", rewards=(),
                       description="turn-level hindsight weighting of the base method's advantage"))
# The sibling methods register themselves (turnsight_jax/methods/: each module ends with its
# registration; turnsight_jax.methods imports the built-ins).


@dataclasses.dataclass(frozen=True)
class ResolvedMethod:
    """A method with every name looked up: what the trainer and the step run."""

    name: str
    rollout: RolloutController
    rewards: tuple[Reward, ...]
    advantage: Estimator
    base: Estimator | None
    loss_terms: tuple[LossTerm, ...]
    teacher: str = "hindsight"
    transform: Estimator | None = None  # the rollout controller's advantage transform (rl.advantages.TRANSFORMS)
    # the step auxiliaries that run (rl.auxiliaries): the method's and its base's, then those whose
    # arrays a loss term reads
    auxiliaries: tuple[StepAuxiliary, ...] = ()

    @property
    def aux(self) -> tuple[str, ...]:
        """The learned auxiliaries the step trains next to the policy (the step's `aux` keys)."""
        return tuple(a.name for a in self.auxiliaries if a.learned)

    def uses(self, auxiliary: str) -> bool:
        """Whether step auxiliary `auxiliary` runs in this method's step."""
        return any(a.name == auxiliary for a in self.auxiliaries)

    def reads(self, name: str) -> bool:
        """Whether a loss term reads array `name`."""
        return any(name in t.inputs for t in self.loss_terms)

    @property
    def needs_views(self) -> bool:
        return (self.advantage.needs_views or bool(self.base and self.base.needs_views)
                or any(self.reads(k) for k in TEACHER_ARRAYS))

    def teacher_views(self, algo: AlgoConfig) -> int:
        """Teacher views (before the packed reference row): the hindsight depths, or the one
        privileged view."""
        return len(algo.depths) if self.teacher == "hindsight" else 1

    @property
    def uses_teacher(self) -> bool:
        """Whether the step runs the teacher teacher.weights names (its views, or an auxiliary's
        rows scored by it: the retrospective teacher's probes)."""
        return self.needs_views or self.uses("retrospective")

    @property
    def top_k(self) -> bool:
        """Whether the teacher's top-K tokens (and the student's log-probs of them) are computed."""
        return self.reads("teacher_topk_logprobs") or self.reads("topk_logprobs")

    @property
    def task_needs(self) -> tuple[str, ...]:
        """The Task fields the method's rewards read (`Reward.needs`), each once, in order."""
        return tuple(dict.fromkeys(f for r in self.rewards for f in r.needs))

    def rewards_needing(self, field: str) -> tuple[str, ...]:
        """The names of the method's rewards that read Task field `field` (for messages)."""
        return tuple(r.name for r in self.rewards if field in r.needs)

    @property
    def needs_ref(self) -> bool:
        return any("ref_logprobs" in t.inputs for t in self.loss_terms)

    def describe(self) -> str:
        adv = self.advantage.name + (f"({self.base.name})" if self.base else "") + (
            f" then {self.transform.name}" if self.transform else "")
        return (f"method {self.name}: rollout {self.rollout.name}, rewards [{', '.join(r.name for r in self.rewards)}], "
                f"advantage {adv}, loss [{', '.join(t.name for t in self.loss_terms)}]"
                + "".join(f", {a.describe or a.name}" for a in self.auxiliaries if a.learned))


def task_needs(method: str, base: str) -> tuple[str, ...]:
    """The Task fields the rewards of rl.method=`method` (over rl.base=`base`) read, as
    `resolve_method` resolves them (ResolvedMethod.task_needs)."""
    return resolve_method(StepConfig(algo=AlgoConfig(method=method, base=base))).task_needs


def resolve_method(cfg: StepConfig) -> ResolvedMethod:
    """Look up `cfg.algo.method` (and its base); ConfigError naming what is unknown or unprovided."""
    algo = cfg.algo

    def method(name: str, key: str) -> Method:
        if name not in METHODS:
            raise ConfigError(f"unknown {key} {name!r}; registered methods: {sorted(METHODS)}")
        return METHODS[name]

    def lookup(table: Callable[[str], Any], name: str, what: str, owner: str):
        try:
            return table(name)
        except KeyError as e:
            raise ConfigError(f"method {owner!r}: {e.args[0]}") from None

    m = method(algo.method, "rl.method")
    advantage = lookup(get_estimator, m.advantage, "advantage", m.name)
    base, reward_names, rollout_name, aux_names = None, list(m.rewards), m.rollout, list(m.auxiliaries)
    if advantage.wraps_base:
        bm = method(algo.base, "rl.base")
        base = lookup(get_estimator, bm.advantage, "advantage", bm.name)
        if base.wraps_base:
            raise ConfigError(f"rl.base={algo.base!r} itself wraps a base method; choose grpo, matchtir or a "
                              f"method with its own advantage")
        reward_names = list(dict.fromkeys([*bm.rewards, *m.rewards]))
        if rollout_name == "sampler":
            rollout_name = bm.rollout
        aux_names = list(dict.fromkeys([*aux_names, *bm.auxiliaries]))
    if algo.rollout:  # rl.rollout: this controller, whatever the method's own
        rollout_name = algo.rollout
    if rollout_name not in ROLLOUTS:
        who = "rl.rollout:" if algo.rollout else f"method {m.name!r}:"
        raise ConfigError(f"{who} unknown rollout controller {rollout_name!r}; registered: {sorted(ROLLOUTS)}")
    controller = ROLLOUTS[rollout_name]
    reward_names = list(dict.fromkeys([*reward_names, *controller.rewards]))
    for name in reward_names:
        if name not in REWARDS:
            raise ConfigError(f"method {m.name!r}: unknown reward {name!r}; registered: {sorted(REWARDS)}")
    terms = [lookup(get_loss_term, t, "loss term", m.name)
             for t in dict.fromkeys([*m.loss_terms, *controller.loss_terms])]
    if cfg.loss.kl_coef > 0 and all(t.name != "kl" for t in terms):
        terms.append(get_loss_term("kl"))
    if cfg.loss.entropy_coef > 0 and all(t.name != "entropy" for t in terms):
        terms.append(get_loss_term("entropy"))
    rewards = tuple(REWARDS[n] for n in reward_names)
    outputs = [r.output for r in rewards]
    dup = sorted({o for o in outputs if outputs.count(o) > 1})
    if dup:
        raise ConfigError(f"method {m.name!r}: several rewards fill {dup}")
    for name in aux_names:
        if name not in AUXILIARIES:
            raise ConfigError(f"method {m.name!r}: unknown step auxiliary {name!r}; registered: {sorted(AUXILIARIES)}")
    # an auxiliary that gives loss-term arrays runs when a term reads one
    for aux in AUXILIARIES.values():
        if aux.name not in aux_names and any(k in t.inputs for t in terms for k in aux.provides):
            aux_names.append(aux.name)
    auxiliaries = tuple(AUXILIARIES[n] for n in aux_names)
    provided = set(CORE_ARRAYS) | set(outputs) | {"delta", "base_advantages", "teacher_covered"} | {
        k for a in auxiliaries for k in a.provides}
    for est in (advantage, base):
        missing = [k for k in (est.inputs if est else ()) if k not in provided]
        if missing:
            givers = {k: a.name for a in AUXILIARIES.values() for k in a.provides}
            hint = "; ".join(f"{k!r}: only a method with step auxiliary {givers[k]!r}" for k in missing if k in givers)
            raise ConfigError(f"method {m.name!r}: advantage {est.name!r} reads {missing}, which no reward of "
                              f"[{', '.join(reward_names)}] fills" + (f" ({hint})" if hint else ""))
    for aux in auxiliaries:
        missing = [k for k in aux.needs_outputs if k not in outputs]
        if missing:
            fillers = sorted(r.name for r in REWARDS.values() if r.output in missing)
            raise ConfigError(f"method {m.name!r}: step auxiliary {aux.name!r} ({aux.describe or aux.name}) reads "
                              f"{missing}, which no reward of [{', '.join(reward_names)}] fills (rewards that do: "
                              f"{fillers})")
    # The step hands a loss term the core arrays, the rewards' outputs and LOSS_ARRAYS only (not
    # delta / base_advantages, which exist only inside the advantage computation).
    term_provided = set(CORE_ARRAYS) | set(outputs) | set(LOSS_ARRAYS) | set(TEACHER_ARRAYS) | {
        k for a in auxiliaries for k in a.provides}
    for term in terms:
        missing = [k for k in term.inputs if k not in term_provided]
        if missing:
            raise ConfigError(f"method {m.name!r}: loss term {term.name!r} reads {missing}, which nothing fills")
        per_row = {r.output for r in rewards if r.per == "trajectory"}
        if term.rows and term.rows not in per_row:
            raise ConfigError(f"method {m.name!r}: loss term {term.name!r} trains the rows of {term.rows!r}, which no "
                              f"per-trajectory reward of [{', '.join(reward_names)}] fills")
    transform = None
    if controller.advantage_transform:
        transform = lookup(get_transform, controller.advantage_transform, "advantage transform", controller.name)
        missing = [k for k in transform.inputs if k != "advantages" and k not in provided]
        if missing:
            raise ConfigError(f"rollout controller {controller.name!r}: advantage transform {transform.name!r} reads "
                              f"{missing}, which no reward of [{', '.join(reward_names)}] fills")
    resolved = ResolvedMethod(m.name, controller, rewards, advantage, base, tuple(terms), m.teacher, transform,
                              auxiliaries)
    if resolved.needs_views and m.teacher not in VIEW_BUILDERS:
        raise ConfigError(f"method {m.name!r}: no teacher view builder for teacher kind {m.teacher!r} "
                          f"(rl.views.register_view_builder); registered: {sorted(VIEW_BUILDERS)}")
    return resolved
