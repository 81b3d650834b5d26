"""tests/file_costs.py: a partial rebuild of the cost table, run from inside a test run.

The nested pytest run gets its own run folder: the CI failure this guards against was a doc-test
running the script, whose pytest cleared the outer run's basetemp and removed its TMPDIR, so
hundreds of later tests lost their files.
"""

from __future__ import annotations

import json
import os

import file_costs
from conftest import RUN_ROOT


def test_a_partial_rebuild_updates_the_files_it_ran_and_keeps_the_outer_run_folder(tmp_path, monkeypatch):
    table = tmp_path / "file_costs.json"
    table.write_text(json.dumps({"cpu_s": {"test_not_run.py": 5.0, "test_batch_shapes.py": 999.0}}))
    monkeypatch.setattr(file_costs, "TABLE", table)
    marker = tmp_path / "outer_run_file"
    marker.write_text("kept")
    rc = file_costs.main(["--", "-n", "0", "-p", "no:cacheprovider", "tests/test_batch_shapes.py"])
    assert rc == 0
    costs = json.loads(table.read_text())["cpu_s"]
    assert costs["test_not_run.py"] == 5.0  # a file the partial run did not run keeps its figure
    assert 0.0 <= costs["test_batch_shapes.py"] < 60.0  # measured again, not the 999 written above
    assert list(costs) == sorted(costs, key=lambda name: -costs[name])  # heaviest first
    assert not table.with_suffix(".new.json").exists()
    # the outer run's folder, its TMPDIR and this test's tmp_path are all still there
    assert marker.read_text() == "kept"
    assert (RUN_ROOT / "tmp").is_dir() and os.environ["TMPDIR"] == str(RUN_ROOT / "tmp")
