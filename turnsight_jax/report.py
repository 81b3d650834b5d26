"""Plots of a training run from its `metrics.jsonl` (one JSON object per training step).

    python -m turnsight_jax.report RUN_DIR [--out DIR]      # default DIR: RUN_DIR/report

Writes PNG files of a fixed size (8 x 4.5 in at 100 dpi = 800 x 450 px) and an index.md:

  reward.png            rollout/reward_mean
  solve.png             Solve-P/R/F1 of the rollouts (solid) and of the held-out evaluations (dashed:
                        eval/ftrl_*, the paper's category averages, or older runs' task-pooled
                        eval/solve_*, and summary.json's before RL and after RL); the title says
                        when the run has no held-out evaluation
  turnsight_weights.png TurnSight weight mean with its min-max range
  depth_histogram.png   share of turns whose selected depth d* is 1, 2, 3, ... (stacked area)
  agreement.png         depth agreement rate, share of turns amplified / damped
  lengths.png           response tokens and turns per rollout
  optimization.png      pg_loss, kl, clip_frac, grad_norm, step time, tool error rate
  <method>.png          a method's own figure and index.md section, for a run of it (rl.methods.ReportSection;
                        SLIM: slim.png, the library's size, skills written / retired, Eval(S) and mean Δ of
                        the audits, and the skill library with its history: methods.slim.report)
  cost.png, cost.md     where the wall-clock went (measured and estimated parts), teacher FLOPs and their
                        share, tokens per view kind, peak memory (turnsight_jax.cost_report); with
                        `--compare OTHER_RUN` both runs side by side (TurnSight and its base)

index.md opens with the run's result (summary.json: held-out task-mean Solve-F1 before -> after RL
with the paired difference and its standard error, greedy, the FTRL Avg), and holds the held-out
evaluations of summary.json (eval_before_rl, eval_after_rl and
their greedy entries) as the paper's FTRL table: per category Solve-P/R/F1, Avg Solve-P/R/F1 and
Avg, the same numbers and layout as `python -m turnsight_jax.evaluate` prints
(`eval.ftrl_metrics`); they are printed too.

A plot whose keys are all absent is skipped with a note (printed and listed in index.md); a
panel or line whose key is absent is left out. Steps written twice (a resumed run) keep the
last record. A missing or empty metrics file is an error (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
from typing import Callable, Sequence

import turnsight_jax.methods  # noqa: F401  (the composition root: the built-in methods register their report sections)
from turnsight_jax import cost_report
from turnsight_jax.eval import ftrl_metrics
from turnsight_jax.rl.methods import REPORT_SECTIONS

FIG_SIZE = (8.0, 4.5)  # inches
DPI = 100  # -> 800 x 450 pixels

SOLVE_KEYS = ("rollout/solve_p", "rollout/solve_r", "rollout/solve_f1", "eval/ftrl_solve_p", "eval/ftrl_solve_r",
              "eval/ftrl_solve_f1")
LEGACY_EVAL_KEYS = ("eval/solve_p", "eval/solve_r", "eval/solve_f1")  # runs before eval/ftrl_*: task-pooled
WEIGHT_KEYS = ("turnsight/weight_mean", "turnsight/weight_min", "turnsight/weight_max")
AGREEMENT_KEYS = ("turnsight/agreement_rate", "turnsight/frac_turns_amplified", "turnsight/frac_turns_damped")
LENGTH_KEYS = ("rollout/response_tokens", "rollout/num_turns")
OPTIM_KEYS = ("train/pg_loss", "train/kl", "train/clip_frac", "train/grad_norm", "perf/step_s",
              "rollout/tool_error_rate")
DEPTH_KEY = "turnsight/depth_histogram"


class ReportError(ValueError):
    """The run folder or its metrics file cannot be read."""


@dataclasses.dataclass
class Metrics:
    """Records by step (ascending), each a dict of the keys that step logged."""

    steps: list[int]
    records: list[dict]

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) where `key` holds a finite number."""
        xs, ys = [], []
        for step, rec in zip(self.steps, self.records):
            v = rec.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                continue
            xs.append(step)
            ys.append(float(v))
        return xs, ys

    def has(self, key: str) -> bool:
        return any(key in r and r[key] is not None for r in self.records)


