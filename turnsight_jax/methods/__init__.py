"""The sibling methods, one module (or package) each, and the one list of the built-ins: importing
this package registers every one of them (its rewards, estimators, loss terms, rollout controller
and method declaration) with the core's registries (`rl.methods`, `rl.advantages`, `rl.losses`).
The entry points import it; the core is not meant to (docs/architecture.md, "Layers"). The
imports the core still has into single method modules (pinned by tests/test_package_layout.py)
load this package, and so this list, too, until they are gone.

TurnSight, MatchTIR, ToolRL and GRPO stay in the core (`rl/turnsight.py`, `rl/methods.py`,
`rewards.py`): their keys live under `rl.*`, which the paper configs set.
"""

# The built-ins, in registration order.
from turnsight_jax.methods import self_distillation  # noqa: F401  RLSD, SDPO, SDAR, SOD
from turnsight_jax.methods import critic, prm  # noqa: F401  PPO, PiCA
from turnsight_jax.methods import toolomni, srl, orchard  # noqa: F401
from turnsight_jax.methods import t2po, appo, bar, akbe, mm_grpo  # noqa: F401  rollout controllers
from turnsight_jax.methods.slim import method as slim  # noqa: F401
from turnsight_jax.judge import method as judge  # noqa: F401  OpenWebRL's model-judged reward
