"""turnsight_jax.runlog: the metrics log (JSONL, resume truncation, cut lines), progress lines."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np

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
