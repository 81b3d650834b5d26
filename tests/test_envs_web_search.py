"""BFCL Web Search on a pluggable backend (envs/web_search.py, envs/bfcl.py, the BFCL harness).

- the offline corpus backend: ranking, snippets, fetch, and its file errors (hand-computed);
- `WebSearchTools` returns what bfcl-eval's own `WebSearchAPI` code returns, given the same
  search results and pages (its methods are read from the installed source with `ast` and run
  with SerpAPI / requests replaced by the corpus: the package's code, never model text);
- a Web Search question played through the harness with a policy that reads its observations:
  it finds the gold answer in a tiny corpus (the official agentic checker passes it), and fails
  when the corpus does not hold it; calls go through the BFCL whitelist.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import types

import pytest

from turnsight_jax.envs import web_search as W

PAGES = [
    {"url": "https://example.org/tea", "title": "The most expensive teas",
     "text": "Da Hong Pao is the most expensive tea in the world. It grows in the Wuyi Mountains of Fujian, China."},
    {"url": "https://example.org/forbes-china", "title": "Richest billionaire in China 2025",
     "text": "Forbes, April 2025. The richest billionaire in China is Zhang Yiming, founder of ByteDance."},
    {"url": "https://example.org/cats", "title": "Cats", "text": "Cats sleep a lot. Cats purr."},
]


def _write(path: pathlib.Path, rows) -> pathlib.Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------------------------------------
# The corpus backend
# ---------------------------------------------------------------------------------------------
def test_corpus_ranking_and_snippets():
    corpus = W.CorpusBackend(PAGES)
    # Terms (stop words "who", "is", "the", "in" dropped): richest, billionaire, china, tea.
    assert W.query_terms("Who is the richest billionaire in China tea") == ["richest", "billionaire", "china", "tea"]
    results = corpus.search("Who is the richest billionaire in China tea", 10, "wt-wt")
    # forbes-china: 3 distinct terms (richest, billionaire, china); tea page: 2 (china, tea); cats: 0.
    assert [r["href"] for r in results] == ["https://example.org/forbes-china", "https://example.org/tea"]
    # Snippet: the sentence with the most distinct terms ("The richest ..." has 3, "Forbes, ..." 0).
    assert results[0]["body"] == "The richest billionaire in China is Zhang Yiming, founder of ByteDance."
    # tea page: sentence 1 has "tea" (1), sentence 2 "china" (1): the first one wins the tie.
    assert results[1]["body"] == "Da Hong Pao is the most expensive tea in the world."
    assert results[1]["title"] == "The most expensive teas"
    # Same distinct count -> more occurrences first: "cats" occurs 3 times on the cats page.
    tie = W.CorpusBackend([PAGES[0], PAGES[2], {"url": "https://x.org/c", "title": "Cats", "text": "One."}])
    assert [r["href"] for r in tie.search("cats", 5, "wt-wt")] == ["https://example.org/cats", "https://x.org/c"]
    assert corpus.search("Who is the", 10, "wt-wt") == []  # only stop words: nothing matches
    assert len(corpus.search("china", 1, "wt-wt")) == 1  # max_results
    assert corpus.fetch("https://example.org/cats#:~:text=purr", "truncate") == "Cats sleep a lot. Cats purr."
    with pytest.raises(W.SearchError, match="https://example.org/dogs is not in the corpus"):
        corpus.fetch("https://example.org/dogs", "raw")


def test_corpus_file_errors_name_the_line_and_key(tmp_path):
    good = _write(tmp_path / "c.jsonl", PAGES)
    assert len(W.CorpusBackend.from_jsonl(good).pages) == 3
    cases = [
        (["{not json"], r"c.jsonl:1: invalid JSON"),
        ([PAGES[0], [1, 2]], r"c.jsonl:2: expected an object \{url, title, text\}, got list"),
        ([{"url": "https://a.org", "title": "A"}], r'c.jsonl:1: "text" must be a string, got None'),
        ([{"url": "ftp://a.org", "title": "A", "text": "t"}], r'c.jsonl:1: "url" must be an http\(s\) URL'),
        ([PAGES[0], PAGES[0]], r"c.jsonl:2: url 'https://example.org/tea' is also on line 1"),
        ([], r"the corpus has no pages"),
    ]
    for rows, message in cases:
        with pytest.raises(ValueError, match=message):
            W.CorpusBackend.from_jsonl(_write(tmp_path / "c.jsonl", rows))
    with pytest.raises(ValueError, match="no such corpus file"):
        W.load_backend(f"corpus:{tmp_path / 'missing.jsonl'}")


def test_load_backend_specs(tmp_path, monkeypatch):
    (tmp_path / "my_search.py").write_text(
        "class Backend:\n"
        "    def search(self, keywords, max_results, region):\n"
        "        return [{'title': 'T', 'href': 'https://t.org', 'body': keywords}]\n"
        "    def fetch(self, url, mode):\n"
        "        return url\n"
        "INSTANCE = Backend()\n"
        "def broken():\n"
        "    raise RuntimeError('no key')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert W.load_backend("my_search:Backend").search("q", 1, "wt-wt")[0]["body"] == "q"  # a class: instantiated
    assert W.load_backend("my_search:INSTANCE").fetch("https://a.org", "raw") == "https://a.org"
    assert isinstance(W.load_backend(f"corpus:{_write(tmp_path / 'c.jsonl', PAGES)}"), W.CorpusBackend)
    for spec, message in [("my_search", "expected corpus:PATH or module:attr"),
                          ("no_such_module_x:B", "cannot import module 'no_such_module_x'"),
                          ("my_search:Nope", "module 'my_search' has no attribute 'Nope'"),
                          ("my_search:broken", r"calling broken\(\) failed \(RuntimeError: no key\)"),
                          ("os:sep", r"str has no search\(keywords, max_results, region\) and fetch")]:
        with pytest.raises(ValueError, match=message):
            W.load_backend(spec)


# ---------------------------------------------------------------------------------------------
# WebSearchTools vs bfcl-eval's WebSearchAPI code
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def official_web_search_api():
    """bfcl-eval's WebSearchAPI class, its network calls answered from `PAGES`."""
    bfcl_eval = pytest.importorskip("bfcl_eval")
    path = pathlib.Path(bfcl_eval.__file__).parent / "eval_checker/multi_turn_eval/func_source_code/web_search.py"
    tree = ast.parse(path.read_text())
    # Everything but the imports of serpapi / requests / bs4 / html2text (not installed here).
    body = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    corpus = W.CorpusBackend(PAGES)

    class GoogleSearch:  # SerpAPI's client: DuckDuckGo's organic results, in rank order
        def __init__(self, params):
            self.params = params

        def get_dict(self):
            found = corpus.search(self.params["q"], len(PAGES), self.params["kl"])
            return {"organic_results": [{"title": r["title"], "link": r["href"], "snippet": r["body"]} for r in found]}

    def get(url, **kwargs):
        page = corpus._by_url.get(url.split("#", 1)[0])

        def raise_for_status():
            if page is None:
                raise RuntimeError(f"404 Client Error: Not Found for url: {url}")
        return types.SimpleNamespace(text=page["text"] if page else "", raise_for_status=raise_for_status)

    import os
    import random
    import time
    namespace = {"os": os, "random": random, "time": time, "Optional": object, "urlparse": None,
                 "GoogleSearch": GoogleSearch, "requests": types.SimpleNamespace(get=get)}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # the package's own code
    return namespace["WebSearchAPI"]


