"""Rollouts: the KV-cached sampler, the paged engine, the multi-turn driver and the rollout-controller
interface (control hooks the engine calls)."""
