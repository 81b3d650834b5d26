"""One evaluation path: the training-time held-out evaluation runs on the evaluation runner.

- `evaluate_policy` (now a layer over `eval.runner.run_batches`) gives bit-identical numbers and
  trajectories to the pre-runner loop, copied below as `_reference`, greedy and sampled;
- `python -m turnsight_jax.evaluate --checkpoint RUN --benchmarks builtin --temperature 1 ...`
  reproduces `evaluate_policy` on the run's own held-out tasks from the run folder alone;
- the driver's progress callback sees increasing finished counts; `ProgressLine` throttles.
"""

from __future__ import annotations

import io
import json
import math
import pathlib

import numpy as np
import pytest
from flax import nnx

from turnsight_jax import evaluate, sources
from turnsight_jax.assets import default_tokenizer_dir
from turnsight_jax.config import apply_overrides, default_config, load_config_file, rollout_config
from turnsight_jax.envs.synthetic import generate_tasks, gold_turn_texts
from turnsight_jax.eval import heldout
from turnsight_jax.eval.ftrl_metrics import ftrl_scores
from turnsight_jax.eval.heldout import evaluate_policy
from turnsight_jax.eval.runner import run_batches
from turnsight_jax.model_setup import runtime_options
from turnsight_jax.models.config import get_preset
from turnsight_jax.models.qwen3 import init_model
from turnsight_jax.rollout.driver import ModelPolicy, ReplayPolicy, RolloutConfig, RolloutProgress, rollout
from turnsight_jax.rollout.progress import ProgressLine
from turnsight_jax.rollout.sampler import SamplingParams

TINY_RANDOM = pathlib.Path(__file__).parent / "configs" / "tiny_random.py"  # the tiny experiment on `tiny`
SMALL = ["rollout.max_turns=2", "eval.max_turns=2", "rollout.max_turn_tokens=12",
         "rollout.max_response_tokens=96", "rollout.max_prompt_tokens=1024", "eval.batch_size=2"]


def _cfg(*extra):
    return apply_overrides(load_config_file(TINY_RANDOM), SMALL + list(extra))


def _reference(graphdef, state, tok, tasks, cfg, env, *, greedy):
    """The training-time held-out evaluation before it ran on the evaluation runner (verbatim
    but for returning the trajectories too, the task-pooled means' names, task_mean_*, and the
    paper's FTRL metrics, `ftrl`, added: issue 58)."""
    samples = 1 if greedy else int(cfg.eval.samples)
    sampling = SamplingParams(greedy=True) if greedy else SamplingParams(
        temperature=cfg.eval.temperature, top_k=int(cfg.eval.top_k), top_p=float(cfg.eval.top_p))
    rc = rollout_config(cfg, max_turns=cfg.eval.max_turns)
    per_task, trajs = [], []
    bs = max(1, cfg.eval.batch_size // samples)
    for i in range(0, len(tasks), bs):
        chunk = tasks[i:i + bs]
        policy = ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=cfg.seed + i)
        res = rollout(policy, env, chunk, tokenizer=tok, group_size=samples, config=rc, seed=cfg.seed)
        trajs += res.trajectories
        for j in range(len(chunk)):
            group = [t.metrics for t in res.trajectories[j * samples:(j + 1) * samples]]
            per_task.append({k: float(np.mean([m[k] for m in group])) for k in group[0]
                             if all(isinstance(m.get(k), (int, float)) for m in group)})
    out = {"n": len(per_task), "mode": "greedy" if greedy else
           f"{samples} samples at temperature {cfg.eval.temperature:g}"
           + (f", top-k {cfg.eval.top_k}" if cfg.eval.top_k else "")
           + (f", top-p {cfg.eval.top_p:g}" if cfg.eval.top_p < 1 else ""),
           "ftrl": ftrl_scores(zip([t.category for t in tasks], per_task))}
    for key in ("solve_f1", "solve_p", "solve_r", "answer_correct", "num_turns"):
        vals = np.array([m.get(key, np.nan) for m in per_task], np.float64)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            out["task_mean_" + key] = float(vals.mean())
            out["task_mean_" + key + "_se"] = float(vals.std(ddof=1) / math.sqrt(vals.size)) if vals.size > 1 else 0.0
    out["per_task_solve_f1"] = [float(m.get("solve_f1", 0.0)) for m in per_task]
    return out, trajs


@pytest.fixture(scope="module")
def tiny():
    cfg = _cfg()
    return nnx.split(init_model(get_preset("tiny"), seed=5, options=runtime_options(cfg)))


@pytest.mark.parametrize("overrides", [["eval.temperature=0.0"],
                                       ["eval.temperature=1.0", "eval.top_k=20", "eval.samples=2"]],
                         ids=["greedy", "sampled"])
