"""T2PO's rollout hooks (turnsight_jax.methods.t2po; docs/rollout_methods.md) on the tiny CPU experiment,
with GRPO as the method: the paged engine computes each token's entropy and top-j negative
log-probs in its decode; TTI forces </think> when the hesitation signal M stalls inside a turn's
thinking (once per trajectory), TDS samples a turn again when its Phi barely moved from the
previous turn's. Nothing else changes: GRPO trains on what was sampled.

    python -m turnsight_jax.train --config configs/methods/t2po.py --workdir /tmp/t2po_run

TurnSight over GRPO with the same rollouts:
`--config.rl.method=turnsight --config.rl.base=grpo --config.rl.rollout=t2po`. Metrics:
t2po/tti_triggers, t2po/tds_resamples, t2po/tds_checked, t2po/gamma_mean, t2po/phi_mean,
t2po/discarded_tokens (decoded then dropped: the extra tokens T2PO samples), t2po/recompute_tokens.

Thresholds: the tiny warm-started model's hesitation moves far more between tokens than a trained
Qwen3's thinking does, so TTI's window and threshold are set where it stalls on this model (3
tokens, 0.25); the paper-scale values are a question for its data (the paper gives none).
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "t2po_tiny"
    c.rl.method = "grpo"
    c.rl.rollout = "t2po"
    c.rollout.engine = "paged"  # the hooks live in the paged engine's decode
    c.rollout.enable_thinking = True  # TTI closes the turn's thinking
    c.t2po.tti_window = 3
    c.t2po.tti_threshold = 0.25
    c.t2po.tds_threshold = 0.5
    c.t2po.tds_max_resamples = 2
    c.train.steps = 8
    c.data.num_eval = 32
    return c
