"""BAR and AKBE (methods.bar, methods.akbe; docs/rollout_methods.md) decide what their hand-computed
schedules say on scripted rollouts: the real controllers, the real rollout driver and the built-in
environment, with a replay policy in place of the model whose turn texts (a gold chain: Solve-F1 1
and a correct answer; a wrong call; a direct answer) are chosen by each episode's global row, so
every reward is fixed in advance. Then their rows through the batch (groups of unequal size, rows
in no group, padding) and the config keys."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from _replayed import WRONG_CALL
from turnsight_jax.chat.trajectory import is_padding
from turnsight_jax.config import apply_overrides, default_config, validate
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import generate_task, gold_turn_texts
from turnsight_jax.errors import ConfigError
from turnsight_jax.methods import akbe as akbe_lib
from turnsight_jax.methods import bar as bar_lib
from turnsight_jax.rl.batch import make_train_batch
from turnsight_jax.rl.config import StepConfig
from turnsight_jax.rl.methods import RolloutContext, resolve_method
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig
from turnsight_jax.rollout.sampler import SamplingParams


@pytest.fixture(scope="module")
def env():
    with FTRLEnv(num_workers=1) as e:
        yield e


def _ctx(tok, env, group_size, offset=0):
    return RolloutContext(None, None, tok, env, SamplingParams(), RolloutConfig(max_turns=4, max_response_tokens=1024),
                          group_size, group_offset=offset)


class Scripted:
    """A policy factory for rl.episodes.run_episodes: each episode's turn texts from its global
    row (`script(row)`); records the rows of every call."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    def __call__(self, ctx, seed, rows):
        self.calls.append([int(r) for r in rows])
        return ReplayPolicy(self.tok, [self.script(int(r)) for r in rows])


# ---- BAR ----

# success (1) or failure (0) of rollout k of each prompt, and what BAR must make of it with
# chunk 2, cap 8, band [0.375, 0.625]:
PATTERNS = [
    [1, 0],                          # round 0: 1/2 in the band -> stop, a group of 2
    [1, 1, 0, 0],                    # 2/2 -> go on; 2/4 -> stop, 4
    [0, 0, 0, 0, 0, 0, 0, 0],        # never in the band, all failures at the cap -> fallback, 8
    [1, 1, 1, 1, 1, 0, 1, 1],        # 1, 1, 5/6, 7/8 -> mixed at the cap, 8
    [0, 0, 1, 0, 1, 0, 1, 0],        # 0, 1/4, 2/6, 3/8 = 0.375 -> in the band exactly at the cap, 8
]
BAR = bar_lib.BarConfig(chunk=2, cap=8, low=0.375, high=0.625, success=1.0, fallback="keep")


def _bar(tok, env, fallback="keep", offset=3):
    tasks = [generate_task("single_hop", s) for s in range(len(PATTERNS))]

    def script(row):  # episode p * cap + k of the step: prompt p - offset, its rollout k
        p, k = divmod(row, BAR.cap)
        return gold_turn_texts(tasks[p - offset]) if PATTERNS[p - offset][k] else WRONG_CALL

    policy = Scripted(tok, script)
    res = bar_lib.bar_rollout(_ctx(tok, env, 4, offset), tasks, 0, dataclasses.replace(BAR, fallback=fallback),
                              policy=policy)
    return tasks, res, policy


def test_bar_decisions_match_the_hand_computed_table():
    cfg = BAR
    assert [bar_lib.decide(s, n, cfg) for s, n in [(1, 2), (2, 2), (0, 2), (3, 8), (5, 8), (2, 8), (0, 8), (8, 8),
                                                   (5, 6), (2, 6)]] == [
        "in_band", "continue", "continue", "in_band", "in_band", "cap_mixed", "fallback", "fallback", "continue",
        "continue"]


