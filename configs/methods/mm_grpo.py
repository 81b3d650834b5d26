"""MM-GRPO (OpenWebRL; turnsight_jax.methods.mm_grpo, docs/rollout_methods.md) on the tiny CPU
experiment: GRPO's trajectory-broadcast advantage (each trajectory's group-normalised outcome on
every one of its tokens), the asymmetric clip rho in [1 - clip_eps, 1 + clip_eps_high] with
clip_eps_high > clip_eps, and the MM-GRPO rollout controller (rl.rollout=mm_grpo): dynamic sampling
(groups whose rewards have zero variance are replaced by new prompts, at most
mm_grpo.refill_rounds rounds) and an observation window (each turn's context keeps only the most
recent mm_grpo.window tool responses in full; older ones are replaced by mm_grpo.placeholder).

    python -m turnsight_jax.train --config configs/methods/mm_grpo.py --workdir /tmp/mm_grpo_run

With TurnSight as the base method's weighting (the teacher's hindsight views are built on each
turn's windowed context):

    python -m turnsight_jax.train --config configs/methods/mm_grpo.py --workdir /tmp/mm_grpo_ts \\
        --config.rl.method=turnsight --config.rl.base=grpo

Metrics: mm_grpo/dropped_groups, mm_grpo/refill_rounds, mm_grpo/extra_rollouts,
mm_grpo/zero_variance_kept, mm_grpo/elided_observations, mm_grpo/reprefill_tokens.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "mm_grpo_tiny"
    c.rl.method = "grpo"
    c.rl.rollout = "mm_grpo"
    c.loss.clip_eps = 0.2  # the ratio's lower clip, 1 - 0.2
    c.loss.clip_eps_high = 0.28  # and its upper, 1 + 0.28: the asymmetric clip (eps_high > eps_low)
    c.mm_grpo.window = 1  # the most recent tool response in full (the paper keeps the last screenshot)
    c.mm_grpo.refill_rounds = 2
    c.train.steps = 8
    c.data.num_eval = 32
    return c
