"""The rollout-controller interface (rollout.control) and the controllers on it: T2PO's and APPO's
decisions on scripted token streams with fixed log-probs and entropies, equal to hand-computed
ones (issue 24, acceptance 1); then on the real paged engine (a tiny random Qwen3): a forced
</think>, a re-sampled turn, branches and an added episode share the prefix's KV blocks (no
prefill of it again) and their log-probs equal a teacher-forced forward of the final sequences
(acceptance 2); APPO's amplification is bit-equal to no transform at amplify = 0."""

from __future__ import annotations

import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from turnsight_jax.methods import appo, t2po
from turnsight_jax.rollout.control import ENTROPY, TOP_J_NLL, Chunk, DecodeSignals, EpisodeStart

from conftest import TINY_POLICY

REPO = pathlib.Path(__file__).resolve().parents[1]
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
    # the run config: the controllers need the paged engine; TTI needs thinking; APPO's rows
    from turnsight_jax.config import load_run_config, validate
    from turnsight_jax.errors import ConfigError

    for name, more, match in (("t2po", ["--config.rollout.engine=lockstep"], r"rl.rollout='t2po' acts inside the paged"),
                              ("appo", ["--config.rollout.engine=lockstep"], r"rl.rollout='appo' acts inside the paged"),
                              ("t2po", ["--config.rollout.enable_thinking=False"], r"t2po.tti forces </think>"),
                              ("appo", ["--config.appo.branches=0"], r"appo.branches must be an int >= 1")):
        with pytest.raises(ConfigError, match=match):
            validate(load_run_config(str(REPO / "configs" / "methods" / f"{name}.py"), more), 1)
    sc, method = validate(load_run_config(str(REPO / "configs" / "methods" / "appo.py"), ["--config.rl.method=turnsight"]), 1)
    assert sc.rows_per_prompt == 4 * 2 and method.transform.name == appo.AMPLIFY and method.base.name == "grpo"
    assert method.rollout.old_policy_kind(load_run_config(str(REPO / "configs" / "methods" / "appo.py"), [])) == "previous"


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
    branch.token_values[appo.OMEGA] = trajs[0].token_values[appo.OMEGA].copy()  # the driver copies a parent's values
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


# ---- on the real engine (a tiny random Qwen3 with the real vocabulary) ----

def _teacher_forced_error(model, trajs) -> float:
    """The largest |recorded - teacher-forced| log-prob over the trajectories' policy tokens (f32)."""
    from turnsight_jax.rl.logprobs import student_logprobs

    m = nnx.merge(*model)
    worst = 0.0
    for t in trajs:
        pos = np.flatnonzero(t.policy_mask)
        toks = jnp.asarray(t.tokens)[None]
        lp = student_logprobs(m, toks, jnp.ones_like(toks, bool), jnp.asarray(pos)[None], chunk=64, temperature=1.0)
        worst = max(worst, float(np.abs(np.asarray(lp)[0] - t.old_logprobs[pos]).max()))
    return worst


def _reference_tti(h, c, alpha, window, threshold):
    """TTI's first firing token of a trajectory's first turn, by plain loops: running min-max
    normalisation, M, the mean of the last `window` |Delta M|; -1 if none."""
    ms, lo_h, hi_h, lo_c, hi_c = [], math.inf, -math.inf, math.inf, -math.inf
    for t, (a, b) in enumerate(zip(h, c)):
        lo_h, hi_h, lo_c, hi_c = min(lo_h, a), max(hi_h, a), min(lo_c, b), max(hi_c, b)
        hn = (a - lo_h) / (hi_h - lo_h) if hi_h > lo_h else 0.0
        cn = (b - lo_c) / (hi_c - lo_c) if hi_c > lo_c else 0.0
        ms.append(alpha * hn + (1 - alpha) * cn)
        if t >= window and sum(abs(ms[s] - ms[s - 1]) for s in range(t - window + 1, t + 1)) / window < threshold:
            return t
    return -1


