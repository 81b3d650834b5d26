"""Aggregation and tables: per-category scores, benchmark averages, the overall average.

All scores are fractions in [0, 1] in results.json and percentages (two decimals) in the
Markdown tables.

* FTRL / built-in: `eval.ftrl_metrics.ftrl_scores` (the one computation of the paper's FTRL
  metrics, shared with the training-time held-out evaluation and the report): per category, the
  mean over its tasks of each task's Solve-P, Solve-R and Solve-F1; "Avg P/R/F1" is the mean over
  the categories present; the benchmark's headline "Avg" (`score`) is the mean of those three
  (= the mean of all category x metric cells).
* BFCL: per subset (the four multi-turn categories, Memory, Web Search), the fraction of tasks
  BFCL's checker passes (multi-turn: `multi_turn_checker`; Memory, Web Search: `agentic_checker`);
  headline = the mean over the subsets run (`averaged` lists them, `not_run` says which selected
  ones could not run and why, `not_selected` which `--bfcl-categories` left out).
* ToolHop: the fraction of tasks answered correctly (headline).
* Overall: the mean of the headlines of the benchmarks evaluated.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from turnsight_jax.eval import suites as suite_lib
from turnsight_jax.eval.ftrl_metrics import coverage_note, ftrl_scores, ftrl_table
from turnsight_jax.eval.ftrl_metrics import pct as _pct
from turnsight_jax.eval.ftrl_metrics import table as _table
from turnsight_jax.eval.runner import Example

ACCURACY_KEY = {"bfcl": "bfcl_pass", "toolhop": "answer_correct"}


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _category_stats(benchmark: str, examples: Sequence[Example]) -> dict:
    """A category's counts and rates; Solve-P/R/F1 come from `ftrl_scores` (in `summarise`)."""
    stats: dict = {"n": len(examples)}
    if suite_lib.KIND[benchmark] == "solve":
        if examples and "answer_correct" in examples[0].metrics:
            stats["answer_correct"] = _mean([float(e.metrics["answer_correct"]) for e in examples])
    else:
        stats["accuracy"] = _mean([float(e.metrics[ACCURACY_KEY[benchmark]]) for e in examples])
    stats["mean_turns"] = _mean([float(e.num_turns) for e in examples])
    stats["mean_calls"] = _mean([float(e.metrics.get("num_calls", 0.0)) for e in examples])
    stats["tool_error_rate"] = _mean([float(e.metrics.get("tool_error_rate", 0.0)) for e in examples])
    stats["truncated"] = _mean([float(e.truncated) for e in examples])
    return stats


def summarise(suites: Sequence[suite_lib.Suite], examples: Sequence[Example]) -> dict:
    """{"benchmarks": {name: {"title", "kind", "categories", "average", "score"}}, "overall"}."""
    out: dict = {"benchmarks": {}}
    for suite in suites:
        by_cat: dict[str, list[Example]] = {cat: [] for cat in suite.categories}
        for e in examples:
            if e.benchmark == suite.benchmark:
                by_cat[e.category].append(e)
        kind = suite_lib.KIND[suite.benchmark]
        extra: dict = {}
        if kind == "solve":  # the paper's FTRL metrics, computed once (eval.ftrl_metrics)
            ftrl = ftrl_scores((cat, e.metrics) for cat, exs in by_cat.items() for e in exs)
            cats = {cat: {"label": scores["label"], **_category_stats(suite.benchmark, by_cat[cat]), **scores}
                    for cat, scores in ftrl["categories"].items()}
            average, score = ftrl["average"], ftrl["avg"]
            extra = {"missing": ftrl["missing"], "paper_categories": ftrl["paper_categories"]}
        else:
            cats = {cat: {"label": suite.labels[cat], **_category_stats(suite.benchmark, exs)}
                    for cat, exs in by_cat.items()}
            average = {"accuracy": _mean([c["accuracy"] for c in cats.values()])}
            score = average["accuracy"]
        out["benchmarks"][suite.benchmark] = {
            "title": suite_lib.TITLES[suite.benchmark], "kind": kind, "n": sum(c["n"] for c in cats.values()),
            "categories": cats, "average": average, "score": score,
            "averaged": [c["label"] for c in cats.values()], "not_run": dict(suite.not_run), **extra,
        }
        if suite.benchmark == "bfcl":  # which of the paper's six subsets --bfcl-categories left out
            out["benchmarks"][suite.benchmark]["not_selected"] = list(suite.not_selected)
    out["overall"] = _mean([b["score"] for b in out["benchmarks"].values()])
    return out


def _solve_table(model: str, bench: Mapping) -> str:
    return ftrl_table(model, bench["categories"], bench["average"], bench["score"])


def _accuracy_table(model: str, bench: Mapping) -> str:
    header, row = ["Model"], [model]
    for cat in bench["categories"].values():
        header.append(cat["label"])
        row.append(_pct(cat["accuracy"]))
    if len(bench["categories"]) > 1:
        header.append("Avg")
        row.append(_pct(bench["score"]))
    return _table(header, [row])


def markdown(model: str, summary: Mapping) -> str:
    """Per-benchmark tables (Table 1 layout, one model row) and an overall table."""
    parts = []
    for name, bench in summary["benchmarks"].items():
        counts = ", ".join(f"{c['label']} {c['n']}" for c in bench["categories"].values())
        table = _solve_table(model, bench) if bench["kind"] == "solve" else _accuracy_table(model, bench)
        metric = "Solve-P/R/F1 (%)" if bench["kind"] == "solve" else "accuracy (%)"
        note = coverage_note(bench["categories"], bench["missing"]) if bench["kind"] == "solve" \
            else f"Tasks per category: {counts}."
        if bench.get("not_run") or "not_selected" in bench:
            note += f"\nAvg over: {', '.join(bench['averaged'])}."
            if bench.get("not_run"):
                note += " Not run: " + "; ".join(f"{k} ({why})" for k, why in bench["not_run"].items()) + "."
            if bench.get("not_selected"):
                note += f" Not selected (--bfcl-categories): {', '.join(bench['not_selected'])}."
        parts.append(f"### {bench['title']} — {metric}\n\n{table}\n\n{note}")
    header = ["Model"] + [b["title"] for b in summary["benchmarks"].values()] + ["Overall"]
    row = [model] + [_pct(b["score"]) for b in summary["benchmarks"].values()] + [_pct(summary["overall"])]
    parts.append("### Overall (benchmark headline scores, %)\n\n" + _table(header, [row]))
    return "\n\n".join(parts) + "\n"
