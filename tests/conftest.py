"""Shared test fixtures.

The Qwen3 tokenizer comes from the package (`turnsight_jax.assets`), so a fresh clone runs the
whole suite; only tests of data that lives solely in `../shared/fixtures` (the FTRL sample rows,
and the check that the bundled tokenizer equals the fixture's) skip cleanly when it is absent.
"""

from __future__ import annotations

import os
import sys

# Bytecode caching on for this run and every process it starts. The install is `--no-compile`
# (70 s instead of 155 s); where the environment also sets PYTHONDONTWRITEBYTECODE (the project's
# 2-core box does), no .pyc would ever be written, and each of the ~40 Python processes the suite
# starts would recompile jax, flax and transformers from source: 8-9 s per import of
# turnsight_jax.train instead of 2 s. Now the first import of each module writes its .pyc.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# glibc's malloc asks for transparent huge pages on the memory it maps (glibc >= 2.35; a no-op
# where the kernel's THP mode is `never` or glibc is older). XLA's CPU buffers of the tiny model's
# 151,936-row embedding (39 MB, and its gradient and moments) are mapped afresh at every step, each
# 4 kB page faulted and zeroed on first touch: the warm-start's first stage took 7.2 M page faults
# and 21.9 s of system time, with huge pages 0.26 M and 6.4 s (BENCHMARKS.md "Test suite"). It
# must be in the environment when a process starts (glibc reads it once): it reaches the xdist
# workers, the trainer processes and every subprocess, not this controller process itself.
if "glibc.malloc.hugetlb" not in os.environ.get("GLIBC_TUNABLES", ""):
    os.environ["GLIBC_TUNABLES"] = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), "glibc.malloc.hugetlb=1"]))

# The suite compiles far more than it computes (tiny models, hundreds of distinct programs), so
# XLA's CPU backend runs at optimisation level 0 in tests, with the fusion emitters off (XLA's
# older loop emitters): a fused train step compiles in 5.7 CPU-s instead of 15.2 (level 0 alone)
# and runs ~25% slower, same results to float tolerance (the pinned step numbers hold;
# BENCHMARKS.md "Test suite"). Subprocesses the tests start (the CLI, documented commands, the
# notebook kernel) get SUBPROCESS_XLA_FLAGS: one CPU device, as a user's machine. The trainer
# process of the method tests (tests/_train_runs.py) executes more than it compiles (its runs
# share their programs): TRAINER_XLA_FLAGS, level 1, 30% less CPU over four method runs.
SUBPROCESS_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
TRAINER_XLA_FLAGS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
# A program a test runs on large inputs or many times (measured: the packed-vs-plain view check
# spends 3-4x longer executing at level 0 than at full optimisation) opts back in per jit:
# `jax.jit(f, compiler_options=OPTIMIZED)`.
OPTIMIZED = {"xla_backend_optimization_level": 3}
# Eight fake CPU devices for the sharding tests; must be set before JAX initialises. Unsharded
# code runs on device 0 as usual.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {SUBPROCESS_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import atexit
import pathlib
import shutil
import tempfile
import time

# Everything a test run writes lives under one folder, removed at its end (pytest_sessionfinish),
# so a run leaves nothing in the machine's temporary folder: TMPDIR points there for the run and
# every process it starts (xdist workers, trainer and tool processes, the browser), and pytest's
# own tmp_path folders go there too (--basetemp, pytest_configure). The controller makes it; the
# xdist workers, started later, inherit its environment.
_SYSTEM_TMP = pathlib.Path(os.environ.get("TURNSIGHT_TEST_SYSTEM_TMP") or tempfile.gettempdir())
os.environ["TURNSIGHT_TEST_SYSTEM_TMP"] = str(_SYSTEM_TMP)
if "TURNSIGHT_TEST_RUN_ROOT" not in os.environ:
    os.environ["TURNSIGHT_TEST_RUN_ROOT"] = tempfile.mkdtemp(prefix="turnsight-tests-", dir=_SYSTEM_TMP)
    os.environ["TURNSIGHT_TEST_RUN_OWNER"] = str(os.getpid())
RUN_ROOT = pathlib.Path(os.environ["TURNSIGHT_TEST_RUN_ROOT"])
# Only the process that made the folder sets pytest's basetemp in it and removes it at the end: a
# pytest run started inside a test (one that inherited the folder) must not clear the outer run's
# tmp_path folders or delete its files (a CI failure: a doc-test ran tests/file_costs.py).
_OWNS_RUN_ROOT = os.environ.get("TURNSIGHT_TEST_RUN_OWNER") == str(os.getpid())
if _OWNS_RUN_ROOT:  # also when a script imports the tests' helpers outside pytest (pytest_sessionfinish first)
    atexit.register(lambda: os.environ.get("TURNSIGHT_KEEP_TEST_TMP") or shutil.rmtree(RUN_ROOT, ignore_errors=True))
