"""Tool environments: the episode protocol, the sandboxed tool executor, and the environments of
the built-in tasks, FTRL, ToolHop and BFCL (which source loads which is turnsight_jax.sources).

- `base`: `Environment`, `Episode`, `StepResult`, `EpisodeScore`, `VectorEnv` (batched).
- `executor`, `_sandbox_host`: `ToolExecutor`, dataset tool code run in a fresh confined process per call.
- `faults`: noisy, slow and unavailable tools injected by configuration (`faults.*`).
- `ftrl`: FTRL loader, `answer_verify`, `solve_metrics` (Solve-P/R/F1), `FTRLEnv`.
- `synthetic`: seeded built-in FTRL-format tasks with gold chains (the training default).
- `toolhop`: ToolHop loader and `ToolHopEnv` (answer accuracy).
- `bfcl`: BFCL v4 multi-turn on the `bfcl-eval` package (imported only when used);
  `python -m turnsight_jax.envs.bfcl_selfcheck` checks it end to end.
"""

from turnsight_jax.envs.base import (
    Environment,
    Episode,
    EpisodeScore,
    StepResult,
    VectorEnv,
)
from turnsight_jax.envs.executor import ToolExecutor, ToolRequest
from turnsight_jax.envs.ftrl import FTRLEnv, answer_verify, solve_metrics
from turnsight_jax.envs.synthetic import (
    SYNTHETIC_CATEGORIES,
    SyntheticConfig,
    generate_task,
    generate_tasks,
    gold_turn_texts,
)
from turnsight_jax.envs.toolhop import ToolHopEnv

__all__ = [
    "Environment",
    "Episode",
    "EpisodeScore",
    "StepResult",
    "VectorEnv",
    "ToolExecutor",
    "ToolRequest",
    "FTRLEnv",
    "answer_verify",
    "solve_metrics",
    "SYNTHETIC_CATEGORIES",
    "SyntheticConfig",
    "generate_task",
    "generate_tasks",
    "gold_turn_texts",
    "ToolHopEnv",
]
