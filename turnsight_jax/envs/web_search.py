"""BFCL's Web Search subset with a pluggable search backend (agentic; 100 questions x {base,
no_snippet} = 200 entries).

BFCL's own `WebSearchAPI` (bfcl-eval 2026.3.23, `func_source_code/web_search.py`) queries SerpAPI's
DuckDuckGo engine and downloads live pages (it needs `SERPAPI_API_KEY`, network access and the
`serpapi`, `requests`, `bs4`, `html2text` packages). Here the two tools it documents run on a
*backend* the user chooses, and nothing is ever faked: without a backend the subset is not run.

* `SearchBackend`: what a backend implements, `search(keywords, max_results, region)` -> ranked
  {"title", "href", "body"} dicts and `fetch(url, mode)` -> page text; it raises `SearchError`
  for an expected failure (no such page, a network error), which the model sees as BFCL's error
  value.
* `WebSearchTools`: BFCL's `WebSearchAPI` with the backend plugged in: the same method names,
  parameters, defaults and return values (`search_engine_query` -> a list of result dicts, without
  "body" for the no_snippet variant, or {"error": ...}; `fetch_url_content` -> {"content": ...} or
  {"error": "An error occurred while fetching URL: ..."}; a URL that is not http(s) raises, as
  BFCL's does). `envs/bfcl.py` instantiates it for entries involving `WebSearchAPI`, so its
  methods are dispatched through the same whitelist as every BFCL class.
* `CorpusBackend`: the shipped backend, offline: pages from a user-supplied JSONL of
  {"url", "title", "text"} objects (see the class for its ranking and snippet rules).
* `load_backend(spec)`: the evaluate CLI's `--bfcl-search-backend` value, `corpus:PATH` or
  `module:attr` (an importable object with `search` and `fetch`, or a class / factory called
  without arguments that returns one).

Scoring needs nothing online: BFCL's `agentic_checker` looks for one of the question's accepted
answers in the last step that is not a call (pure string matching, as for Memory).
"""

from __future__ import annotations

import importlib
import json
import pathlib
import re
from typing import Any, Protocol

FETCH_MODES = ("raw", "markdown", "truncate")  # what BFCL's fetch_url_content accepts


class SearchError(Exception):
    """An expected backend failure (unknown page, network error): shown to the model as BFCL's
    error value, not raised."""


class SearchBackend(Protocol):
    """What BFCL's two web tools need (`search_engine_query`, `fetch_url_content`)."""

    def search(self, keywords: str, max_results: int, region: str) -> list[dict]:
        """At most `max_results` results in rank order: {"title", "href", "body"} dicts of str."""

    def fetch(self, url: str, mode: str) -> str:
        """Content of `url` in `mode` ("raw", "markdown" or "truncate", as BFCL's tool documents)."""


class WebSearchTools:
    """BFCL's `WebSearchAPI` on a `SearchBackend` (same public methods; see the module docstring).

    Public methods are exactly BFCL's two tools: everything else is private, so the episode's
    whitelist (documented names that are public methods) admits nothing more."""

    def __init__(self, backend: SearchBackend):
        self._backend = backend
        self._show_snippet = True

    def _load_scenario(self, initial_config: dict, long_context: bool = False) -> None:
        # BFCL's initial config of the subset: show_snippet False for web_search_no_snippet.
        self._show_snippet = bool(initial_config["show_snippet"])

    def search_engine_query(self, keywords: str, max_results: int = 10, region: str = "wt-wt"):
        if not isinstance(keywords, str):
            raise TypeError(f"keywords must be a string, got {type(keywords).__name__}")
        if isinstance(max_results, bool) or not isinstance(max_results, int):
            raise TypeError(f"max_results must be an integer, got {type(max_results).__name__}")
        if not isinstance(region, str):
            raise TypeError(f"region must be a string, got {type(region).__name__}")
        try:
            found = self._backend.search(keywords, max_results, region)
        except Exception as e:  # noqa: BLE001 - BFCL returns a failed query's error as the result
            return {"error": str(e)}
        results = []
        for rank, item in enumerate(list(found)[:max(max_results, 0)]):
            if not (isinstance(item, dict) and all(isinstance(item.get(k), str) for k in ("title", "href", "body"))):
                return {"error": f"search backend result {rank} is not a {{title, href, body}} dict of strings"}
            result = {"title": item["title"], "href": item["href"]}
            if self._show_snippet:
                result["body"] = item["body"]
            results.append(result)
        return results

    def fetch_url_content(self, url: str, mode: str = "raw"):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"Invalid URL: {url}")  # BFCL raises this one (an execution error)
        try:
            if mode not in FETCH_MODES:
                raise ValueError(f"Unsupported mode: {mode}")
            content = self._backend.fetch(url, mode)
            if not isinstance(content, str):
                raise TypeError(f"the search backend returned {type(content).__name__}, not text")
            return {"content": content}
        except Exception as e:  # noqa: BLE001 - BFCL wraps every fetch failure in this error value
            return {"error": f"An error occurred while fetching {url}: {e}"}


