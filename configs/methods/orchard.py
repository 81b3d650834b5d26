"""Orchard's credit-assigned SFT next to GRPO (turnsight_jax.methods.orchard; docs/signal_methods.md)
on the tiny CPU experiment: each step the frozen teacher, told the episode's reward and the gold
answer, values every state of every trajectory (P(Yes) to "will the assistant go on to solve the
task?" after the state's prefix); the turns whose value rises by orchard.rise or more are
imitated (SFT) on the trajectories that failed, next to GRPO's update.

    python -m turnsight_jax.train --config configs/methods/orchard.py --workdir /tmp/orchard_run

`--config.rl.base=matchtir` puts the SFT next to MatchTIR instead. Metrics: orchard/v_start,
orchard/credit_mean, orchard/rise_segments (per failed trajectory), orchard/rise_turn_frac,
orchard/rise_token_share (the share of policy tokens imitated), train/ca_sft_nll.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "orchard_tiny"
    c.rl.method = "orchard"
    c.rl.base = "grpo"
    c.train.steps = 8
    c.data.num_eval = 32
    return c