def test_engine_forces_resamples_and_branches_on_the_shared_prefix(tok, model):
    """The paged engine with controllers. (1) T2PO's TTI on sampled rollouts, thinking on: </think>
    is forced right after the token a loop over the recorded entropies and top-j NLLs says TTI fires
    at, and its log-prob is the policy's (a teacher-forced forward of the final sequence, f32, 1e-4).
    (2) TDS re-sampling every turn 1 (threshold 1, cap 1) on forced gold scripts, with rollout hooks
    that branch two finished episodes inside turns 0 and 1 and add a fresh one: the prompts are
    prefilled once each (prefill tokens = their lengths: a re-sampled turn, a branch and an added
    episode prefill nothing), a branch holds its parent's tokens up to its branch point, every
    recorded log-prob equals the teacher-forced forward, and every block is freed at the end."""
    from turnsight_jax.envs.ftrl import FTRLEnv
    from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
    from turnsight_jax.rollout import engine as E
    from turnsight_jax.rollout.driver import RolloutConfig, rollout
    from turnsight_jax.rollout.sampler import SamplingParams

    graphdef, state = model
    sampling = SamplingParams(temperature=1.0, top_k=20)
    tasks = [generate_task("single_hop", 4, SyntheticConfig())]
    env = FTRLEnv(num_workers=1)
    try:
        # (1) TTI
        rc = RolloutConfig(max_turns=2, max_prompt_tokens=1024, max_response_tokens=64, max_turn_tokens=24,
                           enable_thinking=True)
        cfg = t2po.T2POConfig(tti_window=3, tti_threshold=0.25, tds=False)
        ctl = t2po.T2POController(cfg, tok, enable_thinking=True)
        eng = E.PagedEngine(graphdef, state, tok, sampling=sampling, config=rc, controller=ctl, seed=3,
                            engine=E.EngineConfig(slots=2, block_size=16, decode_chunk=8))
        res = rollout(eng, env, tasks, tokenizer=tok, group_size=2, config=rc)
        assert ctl.stats["tti_triggers"] == 2 and res.stats["engine/forced_tokens"] == ctl.stats["tti_triggers"]
        for row, turn, at in ctl.fired:
            t = res.trajectories[row]
            span = slice(t.turns[0].policy_start, t.turns[0].policy_end)
            ids = t.tokens[span]
            assert turn == 0 and ids[at + 1] == THINK_CLOSE and THINK_CLOSE not in ids[:at + 1]
            h, c = t.token_values[ENTROPY][span], t.token_values[TOP_J_NLL][span]
            assert _reference_tti(h[:at + 1], c[:at + 1], cfg.alpha, cfg.tti_window, cfg.tti_threshold) == at
        assert _teacher_forced_error(model, res.trajectories) < 1e-4
        assert res.stats["engine/prefill_tokens"] == sum(len(p) for p in eng.prompts)

        # (2) TDS, branches, an added episode
        G = 2
        scripts = [gold_turn_texts(t) for t in tasks for _ in range(G)]
        rc = RolloutConfig(max_turns=3, max_prompt_tokens=1024, max_response_tokens=160, max_turn_tokens=48)
        ctl = t2po.T2POController(t2po.T2POConfig(tti=False, tds_threshold=1.0, tds_max_resamples=1), tok,
                                  enable_thinking=False)

        class Hooks:
            chosen = {}

            def after_group(self, p, rows, trajs):
                if len(rows) > G:
                    return []
                t = trajs[0]
                at = [int(np.flatnonzero(t.policy_mask)[5]), t.turns[1].policy_start + 3]
                self.chosen[p] = (rows[0], at)
                return [EpisodeStart(1000 + 10 * p + j, 100 + p, rows[0], a) for j, a in enumerate(at)] + [
                    EpisodeStart(1002 + 10 * p, 100 + p)]

        hooks = Hooks()
        eng = E.PagedEngine(graphdef, state, tok, sampling=sampling, config=rc, controller=ctl, seed=3, retain=True,
                            forced_scripts=scripts, engine=E.EngineConfig(slots=2, block_size=16, decode_chunk=8))
        res = rollout(eng, env, tasks, tokenizer=tok, group_size=G, config=rc, hooks=hooks)
    finally:
        env.close()
    trajs = res.trajectories
    assert len(trajs) == 2 + 3 and all(t.reward == pytest.approx(1.0) for t in trajs[:2])  # the gold scripts
    # both forced episodes re-sampled their turn 1 once (the script gives the same turn again:
    # dropped, its tokens counted); a branch starts with no Phi of its own, so it re-samples nothing
    assert ctl.resampled == {0: [1], 1: [1]} and res.stats["engine/resampled_turns"] == 2
    assert res.stats["engine/discarded_tokens"] == sum(t.turns[1].num_policy_tokens for t in trajs[:2])
    assert res.stats["engine/prefill_tokens"] == sum(len(p) for p in eng.prompts)  # nothing prefilled twice
    assert res.stats["branches"] == 2 and res.stats["added_episodes"] == 1 and res.stats["replay_mismatches"] == 0
    positions = [a for _, ats in hooks.chosen.values() for a in ats]
    assert res.stats["engine/branch_shared_tokens"] == sum(positions)
    (parent, ats), = hooks.chosen.values()
    for b, at in zip(trajs[2:4], ats):  # rows in start order: the two branches, then the added episode
        np.testing.assert_array_equal(b.tokens[:at], trajs[parent].tokens[:at])
        assert b.group_id == 100 and b.tokens.size > at
    assert trajs[4].group_id == 100 and trajs[4].prompt_len == len(eng.prompts[0])
    assert _teacher_forced_error(model, trajs) < 1e-4
    assert all(len(f) == eng.pool_blocks - 1 for f in eng.free) and eng.committed == [0] and not eng.retained