def load_metrics(path: str | pathlib.Path) -> tuple[Metrics, list[str]]:
    """Reads metrics.jsonl; returns (metrics, notes). A cut-off last line (a run still writing)
    is skipped with a note; any other unreadable line is an error naming it."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: no such file (expected a training run folder with metrics.jsonl)")
    lines = path.read_text(encoding="utf-8").splitlines()
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise ReportError(f"{path}: no metrics (the file is empty)")
    notes: list[str] = []
    by_step: dict[int, dict] = {}
    for k, (lineno, line) in enumerate(numbered):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if k == len(numbered) - 1 and k > 0:
                notes.append(f"line {lineno}: skipped an incomplete last line ({e.msg})")
                continue
            raise ReportError(f"{path}: line {lineno}: invalid JSON ({e})") from None
        if not isinstance(rec, dict):
            raise ReportError(f"{path}: line {lineno}: expected a JSON object, got {type(rec).__name__}")
        step = rec.get("step", k)
        if isinstance(step, bool) or not isinstance(step, (int, float)):
            raise ReportError(f"{path}: line {lineno}: 'step' must be a number, got {step!r:.40}")
        by_step[int(step)] = rec  # a resumed run re-logs steps: keep the last
    steps = sorted(by_step)
    return Metrics(steps, [by_step[s] for s in steps]), notes


# ---------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------
def _figure(nrows: int = 1, ncols: int = 1):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=FIG_SIZE, dpi=DPI, squeeze=False)
    return fig, axes


def _save(fig, path: pathlib.Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": the pixel size stays fixed
    plt.close(fig)


def _line(ax, m: Metrics, key: str, label: str | None = None, **kw) -> bool:
    xs, ys = m.series(key)
    if not xs:
        return False
    ax.plot(xs, ys, label=label or key, **kw)
    return True


def _integer_steps(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _finish(ax, title: str, ylabel: str = "", legend: bool = True) -> None:
    ax.set_title(title)
    ax.set_xlabel("step")
    _integer_steps(ax)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def plot_reward(m: Metrics, path: pathlib.Path) -> None:
    fig, ax = _figure()
    _line(ax[0, 0], m, "rollout/reward_mean", "rollout reward (mean)", marker=".")
    _finish(ax[0, 0], "Reward", "reward")
    _save(fig, path)


def plot_solve(m: Metrics, path: pathlib.Path, summary: dict | None = None) -> None:
    """Rollout Solve-P/R/F1 per step (solid); the held-out evaluations (dashed, circles): those
    logged during the run (eval/ftrl_*, eval.every) and summary.json's before RL (drawn at the step
    before the first) and after RL (at the last step), category averages."""
    fig, ax = _figure()
    a = ax[0, 0]
    styles = {"solve_f1": ("Solve-F1", "C0"), "solve_p": ("Solve-P", "C1"), "solve_r": ("Solve-R", "C2")}
    ends = _summary_points(m, summary)
    drew_eval = False
    for suffix, (name, color) in styles.items():
        _line(a, m, f"rollout/{suffix}", f"rollout {name}", color=color, lw=2 if suffix == "solve_f1" else 1)
        points = sorted(ends.get(suffix, []) + [(x, y) for x, y in zip(*m.series(f"eval/ftrl_{suffix}"))])
        if not points:
            points = sorted(ends.get(suffix, []) + [(x, y) for x, y in zip(*m.series(f"eval/{suffix}"))])
        if points:
            a.plot([x for x, _ in points], [y for _, y in points], color=color, ls="--", marker="o", ms=4,
                   label=f"held-out {name}")
            drew_eval = True
    _finish(a, "Solve-P/R/F1 (rollouts: solid; held-out eval: dashed)" if drew_eval
            else "Solve-P/R/F1 of the rollouts (no held-out evaluation in this run)", "score")
    _save(fig, path)


def _summary_points(m: Metrics, summary: dict | None) -> dict[str, list[tuple[float, float]]]:
    """summary.json's held-out category averages: before RL at the step before the first, after RL
    at the last step."""
    out: dict[str, list[tuple[float, float]]] = {}
    if not summary or not m.steps:
        return out
    for key, x in (("eval_before_rl", m.steps[0] - 1), ("eval_after_rl", m.steps[-1])):
        ftrl = (summary.get(key) or {}).get("ftrl") if isinstance(summary.get(key), dict) else None
        if isinstance(ftrl, dict) and isinstance(ftrl.get("average"), dict):
            for suffix, value in ftrl["average"].items():
                out.setdefault(suffix, []).append((float(x), float(value)))
    return out


def plot_weights(m: Metrics, path: pathlib.Path) -> None:
    fig, ax = _figure()
    a = ax[0, 0]
    lo_x, lo = m.series("turnsight/weight_min")
    hi_x, hi = m.series("turnsight/weight_max")
    if lo_x and lo_x == hi_x:
        a.fill_between(lo_x, lo, hi, alpha=0.25, color="C0", label="min-max")
    else:
        _line(a, m, "turnsight/weight_min", "min", color="C0", ls=":")
        _line(a, m, "turnsight/weight_max", "max", color="C0", ls=":")
    _line(a, m, "turnsight/weight_mean", "mean", color="C0", lw=2)
    a.axhline(1.0, color="gray", lw=0.8)
    _finish(a, "TurnSight weights w", "w")
    _save(fig, path)


def depth_fractions(m: Metrics) -> tuple[list[int], list[list[float]]]:
    """(steps, fractions[d][i]) from the per-step depth histograms (counts of turns per d*)."""
    steps, hists = [], []
    for step, rec in zip(m.steps, m.records):
        h = rec.get(DEPTH_KEY)
        if not isinstance(h, list) or not h or not all(isinstance(c, (int, float)) for c in h):
            continue
        total = float(sum(h))
        if total <= 0:
            continue
        steps.append(step)
        hists.append([c / total for c in h])
    depth = max((len(h) for h in hists), default=0)
    fractions = [[h[d] if d < len(h) else 0.0 for h in hists] for d in range(depth)]
    return steps, fractions


def plot_depths(m: Metrics, path: pathlib.Path) -> None:
    steps, fractions = depth_fractions(m)
    fig, ax = _figure()
    a = ax[0, 0]
    a.stackplot(steps, fractions, labels=[f"d* = {d + 1}" for d in range(len(fractions))], alpha=0.85)
    a.set_ylim(0, 1)
    _finish(a, "Selected hindsight depth (share of turns)", "share")
    _save(fig, path)


def plot_agreement(m: Metrics, path: pathlib.Path) -> None:
    fig, ax = _figure()
    a = ax[0, 0]
    _line(a, m, "turnsight/agreement_rate", "depth agreement rate", lw=2)
    _line(a, m, "turnsight/frac_turns_amplified", "turns amplified (w > 1)")
    _line(a, m, "turnsight/frac_turns_damped", "turns damped (w < 1)")
    a.set_ylim(-0.02, 1.02)
    _finish(a, "Depth agreement and weight direction", "fraction")
    _save(fig, path)


def plot_lengths(m: Metrics, path: pathlib.Path) -> None:
    fig, ax = _figure(1, 2)
    for a, key, title in ((ax[0, 0], "rollout/response_tokens", "Response tokens"),
                          (ax[0, 1], "rollout/num_turns", "Turns per rollout")):
        if not _line(a, m, key, key, marker="."):
            a.text(0.5, 0.5, f"no {key}", ha="center", va="center", transform=a.transAxes)
        _finish(a, title, legend=False)
    _save(fig, path)


def plot_optimization(m: Metrics, path: pathlib.Path) -> None:
    fig, ax = _figure(2, 3)
    for a, key in zip(ax.flat, OPTIM_KEYS):
        if not _line(a, m, key, key, lw=1):
            a.text(0.5, 0.5, f"no {key}", ha="center", va="center", transform=a.transAxes, fontsize=8)
        a.set_title(key, fontsize=9)
        a.tick_params(labelsize=7)
        _integer_steps(a)
        a.grid(alpha=0.3)
    _save(fig, path)


def plot_cost(names: Sequence[str], summaries: Sequence[cost_report.CostSummary], path: pathlib.Path) -> None:
    """Each run's wall-clock total, stacked by part (negative parts, tools overlapping decoding, as 0)."""
    fig, ax = _figure()
    a = ax[0, 0]
    labels = [lab for lab in dict.fromkeys(lab for s in summaries for lab, _, _ in s.wall) if lab != "total"]
    left = [0.0] * len(summaries)
    cmap = __import__("matplotlib").colormaps["tab20"]
    for i, label in enumerate(labels):
        widths = [max(next((t for lab, t, _ in s.wall if lab == label), 0.0), 0.0) for s in summaries]
        a.barh(list(range(len(summaries))), widths, left=left, color=cmap(i % 20), label=label.replace(" (est.)", "*"))
        left = [x + w for x, w in zip(left, widths)]
    a.set_yticks(list(range(len(summaries))), [f"{n}\n({s.steps} steps)" for n, s in zip(names, summaries)])
    a.set_xlabel("seconds (sum over the logged steps; * estimated)")
    a.set_title("Where the wall-clock went")
    a.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    a.grid(alpha=0.3, axis="x")
    _save(fig, path)


