"""Built-in synthetic tasks: gold chains solve them, random calls do not, generation is seeded."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import numpy as np
import pytest

from turnsight_jax.chat.types import ToolCall
from turnsight_jax.envs.base import VectorEnv
from turnsight_jax.envs.ftrl import FTRLEnv, solve_metrics
from turnsight_jax.envs.synthetic import (
    SYNTHETIC_CATEGORIES,
    SyntheticConfig,
    entity_vocabulary,
    generate_task,
    generate_tasks,
    gold_tool_calls,
    gold_turn_texts,
)
from turnsight_jax.rewards import extract_answer, matchtir_turn_rewards, token_f1


@pytest.fixture(scope="module")
def env():
    with FTRLEnv(num_workers=2, timeout_s=5.0) as e:
        yield e


def _run_policy(env, tasks, policy):
    """Steps every task's episode turn by turn with `policy(task, turn, rng)` -> calls."""
    venv = VectorEnv(env)
    try:
        venv.start(tasks, seeds=list(range(len(tasks))))
        rngs = [random.Random(i) for i in range(len(tasks))]
        n_turns = max(len(t.gold_calls) for t in tasks)
        for turn in range(n_turns):
            venv.step([policy(t, turn, r) for t, r in zip(tasks, rngs)])
        venv.step([[] for _ in tasks])  # the answer turn
        return venv.score([f"<answer>{t.answer}</answer>" for t in tasks]), list(venv.episodes)
    finally:
        venv.close()


def _gold_policy(task, turn, rng):
    calls = gold_tool_calls(task)
    return calls[turn] if turn < len(calls) else None


def _random_policy(task, turn, rng):
    if turn >= len(task.gold_calls):
        return None
    names = [t["function"]["name"] for t in task.tools]
    keys = sorted({k for src in task.codes.values() for k in json.loads(
        src.split("table = ", 1)[1].split("\n", 1)[0])})
    return [ToolCall(rng.choice(names), {"name": rng.choice(keys)}) for _ in task.gold_calls[turn]]


@pytest.mark.parametrize("category", SYNTHETIC_CATEGORIES)
def test_gold_chains_score_solve_f1_one_on_1000_tasks(env, category):
    tasks = [generate_task(category, s) for s in range(1000)]
    t0 = time.monotonic()
    scores, episodes = _run_policy(env, tasks, _gold_policy)
    elapsed = time.monotonic() - t0
    f1 = np.array([s.metrics["solve_f1"] for s in scores])
    assert f1.min() == 1.0, [t.task_id for t, v in zip(tasks, f1) if v < 1][:3]
    assert all(s.metrics["answer_correct"] == 1.0 for s in scores)
    # The final observations carry the answer: the last turn's outputs are the answer parts.
    for task, ep in list(zip(tasks, episodes))[:50]:
        assert ", ".join(out for _, out in ep.turns[-1]) == task.answer
    assert elapsed < 60, elapsed


def test_random_calls_score_far_lower(env):
    tasks = generate_tasks(400, seed=7)
    gold_scores, _ = _run_policy(env, tasks, _gold_policy)
    rand_scores, _ = _run_policy(env, tasks, _random_policy)
    gold = np.mean([s.reward for s in gold_scores])
    rand = np.mean([s.reward for s in rand_scores])
    assert gold == 1.0
    assert rand < 0.3, rand


def test_generation_is_deterministic_per_seed():
    a = generate_tasks(40, seed=3)
    b = generate_tasks(40, seed=3)
    c = generate_tasks(40, seed=4)
    assert a == b
    assert sum(x != y for x, y in zip(a, c)) >= 38