def test_appo_amplification_in_the_step(tok):
    """The step applies the controller's advantage transform to the method's final advantage:
    GRPO's (and TurnSight's over GRPO) times 1 + amplify * (clip(Omega) - 1) per policy token,
    exactly; with amplify = 0 the update is the one without any transform, bit for bit."""
    import optax

    from _replayed import gold_and_wrong
    from _vocab import SMALL_VOCAB, fold_batch
    from turnsight_jax.models.config import Qwen3Config
    from turnsight_jax.models.qwen3 import init_model
    from turnsight_jax.rl.batch import make_train_batch
    from turnsight_jax.rl.config import AlgoConfig, StepConfig
    from turnsight_jax.rl.methods import resolve_method
    from turnsight_jax.rl.step import compute_advantages, make_train_step

    trajs, tasks = gold_and_wrong(tok)
    rng = np.random.default_rng(0)
    for t in trajs:  # a clip(Omega) per policy token, as the APPO controller records it
        t.token_values[appo.OMEGA] = np.where(t.policy_mask, rng.uniform(0.8, 1.28, t.length), 0).astype(np.float32)
        t.old_logprobs = np.where(t.policy_mask, -rng.uniform(0.1, 3.0, t.length), 0).astype(np.float32)
    row_tasks = [tasks[i // 2] for i in range(len(trajs))]

    def setup(method, rollout, amplify, base="grpo"):
        cfg = StepConfig(algo=AlgoConfig(method=method, base=base, rollout=rollout,
                                         sections=(("appo", appo.APPOConfig(amplify=amplify)),)),
                         group_size=2, max_turns=5, logprob_chunk=64)
        m = resolve_method(cfg)
        return cfg, m, fold_batch(make_train_batch(trajs, row_tasks, tok, cfg, m)[0])

    for method in ("grpo", "turnsight"):
        cfg0, m0, b0 = setup(method, "", 0.5)
        cfg1, m1, b1 = setup(method, "appo", 0.5)
        assert m1.transform.name == appo.AMPLIFY and "appo_omega" in b1.signals and "appo_omega" not in b0.signals
        teacher = None
        if m0.needs_views:  # TurnSight's teacher log-probs: any fixed values serve both sides
            teacher = jnp.asarray(rng.normal(-1.0, 0.5, (len(cfg0.algo.depths), *b0.pol_valid.shape)), jnp.float32)
        a0, _ = compute_advantages(jax.tree.map(jnp.asarray, b0), teacher, cfg0, m0)
        a1, diag = compute_advantages(jax.tree.map(jnp.asarray, b1), teacher, cfg1, m1)
        omega, mask = np.asarray(b1.signals["appo_omega"]), np.asarray(b1.pol_valid)
        want = np.where(mask, np.asarray(a0) * (1 + 0.5 * (omega - 1)), 0)
        np.testing.assert_allclose(np.asarray(a1), want, rtol=1e-6, atol=1e-7)
        assert np.abs(np.asarray(a0)).max() > 0.1 and float(diag["appo/amplify_max"]) > 1.1
        assert float(diag["appo/amplify_min"]) == pytest.approx(1 + 0.5 * (omega[mask].min() - 1))

    # amplify = 0: the update equals GRPO's without a transform, bit for bit
    policy = init_model(Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                                    num_heads=2, num_kv_heads=1, head_dim=16), seed=0)
    graphdef, params = nnx.split(policy)
    outs = []
    for rollout in ("", "appo"):
        cfg, m, batch = setup("grpo", rollout, 0.0)
        step = make_train_step(graphdef, cfg, optax.sgd(1.0), m)
        p = jax.tree.map(jnp.copy, params)
        new, _, metrics = step(p, optax.sgd(1.0).init(p), params, jax.tree.map(jnp.asarray, batch))
        outs.append((jax.tree.map(np.asarray, new), float(metrics["adv_abs_mean"])))
    assert outs[0][1] == outs[1][1] > 0
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(outs[0][0]), jax.tree.leaves(outs[1][0])))