# The drawing helpers a method's report section draws with (rl.methods.ReportSection.plot's `kit`).
PLOT_KIT = argparse.Namespace(figure=_figure, line=_line, finish=_finish, save=_save)

PLOTS: tuple[tuple[str, Sequence[str], Callable], ...] = (
    ("reward.png", ("rollout/reward_mean",), plot_reward),
    ("solve.png", SOLVE_KEYS, plot_solve),
    ("turnsight_weights.png", WEIGHT_KEYS, plot_weights),
    ("depth_histogram.png", (DEPTH_KEY,), plot_depths),
    ("agreement.png", AGREEMENT_KEYS, plot_agreement),
    ("lengths.png", LENGTH_KEYS, plot_lengths),
    ("optimization.png", OPTIM_KEYS, plot_optimization),
)


@dataclasses.dataclass
class Report:
    files: list[pathlib.Path]
    notes: list[str]
    num_steps: int


def make_report(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path | None = None,
                log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
                compare: str | pathlib.Path | None = None) -> Report:
    """Writes the plots of `run_dir/metrics.jsonl` into `out_dir` (default run_dir/report); the
    cost table also holds `compare`'s run when given (its own metrics.jsonl)."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run folder")
    metrics, notes = load_metrics(run_dir / "metrics.jsonl")
    out = pathlib.Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for name, keys, plot in PLOTS:
        present = [k for k in keys if metrics.has(k)]
        if plot is plot_solve and not any(k.startswith("eval/") for k in present):  # an older run
            present += [k.replace("/solve", "/ftrl_solve") for k in LEGACY_EVAL_KEYS if metrics.has(k)]
        if not present or (plot is plot_depths and not depth_fractions(metrics)[0]):
            notes.append(f"skipped {name}: no {', '.join(keys)} in metrics.jsonl")
            continue
        missing = [k for k in keys if k not in present]
        if missing:
            notes.append(f"{name}: absent keys left out: {', '.join(missing)}")
        if plot is plot_solve:
            plot(metrics, out / name, _read_summary(run_dir))
        else:
            plot(metrics, out / name)
        files.append(out / name)
        log(f"wrote {out / name}")
    method_lines = []  # the methods' own sections (rl.methods.ReportSection; SLIM's skill library)
    for section in REPORT_SECTIONS.values():
        lines = section.lines(run_dir)
        if not lines:
            continue
        method_lines += lines
        if section.plot is not None and any(metrics.has(k) for k in section.plot_keys):
            section.plot(metrics, out / section.plot_name, PLOT_KIT)
            files.append(out / section.plot_name)
            log(f"wrote {out / section.plot_name}")
    cost_lines = _cost_section(run_dir, metrics, compare, out, files, notes, log)
    heldout_lines = heldout_section(run_dir, notes)
    if heldout_lines:
        log("\n".join(heldout_lines))
    for note in notes:
        log(f"note: {note}")
    result_lines = result_section(run_dir)
    index = [f"# Training report: {run_dir.name}", ""] + result_lines + [
             f"{len(metrics.steps)} steps ({metrics.steps[0]}..{metrics.steps[-1]}).", ""]
    index += [f"![{f.stem}]({f.name})" for f in files]
    index += heldout_lines + method_lines + cost_lines
    if notes:
        index += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    (out / "index.md").write_text("\n".join(index) + "\n")
    return Report(files, notes, len(metrics.steps))


def _read_summary(run_dir: pathlib.Path) -> dict | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def result_section(run_dir: str | pathlib.Path) -> list[str]:
    """index.md's opening lines: the run's result, held-out before -> after RL (summary.json), the
    task-mean Solve-F1 with the paired difference and its standard error, then greedy, then the
    paper's FTRL Avg; [] when the run has no held-out evaluation at both ends."""
    summary = _read_summary(pathlib.Path(run_dir))
    if summary is None:
        return []
    before, after = summary.get("eval_before_rl"), summary.get("eval_after_rl")
    if not isinstance(before, dict) or not isinstance(after, dict):
        return []
    key = "task_mean_solve_f1"
    lines = ["## Result", ""]
    imp = summary.get("improvement") or {}
    if key in before and key in after:
        diff = (f" (paired difference {imp['mean']:+.3f} ± {imp['paired_se']:.3f} SE, z {imp['z']:.1f})"
                if {"mean", "paired_se", "z"} <= set(imp) else "")
        lines.append(f"- Held-out task-mean Solve-F1, {after.get('n', '?')} tasks, {after.get('mode', '?')}: "
                     f"**{before[key]:.3f} -> {after[key]:.3f}** before -> after RL{diff}")
    gb, ga = before.get("greedy"), after.get("greedy")
    if isinstance(gb, dict) and isinstance(ga, dict) and key in gb and key in ga:
        lines.append(f"- Greedy: {gb[key]:.3f} -> {ga[key]:.3f}")
    fb, fa = before.get("ftrl"), after.get("ftrl")
    if isinstance(fb, dict) and isinstance(fa, dict):
        lines.append(f"- The paper's FTRL {ftrl_metrics.AVG_LABEL}: {ftrl_metrics.pct(fb['avg'])} -> "
                     f"{ftrl_metrics.pct(fa['avg'])} (%; tables below)")
    return lines + [""] if len(lines) > 2 else []


