"""The paper's FTRL metrics, computed in one place.

The paper reports, for FTRL, Solve-P, Solve-R and Solve-F1 per category (Single-Hop, Parallel
Single-Hop, Multi-Hop, Parallel Multi-Hop), each averaged over the four categories, and an "Avg":
the mean of the three category-averaged numbers (e.g. (46.99 + 50.71 + 43.07) / 3 = 46.92).
`ftrl_scores` computes exactly that from (category, per-task metrics) pairs. It is the only
computation of these numbers: the evaluate command (`eval.scoring.summarise`, FTRL and built-in
tables), the trainer's held-out evaluation (`eval.heldout.summarise_tasks`: summary.json,
eval_before_rl.json, metrics.jsonl's `eval/ftrl_*`) and the report (`report.heldout_section`,
reading summary.json) all use it, and `ftrl_table` prints it the same way everywhere.

A task's metrics are already averaged over its samples (sampled evaluation); a category's
Solve-X is the mean over its tasks; the averages are over the categories that have tasks.

Categories: the paper's four come first, in Table 1 order; a task of any other category (a
custom file's `data_source` suffix, or none: "uncategorised") forms a category of its own,
after them, and is averaged like them. `averaged_over` lists the categories averaged and
`missing` the paper's categories with no task (e.g. the tiny configs' held-out tasks hold only
single_hop and multi_hop): the Avg is then not over the paper's four categories.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

FTRL_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("single_hop", "Single-Hop"),
    ("parallel_single_hop", "Parallel Single-Hop"),
    ("multi_hop", "Multi-Hop"),
    ("parallel_multi_hop", "Parallel Multi-Hop"),
)
SOLVE_METRICS = ("solve_p", "solve_r", "solve_f1")
SHORT = {"solve_p": "Solve-P", "solve_r": "Solve-R", "solve_f1": "Solve-F1"}
UNCATEGORISED = "uncategorised"


def category_key(category: str | None) -> str:
    """A task's category key: its category, or "uncategorised" when it has none."""
    return category or UNCATEGORISED


def category_label(key: str) -> str:
    """"Single-Hop" for the paper's categories; otherwise the key in title case ("Uncategorised")."""
    return dict(FTRL_CATEGORIES).get(key) or key.replace("_", " ").title()


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def ftrl_scores(rows: Iterable[tuple[str | None, Mapping[str, float]]]) -> dict:
    """The paper's FTRL metrics of (category, task metrics) pairs.

    Returns {"categories": {key: {"label", "n", "solve_p", "solve_r", "solve_f1"}} (categories
    with tasks: the paper's four in Table 1 order, then others as first seen), "average":
    {"solve_p", "solve_r", "solve_f1"} (means over those categories), "avg" (the mean of the three
    averages: the paper's FTRL Avg), "averaged_over" (their labels), "missing" (labels of the
    paper's categories with no task), "paper_categories" (True when the categories are exactly
    the paper's four, so the averages are the paper's)}. A metric no task of a category has is NaN there (and in
    the averages it enters). Fractions in [0, 1]."""
    groups: dict[str, list[Mapping[str, float]]] = {key: [] for key, _ in FTRL_CATEGORIES}
    for category, metrics in rows:
        groups.setdefault(category_key(category), []).append(metrics)
    cats: dict[str, dict] = {}
    for key, tasks in groups.items():
        if tasks:
            cats[key] = {"label": category_label(key), "n": len(tasks),
                         **{m: _mean([float(t[m]) for t in tasks if m in t]) for m in SOLVE_METRICS}}
    average = {m: _mean([c[m] for c in cats.values()]) for m in SOLVE_METRICS}
    return {"categories": cats, "average": average, "avg": _mean(list(average.values())),
            "averaged_over": [c["label"] for c in cats.values()],
            "missing": [label for key, label in FTRL_CATEGORIES if key not in cats],
            "paper_categories": list(cats) == [key for key, _ in FTRL_CATEGORIES]}


def pct(x: float) -> str:
    """A fraction as a percentage with two decimals ("–" for NaN)."""
    return "–" if not isinstance(x, (int, float)) or math.isnan(x) else f"{100 * x:.2f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def ftrl_table(model: str, categories: Mapping[str, Mapping], average: Mapping[str, float], avg: float) -> str:
    """The Table 1 layout (percentages): per category Solve-P/R/F1, Avg Solve-P/R/F1, Avg."""
    header, row = ["Model"], [model]
    for cat in categories.values():
        for key in SOLVE_METRICS:
            header.append(f"{cat['label']} {SHORT[key]}")
            row.append(pct(cat[key]))
    for key in SOLVE_METRICS:
        header.append(f"Avg {SHORT[key]}")
        row.append(pct(average[key]))
    header.append(AVG_LABEL)
    row.append(pct(avg))
    return table(header, [row])


# The last column: the paper's FTRL "Avg", labelled with what it averages (it is not a Solve-F1)
AVG_LABEL = "Avg (mean of Avg Solve-P/R/F1)"
# FTRL's scorer (docs/spec.md): a task with no calls has Solve-P 1 (nothing wrong was called), so a
# model that never calls scores Solve-P 100 and an Avg of about a third: read Solve-F1 first.
SOLVE_P_NOTE = ("Solve-P of a task with no calls is 1 (FTRL's scorer): a model that makes no call has Solve-P 100 "
                "and Solve-F1 0, so its Avg is about 33, not 0; read the Avg (the paper's number) with Solve-F1.")


def coverage_note(categories: Mapping[str, Mapping], missing: Sequence[str]) -> str:
    """"Tasks per category: ..."; when the categories are not the paper's four, which ones the
    averages cover."""
    note = "Tasks per category: " + ", ".join(f"{c['label']} {c['n']}" for c in categories.values()) + ". "
    note += SOLVE_P_NOTE
    others = [c["label"] for key, c in categories.items() if key not in dict(FTRL_CATEGORIES)]
    if missing or others:
        note += f" Averaged over {', '.join(c['label'] for c in categories.values())}"
        note += f"; no tasks of {', '.join(missing)}" if missing else ""
        note += f"; not paper categories: {', '.join(others)}" if others else ""
        note += " (not the paper's four-category average)."
    return note
