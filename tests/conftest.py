"""Shared test fixtures.

Tests that read `../shared/fixtures` (the Qwen3 tokenizer, FTRL sample rows) skip cleanly when
that folder is absent, as it is in a user's fresh clone.
"""

from __future__ import annotations

import os

# Eight fake CPU devices for the sharding tests; must be set before JAX initialises. Unsharded
# code runs on device 0 as usual.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import pathlib

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
    return shared_path("qwen3-tokenizer")


@pytest.fixture(scope="session")
def ftrl_sample_path() -> pathlib.Path:
    return shared_path("ftrl", "ftrl_test_sample.jsonl")
