"""Benchmarks and their categories: which tasks, which environment, which rollout budgets.

A *suite* is one benchmark's tasks grouped by category in the order of the paper's Table 1:

  ftrl     Single-Hop, Parallel Single-Hop, Multi-Hop, Parallel Multi-Hop  (Solve-P/R/F1)
  bfcl     Base, Missing Function, Missing Parameter, Long Context, Memory,
           Web Search (the paper's six BFCL subsets)                       (checker accuracy)
  toolhop  ToolHop                                                          (answer accuracy)
  builtin  the four FTRL categories on seeded synthetic tasks               (Solve-P/R/F1)

BFCL's subsets are chosen by bfcl-eval category name (`parse_bfcl_categories`, `--bfcl-categories`);
`load_bfcl_suite` lists the selected ones that cannot run here (no embedding model, no search
backend) as not run and the unselected ones of the paper's six as not selected.

`check_inputs` validates names and paths without loading anything; `load_suite` loads the tasks;
`run_heldout_suite` is a training run's own held-out built-in tasks (in the run's order, with the
run's budgets); `make_env` builds the environment; `rollout_config` the driver's budgets. Tasks and
environments come from the task-source registry `turnsight_jax.sources`, shared with training.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Sequence

from turnsight_jax.chat.types import Task
from turnsight_jax.envs.base import Environment
from turnsight_jax.eval import ftrl_metrics
from turnsight_jax.eval.errors import EvalError
from turnsight_jax.rollout.driver import RolloutConfig

BENCHMARKS = ("ftrl", "bfcl", "toolhop", "builtin")

FTRL_CATEGORIES = ftrl_metrics.FTRL_CATEGORIES  # (key, label) in Table 1 order
BFCL_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("multi_turn_base", "Base"),
    ("multi_turn_miss_func", "Missing Function"),
    ("multi_turn_miss_param", "Missing Parameter"),
    ("multi_turn_long_context", "Long Context"),
    ("memory", "Memory"),
    ("web_search", "Web Search"),
)
# The paper's BFCL average covers these six subsets (Memory: its backends' questions together;
# Web Search: its base and no_snippet entries together).
# bfcl-eval's own category names (`--bfcl-categories`), in table order, and its collection names
# for groups of them (bfcl_eval.constants.category_mapping); the default is all of them.
BFCL_SUBSET_CATEGORIES: tuple[str, ...] = (
    "multi_turn_base", "multi_turn_miss_func", "multi_turn_miss_param", "multi_turn_long_context",
    "memory_kv", "memory_rec_sum", "memory_vector", "web_search_base", "web_search_no_snippet",
)
BFCL_CATEGORY_GROUPS: dict[str, tuple[str, ...]] = {
    "multi_turn": BFCL_SUBSET_CATEGORIES[:4], "memory": BFCL_SUBSET_CATEGORIES[4:7],
    "web_search": BFCL_SUBSET_CATEGORIES[7:], "all": BFCL_SUBSET_CATEGORIES,
}
TOOLHOP_CATEGORIES: tuple[tuple[str, str], ...] = (("toolhop", "ToolHop"),)

# What each benchmark reports per category: FTRL-style Solve-P/R/F1 or a pass rate.
SOLVE_METRICS = ftrl_metrics.SOLVE_METRICS
KIND = {"ftrl": "solve", "builtin": "solve", "bfcl": "accuracy", "toolhop": "accuracy"}
TITLES = {"ftrl": "FTRL", "bfcl": "BFCL v4", "toolhop": "ToolHop", "builtin": "Built-in"}

# BFCL ends a user turn after 20 steps (its MAXIMUM_STEP_LIMIT, enforced by the environment,
# which force-quits the episode); a user turn needs at most that many call steps plus the
# answer step, so this many policy turns per user turn never bind before BFCL's own limit.
BFCL_POLICY_TURNS_PER_USER_TURN = 20 + 2


# Policy turns per episode when --max-turns is not given: the released MatchTIR evaluation's
# (verl's multi-turn rollout default max_turns=10 for FTRL; evaluation_toolhop.py --max_turns 9,
# one generation in the direct scenario). Built-in tasks are FTRL-format: FTRL's limit.
DEFAULT_MAX_TURNS = {"ftrl": 10, "builtin": 10}
# BFCL's per-step generation cap (its OSS handler asks for min(4096, context left) tokens).
BFCL_STEP_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """Options shared by every benchmark (see `python -m turnsight_jax.evaluate --help`).

    max_turns: None: each benchmark's default (`DEFAULT_MAX_TURNS`, ToolHop's per scenario).
    max_new_tokens: per-turn decode cap; None: off (only the episode's response budget applies;
    BFCL: its own 4096 per step).
    """

    max_turns: int | None = None
    max_new_tokens: int | None = None
    max_prompt_tokens: int = 10_000
    max_response_tokens: int = 13_000
    bfcl_max_response_tokens: int = 32_768
    enable_thinking: bool = False
    batch_size: int = 32
    limit: int | None = None
    bfcl_limit: int | None = None
    builtin_per_category: int = 50
    builtin_seed: int = 1000
    workers: int = 2
    tool_timeout_s: float = 10.0
    seed: int = 0
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    samples: int = 1  # rollouts per task when sampling (per-task metrics = their mean)
    bfcl_memory_embedding_model: str | None = None  # local sentence-transformers folder: runs memory_vector
    bfcl_search_backend: str | None = None  # Web Search backend (envs.web_search.load_backend); None: not run
    bfcl_categories: tuple[str, ...] = BFCL_SUBSET_CATEGORIES  # bfcl-eval category names to run
    toolhop_scenario: str = "direct"  # envs.toolhop.SCENARIOS; the released evaluation's default
    thinking_rule: str = ""  # why enable_thinking is what it is (the evaluate CLI's header)

    def turns_for(self, benchmark: str) -> int:
        """Policy turns per episode of a non-BFCL benchmark (the flag, else the benchmark's default)."""
        if self.max_turns is not None:
            return self.max_turns
        if benchmark == "toolhop":
            from turnsight_jax.envs.toolhop import SCENARIO_MAX_TURNS

            return SCENARIO_MAX_TURNS[self.toolhop_scenario]
        return DEFAULT_MAX_TURNS[benchmark]

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def group_size(self) -> int:
        """Rollouts per task: `samples` when sampling, 1 when greedy."""
        return 1 if self.greedy else self.samples


@dataclasses.dataclass
class Suite:
    """One benchmark's tasks, grouped by category (category key -> tasks, in table order)."""

    benchmark: str
    categories: dict[str, list[Task]]
    labels: dict[str, str]
    order: list[tuple[str, Task]] | None = None  # evaluation order; None: category by category
    heldout: bool = False  # a training run's held-out tasks
    prerequisites: list[Task] = dataclasses.field(default_factory=list)  # BFCL Memory: run first, unscored
    not_run: dict[str, str] = dataclasses.field(default_factory=dict)  # subset label -> why it was not run
    not_selected: list[str] = dataclasses.field(default_factory=list)  # BFCL subsets left out by --bfcl-categories
    search_backend: object | None = None  # BFCL Web Search: the loaded backend

    def pairs(self) -> list[tuple[str, Task]]:
        """(category, task) in evaluation (= batching) order."""
        if self.order is not None:
            return list(self.order)
        return [(cat, t) for cat, ts in self.categories.items() for t in ts]

    @property
    def tasks(self) -> list[Task]:
        return [t for ts in self.categories.values() for t in ts]

    def __len__(self) -> int:
        return sum(len(ts) for ts in self.categories.values())


def parse_benchmarks(text: str) -> list[str]:
    """"ftrl,bfcl" -> ["ftrl", "bfcl"]; unknown or repeated names are an EvalError."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names:
        raise EvalError(f"--benchmarks is empty; choose from {', '.join(BENCHMARKS)}")
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise EvalError(
            f"unknown benchmark {unknown[0]!r} in --benchmarks; valid benchmarks: {', '.join(BENCHMARKS)}"
        )
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise EvalError(f"benchmark {dupes[0]!r} is listed twice in --benchmarks")
    return names


def parse_bfcl_categories(text: str) -> tuple[str, ...]:
    """"multi_turn_base,memory" -> bfcl-eval category names in table order (groups expanded);
    an unknown name is an EvalError listing the valid ones."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    valid = f"{', '.join(BFCL_SUBSET_CATEGORIES)} (groups: {', '.join(BFCL_CATEGORY_GROUPS)})"
    if not names:
        raise EvalError(f"--bfcl-categories is empty; valid categories: {valid}")
    chosen: set[str] = set()
    for name in names:
        if name in BFCL_CATEGORY_GROUPS:
            chosen.update(BFCL_CATEGORY_GROUPS[name])
        elif name in BFCL_SUBSET_CATEGORIES:
            chosen.add(name)
        else:
            raise EvalError(f"unknown BFCL category {name!r} in --bfcl-categories; valid categories: {valid}")
    return tuple(c for c in BFCL_SUBSET_CATEGORIES if c in chosen)


def check_inputs(benchmarks: Sequence[str], ftrl_path: str | None, toolhop_path: str | None) -> None:
    """Data paths exist for the benchmarks that need them; bfcl-eval is importable for bfcl."""
    for name, flag, path in (("ftrl", "--ftrl", ftrl_path), ("toolhop", "--toolhop", toolhop_path)):
        if name not in benchmarks:
            continue
        if not path:
            raise EvalError(f"--benchmarks {name} needs {flag} PATH (the {TITLES[name]} test file)")
        if not os.path.exists(path):
            raise EvalError(f"{flag} {path}: no such file or folder")
    if "bfcl" in benchmarks:
        from turnsight_jax.envs.bfcl import import_bfcl

        try:
            import_bfcl()
        except ImportError as e:
            raise EvalError(str(e)) from None


def check_bfcl_options(settings: EvalSettings) -> None:
    """The vector Memory backend's model folder, before any run (when memory_vector is selected)."""
    if settings.bfcl_memory_embedding_model is not None and "memory_vector" in settings.bfcl_categories:
        from turnsight_jax.envs.bfcl import use_embedding_model

        try:
            use_embedding_model(settings.bfcl_memory_embedding_model)
        except (ImportError, OSError, ValueError) as e:
            raise EvalError(f"--bfcl-memory-embedding-model {settings.bfcl_memory_embedding_model}: {e}") from None


def load_search_backend(spec: str):
    """The Web Search backend `--bfcl-search-backend spec` names (EvalError on a bad spec)."""
    from turnsight_jax.envs.web_search import load_backend

    try:
        return load_backend(spec)
    except (OSError, ValueError) as e:
        raise EvalError(f"--bfcl-search-backend {e}") from None


WEB_SEARCH_NOT_RUN = "needs a search backend: --bfcl-search-backend corpus:PATH or module:attr"
VECTOR_NOT_RUN = "needs a local embedding model: --bfcl-memory-embedding-model DIR"


def _subset_label(title: str, names: Sequence[str], prefix: str) -> str:
    """"Memory (kv, rec_sum)": a subset's title with the bfcl-eval categories it holds."""
    return f"{title} ({', '.join(n[len(prefix):] for n in names)})"


def load_bfcl_suite(settings: EvalSettings) -> Suite:
    """The selected BFCL subsets (`settings.bfcl_categories`): multi-turn entries; Memory questions
    (+ the prerequisite conversations they depend on); Web Search questions (with a backend).
    Selected subsets that cannot run here are listed in `not_run` with the reason, subsets of the
    paper's average that were not selected in `not_selected`; neither is faked or averaged."""
    from turnsight_jax.envs import bfcl

    selected = settings.bfcl_categories
    per_cat = [x for x in (settings.bfcl_limit, settings.limit) if x is not None]
    n = min(per_cat) if per_cat else None
    tasks = [t for key in bfcl.BFCL_CATEGORIES if key in selected for t in bfcl.load_tasks(key, limit=n)]
    labels = dict(BFCL_CATEGORIES)
    prereqs, memory, not_run = [], [], {}
    for backend in bfcl.MEMORY_BACKENDS:
        if f"memory_{backend}" not in selected:
            continue
        if backend == "vector" and not settings.bfcl_memory_embedding_model:
            not_run["Memory (vector)"] = VECTOR_NOT_RUN
            continue
        pre, questions = bfcl.load_memory_tasks(backend, limit=n)
        prereqs += pre
        tasks += questions
        memory.append(f"memory_{backend}")
    labels["memory"] = _subset_label("Memory", memory, "memory_")
    searches = [c for c in bfcl.WEB_SEARCH_CATEGORIES if c in selected]
    backend = None
    if searches and settings.bfcl_search_backend is None:
        not_run[_subset_label("Web Search", searches, "web_search_")] = WEB_SEARCH_NOT_RUN
    elif searches:
        backend = load_search_backend(settings.bfcl_search_backend)
        tasks += [t for c in searches for t in bfcl.load_web_search_tasks(c, limit=n)]
    labels["web_search"] = _subset_label("Web Search", searches, "web_search_")
    if not tasks:
        why = "; ".join(f"{k}: {v}" for k, v in not_run.items())
        raise EvalError(f"--bfcl-categories {','.join(selected)}: none of the selected BFCL subsets can run ({why})")
    groups, _ = _group(tasks, BFCL_CATEGORIES, None, "bfcl")
    not_selected = [label for key, label in BFCL_CATEGORIES
                    if not any(_bfcl_subset(c) == key for c in selected)]
    return Suite("bfcl", groups, {k: labels[k] for k in groups}, prerequisites=prereqs, not_run=not_run,
                 not_selected=not_selected, search_backend=backend)


def _bfcl_subset(category: str) -> str:
    """The table column (BFCL_CATEGORIES key) of a bfcl-eval category name."""
    return "memory" if category.startswith("memory_") else "web_search" if category.startswith("web_search") \
        else category


def _group(tasks: Sequence[Task], known: Sequence[tuple[str, str]], limit: int | None,
           where: str) -> tuple[dict[str, list[Task]], dict[str, str]]:
    """Tasks by category: the known categories first (in table order), then any others."""
    labels = dict(known)
    groups: dict[str, list[Task]] = {key: [] for key, _ in known}
    for task in tasks:
        key = ftrl_metrics.category_key(task.category)
        if key not in groups:
            groups[key] = []
            labels[key] = ftrl_metrics.category_label(key)
        groups[key].append(task)
    groups = {k: (v[:limit] if limit is not None else v) for k, v in groups.items() if v}
    if not groups:
        raise EvalError(f"{where}: no tasks to evaluate")
    return groups, {k: labels[k] for k in groups}


def _load_file(benchmark: str, path: str) -> list[Task]:
    from turnsight_jax import sources

    try:
        return sources.get_source(benchmark).load(pathlib.Path(path))
    except (OSError, ValueError) as e:
        raise EvalError(f"--{benchmark}: {e}") from None


def load_suite(benchmark: str, settings: EvalSettings, *, ftrl_path: str | None = None,
               toolhop_path: str | None = None) -> Suite:
    """Loads one benchmark's tasks (limits applied per category)."""
    limit = settings.limit
    if benchmark == "ftrl":
        groups, labels = _group(_load_file("ftrl", ftrl_path), FTRL_CATEGORIES, limit, f"--ftrl {ftrl_path}")
    elif benchmark == "toolhop":
        from turnsight_jax.envs.toolhop import scenario_task

        tasks = [scenario_task(t, settings.toolhop_scenario) for t in _load_file("toolhop", toolhop_path)]
        groups, labels = _group(tasks, TOOLHOP_CATEGORIES, limit, f"--toolhop {toolhop_path}")
    elif benchmark == "bfcl":
        return load_bfcl_suite(settings)
    elif benchmark == "builtin":
        from turnsight_jax.envs import synthetic

        n = settings.builtin_per_category if limit is None else min(limit, settings.builtin_per_category)
        cats = [key for key, _ in FTRL_CATEGORIES]
        tasks = synthetic.generate_tasks(n * len(cats), seed=settings.builtin_seed, categories=cats)
        groups, labels = _group(tasks, FTRL_CATEGORIES, None, "builtin")
    else:
        raise EvalError(f"unknown benchmark {benchmark!r}; valid benchmarks: {', '.join(BENCHMARKS)}")
    return Suite(benchmark, groups, labels)


def run_heldout_suite(run_cfg, settings: EvalSettings) -> Suite:
    """A training run's held-out built-in tasks (`sources.load_tasks(run_cfg, "eval")`: data.num_eval
    tasks from the run's held-out seed stream) in the run's order. Its budgets are the settings'
    (`rollout_config`), which the command line fills from the run's config (rollout.*,
    eval.max_turns) unless flags say otherwise. `settings.limit` keeps the first N tasks of every
    category (and then no longer reproduces the run's batches)."""
    from turnsight_jax import sources

    tasks = sources.load_tasks(run_cfg, "eval")
    groups, labels = _group(tasks, FTRL_CATEGORIES, settings.limit, "the run's held-out tasks")
    kept = {id(t) for ts in groups.values() for t in ts}
    order = [(ftrl_metrics.category_key(t.category), t) for t in tasks if id(t) in kept]
    return Suite("builtin", groups, labels, order=order, heldout=True)


def make_env(benchmark: str, settings: EvalSettings) -> Environment:
    """The benchmark's environment from the task-source registry (the caller closes it)."""
    from turnsight_jax import sources

    return sources.make_env(benchmark, num_workers=settings.workers, timeout_s=settings.tool_timeout_s)


def rollout_config(benchmark: str, settings: EvalSettings, tasks: Sequence[Task]) -> RolloutConfig:
    """The driver's budgets for a benchmark.

    FTRL, ToolHop, built-in: `settings.turns_for(benchmark)` policy turns (released defaults: FTRL
    10, ToolHop 9, direct 1) and `max_response_tokens`; the per-turn cap is `max_new_tokens`, or
    the response budget itself when None (off: a turn may use all that is left). BFCL: its own
    per-user-turn step limit applies (the environment force-quits after 20 steps in one user turn,
    as BFCL's harness does), so the driver's cap is set above it, (#user turns) x 22; the response
    budget is `bfcl_max_response_tokens`, the per-step cap BFCL's 4096 unless `max_new_tokens`.
    """
    common = dict(max_prompt_tokens=settings.max_prompt_tokens, enable_thinking=settings.enable_thinking)
    if benchmark == "bfcl":
        user_turns = max((len(t.extra["bfcl_entry"]["question"]) for t in tasks), default=1)
        budget = settings.bfcl_max_response_tokens
        step = settings.max_new_tokens if settings.max_new_tokens is not None else BFCL_STEP_TOKENS
        return RolloutConfig(max_turns=user_turns * BFCL_POLICY_TURNS_PER_USER_TURN, max_response_tokens=budget,
                             max_turn_tokens=step, **common)
    budget = settings.max_response_tokens
    per_turn = budget if settings.max_new_tokens is None else settings.max_new_tokens
    return RolloutConfig(max_turns=settings.turns_for(benchmark), max_response_tokens=budget,
                         max_turn_tokens=per_turn, **common)
