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