def test_bar_stops_each_prompt_where_the_hand_computed_schedule_says(tok, env):
    tasks, res, policy = _bar(tok, env)
    # one batched call per round over the prompts still open, episode p * cap + k of prompt p
    assert policy.calls == [[p * 8 + k for p in (3, 4, 5, 6, 7) for k in (0, 1)],
                            [p * 8 + k for p in (4, 5, 6, 7) for k in (2, 3)],
                            [p * 8 + k for p in (5, 6, 7) for k in (4, 5)],
                            [p * 8 + k for p in (5, 6, 7) for k in (6, 7)]]
    trajs = res.trajectories
    assert len(trajs) == 5 * 8
    sizes = [2, 4, 8, 8, 8]
    for i, (size, pattern) in enumerate(zip(sizes, PATTERNS)):
        block = trajs[i * 8:(i + 1) * 8]
        group, pad = block[:size], block[size:]
        assert [t.group_id for t in group] == [3 + i] * size
        assert [t.reward for t in group] == [float(s) for s in pattern]  # rollout k in position k
        assert [t.metrics["bar_round"] for t in group] == [float(k // 2) for k in range(size)]
        assert all(is_padding(t) and t.group_id == -1 and t.policy_mask.sum() == 0 for t in pad)
    m = res.metrics
    assert m["bar/prompts"] == 5 and m["bar/rollouts"] == 30 and m["bar/rounds"] == 1 + 2 + 4 + 4 + 4
    assert (m["bar/early_stops"], m["bar/in_band"], m["bar/cap_mixed"], m["bar/fallbacks"], m["bar/dropped"]) == (
        2, 3, 1, 1, 0)
    assert m["bar/rows_in_groups"] == 30 and m["bar/group_size_mean"] == 30 / 5


def test_bar_drop_fallback_leaves_the_prompt_out(tok, env):
    _, res, _ = _bar(tok, env, fallback="drop", offset=0)
    block = res.trajectories[16:24]  # prompt 2: all failures at the cap
    assert all(is_padding(t) for t in block)
    assert res.metrics["bar/dropped"] == 1 and res.metrics["bar/rows_in_groups"] == 2 + 4 + 8 + 8
    assert res.metrics["bar/group_size_mean"] == (2 + 4 + 8 + 8) / 4


@pytest.mark.parametrize("method", ["grpo", "turnsight", "orchard", "rlsd"])
def test_bar_rows_through_the_batch(tok, env, method):
    """Groups of 2, 4, 8, 8, 8 and padding: ids renumbered in order from the first prompt (10)
    times the rows per prompt (8: a block may hold several groups, APPO's), -1 for padding; the outcome reward filled on real rows, 0 (not computed) on padding rows; the
    teacher's rows (TurnSight's hindsight views, RLSD's privileged views, Orchard's probes) built
    for padding rows too (one token each)."""
    tasks, res, _ = _bar(tok, env)
    cfg = dataclasses.replace(_step(method, rollout="bar"), prompt_rows=8, max_turns=4)
    batch, _ = make_train_batch(res.trajectories, [t for t in tasks for _ in range(8)], tok, cfg, resolve_method(cfg),
                                group_offset=10)
    ids = np.asarray(batch.group_ids)
    expected = np.concatenate([np.r_[np.full(n, 80 + i), np.full(8 - n, -1)] for i, n in enumerate([2, 4, 8, 8, 8])])
    np.testing.assert_array_equal(ids, expected)
    assert not np.asarray(batch.pol_valid)[ids < 0].any()
    np.testing.assert_array_equal(np.asarray(batch.signals["rewards"]),
                                  np.concatenate([np.r_[p, np.zeros(8 - len(p))] for p in PATTERNS]))
    assert (batch.views is not None) == (method in ("turnsight", "rlsd"))
    assert (batch.aux_rows is not None and "retrospective" in batch.aux_rows) == (method == "orchard")


# ---- AKBE ----

G = 3


def _akbe_scripts(task):
    gold = gold_turn_texts(task)
    return {
        "gold": gold,  # 1 call, correct answer
        "gold2": [gold[0] + "\n" + gold[0], gold[1]],  # 2 calls, correct answer
        "gold_long": [gold[0], f"<answer>{task.answer}, as the tool said</answer>"],  # 1 call, longer answer
        "wrong": WRONG_CALL,
        "direct": [f"<answer>{task.answer}</answer>"],  # no call, correct
        "direct_long": [f"<answer>It is {task.answer}, I am sure</answer>"],
        "no": ["<answer>no</answer>"],
        "call": [gold[0], "<answer>no</answer>"],  # a call (refused without tools), then a wrong answer
    }


# (with-tool scripts, no-tool scripts, the quadrant, the exemplar: ("wt" | "nt", index) or None)
AKBE_CASES = [
    (["gold2", "gold", "wrong"], ["direct_long", "direct", "no"], (1, 1), ("nt", 1)),  # fewest tokens
    (["gold2", "gold_long", "gold"], ["no", "call", "no"], (1, 0), ("wt", 2)),  # fewest calls, then tokens
    (["wrong", "wrong", "wrong"], ["no", "direct", "direct"], (0, 1), ("nt", 1)),  # a tie: the earliest
    (["wrong", "wrong", "wrong"], ["call", "call", "no"], (0, 0), None),
]


def _akbe(tok, env, mode="refuse", offset=2):
    tasks = [generate_task("single_hop", 10 + s) for s in range(len(AKBE_CASES))]

    def script(row):
        no_tool = row >= akbe_lib.NO_TOOL_ROWS
        p, j = divmod(row - no_tool * akbe_lib.NO_TOOL_ROWS, G)
        return _akbe_scripts(tasks[p - offset])[AKBE_CASES[p - offset][1 if no_tool else 0][j]]

    policy = Scripted(tok, script)
    cfg = akbe_lib.AkbeConfig(no_tool_calls=mode)
    return tasks, akbe_lib.akbe_rollout(_ctx(tok, env, G, offset), tasks, 0, cfg, policy=policy), policy


def test_akbe_quadrants_and_exemplars_match_the_hand_computed_ones(tok, env):
    tasks, res, policy = _akbe(tok, env)
    n = len(AKBE_CASES)
    # one batched call: the with-tool rows the default sampler would draw, then the no-tool ones
    base = [2 * G + r for r in range(n * G)]
    assert policy.calls == [base + [akbe_lib.NO_TOOL_ROWS + r for r in base]]
    trajs = res.trajectories
    assert len(trajs) == n * (G + 1)
    exemplar_tokens, exemplar_calls = [], []
    for i, (_, _, label, pick) in enumerate(AKBE_CASES):
        block = trajs[i * (G + 1):(i + 1) * (G + 1)]
        with_tool, last = block[:G], block[G]
        assert [t.group_id for t in with_tool] == [2 + i] * G
        flagged = [j for j, t in enumerate(block) if t.metrics.get(akbe_lib.EXEMPLAR)]
        if pick is None:
            assert flagged == [] and is_padding(last)
        elif pick[0] == "wt":
            assert flagged == [pick[1]] and is_padding(last)
        else:  # the no-tool exemplar after the group, in no group, on its own tool-free prompt
            assert flagged == [G] and last.group_id == -1 and not is_padding(last)
            assert last.turns[0].text.startswith(_akbe_scripts(tasks[i])[AKBE_CASES[i][1][pick[1]]][0])
            prompt = tok.decode(last.tokens[:last.prompt_len].tolist())
            assert "<tools>" not in prompt and "<tools>" in tok.decode(with_tool[0].tokens[:with_tool[0].prompt_len].tolist())
        if pick is not None:
            chosen = block[flagged[0]]
            exemplar_tokens.append(int(chosen.policy_mask.sum()))
            exemplar_calls.append(sum(len(t.calls) for t in chosen.turns))
    assert exemplar_calls == [0, 1, 0]
    m = res.metrics
    assert [m[f"akbe/q{a}{b}"] for a, b in [(1, 1), (1, 0), (0, 1), (0, 0)]] == [1, 1, 1, 1]
    assert m["akbe/exemplars"] == 3
    assert m["akbe/exemplar_tokens_mean"] == sum(exemplar_tokens) / 3 and m["akbe/exemplar_calls_mean"] == 1 / 3
    assert m["akbe/refused_calls"] == 3 and m["akbe/no_tool_correct"] == 4
    assert m["akbe/no_tool_rollouts"] == n * G


def test_akbe_refuses_no_tool_calls_or_ends_the_episode(tok, env):
    _, res, _ = _akbe(tok, env)
    refused = [t for t in res.trajectories if t.metrics.get(akbe_lib.REFUSED)]
    assert refused == []  # no refused rollout is an exemplar or in a group; they are counted above
    _, res_end, _ = _akbe(tok, env, mode="end")
    assert res_end.metrics["akbe/refused_calls"] == 3
    # the choice does not depend on what refused calls lead to here: same quadrants
    assert [res_end.metrics[f"akbe/q{a}{b}"] for a, b in [(1, 1), (1, 0), (0, 1), (0, 0)]] == [1, 1, 1, 1]


def test_no_tool_episodes_answer_a_call_with_the_refusal_and_never_run_it(tok, env):
    task = generate_task("single_hop", 10)
    nt = akbe_lib.no_tool_task(task)
    wrapped = akbe_lib.NoToolEnvironment(env, "refuse")
    from turnsight_jax.chat.types import ToolCall

    call = ToolCall(name=task.gold_calls[0][0]["name"], arguments=dict(task.gold_calls[0][0]["arguments"]))
    episode = wrapped.start(nt)
    step = episode.step([call, call])
    assert step.observations == (akbe_lib.REFUSAL,) * 2 and not step.done
    score = episode.score("<answer>no</answer>")
    assert score.metrics[akbe_lib.REFUSED] == 2 and score.metrics["num_calls"] == 0  # nothing executed
    episode.close()
    ended = akbe_lib.NoToolEnvironment(env, "end").start(nt)
    assert ended.step([call]).done and ended.done
    ended.close()
    plain = wrapped.start(task)  # a with-tool task: the environment's own episode
    assert plain.step([call]).observations != (akbe_lib.REFUSAL,)
    plain.close()


def test_akbe_rows_through_the_batch(tok, env):
    """G with-tool rows per prompt in their group, the no-tool exemplar (group -1) or a padding
    row; the akbe_exemplar signal on exactly the chosen rows."""
    tasks, res, _ = _akbe(tok, env)
    cfg = dataclasses.replace(_step("grpo", rollout="akbe"), prompt_rows=G + 1, max_turns=4)
    method = resolve_method(cfg)
    assert [t.name for t in method.loss_terms] == ["clipped_surrogate", "akbe_ce"]
    batch, _ = make_train_batch(res.trajectories, [t for t in tasks for _ in range(G + 1)], tok, cfg, method)
    np.testing.assert_array_equal(np.asarray(batch.group_ids),
                                  [0, 0, 0, -1, 1, 1, 1, -1, 2, 2, 2, -1, 3, 3, 3, -1])
    flag = np.zeros(16)
    flag[[3, 6, 11]] = 1.0  # (1,1): no-tool row; (1,0): with-tool row 2; (0,1): no-tool row
    np.testing.assert_array_equal(np.asarray(batch.signals["akbe_exemplar"]), flag)
    assert np.asarray(batch.pol_valid)[[3, 11]].any(axis=1).all()  # the no-tool exemplars' tokens, for the CE
    assert not np.asarray(batch.pol_valid)[[7, 15]].any()  # padding


def test_akbe_refuses_a_metric_no_rollout_has(tok, env):
    tasks = [generate_task("single_hop", 10)]
    policy = Scripted(tok, lambda row: ["<answer>no</answer>"])
    with pytest.raises(ConfigError, match="akbe.correct='solved_it': no rollout has that metric"):
        akbe_lib.akbe_rollout(_ctx(tok, env, 1), tasks, 0, akbe_lib.AkbeConfig(correct="solved_it"), policy=policy)


# ---- config ----

def _step(method, rollout=""):
    from turnsight_jax.rl.config import AlgoConfig

    return StepConfig(algo=AlgoConfig(method=method, base="grpo", rollout=rollout), group_size=4)


def test_config_keys_give_the_rows_per_prompt_and_refuse_bad_values():
    def check(*overrides):
        return validate(apply_overrides(default_config(), list(overrides)), 1)

    sc, method = check("rl.method=grpo", "rl.rollout=bar", "bar.chunk=2", "bar.cap=6")
    assert method.rollout.name == "bar" and sc.prompt_rows == 6 and sc.rows_per_prompt == 6
    sc, _ = check("rl.method=grpo", "rl.rollout=bar", "bar.chunk=2", "train.group_size=4")  # cap 0: G
    assert sc.prompt_rows == 4
    sc, method = check("rl.method=turnsight", "rl.base=grpo", "rl.rollout=akbe", "akbe.coef=0.1")
    assert sc.prompt_rows == 4 + 1 and sc.algo.section("akbe").coef == 0.1 and "akbe_ce" in [t.name for t in method.loss_terms]
    sc, _ = check("rl.method=grpo")
    assert sc.prompt_rows == 0 and sc.rows_per_prompt == 4
    for bad, msg in [("bar.cap=6", "bar.cap=6 must be a multiple of bar.chunk=4"),
                     ("bar.low=0.7", "bar.low=0.7 and bar.high=0.625"),
                     ("bar.fallback='first'", "bar.fallback must be one of"),
                     ("bar.chunk=0", "bar.chunk must be an int >= 1"),
                     ("akbe.coef=-1.0", "akbe.coef must be a finite number >= 0"),
                     ("akbe.no_tool_calls='skip'", "akbe.no_tool_calls must be one of"),
                     ("akbe.correct=''", "akbe.correct must name a trajectory metric")]:
        controller = bad.split(".")[0]
        with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(".", r"\.")):
            check(f"rl.rollout={controller}", bad)
        check(bad)  # a section of a controller that does not run is not read (bar.cap 0 follows G)


# ---- BAR from outside the package (issue 60) ----

@pytest.fixture
def bar_copy(tmp_path, monkeypatch):
    """methods/bar.py copied into a folder outside the package as module `bar_copy`, its registered
    names renamed (the built-in BAR holds "bar"): controller and config section "bar_copy", the
    run config read as cfg.bar_copy. Nothing else changes, and no file of the package is edited.
    Its registrations are taken off the registries afterwards."""
    import importlib
    import pathlib
    import sys

    from turnsight_jax.rl import methods as registry

    src = (pathlib.Path(bar_lib.__file__)).read_text()
    code = src.replace('"bar"', '"bar_copy"').replace("cfg.bar,", "cfg.bar_copy,")
    assert code.count('"bar_copy"') == 4 and code.count("cfg.bar_copy,") == 3  # the registration block's names
    (tmp_path / "bar_copy.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("bar_copy")
    try:
        assert pathlib.Path(module.__file__).parent == tmp_path
        yield module
    finally:
        registry.ROLLOUTS.pop("bar_copy", None)
        registry.CONFIG_SECTIONS.pop("bar_copy", None)
        sys.modules.pop("bar_copy", None)


def test_bar_works_from_a_copy_outside_the_package(tok, env, bar_copy):
    """BAR is self-contained: the copy's config section is generated from its dataclass and checked
    by its own check, its controller resolves and gives the rows per prompt, and it rolls out
    exactly as the built-in controller does (the same scripted episodes, decisions and metrics)."""
    cfg = default_config()
    assert dict(cfg.bar_copy) == dataclasses.asdict(bar_copy.BarConfig())
    sc, method = validate(apply_overrides(cfg, ["rl.method=grpo", "rl.rollout=bar_copy", "bar_copy.chunk=2",
                                                "bar_copy.cap=6"]), 1)
    assert method.rollout.name == "bar_copy" and sc.prompt_rows == 6 and sc.rows_per_prompt == 6
    with pytest.raises(ConfigError, match=r"bar\.cap=6 must be a multiple of bar\.chunk=4"):
        validate(apply_overrides(default_config(), ["rl.method=grpo", "rl.rollout=bar_copy", "bar_copy.cap=6",
                                                    "bar_copy.chunk=4"]), 1)
    tasks = [generate_task("single_hop", s) for s in range(len(PATTERNS))]

    def rollout(lib):
        def script(row):
            p, k = divmod(row, BAR.cap)
            return gold_turn_texts(tasks[p]) if PATTERNS[p][k] else WRONG_CALL

        cfg = lib.BarConfig(**dataclasses.asdict(BAR))
        return lib.bar_rollout(_ctx(tok, env, 4), tasks, 0, cfg, policy=Scripted(tok, script))

    mine, theirs = rollout(bar_copy), rollout(bar_lib)
    assert mine.metrics == theirs.metrics and mine.metrics["bar/rows_in_groups"] == 30
    assert [(t.group_id, t.reward, t.tokens.tolist()) for t in mine.trajectories] == [
        (t.group_id, t.reward, t.tokens.tolist()) for t in theirs.trajectories]
