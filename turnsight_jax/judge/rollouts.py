"""Trajectories for the teacher to label (`python -m turnsight_jax.judge label --policy ...`):
rollouts of a Hugging Face policy at the run's rollout sampling, or replayed demonstrations."""

from __future__ import annotations

import pathlib
from typing import Sequence

import numpy as np

from turnsight_jax.chat.types import Task
from turnsight_jax.errors import ConfigError

DEMONSTRATIONS = "demonstrations"


def _wrong_answer(task: Task) -> str:
    """A plausible wrong answer: an intermediate entity of the gold chain, else 'unknown'."""
    for values in task.unsolved_set.values():
        for v in values:
            if str(v).strip().lower() != str(task.answer).strip().lower():
                return str(v)
    return "unknown"


DEMO_KINDS = ("gold", "wrong_answer", "no_tools")


def demonstration_scripts(task: Task, rng: np.random.Generator, kinds: Sequence[str] = DEMO_KINDS) -> list[str]:
    """One replayed behaviour, drawn uniformly from `kinds`: "gold" (the gold chain: solved),
    "wrong_answer" (the gold calls, then a wrong final answer: an intermediate entity),
    "no_tools" (a guess without any tool call, the same wrong answer). Needs the task's gold
    chain (the built-in tasks have one)."""
    from turnsight_jax.envs.synthetic import gold_turn_texts

    gold = gold_turn_texts(task)
    wrong = f"<answer>{_wrong_answer(task)}</answer>"
    kind = kinds[int(rng.integers(len(kinds)))]
    return {"gold": gold, "wrong_answer": gold[:-1] + [wrong], "no_tools": [wrong]}[kind]


def policy_rollouts(cfg, policy: str, tasks: Sequence[Task], samples: int, *, seed: int = 0,
                    kinds: Sequence[str] = DEMO_KINDS):
    """(trajectories, their tasks): `samples` rollouts per task, in the source's environment
    (`kinds`: the demonstrations' behaviours, with policy='demonstrations')."""
    from turnsight_jax import model_setup, sources
    from turnsight_jax.chat.tokenizer import load_tokenizer
    from turnsight_jax.config import rollout_config, sampling_params
    from turnsight_jax.rollout.driver import ModelPolicy, ReplayPolicy, rollout

    rc = rollout_config(cfg)
    if policy == DEMONSTRATIONS:
        if any(t.gold_calls is None for t in tasks):
            raise ConfigError("--policy demonstrations replays gold chains: use tasks with gold calls "
                              "(data.source=builtin)")
        tok = load_tokenizer(model_setup.tokenizer_folder(cfg.tokenizer_path, None))
        bad = [k for k in kinds if k not in DEMO_KINDS]
        if bad or not kinds:
            raise ConfigError(f"--demos: unknown behaviour {bad[0] if bad else '(none)'!r}; known: {', '.join(DEMO_KINDS)}")
        rng = np.random.default_rng(seed)
        actor = ReplayPolicy(tok, [demonstration_scripts(t, rng, kinds) for t in tasks for _ in range(samples)])
    else:
        if not (pathlib.Path(policy) / "config.json").is_file():
            raise ConfigError(f"--policy {policy!r} is neither a Hugging Face Qwen3 folder (no config.json) nor "
                              f"'{DEMONSTRATIONS}'")
        from flax import nnx

        from turnsight_jax.models.weights import load_pretrained

        tok = load_tokenizer(model_setup.tokenizer_folder(cfg.tokenizer_path, policy))
        graphdef, params = nnx.split(load_pretrained(policy, dtype=model_setup.DTYPES[cfg.model.param_dtype]))
        actor = ModelPolicy(graphdef, params, tok, sampling=sampling_params(cfg), config=rc, seed=seed)
    with sources.make_env(cfg.data.source, max_output_chars=cfg.rollout.get("max_tool_output_chars", None)) as env:
        res = rollout(actor, env, list(tasks), tokenizer=tok, group_size=samples, config=rc, seed=seed)
    return res.trajectories, [t for t in tasks for _ in range(samples)]
