"""The paper's FTRL metrics (issue 58, item 1): one function (`eval.ftrl_metrics.ftrl_scores`)
behind summary.json (the trainer's held-out evaluation), the report and the evaluate command.

Hand-computed inputs only, in process: four categories of unequal size whose task-pooled means
differ from the paper's category averages, and the tiny configs' case (two of the four
categories, plus a task without one).
"""

from __future__ import annotations

import json

import pytest

from turnsight_jax import report
from turnsight_jax.eval import heldout, scoring
from turnsight_jax.eval.ftrl_metrics import FTRL_CATEGORIES, ftrl_scores
from turnsight_jax.eval.runner import Example
from turnsight_jax.eval.suites import Suite

# (category, (Solve-P, Solve-R, Solve-F1)) per task, in a run's (mixed) order; 1, 2, 3 and 4 tasks.
TASKS = [
    ("parallel_multi_hop", (0.5, 0.25, 1 / 3)), ("multi_hop", (0.0, 0.0, 0.0)),
    ("single_hop", (1.0, 1.0, 1.0)), ("parallel_single_hop", (1.0, 0.5, 2 / 3)),
    ("parallel_multi_hop", (0.5, 0.25, 1 / 3)), ("multi_hop", (1.0, 0.5, 2 / 3)),
    ("parallel_multi_hop", (0.5, 0.25, 1 / 3)), ("parallel_single_hop", (0.5, 0.5, 0.5)),
    ("multi_hop", (0.0, 0.0, 0.0)), ("parallel_multi_hop", (0.5, 0.25, 1 / 3)),
]
# By hand: per category (P, R, F1) means over its tasks, in Table 1 order.
PER_CATEGORY = {"single_hop": (1, 1, 1), "parallel_single_hop": (3 / 4, 1 / 2, 7 / 12),
                "multi_hop": (1 / 3, 1 / 6, 2 / 9), "parallel_multi_hop": (1 / 2, 1 / 4, 1 / 3)}
AVERAGE = {"solve_p": 31 / 48, "solve_r": 23 / 48, "solve_f1": 77 / 144}  # (sum of the four) / 4
AVG = 239 / 432  # (31/48 + 23/48 + 77/144) / 3
POOLED_P = 5.5 / 10  # the mean over the ten tasks: not the paper's number


def _metrics(prf):
    return {"solve_p": prf[0], "solve_r": prf[1], "solve_f1": prf[2], "answer_correct": float(prf[2] == 1),
            "num_turns": 2.0}


def _examples(tasks):
    return [Example(benchmark="builtin", category=cat or "uncategorised", task_id=f"t{i}", metrics=_metrics(prf),
                    reward=prf[2], finish_reason="answer", truncated=False, num_turns=2, text="", turns=[])
            for i, (cat, prf) in enumerate(tasks)]


def _three_ways(tmp_path, tasks):
    """(summary.json's eval_after_rl as read back, the report's lines, evaluate's builtin results
    and its Markdown) for the same tasks."""
    cats = [c for c, _ in tasks]
    ev = heldout.summarise_tasks([_metrics(prf) for _, prf in tasks], "greedy", cats)
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"eval_after_rl": ev}, indent=2))
    lines = report.heldout_section(run)
    examples = _examples(tasks)
    keys = list(dict.fromkeys([k for k, _ in FTRL_CATEGORIES] + [e.category for e in examples]))
    suite = Suite("builtin", {k: [None] for k in keys if any(e.category == k for e in examples)},
                  {k: k for k in keys})
    results = scoring.summarise([suite], examples)
    return json.loads((run / "summary.json").read_text())["eval_after_rl"], lines, results, \
        scoring.markdown("run", results)


def _row(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("| run |"))


