"""RLSD (Self-Distilled RLVR; docs/baselines.md) on the tiny CPU experiment: the embedded default's
model, built-in tasks and warm-start, with the method switched to `rlsd`: the base advantage
(MatchTIR, as the paper runs RLSD: the built-in tasks carry their gold call chains) modulated per token by
w = clip(exp(sign(A) * gap), 1 - eps_w, 1 + eps_w), where gap is the teacher's log-prob of the
token with the gold answer shown after the prompt minus the student's.

    python -m turnsight_jax.train --config configs/methods/rlsd.py --workdir /tmp/rlsd_run

The mechanism shows in the logged metrics rlsd/weight_mean|min|max, rlsd/frac_strengthened,
rlsd/frac_weakened and teacher/gap_mean. 8 RL steps and 32 held-out tasks (as configs/methods/toolrl.py).
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "rlsd_tiny"
    c.rl.method, c.rl.base = "rlsd", "matchtir"
    c.teacher.weights = "policy"  # the same model, given the privileged context (RLSD)
    c.privileged.source, c.privileged.placement = "gold_answer", "prompt"
    c.train.steps = 8
    c.data.num_eval = 32
    return c
