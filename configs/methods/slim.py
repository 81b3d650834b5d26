"""SLIM: the skill library as a training variable (turnsight_jax.methods.slim.library, methods.slim.runner;
docs/signal_methods.md) on the tiny CPU experiment. The policy's prompts show the library's
active skills (the bundled skills of the run's task types to start with); after every step a
leave-one-out audit on 4 validation tasks (greedy) measures each skill's Δ = Eval(S) −
Eval(S \\ {s}), smoothed by an EMA into the keep / watch / retire bands; a task type failing
2 audits in a row gets a new skill written by the current policy from its failed trajectories.
The rollouts train with GRPO's advantage (`rl.base`; any base method with its own advantage
works, e.g. `--config.rl.base=ppo`).

    python -m turnsight_jax.train --config configs/methods/slim.py --workdir /tmp/slim_run

Metrics: slim/library_size, slim/audit_eval, slim/delta/<id>, slim/ema/<id>, slim/delta_mean,
slim/fail_rate/<type>, slim/retired_total, slim/expanded_total, slim/expand_failed_total; the
library with its history is `slim_library.json` in the run folder and in every checkpoint.
"""

from turnsight_jax.config import default_config


def get_config():
    c = default_config()
    c.name = "slim_tiny"
    c.rl.method = "slim"
    c.rl.base = "grpo"
    c.slim.initial = "builtin"
    c.slim.audit_every = 1
    c.slim.audit_tasks = 4
    c.slim.min_exposures = 4
    c.slim.min_low_rounds = 2
    c.slim.expand_patience = 2
    c.slim.max_skills = 6
    c.slim.max_skill_tokens = 64
    c.train.steps = 8
    c.data.num_eval = 32
    return c
