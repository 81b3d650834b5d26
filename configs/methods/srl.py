"""SRL then the sparse outcome (turnsight_jax.methods.srl; docs/signal_methods.md) on the tiny CPU
experiment: the first `rl.switch_step` RL steps reward each rollout by the similarity of its
actions to the task's gold chain, step by step (difflib's Ratcliff-Obershelp ratio of the calls'
JSON and of the answer), group-normalised like GRPO; from then on GRPO on the outcome (Solve-F1).
One run, one config: the SRL paper's best recipe.

    python -m turnsight_jax.train --config configs/methods/srl.py --workdir /tmp/srl_run

`--config.rl.switch_step=0 --config.rl.switch_method=''` trains on SRL's reward alone. Metrics:
rl/stage (1: SRL, 2: outcome), train/reward_mean (the stage's reward: the mean similarity in
stage 1), rollout/reward_mean (the outcome, both stages).
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "srl_tiny"
    c.rl.method = "srl"
    c.rl.switch_step, c.rl.switch_method = 4, "grpo"
    c.train.steps = 8
    c.data.num_eval = 32
    return c
