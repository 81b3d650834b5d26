"""AKBE, when to call a tool (turnsight_jax.methods.akbe; docs/rollout_methods.md) next to GRPO on the
tiny CPU experiment: each prompt gets a with-tool group (what GRPO trains on, unchanged) and a
no-tool group (the tool schemas removed from the prompt; every call refused); the 2-bit label
(WT, NT) = (a with-tool rollout answered correctly, a no-tool one did) picks an exemplar per
prompt, imitated with the auxiliary CE akbe.coef = 0.05 (a correct no-tool answer for (1,1) and
(0,1); for (1,0) the correct with-tool rollout with the fewest calls; none for (0,0)).

    python -m turnsight_jax.train --config configs/methods/akbe.py --workdir /tmp/akbe_run

TurnSight as the method instead of GRPO: `--config.rl.method=turnsight --config.rl.base=grpo`
(the controller and its CE come with rl.rollout, whatever the method). Metrics: akbe/q11,
akbe/q10, akbe/q01, akbe/q00 (prompts per quadrant), akbe/exemplars, akbe/exemplar_tokens_mean,
akbe/exemplar_calls_mean, akbe/no_tool_correct, akbe/refused_calls, akbe/no_tool_tokens;
train/akbe_ce (the exemplars' mean NLL).
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "akbe_tiny"
    c.rl.method = "grpo"
    c.rl.rollout = "akbe"
    c.train.steps = 8
    c.data.num_eval = 32
    return c
