"""PPO (GAE against a learned critic), PiCA and ToolOmni train from their tiny configs
(configs/methods/{ppo,pica,toolomni}.py) through `python -m turnsight_jax.train` on the built-in
tasks, 3 RL steps each from the shared warm-start (tests/_train_runs.py), each method's mechanism
showing in the logged metrics; PPO's critic is checkpointed and a resumed run's step equals the
uninterrupted one."""

from __future__ import annotations

import shutil

import pytest

from _train_runs import any_of as _any
from _train_runs import train


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("signal")


@pytest.fixture(scope="module")
def ppo(root, warm_start):
    """PPO (GAE against a learned critic), 3 steps from the shared warm-start, a checkpoint after
    every step; then the same run resumed from its step-2 checkpoint (step 3 deleted)."""
    records = train("ppo", root / "ppo", warm_start, "--config.checkpoint.every=1")
    resumed = root / "ppo_resumed"
    shutil.copytree(root / "ppo", resumed)
    shutil.rmtree(resumed / "checkpoints" / "3")
    again = train("ppo", resumed, warm_start, "--config.checkpoint.every=1")
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
def pica(root, warm_start):
    return train("pica", root / "pica", warm_start, "--config.prm.success_reward=0.5")


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
def toolomni(root, warm_start):
    return train("toolomni", root / "toolomni", warm_start)


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
