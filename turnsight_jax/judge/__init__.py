"""A model-judged reward and a distilled judge (OpenWebRL; docs/signal_methods.md).

A judge model reads a trajectory's transcript and writes a rationale, then a 0/1 verdict
(`prompt`: what it sees, `parse`: the strict format); `model.Judge` runs it greedily in batches;
`method` registers `rl.method=judge` (the judged rollout controller, the label as GRPO's
reward, agreement with the verifier as metrics); `labels` and `distill` are the teacher's
labelling and the student's distillation, `python -m turnsight_jax.judge label|distill`.
"""
