"""The report's SLIM section (`python -m turnsight_jax.report RUN_DIR`): for a run folder holding
`slim_library.json` (methods.slim.runner writes it after every audit) a markdown section (the report
adds a plot of the library's counters, PLOT): every skill with its status, task type, EMA of Δ, exposures
and text, then the history of adds, retirements and failed expansions, and the audits' Eval(S).
Runs of other methods get nothing (no file, no note)."""

from __future__ import annotations

import pathlib
from turnsight_jax.methods.slim import library as slim

PLOT = "slim.png"
COUNTER_KEYS = ("slim/library_size", "slim/expanded_total", "slim/retired_total", "slim/expand_failed_total")
TEXT_CHARS = 160  # skill texts in the table are cut to this many characters


def _cell(text: str, limit: int = TEXT_CHARS) -> str:
    """Model text as one markdown table cell: one line, pipes escaped, cut."""
    one = " ".join(str(text).split()).replace("|", "\\|")
    return one if len(one) <= limit else one[:limit] + "…"


def _num(v) -> str:
    return "–" if v is None else f"{v:+.3f}"


def markdown(library: slim.SkillLibrary) -> list[str]:
    """The section's markdown lines for `library`."""
    c = library.counts()
    lines = ["## Skill library (SLIM)", "",
             f"{c['library_size']} active skills, {c['retired_total']} retired, {c['expanded_total']} written by the "
             f"writer, {c['expand_failed_total']} failed expansions, {c['audits_total']} audits.", "",
             "| id | status | task type | origin | EMA Δ | last Δ | exposures | low rounds | created | retired | text |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in library.skills:
        lines.append(f"| {s.id} | {s.status} | {s.task_type or '(all)'} | {s.origin} | {_num(s.ema)} | "
                     f"{_num(s.last_delta)} | {s.exposures} | {s.low_rounds} | {s.created_step} | "
                     f"{'' if s.retired_step is None else s.retired_step} | {_cell(s.text)} |")
    lines += ["", "History (steps as in metrics.jsonl):", ""]
    for e in library.history:
        kind = e.get("event")
        if kind == "audit":
            deltas = ", ".join(f"{k} {v:+.3f}" for k, v in e.get("deltas", {}).items()) or "no skill measured"
            lines.append(f"- step {e['step']}: audit, Eval(S) {e['eval']:.3f} on {e['n_tasks']} tasks; Δ: {deltas}")
        elif kind == "add":
            lines.append(f"- step {e['step']}: added {e['id']} ({e['origin']}, {e.get('task_type') or 'all types'}): "
                         f"{_cell(e.get('text', ''), 80)}")
        elif kind == "retire":
            lines.append(f"- step {e['step']}: retired {e['id']} (EMA {e['ema']:+.3f}, {e['exposures']} exposures, "
                         f"{e['low_rounds']} low rounds)")
        elif kind == "expand_failed":
            lines.append(f"- step {e['step']}: expansion for {e.get('task_type')} failed: {e.get('reason')}")
    return lines


def slim_section(run_dir: pathlib.Path) -> list[str] | None:
    """The markdown lines of a SLIM run's library section; None for any other run (no
    slim_library.json). The report (turnsight_jax.report) then draws `plot`."""
    path = pathlib.Path(run_dir) / "slim_library.json"
    if not path.is_file():
        return None
    try:
        library = slim.from_json(path.read_text(encoding="utf-8"), where=str(path))
    except ValueError as e:
        return ["", "## Skill library (SLIM)", "", f"unreadable: {e}"]
    return [""] + markdown(library)


def plot(m, path: pathlib.Path, kit) -> None:
    """The library's counters and its audits (`kit`: the report's drawing helpers)."""
    fig, ax = kit.figure(1, 2)
    for key in COUNTER_KEYS:
        kit.line(ax[0, 0], m, key, key.split("/", 1)[1], marker=".")
    kit.finish(ax[0, 0], "Skill library", "skills")
    kit.line(ax[0, 1], m, "slim/audit_eval", "Eval(S)", marker=".")
    kit.line(ax[0, 1], m, "slim/delta_mean", "mean Δ", marker=".")
    kit.finish(ax[0, 1], "Audits", "reward")
    kit.save(fig, path)
