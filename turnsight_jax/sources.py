"""Task sources, registered by name: how to load a source's tasks and build its environment.

Training (`data.source`, `data.eval_source`), the SFT warm-start and the evaluation CLI
(`--benchmarks`) all look sources up here, so a new source is added in one place
(docs/adding_an_environment.md).

Capabilities: a source declares the optional Task fields it can fill (`TaskSource.provides`);
a reward declares the ones it reads (`rl.methods.Reward.needs`). `config.validate` refuses a
training source that cannot provide what the method's rewards read, and `load_tasks(cfg,
"train")` refuses a training row that lacks it (FTRL rows without `ground_truth`), naming the
file and the row, before any model is built.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable

import ml_collections as mlc

from turnsight_jax.chat.types import Task
from turnsight_jax.envs.base import Environment
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_tasks
from turnsight_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TaskSource:
    """load(path, needs=()) -> tasks (None for generated sources; `needs`: the Task fields every
    task must carry, a row without one is an error naming it); make_env(num_workers, timeout_s) ->
    a fresh environment (the caller closes it). trainable: usable as data.source. provides: the
    optional Task fields (e.g. "gold_calls") its tasks can carry."""

    name: str
    make_env: Callable[[int, float], Environment]
    load: Callable[..., list[Task]] | None = None
    trainable: bool = True
    provides: tuple[str, ...] = ()

    @property
    def needs_path(self) -> bool:
        return self.load is not None


SOURCES: dict[str, TaskSource] = {}


def register_source(source: TaskSource) -> TaskSource:
    if source.name in SOURCES:
        raise ValueError(f"task source {source.name!r} already registered")
    SOURCES[source.name] = source
    return source


def get_source(name: str, *, key: str = "data.source", trainable: bool = False) -> TaskSource:
    known = sorted(n for n, s in SOURCES.items() if s.trainable or not trainable)
    if name not in SOURCES or (trainable and not SOURCES[name].trainable):
        raise ConfigError(f"{key} must be one of {', '.join(known)}, got {name!r}")
    return SOURCES[name]


def _executor_env(env_cls, num_workers: int, timeout_s: float, max_output_chars: int | None) -> Environment:
    if max_output_chars is None:
        return env_cls(num_workers=num_workers, timeout_s=timeout_s)
    from turnsight_jax.envs.executor import ToolExecutor

    env = env_cls(ToolExecutor(num_workers, timeout_s=timeout_s, max_output_chars=max_output_chars))
    env._owns_executor = True  # built for this environment alone: its close() closes it too
    return env


def _ftrl_env(num_workers: int, timeout_s: float, max_output_chars: int | None = None) -> Environment:
    from turnsight_jax.envs.ftrl import FTRLEnv

    return _executor_env(FTRLEnv, num_workers, timeout_s, max_output_chars)


def _ftrl_load(path: pathlib.Path, needs: tuple[str, ...] = ()) -> list[Task]:
    from turnsight_jax.envs import ftrl

    return ftrl.load_tasks(path, require=needs)


def _toolhop_env(num_workers: int, timeout_s: float, max_output_chars: int | None = None) -> Environment:
    from turnsight_jax.envs.toolhop import ToolHopEnv

    return _executor_env(ToolHopEnv, num_workers, timeout_s, max_output_chars)


def _toolhop_load(path: pathlib.Path, needs: tuple[str, ...] = ()) -> list[Task]:
    from turnsight_jax.envs import toolhop

    if needs:  # config.validate refuses this first; kept for direct callers
        raise ConfigError(f"ToolHop tasks cannot provide {list(needs)}")
    return toolhop.load_tasks(path)


def _bfcl_env(num_workers: int, timeout_s: float) -> Environment:
    from turnsight_jax.envs.bfcl import BFCLEnv  # imports bfcl-eval: only when used

    return BFCLEnv()


# generated FTRL-format tasks with their gold chains, the FTRL environment
register_source(TaskSource("builtin", _ftrl_env, provides=("gold_calls",)))
# gold_calls from the rows' `ground_truth` column (MatchTIR's training rows; FTRL's test rows lack it)
register_source(TaskSource("ftrl", _ftrl_env, _ftrl_load, provides=("gold_calls",)))
register_source(TaskSource("toolhop", _toolhop_env, _toolhop_load))  # no gold call chains
# tasks come from bfcl-eval (eval only); they carry BFCL's ground-truth calls
register_source(TaskSource("bfcl", _bfcl_env, trainable=False, provides=("gold_calls",)))


def providers(field: str) -> list[str]:
    """The trainable sources that can provide Task field `field`."""
    return sorted(n for n, s in SOURCES.items() if s.trainable and field in s.provides)


def check_provides(source: TaskSource, needs: tuple[str, ...], who: str) -> None:
    """ConfigError (one line) when `source` cannot provide a Task field of `needs`; `who` says
    what needs it (for the message)."""
    for field in needs:
        if field not in source.provides:
            have = ", ".join(providers(field)) or "none"
            raise ConfigError(f"{who} needs Task.{field}, which data.source={source.name!r} does not provide "
                              f"(sources that do: {have})")


def training_needs(cfg: mlc.ConfigDict) -> tuple[str, ...]:
    """The Task fields the rewards of the run's method (rl.method, over rl.base) read."""
    from turnsight_jax.rl.methods import task_needs  # imports the rollout stack: only when training

    return task_needs(cfg.rl.method, cfg.rl.base)


