"""Packed hindsight views: the teacher's log-probs on the packed copies equal those of each
(turn, depth) view built as its own plain sequence, also when an observation window (methods.mm_grpo)
elided observations from the turns' contexts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.chat.hindsight import hindsight_ids, hindsight_pieces, teacher_view_ids
from turnsight_jax.chat.trajectory import turn_context
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import RuntimeOptions, init_model
from turnsight_jax.rollout.driver import ObservationWindow, ReplayPolicy, RolloutConfig, placeholder_suffix, rollout
from turnsight_jax.rl.logprobs import logprobs_at, teacher_logprobs
from turnsight_jax.rl.views import ViewOptions, build_views, covered_turns

from _vocab import SMALL_VOCAB, fold, fold_views
from conftest import OPTIMIZED

CFG = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)


def _replayed(tok, window=None):
    """Real multi-turn trajectories: gold chains, wrong calls, malformed calls, parallel calls."""
    rng = np.random.default_rng(0)
    tasks = [generate_task(c, s, SyntheticConfig(hops=3)) for s, c in
             enumerate(["multi_hop", "parallel_multi_hop", "single_hop", "parallel_single_hop"])]
    scripts = []
    for t in tasks:
        gold = gold_turn_texts(t)
        scripts.append(gold)
        noisy = list(gold)
        noisy.insert(1, '<tool_call>\n{"name": "nope", "arguments": {"x": 1}}\n</tool_call>')
        noisy.insert(2, "<tool_call>{not json</tool_call>")
        scripts.append(noisy[: int(rng.integers(2, len(noisy) + 1))])
    with FTRLEnv(num_workers=1) as env:
        res = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=2,
                      config=RolloutConfig(max_turns=6, max_response_tokens=4096), window=window)
    return tasks, res.trajectories


@pytest.fixture(scope="module")
def trajectories(tok):
    return _replayed(tok)


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=1, options=RuntimeOptions(attn_q_chunk=128))


@pytest.mark.parametrize("options", [
    ViewOptions(),
    ViewOptions(source="tool_results_answer", turns="last:2"),
    ViewOptions(source="answer", depths=(2,), turns="first:1"),  # answer-only source, one depth, first turn
    # the equal-length control (rl.hindsight_budget): blocks cut to their head or padded with the filler
    ViewOptions(budget=60),
    ViewOptions(source="tool_results_answer", depths=(1, 3), budget=48, filler="(none)\n"),
])
def test_packed_views_equal_plain_sequences(tok, trajectories, model, options):
    _check_views_against_plain_sequences(tok, *trajectories, model, options)


def test_packed_views_under_an_observation_window_equal_plain_sequences(tok, model):
    """An observation window of one (methods.mm_grpo): every turn's views and its own-context row are
    built on the context that turn saw (older tool responses replaced by the placeholder)."""
    window = ObservationWindow(1, placeholder_suffix(tok, "[earlier tool output omitted]", enable_thinking=False))
    tasks, trajs = _replayed(tok, window)
    assert sum(t.contexts is not None for t in trajs) >= 4  # elisions happened
    assert sum(t.contexts.counts[k] > 0 for t in trajs if t.contexts for k in range(t.num_turns)) >= 8
    _check_views_against_plain_sequences(tok, tasks, trajs, model, ViewOptions())


def test_last_turn_results_reach_the_blocks_of_the_last_three_turns(tok, model):
    """Issue 58: a 10-turn episode stops at rollout.max_turns right after its 10th turn called a
    tool. The call ran, so its result is recorded on that turn (no tokens follow it) and shows in
    the depth-1, 2 and 3 blocks of turns 9, 8 and 7 (k̄ = min(k + d − 1, K − 1) = 9), in the
    turn's record (what the viewer shows); the packed views equal the plain sequences."""
    from turnsight_jax.records import trajectory_record

    task = generate_task("multi_hop", 4, SyntheticConfig(hops=10, min_distractors=0, max_distractors=0))
    script = gold_turn_texts(task)  # 10 tool turns, then the answer turn the episode never reaches
    with FTRLEnv(num_workers=1) as env:
        traj = rollout(ReplayPolicy(tok, [script]), env, [task], tokenizer=tok, group_size=1,
                       config=RolloutConfig(max_turns=10, max_response_tokens=4096)).trajectories[0]
        ep = env.start(task, seed=0)
        for t in traj.turns:  # the environment's own results of the same calls
            want = list(ep.step(list(t.calls)).observations)
    last = traj.turns[-1]
    assert traj.num_turns == 10 and traj.finish_reason == "max_turns" and not traj.truncated
    assert len(last.calls) == 1 and last.results == want == [task.answer]  # the chain's last hop is the answer
    # no observation tokens after the last turn: the token stream and the budget are unchanged
    assert not last.has_observation and last.result_spans == [] and traj.length == last.policy_end
    response = f"<tool_response>\n{task.answer}\n</tool_response>"
    for k in range(10):
        for d in (1, 2, 3):
            text = tok.decode(hindsight_ids(tok, traj, k, d))
            assert (response in text) == (k + d - 1 >= 9), (k, d)
    record = trajectory_record(traj, task, 0, {"group": 0, "signals": {}}, {"count": np.zeros((1, 10))}, {},
                               depths=(1, 2, 3), selection="vote", text_chars=1000)
    assert record["turns"][-1]["observations"] == [task.answer]
    # every turn called a tool, so every turn's views show a block (PackedViews.covered)
    views, _ = build_views([traj], tok)
    assert views.covered[0, : int(traj.policy_mask.sum())].all()
    _check_views_against_plain_sequences(tok, [task], [traj], model, ViewOptions())


