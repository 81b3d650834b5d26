"""PiCA (progress credit from a monotone step-PRM, propagated by GAE; turnsight_jax.methods.prm,
docs/ppo.md) on the tiny CPU experiment: PPO with a learned critic (configs/methods/ppo.py) whose
token rewards add, at every tool-result boundary k, the PRM's gain
alpha * decay^(k-1) * (h(s_{k-1}) - h(s_k) - baseline) on the last token of the turn that called
the tool. The PRM h(s) = P(not yet solved | the trajectory so far) is a logistic head on the frozen
reference trunk, trained every step on that step's trajectories (failed ones unsolved at every
state, solved ones solved at their end, a hinge against rises of h along solved ones).

    python -m turnsight_jax.train --config configs/methods/pica.py --workdir /tmp/pica_run

Metrics: prm/loss, prm/bce, prm/hinge, prm/gain_mean, prm/gain_abs_mean, prm/boundaries,
prm/h_start, prm/h_final_solved, prm/h_final_failed, and PPO's critic/*.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "pica_tiny"
    c.rl.method = "pica"
    c.gae.gamma, c.gae.lam, c.gae.whiten = 1.0, 0.95, True
    c.critic.lr = 1e-4  # as configs/methods/ppo.py
    c.prm.lr = 1e-2  # a head on frozen features: a larger step than the trunks'
    c.prm.alpha, c.prm.decay, c.prm.baseline = 0.5, 0.9, 0.0
    c.prm.hinge_coef = 1.0
    c.prm.success_reward = 1.0  # Solve-F1 1: solved
    c.train.steps = 8
    c.data.num_eval = 32
    return c