def heldout_section(run_dir: str | pathlib.Path, notes: list[str] | None = None) -> list[str]:
    """index.md's lines for summary.json's held-out evaluations (eval_before_rl.json when the run
    has no summary.json yet): per evaluation the paper's FTRL table (`ftrl_metrics.ftrl_table` of
    its `ftrl` entry) and which categories it covers. [] when there is neither file; an
    evaluation without `ftrl` (written before it existed) gets a note instead of a table."""
    run_dir = pathlib.Path(run_dir)
    notes = notes if notes is not None else []
    path = run_dir / "summary.json"
    try:
        if path.is_file():
            summary = json.loads(path.read_text())
        elif (run_dir / "eval_before_rl.json").is_file():
            path = run_dir / "eval_before_rl.json"
            summary = {"eval_before_rl": json.loads(path.read_text())}
        else:
            return []
    except (OSError, json.JSONDecodeError) as e:
        notes.append(f"{path.name}: not read ({e})")
        return []
    if not isinstance(summary, dict):
        notes.append(f"{path.name}: not a JSON object")
        return []
    lines = ["", "## Held-out evaluation (the paper's FTRL metrics, %)", "",
             f"From `{path.name}`: Solve-P/R/F1 per category, their averages over the categories "
             "(Avg Solve-P/R/F1) and Avg, the mean of the three (the paper's FTRL Avg)."]
    for key, title in (("eval_before_rl", "before RL"), ("eval_after_rl", "after RL")):
        ev = summary.get(key)
        if not isinstance(ev, dict):
            continue
        for entry, label in ((ev, f"{title} ({ev.get('mode', '?')})"), (ev.get("greedy"), f"{title} (greedy)")):
            if not isinstance(entry, dict):
                continue
            ftrl = entry.get("ftrl")
            if not isinstance(ftrl, dict):
                notes.append(f"{path.name} {key}: no per-category FTRL metrics (written before they existed); "
                             "python -m turnsight_jax.evaluate computes them")
                continue
            lines += ["", f"`{key}{'' if entry is ev else '.greedy'}`: {label}", "",
                      ftrl_metrics.ftrl_table(run_dir.name, ftrl["categories"], ftrl["average"], ftrl["avg"]), "",
                      ftrl_metrics.coverage_note(ftrl["categories"], ftrl.get("missing", []))]
    return lines if len(lines) > 4 else []


