"""docs/experiments.md's study commands (`python -m turnsight_jax.studies ...`) parse and plan:
every documented command runs here with --check (each arm's config built and validated, no
training: the studies themselves take minutes each and are run by hand, their tables committed
under docs/experiments/)."""

from __future__ import annotations

import json
import pathlib

import pytest

from test_docs import REPO, extract_commands
from turnsight_jax import studies

DOC = REPO / "docs" / "experiments.md"
COMMANDS = [c for c in extract_commands(DOC) if c.argv[:3] == ["python", "-m", "turnsight_jax.studies"]]


def test_every_study_is_documented_with_its_committed_table():
    assert sorted({c.argv[3] for c in COMMANDS}) == sorted(studies.STUDIES)
    for c in COMMANDS:
        out = pathlib.Path(c.argv[c.argv.index("--out") + 1])
        assert (REPO / out / "table.md").is_file(), out  # the table the command wrote
        summary = json.loads((REPO / out / "summary.json").read_text())
        assert summary["study"] == c.argv[3] and set(summary["arms"]) == set(studies.STUDIES[c.argv[3]].arms)
        assert summary["seed"] == int(c.argv[c.argv.index("--seed") + 1])


@pytest.mark.parametrize("cmd", COMMANDS, ids=[c.argv[3] for c in COMMANDS])
def test_documented_study_command_plans(cmd, capsys, tmp_path):
    args = list(cmd.argv[3:])
    args[args.index("--workdir") + 1] = str(tmp_path)  # --check writes nothing; never the doc's folder
    assert studies.main(args + ["--check"]) == 0
    out = capsys.readouterr().out
    assert all(f"{cmd.argv[3]}/{arm}:" in out for arm in studies.STUDIES[cmd.argv[3]].arms), out


def test_a_bad_study_argument_is_refused(capsys):
    with pytest.raises(SystemExit):
        studies.main(["nonsense"])
    assert studies.main(["horizon", "--steps", "0", "--check"]) == 2


def test_an_arms_folder_is_emptied_under_its_workdir_lock(tmp_path):
    """A study run empties each arm's folder before training it, holding the folder's workdir lock:
    a trainer holding that lock (another study command in the same folder) is refused, and nothing
    of its run is deleted; a free folder is emptied and gets the warm-start, and no lock is left."""
    from turnsight_jax.checkpointing import LOCK_FILE, WorkdirLock
    from turnsight_jax.errors import WorkdirInUse

    sft = tmp_path / "warm" / "sft"
    sft.mkdir(parents=True)
    (sft / "SFT_DONE").write_text("")
    arm = tmp_path / "study" / "arm"
    (arm / "checkpoints" / "3").mkdir(parents=True)
    (arm / "metrics.jsonl").write_text("{}\n")
    with WorkdirLock(arm):  # a running trainer's lock (another open file: flock refuses it here too)
        with pytest.raises(WorkdirInUse, match=str(arm)):
            studies._fresh_arm_folder(arm, sft)
        assert (arm / "checkpoints" / "3").is_dir() and (arm / "metrics.jsonl").is_file()
    studies._fresh_arm_folder(arm, sft)
    assert sorted(p.name for p in arm.iterdir()) == ["sft"] and (arm / "sft" / "SFT_DONE").is_file()
    assert not (arm / LOCK_FILE).exists()
