"""Evaluation on FTRL, BFCL v4 (multi-turn, Memory, Web Search), ToolHop and the built-in tasks.

- `suites`: benchmark names, categories (Table 1 order), task loading, environments, budgets.
- `scripts`: replay scripts (ground truth or a file).
- `policies`: `PolicySource`: `ModelSource` (run folder / HF folder, greedy or sampled) and `ReplaySource`.
- `runner`: the batched loop through the rollout driver (samples per task, the held-out seeding); `Example` records.
- `bfcl_harness`: BFCL's own loop for a Qwen3 (the Qwen FC handler's prompting path), Memory chains.
- `web_search`: BFCL's Web Search tools on a pluggable search backend (interface, offline corpus backend, `load_backend`).
- `heldout`: the training-time held-out evaluation, a layer over the runner.
- `ftrl_metrics`: the paper's FTRL metrics (per category and category-averaged Solve-P/R/F1, Avg), the one
  computation behind the tables, the held-out evaluation's summary.json and the report.
- `scoring`: per-category and average scores, Markdown tables.

The progress line is `turnsight_jax.rollout.progress.ProgressLine` (shared with training).

The command line is `python -m turnsight_jax.evaluate` (see docs/evaluation.md).
"""

from turnsight_jax.eval.errors import EvalError

__all__ = ["EvalError"]