def test_task_shape_is_small_and_ftrl_like():
    cfg = SyntheticConfig()
    for category in SYNTHETIC_CATEGORIES:
        for seed in range(50):
            t = generate_task(category, seed, cfg)
            hops = 1 if "single" in category else cfg.hops
            width = cfg.width if category.startswith("parallel") else 1
            assert len(t.gold_calls) == hops
            assert all(len(turn) == width for turn in t.gold_calls)
            assert hops + cfg.min_distractors <= len(t.tools) <= hops + cfg.max_distractors
            assert set(t.codes) == {x["function"]["name"] for x in t.tools}
            assert sum(len(v) for v in t.unsolved_set.values()) == hops * width
            assert len(t.answer.split(", ")) == width
            content = t.messages[0]["content"]
            assert content.startswith("Please call given tools to answer the question.\nQuestion: ")
            assert len(content) < 160
            assert t.category == category and t.data_source == f"synthetic/{category}"
    q = generate_task("multi_hop", 0).extra["question"]
    assert q.startswith("What is the ") and q.count(" of ") == 2


def test_difficulty_knobs():
    cfg = SyntheticConfig(hops=3, width=3, min_distractors=2, max_distractors=2, vocab_size=30)
    t = generate_task("parallel_multi_hop", 1, cfg)
    assert len(t.gold_calls) == 3 and all(len(turn) == 3 for turn in t.gold_calls)
    assert len(t.tools) == 5
    names = {c["arguments"]["name"] for turn in t.gold_calls for c in turn}
    assert names <= set(entity_vocabulary(30))
    long_prompt = generate_task("single_hop", 1, SyntheticConfig(prompt_style="ftrl"))
    assert "Please note that all your information must be obtained by calling tools" in (
        long_prompt.messages[0]["content"])
    with pytest.raises(ValueError, match="hops"):
        generate_task("multi_hop", 0, SyntheticConfig(hops=1))
    with pytest.raises(ValueError, match="unknown synthetic category"):
        generate_task("triple_hop", 0)


def test_gold_turn_texts_are_qwen3_tool_calls_and_answer():
    t = generate_task("parallel_multi_hop", 5)
    texts = gold_turn_texts(t)
    assert len(texts) == len(t.gold_calls) + 1
    first = texts[0].split("\n")
    assert first[0] == "<tool_call>" and first[2] == "</tool_call>" and first[3] == "<tool_call>"
    payload = json.loads(first[1])
    assert payload == dict(t.gold_calls[0][0]) and list(payload) == ["name", "arguments"]
    assert texts[-1] == f"<answer>{t.answer}</answer>"
    # The gold chain is MatchTIR-perfect too.
    r = matchtir_turn_rewards(gold_tool_calls(t) + [[]], t.gold_calls, texts[-1], t.answer)
    np.testing.assert_allclose(r, np.ones(len(texts)))
    assert token_f1(extract_answer(texts[-1]), t.answer) == 1.0


def test_gold_turn_texts_round_trip_through_the_parser():
    parsing = pytest.importorskip("turnsight_jax.chat.parsing")
    t = generate_task("parallel_multi_hop", 9)
    for text, gold in zip(gold_turn_texts(t), gold_tool_calls(t)):
        calls = parsing.parse_turn(text).calls
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in gold]


def test_solve_metrics_of_a_wrong_hop(env):
    t = generate_task("multi_hop", 11)
    gold = gold_tool_calls(t)
    ep = env.start(t, seed=0)
    ep.step(gold[0])
    ep.step([ToolCall(gold[1][0].name, {"name": gold[0][0].arguments["name"]})])  # wrong input
    ep.step([])
    m = ep.score("<answer>x</answer>").metrics
    assert m["solved"] == 1 and m["solve_f1"] == pytest.approx(2 * 1 / (2 + 2))
    assert m == {**solve_metrics(ep.call_outputs, t.unsolved_set), "answer_correct": 0.0,
                 "num_turns": 2.0}