def test_covered_marks_the_turns_whose_views_show_a_block(tok, trajectories):
    """PackedViews.covered (rl.empty_block_turns reads it): False on the answer turn (an empty
    block under source tool_results) and on turns outside rl.turns, True elsewhere."""
    _, trajs = trajectories
    for options in (ViewOptions(), ViewOptions(turns="first:1"), ViewOptions(source="tool_results_answer")):
        views, _ = build_views(trajs, tok, options=options, gold_answers=["x"] * len(trajs))
        for b, traj in enumerate(trajs):
            want = []
            for k, t in enumerate(traj.turns):
                shown = k in covered_turns(traj.num_turns, options.turns) and not hindsight_pieces(
                    tok, traj, k, source=options.source, gold_answer="x").is_empty
                want += [shown] * t.num_policy_tokens
            np.testing.assert_array_equal(views.covered[b, : len(want)], want)
            assert not views.covered[b, len(want):].any()
    views, _ = build_views(trajs, tok)
    assert not views.covered.all() and views.covered.any()


def _own_context(traj, k) -> list[int]:
    """Turn k's own context and its tokens (what the student scores)."""
    turn = traj.turns[k]
    return [int(x) for x in turn_context(traj, k)[0]] + [int(x) for x in traj.tokens[turn.policy_start:turn.policy_end]]


