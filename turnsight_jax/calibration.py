"""The teacher's calibration report of a run folder: `python -m turnsight_jax.calibration RUN_DIR`.

Reads the run's turn records (rl.turn_outcomes; train with `--config.log.turn_records=True`: the
teacher's log-probs come from the train step's own arrays, no second forward) and writes to
`--out` (default RUN_DIR/calibration):

* reliability.png: reliability diagrams of the student's (the sampler's) and the teacher's (each
  view: hindsight depth, or the privileged block) probabilities p = exp(log-prob) of the sampled
  tokens of tool turns, against the turn's tool outcome y (1: every call of the turn is a call of
  the task's gold chain, "gold_match"). Left: per token (each token's p, its turn's y); right: per
  turn (the turn's length-normalised probability exp(mean log-prob)). Equal-width bins; the
  diagonal is perfect calibration.
* calibration.md: per view, the expected calibration error (ECE = sum over bins of n_bin / n *
  |mean y - mean p|) per token and per turn, the mean probability, and the correlation of the
  turn's gap δ̄ = mean(teacher − student log-prob) with the tool outcome, for both outcomes:
  "errored" (a malformed call or an error result, e.g. an unavailable tool) and "gold_match";
  Pearson's r on the binary outcome (point-biserial), with n and a 95% interval from Fisher's z;
  the selected gap δ̄* (TurnSight's turn value) as its own row.

Only tool turns (turns with calls) count: the tool outcome of an answer turn is undefined. A
missing run folder or one without turn records is an error (exit status 2).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
from typing import Sequence

import numpy as np

from turnsight_jax.rl import turn_outcomes

OUTCOMES = ("gold_match", "errored")


def reliability(p: np.ndarray, y: np.ndarray, bins: int) -> dict[str, np.ndarray | float]:
    """Equal-width bins of p in [0, 1]: per bin the mean p, the mean y and the count; ECE."""
    p, y = np.asarray(p, np.float64), np.asarray(y, np.float64)
    which = np.minimum((p * bins).astype(int), bins - 1)
    count = np.bincount(which, minlength=bins).astype(np.float64)
    conf = np.bincount(which, p, minlength=bins) / np.maximum(count, 1)
    acc = np.bincount(which, y, minlength=bins) / np.maximum(count, 1)
    ece = float(np.sum(count / max(count.sum(), 1) * np.abs(acc - conf)))
    return {"conf": conf, "acc": acc, "count": count, "ece": ece}


def correlation(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, int]:
    """(Pearson's r, 95% interval low, high, n); nan when either side is constant or n < 4."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    n = int(x.size)
    if n < 4 or x.std() == 0 or y.std() == 0:
        return float("nan"), float("nan"), float("nan"), n
    r = float(np.corrcoef(x, y)[0, 1])
    z, se = math.atanh(max(min(r, 0.999999), -0.999999)), 1.0 / math.sqrt(n - 3)
    return r, math.tanh(z - 1.96 * se), math.tanh(z + 1.96 * se), n


def collect(run_dir: pathlib.Path) -> dict:
    """Tool-turn and token arrays over every recorded step of the run."""
    steps = turn_outcomes.load(run_dir)
    views = None
    tok_p = []  # per step: [V + 1, n_tool_tokens] log-probs (student first)
    tok_y = []
    turn_lp, turn_y, turn_gap, turn_sel = [], {o: [] for o in OUTCOMES}, [], []
    for step, rec in steps:
        if "token_teacher" not in rec:
            raise ValueError(f"{run_dir}: step {step}'s turn records hold no token log-probs (the method has no "
                             "teacher views)")
        names = [str(v) for v in rec["token_views"]]
        if views is None:
            views = names
        elif names != views:
            raise ValueError(f"{run_dir}: step {step} records views {names}, earlier steps {views}")
        row, turn = rec["token_row"], rec["token_turn"]
        tool = rec["has_calls"][row, turn]
        lp = np.concatenate([rec["token_student"][None], rec["token_teacher"]], axis=0)  # [V+1, n]
        tok_p.append(lp[:, tool])
        tok_y.append(rec["gold_match"][row, turn][tool])
        # per tool turn: the mean log-probs of its tokens
        key = row.astype(np.int64) * rec["has_calls"].shape[1] + turn
        uniq, inv = np.unique(key, return_inverse=True)
        count = np.bincount(inv).astype(np.float64)
        means = np.stack([np.bincount(inv, x) / count for x in lp])  # [V+1, turns]
        r, k = uniq // rec["has_calls"].shape[1], uniq % rec["has_calls"].shape[1]
        is_tool = rec["has_calls"][r, k]
        turn_lp.append(means[:, is_tool])
        for o in OUTCOMES:
            turn_y[o].append(rec[o][r, k][is_tool])
        turn_gap.append(means[1:, is_tool] - means[:1, is_tool])
        turn_sel.append(rec["step_delta_bar"][r, k][is_tool] if "step_delta_bar" in rec
                        else np.full(int(is_tool.sum()), np.nan))
    return {"views": ["student"] + views, "tok_lp": np.concatenate(tok_p, axis=1), "tok_y": np.concatenate(tok_y),
            "turn_lp": np.concatenate(turn_lp, axis=1), "turn_y": {o: np.concatenate(v) for o, v in turn_y.items()},
            "turn_gap": np.concatenate(turn_gap, axis=1), "turn_sel": np.concatenate(turn_sel), "steps": len(steps)}


def report(run_dir: pathlib.Path, out: pathlib.Path, bins: int = 10) -> dict:
    """Write reliability.png and calibration.md; returns the numbers of the table."""
    data = collect(run_dir)
    if not data["turn_y"]["gold_match"].size:
        raise ValueError(f"{run_dir}: the turn records hold no tool turn (no calls were made): nothing to calibrate")
    out.mkdir(parents=True, exist_ok=True)
    views = data["views"]
    tok = [reliability(np.exp(data["tok_lp"][v]), data["tok_y"], bins) for v in range(len(views))]
    turn = [reliability(np.exp(data["turn_lp"][v]), data["turn_y"]["gold_match"], bins) for v in range(len(views))]
    rows = []
    for v, name in enumerate(views):
        row = {"view": name, "ece_token": tok[v]["ece"], "ece_turn": turn[v]["ece"],
               "p_mean": float(np.exp(data["tok_lp"][v]).mean()) if data["tok_lp"].size else float("nan")}
        if v:
            for o in OUTCOMES:
                row[f"r_{o}"] = correlation(data["turn_gap"][v - 1], data["turn_y"][o])
            row["gap_mean"] = float(data["turn_gap"][v - 1].mean()) if data["turn_gap"].size else float("nan")
        rows.append(row)
    sel = data["turn_sel"]
    selected = None
    if sel.size and np.isfinite(sel).all():
        selected = {"view": "selected δ̄*", **{f"r_{o}": correlation(sel, data["turn_y"][o]) for o in OUTCOMES},
                    "gap_mean": float(sel.mean())}
    _plot(out / "reliability.png", views, tok, turn)
    _table(out / "calibration.md", run_dir, data, rows, selected, bins)
    return {"rows": rows, "selected": selected, "tool_turns": int(data["turn_y"]["gold_match"].size),
            "tokens": int(data["tok_y"].size), "gold_match_rate": float(np.mean(data["turn_y"]["gold_match"]))
            if data["turn_y"]["gold_match"].size else float("nan"),
            "errored_rate": float(np.mean(data["turn_y"]["errored"])) if data["turn_y"]["errored"].size else float("nan")}


def _fmt_r(r: tuple[float, float, float, int]) -> str:
    return "n/a" if math.isnan(r[0]) else f"{r[0]:+.3f} [{r[1]:+.2f}, {r[2]:+.2f}]"


def _table(path: pathlib.Path, run_dir: pathlib.Path, data: dict, rows: list[dict], selected: dict | None,
           bins: int) -> None:
    y = data["turn_y"]
    lines = [f"# Teacher calibration: {run_dir}", "",
             f"{data['steps']} recorded steps; {y['gold_match'].size} tool turns ({np.mean(y['gold_match']):.3f} "
             f"gold-matching, {np.mean(y['errored']):.3f} errored), {data['tok_y'].size} of their tokens; {bins} "
             "equal-width bins. ECE: expected calibration error of p (per token: the sampled token's "
             "probability; per turn: exp(mean log-prob)) against the turn's gold match. r: Pearson's "
             "correlation of the turn's gap (teacher − student mean log-prob) with the outcome, 95% interval.", "",
             "| view | mean p | ECE (tokens) | ECE (turns) | mean gap | r(gap, gold match) | r(gap, errored) |",
             "|---|---|---|---|---|---|---|"]
    for row in rows + ([selected] if selected else []):
        gap = row.get("gap_mean")
        lines.append(f"| {row['view']} | {row['p_mean']:.3f} | {row['ece_token']:.3f} | {row['ece_turn']:.3f} | "
                     if "p_mean" in row else f"| {row['view']} | | | | ")
        lines[-1] += (f"{gap:+.3f} | {_fmt_r(row['r_gold_match'])} | {_fmt_r(row['r_errored'])} |" if gap is not None
                      else "| | |")
    lines += ["", "![reliability](reliability.png)", ""]
    path.write_text("\n".join(lines))


def _plot(path: pathlib.Path, views: Sequence[str], tok: list[dict], turn: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.0, 4.2), dpi=100)
    for ax, rel, title in ((axes[0], tok, "per token"), (axes[1], turn, "per tool turn")):
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        for name, r in zip(views, rel):
            keep = r["count"] > 0
            ax.plot(r["conf"][keep], r["acc"][keep], marker="o", ms=3, label=f"{name} (ECE {r['ece']:.3f})")
        ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="probability of the sampled tokens", ylabel="gold-matching turns",
               title=title)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnsight_jax.calibration", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", help="a run folder trained with --config.log.turn_records=True")
    ap.add_argument("--out", default=None, help="output folder (default RUN_DIR/calibration)")
    ap.add_argument("--bins", type=int, default=10, help="equal-width probability bins")
    args = ap.parse_args(argv)
    run = pathlib.Path(args.run_dir)
    if args.bins < 1:
        print("error: --bins must be >= 1", file=sys.stderr)
        return 2
    try:
        res = report(run, pathlib.Path(args.out) if args.out else run / "calibration", args.bins)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"calibration of {res['tool_turns']} tool turns ({res['tokens']} tokens) written to "
          f"{args.out or run / 'calibration'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
