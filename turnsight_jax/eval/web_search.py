"""The search backend interface for BFCL's Web Search subset (agentic; 100 questions x {with,
without snippets} = 200 entries).

BFCL's WebSearchAPI calls SerpAPI and fetches live pages: it cannot run offline, and its results
are never faked here. A backend is a named factory registered with `register_backend`; the
evaluate CLI's `--bfcl-search-backend NAME` selects one. No backend ships with the project, so
today the subset is listed as "not run" in the report (and left out of the BFCL average, which
says which subsets it covers). Wiring a registered backend into the Web Search episodes is the
remaining work (see docs/evaluation.md); the interface is what such a backend implements.
"""

from __future__ import annotations

from typing import Callable, Protocol


class SearchBackend(Protocol):
    """What BFCL's two web tools need (`search_engine_query`, `fetch_url_content`)."""

    def search(self, keywords: str, max_results: int, region: str) -> list[dict]:
        """Results in rank order: {"title", "href", "body"} dicts."""

    def fetch(self, url: str, mode: str) -> str:
        """Page content of `url` ("raw", "markdown" or "truncate" as BFCL's tool documents)."""


_BACKENDS: dict[str, Callable[[], SearchBackend]] = {}


def register_backend(name: str, factory: Callable[[], SearchBackend]) -> None:
    if not name or name in _BACKENDS:
        raise ValueError(f"search backend name {name!r} is empty or already registered")
    _BACKENDS[name] = factory


def get_backend(name: str) -> SearchBackend:
    """The registered backend `name`; KeyError naming the registered ones (none ship)."""
    if name not in _BACKENDS:
        known = ", ".join(sorted(_BACKENDS)) or "none are registered"
        raise KeyError(f"unknown search backend {name!r} ({known}; see turnsight_jax/eval/web_search.py)")
    return _BACKENDS[name]()
