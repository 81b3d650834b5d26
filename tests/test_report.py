"""`python -m turnsight_jax.report`: plots from a run's metrics.jsonl.

The metrics file is constructed here with the keys and value shapes of a real run of
`python -m turnsight_jax.train` (a 3-step tiny_cpu run logged exactly these keys); a real run
takes about a minute on a CPU, too long for this suite.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import pytest

from turnsight_jax import report

EXPECTED_PNGS = ("reward.png", "solve.png", "turnsight_weights.png", "depth_histogram.png", "agreement.png",
                 "lengths.png", "optimization.png")


def realistic_record(step: int, rng: np.random.Generator, *, turnsight: bool = True, evaluate: bool = False) -> dict:
    """One step's metrics as the trainer writes them (keys of a real tiny_cpu run)."""
    progress = step / 20
    f1 = min(1.0, 0.2 + 0.6 * progress + 0.05 * rng.standard_normal())
    rec = {
        "step": step,
        "rollout/reward_mean": f1, "rollout/solve_f1": f1, "rollout/solve_p": min(1.0, f1 + 0.1),
        "rollout/solve_r": max(0.0, f1 - 0.05), "rollout/num_turns": 2.0 + progress, "rollout/num_calls": 1.5,
        "rollout/response_tokens": 120.0 + 40 * progress, "rollout/tool_error_rate": 0.3 * (1 - progress),
        "rollout/truncated": 0.0, "rollout/policy_tokens": 80.0,
        "train/adv_abs_mean": 0.7, "train/adv_mean": 0.0, "train/clip_frac": 0.01 * step, "train/grad_norm": 1.5,
        "train/kl": 0.0, "train/pg_loss": -0.01 * rng.standard_normal(), "train/ratio": 1.0,
        "train/reward_mean": f1,
        "perf/step_s": 4.1, "perf/rollout_s": 1.0, "perf/update_s": 3.1, "perf/tool_s": 0.01,
        "perf/tokens_per_s": 650.0, "perf/compilations": 6.0, "perf/view_overhead": 1.0,
    }
    if turnsight:
        hist = [int(x) for x in rng.multinomial(40, [0.6 - 0.02 * step, 0.25 + 0.01 * step, 0.15 + 0.01 * step])]
        rec.update({
            "turnsight/agreement_rate": 0.8, "turnsight/delta_mean": [0.01, 0.02, 0.03],
            "turnsight/depth_histogram": hist, "turnsight/frac_turns_amplified": 0.4,
            "turnsight/frac_turns_damped": 0.35, "turnsight/weight_max": 1.45, "turnsight/weight_mean": 1.02,
            "turnsight/weight_min": 0.55,
        })
    if evaluate:
        rec.update({"eval/ftrl_solve_f1": f1, "eval/ftrl_solve_p": f1, "eval/ftrl_solve_r": f1, "eval/ftrl_avg": f1,
                    "eval/task_mean_solve_f1": f1, "eval/task_mean_solve_f1_se": 0.03,
                    "eval/task_mean_answer_correct": f1})
    return rec


def write_metrics(run_dir: pathlib.Path, records, tail: str = "") -> pathlib.Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return path


def png_size(path: pathlib.Path) -> tuple[int, int]:
    import matplotlib.image as mpimg

    img = mpimg.imread(path)
    return img.shape[1], img.shape[0]  # (width, height)