def synthetic_config(cfg: mlc.ConfigDict) -> SyntheticConfig:
    d = cfg.data
    # .get: a run folder's config.json written before the result-words knob has no such key
    return SyntheticConfig(hops=d.hops, max_hops=d.max_hops, width=d.width, min_distractors=d.min_distractors,
                           max_distractors=d.max_distractors, vocab_size=d.vocab_size, extra_rows=d.extra_rows,
                           num_relations=d.num_relations, entity_style=d.entity_style,
                           prompt_style=d.prompt_style, min_result_words=d.get("min_result_words", 0),
                           max_result_words=d.get("max_result_words", 0))


def load_tasks(cfg: mlc.ConfigDict, split: str) -> list[Task]:
    """Training (`split="train"`) or held-out tasks of the run. Built-in held-out tasks use a
    seed stream disjoint from the training tasks'. Training tasks must carry every Task field the
    method's rewards read (`training_needs`): a file row without one raises (ValueError naming the
    file, the row and the column)."""
    key = "data.source" if split == "train" else "data.eval_source"
    name = cfg.data.source if split == "train" else cfg.data.eval_source
    path = cfg.data.path if split == "train" else cfg.data.eval_path
    source = get_source(name, key=key, trainable=True)
    if not source.needs_path:
        n = cfg.data.num_train if split == "train" else cfg.data.num_eval
        seed = 2 * cfg.seed + (0 if split == "train" else 1)
        return generate_tasks(n, seed=seed, categories=tuple(cfg.data.categories), config=synthetic_config(cfg))
    if not path:
        raise ConfigError(f"data.{'path' if split == 'train' else 'eval_path'} is required for source {name!r}")
    needs = training_needs(cfg) if split == "train" else ()
    check_provides(source, needs, f"rl.method={cfg.rl.method!r}")
    tasks = source.load(pathlib.Path(path), needs) if needs else source.load(pathlib.Path(path))
    if split == "eval" and cfg.data.num_eval:
        tasks = tasks[: cfg.data.num_eval]
    return tasks


def make_env(name: str, *, num_workers: int = 2, timeout_s: float = 10.0,
             max_output_chars: int | None = None) -> Environment:
    """A fresh environment of source `name`. `max_output_chars` (`rollout.max_tool_output_chars`):
    tool results longer than this are cut to it plus a note; None or the executor's default
    (16,384) builds the source's environment as registered. Only the built-in executor-backed
    sources (builtin, ftrl, toolhop) take another value: for any other source it is a ConfigError."""
    source = get_source(name)
    if not check_output_cap(name, max_output_chars):
        return source.make_env(num_workers, timeout_s)
    return source.make_env(num_workers, timeout_s, max_output_chars)


def check_output_cap(name: str, max_output_chars: int | None) -> bool:
    """Whether source `name`'s environment must be built with `max_output_chars` (not None, not
    the executor's default); ConfigError when the source cannot take it."""
    from turnsight_jax.envs.executor import ExecutorLimits

    if max_output_chars in (None, ExecutorLimits.max_output_chars):
        return False
    if get_source(name).make_env not in (_ftrl_env, _toolhop_env):
        raise ConfigError(f"source {name!r} does not take rollout.max_tool_output_chars={max_output_chars} (its "
                          f"environment does not run tools through this project's executor)")
    return True
