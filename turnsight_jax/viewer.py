"""`python -m turnsight_jax.viewer RUN [--out FILE]`: the trajectory viewer of a training run.

Reads RUN/records/*.jsonl.gz (turnsight_jax.records, docs/records.md) and writes one
self-contained static HTML file (default RUN/viewer.html): the records embedded as JSON, plain
JavaScript and CSS, nothing fetched, no server. Open it in a browser to browse steps -> prompt
groups -> trajectories -> turns, each turn coloured by its weight and the sign of its base
advantage, sortable and filterable (turns whose depths disagree, whose weight opposes the tool
outcome, by task category or outcome), with per-step aggregates: the chosen-depth histogram, the
agreement rate, the weight by turn position and by tool outcome (docs/records.md, "The viewer").

A records file that cannot be read (cut short by a kill, not this schema) is left out and named on
the page with the reason; a run without any records is an error (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from importlib import resources
from typing import Sequence

from turnsight_jax import records
from turnsight_jax.report import ReportError, load_metrics

# the metrics shown next to each step (when metrics.jsonl has them)
STEP_METRICS = ("rollout/reward_mean", "rollout/solve_f1", "turnsight/agreement_rate", "turnsight/weight_mean",
                "turnsight/depth_histogram", "train/adv_abs_mean")


class InspectError(ValueError):
    """The run folder has nothing to show."""


def load_run(run_dir: pathlib.Path) -> dict:
    """{"run", "steps": [{"step", "header", "trajectories", "files", "metrics"}], "problems": [{"file",
    "message"}]}: every readable records file (the processes of one step merged, in process order)."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise InspectError(f"{run_dir}: no such run folder")
    files = records.run_record_files(run_dir)
    if not files:
        raise InspectError(f"{run_dir}: no trajectory records (records/step_*.jsonl.gz); train with "
                           "--config.log.records_every=N to write them")
    steps: dict[int, dict] = {}
    problems = []
    for path in sorted(files, key=lambda p: (records.file_step(p), records.file_process(p))):
        rel = str(path.relative_to(run_dir))
        try:
            header, trajs = records.read_records(path)
        except records.RecordsError as e:
            problems.append({"file": rel, "message": str(e).removeprefix(f"{path}: ")})
            continue
        entry = steps.setdefault(header["step"], {"step": header["step"], "header": header, "trajectories": [],
                                                  "files": []})
        if header["process"] != 0 and entry["files"]:
            entry["header"] = {**entry["header"], "dropped": entry["header"]["dropped"] + header["dropped"]}
        entry["trajectories"].extend(trajs)
        entry["files"].append(rel)
    try:
        metrics, _ = load_metrics(run_dir / "metrics.jsonl")
        by_step = dict(zip(metrics.steps, metrics.records))
    except ReportError:
        by_step = {}
    for step, entry in steps.items():
        rec = by_step.get(step, {})
        entry["metrics"] = {k: rec[k] for k in STEP_METRICS if k in rec}
    return {"run": run_dir.resolve().name, "steps": [steps[s] for s in sorted(steps)], "problems": problems}


def _asset(name: str) -> str:
    return resources.files("turnsight_jax").joinpath("assets", "viewer", name).read_text(encoding="utf-8")


def embedded_json(data) -> str:
    """JSON safe inside a <script> element: ASCII, every "<" escaped (so no "</script>" or "<!--")."""
    return json.dumps(data, allow_nan=False).replace("<", "\\u003c")


def render(data: dict) -> str:
    """The viewer page for `data` (load_run's), one self-contained HTML string."""
    parts = {"TITLE": data["run"].replace("&", "&amp;").replace("<", "&lt;"), "CSS": _asset("viewer.css"),
             "JS": _asset("viewer.js"), "DATA": embedded_json(data)}
    # one pass over the template: a placeholder-like text inside the data stays as it is
    return re.sub(r"__(TITLE|CSS|JS|DATA)__", lambda m: parts[m.group(1)], _asset("viewer.html"))


def write_viewer(run_dir: pathlib.Path, out: pathlib.Path | None = None) -> tuple[pathlib.Path, dict]:
    data = load_run(run_dir)
    out = pathlib.Path(out) if out is not None else pathlib.Path(run_dir) / "viewer.html"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(data), encoding="utf-8")
    return out, data


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m turnsight_jax.viewer", description=__doc__.split("\n\n")[1])
    parser.add_argument("run_dir", help="training run folder holding records/")
    parser.add_argument("--out", default=None, help="the HTML file to write (default: RUN_DIR/viewer.html)")
    args = parser.parse_args(argv)
    try:
        out, data = write_viewer(pathlib.Path(args.run_dir), args.out)
    except InspectError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in data["problems"]:
        print(f"warning: {p['file']}: {p['message']} (left out)", file=sys.stderr)
    n = sum(len(s["trajectories"]) for s in data["steps"])
    print(f"{out}: {len(data['steps'])} steps, {n} trajectories")
    return 0


if __name__ == "__main__":
    sys.exit(main())