def test_all_plots_from_a_realistic_run(tmp_path, capsys):
    rng = np.random.default_rng(0)
    records = [realistic_record(s, rng, evaluate=(s + 1) % 5 == 0) for s in range(20)]
    # A resumed run re-logs steps 18 and 19; the last record of a step wins.
    rerun = [realistic_record(s, rng) for s in (18, 19)]
    rerun[1]["rollout/reward_mean"] = 0.987
    # The run was still writing: a cut-off last line.
    write_metrics(tmp_path / "run", records + rerun, tail='{"step": 20, "rollout/rew')
    code = report.main([str(tmp_path / "run"), "--out", str(tmp_path / "plots")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "7 plots from 20 steps" in out
    assert "skipped an incomplete last line" in err
    for name in EXPECTED_PNGS:
        path = tmp_path / "plots" / name
        assert path.stat().st_size > 5_000, name
        assert png_size(path) == (800, 450), name
    index = (tmp_path / "plots" / "index.md").read_text()
    assert all(f"({name})" in index for name in EXPECTED_PNGS)

    metrics, notes = report.load_metrics(tmp_path / "run" / "metrics.jsonl")
    assert metrics.steps == list(range(20))
    assert metrics.series("rollout/reward_mean")[1][19] == 0.987
    assert metrics.series("eval/ftrl_solve_f1")[0] == [4, 9, 14]  # only evaluation steps (18/19 re-logged without)
    steps, fractions = report.depth_fractions(metrics)
    assert steps == list(range(20)) and len(fractions) == 3
    hist = metrics.records[7]["turnsight/depth_histogram"]
    assert [f[7] for f in fractions] == pytest.approx([c / sum(hist) for c in hist])
    assert all(math.isclose(sum(f[i] for f in fractions), 1.0) for i in range(20))


def test_grpo_run_without_turnsight_keys_skips_those_plots(tmp_path, capsys):
    rng = np.random.default_rng(1)
    write_metrics(tmp_path, [realistic_record(s, rng, turnsight=False) for s in range(5)])
    result = report.make_report(tmp_path)
    capsys.readouterr()
    names = sorted(p.name for p in result.files)
    assert names == sorted(["reward.png", "solve.png", "lengths.png", "optimization.png"])
    assert all(p.parent == tmp_path / "report" and png_size(p) == (800, 450) for p in result.files)
    skipped = [n for n in result.notes if n.startswith("skipped")]
    assert [n.split(":")[0] for n in skipped] == ["skipped turnsight_weights.png", "skipped depth_histogram.png",
                                                  "skipped agreement.png"]
    assert any(n.startswith("solve.png: absent keys left out: eval/ftrl_solve_p") for n in result.notes)
    assert "skipped depth_histogram.png: no turnsight/depth_histogram in metrics.jsonl" in (
        tmp_path / "report" / "index.md").read_text()


def test_missing_empty_and_broken_metrics_files(tmp_path, capsys):
    assert report.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {tmp_path / 'metrics.jsonl'}: no such file "
                                               "(expected a training run folder with metrics.jsonl)")
    write_metrics(tmp_path, [], tail="\n\n")
    assert report.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'metrics.jsonl'}: no metrics (the file is empty)"
    write_metrics(tmp_path, [], tail='{"step": 0}\nnot json\n{"step": 2}\n')
    assert report.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {tmp_path / 'metrics.jsonl'}: line 2: invalid JSON")
    assert report.main([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nope'}: no such run folder"


def cost_record(step: int, *, teacher: bool, device_gib: float | None = None) -> dict:
    """One step's cost metrics as turnsight_jax.cost logs them (round numbers to add by hand)."""
    rec = {"step": step, "rollout/reward_mean": 0.5, "perf/rollout_s": 3.0, "perf/rollout_prefill_s": 0.5,
           "perf/rollout_decode_s": 2.0, "perf/tool_s": 0.25, "perf/batch_s": 0.25, "perf/step_fn_s": 4.0 + step,
           "perf/step_s": 7.5 + step, "perf/records_s": 0.125, "perf/eval_s": 0.0,
           "perf/checkpoint_s": 1.0 if step == 2 else 0.0, "perf/step_fn_optimizer_s_est": 0.5,
           "perf/step_fn_student_s_est": 3.5 + step - (1.0 if teacher else 0.0), "perf/update_flops_necessary": 4e9,
           "perf/host_rss_peak_gib": 1.5 + step, "perf/student_tokens": 1000.0, "perf/step_compilations": 1.0}
    if teacher:
        rec.update({"perf/step_fn_teacher_s_est": 1.0, "perf/teacher_flops_necessary": 1e9,
                    "perf/teacher_tokens_trajectory": 1000.0, "perf/teacher_tokens_blocks": 600.0,
                    "perf/teacher_tokens_turn_copies": 400.0})
    if device_gib is not None:
        rec["perf/device_peak_gib"] = device_gib + step
    return rec


def test_the_cost_table_of_a_run_and_its_base(tmp_path, capsys):
    """`--compare`: the two runs' wall split (sums over steps, medians per step, the ratio), the
    teacher's FLOPs and share, tokens per view kind and peak memory, in cost.md and cost.png;
    a run's missing device memory stats are said to be unavailable, not filled in."""
    write_metrics(tmp_path / "turnsight", [cost_record(s, teacher=True, device_gib=2.0) for s in range(3)])
    write_metrics(tmp_path / "grpo", [cost_record(s, teacher=False) for s in range(3)])
    code = report.main([str(tmp_path / "turnsight"), "--compare", str(tmp_path / "grpo")])
    capsys.readouterr()
    assert code == 0
    out = tmp_path / "turnsight" / "report"
    rows = {line.split(" | ")[0].strip("| *"): [c.strip() for c in line.strip("|").split(" | ")[1:]]
            for line in (out / "cost.md").read_text().splitlines() if line.startswith("| ") and "---" not in line}
    assert rows[""] == ["turnsight: total", "turnsight: per step (median)", "grpo: total", "grpo: per step (median)",
                        "ratio"]
    assert rows["rollout: decode"] == ["6.00 s", "2.00 s", "6.00 s", "2.00 s", "1.00x"]
    # rollout 3 - 0.5 - 2 - 0.25 of host work per step
    assert rows["rollout: host (parsing, episodes; < 0: tools overlapped decoding)"][:2] == ["0.75 s", "0.25 s"]
    # student fwd+bwd: 2.5, 3.5, 4.5 (TurnSight) against 3.5, 4.5, 5.5 (GRPO)
    assert rows["update: student forward + backward (est.)"] == ["10.5 s", "3.50 s", "13.5 s", "4.50 s", "0.78x"]
    assert rows["update: teacher (est.)"] == ["3.00 s", "1.00 s", "—", "—", "—"]
    assert rows["checkpoint"] == ["1.00 s", "0.00 s", "1.00 s", "0.00 s", "1.00x"]
    # total: step_s + records + eval + checkpoint = 7.625, 8.625, 10.625
    assert rows["total"] == ["26.9 s", "8.62 s", "26.9 s", "8.62 s", "1.00x"]
    assert rows["teacher share of the update's FLOPs"][0] == "25.0%"
    assert rows["tokens scored, teacher: hindsight / privileged blocks"][0] == "1.8e+03"
    assert rows["peak device memory"][0] == "4.00 GiB"
    assert rows["peak device memory"][2] == "unavailable (no device memory stats: CPU backend)"
    assert rows["peak host RSS of the process"][0] == "3.50 GiB"
    assert png_size(out / "cost.png") == (800, 450)
    assert "## Cost" in (out / "index.md").read_text()


def _summary(before: float, after: float) -> dict:
    def ev(f1, greedy_f1):
        ftrl = {"categories": {"single_hop": {"label": "Single-Hop", "n": 2, "solve_p": 0.9, "solve_r": f1,
                                              "solve_f1": f1}},
                "average": {"solve_p": 0.9, "solve_r": f1, "solve_f1": f1}, "avg": (0.9 + 2 * f1) / 3,
                "averaged_over": ["Single-Hop"], "missing": [], "paper_categories": False}
        return {"n": 2, "mode": "2 samples at temperature 1", "ftrl": ftrl, "task_mean_solve_f1": f1,
                "greedy": {"n": 2, "mode": "greedy", "ftrl": ftrl, "task_mean_solve_f1": greedy_f1}}
    return {"eval_before_rl": ev(before, before + 0.1), "eval_after_rl": ev(after, after + 0.05),
            "improvement": {"metric": "task_mean_solve_f1", "mean": after - before, "paired_se": 0.025, "z": 9.6}}


def test_the_index_opens_with_the_result_and_the_solve_plot_draws_its_held_out_line(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    run = tmp_path / "run"
    write_metrics(run, [realistic_record(s, rng) for s in range(4)])
    (run / "summary.json").write_text(json.dumps(_summary(0.561, 0.802)))
    figures = {}
    real_save = report._save
    monkeypatch.setattr(report, "_save", lambda fig, path: (figures.__setitem__(path.name, fig), real_save(fig, path)))
    report.make_report(run, log=lambda s: None)
    index = (run / "report" / "index.md").read_text().splitlines()
    assert index[:5] == [
        "# Training report: run", "", "## Result", "",
        "- Held-out task-mean Solve-F1, 2 tasks, 2 samples at temperature 1: **0.561 -> 0.802** before -> after RL "
        "(paired difference +0.241 ± 0.025 SE, z 9.6)"]
    assert index[5] == "- Greedy: 0.661 -> 0.852"
    assert index[6].startswith("- The paper's FTRL Avg (mean of Avg Solve-P/R/F1): 67.40 -> 83.47")
    ax = figures["solve.png"].axes[0]
    assert "held-out eval: dashed" in ax.get_title()
    dashed = {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines() if line.get_linestyle() == "--"}
    # before RL at the step before the first, after RL at the last step
    assert dashed["held-out Solve-F1"] == [[-1.0, 0.561], [3.0, 0.802]]
    assert set(dashed) == {"held-out Solve-F1", "held-out Solve-P", "held-out Solve-R"}

    # a run without any held-out evaluation: no dashed line, and the title says so
    bare = tmp_path / "bare"
    write_metrics(bare, [realistic_record(s, rng) for s in range(4)])
    figures.clear()
    report.make_report(bare, log=lambda s: None)
    ax = figures["solve.png"].axes[0]
    assert ax.get_title() == "Solve-P/R/F1 of the rollouts (no held-out evaluation in this run)"
    assert not [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert "## Result" not in (bare / "report" / "index.md").read_text()
