"""notebooks/quickstart.ipynb runs headless, unchanged, end to end on the CPU.

The notebook is executed with nbclient in a python3 Jupyter kernel (this interpreter: the
kernelspec that ipykernel installs into the environment, or one written into a temp folder when
none is found). Its setup cell must see the checkout and skip cloning and installing. The run
folder goes to a temp directory through TURNSIGHT_QUICKSTART_DIR (the notebook's default is
runs/quickstart); XLA_FLAGS is tests/conftest.py's SUBPROCESS_XLA_FLAGS (not this session's 8
fake devices) so the notebook sees one CPU device as on a laptop; the JAX compilation cache is shared with tests/test_docs.py, whose
short run uses the same settings as the notebook's QUICK run.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
from conftest import SUBPROCESS_XLA_FLAGS

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
TIMEOUT_S = 900  # per cell


def _kernel_name(tmp_path_factory, monkeypatch) -> str:
    """A kernelspec named python3 that runs this interpreter."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
        if spec.argv and spec.argv[0] in ("python", "python3", sys.executable):
            return "python3"
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    prefix = tmp_path_factory.mktemp("jupyter_prefix")
    install(prefix=str(prefix), kernel_name="python3")  # argv[0] = sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    return "python3"


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, "commit the notebook with outputs cleared"
    setup = nb.cells[1].source
    assert "git clone" in setup and "%pip install" in setup and "importlib.metadata.version" in setup
    assert "JAX_PLATFORMS" not in "".join(c.source for c in nb.cells)  # runs unchanged on CPU, GPU, TPU


def test_quickstart_notebook_runs(tmp_path, tmp_path_factory, monkeypatch):
    run_dir = tmp_path / "quickstart_run"
    cache = pathlib.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])  # the run's cache (tests/conftest.py)
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("XLA_FLAGS", SUBPROCESS_XLA_FLAGS)  # one device (tests/conftest.py)
    monkeypatch.setenv("TURNSIGHT_QUICKSTART_DIR", str(run_dir))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(cache))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
    kernel = _kernel_name(tmp_path_factory, monkeypatch)

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT_S, kernel_name=kernel,
                                     resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"notebook cell failed:\n{str(e)[-4000:]}")

    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs
                     if o.get("output_type") == "stream")
    assert "already installed: nothing to install" in text  # no clone, no pip inside the checkout
    assert f"repository: {REPO}" in text

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["step"] == 0
    record = json.loads(lines[0])
    assert "rollout/reward_mean" in record and "turnsight/weight_mean" in record
    assert (run_dir / "export" / "config.json").is_file() and (run_dir / "checkpoints").is_dir()

    results = json.loads((run_dir / "eval" / "results.json").read_text())
    # --checkpoint RUN --benchmarks builtin scores the run's own held-out tasks (data.num_eval=2 of the
    # run's categories), the tasks its training-time evaluation scored
    cats = results["benchmarks"]["builtin"]["categories"]
    assert set(cats) <= {"single_hop", "multi_hop"} and sum(c["n"] for c in cats.values()) == 2, cats
    assert (run_dir / "eval" / "examples.jsonl").read_text().count("\n") == 2

    pngs = sorted(p.name for p in (run_dir / "report").glob("*.png"))
    assert {"reward.png", "turnsight_weights.png", "depth_histogram.png"} <= set(pngs), pngs
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if "image/png" in o.get("data", {})]
    assert len(images) >= len(pngs) + 1  # the report's PNGs and the matplotlib figure
