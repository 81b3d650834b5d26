"""`python -m turnsight_jax.train`: bad inputs, SIGTERM + resume, checkpoint validity, HF export."""

from __future__ import annotations

import json
import os
import pathlib
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
    (["--config.rl.method=ppo"], "unknown rl.method 'ppo'; registered methods"),
    (["--config.checkpoint.keep=0"], r"checkpoint.keep must be >= 1 \(0 would delete every save\), got 0"),
    (["--config.train.max_skipped_steps=0"], "train.max_skipped_steps must be >= 1, got 0"),
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
    """NaN injected into RL step 1 (of 2; TURNSIGHT_FAULT_NAN_STEPS): its update is skipped and
    logged, and with train.max_skipped_steps=1 the run stops with exit 1, the checkpoint of step 1
    being the last one (no checkpoint of the poisoned step)."""
    env = {"TURNSIGHT_FAULT_NAN_STEPS": "1"}
    proc = _run(FAST + ["--config.train.steps=2", "--config.checkpoint.every=1", "--config.train.max_skipped_steps=1"],
                tmp_path / "run", extra_env=env)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err[-3000:]
    assert "step 2: non-finite loss or gradient, 1 update(s) skipped" in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: 1 steps in a row (to step 2)") and "last checkpoint (1) intact" in last, last
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_updates"] for r in recs] == [0.0, 1.0]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == ["1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    proc = _run(FAST, workdir)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return workdir


def test_sigterm_then_resume_matches_uninterrupted(uninterrupted, tmp_path):
    workdir = tmp_path / "interrupted"
    proc = _run(FAST, workdir)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            proc.send_signal(signal.SIGTERM)  # a real signal while step 3 runs (or just after step 2)
            break
        time.sleep(0.2)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "checkpointing after this step" in err
    stopped = max(_records(workdir))
    assert 1 <= stopped < 3, stopped  # stopped early, with a checkpoint of what it finished
    proc = _run(FAST, workdir)
    _, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    assert "resumed from" in err
    full, resumed = _records(uninterrupted), _records(workdir)
    assert sorted(resumed) == list(range(4))
    for step in range(stopped + 1, 4):  # the steps the resumed process ran
        assert resumed[step] == full[step], step


def test_the_step_compiles_once_per_batch_geometry(uninterrupted):
    """The updated parameters keep their shardings (make_train_step's state_shardings), so the
    step and the rollout programs are not compiled again on the second step: the step's compiled
    programs equal the distinct batch geometries the run met."""
    recs = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    geometries = {tuple(v for k, v in sorted(r.items()) if k.startswith("shape/")) for r in recs}
    assert recs[-1]["perf/step_compilations"] == len(geometries), [r["perf/step_compilations"] for r in recs]


def test_unfinished_checkpoint_is_never_loaded(uninterrupted, tmp_path):
    import shutil

    from turnsight_jax.checkpointing import Checkpointer

    work = tmp_path / "copy"
    shutil.copytree(uninterrupted, work)
    # a write cut short: orbax's temporary folder for step 9, half written
    partial = work / "checkpoints" / "9.orbax-checkpoint-tmp-1234567"
    shutil.copytree(work / "checkpoints" / "4", partial)
    (partial / "params" / "_METADATA").unlink(missing_ok=True)
    ckpt = Checkpointer(work)
    assert ckpt.latest_step() == 4
    ckpt.close()


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
