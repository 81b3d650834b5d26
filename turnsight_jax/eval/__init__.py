"""Evaluation on FTRL, BFCL v4 multi-turn, ToolHop and the built-in tasks.

- `suites`: benchmark names, categories (Table 1 order), task loading, environments, budgets.
- `scripts`: replay scripts (ground truth or a file).
- `policies`: `PolicySource`: `ModelSource` (run folder / HF folder, greedy) and `ReplaySource`.
- `runner`: the batched loop through the rollout driver; `Example` records.
- `scoring`: per-category and average scores, Markdown tables.
- `progress`: the stderr progress line.

The command line is `python -m turnsight_jax.evaluate` (see docs/evaluation.md).
"""

from turnsight_jax.eval.errors import EvalError

__all__ = ["EvalError"]