def _cost_section(run_dir, metrics, compare, out, files, notes, log) -> list[str]:
    """cost.md and cost.png of the run (and `compare`'s); the index's lines for them."""
    runs = [(run_dir.name, metrics)]
    if compare is not None:
        other, other_notes = load_metrics(pathlib.Path(compare) / "metrics.jsonl")
        notes += [f"{pathlib.Path(compare).name}: {n}" for n in other_notes]
        runs.append((pathlib.Path(compare).name if pathlib.Path(compare).name != run_dir.name else f"{compare}", other))
    missing = [name for name, m in runs if not cost_report.has_costs(m.records)]
    if missing:
        notes.append(f"no cost table: {', '.join(missing)} logged no cost metrics (perf/step_fn_s; runs before them)")
        return []
    names = [name for name, _ in runs]
    summaries = [cost_report.summarize(m.records) for _, m in runs]
    table = cost_report.cost_markdown(names, summaries)
    (out / "cost.md").write_text("\n".join([f"# Cost: {' vs '.join(names)}", "", *table, ""]) + "\n")
    plot_cost(names, summaries, out / "cost.png")
    files.append(out / "cost.png")
    log(f"wrote {out / 'cost.md'} and {out / 'cost.png'}")
    return ["", "## Cost", "", *table]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnsight_jax.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="training run folder holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report)")
    parser.add_argument("--compare", default=None, metavar="OTHER_RUN",
                        help="a second run folder whose costs go next to RUN_DIR's in cost.md (e.g. the base method)")
    args = parser.parse_args(argv)
    try:
        report = make_report(args.run_dir, args.out, compare=args.compare)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(report.files)} plots from {report.num_steps} steps in "
          f"{pathlib.Path(args.out) if args.out else pathlib.Path(args.run_dir) / 'report'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