def test_heldout_on_the_runner_is_bit_identical_to_the_reference_loop(overrides, tiny, tok, env):
    cfg = _cfg(*overrides)
    graphdef, state = tiny
    tasks = generate_tasks(4, seed=11, categories=("single_hop", "multi_hop"))
    greedy = cfg.eval.temperature <= 0
    want, want_trajs = _reference(graphdef, state, tok, tasks, cfg, env, greedy=greedy)
    got = evaluate_policy(graphdef, state, tok, tasks, cfg, env)
    assert got == want  # exact float equality, every key
    # The runner's trajectories themselves, token by token and log-prob by log-prob.
    samples = 1 if greedy else 2
    rc = rollout_config(cfg, max_turns=cfg.eval.max_turns)
    sampling = SamplingParams(greedy=True) if greedy else SamplingParams(temperature=1.0, top_k=20)
    per_task, _ = run_batches(
        lambda chunk, g, seed: ModelPolicy(graphdef, state, tok, sampling=sampling, config=rc, seed=seed),
        env, tasks, tokenizer=tok, config=rc, group_size=samples, batch_size=cfg.eval.batch_size, seed=cfg.seed)
    trajs = [t for group in per_task for t in group]
    assert len(trajs) == len(want_trajs) == 4 * samples
    for a, b in zip(trajs, want_trajs):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.old_logprobs, b.old_logprobs)
        assert a.metrics == b.metrics
    if not greedy:  # the samples of a task differ: sampling really happened
        assert any(not np.array_equal(per_task[i][0].tokens, per_task[i][1].tokens) for i in range(4))


def test_cli_reproduces_the_runs_heldout_evaluation_from_the_run_folder(tok, env, tmp_path, capsys):
    from turnsight_jax.checkpointing import Checkpointer, write_run_config, write_run_files

    cfg = _cfg("data.num_eval=4", "seed=3", "eval.temperature=1.0", "eval.top_k=20", "eval.samples=2",
               "eval.batch_size=4")
    model = init_model(get_preset("tiny"), seed=9, options=runtime_options(cfg))
    graphdef, params = nnx.split(model)
    run = tmp_path / "run"
    # What train.py writes into its workdir: run files, the resolved config, an orbax step.
    write_run_files(run, model.config, default_tokenizer_dir())
    write_run_config(run, cfg)
    ckpt = Checkpointer(run)
    ckpt.save(2, params, {"count": np.zeros((), np.int32)}, {"next_step": 2})
    ckpt.close()

    want = evaluate_policy(graphdef, params, tok, sources.load_tasks(cfg, "eval"), cfg, env)
    out = tmp_path / "out"
    code = evaluate.main([str(a) for a in ["--checkpoint", run, "--benchmarks", "builtin", "--temperature", 1,
                                           "--top-k", 20, "--samples", 2, "--workers", 1, "--out", out]])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    results = json.loads((out / "results.json").read_text())
    assert results["heldout"] == want
    assert want["n"] == 4 and want["mode"] == "2 samples at temperature 1, top-k 20"
    assert "Decoding: 2 samples at temperature 1, top-k 20." in stdout
    assert f"FTRL Avg {want['ftrl']['avg']:.4f}" in stdout
    assert f"task-mean Solve-F1 {want['task_mean_solve_f1']:.4f}" in stdout
    assert results["benchmarks"]["builtin"]["score"] == want["ftrl"]["avg"]  # the table's Avg is summary.json's
    assert results["settings"]["seed"] == 3 and results["settings"]["batch_size"] == 4
    assert "4/4" not in err and "8/8 episodes (100.0%)" in err  # the progress line, 4 tasks x 2 samples
    examples = [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]
    assert [e["task_id"] for e in examples] == [t.task_id for t in sources.load_tasks(cfg, "eval")]
    assert all(len(e["samples"]) == 2 for e in examples)
    # The run's Hugging Face export (train.export: it carries the run's config) evaluated with
    # --hf: the same settings, the same held-out tasks, the same numbers; so is any folder with
    # --run naming the run; the header comes before the decoding.
    from turnsight_jax.train import export

    export(graphdef, params, run / "export", default_tokenizer_dir(), cfg)
    flags = ["--benchmarks", "builtin", "--temperature", 1, "--top-k", 20, "--samples", 2, "--workers", 1]
    code = evaluate.main([str(a) for a in ["--hf", run / "export", *flags, "--out", tmp_path / "out_hf"]])
    stdout_hf, err_hf = capsys.readouterr()
    assert code == 0, err_hf
    assert json.loads((tmp_path / "out_hf" / "results.json").read_text())["heldout"] == want
    assert err_hf.index("on its run's held-out tasks, with the run's rollout settings") < err_hf.index("8/8 episodes")
    (run / "export" / "turnsight_run.json").unlink()
    code = evaluate.main([str(a) for a in ["--hf", run / "export", "--run", run, *flags, "--out", tmp_path / "out_run"]])
    assert code == 0, capsys.readouterr().err
    assert json.loads((tmp_path / "out_run" / "results.json").read_text())["heldout"] == want
    code = evaluate.main([str(a) for a in ["--hf", run / "export", "--run", run, "--benchmarks", "builtin",
                                           "--builtin-per-category", 1, "--limit", 1, "--workers", 1, "--max-turns", 1,
                                           "--max-response-tokens", 8, "--no-thinking"]])
    assert code == 0 and "warning: --builtin-per-category / --builtin-seed: the generic built-in suite, not the " \
        "task family this model's run trained on" in capsys.readouterr().err
    # Every sampled trajectory the CLI wrote is the one the training-time loop decodes.
    rc = rollout_config(cfg, max_turns=cfg.eval.max_turns)
    sampling = SamplingParams(temperature=1.0, top_k=20)
    per_task, _ = run_batches(
        lambda chunk, g, seed: ModelPolicy(graphdef, params, tok, sampling=sampling, config=rc, seed=seed),
        env, sources.load_tasks(cfg, "eval"), tokenizer=tok, config=rc, group_size=2, batch_size=4, seed=3)
    assert [[s["text"] for s in e["samples"]] for e in examples] == \
        [[tok.decode(t.tokens.tolist(), skip_special_tokens=False) for t in group] for group in per_task]

    # The greedy figure of the same run (train.py's "greedy" entry) through the same flags' defaults.
    want_greedy = evaluate_policy(graphdef, params, tok, sources.load_tasks(cfg, "eval"), cfg, env, greedy=True)
    code = evaluate.main([str(a) for a in ["--checkpoint", run, "--benchmarks", "builtin", "--workers", 1,
                                           "--quiet", "--out", tmp_path / "greedy"]])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads((tmp_path / "greedy" / "results.json").read_text())["heldout"] == want_greedy
    assert "Decoding: greedy." in stdout and "episodes" not in err  # --quiet


