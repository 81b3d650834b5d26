"""The train-step benchmark's batches: real trajectories (built-in tasks replayed through the
environment), at the embedded default's geometry or at a paper-like length spread.

Imported by benchmarks/train_step.py and by benchmarks/_step_worker.py, which may run against an
earlier revision of the package: only names that revision has are used here."""

from __future__ import annotations

import dataclasses

import numpy as np

from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_tasks, gold_turn_texts
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout

WORDS = "so the next step is to look up the value then compare it with what the question asks".split()
GEOMETRIES = ("default", "paper-like")


class _LongResults:
    """An environment whose tool results are padded to a drawn length (50-500 tokens): FTRL's
    results are longer than the built-in tables'. Wraps FTRLEnv; observations only change."""

    def __init__(self, env, rng):
        self.env, self.rng = env, rng

    def start(self, task, *, seed=0):
        episode, rng = self.env.start(task, seed=seed), self.rng

        class Padded:
            def __getattr__(self, name):
                return getattr(episode, name)

            def step(self, calls):
                res = episode.step(calls)
                obs = tuple(o + " " + " ".join(rng.choice(WORDS, size=int(rng.integers(50, 500))))
                            for o in res.observations)
                return dataclasses.replace(res, observations=obs)

        return Padded()

    def __getattr__(self, name):
        return getattr(self.env, name)


def geometry_batch(kind: str, tok):
    """(trajectories, row tasks, max turns) of a geometry; the same on every call.

    "default": the embedded default's batch (8 built-in tasks x 4 siblings, its data and rollout
    settings). "paper-like": FTRL-like spread scaled to CPU: 2-10 turns per episode (the gold chain
    cut at a random hop), a <think> block of lognormal length per turn (median 60 tokens), and tool
    results padded to 50-500 tokens."""
    rng = np.random.default_rng(0)
    if kind == "default":
        cfg = SyntheticConfig(max_distractors=1, vocab_size=10, entity_style="names", num_relations=4,
                              extra_rows=1)
        tasks = generate_tasks(8, seed=3, categories=("single_hop", "multi_hop"), config=cfg)
        scripts = [gold_turn_texts(t) for t in tasks for _ in range(4)]
        env, rcfg, turns = FTRLEnv(num_workers=1), RolloutConfig(max_turns=4, max_response_tokens=256), 4
        wrap = lambda e: e  # noqa: E731
    elif kind == "paper-like":
        tasks = generate_tasks(4, seed=7, categories=("multi_hop",), config=SyntheticConfig(hops=9))
        scripts = []
        for task in tasks:
            gold = gold_turn_texts(task)
            for _ in range(4):
                k = int(rng.integers(1, len(gold)))  # 1..9 tool turns, then the answer: 2-10 turns
                scripts.append([f"<think>\n{' '.join(rng.choice(WORDS, size=int(min(np.exp(rng.normal(np.log(60), 0.8)), 400))))}"
                                f"\n</think>\n\n{t}" for t in gold[:k] + [gold[-1]]])
        env, rcfg, turns = FTRLEnv(num_workers=1), RolloutConfig(max_turns=10, max_response_tokens=8192), 10
        wrap = lambda e: _LongResults(e, rng)  # noqa: E731
    else:
        raise ValueError(f"unknown geometry {kind!r}; known: {GEOMETRIES}")
    with env:
        trajs = rollout(ReplayPolicy(tok, scripts), wrap(env), tasks, tokenizer=tok, group_size=4,
                        config=rcfg).trajectories
    for t in trajs:
        t.reward = float(rng.random())
        t.old_logprobs = np.where(t.policy_mask, -1.0, 0.0).astype(np.float32)
    return trajs, [t for t in tasks for _ in range(4)], turns
