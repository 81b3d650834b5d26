"""The self-distillation baselines, PPO, PiCA and ToolOmni train from their tiny configs
(configs/methods/{rlsd,sdpo,sdar,sod,ppo,pica,toolomni}.py) through `python -m turnsight_jax.train` on the
built-in tasks, 3 RL steps each, and each method's mechanism shows in the logged metrics; PPO's
critic is checkpointed and a resumed run's step equals the uninterrupted one.

A random model never solves a built-in task, and every advantage would then be 0 (RLSD's weights
all 1, no successful sibling for SDPO). So the runs share one short supervised warm-start, built
by the first run (a smaller version of the configs' own: 200 + 60 steps of 4 rows instead of
250 + 60 of 16, from 128 tasks, gold demonstrations only) and reused by the others from their run folders (the trainer reuses a completed
`sft/` folder); SOD's external teacher is that warm-start (`teacher.checkpoint=warm_start`, its
tiny config's default). Only sizes are overridden, plus SDPO's sibling threshold: on this weak
warm-start few rollouts solve a task fully, so any sibling with a higher reward than 0 counts.
(Named to be collected early: the longest file of the suite starts first under pytest-xdist.)"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
from conftest import SUBPROCESS_XLA_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[1]
SIZES = ["--config.data.num_eval=0", "--config.train.steps=3", "--config.train.prompts_per_step=2",
         "--config.train.group_size=4", "--config.checkpoint.every=0", "--config.log.tensorboard=False",
         "--config.sft.curriculum_steps=200", "--config.sft.steps=60", "--config.sft.batch_size=4",
         "--config.sft.num_tasks=128", "--config.sft.wrong_call_rate=0.0", "--config.data.num_train=64"]
EXTRA = {"sdpo": ["--config.teacher.sibling_min_reward=0.01"]}
METHODS = ("rlsd", "sdpo", "sdar", "sod")


def _train(method: str, workdir: pathlib.Path, *more: str) -> list[dict]:
    env = dict(os.environ, XLA_FLAGS=SUBPROCESS_XLA_FLAGS, JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", "turnsight_jax.train", "--config", str(REPO / "configs" / "methods" / f"{method}.py"),
            "--workdir", str(workdir), *SIZES, *EXTRA.get(method, []), *more]
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{method}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    assert f"method {method}:" in proc.stderr
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("baselines")


@pytest.fixture(scope="module")
def runs(root):
    out = {}
    for method in METHODS:
        if out:  # the first run's warm-start, reused
            shutil.copytree(root / METHODS[0] / "sft", root / method / "sft")
        out[method] = _train(method, root / method)
    return out


def _any(records, key, pred):
    return any(pred(r[key]) for r in records if key in r)


def test_every_baseline_trains_three_steps_with_its_mechanism_acting(runs):
    for method, records in runs.items():
        assert [r["step"] for r in records] == [0, 1, 2], method
        assert all(r["train/skipped_updates"] == 0.0 and r["perf/update_flops_necessary"] > 0 for r in records)
        # the teacher forward's FLOPs, a share of the update's
        assert all(0 < r["perf/teacher_flops_necessary"] <= r["perf/teacher_flops_executed"] for r in records)
        assert all(0 < r["perf/teacher_flops_share"] < 1 for r in records)
        # the teacher's views were scored and differ from the student somewhere (the privileged
        # block, or SOD's other model once the policy has moved away from it)
        assert _any(records, "teacher/gap_abs_mean", lambda v: v > (1e-4 if method == "sod" else 1e-3)), method
    rlsd = runs["rlsd"]
    # MatchTIR's turn rewards give non-zero advantages; some tokens strengthened (w > 1), some
    # weakened (w < 1), within the clip [1 - eps_w, 1 + eps_w] = [0.5, 1.5]
    assert _any(rlsd, "train/adv_abs_mean", lambda v: v > 0)
    assert _any(rlsd, "rlsd/weight_max", lambda v: 1.0 < v <= 1.5 + 1e-6)
    assert _any(rlsd, "rlsd/weight_min", lambda v: 0.5 - 1e-6 <= v < 1.0)
    assert all(0 < r["rlsd/frac_strengthened"] < 1 and 0 < r["rlsd/frac_weakened"] < 1 for r in rlsd
               if r["train/adv_abs_mean"] > 0)
    sdpo = runs["sdpo"]
    assert all(r["teacher/views_built"] + r["teacher/views_skipped"] == 8 for r in sdpo)  # one per trajectory
    # a step whose group has a sibling with reward > 0 builds views, and their KL is positive
    assert _any(sdpo, "teacher/views_built", lambda v: v > 0)
    assert all((r["train/sdpo_kl"] > 0) == (r["teacher/views_built"] > 0) for r in sdpo)
    sdar = runs["sdar"]
    # the gate sigmoid(beta * gap) is strictly inside (0, 1), the auxiliary NLL positive
    assert all(0.0 < r["train/sdar_gate"] < 1.0 and r["train/sdar_nll"] > 0 for r in sdar)
    assert all(r["teacher/covered_frac"] == 1.0 for r in sdar)  # a skill for every category
    sod = runs["sod"]
    # the teacher starts as the policy's warm-start (KL 0 and weight 1 to float rounding, ~1e-9 and
    # ~1e-6); once the policy has moved (the learning rate warms up from 0), per-turn weights
    # exp(-divergence / tau) fall below 1 and the KL is positive
    assert all(0.0 < r["train/sod_weight"] <= 1.0 + 1e-5 for r in sod)  # a token mean of weights <= 1
    assert abs(sod[0]["train/sod_kl"]) < 1e-7 and abs(sod[0]["train/sod_weight"] - 1.0) < 3e-6
    assert sod[-1]["train/sod_kl"] > 1e-6 and sod[-1]["train/sod_weight"] < 1.0 - 3e-6


@pytest.fixture(scope="module")
def ppo(root, runs):
    """PPO (GAE against a learned critic), 3 steps from the shared warm-start, a checkpoint after
    every step; then the same run resumed from its step-2 checkpoint (step 3 deleted)."""
    shutil.copytree(root / METHODS[0] / "sft", root / "ppo" / "sft")
    records = _train("ppo", root / "ppo", "--config.checkpoint.every=1")
    resumed = root / "ppo_resumed"
    shutil.copytree(root / "ppo", resumed)
    shutil.rmtree(resumed / "checkpoints" / "3")
    again = _train("ppo", resumed, "--config.checkpoint.every=1")
    return records, again


def test_ppo_trains_its_critic_and_resumes_it(ppo):
    records, again = ppo
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["train/skipped_updates"] == 0.0 for r in records)
    # the outcome reward on the last token, GAE against the critic: non-zero advantages whenever a
    # rollout earned a reward (whitened: mean 0)
    assert _any(records, "train/reward_mean", lambda v: v > 0)
    assert all(abs(r["train/adv_mean"]) < 1e-5 for r in records if r["train/adv_abs_mean"] > 0)
    assert _any(records, "train/adv_abs_mean", lambda v: v > 0.1)
    # the critic starts at V = 0 (a zero head) and moves: its values and its loss are non-trivial
    assert records[0]["critic/values_mean"] == 0.0 and records[0]["critic/explained_variance"] <= 1e-6
    assert all(r["critic/value_loss"] > 0 and r["critic/grad_norm"] > 0 for r in records)
    assert records[-1]["critic/values_mean"] != 0.0
    # the critic's FLOPs are counted: a trunk forward for V_old plus a forward+backward
    assert all(r["perf/update_padding_ratio_critic"] >= 1.0 for r in records)
    # resumed from step 2, the critic (and everything else) restored: step 3 is the same step
    assert [r["step"] for r in again] == [0, 1, 2]
    for key in ("critic/value_loss", "critic/values_mean", "critic/explained_variance", "train/grad_norm",
                "train/adv_abs_mean", "train/reward_mean"):
        assert again[2][key] == records[2][key], key


@pytest.fixture(scope="module")
def pica(root, runs):
    shutil.copytree(root / METHODS[0] / "sft", root / "pica" / "sft")
    return _train("pica", root / "pica", "--config.prm.success_reward=0.5")


def test_pica_trains_its_prm_and_critic(pica):
    """PiCA 3 steps: the step-PRM is trained each step (its loss positive, h away from the zero
    head's 0.5 by the end), it writes gains at tool-result boundaries, and the critic trains."""
    assert [r["step"] for r in pica] == [0, 1, 2]
    assert all(r["train/skipped_updates"] == 0.0 and r["prm/skipped_updates"] == 0.0 for r in pica)
    assert all(r["prm/boundaries"] > 0 and r["prm/loss"] > 0 for r in pica)
    assert pica[0]["prm/h_start"] == pytest.approx(0.5) and pica[0]["prm/gain_abs_mean"] == 0.0  # the zero head
    assert pica[-1]["prm/gain_abs_mean"] > 0 and abs(pica[-1]["prm/h_start"] - 0.5) > 1e-3
    assert pica[-1]["prm/loss"] < pica[0]["prm/loss"]
    assert all(r["critic/value_loss"] > 0 for r in pica)
    assert all(r["perf/update_padding_ratio_prm"] >= 1.0 for r in pica)


@pytest.fixture(scope="module")
def toolomni(root, runs):
    shutil.copytree(root / METHODS[0] / "sft", root / "toolomni" / "sft")
    return _train("toolomni", root / "toolomni")


def test_toolomni_trains_its_two_stages(toolomni):
    """ToolOmni 3 steps: its retrieval reward's factors are reported, some rollouts pass the gate
    and some do not (the warm-start solves part of the tasks), and the tool turns get a non-zero
    advantage."""
    assert [r["step"] for r in toolomni] == [0, 1, 2]
    assert all(r["train/skipped_updates"] == 0.0 for r in toolomni)
    assert all(0 <= r["toolomni/info_recall_mean"] <= 1 and 0 <= r["toolomni/answer_tran_mean"] <= 1 for r in toolomni)
    assert _any(toolomni, "toolomni/gate_pass_rate", lambda v: 0 < v < 1)
    assert all(0 < r["toolomni/answer_token_frac"] < 1 for r in toolomni)
    assert _any(toolomni, "train/adv_abs_mean", lambda v: v > 0.1)
