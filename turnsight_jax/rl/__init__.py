"""The RL core: the step's input (batch, views), log-probs, advantages, losses, methods, the
fused step and its memory plan. Host-side code imports `rl.config` and `rl.batch` for types;
only the trainer and the plan import `rl.step`."""