class _CorpusWith404(W.CorpusBackend):
    """The corpus backend, failing an unknown page with the error text the fake HTTP client uses."""

    def fetch(self, url, mode):
        if url.split("#", 1)[0] not in self._by_url:
            raise W.SearchError(f"404 Client Error: Not Found for url: {url}")
        return super().fetch(url, mode)


@pytest.mark.parametrize("show_snippet", [True, False])
def test_tools_return_what_bfcls_web_search_api_returns(official_web_search_api, show_snippet):
    official = official_web_search_api()
    official._load_scenario({"show_snippet": show_snippet})
    ours = W.WebSearchTools(_CorpusWith404(PAGES))
    ours._load_scenario({"show_snippet": show_snippet})
    for kwargs in [dict(keywords="richest billionaire china tea"), dict(keywords="china", max_results=1),
                   dict(keywords="cats", region="us-en"), dict(keywords="zzz")]:
        assert ours.search_engine_query(**kwargs) == official.search_engine_query(**kwargs), kwargs
    for kwargs in [dict(url="https://example.org/tea"), dict(url="https://example.org/cats#:~:text=purr", mode="raw"),
                   dict(url="https://example.org/dogs"), dict(url="https://example.org/tea", mode="pdf")]:
        assert ours.fetch_url_content(**kwargs) == official.fetch_url_content(**kwargs), kwargs
    with pytest.raises(ValueError, match="Invalid URL: file:///etc/passwd"):
        official.fetch_url_content("file:///etc/passwd")
    with pytest.raises(ValueError, match="Invalid URL: file:///etc/passwd"):
        ours.fetch_url_content("file:///etc/passwd")
    # Spelled out for the snippet variant: BFCL's result dicts, "body" only with snippets.
    first = ours.search_engine_query("richest billionaire")[0]
    assert first == ({"title": "Richest billionaire in China 2025", "href": "https://example.org/forbes-china"}
                     | ({"body": "The richest billionaire in China is Zhang Yiming, founder of ByteDance."}
                        if show_snippet else {}))