def _check_views_against_plain_sequences(tok, tasks, trajs, model, options):
    answers = [tasks[i // 2].answer for i in range(len(trajs))]
    views, stats = build_views(trajs, tok, options=options, gold_answers=answers, with_reference=True)
    # the model's vocabulary is small: ids folded identically on both sides (tests/_vocab.py)
    packed = np.asarray(jax.jit(lambda v: teacher_logprobs(model, v, chunk=64), compiler_options=OPTIMIZED)(
        jax.tree.map(jnp.asarray, fold_views(views))))
    assert stats["teacher_distinct_rows"] < stats["teacher_rows"]  # shared predictors computed once

    # every (turn, depth) view as its own plain sequence, scored in fixed-shape batches
    cases = []  # (b, k, di, seq, n)
    for b, traj in enumerate(trajs):
        covered = set(covered_turns(traj.num_turns, options.turns))
        for k, turn in enumerate(traj.turns):
            for di, d in enumerate(options.depths):
                if k in covered:
                    seq = teacher_view_ids(tok, traj, k, d, max_depth=max(options.depths), source=options.source,
                                           gold_answer=answers[b], template=options.template, budget=options.budget,
                                           filler=options.filler)
                else:  # outside coverage the teacher reads the student's own context
                    seq = _own_context(traj, k)
                cases.append((b, k, di, seq, turn.policy_end - turn.policy_start))
            # the reference row: the student's own context
            cases.append((b, k, len(options.depths), _own_context(traj, k), turn.policy_end - turn.policy_start))
    rows, most = 8, 64  # fixed shapes: one compilation (1,024 wide, or the longest view's 256-multiple)
    width = max(1024, -(-max(len(c[3]) for c in cases) // 256) * 256)
    assert max(n for *_, n in cases) <= most
    score = jax.jit(lambda x, m, pred, y: logprobs_at(model, model.hidden_states(x, Layout.causal(m)), pred, y,
                                                      chunk=256), compiler_options=OPTIMIZED)
    plain = []
    for i in range(0, len(cases), rows):
        x = np.zeros((rows, width), np.int32)
        m = np.zeros((rows, width), bool)
        pred = np.zeros((rows, most), np.int32)
        y = np.zeros((rows, most), np.int32)
        for r, (_, _, _, seq, n) in enumerate(cases[i:i + rows]):
            x[r, : len(seq)] = fold(seq)
            m[r, : len(seq)] = True
            pred[r, :n] = np.arange(len(seq) - n - 1, len(seq) - 1)  # only the turn's tokens
            y[r, :n] = fold(seq[len(seq) - n:])
        out = np.asarray(score(*map(jnp.asarray, (x, m, pred, y))))
        plain.extend(out[r, :n] for r, (*_, n) in enumerate(cases[i:i + rows]))
    checked = 0
    for (b, k, di, seq, n), lp in zip(cases, plain):
        traj, turn = trajs[b], trajs[b].turns[k]
        pol = np.flatnonzero(traj.policy_mask)
        idx = [int(np.searchsorted(pol, p)) for p in range(turn.policy_start, turn.policy_end)]
        np.testing.assert_allclose(packed[di, b, idx], lp, atol=1e-5, rtol=0)
        checked += n
    assert checked > 100
    assert stats["view_tokens"] > stats["trajectory_tokens"]
    if options.budget:  # every distinct message is exactly the budget; some were cut, some padded
        assert stats["hindsight_block_tokens"] == options.budget * stats["hindsight_blocks"]
        assert 0 < stats["hindsight_blocks_cut"] < stats["hindsight_blocks"]


def test_depths_share_trunk_and_dedupe(tok, trajectories):
    """Depths that clip to the same block reuse one branch; the trunk is built once per turn."""
    _, trajs = trajectories
    traj = trajs[0]
    one, s1 = build_views([traj], tok, options=ViewOptions(depths=(1,)))
    three, s3 = build_views([traj], tok, options=ViewOptions(depths=(1, 2, 3)))
    # the three depths share their trunk: fewer tokens than three separate hindsight copies
    extra1 = s1["view_tokens"] - s1["trajectory_tokens"]
    extra3 = s3["view_tokens"] - s3["trajectory_tokens"]
    naive = sum(len(teacher_view_ids(tok, traj, k, d)) - t.header_start
                for k, t in enumerate(traj.turns) if k < traj.num_turns - 1 for d in (1, 2, 3))
    assert extra1 < extra3 < naive
    # the packed tokens by kind: the trajectory, each turn's trunk (the hindsight block: message
    # open + items) and its branches (message close + header + a copy of the turn)
    blocks = copies = 0
    for k, t in enumerate(traj.turns):
        pieces = hindsight_pieces(tok, traj, k, max_depth=3)
        if not pieces.is_empty:
            blocks += len(pieces.open_ids) + sum(len(item) for item in pieces.item_ids)
            branch = len(pieces.close_ids) + len(pieces.header_ids) + t.num_policy_tokens - 1
            copies += branch * len({min(d, pieces.num_items) for d in (1, 2, 3)})
    assert (s3["view_tokens_trajectory"], s3["view_tokens_blocks"], s3["view_tokens_turn_copies"]) == (
        traj.length, blocks, copies)
    assert blocks + copies == extra3 > 0
    last = traj.turns[-2]  # the last tool turn: items for itself and the answer turn, so d = 3 clips to d = 2
    pol = np.flatnonzero(traj.policy_mask)
    j = int(np.searchsorted(pol, last.policy_start))
    assert three.view_pred[0, 0, j] != three.view_pred[1, 0, j] == three.view_pred[2, 0, j]
    # the answer turn (empty block) is scored on the original segment
    ans = traj.turns[-1]
    j = int(np.searchsorted(pol, ans.policy_start))
    assert list(three.view_pred[:, 0, j]) == [ans.policy_start - 1] * 3


def test_bad_options(tok, trajectories):
    _, trajs = trajectories
    with pytest.raises(ValueError, match="depths"):
        build_views(trajs, tok, options=ViewOptions(depths=()))
    with pytest.raises(ValueError, match="turns must be"):
        build_views(trajs, tok, options=ViewOptions(turns="middle:3"))
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        build_views(trajs, tok, buckets=(64,))


def test_configured_template_appears_verbatim_in_the_packed_rows(tok, trajectories):
    """rl.hindsight_template reaches the teacher rows: make_train_batch packs the custom text."""
    from turnsight_jax.chat.hindsight import HindsightTemplate
    from turnsight_jax.rl.batch import make_train_batch
    from turnsight_jax.rl.config import AlgoConfig, StepConfig
    from turnsight_jax.rl.methods import resolve_method

    tasks, trajs = trajectories
    custom = HindsightTemplate(message_open="<|im_start|>user\nLATER YOU WILL SEE:\n",
                               item="== turn {turn} (+{offset}) ==\n{calls}{results}", call="CALL {call}\n",
                               result="GOT {result}\n", message_close="END OF HINDSIGHT<|im_end|>\n")
    cfg = StepConfig(algo=AlgoConfig(method="turnsight", base="grpo", depths=(1, 2), hindsight_template=custom),
                     group_size=2, max_turns=6)
    row_tasks = [tasks[i // 2] for i in range(len(trajs))]
    batch, _ = make_train_batch(trajs, row_tasks, tok, cfg, resolve_method(cfg))
    traj = trajs[0]  # a gold chain: turn 0 calls, its result comes back
    text = tok.decode(batch.views.tokens[0][: int((batch.views.layout.segment_ids[0] >= 0).sum())])
    call0 = traj.turns[0].calls[0]
    first = f'<|im_start|>user\nLATER YOU WILL SEE:\n== turn 1 (+0) ==\nCALL {{"name": "{call0.name}", "arguments": '
    assert first in text
    assert f"GOT {traj.turns[0].results[0]}\n" in text and "== turn 2 (+1) ==\n" in text
    assert "END OF HINDSIGHT<|im_end|>\n" in text and "<hindsight>" not in text  # the default template is gone