def test_decode_signals_are_the_tempered_distributions_and_only_when_declared(model):
    """rollout.sampler.token_signals equals H and C computed in float64 from softmax(logits / T);
    the compiled decode computes them only when a controller declares them (with a top-k-free
    sampler, the top-j search appears in the program only then)."""
    from turnsight_jax.models.paged_cache import LiveBlocks, empty_pool
    from turnsight_jax.models.config import Qwen3Config
    from turnsight_jax.rollout import engine as E
    from turnsight_jax.rollout.sampler import SamplingParams, token_signals

    logits = np.random.default_rng(0).normal(0, 3, (3, 2000)).astype(np.float32)
    got = token_signals(jnp.asarray(logits), SamplingParams(temperature=0.7), entropy=True, top_j=4)
    z = logits.astype(np.float64) / 0.7
    logp = z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) - z.max(1, keepdims=True)
    np.testing.assert_allclose(got[ENTROPY], -(np.exp(logp) * logp).sum(1), rtol=1e-4)
    np.testing.assert_allclose(got[TOP_J_NLL], -np.sort(logp, 1)[:, -4:].mean(1), rtol=1e-5)

    graphdef, state = model
    cfg = Qwen3Config(**TINY_POLICY)
    r, steps = 2, 4
    live = LiveBlocks(*(jnp.zeros((1, 8), jnp.int32) for _ in range(3)), jnp.zeros((1, r), jnp.int32))
    args = (graphdef, state, empty_pool(cfg, 1, 9, 16, jnp.float32), jnp.zeros((r, cfg.hidden_size)),
            jnp.zeros((r, 8), jnp.int32), live, jnp.zeros(r, jnp.int32), jnp.ones(r, jnp.int32),
            jax.vmap(jax.random.key)(jnp.arange(r)), jnp.zeros(r, jnp.int32), jnp.array([1, 2], jnp.int32),
            jnp.full((r, steps), -1, jnp.int32))
    params = SamplingParams(temperature=1.0)
    plain = E._decode.lower(*args, steps=steps, params=params).as_text()
    declared = E._decode.lower(*args, steps=steps, params=params, signals=DecodeSignals(entropy=True, top_j=5)).as_text()
    assert "top_k" not in plain and "top_k" in declared
    assert plain == E._decode.lower(*args, steps=steps, params=params, signals=DecodeSignals()).as_text()
