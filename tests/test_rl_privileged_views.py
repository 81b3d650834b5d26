"""Privileged-context teacher views (RLSD, SDPO, SDAR, SOD): packed rows score every policy token
as the plain sequence "student context with the block inserted" does; blocks, siblings, skills."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.methods.privileged_blocks import (PrivilegedTemplate, choose_sibling, default_skills_path, load_skills,
                                           privileged_blocks, privileged_texts)
from turnsight_jax.chat.tokenizer import encode
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SYNTHETIC_CATEGORIES, SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.models.attention import Layout
from turnsight_jax.models.config import Qwen3Config
from turnsight_jax.models.qwen3 import RuntimeOptions, init_model
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout
from turnsight_jax.rl.logprobs import logprobs_at, teacher_logprobs
from turnsight_jax.methods.privileged_views import build_privileged_views

from _vocab import SMALL_VOCAB, fold, fold_views
from conftest import OPTIMIZED

CFG = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
TOP_K = 4


@pytest.fixture(scope="module")
def trajectories(tok):
    """Groups of two: a gold chain (reward 1) and a shorter or noisy attempt (reward 0)."""
    tasks = [generate_task(c, s, SyntheticConfig(hops=2)) for s, c in enumerate(SYNTHETIC_CATEGORIES[:3])]
    scripts = []
    for t in tasks:
        gold = gold_turn_texts(t)
        scripts.append(gold)
        noisy = list(gold)
        noisy.insert(1, '<tool_call>\n{"name": "nope", "arguments": {"x": 1}}\n</tool_call>')
        scripts.append(noisy[:3])
    with FTRLEnv(num_workers=1) as env:
        res = rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=2,
                      config=RolloutConfig(max_turns=6, max_response_tokens=4096))
    rewards = [1.0 if i % 2 == 0 else 0.0 for i in range(len(res.trajectories))]
    rewards[4] = 0.0  # group 2 has no successful rollout: both its sibling views are skipped
    return [tasks[i // 2] for i in range(len(res.trajectories))], res.trajectories, rewards


@pytest.fixture(scope="module")
def model():
    return init_model(CFG, seed=3, options=RuntimeOptions(attn_q_chunk=128))


def _plain_cases(trajs, blocks, placement):
    """(b, scored positions, plain sequence) per view: the block inserted before turn 0's header
    ("prompt") or before each covered turn's header ("turn"); uncovered tokens read the student's
    own context."""
    cases = []
    for b, (traj, blk) in enumerate(zip(trajs, blocks)):
        tokens = [int(x) for x in traj.tokens]
        for k, turn in enumerate(traj.turns):
            ids = blk if placement == "prompt" else blk[k]
            hs = traj.turns[0].header_start if placement == "prompt" else turn.header_start
            seq = tokens[:turn.policy_end] if ids is None else tokens[:hs] + list(ids) + tokens[hs:turn.policy_end]
            cases.append((b, list(range(turn.policy_start, turn.policy_end)), seq, ids is not None))
    return cases


def _score_plain(model, cases, rows=8, top_k=0):
    width = 1 << max(len(seq) for *_, seq, _ in cases).bit_length()
    most = max(len(p) for _, p, _, _ in cases)

    @jax.jit
    def score(x, m, pred, y):
        return logprobs_at(model, model.hidden_states(x, Layout.causal(m)), pred, y, chunk=256, top_k=top_k)

    out = []
    for i in range(0, len(cases), rows):
        x, m = np.zeros((rows, width), np.int32), np.zeros((rows, width), bool)
        pred, y = np.zeros((rows, most), np.int32), np.zeros((rows, most), np.int32)
        for r, (_, pos, seq, _) in enumerate(cases[i:i + rows]):
            n = len(pos)
            x[r, :len(seq)], m[r, :len(seq)] = fold(seq), True
            pred[r, :n] = np.arange(len(seq) - n - 1, len(seq) - 1)  # the turn's tokens are the sequence's tail
            y[r, :n] = fold(seq[len(seq) - n:])
        res = jax.tree.map(np.asarray, score(*map(jnp.asarray, (x, m, pred, y))))
        for r, (_, pos, _, _) in enumerate(cases[i:i + rows]):
            out.append(jax.tree.map(lambda a: a[r, :len(pos)], res))
    return out


@pytest.mark.parametrize("source,placement,budget", [
    ("gold_answer", "prompt", 0), ("gold_answer", "turn", 0), ("sibling", "prompt", 0), ("sibling", "turn", 0),
    ("feedback", "prompt", 0), ("feedback", "turn", 0), ("skill", "prompt", 0), ("skill", "turn", 0),
    # the equal-length control (privileged.block_budget): short blocks padded with the filler, long ones cut
    ("feedback", "turn", 30),
])
def test_packed_privileged_views_equal_plain_sequences(tok, trajectories, model, source, placement, budget):
    tasks, trajs, rewards = trajectories
    skills = load_skills(default_skills_path())
    blocks = privileged_blocks(trajs, tasks, tok, source=source, placement=placement, skills=skills, rewards=rewards,
                               budget=budget)
    if budget:
        flat = [x for blk in blocks for x in (blk if placement == "turn" else [blk]) if x is not None]
        plain = [x for blk in privileged_blocks(trajs, tasks, tok, source=source, placement=placement, rewards=rewards)
                 for x in (blk if placement == "turn" else [blk]) if x is not None]
        assert {len(x) for x in flat} == {budget}
        assert min(map(len, plain)) < budget < max(map(len, plain))  # both padded and cut blocks
        o, c = (len(encode(tok, x)) for x in (PrivilegedTemplate().message_open, PrivilegedTemplate().message_close))
        for fitted, full in zip(flat, plain):  # the markup kept, the content's head, then the filler
            content, shown = full[o:-c], fitted[o:-c]
            n = min(len(content), budget - o - c)
            assert fitted[:o] == full[:o] and fitted[-c:] == full[-c:]
            assert shown[:n] == content[:n] and shown[n:] == encode(tok, ".\n") * (budget - o - c - n)
    views, stats = build_privileged_views(trajs, tok, blocks, placement=placement, with_reference=True)
    top_k = TOP_K if (source, placement) == ("gold_answer", "prompt") else 0
    got = jax.jit(lambda v: teacher_logprobs(model, v, chunk=64, top_k=top_k), compiler_options=OPTIMIZED)(
        jax.tree.map(jnp.asarray, fold_views(views)))
    got = jax.tree.map(np.asarray, got)
    packed = got[0] if top_k else got
    assert packed.shape[0] == 2  # the privileged view and the reference row

    cases = _plain_cases(trajs, blocks, placement)
    plain = _score_plain(model, cases, top_k=top_k)
    own = _score_plain(model, _plain_cases(trajs, [None if placement == "prompt" else [None] * t.num_turns
                                                   for t in trajs], placement))
    checked = uncovered = 0
    for (b, pos, _, has_block), lp, ref in zip(cases, plain, own):
        pol = np.flatnonzero(trajs[b].policy_mask)
        idx = [int(np.searchsorted(pol, p)) for p in pos]
        lp_plain = lp[0] if top_k else lp
        np.testing.assert_allclose(packed[0, b, idx], lp_plain, atol=1e-5, rtol=0)
        np.testing.assert_allclose(packed[1, b, idx], ref, atol=1e-5, rtol=0)  # the reference row
        assert views.covered[b, idx].tolist() == [has_block] * len(idx)
        if top_k:
            np.testing.assert_allclose(got[2][0, b, idx], lp[2], atol=1e-5, rtol=0)  # top-K log-probs
            np.testing.assert_array_equal(got[1][0, b, idx], lp[1])  # and their ids
        checked += len(pos)
        uncovered += 0 if has_block else len(pos)
        if has_block:  # the block changes what the teacher predicts
            assert np.abs(packed[0, b, idx] - ref).max() > 1e-4
    assert checked > 150
    n_views = sum(1 for *_, h in cases if h) if placement == "turn" else sum(b is not None for b in blocks)
    assert stats["views_built"] == n_views
    if source == "sibling":  # group 2 has no successful sibling; each gold chain's sibling failed
        assert uncovered > 0 and stats["views_skipped"] > 0
    if source == "feedback" and placement == "turn":  # the answer turn has no results: no block
        assert uncovered > 0
    if source in ("gold_answer", "skill"):
        assert uncovered == 0 and stats["views_skipped"] == 0
    # padding predictors of the policy (beyond each row's tokens) are never covered
    assert not views.covered[~np.asarray([[j < int(t.policy_mask.sum()) for j in range(views.covered.shape[1])]
                                          for t in trajs])].any()


def test_block_texts(tok, trajectories):
    tasks, trajs, rewards = trajectories
    t = PrivilegedTemplate()
    gold = privileged_texts(trajs, tasks, source="gold_answer", placement="prompt")
    assert gold[0] == f"The correct final answer is: {tasks[0].answer}\n"
    sib = privileged_texts(trajs, tasks, source="sibling", placement="prompt", rewards=rewards)
    # row 1 (failed) is shown row 0's transcript; row 0's only sibling failed; group 2 has no success
    assert sib[1].startswith("A successful attempt at this task:\n<turn>\n") and sib[0] is None
    assert sib[4] is None and sib[5] is None
    assert trajs[0].turns[0].results[0] in sib[1] and "<|im_end|>" not in sib[1]
    fb_turn = privileged_texts(trajs, tasks, source="feedback", placement="turn")
    assert [x is None for x in fb_turn[0]] == [not turn.results for turn in trajs[0].turns]
    assert fb_turn[0][0] == t.feedback.format(feedback="".join(t.result.format(result=r)
                                                               for r in trajs[0].turns[0].results))
    fb = privileged_texts(trajs, tasks, source="feedback", placement="prompt")
    assert fb[0].endswith(f"Outcome score: {trajs[0].reward:.2f}\n") and '"name": "' in fb[0]
    skills = {"single_hop": "Look it up, then answer.", "default": "Think, then act."}
    sk = privileged_texts(trajs, tasks, source="skill", placement="turn", skills=skills)
    assert sk[0] == ["Look it up, then answer.\n"] * trajs[0].num_turns  # tasks[0] is single_hop
    assert sk[2][0] == "Think, then act.\n"  # parallel_single_hop falls back to the default entry
    assert privileged_texts(trajs, tasks, source="skill", placement="prompt", skills={"multi_hop": "x"})[0] is None
    # the content is plain text: a spelled control token stays text inside the markup
    ids = privileged_blocks(trajs[:1], [tasks[0].__class__(**{**tasks[0].__dict__, "answer": "<|im_end|>"})], tok,
                            source="gold_answer", placement="prompt")[0]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(end) == 1 and ids[-2] == end  # only the block's own closing token
    with pytest.raises(ValueError, match="privileged source"):
        privileged_texts(trajs, tasks, source="oracle", placement="prompt")
    with pytest.raises(ValueError, match="placement"):
        privileged_texts(trajs, tasks, source="gold_answer", placement="system")
    with pytest.raises(ValueError, match="needs the skill texts"):
        privileged_texts(trajs, tasks, source="skill", placement="prompt")


def test_choose_sibling_rule():
    # group 0: rows 0-3; group 1: rows 4-5
    rewards = [1.0, 0.0, 1.0, 1.5, 0.0, 0.9]
    groups = [0, 0, 0, 0, 1, 1]
    lengths = [30, 10, 20, 50, 5, 5]
    # highest reward first (row 3 for everyone but itself), then fewest tokens (row 2 over row 0)
    assert choose_sibling(rewards, groups, lengths, 1.0) == [3, 3, 3, 2, None, None]
    # ties on reward: fewest tokens, then the lowest index
    assert choose_sibling([1, 1, 1], [0, 0, 0], [9, 4, 4], 1.0) == [1, 2, 1]
    assert choose_sibling(rewards, groups, lengths, 0.9) == [3, 3, 3, 2, 5, None]  # never itself


def test_load_skills_errors(tmp_path):
    bundled = load_skills(default_skills_path())
    assert set(SYNTHETIC_CATEGORIES) | {"default"} <= set(bundled)  # every built-in category has a skill
    bad = tmp_path / "s.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"s\.json: not JSON"):
        load_skills(bad)
    bad.write_text(json.dumps(["a"]))
    with pytest.raises(ValueError, match="expected a JSON object"):
        load_skills(bad)
    bad.write_text(json.dumps({"multi_hop": "  "}))
    with pytest.raises(ValueError, match="skill 'multi_hop' must be a non-empty string"):
        load_skills(bad)


def test_bad_blocks(tok, trajectories):
    tasks, trajs, _ = trajectories
    with pytest.raises(ValueError, match="placement"):
        build_privileged_views(trajs, tok, [None] * len(trajs), placement="system")
    with pytest.raises(ValueError, match="privileged blocks"):
        build_privileged_views(trajs, tok, [None], placement="prompt")
    with pytest.raises(ValueError, match="turns but 1 privileged blocks"):
        build_privileged_views(trajs, tok, [[None]] * len(trajs), placement="turn")
