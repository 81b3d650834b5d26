"""The studies of the paper's open questions on the built-in tasks (docs/experiments.md):

    python -m turnsight_jax.studies equal_length --workdir runs/studies --out docs/experiments/equal_length
    python -m turnsight_jax.studies horizon      --workdir runs/studies --out docs/experiments/horizon
    python -m turnsight_jax.studies faults       --workdir runs/studies --out docs/experiments/faults
    python -m turnsight_jax.studies recovery     --workdir runs/studies --out docs/experiments/recovery

Each study is a set of arms: one training run each, from the embedded default (the tiny model,
CPU) with the study's task and size overrides plus the arm's own, trained in this process one
after the other from one supervised warm-start (built once per task family in
WORKDIR/warm_start_<family>/sft and copied into every arm's run folder). Then the study's table
(table.md), plots (*.png) and numbers (summary.json) are written to --out.

* equal_length: TurnSight with the hindsight source tool_results / tool_results_answer / answer,
  every block exactly rl.hindsight_budget tokens (chat.budget); each arm's calibration report
  (turnsight_jax.calibration) and the gap-outcome correlations side by side.
* horizon: TurnSight's depth selection vote (the paper) / dependency / saturation (rl.horizon) on
  the embedded default's tasks; the chosen depth against the gold chain's dependency horizon.
* faults: chains of 2-11 hops (up to 12 turns), clean tools / wrong results / temporary
  unavailability / delays (envs.faults); throughput, recovery and the credit of faulted turns.
* recovery: the same arms on the embedded default's tasks, which the tiny model solves more often.

--check builds and validates every arm's config and prints the plan without training (what the
documentation's test runs). Numbers are tiny-model evidence: a 4-layer model with a 64-wide
trunk, a few RL steps, one seed; they show the mechanisms at work, not the paper's effects.
Same command, seed and machine -> the same numbers (the rollouts and the step are deterministic
on a CPU); the wall times are the box's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
import sys
import time
from typing import Callable

import numpy as np

# Task families: the built-in task overrides shared by the studies that use them.
FAMILIES = {
    # the embedded default's tasks (single lookups and 2-hop chains over 10 single-token names and 4
    # relations) and its warm-start recipe at half the batch (8 rows): a tiny model solves them
    # often enough for every outcome to occur. (Chains of 2-4 hops over 16 names and 6 relations
    # left this warm-start at 0.06 Solve-F1, too few solved turns to measure anything.)
    "default": ["--config.sft.batch_size=8"],
    # chains of 2-11 hops, up to 12 turns (the tiny model solves the short ones, so the groups have
    # advantages, and the long ones run past 10 turns)
    "long": ["--config.data.categories=('multi_hop',)", "--config.data.hops=2", "--config.data.max_hops=11",
             "--config.data.vocab_size=28", "--config.data.num_relations=12", "--config.rollout.max_turns=14",
             "--config.rollout.max_prompt_tokens=1536", "--config.rollout.max_response_tokens=1024",
             "--config.eval.max_turns=14", "--config.sft.batch_size=8"],
}
# Sizes of every arm: a few RL steps, no held-out evaluation (the rollouts are the evidence), the
# turn records on, nothing exported.
SIZES = ["--config.train.prompts_per_step=4", "--config.train.group_size=4", "--config.data.num_eval=0",
         "--config.data.num_train=256", "--config.checkpoint.every=0", "--config.checkpoint.export_at_end=False",
         "--config.log.tensorboard=False", "--config.log.turn_records=True", "--config.sft.num_tasks=512"]


@dataclasses.dataclass(frozen=True)
class Study:
    family: str
    arms: dict[str, list[str]]
    steps: int
    report: Callable[[dict, pathlib.Path], list[str]]  # (per-arm results, out) -> the table's lines
    question: str


def _mean(records: list[dict], key: str) -> float:
    vals = [r[key] for r in records if key in r and isinstance(r[key], (int, float)) and math.isfinite(r[key])]
    return float(np.mean(vals)) if vals else float("nan")


def _f(x: float, nd: int = 3) -> str:
    return "n/a" if not isinstance(x, (int, float)) or not math.isfinite(x) else f"{x:.{nd}f}"


def _fr(r) -> str:
    return "n/a" if r is None or not math.isfinite(r[0]) else f"{r[0]:+.2f} [{r[1]:+.2f}, {r[2]:+.2f}]"


# ---- the reports ----

def _equal_length_report(results: dict, out: pathlib.Path) -> list[str]:
    from turnsight_jax import calibration

    lines = ["| source | block tokens | blocks cut | reward | δ̄ mean (d=1/2/3) | ECE student / teacher d=1 (turns) "
             "| r(δ̄*, gold match) | r(δ̄*, errored) |", "|---|---|---|---|---|---|---|---|"]
    for arm, res in results.items():
        cal = calibration.report(res["run"], out / f"calibration_{arm}")
        rows = {r["view"]: r for r in cal["rows"]}
        sel = cal["selected"] or {}
        gaps = "/".join(_f(rows[f"depth {d}"]["gap_mean"], 2) for d in (1, 2, 3))
        lines.append(f"| {arm} | {_f(_mean(res['records'], 'hindsight/block_tokens_mean'), 0)} | "
                     f"{_f(_mean(res['records'], 'hindsight/blocks_cut_frac'), 2)} | "
                     f"{_f(_mean(res['records'], 'rollout/reward_mean'))} | {gaps} | "
                     f"{_f(rows['student']['ece_turn'])} / {_f(rows['depth 1']['ece_turn'])} | "
                     f"{_fr(sel.get('r_gold_match'))} | {_fr(sel.get('r_errored'))} |")
        res["calibration"] = cal
    _plot_bars(out / "correlations.png", results, "r(δ̄ at depth d, gold match)",
               lambda res, d: next(r for r in res["calibration"]["rows"] if r["view"] == f"depth {d}")["r_gold_match"][0])
    lines += ["", "Each arm's reliability diagram: calibration_<source>/reliability.png; the gap-outcome "
              "correlation per depth: correlations.png."]
    return lines


def _horizon_report(results: dict, out: pathlib.Path) -> list[str]:
    from turnsight_jax.rl import turn_outcomes

    lines = ["| selection | mean chosen depth | depth covers the gold horizon | trajectory rule = gold rule "
             "| reward | weight max |", "|---|---|---|---|---|---|"]
    table = {}
    for arm, res in results.items():
        recs = [r for _, r in turn_outcomes.load(res["run"])]
        gold = np.concatenate([r["gold_horizon"][r["has_calls"]] for r in recs])
        depth = np.concatenate([r["step_depth"][r["has_calls"]] for r in recs])
        rule = np.concatenate([r["horizon"][r["has_calls"]] for r in recs])
        table[arm] = (gold, depth)
        known = gold >= 1
        covering = np.minimum(np.maximum(gold, 1), 3)
        share = (lambda x: _f(float(x.mean()), 2) if x.size else "n/a")
        lines.append(f"| {arm} | {_f(depth[depth >= 1].mean() if (depth >= 1).any() else float('nan'), 2)} | "
                     f"{share(depth[known] == covering[known])} | {share(rule[known] == gold[known])} "
                     f"({int(known.sum())} turns) | "
                     f"{_f(_mean(res['records'], 'rollout/reward_mean'))} | "
                     f"{_f(_mean(res['records'], 'turnsight/weight_max'), 2)} |")
        res["depth_by_gold"] = {int(g): [int((depth[gold == g] == d).sum()) for d in (1, 2, 3)]
                                for g in sorted(set(gold[known].tolist()))}
    _plot_depths(out / "depth_vs_gold.png", table)
    lines += ["", "Tool turns whose calls are a gold turn's (the others have no gold horizon). The "
              "covering depth of a gold horizon h is min(h, 3). depth_vs_gold.png: the chosen depth's "
              "distribution per gold horizon."]
    return lines


def _faults_report(results: dict, out: pathlib.Path) -> list[str]:
    from turnsight_jax.rl import turn_outcomes

    lines = ["| tools | faulted tool turns | episodes/s | tokens/s (rollout) | step s | success: faulted / clean "
             "episodes | weight: faulted / clean turns | advantage: faulted / clean turns | turns: mean, > 10, longest |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, res in results.items():
        r = res["records"]
        turns = np.concatenate([rec["num_turns"] for _, rec in turn_outcomes.load(res["run"])])
        lines.append(f"| {arm} | {_f(_mean(r, 'faults/faulted_turns'), 2)} | "
                     f"{_f(_mean(r, 'perf/rollout_episodes_per_s'), 2)} | {_f(_mean(r, 'perf/rollout_tokens_per_s'), 0)} | "
                     f"{_f(_mean(r, 'perf/step_s'), 1)} | {_f(_mean(r, 'recovery/success_faulted'), 2)} / "
                     f"{_f(_mean(r, 'recovery/success_clean'), 2)} | {_f(_mean(r, 'credit/weight_faulted'))} / "
                     f"{_f(_mean(r, 'credit/weight_clean'))} | {_f(_mean(r, 'credit/advantage_faulted'))} / "
                     f"{_f(_mean(r, 'credit/advantage_clean'))} | {_f(float(turns.mean()), 1)}, "
                     f"{_f(float((turns > 10).mean()), 2)}, {int(turns.max())} |")
    _plot_faults(out / "faults.png", results)
    lines += ["", "Means over the arm's RL steps (step 1 includes compilation in its step time). Success: the "
              "episode's final answer holds the gold answer (FTRL's check). faults.png: the same per step."]
    return lines


# ---- the plots ----

def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot_bars(path, results, ylabel, value):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    arms = list(results)
    for i, d in enumerate((1, 2, 3)):
        ax.bar(np.arange(len(arms)) + (i - 1) * 0.25, [value(results[a], d) for a in arms], 0.25, label=f"depth {d}")
    ax.axhline(0, color="0.5", lw=0.8)
    ax.set_xticks(range(len(arms)), arms)
    ax.set(ylabel=ylabel)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_depths(path, table):
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(table), figsize=(3.2 * len(table), 3.2), dpi=100, sharey=True)
    for ax, (arm, (gold, depth)) in zip(np.atleast_1d(axes), table.items()):
        hs = sorted(set(gold[gold >= 1].tolist()))
        bottom = np.zeros(len(hs))
        for d in (1, 2, 3):
            share = np.array([np.mean(depth[gold == h] == d) for h in hs])
            ax.bar([str(h) for h in hs], share, bottom=bottom, label=f"depth {d}")
            bottom += share
        ax.set(title=arm, xlabel="gold dependency horizon")
    np.atleast_1d(axes)[0].set_ylabel("share of turns")
    np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_faults(path, results):
    plt = _pyplot()
    keys = (("perf/rollout_episodes_per_s", "episodes/s"), ("recovery/success_faulted", "success of faulted episodes"),
            ("credit/weight_faulted", "weight of faulted turns"))
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(keys), figsize=(10.5, 3.2), dpi=100)
    for ax, (key, label) in zip(axes, keys):
        for i, (arm, res) in enumerate(results.items()):  # one colour per arm in every panel
            pts = [(r["step"] + 1, r[key]) for r in res["records"] if key in r and math.isfinite(r[key])]
            ax.plot(*(zip(*pts) if pts else ([], [])), marker="o", ms=3, color=f"C{i}", label=arm)
        ax.set(xlabel="RL step", title=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


FAULT_ARMS = {"clean": [], "wrong": ["--config.faults.wrong_rate=0.15"],
              "unavailable": ["--config.faults.unavailable_rate=0.2", "--config.faults.unavailable_attempts=1"],
              "delay": ["--config.faults.delay_rate=0.3", "--config.faults.delay_s=0.5"]}
BUDGET = 64  # tokens per hindsight message in the equal-length study: pads depth 1, cuts depth 3 of 2-hop chains
STUDIES = {
    "equal_length": Study(
        "default",
        {src: [f"--config.rl.source={src}", f"--config.rl.hindsight_budget={BUDGET}"]
         for src in ("tool_results", "tool_results_answer", "answer")},
        4, _equal_length_report,
        "At equal block length, does the teacher's gap track the turn's tool outcome, per hindsight source?"),
    "horizon": Study(
        "default",
        {"vote": ["--config.rl.selection=vote"], "dependency": ["--config.rl.selection=dependency"],
         "saturation": ["--config.rl.selection=saturation", "--config.rl.horizon_tol=0.05"]},
        4, _horizon_report,
        "Does an adaptive horizon pick the depth the task's dependency needs?"),
    "faults": Study(
        "long", FAULT_ARMS, 2, _faults_report,
        "Beyond 10 turns with noisy, slow or unavailable tools: throughput, recovery, credit to the faulty turn."),
    "recovery": Study(
        "default", FAULT_ARMS, 4, _faults_report,
        "The same faults on the short tasks the tiny model solves more often: recovery and credit."),
}


def arm_config(study: Study, arm: str, seed: int, steps: int):
    """The run config of one arm (validated)."""
    import turnsight_jax.methods  # noqa: F401  (the built-in methods register themselves)
    from turnsight_jax.config import load_run_config, validate

    cfg = load_run_config(None, [*FAMILIES[study.family], *SIZES, *study.arms[arm], f"--config.seed={seed}",
                                 f"--config.train.steps={steps}", f"--config.faults.seed={seed}"])
    cfg.name = f"study_{arm}"
    validate(cfg, 1)
    return cfg


def warm_start(study: Study, workdir: pathlib.Path, seed: int) -> pathlib.Path:
    """The task family's supervised warm-start (the embedded default's recipe on its tasks)."""

    from turnsight_jax import model_setup
    from turnsight_jax.models.sharding import make_mesh
    from turnsight_jax.sft import run_sft

    folder = workdir / f"warm_start_{study.family}_seed{seed}"
    cfg = arm_config(study, next(iter(study.arms)), seed, 1)
    mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    qcfg = model_setup.model_config(cfg)
    tok, tokdir = model_setup.setup_tokenizer(cfg, qcfg.vocab_size)
    folder.mkdir(parents=True, exist_ok=True)
    built = not (folder / "sft" / "SFT_DONE").is_file()
    t0 = time.perf_counter()
    out = run_sft(cfg, folder, mesh, tok, tokdir)
    if built:  # how long it took, for the tables of the studies that reuse it
        (folder / "build_seconds.txt").write_text(f"{time.perf_counter() - t0:.0f}\n")
    return out


def _warm_start_note(sft: pathlib.Path, seconds: float) -> str:
    """The warm-start's share of a study's wall time: built now, or reused (and how long it took)."""
    record = sft.parent / "build_seconds.txt"
    built = float(record.read_text()) if record.is_file() else float("nan")
    if seconds > 0.5 * built:
        return f"warm-start built in {seconds:.0f} s"
    return f"warm-start reused from {sft.parent.name} (built in {built:.0f} s by the same code)"


def _fresh_arm_folder(run_dir: pathlib.Path, sft: pathlib.Path) -> None:
    """Empties an arm's run folder (the table holds this command's numbers only) and copies the
    warm-start in, holding the folder's workdir lock while it does: a trainer still running there
    (another study command) is refused with WorkdirInUse naming it, not deleted from under. The
    lock is released before training, which takes it again."""
    from turnsight_jax.checkpointing import LOCK_FILE, WorkdirLock

    with WorkdirLock(run_dir):
        for entry in run_dir.iterdir():
            if entry.name == LOCK_FILE:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        shutil.copytree(sft, run_dir / "sft")


def run(name: str, workdir: pathlib.Path, out: pathlib.Path, seed: int = 0, steps: int | None = None) -> dict:
    """Train every arm of study `name` and write its table, plots and summary.json to `out`."""
    from turnsight_jax.train import train

    study = STUDIES[name]
    steps = study.steps if steps is None else steps
    t0 = time.perf_counter()
    sft = warm_start(study, workdir, seed)
    note = _warm_start_note(sft, time.perf_counter() - t0)
    results = {}
    for arm in study.arms:
        cfg = arm_config(study, arm, seed, steps)
        run_dir = workdir / name / arm
        _fresh_arm_folder(run_dir, sft)
        t1 = time.perf_counter()
        train(cfg, run_dir)
        results[arm] = {"run": run_dir, "records": _metrics(run_dir), "wall_s": time.perf_counter() - t1}
    _write(name, workdir, out, seed, steps, results, time.perf_counter() - t0, note)
    return results


def report_only(name: str, workdir: pathlib.Path, out: pathlib.Path, seed: int = 0, steps: int | None = None) -> dict:
    """The table, plots and summary of study `name` from its arms' existing run folders (the wall
    times from the summary.json of the run that trained them); ValueError when an arm is missing."""
    study = STUDIES[name]
    steps = study.steps if steps is None else steps
    prev_path = out / "summary.json"
    prev = json.loads(prev_path.read_text()) if prev_path.is_file() else {}
    if prev and (prev.get("seed"), prev.get("steps")) != (seed, steps):
        raise ValueError(f"{prev_path}: trained with seed {prev.get('seed')} and {prev.get('steps')} steps, not "
                         f"{seed} and {steps}")
    results = {}
    for arm in study.arms:
        run_dir = workdir / name / arm
        if not (run_dir / "metrics.jsonl").is_file():
            raise ValueError(f"{run_dir}: no finished run of arm {arm!r} (train the study first)")
        wall = prev.get("arms", {}).get(arm, {}).get("wall_s", float("nan"))
        results[arm] = {"run": run_dir, "records": _metrics(run_dir), "wall_s": wall}
    _write(name, workdir, out, seed, steps, results, prev.get("wall_s", float("nan")),
           prev.get("warm_start", "warm-start: see the run that trained the arms"))
    return results


def _metrics(run_dir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _write(name: str, workdir: pathlib.Path, out: pathlib.Path, seed: int, steps: int, results: dict, wall: float,
           note: str) -> None:
    study = STUDIES[name]
    cfg = arm_config(study, next(iter(study.arms)), seed, steps)
    out.mkdir(parents=True, exist_ok=True)
    lines = study.report(results, out)
    command = (f"python -m turnsight_jax.studies {name} --workdir {workdir} --out {out} --seed {seed}"
               + ("" if steps == study.steps else f" --steps {steps}"))
    head = [f"# Study: {name}", "", study.question, "",
            f"Tiny-model evidence: the embedded default's 4-layer, 64-wide Qwen3 from a supervised warm-start, "
            f"{steps} RL steps of {cfg.train.prompts_per_step} prompts x {cfg.train.group_size} rollouts per arm, one "
            f"seed ({seed}); not the paper's scale.", "",
            f"Command: `{command}`; wall time {wall / 60:.1f} min on the shared 2-core CPU box ({note}; arms: "
            + ", ".join(f"{a} {r['wall_s']:.0f} s" for a, r in results.items()) + ").", ""]
    (out / "table.md").write_text("\n".join(head + lines) + "\n")
    summary = {arm: {"wall_s": r["wall_s"], "steps": [{k: v for k, v in rec.items() if isinstance(v, (int, float))}
                                                      for rec in r["records"]]} for arm, r in results.items()}
    (out / "summary.json").write_text(json.dumps({"study": name, "seed": seed, "steps": steps, "wall_s": wall,
                                                  "warm_start": note, "arms": summary}, indent=1, sort_keys=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m turnsight_jax.studies", description=__doc__.split("\n\n")[0])
    ap.add_argument("study", choices=sorted(STUDIES))
    ap.add_argument("--workdir", default="runs/studies", help="run folders and warm-starts (not committed)")
    ap.add_argument("--out", default=None, help="table, plots and summary (default WORKDIR/<study>/report)")
    ap.add_argument("--seed", type=int, default=0, help="model init, tasks, rollouts and fault draws")
    ap.add_argument("--steps", type=int, default=None, help="RL steps per arm (default: the study's)")
    ap.add_argument("--check", action="store_true", help="validate every arm's config and print the plan; no training")
    ap.add_argument("--report-only", action="store_true",
                    help="rewrite the table and plots from the arms' existing run folders (no training)")
    args = ap.parse_args(argv)
    from turnsight_jax.errors import ConfigError

    study = STUDIES[args.study]
    steps = study.steps if args.steps is None else args.steps
    if steps < 1:
        print("error: --steps must be >= 1", file=sys.stderr)
        return 2
    workdir = pathlib.Path(args.workdir)
    out = pathlib.Path(args.out) if args.out else workdir / args.study / "report"
    try:
        configs = {arm: arm_config(study, arm, args.seed, steps) for arm in study.arms}
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        for arm, cfg in configs.items():
            print(f"{args.study}/{arm}: {cfg.rl.method} over {cfg.rl.base}, {steps} steps of "
                  f"{cfg.train.prompts_per_step} x {cfg.train.group_size}, arm {' '.join(study.arms[arm]) or '(none)'}")
        print(f"warm-start: {workdir / f'warm_start_{study.family}_seed{args.seed}'}; report: {out}")
        return 0
    if args.report_only:
        try:
            report_only(args.study, workdir, out, args.seed, steps)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        from turnsight_jax.errors import WorkdirInUse

        try:
            run(args.study, workdir, out, args.seed, steps)
        except WorkdirInUse as e:  # another trainer holds an arm's folder: one line naming it, as train's CLI
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(f"{args.study}: {out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
