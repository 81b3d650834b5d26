"""The rollout-controller interface (rollout.control) and the controllers on it: T2PO's and APPO's
decisions on scripted token streams with fixed log-probs and entropies, equal to hand-computed
ones (issue 24, acceptance 1); then on the real paged engine (a tiny random Qwen3): a forced
</think>, a re-sampled turn, branches and an added episode share the prefix's KV blocks (no
prefill of it again) and their log-probs equal a teacher-forced forward of the final sequences
(acceptance 2); APPO's amplification is bit-equal to no transform at amplify = 0."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turnsight_jax.rl import appo, t2po
from turnsight_jax.rollout.control import ENTROPY, TOP_J_NLL, Chunk, DecodeSignals, EpisodeStart

THINK_CLOSE, TOOL_CALL, IM_END = 151668, 151657, 151645  # Qwen3's </think>, <tool_call>, <|im_end|>


def _replay_turn(ctl, row, turn, attempts, *, chunk=3, budget=32):
    """Feed a turn to an engine controller the way rollout.engine's decode loop does: the scripted
    attempts in order (a re-sample takes the next), each a list of (token, logprob, H, C) drawn
    `chunk` at a time; an Edit keeps a prefix of the chunk, its forced tokens come next with the
    signals scripted for them in `attempt["forced"]`, then the attempt's `after` tokens. Returns
    (the kept turn's tokens, attempts used)."""
    for attempt, script in enumerate(attempts):
        stream, kept, forced_queue = list(script["tokens"]), [], []
        while True:
            draw = (forced_queue + stream)[:chunk]
            n_forced = min(len(forced_queue), chunk)
            forced_queue, stream = forced_queue[n_forced:], stream[len(draw) - n_forced:]
            toks = np.array([d[0] for d in draw], np.int32)
            stop = [i for i, t in enumerate(toks) if t == IM_END]
            draw, toks = (draw[:stop[0] + 1], toks[:stop[0] + 1]) if stop else (draw, toks)
            edit = ctl.on_chunk(Chunk(row, turn, attempt, len(kept), budget - len(kept), toks,
                                      np.array([d[1] for d in draw], np.float32),
                                      {ENTROPY: np.array([d[2] for d in draw], np.float32),
                                       TOP_J_NLL: np.array([d[3] for d in draw], np.float32)}))
            keep = len(draw) if edit is None else edit.keep
            kept += [d[0] for d in draw[:keep]]
            if edit is not None and edit.force:
                forced_queue = [(t, *script["forced"]) for t in edit.force]
                stream = list(script.get("after", []))
            if kept and kept[-1] == IM_END:
                break
        resample = ctl.turn_done(row, turn, attempt, np.array(kept, np.int32), np.zeros(len(kept), np.float32), {})
        if not resample:
            return kept, attempt + 1
    raise AssertionError("every scripted attempt was re-sampled")


def _stream(tokens, h, c):
    return [(t, -1.0, a, b) for t, a, b in zip(tokens, h, c)]


def test_hesitation_and_tti_fire_at_the_hand_computed_token(tok):
    """H = [1, 3, 2, 2, 2, 2, 2, 2], C = [2, 2, 4, 3, 3, 3, 3, 3], alpha = 0.5. Running min-max:
    H~ = [0, 1, .5, .5, .5, .5, .5, .5], C~ = [0, 0, 1, .5, .5, .5, .5, .5], so
    M = [0, .5, .75, .5, .5, .5, .5, .5] and Delta_1.. = [.5, .25, .25, 0, 0, 0, 0]. With N = 2 the
    window means at t = 2, 3, 4 are .375, .25, .125: threshold .2 fires at t = 4, threshold .1 at
    t = 5 (mean 0). The turn keeps tokens 0..4, then </think> (forced), then goes on; TTI is spent."""
    h = [1, 3, 2, 2, 2, 2, 2, 2]
    c = [2, 2, 4, 3, 3, 3, 3, 3]
    m, run, _ = t2po.hesitation(np.array(h), np.array(c), t2po.Running(), 0.5)
    np.testing.assert_allclose(m, [0, .5, .75, .5, .5, .5, .5, .5])
    assert (run.h_lo, run.h_hi, run.c_lo, run.c_hi) == (1, 3, 2, 4)
    assert t2po.tti_fire(m, 0, 2, 0.2) == 4 and t2po.tti_fire(m, 0, 2, 0.1) == 5
    assert t2po.tti_fire(m, 5, 2, 0.2) == 5 and t2po.tti_fire(m, 0, 8, 0.2) == -1  # from `first`; too short

    tokens = [10, 11, 12, 13, 14, 15, 16, 17, IM_END]
    script = {"tokens": _stream(tokens, h + [2], c + [3]), "forced": (-2.0, 2.0, 3.0),
              "after": _stream([20, 21, IM_END], [2, 2, 2], [3, 3, 3])}
    for chunk in (1, 3, 4, 16):  # the decision does not depend on how the decode cut the stream
        ctl = t2po.T2POController(t2po.T2POConfig(tti_window=2, tti_threshold=0.2, tds=False), tok,
                                  enable_thinking=True)
        kept, attempts = _replay_turn(ctl, 0, 0, [script], chunk=chunk)
        assert kept == [10, 11, 12, 13, 14, THINK_CLOSE, 20, 21, IM_END] and attempts == 1, chunk
        assert ctl.fired == [(0, 0, 4)] and ctl.stats["tti_triggers"] == 1
        assert ctl.rows[0].tti_used and not ctl.rows[0].thinking
    # thinking closed by the policy itself before the window stalls: nothing is forced
    ctl = t2po.T2POController(t2po.T2POConfig(tti_window=2, tti_threshold=0.2, tds=False), tok,
                              enable_thinking=True)
    closed = [10, 11, 12, THINK_CLOSE, 14, 15, 16, 17, IM_END]
    kept, _ = _replay_turn(ctl, 0, 0, [{"tokens": _stream(closed, h + [2], c + [3])}], chunk=3)
    assert kept == closed and ctl.fired == []
    # at most once per trajectory: the next turn stalls too, and nothing is forced
    ctl = t2po.T2POController(t2po.T2POConfig(tti_window=2, tti_threshold=0.2, tds=False), tok,
                              enable_thinking=True)
    _replay_turn(ctl, 0, 0, [script])
    again, _ = _replay_turn(ctl, 0, 1, [{"tokens": _stream([30, 31, 32, 33, IM_END], [2] * 5, [3] * 5)}])
    assert again == [30, 31, 32, 33, IM_END] and len(ctl.fired) == 1


def test_tds_resamples_the_hand_computed_turns(tok):
    """Turn 0 as above (M = [0, .5, .75, .5 x 5], no TTI): Phi^0 = exp(mean log max(M, 1e-3)) =
    exp((log 1e-3 + 6 log .5 + log .75) / 8) = 0.24189. Turn 1, first sample: H = 2, C = 3 (inside
    the running ranges) -> M = .5, Phi = .5, Gamma = .25811 < .3: sampled again. Second sample:
    H = 3, C = 4 -> M = 1, Gamma = .75811: kept. With the cap at 1 re-sample, a third turn whose
    Gamma is small is kept anyway (the cap is per trajectory)."""
    cfg = t2po.T2POConfig(tti=False, tds_threshold=0.3, tds_max_resamples=1, phi_floor=1e-3)
    ctl = t2po.T2POController(cfg, tok, enable_thinking=False)
    turn0 = {"tokens": _stream([10] * 7 + [IM_END], [1, 3, 2, 2, 2, 2, 2, 2], [2, 2, 4, 3, 3, 3, 3, 3])}
    assert _replay_turn(ctl, 3, 0, [turn0]) == ([10] * 7 + [IM_END], 1)
    phi0 = math.exp((math.log(1e-3) + 6 * math.log(0.5) + math.log(0.75)) / 8)
    assert ctl.rows[3].phi_prev == pytest.approx(phi0) and phi0 == pytest.approx(0.24189, abs=1e-5)
    low = {"tokens": _stream([20, 21, IM_END], [2, 2, 2], [3, 3, 3])}
    high = {"tokens": _stream([22, 23, IM_END], [3, 3, 3], [4, 4, 4])}
    assert _replay_turn(ctl, 3, 1, [low, high]) == ([22, 23, IM_END], 2)
    assert ctl.resampled == {3: [1]} and ctl.rows[3].phi_prev == pytest.approx(1.0)
    # Gamma^2 = |.5 - 1| = .5 is not below .3; Gamma^3 = 0 is, but the cap (1) is spent: kept
    assert _replay_turn(ctl, 3, 2, [low]) == ([20, 21, IM_END], 1)
    assert _replay_turn(ctl, 3, 3, [low]) == ([20, 21, IM_END], 1)
    assert ctl.stats["tds_resamples"] == 1 and ctl.stats["tds_checked_turns"] == 4
    assert ctl.stats["gamma_sum"] == pytest.approx((0.5 - phi0) + (1 - phi0) + 0.5 + 0.0, abs=1e-9)
    assert 0.5 - phi0 == pytest.approx(0.25811, abs=1e-5) and 1 - phi0 == pytest.approx(0.75811, abs=1e-5)
    # a re-sample restores the statistics the turn started with: the discarded sample's H = 2 ... did
    # not move them, the kept one's 3, 4 did not either (inside [1, 3] x [2, 4])
    assert (ctl.rows[3].run.h_lo, ctl.rows[3].run.h_hi, ctl.rows[3].run.c_lo, ctl.rows[3].run.c_hi) == (1, 3, 2, 4)


def test_t2po_config_is_checked(tok):
    with pytest.raises(Exception, match=r"t2po.tti_window must be an int >= 1"):
        t2po.t2po_settings({"tti_window": 0})
    with pytest.raises(Exception, match=r"t2po.bogus is not a T2PO key"):
        t2po.t2po_settings({"bogus": 1})
    with pytest.raises(Exception, match=r"needs rollout.enable_thinking=True"):
        t2po.T2POController(t2po.T2POConfig(), tok, enable_thinking=False)
    with pytest.raises(Exception, match=r"appo.amplify must be >= 0 with amplify \* clip_low < 1"):
        appo.appo_settings({"amplify": 5.0, "clip_low": 0.2})
    with pytest.raises(Exception, match=r"appo.ratio_to must be one of"):
        appo.appo_settings({"ratio_to": "ema"})


def test_appo_omega_and_branch_points_equal_hand_computed():
    """log rho = [.1, -.2, 0, .3, -.1], gamma = .5: log Omega_4 = -.1, _3 = .3 - .05 = .25,
    _2 = .125, _1 = -.2 + .0625 = -.1375, _0 = .1 - .06875 = .03125; clip to [.8, 1.28]:
    exp(.25) = 1.284 -> 1.28. With H = [1, 2, .5, 3, 1]: Z(clip Omega) = [-.0832, -1.1494, .5916,
    1.5688, -.9278], Z(H) = [-.5590, .5590, -1.1180, 1.6771, -.5590], BS = their product =
    [.0465, -.6425, -.6614, 2.6310, .5186]: the top two are tokens 3 and 4."""
    lo = appo.log_omega(np.array([0.1, -0.2, 0.0, 0.3, -0.1]), 0.5)
    np.testing.assert_allclose(lo, [0.03125, -0.1375, 0.125, 0.25, -0.1], atol=1e-12)
    cfg = appo.APPOConfig(clip_low=0.2, clip_high=0.28)
    om = appo.clip_omega(lo, cfg)
    np.testing.assert_allclose(om, [math.exp(0.03125), math.exp(-0.1375), math.exp(0.125), 1.28, math.exp(-0.1)])
    h = np.array([1.0, 2.0, 0.5, 3.0, 1.0])
    points, bs = appo.branch_points(om, h, 2)
    np.testing.assert_allclose(bs, [0.0465, -0.6425, -0.6614, 2.6310, 0.5186], atol=1e-4)
    assert points.tolist() == [3, 4]
    # Omega constant (the first step: no earlier policy, rho = 1): BS = 0 everywhere, the entropy
    # breaks the tie, then the position; fewer tokens than branches: the order repeats
    points, bs = appo.branch_points(np.ones(5), h, 3)
    assert not bs.any() and points.tolist() == [3, 1, 0]
    assert appo.branch_points(np.ones(2), np.array([1.0, 2.0]), 3)[0].tolist() == [1, 0, 1]


def _rollout(group_id, lps, entropy):
    """A one-turn trajectory of a 3-token prompt and five policy tokens (the last <|im_end|>),
    its recorded log-probs and decode entropies as given."""
    from turnsight_jax.chat.trajectory import TrajectoryBuilder

    b = TrajectoryBuilder([151644, 872, 198], group_id, "t")
    b.add_policy_turn([40, 41, 42, 43, IM_END], lps, "abcd", [], answer="abcd", signals={ENTROPY: entropy})
    return b.build()


def test_appo_hooks_branch_at_the_hand_computed_positions():
    """The APPO hooks on two scripted rollouts of one prompt (G = 2, B = 2), their recorded
    log-probs and decode entropies fixed and pi_old's scripted: rollout 0 is the example above
    (branches at its policy tokens 3 and 4: positions 6 and 7); rollout 1 has ratio 1 everywhere
    (BS = 0: the entropies 5 and 4 decide, tokens 1 and 3: positions 4 and 6). The initial rows get
    group 2p, the branches 2p + 1 (p = 7: the call's first prompt), each branch its own key;
    clip(Omega) lands in token_values; when the branches end their own Omega is recorded and
    nothing more starts."""
    trajs = [_rollout(7, [-1.0] * 5, [1.0, 2.0, 0.5, 3.0, 1.0]), _rollout(7, [-2.0] * 5, [1.0, 5.0, 2.0, 4.0, 3.0])]
    branch = _rollout(15, [-1.0] * 5, [1.0] * 5)
    old = {id(trajs[0]): np.float32(-1.0) - np.array([0.1, -0.2, 0.0, 0.3, -0.1], np.float32),
           id(trajs[1]): np.full(5, -2.0, np.float32), id(branch): np.full(5, -1.1, np.float32)}
    cfg = appo.APPOConfig(branches=2, gamma=0.5, clip_low=0.2, clip_high=0.28)
    scored = []
    hooks = appo.APPOHooks(cfg, 2, first_prompt=7,
                           score_old=lambda ts: (scored.append(len(ts)), [old[id(t)] for t in ts])[1])
    starts = hooks.after_group(0, [0, 1], trajs)
    assert [(s.parent, s.position) for s in starts] == [(0, 6), (0, 7), (1, 4), (1, 6)]
    assert all(s.group_id == 15 for s in starts) and trajs[0].group_id == trajs[1].group_id == 14
    assert len({s.key_row for s in starts}) == 4 and min(s.key_row for s in starts) >= appo.BRANCH_KEY_BASE
    np.testing.assert_allclose(trajs[0].token_values[appo.OMEGA][3:8],
                               [math.exp(0.03125), math.exp(-0.1375), math.exp(0.125), 1.28, math.exp(-0.1)], rtol=1e-6)
    np.testing.assert_allclose(trajs[1].token_values[appo.OMEGA][3:8], 1.0)
    assert not trajs[0].token_values[appo.OMEGA][:3].any()  # the prompt: no policy token
    assert hooks.stats["appo/branch_score_sum"] == pytest.approx(2.6310 + 0.5186, abs=1e-3)
    # the branches end: one scoring call for the new row only, no further branching. Its log rho =
    # .1 everywhere: log Omega = [.19375, .1875, .175, .15, .1], all inside the clip
    assert hooks.after_group(0, [0, 1, 2], trajs + [branch]) == [] and scored == [2, 1]
    np.testing.assert_allclose(branch.token_values[appo.OMEGA][3:8],
                               np.exp([0.19375, 0.1875, 0.175, 0.15, 0.1]), rtol=1e-5)