# ---------------------------------------------------------------------------------------------
# The offline corpus backend
# ---------------------------------------------------------------------------------------------
_WORD = re.compile(r"[a-z0-9]+")
# Words too common to rank by (a query term must say something about the page).
_STOPWORDS = frozenset(
    "a an and are as at be by did do does for from had has have how in is it of on or that the this "
    "to was were what when where which who whom whose why with".split())
SNIPPET_CHARS = 300


def query_terms(text: str) -> list[str]:
    """Distinct lower-cased alphanumeric words of `text` minus `_STOPWORDS`, in first-seen order."""
    seen: dict[str, None] = {}
    for word in _WORD.findall(text.lower()):
        if word not in _STOPWORDS:
            seen.setdefault(word, None)
    return list(seen)


def _sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+|\n+", text) if s.strip()]


class CorpusBackend:
    """Search and fetch over a fixed set of pages: `pages` = [{"url", "title", "text"}, ...].

    Ranking: a page's score is the number of distinct query terms (`query_terms`) among its title
    and text words, then the total count of those terms' occurrences; pages scoring 0 are not
    results; ties keep corpus order. Snippet ("body"): the first sentence of the text with the most
    distinct query terms, cut to `SNIPPET_CHARS` characters. `region` is ignored (one corpus).
    Fetch: the page whose url equals `url` without its "#fragment" (BFCL's source links carry
    text fragments); every mode returns the page's text (a corpus holds text, not HTML); an
    unknown url is a `SearchError`."""

    def __init__(self, pages: list[dict[str, str]]):
        self.pages = list(pages)
        self._by_url = {p["url"]: p for p in self.pages}
        self._words = [_WORD.findall((p["title"] + " " + p["text"]).lower()) for p in self.pages]

    @classmethod
    def from_jsonl(cls, path) -> "CorpusBackend":
        """Reads {"url", "title", "text"} lines; errors name the file, line and key."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise ValueError(f"{path}: no such corpus file (JSONL of {{url, title, text}} pages)")
        pages, lines = [], {}
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: invalid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{where}: expected an object {{url, title, text}}, got {type(row).__name__}")
                for key in ("url", "title", "text"):
                    if not isinstance(row.get(key), str):
                        raise ValueError(f"{where}: \"{key}\" must be a string, got {row.get(key)!r:.60}")
                if not row["url"].startswith(("http://", "https://")) or "#" in row["url"]:
                    raise ValueError(f"{where}: \"url\" must be an http(s) URL without a #fragment, "
                                     f"got {row['url']!r:.80}")
                if row["url"] in lines:
                    raise ValueError(f"{where}: url {row['url']!r:.80} is also on line {lines[row['url']]}")
                lines[row["url"]] = lineno
                pages.append({k: row[k] for k in ("url", "title", "text")})
        if not pages:
            raise ValueError(f"{path}: the corpus has no pages")
        return cls(pages)

    def _snippet(self, text: str, terms: set[str]) -> str:
        best, best_n = "", 0
        for sentence in _sentences(text):
            n = len(terms & set(_WORD.findall(sentence.lower())))
            if n > best_n:
                best, best_n = sentence, n
        return best[:SNIPPET_CHARS]

    def search(self, keywords: str, max_results: int, region: str) -> list[dict]:
        terms = query_terms(keywords)
        scored = []
        for index, (page, words) in enumerate(zip(self.pages, self._words)):
            distinct = sum(1 for t in terms if t in words)
            if distinct:
                scored.append((-distinct, -sum(words.count(t) for t in terms), index, page))
        scored.sort(key=lambda s: s[:3])
        return [{"title": p["title"], "href": p["url"], "body": self._snippet(p["text"], set(terms))}
                for *_, p in scored[:max_results]]

    def fetch(self, url: str, mode: str) -> str:
        page = self._by_url.get(url.split("#", 1)[0])
        if page is None:
            raise SearchError(f"{url.split('#', 1)[0]} is not in the corpus")
        return page["text"]


# ---------------------------------------------------------------------------------------------
# Selecting a backend
# ---------------------------------------------------------------------------------------------
CORPUS_PREFIX = "corpus:"


def _is_backend(obj: Any) -> bool:
    return callable(getattr(obj, "search", None)) and callable(getattr(obj, "fetch", None))


def load_backend(spec: str) -> SearchBackend:
    """The backend `spec` names: "corpus:PATH" (a `CorpusBackend` of that JSONL file) or
    "module:attr" (importable; an object with `search` and `fetch`, or a class / factory that,
    called without arguments, returns one). Raises ValueError with a one-line reason."""
    if spec.startswith(CORPUS_PREFIX):
        return CorpusBackend.from_jsonl(spec[len(CORPUS_PREFIX):])
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r}: expected corpus:PATH or module:attr")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{spec!r}: cannot import module {module_name!r} ({e})") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type) or (callable(obj) and not _is_backend(obj)):
        try:
            obj = obj()
        except Exception as e:  # noqa: BLE001 - the user's factory: report it in one line
            raise ValueError(f"{spec!r}: calling {attr}() failed ({type(e).__name__}: {e})") from None
    if not _is_backend(obj):
        raise ValueError(f"{spec!r}: {type(obj).__name__} has no search(keywords, max_results, region) and "
                         f"fetch(url, mode) methods")
    return obj