(RUN_ROOT / "tmp").mkdir(exist_ok=True)
os.environ["TMPDIR"] = str(RUN_ROOT / "tmp")
tempfile.tempdir = None  # re-read TMPDIR
# One persistent JAX compilation cache for the whole test run: both xdist workers and every
# subprocess they start (the CLI, documented commands, the notebook's kernel) inherit it, so a
# program compiled by one test is loaded, not recompiled, by the next. Fresh per run.
JAX_CACHE = RUN_ROOT / "jax-cache"
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(JAX_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.02")

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_FIXTURES = pathlib.Path(
    os.environ.get("TURNSIGHT_SHARED_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures")
)


def shared_path(*parts: str) -> pathlib.Path:
    """Path under ../shared/fixtures, or skip the calling test when it is absent."""
    path = SHARED_FIXTURES.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"shared fixture {path} not present (fresh clone without ../shared)")
    return path


@pytest.fixture(scope="session", autouse=True)
def builtin_methods():
    """The built-in methods registered, as every entry point does (`import turnsight_jax.methods`):
    the core's registries hold only GRPO, MatchTIR, ToolRL and TurnSight until then."""
    import turnsight_jax.methods  # noqa: F401


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> pathlib.Path:
    """The bundled Qwen3 tokenizer folder (tokenizer.json + tokenizer_config.json)."""
    from turnsight_jax.assets import default_tokenizer_dir

    return default_tokenizer_dir()


@pytest.fixture(scope="session")
def ftrl_sample_path() -> pathlib.Path:
    return shared_path("ftrl", "ftrl_test_sample.jsonl")


# In CI (CI=true) every optional test dependency is installed by the project's own files
# (`.ci/run`), so a skip for any reason other than an absent ../shared/fixtures would hide an
# untested acceptance item: it is reported as a failure instead.
_ALLOWED_CI_SKIP = "shared fixture"


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _fail_unexpected_skip(report) -> None:
    if os.environ.get("CI", "").lower() in ("", "0", "false") or not report.skipped:
        return
    reason = _skip_reason(report)
    if _ALLOWED_CI_SKIP not in reason:
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where every test dependency is installed: {reason}"


# The suite's files are handed to the two xdist workers heaviest first (`pyproject.toml` runs
# xdist with `--no-loadscope-reorder`): both workers then finish together, the many small files
# filling the end. The costs are CPU-seconds per file (the test process and the subprocesses it
# waited for), measured by the plugin below and committed in tests/file_costs.json; rebuild the
# table with `python tests/file_costs.py` after adding or slimming a heavy file. A file missing
# from the table (a new one) goes first: a light file run early costs nothing, a heavy one run
# last leaves one core idle.
FILE_COSTS_PATH = pathlib.Path(__file__).with_name("file_costs.json")


def _file_costs() -> dict[str, float]:
    import json

    try:
        return json.loads(FILE_COSTS_PATH.read_text())["cpu_s"]
    except FileNotFoundError:
        return {}


def pytest_collection_modifyitems(session, config, items):
    costs = _file_costs()
    # ties broken by name: every xdist worker must collect the same order
    files = sorted({item.path.name for item in items}, key=lambda name: (-costs.get(name, float("inf")), name))
    # The first file that needs the shared warm-start builds it (~100 CPU-s) while the other
    # worker would wait on its lock: the three files after it, the other worker's first two and
    # this worker's next, are the heaviest that do not need it.
    waiting = {item.path.name for item in items if "warm_start" in getattr(item, "fixturenames", ())}
    if waiting:
        first = next(f for f in files if f in waiting)
        head = [first] + [f for f in files if f not in waiting][:3]
        files = head + [f for f in files if f not in head]
    rank = {name: k for k, name in enumerate(files)}
    items.sort(key=lambda item: rank[item.path.name])  # stable: a file's tests keep their order


