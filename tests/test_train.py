"""`python -m turnsight_jax.train`: bad inputs, SIGTERM + resume, checkpoint validity, HF export."""

from __future__ import annotations

import json
import re
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import SUBPROCESS_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[1]

# A run small enough for CI: random tiny model (no warm-start), 2 prompts x 2 rollouts, 2 turns.
FAST = [
    "--config", str(REPO / "tests/configs/tiny_random.py"), "--config.sft.steps=0", "--config.sft.curriculum_steps=0", "--config.data.num_eval=0", "--config.train.steps=4",
    "--config.train.prompts_per_step=2", "--config.train.group_size=2", "--config.rollout.max_turns=2",
    "--config.rollout.max_turn_tokens=12", "--config.rollout.max_response_tokens=64",
    "--config.checkpoint.every=0", "--config.log.tensorboard=False", "--config.model.attn_q_chunk=128",
    "--config.rollout.prompts_per_chunk=1",  # exercise chunked rollouts
    "--config.log.records_every=2",  # trajectory records of steps 1 and 3 (0-based)
]


def _run(args, workdir, extra_env=None, **kw):
    env = dict(os.environ, **(extra_env or {}))
    env["XLA_FLAGS"] = SUBPROCESS_XLA_FLAGS  # one CPU device, as a user's laptop (tests/conftest.py)
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen([sys.executable, "-m", "turnsight_jax.train", "--workdir", str(workdir), *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _records(workdir):
    out = {}
    for line in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = {k: v for k, v in rec.items() if not k.startswith("perf/")}
    return out


@pytest.mark.parametrize("args,message", [
    (["--config.data.source=ftrl", "--config.data.path=/nonexistent/ftrl.jsonl"], "/nonexistent/ftrl.jsonl"),
    (["--config.rl.lamda=0.3"], "unknown config key 'rl.lamda'; did you mean rl.lam"),
    (["SMALL_VOCAB_MODEL"], "tokenizer .* does not fit the model"),
    (["--config.train.micro_batches=3"], "must split into 1 mini-batches of 3 equal micro-batches"),
    (["--config.mesh.fsdp=3"], r"mesh data=1 x fsdp=3 x tensor=1 does not divide \d+ devices"),
    (["--config.rl.eps_w=1.0"], "eps_w must be in"),
    (["--config.eval.top_p=0"], r"eval: top_p must be in \(0, 1\], got 0"),
    (["--config.optim.lr=1e999"], "optim.lr must be finite and > 0"),
    (["--config.rl.method=dpo"], "unknown rl.method 'dpo'; registered methods"),
    (["--config.rl.method=ppo", "--config.critic.value_clip=-1"], r"critic.value_clip must be None \(off\) or a number > 0"),
    (["--config.rl.method=ppo", "--config.gae.lam=1.5"], r"gae.lam must be in \[0, 1\], got 1.5"),
    (["--config.checkpoint.keep=0"], r"checkpoint.keep must be >= 1 \(0 would delete every save\), got 0"),
    (["--config.train.max_skipped_steps=0"], "train.max_skipped_steps must be >= 1, got 0"),
    (["--config.model.vocab_block=-1"], r"model.vocab_block must be >= 0 \(vocab_block 0: the whole vocabulary"),
    (["--config.model.attn_row_group=-2"], r"model.attn_row_group must be >= 0 .*got -2"),
    (["--config.model.attn_row_group=0", "--config.model.attn_key_block=64"],
     r"model.attn_key_block=64 needs model.attn_row_group > 0"),
    (["--config.log.wandb=True", "--config.log.wandb_mode=cloud"],
     r"log.wandb_mode must be 'online' or 'offline', got 'cloud'"),
])
def test_bad_inputs_fail_before_training(tmp_path, capsys, args, message):
    """In-process `train.main`: exit code 2, one `error:` line naming the problem, run folder untouched."""
    from turnsight_jax import train

    if args == ["SMALL_VOCAB_MODEL"]:  # a Qwen3 whose embedding has fewer rows than the tokenizer
        from turnsight_jax.models.config import Qwen3Config
        from turnsight_jax.models.qwen3 import init_model
        from turnsight_jax.models.weights import save_pretrained

        save_pretrained(init_model(Qwen3Config(vocab_size=1000, hidden_size=16, intermediate_size=32, num_layers=1,
                                               num_heads=1, num_kv_heads=1, head_dim=16)), tmp_path / "small")
        args = [f"--config.model.hf_path={tmp_path / 'small'}"]
    code = train.main(FAST + args + ["--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and __import__("re").search(message, last), last
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing touched


def test_a_workdir_that_is_a_file_is_one_line(tmp_path, capsys):
    from turnsight_jax import train

    (tmp_path / "run").write_text("notes")
    code = train.main(FAST + ["--workdir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"error: --workdir {tmp_path / 'run'} is a file, not a run folder: name a new " \
                                        f"or existing folder", err[-2000:]
    assert (tmp_path / "run").read_text() == "notes"


def test_the_cli_exits_2_on_a_config_error(tmp_path):
    """The same through a real `python -m turnsight_jax.train` process (exit status, stderr)."""
    proc = _run(FAST + ["--config.rl.lamda=0.3"], tmp_path / "run")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.strip().splitlines()[-1].startswith("error: unknown config key"), err[-2000:]


def test_dataset_row_missing_field_names_row(tmp_path):
    tool = {"type": "function", "function": {"name": "t", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    row = {"messages": [{"role": "user", "content": "q"}], "tools": json.dumps([tool]),
           "codes": json.dumps({"t": "def t():\n    return 'x'\n"}), "unsolved_set": json.dumps({"t": ["x"]}),
           "data_source": "self/single_hop"}  # no "answer"
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({**row, "answer": "a"}) + "\n" + json.dumps(row) + "\n")
    proc = _run(FAST + ["--config.data.source=ftrl", f"--config.data.path={path}"], tmp_path / "run")
    _, err = proc.communicate(timeout=300)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 2 and "answer" in last and ("row 1" in last or "line 2" in last), last
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path):
    """NaN injected into RL steps 2 and 3 (of 3; TURNSIGHT_FAULT_NAN_STEPS counts from 0): step 2's update is
    skipped and logged, so the checkpoint written after it holds exactly the parameters of step 1
    (tests/test_rl_step.py checks the optimizer state); step 3 is skipped too, and with train.max_skipped_steps=2 the run
    stops there with exit 1, naming the step, and writes no checkpoint of it."""
    import jax
    from flax import nnx

    from turnsight_jax.checkpointing import load_policy_from_run

    env = {"TURNSIGHT_FAULT_NAN_STEPS": "1,2"}
    proc = _run(FAST + ["--config.train.steps=3", "--config.checkpoint.every=1", "--config.train.max_skipped_steps=2"],
                tmp_path / "run", extra_env=env)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-3000:]
    assert "step 2: non-finite loss or gradient, 1 update(s) skipped" in err, err[-3000:]
    assert "step 3: non-finite loss or gradient, 1 update(s) skipped" in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: 2 steps in a row (to step 3)") and "last checkpoint (2) intact" in last, last
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_updates"] for r in recs] == [0.0, 1.0, 1.0]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["1", "2"]
    before, _, _ = load_policy_from_run(tmp_path / "run", step=1)
    after, _, _ = load_policy_from_run(tmp_path / "run", step=2)
    leaves = zip(jax.tree.leaves(nnx.state(before)), jax.tree.leaves(nnx.state(after)))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) and np.isfinite(np.asarray(b)).all() for a, b in leaves)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    proc = _run(FAST, workdir)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return workdir


# The chaos run (tests/configs/chaos.py): scripted turns whose tools crash, hang, segfault, forge
# replies and return garbage at random, in the real sandbox; a checkpoint every step.
CHAOS = [
    "--config", str(REPO / "tests/configs/chaos.py"), "--config.sft.steps=0", "--config.sft.curriculum_steps=0",
    "--config.data.num_eval=0", "--config.train.steps=3", "--config.train.prompts_per_step=2",
    "--config.train.group_size=2", "--config.rollout.max_turns=3", "--config.rollout.max_turn_tokens=48",
    "--config.rollout.max_response_tokens=256", "--config.checkpoint.every=1", "--config.log.tensorboard=False",
    "--config.model.attn_q_chunk=128", "--config.checkpoint.export_at_end=False",
    "--config.train.shapes=batch",  # the shapes used so far are saved and restored with each checkpoint
]


def test_chaos_sigterm_then_sigkill_in_a_checkpoint_write_then_resume(tmp_path):
    """Hostile tools all along; Ctrl-C and SIGTERM (graceful stop with a checkpoint), then a resumed run
    SIGKILLed while writing its next checkpoint (every file written, not yet verified), then a
    second resume: it finishes, keeps every finished step, skips the unverified one saying why,
    and logs the same numbers as an uninterrupted run from the last finished step on."""
    from turnsight_jax.checkpointing import check_step, step_folders

    reference = _run(CHAOS, tmp_path / "reference")
    workdir = tmp_path / "chaos"
    proc = _run(CHAOS, workdir)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 1:
            # real signals while step 2 runs (or just after step 1): Ctrl-C, then a preemption
            proc.send_signal(signal.SIGINT)
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.1)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "received SIGINT: checkpointing after this step, then exiting; press Ctrl-C again" in err, err[-3000:]
    assert "received SIGTERM: checkpointing after this step, then exiting" in err, err[-3000:]
    stopped = max(_records(workdir))  # 0-based; checkpoint `stopped + 1` holds it
    assert 0 <= stopped < 2, stopped
    killed_step = stopped + 2  # the next save: one more step, then SIGKILL before its manifest
    proc = _run(CHAOS, workdir, extra_env={"TURNSIGHT_FAULT_KILL_BEFORE_MANIFEST": str(killed_step)})
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, err[-3000:])
    assert check_step(step_folders(workdir)[killed_step]) == "no turnsight_manifest.json (the save did not finish)"
    proc = _run(CHAOS, workdir)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert (f"resume: skipping checkpoint step {killed_step}: no turnsight_manifest.json (the save did not "
            f"finish) (moved to invalid-{killed_step}-0)") in err, err[-3000:]
    assert f"resumed from {workdir}/checkpoints/{killed_step - 1} (next step {killed_step - 1})" in err
    _, ref_err = reference.communicate(timeout=900)
    assert reference.returncode == 0, ref_err[-3000:]
    full, resumed = _records(reference_dir := tmp_path / "reference"), _records(workdir)
    assert sorted(resumed) == list(range(3))
    for step in range(killed_step - 1, 3):  # what the last process ran, from the last finished step
        assert resumed[step] == full[step], step
    assert max(full[s]["rollout/tool_error_rate"] for s in full) > 0  # the hostile tools did run
    folders = step_folders(workdir)
    keep = json.loads((workdir / "config.json").read_text())["checkpoint"]["keep"]
    assert sorted(folders) == list(range(max(1, 4 - keep), 4))  # the newest `keep` finished steps, all there
    assert all(check_step(f) is None for f in folders.values()), {s: check_step(f) for s, f in folders.items()}
    assert (workdir / "checkpoints" / f"invalid-{killed_step}-0").is_dir() and reference_dir.is_dir()


def test_ctrl_c_and_sigterm_ask_for_a_checkpoint_and_a_second_ctrl_c_stops_now(capsys):
    """The trainer's handler (train._Preemption), with real signals to this process: SIGINT and
    SIGTERM each set the stop flag with one line; a second SIGINT raises KeyboardInterrupt (main
    turns it into one line and exit 130); restore() puts the previous handlers back."""
    from turnsight_jax.train import _Preemption

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for first in (signal.SIGTERM, signal.SIGINT):
        preempt = _Preemption()
        try:
            os.kill(os.getpid(), first)
            time.sleep(0.01)  # the handler runs between bytecodes of this thread
            assert preempt.requested
            assert f"received {first.name}: checkpointing after this step" in capsys.readouterr().err
            with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.01)
        finally:
            preempt.restore()
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_arriving_inside_a_write_to_the_teed_stderr_never_ends_the_run(tmp_path):
    """A signal handler runs between two bytecodes of whatever the main thread does, a write to
    stderr included (a progress line, or the message of a signal a moment earlier: CI's chaos run
    got SIGINT then SIGTERM and died of "reentrant call inside BufferedWriter"). Here the run log's
    console raises SIGTERM in the middle of a write: the write completes, the flag is set, the
    message and the line reach the console and the log once each; a SIGINT in the next write is
    the second signal (stop now), raised as KeyboardInterrupt, not as a stream error."""
    import io

    from turnsight_jax.runlog import ConsoleLog
    from turnsight_jax.train import _Preemption

    class SignalsMidWrite(io.RawIOBase):  # the console: a real descriptor whose writes are interrupted
        def __init__(self, fd, signals):
            self.fd, self.signals = fd, list(signals)

        def writable(self):
            return True

        def fileno(self):
            return self.fd

        def write(self, b):
            if self.signals:
                os.kill(os.getpid(), self.signals.pop(0))
                time.sleep(0.01)  # the handler runs here, with the buffered stream's lock held
            return os.write(self.fd, b)

    console_path = tmp_path / "console.txt"
    fd = os.open(console_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    raw = SignalsMidWrite(fd, [signal.SIGTERM, signal.SIGINT])
    console = io.TextIOWrapper(io.BufferedWriter(raw), write_through=True)
    saved, sys.stderr = sys.stderr, console
    logger = ConsoleLog()
    preempt = _Preemption()
    try:
        logger.start(tmp_path / "train.log")
        print("[####] step 1/3 | reward 0.25", file=sys.stderr, flush=True)
        assert preempt.requested
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):  # the SIGINT after SIGTERM: stop now
            print("step 2", file=sys.stderr, flush=True)
    finally:
        raw.signals.clear()  # none left for the default handlers
        preempt.restore()
        logger.stop()
        sys.stderr = saved
        console.close()
    shown, logged = console_path.read_text(), (tmp_path / "train.log").read_text()
    for text in (shown, logged):
        assert text.count("received SIGTERM: checkpointing after this step, then exiting\n") == 1, text
        assert text.count("[####] step 1/3 | reward 0.25\n") == 1, text


