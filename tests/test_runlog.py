"""turnsight_jax.runlog: the metrics log (JSONL, resume truncation, cut lines; TensorBoard and Weights &
Biases on a trainer run), progress lines."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from turnsight_jax.runlog import MetricsLog, Progress


def test_metrics_log_writes_plain_json_and_truncates_on_resume(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=False, resume_step=None)
    for step in range(4):
        log.write(step, {"a": jnp.float32(step), "h": np.arange(2), "s": "x"})
    log.close()
    recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert recs[2] == {"step": 2, "a": 2.0, "h": [0, 1], "s": "x"}
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "a": ')  # a line cut by a kill
    MetricsLog(tmp_path, tensorboard=False, resume_step=1).close()  # resumed after step 1's checkpoint
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_progress_line(capsys):
    p = Progress(total=4, start=0)
    p.update(1, {"reward": 0.5})
    err = capsys.readouterr().err
    assert "step 2/4" in err and "reward 0.5" in err and "ETA" in err and "[##########..........]" in err
    Progress(total=4, start=0, enabled=False).update(1, {"reward": 0.5})
    assert capsys.readouterr().err == ""


def _events(folder):
    """(tag, step, value) of every scalar in the TensorBoard event files under `folder`, read as
    TensorBoard reads them: TFRecords (length, its CRC, an Event proto, its CRC)."""
    import struct

    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return out


def test_tensorboard_events_hold_every_numeric_metric(tmp_path):
    log = MetricsLog(tmp_path, tensorboard=True, resume_step=None)
    for step in range(3):
        log.write(step, {"rollout/reward_mean": 0.25 * step, "train/loss": jnp.float32(1.5 - step), "s": "x"})
    log.close()
    scalars = _events(tmp_path / "tensorboard")
    assert sorted(scalars) == sorted([("rollout/reward_mean", s, 0.25 * s) for s in range(3)]
                                     + [("train/loss", s, 1.5 - s) for s in range(3)])


def _wandb_records(path):
    """The records of a W&B offline run file (RUN/wandb/offline-run-*/run-<id>.wandb), read as its
    format is documented: a 7-byte header (":W&B", a 2-byte magic, a version byte), then LevelDB's
    log format (32 KiB blocks of chunks, each a CRC, a 2-byte length and a type: full, or first /
    middle / last of a record split across blocks), each record a W&B `Record` protobuf."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:7]
    at, parts, out = 7, [], []
    while at + 7 <= len(data):
        room = block - at % block
        if room < 7:  # a block's tail too short for a chunk header is zero padding
            at += room
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if kind == 0 and length == 0:
            at += room
            continue
        chunk, at = data[at + 7:at + 7 + length], at + 7 + length
        if kind == 1:
            parts = [chunk]
        elif kind == 2:
            parts = [chunk]
            continue
        elif kind == 3:
            parts.append(chunk)
            continue
        else:
            parts.append(chunk)
        out.append(wandb_internal_pb2.Record.FromString(b"".join(parts)))
    return out


def _wandb_run(run_dir):
    """-> (run id, config {key: value}, history {step: {key: value}}, summary {key: value}) of every
    offline W&B run file under run_dir/wandb (a resumed run adds a file with the same id)."""
    ids, config, history, summary = set(), {}, {}, {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
                config.update({i.key: json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                history.setdefault(int(row["_step"]), {}).update(row)
            elif kind == "summary":
                summary.update({i.key: json.loads(i.value_json) for i in rec.summary.update if i.key})
    assert len(ids) == 1, ids
    return ids.pop(), config, history, summary


def test_a_run_of_the_embedded_default_logs_to_tensorboard_and_wandb_offline(tmp_path):
    """`python -m turnsight_jax.train` (the embedded default, shortened) with log.tensorboard and
    log.wandb in W&B's offline mode: the TensorBoard events and the W&B run both hold every
    numeric metric of metrics.jsonl at its step; W&B also holds the resolved config and the
    held-out summary, and a resumed run (one more step) continues the same W&B run."""
    from _train_runs import run_main

    run = tmp_path / "run"
    short = ["--config.sft.steps=0", "--config.sft.curriculum_steps=0", "--config.train.prompts_per_step=2",
             "--config.train.group_size=2", "--config.data.num_eval=2", "--config.eval.temperature=0",
             "--config.eval.max_turns=2", "--config.rollout.max_turns=2", "--config.rollout.max_turn_tokens=12",
             "--config.rollout.max_response_tokens=64", "--config.checkpoint.every=1", "--config.log.records_every=0",
             "--config.checkpoint.export_at_end=False", "--config.log.tensorboard=True", "--config.log.wandb=True",
             "--config.log.wandb_mode=offline", "--config.log.wandb_project=tests"]
    for steps in (1, 2):  # the second: a resume (train.steps is harmless under the default schedule)
        done = run_main("turnsight_jax.train", "--workdir", run, f"--config.train.steps={steps}", *short,
                        env={"WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),  # its service's logs: not in ~/.cache
                             "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config")})
        assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "(next step 1)" in done.stderr
    logged = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
    assert sorted(logged) == [0, 1]
    numbers = {s: {k: v for k, v in r.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
               for s, r in logged.items()}
    assert all(len(n) > 50 and "perf/checkpoint_s" in n for n in numbers.values())  # amended after the step's line

    tb = {}
    for tag, step, value in _events(run / "tensorboard"):
        tb.setdefault(step, {})[tag] = value
    assert sorted(tb) == [0, 1]
    for step, want in numbers.items():
        assert set(tb[step]) == set(want), step
        assert all(tb[step][k] == pytest.approx(v, rel=1e-6, abs=1e-30) for k, v in want.items())  # float32 events

    run_id, config, history, summary = _wandb_run(run)
    assert json.loads((run / "wandb_run.json").read_text())["id"] == run_id
    assert config["rl"]["method"] == "turnsight" and config["train"]["group_size"] == 2
    assert sorted(history) == [0, 1]
    for step, want in numbers.items():
        got = {k: v for k, v in history[step].items() if not k.startswith("_")}
        assert got == pytest.approx(want, rel=1e-12, abs=0), step
    held_out = json.loads((run / "summary.json").read_text())
    assert summary["eval_after_rl/task_mean_solve_f1"] == pytest.approx(held_out["eval_after_rl"]["task_mean_solve_f1"])
    assert summary["improvement/mean"] == pytest.approx(held_out["improvement"]["mean"])


def test_wandb_online_without_a_login_is_one_config_error(tmp_path, monkeypatch):
    """log.wandb in online mode on a machine with no W&B login: one ConfigError naming the fixes
    (`wandb login`, or the offline mode), raised before any step, not W&B's traceback."""
    from turnsight_jax.errors import ConfigError

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(ConfigError, match=r"log\.wandb: Weights & Biases could not start the run \(.*\); run "
                                          r"`wandb login`, or pass --config\.log\.wandb_mode=offline"):
        MetricsLog(tmp_path / "run", tensorboard=False, resume_step=None,
                   wandb=dict(project="tests", mode="online", name="run", config={}))