def test_long_chains_up_to_twenty_turns(tok):
    """data.max_hops: chains of hops..max_hops hops (19 hops: 20 turns with the answer); a gold
    replay of the longest solves it in a 20-turn rollout; the dependency rule recovers the chain."""
    from turnsight_jax.rl.horizon import dependency_batch, dependency_horizon, gold_horizons
    from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout

    cfg = SyntheticConfig(hops=2, max_hops=19, num_relations=32, vocab_size=64, max_distractors=2)
    tasks = generate_tasks(60, categories=("multi_hop", "single_hop"), config=cfg)
    lengths = [len(t.gold_calls) for t in tasks if t.category == "multi_hop"]
    assert min(lengths) >= 2 and max(lengths) == 19 and len(set(lengths)) > 8
    assert all(len(t.gold_calls) == 1 for t in tasks if t.category == "single_hop")
    longest = max(tasks, key=lambda t: len(t.gold_calls))
    assert gold_horizons(longest) == list(range(19, 0, -1)) + [1]
    assert len({c[0]["name"] for c in longest.gold_calls}) == 19  # each relation once
    with FTRLEnv(num_workers=1) as env:
        res = rollout(ReplayPolicy(tok, [gold_turn_texts(longest)]), env, [longest], tokenizer=tok, group_size=1,
                      config=RolloutConfig(max_turns=20, max_response_tokens=8192))
    traj = res.trajectories[0]
    assert traj.num_turns == 20 and traj.reward == 1.0 and traj.finish_reason == "answer"
    h = np.asarray(dependency_horizon(dependency_batch([traj], 20)))[0]
    assert h.tolist() == gold_horizons(longest)
    with pytest.raises(ValueError, match="max_hops must be 0"):
        SyntheticConfig(hops=3, max_hops=2).validate()
    with pytest.raises(ValueError, match=r"max_hops \+ max_distractors must be <= num_relations=16"):
        SyntheticConfig(max_hops=16, vocab_size=64).validate()


@pytest.mark.parametrize("style,vocab", [("names", 31), ("cvcv", 64)])
def test_result_words_make_long_results_that_never_credit(env, style, vocab):
    """data.min/max_result_words: every table row's result carries a record note of [min, max]
    words after its entity; gold chains still solve every task (Solve-F1 1, answer correct), the
    notes solve nothing a wrong call would not (random calls score as without notes), an unknown
    name gets 'unknown' and a note of its tool's, and the tasks are those without notes apart from their codes."""
    base = SyntheticConfig(hops=2, max_hops=6, entity_style=style, vocab_size=vocab, max_distractors=2)
    cfg = dataclasses.replace(base, min_result_words=20, max_result_words=60)
    tasks = generate_tasks(120, seed=5, config=cfg)
    plain = generate_tasks(120, seed=5, config=base)
    for t, p in zip(tasks, plain):
        assert (t.messages, t.tools, t.unsolved_set, t.answer, t.gold_calls) == (
            p.messages, p.tools, p.unsolved_set, p.answer, p.gold_calls)
        assert t.codes != p.codes
    scores, episodes = _run_policy(env, tasks, _gold_policy)
    assert min(s.metrics["solve_f1"] for s in scores) == 1.0
    assert all(s.metrics["answer_correct"] == 1.0 for s in scores)
    lengths, vocabulary = [], entity_vocabulary(vocab, style)
    for task, ep in zip(tasks, episodes):
        for turn in ep.turns[:-1]:
            for _, out in turn:
                entity, note = out.split("\nrecord: ")
                assert entity in vocabulary  # the entity first, then its note
                lengths.append(len(note.split()))
                assert note == note.lower()
                assert not any(e.lower() in note for e in vocabulary)
    assert min(lengths) >= 20 and max(lengths) <= 60 and len(set(lengths)) > 20
    # The last hop's output is the answer followed by its note.
    for task, ep in zip(tasks, episodes):
        assert ", ".join(out.split("\n", 1)[0] for _, out in ep.turns[-1]) == task.answer
    rand, _ = _run_policy(env, tasks, _random_policy)
    rand_plain, _ = _run_policy(env, plain, _random_policy)
    assert [s.metrics["solve_f1"] for s in rand] == [s.metrics["solve_f1"] for s in rand_plain]
    ep = env.start(tasks[0], seed=0)
    res = ep.step([ToolCall(tasks[0].tools[0]["function"]["name"], {"name": "Nobody"})] * 2)
    word, note = res.observations[0].split("\nrecord: ")
    assert word == "unknown" and 20 <= len(note.split()) <= 60 and res.observations[1] == res.observations[0]
    with pytest.raises(ValueError, match="need 0 <= min_result_words <= max_result_words, got 5, 2"):
        dataclasses.replace(base, min_result_words=5, max_result_words=2).validate()
