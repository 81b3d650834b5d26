"""Replayed trajectories of the built-in tasks, shared by the fused-step tests."""

from __future__ import annotations

from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout

WRONG_CALL = ['<tool_call>\n{"name": "nope", "arguments": {"x": 1}}\n</tool_call>', "<answer>no</answer>"]


def gold_and_wrong(tok):
    """(8 trajectories, their 4 tasks): 4 built-in tasks (multi-hop and single-hop, 2 hops), each
    replayed twice in its group, once as its gold chain (reward 1) and once as one wrong call and
    a wrong answer (reward 0)."""
    tasks = [generate_task(c, s, SyntheticConfig(hops=2)) for s, c in
             enumerate(["multi_hop", "single_hop", "multi_hop", "single_hop"])]
    scripts = []
    for t in tasks:
        scripts += [gold_turn_texts(t), WRONG_CALL]
    return replayed(tok, tasks, scripts), tasks


def replayed(tok, tasks, scripts, group_size: int = 2):
    """The trajectories of `scripts` (turn texts per row; row r is task r // group_size) replayed
    through the built-in tasks' environment, up to 5 turns."""
    with FTRLEnv(num_workers=1) as env:
        return rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=group_size,
                       config=RolloutConfig(max_turns=5, max_response_tokens=2048)).trajectories
