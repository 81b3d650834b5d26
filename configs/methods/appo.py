"""APPO (turnsight_jax.methods.appo; docs/rollout_methods.md) on the tiny CPU experiment, with GRPO as
the method: each prompt's G rollouts, then appo.branches continuations of each from its top
branch points by BS = Z(clip Omega) * Z(H) (Omega: the discounted future log-ratio of the current
policy to the one before the last update; H: the decode's entropy), each sharing its prefix's KV
blocks; the initial rollouts and the branches form two advantage groups per prompt, and the
final advantage is amplified by 1 + appo.amplify * (clip(Omega) - 1) per token.

    python -m turnsight_jax.train --config configs/methods/appo.py --workdir /tmp/appo_run

TurnSight over GRPO with APPO's rollouts and amplification:
`--config.rl.method=turnsight --config.rl.base=grpo --config.rl.rollout=appo`. Metrics:
appo/branches, appo/branch_tokens, appo/shared_prefix_tokens, appo/omega_log_mean,
appo/omega_clipped_mean, appo/branch_score_mean, appo/branch_entropy_mean, appo/amplify_{mean,min,max},
rollout/groups (two per prompt).
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "appo_tiny"
    c.rl.method = "grpo"
    c.rl.rollout = "appo"
    c.rollout.engine = "paged"  # branches share the prefix's blocks in the paged engine
    c.appo.branches = 1
    # no warm-up: Omega compares the policy with the one before the last update, which a zero-lr
    # warm-up step would leave equal (rho = 1 everywhere)
    c.optim.warmup_steps = 0
    c.train.steps = 8
    c.data.num_eval = 32
    return c