def test_rollout_progress_callback_sees_increasing_finished_counts(tok, env):
    tasks = generate_tasks(4, seed=2, categories=("single_hop", "multi_hop"))
    scripts = [["<answer>nobody</answer>"]] + [gold_turn_texts(t) for t in tasks[1:]]
    seen: list[RolloutProgress] = []
    rollout(ReplayPolicy(tok, scripts), env, tasks, tokenizer=tok, group_size=1,
            config=RolloutConfig(max_turns=8, max_prompt_tokens=2048, max_response_tokens=2048,
                                 max_turn_tokens=256), progress=seen.append)
    finished = [p.finished for p in seen]
    assert finished == sorted(finished) and finished[0] < finished[-1] == 4
    assert finished[0] >= 1  # the one-turn script ends at turn 1
    assert [p.turn for p in seen[:-1]] == list(range(1, len(seen)))
    assert seen[-1].done and not any(p.done for p in seen[:-1]) and seen[-1].total == 4
    tokens = [p.tokens for p in seen]
    assert tokens == sorted(tokens) and tokens[-1] > 0


def test_progress_line_prints_at_most_every_few_seconds_and_at_the_end():
    now = [0.0]
    stream = io.StringIO()
    line = ProgressLine(6, label="builtin", stream=stream, every_s=5.0, clock_fn=lambda: now[0])
    for t, p in [(0.5, RolloutProgress(1, 4, 1, 40, 0.5)), (2.0, RolloutProgress(2, 4, 2, 80, 2.0)),
                 (6.0, RolloutProgress(4, 4, 3, 120, 6.0, done=True)), (7.0, RolloutProgress(1, 2, 1, 10, 1.0)),
                 (8.0, RolloutProgress(2, 2, 2, 20, 2.0, done=True))]:
        now[0] = t
        line(p)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3  # t=0.5 (first), t=6 (5 s later), t=8 (the last episode)
    assert lines[0].startswith("[builtin] 1/6 episodes (16.7%), turn 1, 80 decode tok/s")
    assert lines[-1].startswith("[builtin] 6/6 episodes (100.0%), turn 2, 18 decode tok/s, elapsed 0:08, ETA 0:00")
    # the final line is not repeated when the throttled update has just printed the same count
    stream = io.StringIO()
    now[0] = 0.0
    line = ProgressLine(2, stream=stream, every_s=5.0, clock_fn=lambda: now[0])
    for t, p in [(1.0, RolloutProgress(2, 2, 3, 30, 1.0)), (1.5, RolloutProgress(2, 2, 3, 30, 1.5, done=True))]:
        now[0] = t
        line(p)
    assert len(stream.getvalue().splitlines()) == 1
    # patient (training rollouts): nothing before every_s, no final line; a short rollout is silent
    stream = io.StringIO()
    now[0] = 0.0
    line = ProgressLine(4, stream=stream, every_s=5.0, patient=True, clock_fn=lambda: now[0])
    for t, p in [(1.0, RolloutProgress(1, 4, 1, 40, 1.0)), (4.0, RolloutProgress(4, 4, 2, 80, 4.0, done=True))]:
        now[0] = t
        line(p)
    assert stream.getvalue() == ""
    now[0] = 0.0
    line = ProgressLine(4, stream=stream, every_s=5.0, patient=True, clock_fn=lambda: now[0])
    for t, p in [(6.0, RolloutProgress(1, 4, 1, 40, 6.0)), (7.0, RolloutProgress(4, 4, 2, 80, 7.0, done=True))]:
        now[0] = t
        line(p)
    assert stream.getvalue().splitlines() == ["1/4 episodes (25.0%), turn 1, 7 decode tok/s, elapsed 0:06, ETA 0:18"]


