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

# The suite compiles far more than it computes (tiny models, hundreds of distinct programs), so
# XLA's CPU backend runs at optimisation level 0 in tests: ~30% less compile time, same results to
# float tolerance (the pinned step numbers hold). Subprocesses the tests start (the CLI, documented
# commands, the notebook kernel) get SUBPROCESS_XLA_FLAGS: one CPU device, as a user's machine.
SUBPROCESS_XLA_FLAGS = "--xla_backend_optimization_level=0"
# A program a test runs on large inputs or many times (measured: the packed-vs-plain view check
# spends 3-4x longer executing at level 0 than at full optimisation) opts back in per jit:
# `jax.jit(f, compiler_options=OPTIMIZED)`.
OPTIMIZED = {"xla_backend_optimization_level": 3}
# Eight fake CPU devices for the sharding tests; must be set before JAX initialises. Unsharded
# code runs on device 0 as usual.
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {SUBPROCESS_XLA_FLAGS}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import pathlib
import shutil
import tempfile

# One persistent JAX compilation cache for the whole test run: both xdist workers and every
# subprocess they start (the CLI, documented commands, the notebook's kernel) inherit it, so a
# program compiled by one test is loaded, not recompiled, by the next. Fresh per run (the xdist
# run id), removed at the end.
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid{os.getpid()}"
JAX_CACHE = pathlib.Path(tempfile.gettempdir()) / f"turnsight-jax-test-cache-{_RUN_ID}"
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


# The suite's files by CPU seconds, most first (measured on the 2-core box with `-p` a per-test
# rusage plugin, BENCHMARKS.md "Test suite"). `pyproject.toml` runs xdist with
# `--no-loadscope-reorder`, so files are handed to the two workers in this order: longest first,
# the many small files fill the end, and both workers finish together. xdist's own order (most
# *tests* first) put the few-test, heavy files (training runs, the notebook, the 8-device dry run)
# last, where one worker ran them alone for ~45 s while the other core idled.
HEAVIEST_FIRST = (
    # the trainer runs on the shared warm-start: the first builds it (~100 s), the second file
    # comes late enough to find it built
    "test_baselines_train.py", "test_docs.py", "test_rl_step.py", "test_signal_train.py", "test_train.py",
    "test_rollout_train.py", "test_rollout_methods_train.py", "test_mm_grpo_train.py", "test_rl_distill_step.py",
    "test_rl_critic_step.py", "test_slim.py", "test_orchard.py", "test_judge.py", "test_rl_packing.py",
    "test_rollout_engine.py", "test_rollout_control.py", "test_mm_grpo.py", "test_rl_step_pinned.py",
    "test_records_viewer.py", "test_custom_method.py", "test_models_qwen3.py", "test_sft.py", "test_eval_heldout.py",
    "test_rollout_sampler.py", "test_rl_views.py", "test_evaluate.py", "test_rl_turnsight_reference.py",
    "test_paper_configs.py", "test_notebook.py", "test_rl_advantages.py", "test_rl_advantages_properties.py",
    "test_rl_unequal_groups.py", "test_rl_logprobs.py", "test_chat_parsing.py", "test_rollout_driver.py",
    "test_rollout_methods.py", "test_envs_bfcl.py", "test_sandbox.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: k for k, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_unexpected_skip(outcome.get_result())


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
WARM_START_ROOT = pathlib.Path(tempfile.gettempdir()) / f"turnsight-jax-test-warm-start-{_RUN_ID}"


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


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist)
        shutil.rmtree(JAX_CACHE, ignore_errors=True)
        shutil.rmtree(WARM_START_ROOT, ignore_errors=True)