def test_backend_failures_become_bfcls_error_values():
    class Down:
        def search(self, keywords, max_results, region):
            raise W.SearchError("503 Server Error: Service Unavailable")

        def fetch(self, url, mode):
            return b"bytes"  # a buggy backend: not text

    tools = W.WebSearchTools(Down())
    assert tools.search_engine_query("x") == {"error": "503 Server Error: Service Unavailable"}
    assert tools.fetch_url_content("https://a.org") == {
        "error": "An error occurred while fetching https://a.org: the search backend returned bytes, not text"}
    with pytest.raises(TypeError, match="max_results must be an integer, got str"):
        tools.search_engine_query("x", max_results="3")


# ---------------------------------------------------------------------------------------------
# A Web Search question through BFCL's loop
# ---------------------------------------------------------------------------------------------
def _call(name, **arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


class ReadingPolicy:
    """A scripted policy that uses what it is shown: it searches the question's key words, fetches
    the first result, and answers with the "X is NAME," phrase of the page (or "I do not know")."""

    def __init__(self):
        self.step = {}

    def reply(self, conv) -> str:
        k = self.step.get(conv.task.task_id, 0)
        self.step[conv.task.task_id] = k + 1
        last = conv.messages[-1]["content"]
        if k == 0:
            return _call("search_engine_query", keywords="richest billionaire China")
        if k == 1:
            hrefs = re.findall(r"'href': '([^']+)'", last)
            return _call("fetch_url_content", url=hrefs[0]) if hrefs else "{'answer': 'I do not know'}"
        found = re.search(r"China is ([A-Z][a-z]+ [A-Z][a-z]+),", last)
        answer = found.group(1) if found else "I do not know"
        return json.dumps({"answer": answer, "context": "the fetched page"})


def _play_web_search(category, pages):
    from turnsight_jax.envs import bfcl
    from turnsight_jax.eval import bfcl_harness as H

    (task,) = bfcl.load_web_search_tasks(category, limit=1)  # web_search_*_0: gold "Zhang Yiming"
    episode = bfcl.BFCLEnv().start(task, search_backend=W.CorpusBackend(pages))
    conv = H.Conversation(task, episode, enable_thinking=False)
    policy = ReadingPolicy()
    while conv.active:
        conv.feed(policy.reply(conv))
    return conv


@pytest.mark.parametrize("category", ["web_search_base", "web_search_no_snippet"])
def test_reading_policy_finds_the_gold_answer_in_the_corpus(category):
    pytest.importorskip("bfcl_eval")
    conv = _play_web_search(category, PAGES)
    steps = conv.turns[0]
    assert [len(s.calls or []) for s in steps] == [1, 1, 0]
    # The observations as BFCL's executor writes them: str() of the result list, json of the dict.
    hits = [{"title": "Richest billionaire in China 2025", "href": "https://example.org/forbes-china",
             "body": "The richest billionaire in China is Zhang Yiming, founder of ByteDance."},
            {"title": "The most expensive teas", "href": "https://example.org/tea",
             "body": "It grows in the Wuyi Mountains of Fujian, China."}]
    if category == "web_search_no_snippet":
        hits = [{k: h[k] for k in ("title", "href")} for h in hits]
    assert steps[0].results == [str(hits)]
    assert steps[1].results == [json.dumps({"content": PAGES[1]["text"]})]
    assert conv.verdict() == {"valid": True, "error": []}  # agentic_checker found "Zhang Yiming"
    # The system prompt is BFCL's answer-format instruction.
    assert conv.messages[0]["content"].startswith("For your final answer to the user, you must respond in this format")


def test_corpus_without_the_answer_fails_and_private_names_are_refused():
    pytest.importorskip("bfcl_eval")
    conv = _play_web_search("web_search_base", [PAGES[0]])  # only the tea page
    assert json.loads(conv.turns[0][-1].text)["answer"] == "I do not know"
    verdict = conv.verdict()
    assert (verdict["valid"], verdict["error_type"]) == (False, "agentic:answer_not_found")
    # The whitelist: only the two documented tools run; the backend object is out of reach.
    from turnsight_jax.chat.types import ToolCall
    from turnsight_jax.envs import bfcl

    (task,) = bfcl.load_web_search_tasks("web_search_base", limit=1)
    episode = bfcl.BFCLEnv().start(task, search_backend=W.CorpusBackend(PAGES))
    out = episode.step([ToolCall("_backend", {}), ToolCall("_load_scenario", {"initial_config": {}}),
                        ToolCall("fetch_url_content", {"url": "https://example.org/cats"})])
    assert out.observations == ("Error during execution: name '_backend' is not defined",
                                "Error during execution: name '_load_scenario' is not defined",
                                json.dumps({"content": "Cats sleep a lot. Cats purr."}))
    with pytest.raises(ValueError, match="web_search_base_0: a Web Search entry needs a search backend"):
        bfcl.BFCLEnv().start(task)
