"""PPO with GAE and a learned critic (turnsight_jax.methods.critic; docs/baselines.md) on the tiny CPU
experiment: the outcome reward on each trajectory's last policy token, GAE(gamma, lambda) over
the policy tokens against a critic (its own trunk, initialised from the warm-started policy, and a
zero value head), advantages whitened over the batch, the clipped surrogate for the policy and the
clipped value loss for the critic, each with its own AdamW.

    python -m turnsight_jax.train --config configs/methods/ppo.py --workdir /tmp/ppo_run

Any method that wraps a base combines with it: `--config.rl.method=turnsight --config.rl.base=ppo`
weights GAE's advantage by TurnSight's hindsight gaps. Metrics: critic/value_loss,
critic/explained_variance, critic/value_clip_frac, critic/values_mean, critic/returns_mean,
critic/grad_norm.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "ppo_tiny"
    c.rl.method = "ppo"
    c.gae.gamma, c.gae.lam, c.gae.whiten = 1.0, 0.95, True
    # The tiny model's critic learns fast from a zero head; verl's 1e-5 barely moves it in 8 steps.
    c.critic.lr = 1e-4
    c.critic.value_clip = 0.5
    c.train.steps = 8
    c.data.num_eval = 32
    return c
