"""Rollouts: the KV-cached sampler and the multi-turn driver."""
