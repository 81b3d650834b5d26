"""Task sources, registered by name: how to load a source's tasks and build its environment.

Training (`data.source`, `data.eval_source`), the SFT warm-start and the evaluation CLI
(`--benchmarks`) all look sources up here, so a new source is added in one place
(docs/adding_an_environment.md).
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
    """load(path) -> tasks (None for generated sources); make_env(num_workers, timeout_s) -> a
    fresh environment (the caller closes it). trainable: usable as data.source."""

    name: str
    make_env: Callable[[int, float], Environment]
    load: Callable[[pathlib.Path], list[Task]] | None = None
    trainable: bool = True

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


def _ftrl_env(num_workers: int, timeout_s: float) -> Environment:
    from turnsight_jax.envs.ftrl import FTRLEnv

    return FTRLEnv(num_workers=num_workers, timeout_s=timeout_s)


def _ftrl_load(path: pathlib.Path) -> list[Task]:
    from turnsight_jax.envs import ftrl

    return ftrl.load_tasks(path)


def _toolhop_env(num_workers: int, timeout_s: float) -> Environment:
    from turnsight_jax.envs.toolhop import ToolHopEnv

    return ToolHopEnv(num_workers=num_workers, timeout_s=timeout_s)


def _toolhop_load(path: pathlib.Path) -> list[Task]:
    from turnsight_jax.envs import toolhop

    return toolhop.load_tasks(path)


def _bfcl_env(num_workers: int, timeout_s: float) -> Environment:
    from turnsight_jax.envs.bfcl import BFCLEnv  # imports bfcl-eval: only when used

    return BFCLEnv()


register_source(TaskSource("builtin", _ftrl_env))  # generated FTRL-format tasks, the FTRL environment
register_source(TaskSource("ftrl", _ftrl_env, _ftrl_load))
register_source(TaskSource("toolhop", _toolhop_env, _toolhop_load))
register_source(TaskSource("bfcl", _bfcl_env, trainable=False))  # tasks come from bfcl-eval (eval only)


def synthetic_config(cfg: mlc.ConfigDict) -> SyntheticConfig:
    d = cfg.data
    return SyntheticConfig(hops=d.hops, width=d.width, min_distractors=d.min_distractors,
                           max_distractors=d.max_distractors, vocab_size=d.vocab_size, extra_rows=d.extra_rows,
                           num_relations=d.num_relations, entity_style=d.entity_style,
                           prompt_style=d.prompt_style)


def load_tasks(cfg: mlc.ConfigDict, split: str) -> list[Task]:
    """Training (`split="train"`) or held-out tasks of the run. Built-in held-out tasks use a
    seed stream disjoint from the training tasks'."""
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
    tasks = source.load(pathlib.Path(path))
    if split == "eval" and cfg.data.num_eval:
        tasks = tasks[: cfg.data.num_eval]
    return tasks


def make_env(name: str, *, num_workers: int = 2, timeout_s: float = 10.0) -> Environment:
    return get_source(name).make_env(num_workers, timeout_s)
