"""Every command-line entry point answers `--help` with its usage and exits 0 (nothing runs), and
flags follow one convention: hyphens, the older underscore spellings kept as aliases."""

from __future__ import annotations

import importlib
import re

import pytest

ENTRY_POINTS = ["train", "sft", "evaluate", "distributed", "viewer", "report", "studies", "calibration", "export", "taskfile",
                "judge.__main__"]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_prints_usage_and_runs_nothing(module, capsys):
    main = importlib.import_module(f"turnsight_jax.{module}").main
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    out = capsys.readouterr().out
    assert stop.value.code == 0 and out.startswith("usage: python -m turnsight_jax."), out[:300]
    # a long option is hyphenated, or an underscore alias listed after its hyphenated form
    for line in out.splitlines():
        for names in re.findall(r"^\s+(--[\w-]+(?:[ ,][^,]*?)?(?:, --[\w-]+)*)", line):
            flags = re.findall(r"--[\w-]+", names)
            assert "_" not in flags[0], (module, line)


def test_train_takes_the_hyphenated_and_the_underscore_dry_run(capsys):
    from turnsight_jax import train

    with pytest.raises(SystemExit):
        train.main(["--help"])
    out = capsys.readouterr().out
    assert "--dry-run, --dry_run" in out and "--fake-devices FAKE_DEVICES, --fake_devices" in out
    assert "--allow-config-change, --allow_config_change" in out


def test_evaluate_help_shows_no_switch_default_as_true(capsys):
    from turnsight_jax import evaluate

    with pytest.raises(SystemExit):
        evaluate.main(["--help"])
    out = capsys.readouterr().out
    block = out[out.index("--no-thinking  "):]
    assert "(default: True)" not in block.split("\n  --")[0]