def _cpu_seconds() -> float:
    """User + system CPU of this process, of the children it has waited for, and of its live
    trainer worker (tests/_trainer_worker.py) as last reported."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    worker = sys.modules.get("_trainer_worker")
    live = sum(worker.LIVE_CPU_S.values()) if worker is not None else 0.0
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + live


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    item._cost_start = (_cpu_seconds(), time.perf_counter())
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    _fail_unexpected_skip(report)
    if call.when == "teardown" and hasattr(item, "_cost_start"):
        # Plain attributes travel with the report from an xdist worker to the controller.
        cpu0, wall0 = item._cost_start
        report.cost_cpu_s = _cpu_seconds() - cpu0
        report.cost_wall_s = time.perf_counter() - wall0


_FILE_COST = {}  # file name -> [CPU-s, wall-s, tests], filled on the controller


def pytest_runtest_logreport(report):
    if report.when == "teardown" and hasattr(report, "cost_cpu_s"):
        entry = _FILE_COST.setdefault(pathlib.Path(report.location[0]).name, [0.0, 0.0, 0])
        entry[0] += report.cost_cpu_s
        entry[1] += report.cost_wall_s
        entry[2] += 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Every run ends with its ten slowest files, so each CI log shows where the time went."""
    if not _FILE_COST:
        return
    ranked = sorted(_FILE_COST.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for v in _FILE_COST.values())
    tr = terminalreporter
    tr.write_sep("=", f"slowest files (CPU-s of the test process and its waited-for children; {total:.0f} in all)")
    tr.write_line(f"{'file':<40} {'CPU-s':>8} {'wall-s':>8} {'tests':>6}")
    for name, (cpu, wall, n) in ranked[:10]:
        tr.write_line(f"{name:<40} {cpu:8.1f} {wall:8.1f} {n:6d}")
    out = os.environ.get("TURNSIGHT_FILE_COSTS_OUT")
    if out:  # tests/file_costs.py
        import json

        table = {name: round(v[0], 1) for name, v in ranked}
        pathlib.Path(out).write_text(json.dumps({"cpu_s": table}, indent=1) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


# The engine and rollout tests' policy: a 2-layer random Qwen3 with the real 151,936-token
# vocabulary (so the bundled tokenizer's ids are all in range), 32 wide.
TINY_POLICY = dict(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                   head_dim=16)


@pytest.fixture(scope="module")
def model():
    """(graphdef, state) of TINY_POLICY at seed 0; a file that needs another model defines its own."""
    from flax import nnx

    from turnsight_jax.models.config import Qwen3Config
    from turnsight_jax.models.qwen3 import init_model

    return nnx.split(init_model(Qwen3Config(**TINY_POLICY), seed=0))


@pytest.fixture(scope="module")
def env():
    """The built-in tasks' environment with one tool worker, closed after the file."""
    from turnsight_jax.envs.ftrl import FTRLEnv

    e = FTRLEnv(num_workers=1, timeout_s=5.0)
    yield e
    e.close()


@pytest.fixture(scope="session")
def tok():
    """The Qwen3 tokenizer the package ships (the same files as ../shared/fixtures/qwen3-tokenizer)."""
    from turnsight_jax.assets import default_tokenizer

    return default_tokenizer()


@pytest.fixture(scope="session")
def hf_tok(qwen3_tokenizer_dir):
    """The same folder loaded by `transformers` (the package's loader does not use it): the
    official chat template (`apply_chat_template`) that our renderer is compared against."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir)


# The trainer runs' shared warm-start (tests/_train_runs.py), one per test run like the cache.
WARM_START_ROOT = RUN_ROOT / "warm-start"


@pytest.fixture(scope="session")
def warm_start() -> pathlib.Path:
    """The supervised warm-start the trainer-run tests start from (tests/_train_runs.py), built
    once per test run: the first xdist worker to ask builds it under an exclusive lock, and the
    other, asking later, reuses it."""
    import fcntl

    from _train_runs import build_warm_start

    WARM_START_ROOT.mkdir(parents=True, exist_ok=True)
    with open(WARM_START_ROOT / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = WARM_START_ROOT / "sft" / "SFT_DONE"
        return done.parent if done.exists() else build_warm_start(WARM_START_ROOT)


def pytest_configure(config):
    if not hasattr(config, "workerinput") and _OWNS_RUN_ROOT and config.option.basetemp is None:
        config.option.basetemp = str(RUN_ROOT / "pytest")  # tmp_path folders (xdist workers: below it)
        config._turnsight_tmp_before = _tmp_entries()


def _tmp_entries() -> set[str]:
    try:
        return set(os.listdir(_SYSTEM_TMP))
    except OSError:
        return set()


def pytest_sessionfinish(session, exitstatus):
    runs = sys.modules.get("_train_runs")  # this process's trainer worker (tests/_train_runs.py)
    if runs is not None and runs._WORKER is not None:
        runs._WORKER.close()
    if hasattr(session.config, "workerinput") or not _OWNS_RUN_ROOT:
        return
    # the controller (or a run without xdist), after every worker has finished
    if os.environ.get("TURNSIGHT_KEEP_TEST_TMP"):
        print(f"\nTURNSIGHT_KEEP_TEST_TMP: kept {RUN_ROOT}", file=sys.stderr)
        return
    shutil.rmtree(RUN_ROOT, ignore_errors=True)
    before = getattr(session.config, "_turnsight_tmp_before", None)
    left = sorted(_tmp_entries() - before) if before is not None else []
    if left:  # a process of the run wrote outside TMPDIR: name it, and fail the run in CI
        print(f"\nthe test run left {len(left)} entries in {_SYSTEM_TMP}: {left[:20]}", file=sys.stderr)
        if os.environ.get("CI", "").lower() not in ("", "0", "false") and session.exitstatus == 0:
            session.exitstatus = 1
