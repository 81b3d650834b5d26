"""Print the packed hindsight row of one trajectory and the token cost of packing (no model).

    python docs/examples/hindsight_layout.py

Part 1 builds `turnsight_jax.rl.views.build_views` for one gold trajectory of a built-in multi-hop
task (2 tool turns + the answer turn) and prints every segment of its packed teacher row: packed
range, rotary positions, the two context pairs, and which packed index predicts the first policy
token of each (turn, depth) view. Part 2 measures the cost in tokens on gold trajectories with
more turns: packed row vs the trajectory, vs scoring every (turn, depth) view as its own sequence.
See docs/hindsight_views.md.
"""

from __future__ import annotations

import numpy as np

from turnsight_jax.assets import default_tokenizer
from turnsight_jax.chat.hindsight import teacher_view_ids
from turnsight_jax.envs.ftrl import FTRLEnv
from turnsight_jax.envs.synthetic import SyntheticConfig, generate_task, gold_turn_texts
from turnsight_jax.models.attention import NO_SEGMENT, PAD_SEGMENT
from turnsight_jax.rollout.driver import ReplayPolicy, RolloutConfig, rollout
from turnsight_jax.rl.views import ViewOptions, build_views

DEPTHS = (1, 2, 3)


def gold_trajectories(tok, env, hops: int, n: int, style: str = "short"):
    tasks = [generate_task("multi_hop", seed, SyntheticConfig(hops=hops, prompt_style=style)) for seed in range(n)]
    res = rollout(ReplayPolicy(tok, [gold_turn_texts(t) for t in tasks]), env, tasks, tokenizer=tok, group_size=1,
                  config=RolloutConfig(max_turns=hops + 2, max_response_tokens=8192, max_turn_tokens=512))
    return res.trajectories


def show_layout(tok, traj) -> None:
    views, stats = build_views([traj], tok, options=ViewOptions(depths=DEPTHS))
    lay = views.layout
    seg = np.asarray(lay.segment_ids[0])
    print(f"trajectory: {traj.length} tokens, {traj.num_turns} turns; packed row: {int(stats['view_tokens'])} "
          f"tokens (bucket {views.tokens.shape[1]})")
    print("turns (header_start, policy_start, policy_end):",
          [(t.header_start, t.policy_start, t.policy_end) for t in traj.turns])
    print(f"{'seg':>4} {'packed':>11} {'positions':>11} {'ctx1 (seg, end)':>16} {'ctx2 (seg, end)':>16}  starts with")
    for s in sorted(set(seg.tolist()) - {PAD_SEGMENT}):
        idx = np.flatnonzero(seg == s)
        a, b = int(idx[0]), int(idx[-1]) + 1
        pos = np.asarray(lay.positions[0])[a:b]

        def ctx(which):
            cs, ce = (int(np.asarray(getattr(lay, f"ctx{which}_segment")[0])[a]),
                      int(np.asarray(getattr(lay, f"ctx{which}_end")[0])[a]))
            return "-" if cs == NO_SEGMENT else f"({cs}, {ce})"

        text = tok.decode(views.tokens[0, a:min(b, a + 6)].tolist()).replace("\n", "\\n")
        print(f"{s:>4} {f'[{a}, {b})':>11} {f'{pos[0]}..{pos[-1]}':>11} {ctx(1):>16} {ctx(2):>16}  {text!r}")
    pol = np.flatnonzero(traj.policy_mask)
    print("predictor of each turn's first policy token, per depth (packed index):")
    for k, turn in enumerate(traj.turns):
        j = int(np.searchsorted(pol, turn.policy_start))
        print(f"  turn {k}: " + ", ".join(f"d={d}: {int(views.view_pred[i, 0, j])}" for i, d in enumerate(DEPTHS))
              + f"   (own context: {turn.policy_start - 1})")
    print(f"teacher rows (views x policy tokens): {int(stats['teacher_rows'])}; distinct predictors: "
          f"{int(stats['teacher_distinct_rows'])}")


def show_cost(tok, env) -> None:
    print("\ncost in tokens (gold multi-hop trajectories, FTRL-style prompts, depths 1-3):")
    print(f"{'turns':>5} {'trajectory':>10} {'packed':>7} {'packed/traj':>11} {'separate views':>14} "
          f"{'separate/traj':>13} {'distinct/rows':>13}")
    for hops in (2, 4, 7):
        trajs = gold_trajectories(tok, env, hops, 4, style="ftrl")
        _, stats = build_views(trajs, tok, options=ViewOptions(depths=DEPTHS))
        naive = sum(len(teacher_view_ids(tok, t, k, d)) for t in trajs for k in range(t.num_turns) for d in DEPTHS)
        own = stats["trajectory_tokens"]
        print(f"{trajs[0].num_turns:>5} {own / len(trajs):>10.0f} {stats['view_tokens'] / len(trajs):>7.0f} "
              f"{stats['view_overhead']:>11.2f} {naive / len(trajs):>14.0f} {naive / own:>13.2f} "
              f"{stats['teacher_distinct_rows'] / stats['teacher_rows']:>13.2f}")


def main() -> None:
    tok = default_tokenizer()
    with FTRLEnv(num_workers=1) as env:
        show_layout(tok, gold_trajectories(tok, env, hops=2, n=1)[0])
        show_cost(tok, env)


if __name__ == "__main__":
    main()
