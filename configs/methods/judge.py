"""The model-judged reward (OpenWebRL; turnsight_jax.judge, docs/signal_methods.md) on the tiny
CPU experiment: every rollout is labelled by a judge model, which writes a rationale and then a
0/1 verdict (`<rationale>...</rationale><verdict>1</verdict>`), and GRPO normalises the labels per
prompt group; the environment's own reward (the verifier) is only measured against, never
trained on. The judge sees the question, the calls, the tool results and the final answer, not
the reference answer (`judge.reference`), and not the policy's reasoning.

The judge is a small model distilled from a teacher's labels. On the built-in tasks, without a
large judge at hand, the teacher is the verifier with a stated rationale (`--teacher verifier`;
`--teacher model --config.judge.checkpoint=/path/to/large_judge` where one exists):

    python -m turnsight_jax.judge label --config configs/methods/judge.py --teacher verifier \\
        --policy demonstrations --num-tasks 256 --samples 2 --out runs/judge_labels.jsonl
    python -m turnsight_jax.judge distill --config configs/methods/judge.py --labels runs/judge_labels.jsonl \\
        --student-preset tiny --steps 200 --lr 1e-2 --batch-size 4 --out runs/judge_tiny
    python -m turnsight_jax.train --config configs/methods/judge.py --workdir /tmp/judge_run

(`--config.judge.checkpoint=DIR` points the run at another judge; `--config.judge.rationale=False`,
for `distill` and the run together, is the rationale-free ablation.) Metrics: judge/agreement
(label == the verifier's success), judge/positive_rate, judge/false_positive_rate,
judge/false_negative_rate, judge/malformed_rate, judge/verifier_success_rate, judge/labelled,
judge/generated_tokens; train/reward_mean is the mean label, rollout/reward_mean the verifier's.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "judge_tiny"
    c.rl.method = "judge"
    c.judge.checkpoint = "runs/judge_tiny"  # what the distill command above writes
    c.judge.max_new_tokens = 48  # the tiny judge's rationales are one sentence
    c.judge.max_prompt_tokens = 1024
    c.train.steps = 8
    c.data.num_eval = 32
    return c
