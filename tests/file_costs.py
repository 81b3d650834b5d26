"""Rebuild tests/file_costs.json: the suite's CPU-seconds per test file.

    python tests/file_costs.py            # the whole suite, as CI runs it (-n 2 --dist loadfile)
    python tests/file_costs.py -- tests/test_rl_step.py  # only the files named; the rest kept
    python tests/file_costs.py -- -k foo  # extra pytest arguments after --

tests/conftest.py measures each test's CPU time (the test process and the subprocesses it waited
for), prints the ten slowest files at the end of every run and, with TURNSIGHT_FILE_COSTS_OUT set,
writes the per-file table; its file order (heaviest first over the two xdist workers) reads the
committed table. CPU-seconds, not wall time, so a busy box distorts the order little. Run it on a
quiet machine after a change that adds or removes a heavy file, and commit the table.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
TABLE = REPO / "tests" / "file_costs.json"


def main(argv: list[str]) -> int:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    out = TABLE.with_suffix(".new.json")
    env = dict(os.environ, TURNSIGHT_FILE_COSTS_OUT=str(out))
    for inherited in ("TURNSIGHT_TEST_RUN_ROOT", "TURNSIGHT_TEST_RUN_OWNER"):
        env.pop(inherited, None)  # started from a test run: its own run folder, not the outer one's
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", *extra]
    print("running:", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=REPO, env=env)
    if not out.exists():
        print(f"no table written (pytest exit {rc})", file=sys.stderr)
        return rc or 1
    new = json.loads(out.read_text())["cpu_s"]
    out.unlink()
    if extra and TABLE.exists():  # a partial run updates only the files it ran
        old = json.loads(TABLE.read_text())["cpu_s"]
        new = {**old, **new}
    ranked = dict(sorted(new.items(), key=lambda kv: -kv[1]))
    TABLE.write_text(json.dumps({"cpu_s": ranked}, indent=1) + "\n")
    print(f"wrote {TABLE} ({len(ranked)} files, {sum(ranked.values()):.0f} CPU-s; pytest exit {rc})")
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