def test_sampled_evaluation_averages_each_tasks_samples(monkeypatch):
    """evaluate_policy at temperature > 0: `samples` rollouts per task (in task-major groups, as
    the rollout driver returns them), per-task metrics = the mean over that task's samples, the
    same seed for every call (before/after evaluations share random numbers)."""
    import types

    cfg = default_config()
    cfg.eval.samples = 3
    cfg.eval.batch_size = 6  # two tasks per rollout call
    cfg.eval.top_k = 0  # unfiltered first (the default's top-k 20 is checked below)
    f1 = np.array([[1.0, 0.0, 0.5], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.25, 0.5, 0.0], [1.0, 0.0, 0.0]])
    calls = []

    def fake_rollout(policy, env, tasks, *, tokenizer, group_size, config, seed, **kw):
        calls.append((tuple(t for t in tasks), group_size, policy.sampling, policy.seed, seed))
        trajs = [types.SimpleNamespace(metrics={"solve_f1": f1[t][k], "num_turns": 1.0 + k, "note": "x"})
                 for t in tasks for k in range(group_size)]
        return types.SimpleNamespace(trajectories=trajs, stats={})

    from turnsight_jax.eval import runner

    monkeypatch.setattr(runner, "rollout", fake_rollout)
    monkeypatch.setattr(heldout, "ModelPolicy", lambda *a, sampling, seed, **k: types.SimpleNamespace(
        sampling=sampling, seed=seed))
    tasks = list(range(5))  # the fake rollout indexes f1 by task
    out = heldout.evaluate_policy(None, None, None, tasks, cfg, None)
    assert out["mode"] == "3 samples at temperature 1" and out["n"] == 5
    np.testing.assert_allclose(out["per_task_solve_f1"], f1.mean(1))
    np.testing.assert_allclose(out["task_mean_solve_f1"], f1.mean())
    np.testing.assert_allclose(out["task_mean_solve_f1_se"], f1.mean(1).std(ddof=1) / np.sqrt(5))
    np.testing.assert_allclose(out["task_mean_num_turns"], 2.0)  # mean of 1, 2, 3
    # these fake tasks have no category: one "uncategorised" category, so the category average is the task mean
    assert list(out["ftrl"]["categories"]) == ["uncategorised"]
    np.testing.assert_allclose(out["ftrl"]["average"]["solve_f1"], f1.mean())
    assert [c[0] for c in calls] == [(0, 1), (2, 3), (4,)] and {c[1] for c in calls} == {3}
    assert {c[2].temperature for c in calls} == {1.0} and not calls[0][2].greedy
    first = list(calls)
    calls.clear()
    heldout.evaluate_policy(None, None, None, tasks, cfg, None)
    assert [c[3:] for c in calls] == [c[3:] for c in first]  # same seeds on every evaluation

    calls.clear()
    greedy = heldout.evaluate_policy(None, None, None, tasks, cfg, None, greedy=True)
    assert greedy["mode"] == "greedy" and {c[1] for c in calls} == {1} and calls[0][2].greedy
    np.testing.assert_allclose(greedy["per_task_solve_f1"], f1[:, 0])

    calls.clear()  # the sampling filters reach the sampler and are named in the mode
    cfg.eval.top_k, cfg.eval.top_p = 20, 0.9
    filtered = heldout.evaluate_policy(None, None, None, tasks, cfg, None)
    assert filtered["mode"] == "3 samples at temperature 1, top-k 20, top-p 0.9"
    assert {(c[2].top_k, c[2].top_p) for c in calls} == {(20, 0.9)}
    cfg.eval.temperature = 0.0
    assert heldout.evaluate_policy(None, None, None, tasks, cfg, None)["mode"] == "greedy"