def test_category_averages_by_hand_and_the_same_numbers_in_summary_report_and_evaluate(tmp_path):
    summary, lines, results, md = _three_ways(tmp_path, TASKS)
    ftrl = summary["ftrl"]
    assert list(ftrl["categories"]) == [k for k, _ in FTRL_CATEGORIES]
    assert [c["n"] for c in ftrl["categories"].values()] == [1, 2, 3, 4]
    for key, want in PER_CATEGORY.items():
        got = ftrl["categories"][key]
        assert [got["solve_p"], got["solve_r"], got["solve_f1"]] == pytest.approx(want, abs=1e-12), key
    assert ftrl["average"] == pytest.approx(AVERAGE, abs=1e-12)
    assert ftrl["avg"] == pytest.approx(AVG, abs=1e-12)
    assert (ftrl["missing"], ftrl["paper_categories"]) == ([], True)
    # the task-pooled means stay, named as such, and differ from the paper's numbers
    assert summary["task_mean_solve_p"] == pytest.approx(POOLED_P)
    assert abs(summary["task_mean_solve_p"] - ftrl["average"]["solve_p"]) > 0.09
    assert "solve_p" not in summary and "solve_f1" not in summary
    assert heldout.flat_ftrl(summary) == pytest.approx({"ftrl_solve_p": AVERAGE["solve_p"], "ftrl_solve_r":
                                                        AVERAGE["solve_r"], "ftrl_solve_f1": AVERAGE["solve_f1"],
                                                        "ftrl_avg": AVG})

    # evaluate: exactly the same numbers (results.json) ...
    bench = results["benchmarks"]["builtin"]
    for key, cat in ftrl["categories"].items():
        assert {m: bench["categories"][key][m] for m in cat} == cat
    assert bench["average"] == ftrl["average"] and bench["score"] == ftrl["avg"] == results["overall"]
    assert bench["categories"]["single_hop"]["answer_correct"] == 1.0  # its other columns are kept
    # ... and the same printed row as the report's
    assert _row(md) == _row("\n".join(lines))
    cells = [float(c) for c in _row(md).strip("|").split("|")[1:]]
    want = [100 * x for k, _ in FTRL_CATEGORIES for x in PER_CATEGORY[k]] + [100 * v for v in AVERAGE.values()]
    assert cells == pytest.approx(want + [100 * AVG], abs=0.006)
    assert _row(md).endswith(" | 55.32 |")
    assert "Tasks per category: Single-Hop 1, Parallel Single-Hop 2, Multi-Hop 3, Parallel Multi-Hop 4." in md
    assert "not the paper's" not in md


def test_missing_and_unknown_categories_are_averaged_as_present_and_said(tmp_path):
    # the tiny configs' held-out tasks: single_hop and multi_hop only; and a task with no category
    tasks = [("multi_hop", (0.0, 0.0, 0.0)), ("single_hop", (1.0, 0.5, 2 / 3)), (None, (1.0, 1.0, 1.0)),
             ("multi_hop", (1.0, 1.0, 1.0))]
    summary, lines, results, md = _three_ways(tmp_path, tasks)
    ftrl = summary["ftrl"]
    assert list(ftrl["categories"]) == ["single_hop", "multi_hop", "uncategorised"]
    assert ftrl["averaged_over"] == ["Single-Hop", "Multi-Hop", "Uncategorised"]
    assert ftrl["missing"] == ["Parallel Single-Hop", "Parallel Multi-Hop"] and not ftrl["paper_categories"]
    assert ftrl["average"]["solve_r"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    assert ftrl["avg"] == pytest.approx(((1 + 0.5 + 1) / 3 + 2 / 3 + (2 / 3 + 0.5 + 1) / 3) / 3)
    assert results["benchmarks"]["builtin"]["score"] == ftrl["avg"]
    assert results["benchmarks"]["builtin"]["missing"] == ftrl["missing"]
    assert _row(md) == _row("\n".join(lines))
    note = ("Averaged over Single-Hop, Multi-Hop, Uncategorised; no tasks of Parallel Single-Hop, Parallel "
            "Multi-Hop; not paper categories: Uncategorised (not the paper's four-category average).")
    assert note in md and note in "\n".join(lines)


def test_ftrl_scores_edge_cases_and_older_run_folders(tmp_path):
    assert ftrl_scores([])["categories"] == {} and ftrl_scores([])["avg"] != ftrl_scores([])["avg"]  # NaN
    with pytest.raises(ValueError, match="2 tasks but 1 categories"):
        heldout.summarise_tasks([{}, {}], "greedy", ["single_hop"])
    # a run folder written before the FTRL metrics: a note, no table; none at all: nothing
    run = tmp_path / "old"
    run.mkdir()
    assert report.heldout_section(run) == []
    (run / "summary.json").write_text(json.dumps({"eval_after_rl": {"n": 2, "mode": "greedy", "solve_f1": 0.5}}))
    notes: list[str] = []
    assert report.heldout_section(run, notes) == []
    assert notes == ["summary.json eval_after_rl: no per-category FTRL metrics (written before they existed); "
                     "python -m turnsight_jax.evaluate computes them"]
    # a sampled evaluation's greedy entry gets its own table; eval_before_rl.json alone is read too
    ev = heldout.summarise_tasks([_metrics(prf) for _, prf in TASKS], "2 samples at temperature 1",
                                 [c for c, _ in TASKS])
    (run / "summary.json").unlink()
    (run / "eval_before_rl.json").write_text(json.dumps({**ev, "greedy": ev}))
    text = "\n".join(report.heldout_section(run))
    assert "`eval_before_rl`: before RL (2 samples at temperature 1)" in text
    assert "`eval_before_rl.greedy`: before RL (greedy)" in text and text.count("| old |") == 2
