"""turnsight_jax: TurnSight turn-level hindsight self-distillation for tool-using Qwen3 agents, in JAX."""

__version__ = "0.1.0"