def test_the_step_compiles_once_per_batch_geometry(uninterrupted):
    """The updated parameters keep their shardings (make_train_step's state_shardings), so the
    step and the rollout programs are not compiled again on the second step: the step's compiled
    programs equal the distinct batch geometries the run met."""
    recs = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    geometries = {tuple(v for k, v in sorted(r.items()) if k.startswith("shape/")) for r in recs}
    assert recs[-1]["perf/step_compilations"] == len(geometries), [r["perf/step_compilations"] for r in recs]


def test_a_changed_config_never_silently_continues_a_run(uninterrupted, tmp_path, capsys):
    """Re-running into a finished run (turnsight_jax.provenance): a result-changing key exits 2
    naming it and leaves every file of the run byte-identical; a harmless change (more steps, other
    logging) resumes and is recorded in config_history.jsonl; --allow-config-change continues under
    a result-changing key and records that it was allowed."""
    from turnsight_jax import train

    run = shutil.copytree(uninterrupted, tmp_path / "run")

    def files():
        return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
                if p.is_file() and p.name != "turnsight.lock"}

    before = files()
    stored = json.loads(before["config.json"])
    assert stored["rl"]["method"] != "grpo" and any(k.startswith("export/") for k in before)
    code = train.main(FAST + ["--workdir", str(run), "--config.rl.method=grpo", "--config.rl.lam=0.25"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and last.startswith(f"error: {run} holds a run with another config"), last
    assert f'rl.method: "{stored["rl"]["method"]}" -> "grpo"' in last and "rl.lam:" in last, last
    assert "--allow-config-change" in last and "train.steps" not in last
    assert files() == before  # config.json, metrics, checkpoints, export: nothing rewritten

    proc = _run(FAST + ["--config.train.steps=5", "--config.log.records_every=1"], run)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in err and "(next step 4)" in err and "config changed since this run's last start" in err
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert len(history) == 1 and history[0]["allowed_by"] == "harmless" and history[0]["result_changing"] == []
    assert history[0]["changed"] == {"log.records_every": [2, 1], "train.steps": [4, 5]}
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 5
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3, 4]
    assert lines[:4] == before["metrics.jsonl"].decode().splitlines()  # the earlier steps' record kept

    # allowed: the finished run (5 of 5 steps) under another lambda; recorded as allowed
    code = train.main(FAST + ["--workdir", str(run), "--config.train.steps=5", "--config.log.records_every=1",
                              "--config.rl.lam=0.25", "--allow-config-change"])
    assert code == 0, capsys.readouterr().err[-3000:]
    history = [json.loads(line) for line in (run / "config_history.jsonl").read_text().splitlines()]
    assert history[1]["allowed_by"] == "--allow-config-change" and history[1]["result_changing"] == ["rl.lam"]
    # (this process has 8 devices: the row groups are fitted off, a layout key, harmless)
    assert history[1]["changed"]["rl.lam"] == [stored["rl"]["lam"], 0.25]
    assert json.loads((run / "config.json").read_text())["rl"]["lam"] == 0.25


def test_harmless_keys_are_the_ones_that_leave_every_step_as_it_was():
    from turnsight_jax.provenance import config_changes, harmless

    new = {"optim": {"schedule": "constant"}, "train": {"steps": 9, "group_size": 4}, "log": {"progress": False},
           "mesh": {"data": 2}, "name": "x", "rl": {"lam": 0.5, "new_key": 1}}
    old = {"optim": {"schedule": "constant"}, "train": {"steps": 3, "group_size": 8}, "log": {"progress": True},
           "mesh": {"data": 1}, "name": "y", "rl": {"lam": 0.5, "gone": 2}}
    changed, added = config_changes(old, new)
    assert set(changed) == {"train.steps", "train.group_size", "log.progress", "mesh.data", "name", "rl.gone"}
    assert harmless("train.micro_batches", {}) and not harmless("train.mini_batches", {})  # accumulation vs more updates
    assert added == ["rl.new_key"] and changed["rl.gone"] == (2, None)
    flat = {"optim.schedule": "constant"}
    assert [k for k in sorted(changed) if not harmless(k, flat)] == ["rl.gone", "train.group_size"]
    # a cosine schedule decays over train.steps: more steps change every later step's learning rate
    assert not harmless("train.steps", {"optim.schedule": "cosine"})


def test_unfinished_checkpoint_is_never_loaded(uninterrupted, tmp_path):
    import shutil

    from turnsight_jax.checkpointing import Checkpointer, latest_valid_step

    work = tmp_path / "copy"
    shutil.copytree(uninterrupted, work)
    # a write cut short: orbax's temporary folder for step 9, half written
    partial = work / "checkpoints" / "9.orbax-checkpoint-tmp-1234567"
    shutil.copytree(work / "checkpoints" / "4", partial)
    (partial / "params" / "_METADATA").unlink(missing_ok=True)
    assert latest_valid_step(work) == (4, [])
    ckpt = Checkpointer(work)
    assert ckpt.latest_step() == 4
    ckpt.close()


def _corrupt(step_dir: pathlib.Path, kind: str) -> str:
    """Damages a copied step in one of the four ways; returns the reason check_step must give."""
    import shutil

    biggest = max((p for p in (step_dir / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    rel = str(biggest.relative_to(step_dir))
    size = biggest.stat().st_size
    if kind == "truncated":
        with open(biggest, "r+b") as fh:
            fh.truncate(size // 2)
        return f"{rel}: {size // 2} bytes, expected {size} (truncated or replaced)"
    if kind == "flipped":
        data = bytearray(biggest.read_bytes())
        data[size // 2] ^= 0xFF
        biggest.write_bytes(bytes(data))
        return f"{rel}: checksum mismatch (corrupt bytes)"
    if kind == "no_metadata":
        (step_dir / "_CHECKPOINT_METADATA").unlink()
        return "missing file _CHECKPOINT_METADATA"
    shutil.rmtree(step_dir)
    step_dir.mkdir()
    return "empty folder"


@pytest.mark.parametrize("kind", ["truncated", "flipped", "no_metadata", "empty"])
def test_a_corrupt_latest_checkpoint_is_skipped_by_evaluate_and_resume(uninterrupted, tmp_path, kind, capsys):
    """A copy of the run's valid step 4 as step 5, then damaged: evaluate's loader and resume both
    fall back to step 4 and say why; resume moves step 5 aside; with no valid step left, one error."""
    import shutil

    from turnsight_jax import checkpointing
    from turnsight_jax.errors import CheckpointError

    work = tmp_path / "copy"
    shutil.copytree(uninterrupted, work, ignore=shutil.ignore_patterns("export"))
    shutil.copytree(work / "checkpoints" / "4", work / "checkpoints" / "5")
    reason = _corrupt(work / "checkpoints" / "5", kind)
    assert checkpointing.check_step(work / "checkpoints" / "5") == reason
    _, _, step = checkpointing.load_policy_from_run(work)
    assert step == 4
    err = capsys.readouterr().err
    assert f"skipping checkpoint step 5: {reason}" in err and "using checkpoint step 4" in err, err
    with pytest.raises(CheckpointError, match=f"checkpoint step 5 is not valid: {re.escape(reason)}"):
        checkpointing.load_policy_from_run(work, step=5)
    logged = []
    assert checkpointing.resume_step(work, logged.append) == 4
    assert logged == [f"resume: skipping checkpoint step 5: {reason} (moved to invalid-5-0)"]
    assert (work / "checkpoints" / "invalid-5-0").is_dir() and not (work / "checkpoints" / "5").exists()
    _corrupt(work / "checkpoints" / "4", kind)
    with pytest.raises(CheckpointError, match=r"no valid checkpoint \(step 4: "):
        checkpointing.resume_step(work, logged.append)
    with pytest.raises(CheckpointError, match=r"no valid checkpoint \(step 4: "):
        checkpointing.load_policy_from_run(work)


def test_exported_folder_loads_in_transformers(uninterrupted):
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from turnsight_jax.checkpointing import load_policy_from_run

    export = uninterrupted / "export"
    hf = Qwen3ForCausalLM.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok.encode("<tool_call>\n{\"name\": \"get_home\"}\n</tool_call>")
    ours, _, step = load_policy_from_run(uninterrupted)
    assert step == 4
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits.numpy()
    assert np.abs(np.asarray(ours(jnp.asarray([ids]))) - ref).max() < 1e-4


def test_any_checkpoint_exports_as_the_run_does(uninterrupted, tmp_path, capsys):
    """python -m turnsight_jax.export RUN --step N: the same Hugging Face folder as the trainer's
    end-of-run export of that step (weights, config, tokenizer, the run's config); a step that
    does not exist and an occupied --out are one line, exit 2."""
    from turnsight_jax import export

    step = max(int(p.name) for p in (uninterrupted / "checkpoints").iterdir() if p.name.isdigit())
    assert export.main([str(uninterrupted), "--step", str(step), "--out", str(tmp_path / "e")]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "turnsight_run.json"):
        assert (tmp_path / "e" / name).read_bytes() == (uninterrupted / "export" / name).read_bytes(), name
    assert export.main([str(uninterrupted), "--step", "99", "--out", str(tmp_path / "f")]) == 2
    assert export.main([str(uninterrupted), "--out", str(tmp_path / "e")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert err[0] == f"error: {uninterrupted}: no checkpoint for step 99; have [{step}]"
    assert err[1] == f"error: {tmp_path / 'e'} exists and is not empty: pass another --out"


def test_the_console_is_kept_in_the_run_folder(uninterrupted):
    log = (uninterrupted / "train.log").read_text()
    first = log.splitlines()[0]  # when and how it started: the command line
    assert first.startswith("--- ") and f"--workdir {uninterrupted}" in first, first
    assert "] step 4/4 |" in log and f"exported Hugging Face folder {uninterrupted / 'export'}" in log


def test_the_update_flops_are_logged(uninterrupted):
    """Every step logs the update's necessary and executed FLOPs (turnsight_jax.flops) and their
    ratio, the padding the step pays for; MFU counts the necessary work only."""
    recs = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        assert r["perf/update_flops_executed"] > r["perf/update_flops_necessary"] > 0
        assert r["perf/update_padding_ratio"] == pytest.approx(
            r["perf/update_flops_executed"] / r["perf/update_flops_necessary"])
        parts = {k: v for k, v in r.items() if k.startswith("perf/update_padding_ratio_")}
        assert "perf/update_padding_ratio_student" in parts and all(v >= 1.0 for v in parts.values()), parts


# The wall split every step logs (turnsight_jax.cost): measured parts, and the fused step's
# estimated ones (student forward+backward, teacher, optimizer) that add up to it.
WALL_SPLIT = ("perf/rollout_s", "perf/rollout_prefill_s", "perf/rollout_decode_s", "perf/tool_s", "perf/batch_s",
              "perf/step_fn_s", "perf/records_s", "perf/eval_s", "perf/checkpoint_s")
STEP_FN_PARTS = ("perf/step_fn_student_s_est", "perf/step_fn_teacher_s_est", "perf/step_fn_optimizer_s_est")


def test_every_step_logs_its_costs_and_records_are_written(uninterrupted):
    """Each step's metrics hold the wall split (the fused step's estimated parts summing to its
    measured time), the teacher's FLOPs, the tokens per view kind and the peak memory (the CPU
    backend has no device memory stats: that key is absent, the process's peak RSS is there); the
    final checkpoint's time is in the last step's line. Records are written every 2nd step, one
    file per step, and their depth histogram equals the step's metric."""
    from turnsight_jax import records

    recs = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    for r in recs:
        assert all(r[k] >= 0 for k in WALL_SPLIT), r
        assert r["perf/rollout_prefill_s"] + r["perf/rollout_decode_s"] <= r["perf/rollout_s"]
        assert sum(r[k] for k in STEP_FN_PARTS) == pytest.approx(r["perf/step_fn_s"], rel=1e-9)
        assert 0 < r["perf/step_fn_optimizer_s_est"] == r["perf/optimizer_probe_s"] < r["perf/step_fn_s"]
        assert 0 < r["perf/teacher_flops_necessary"] and 0 < r["perf/teacher_flops_share"] < 1
        assert r["perf/teacher_tokens_trajectory"] == r["perf/student_tokens"] > 0
        assert (r["perf/teacher_tokens_trajectory"] + r["perf/teacher_tokens_blocks"] + r["perf/teacher_tokens_turn_copies"]
                == pytest.approx(r["perf/view_overhead"] * r["perf/student_tokens"]))
        assert "perf/device_peak_gib" not in r and r["perf/host_rss_peak_gib"] > 0.1
    assert [r["perf/checkpoint_s"] > 0 for r in recs] == [False, False, False, True]
    files = records.run_record_files(uninterrupted)
    assert [p.name for p in files] == ["step_000001.jsonl.gz", "step_000003.jsonl.gz"]
    for path in files:
        header, trajs = records.read_records(path)
        assert header["trajectories"] == 4 and header["dropped"] == 0 and header["method"] == "turnsight"
        hist = [sum(t.get("depth") == d for tr in trajs for t in tr["turns"]) for d in header["depths"]]
        assert hist == recs[header["step"]]["turnsight/depth_histogram"]


def test_the_runs_viewer_in_a_real_browser(uninterrupted, tmp_path):
    """`python -m turnsight_jax.viewer RUN` on the trainer's own run folder, opened in headless
    Chromium: no console error, and the weight and chosen depth of three turns picked at random
    equal the records."""
    import random

    from _browser import Browser, find_browser
    from turnsight_jax import records

    proc = subprocess.run([sys.executable, "-m", "turnsight_jax.viewer", str(uninterrupted), "--out",
                           str(tmp_path / "viewer.html")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "2 steps, 8 trajectories" in proc.stdout, proc.stderr
    binary = find_browser()
    if binary is None:
        pytest.skip("no headless Chromium (apt-get install chromium-headless-shell; .ci/run installs it)")
    header, trajs = records.read_records(records.run_record_files(uninterrupted)[-1])
    turns = [(tr, t) for tr in trajs for t in tr["turns"]]
    with Browser(binary) as browser:
        browser.open((tmp_path / "viewer.html").as_uri())
        assert browser.eval("document.body.dataset.ready") == "1" and browser.errors == []
        assert browser.eval("window.viewer.state.step") == header["step"]
        for tr, t in random.Random(1).sample(turns, 3):
            sel = f"#turn-{header['step']}-{tr['row']}-{t['k']}"
            got = browser.eval(f"['weight', 'depth'].map(f => document.querySelector('{sel} "
                               f"[data-field=\"' + f + '\"]').dataset.value)")
            assert [float(v) for v in got] == [t["weight"], t["depth"]], sel
        assert browser.errors == []


def test_a_packed_run_equals_the_plain_run(uninterrupted, tmp_path):
    """train.pack_rows with rows wider than the batch's (several trajectories and hindsight rows
    per row): the run's every logged value (rollouts, rewards, losses, advantages, eval) equals
    the plain run's to float rounding; only the shapes and the padding it pays for differ."""
    proc = _run(FAST + ["--config.train.pack_rows=True", "--config.train.pack_width=2048", "--config.train.steps=2"],
                tmp_path)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    packed, plain = _records(tmp_path), _records(uninterrupted)
    assert sorted(packed) == sorted(plain)[:len(packed)] and len(packed) >= 2
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["shape/RT"] < 4 for r in recs if "shape/RT" in r) and any("shape/RT" in r for r in recs)
    for step, rec in packed.items():
        for key, value in rec.items():
            if key.startswith("shape/") or not isinstance(value, (int, float)):
                continue
            assert value == pytest.approx(plain[step][key], rel=1e-4, abs=1e-5), (step, key)
    # the records of step 1: the packed batch holds the rows in another order, yet each trajectory's
    # record pairs its own turns with its own numbers, as the plain run's
    from turnsight_jax import records

    def by_trajectory(run):
        _, trajs = records.read_records(records.records_path(run, 1))
        return sorted((tr["group"], [t["text"] for t in tr["turns"]], [[t[k] for k in ("adv", "weight", "depth",
                                                                                        "delta_star")] + t["delta"]
                                                                       for t in tr["turns"]]) for tr in trajs)

    for (g, texts, nums), (g2, texts2, nums2) in zip(by_trajectory(tmp_path), by_trajectory(uninterrupted), strict=True):
        assert (g, texts) == (g2, texts2)
        np.testing.assert_allclose(np.array(nums, float), np.array(nums2, float), rtol=1e-4, atol=1e-5)


def test_a_dry_run_whose_plan_does_not_fit_exits_1(tmp_path):
    """--dry-run prints the plan against the budget the allocator will give (plan.device_memory_gib
    x XLA_PYTHON_CLIENT_MEM_FRACTION, JAX's 0.75 when unset, less 5% headroom), the checkpoint size
    and the host RAM to load the weights, lists every input the run would refuse, and exits 1 when
    a peak is over the budget (a launch script can gate on it); the same plan within it exits 0."""
    args = ["--config", str(REPO / "tests/configs/tiny_random.py"), "--dry-run", "--config.train.prompts_per_step=2",
            "--config.train.group_size=2", "--config.rollout.max_response_tokens=64"]
    over = _run([*args, "--config.plan.device_memory_gib=0.001", "--config.data.source=ftrl",
                 "--config.data.path=/nonexistent/train.parquet", "--config.tokenizer_path=/nonexistent/tok"],
                tmp_path / "a", extra_env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    out, err = over.communicate(timeout=600)
    assert over.returncode == 1, err[-2000:]
    assert ("budget: 0.00 GiB per device = 0.001 GiB (plan.device_memory_gib) x 0.50 "
            "(XLA_PYTHON_CLIENT_MEM_FRACTION=0.5 of the card) - 5% headroom") in out, out[-3000:]
    assert "does NOT fit: peak" in out and "to fit: more train.micro_batches" in out
    assert "error: the train step plan does not fit the budget of 0.00 GiB per device" in err
    # every refused input in one line, before the error
    assert ("warning: on this machine the run would also refuse 2 input(s): data.path=/nonexistent/train.parquet: "
            "no such file; tokenizer_path=/nonexistent/tok: not a Hugging Face folder here") in err, err[-2000:]
    ok = _run(args, tmp_path / "b")
    out, err = ok.communicate(timeout=600)
    assert ok.returncode == 0 and "fits: peak" in out and "XLA_PYTHON_CLIENT_MEM_FRACTION unset: JAX's default 0.75" \
        in out, err[-2000:]
    ckpt = re.search(r"checkpoint: ([\d.]+) GiB per step \(params ([\d.]+), optimizer state ([\d.]+)\)", out)
    assert ckpt and float(ckpt[3]) == pytest.approx(2 * float(ckpt[2]), abs=0.011), out[-2000:]  # AdamW: mu and nu
    assert "host RAM to load the weights: about" in out and "warning:" not in err


def test_the_memory_budget_reads_the_launchers_allocator_settings():
    import ml_collections as mlc

    from turnsight_jax.rl.plan import memory_budget, missing_inputs

    cfg = mlc.ConfigDict({"plan": {"device_memory_gib": 80.0}})
    assert memory_budget(cfg, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.90"})[0] == pytest.approx(80 * 0.90 * 0.95)
    assert memory_budget(cfg, {})[0] == pytest.approx(80 * 0.75 * 0.95)
    assert memory_budget(cfg, {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"})[0] == pytest.approx(80 * 0.95)
    from turnsight_jax.config import default_config

    c = default_config()
    c.data.source, c.data.path, c.data.eval_source = "ftrl", "/nonexistent/a.parquet", "toolhop"
    c.model.hf_path, c.teacher.weights, c.teacher.checkpoint = "/nonexistent/qwen", "external", "/nonexistent/big"
    assert missing_inputs(c) == [
        "data.path=/nonexistent/a.parquet: no such file",
        "data.eval_path: not set (data.eval_source='toolhop' reads a file)",
        "model.hf_path=/nonexistent/qwen: not a Hugging Face folder here (no config.json)",
        "teacher.checkpoint=/nonexistent/big: not a Hugging Face folder here (no config.json)"]


def test_checkpointer_saves_and_restores_the_optional_items(tmp_path):
    """The EMA teacher and PPO's critic are items of their own next to params / opt_state / meta
    (orbax refuses an undeclared item: before, a teacher.weights=ema run failed at its first
    save); a step saved without them restores None for them."""
    import jax.numpy as jnp

    from turnsight_jax.checkpointing import Checkpointer

    ckpt = Checkpointer(tmp_path)
    p = {"embed": jnp.arange(6.0).reshape(2, 3)}
    critic = {"params": {"trunk": {"embed": jnp.ones((2, 3))}, "head": {"value_w": jnp.full(3, 0.5),
                                                                      "value_b": jnp.asarray(-1.0)}},
              "opt_state": {"count": jnp.asarray(7, jnp.int32)}}
    ckpt.save(1, p, p, {"next_step": 1})
    ckpt.save(2, p, p, {"next_step": 2}, teacher={"embed": jnp.full((2, 3), 2.0)}, aux={"critic": critic})
    assert ckpt.restore_item(1, "critic", critic) is None and ckpt.restore_teacher(1, p) is None
    got = ckpt.restore_item(2, "critic", critic)
    assert float(got["params"]["head"]["value_b"]) == -1.0 and int(got["opt_state"]["count"]) == 7
    np.testing.assert_array_equal(np.asarray(got["params"]["head"]["value_w"]), [0.5, 0.5, 0.5])
    np.testing.assert_array_equal(np.asarray(ckpt.restore_teacher(2, p)["embed"]), np.full((2, 3), 2.0))
    ckpt.close()


# ---- untrusted checkpoints and run folders (issue 57, item 6): in-process, no trainer ----

def _fake_step(workdir: pathlib.Path, step: int) -> pathlib.Path:
    """A step folder as a save leaves it (files, then the manifest), without orbax."""
    from turnsight_jax.checkpointing import write_manifest

    folder = workdir / "checkpoints" / str(step)
    (folder / "params").mkdir(parents=True)
    (folder / "params" / "a").write_bytes(b"abc" * 10)
    (folder / "_CHECKPOINT_METADATA").write_text("{}")
    write_manifest(folder)
    return folder


def _manifest(step_dir: pathlib.Path, text: str) -> None:
    (step_dir / "turnsight_manifest.json").write_text(text)


M = "turnsight_manifest.json"
_UNTRUSTED = {
    "top_level_list": (lambda d, out: _manifest(d, "[]"),
                       f'{M}: the top level is a list of 0 items, expected an object {{"format": 1, "files": {{...}}}}'),
    "top_level_string": (lambda d, out: _manifest(d, '"files"'),
                         f"{M}: the top level is a string ('files'), expected an object "
                         f'{{"format": 1, "files": {{...}}}}'),
    "files_a_string": (lambda d, out: _manifest(d, '{"format": 1, "files": "params/a"}'),
                       f"{M}: \"files\" is a string ('params/a'), expected an object of path -> [size, crc32]"),
    "files_a_list_of_numbers": (lambda d, out: _manifest(d, '{"format": 1, "files": [30, 7]}'),
                                f'{M}: "files" is a list of 2 items, expected an object of path -> [size, crc32]'),
    "entry_a_number": (lambda d, out: _manifest(d, '{"format": 1, "files": {"params/a": 30}}'),
                       f"{M}: files['params/a'] is the number 30, expected [size, crc32] (two integers)"),
    "entry_floats": (lambda d, out: _manifest(d, '{"format": 1, "files": {"params/a": [30.0, 1]}}'),
                     f"{M}: files['params/a'] is a list of 2 items, expected [size, crc32] (two integers)"),
    "crc_out_of_range": (lambda d, out: _manifest(d, '{"format": 1, "files": {"params/a": [30, -1]}}'),
                         f"{M}: files['params/a'] is [30, -1], expected a size >= 0 and a CRC-32 in 0..4294967295"),
    "no_format": (lambda d, out: _manifest(d, '{"files": {}}'), f"{M}: no key \"format\" (keys: 'files')"),
    "format_a_string": (lambda d, out: _manifest(d, '{"format": "1", "files": {}}'),
                        f"{M}: \"format\" is a string ('1'), expected 1"),
    "deeply_nested": (lambda d, out: _manifest(d, '{"format": 1, "files": ' + "[" * 100_000),
                      f'{M}: JSON nested too deeply, expected {{"format": 1, "files": {{...}}}}'),
    "dot_dot_path": (lambda d, out: _manifest(d, json.dumps({"format": 1, "files": {"../../outside": [5, 0]}})),
                     f"{M}: files['../../outside']: a path with a '..' component, expected a relative path "
                     f"inside the step folder"),
    "absolute_path": (lambda d, out: _manifest(d, json.dumps({"format": 1, "files": {"/etc/hostname": [5, 0]}})),
                      f"{M}: files['/etc/hostname']: an absolute path, expected a relative path inside the step "
                      f"folder"),
    "file_symlinked_out": (lambda d, out: ((d / "params" / "a").unlink(), (out / "a").write_bytes(b"abc" * 10),
                                           (d / "params" / "a").symlink_to(out / "a")),
                           re.compile(r"params/a: a symbolic link \(to '/.*/a'\); a step's files must be its own, no link is "
                           r"followed out of the step folder")),
    "folder_symlinked_out": (lambda d, out: (shutil.move(d / "params", out / "params"),
                                             (d / "params").symlink_to(out / "params")),
                             re.compile(r"params: a symbolic link \(to '/.*/params'\); .*")),
    "step_folder_a_symlink": (lambda d, out: (shutil.move(d, out / "step"), d.symlink_to(out / "step")),
                              re.compile(r"the step folder is a symbolic link \(to '/.*/step'\); a step is read from its own "
                              r"folder only")),
    "unprintable_path": (lambda d, out: _manifest(d, json.dumps({"format": 1, "files": {"a\nb": [5, 0]}})),
                         f"{M}: files['a\\nb']: a path with unprintable characters, expected a relative path inside "
                         f"the step folder"),
    "a_named_pipe": (lambda d, out: ((d / "params" / "a").unlink(), os.mkfifo(d / "params" / "a")),
                     "params/a: a named pipe, expected a file"),
}


@pytest.mark.parametrize("kind", list(_UNTRUSTED))
def test_an_untrusted_manifest_or_link_is_a_named_reason_and_a_skipped_step(tmp_path, kind):
    """Valid JSON of the wrong shape, paths out of the step folder, symbolic links and special
    files: each is a reason from check_step (never an exception), evaluate's step choice and resume
    skip the step, resume moves it aside; nothing outside the step is read."""
    from turnsight_jax import checkpointing

    work, out = tmp_path / "run", tmp_path / "outside"
    out.mkdir()
    _fake_step(work, 1)
    step2 = _fake_step(work, 2)
    change, reason = _UNTRUSTED[kind]
    change(step2, out)
    got = checkpointing.check_step(step2)
    assert got is not None and (reason.fullmatch(got) if isinstance(reason, re.Pattern) else got == reason), got
    assert "\n" not in got and len(got) < 300
    assert checkpointing.latest_valid_step(work) == (1, [(2, got)])
    logged = []
    assert checkpointing.resume_step(work, logged.append) == 1
    assert logged == [f"resume: skipping checkpoint step 2: {got} (moved to invalid-2-0)"]
    assert os.path.lexists(work / "checkpoints" / "invalid-2-0") and not os.path.lexists(step2)


def test_step_folders_are_ascii_step_numbers(tmp_path):
    """'²' passes str.isdigit() and fails int(); '007' would be read as step 7 where orbax reads '7':
    neither is a step, and evaluate's and resume's step choice go on without them."""
    from turnsight_jax import checkpointing

    _fake_step(tmp_path, 3)
    for name in ("²", "٣", "007", "+4", " 5", "6.0"):
        (tmp_path / "checkpoints" / name).mkdir()
    assert list(checkpointing.step_folders(tmp_path)) == [3]
    assert checkpointing.latest_valid_step(tmp_path) == (3, [])
    assert checkpointing.resume_step(tmp_path, print) == 3


def test_the_workdir_lock_refuses_a_second_trainer_and_takes_over_a_stale_one(tmp_path, monkeypatch):
    import fcntl
    import errno
    import socket

    from turnsight_jax.checkpointing import LOCK_FILE, WorkdirLock
    from turnsight_jax.errors import WorkdirInUse

    host = socket.gethostname()
    first = WorkdirLock(tmp_path)
    first.acquire()
    with pytest.raises(WorkdirInUse) as e:
        WorkdirLock(tmp_path).acquire()
    line = str(e.value)
    assert "\n" not in line and re.match(
        rf"{re.escape(str(tmp_path))} is in use by another trainer: pid {os.getpid()} on host {re.escape(host)} "
        rf"since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ \(lock file ", line), line
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()  # a normal exit leaves no lock file
    # A holder killed with its lock held: the kernel dropped the flock, its file remains.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = {"pid": int(dead.stdout), "host": host, "since": "2020-01-01T00:00:00Z"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    said = []
    with WorkdirLock(tmp_path, log=said.append):
        assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert said == [f"workdir lock: taking over the stale lock {tmp_path / LOCK_FILE} of pid {stale['pid']} on "
                    f"host {host} since 2020-01-01T00:00:00Z (that process is gone)"]
    # Where flock is refused (some network file systems) the file decides: a live pid on this host holds it.

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    (tmp_path / LOCK_FILE).write_text(json.dumps(dict(stale, pid=os.getppid())))
    with pytest.raises(WorkdirInUse, match=f"pid {os.getppid()} on host"):
        WorkdirLock(tmp_path).acquire()
    (tmp_path / LOCK_FILE).write_text(json.dumps(stale))
    said.clear()
    with WorkdirLock(tmp_path, log=said.append):
        pass
    assert len(said) == 1 and "taking over the stale lock" in said[0]


def test_a_second_trainer_on_a_held_workdir_exits_2_naming_the_first(tmp_path):
    """The lock is taken after the inputs are checked and before any model is built (~3 CPU-s)."""
    import socket

    from turnsight_jax.checkpointing import WorkdirLock

    with WorkdirLock(tmp_path / "run"):
        proc = _run(["--config", str(REPO / "tests/configs/tiny_random.py"), "--config.sft.steps=0",
                     "--config.sft.curriculum_steps=0", "--config.data.num_eval=0"], tmp_path / "run")
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err[-2000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"is in use by another trainer: pid {os.getpid()} on host {socket.gethostname()} " \
        "since " in errors[0], err[-2000:]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []  # nothing of the run was written


def test_checkpoint_rotation_never_crashes_a_save(tmp_path):
    """Orbax's rotation raised on a step folder that is a symbolic link, inside the save, and left
    the new step without its manifest. Now the save completes (manifest included), the link is
    reported and left, and older real steps are removed."""
    import jax.numpy as jnp

    from turnsight_jax.checkpointing import Checkpointer, check_step, step_folders

    said = []
    ckpt = Checkpointer(tmp_path / "run", keep=1, log=said.append)
    p = {"w": jnp.ones(3)}
    ckpt.save(1, p, p, {"next_step": 1})
    shutil.move(tmp_path / "run" / "checkpoints" / "1", tmp_path / "elsewhere")
    (tmp_path / "run" / "checkpoints" / "1").symlink_to(tmp_path / "elsewhere")
    ckpt.save(2, p, p, {"next_step": 2})
    ckpt.save(3, p, p, {"next_step": 3})
    assert sorted(step_folders(tmp_path / "run")) == [1, 3]  # 2 rotated out, 1 (the link) left
    assert check_step(tmp_path / "run" / "checkpoints" / "3") is None
    assert (tmp_path / "elsewhere" / "turnsight_manifest.json").is_file()  # nothing removed through the link
    assert said and all(s.startswith("checkpoint rotation: step 1 left in place: ") and "symbolic link" in s
                        for s in said), said
    assert ckpt.latest_step() == 3 and 2 not in ckpt.all_steps()
    ckpt.close()
