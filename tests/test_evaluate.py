"""`python -m turnsight_jax.evaluate` end to end, run in-process through `main(argv)`.

- BFCL ground truth replayed through the CLI passes the official checker on every entry;
- FTRL fixture rows with scripted calls give the hand-computed Solve-P/R/F1 per category;
- a tiny random model gives identical tables on two runs (greedy, deterministic);
- input errors exit with status 2 and a one-line message, before any heavy work.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

from turnsight_jax import evaluate
from turnsight_jax.eval.suites import BFCL_CATEGORIES, FTRL_CATEGORIES

HAS_BFCL = importlib.util.find_spec("bfcl_eval") is not None
needs_bfcl = pytest.mark.skipif(not HAS_BFCL, reason="bfcl-eval is not installed")


def run_cli(argv, capsys):
    code = evaluate.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def read_results(out_dir: pathlib.Path) -> tuple[dict, list[dict]]:
    results = json.loads((out_dir / "results.json").read_text())
    examples = [json.loads(line) for line in (out_dir / "examples.jsonl").read_text().splitlines()]
    return results, examples


# ---------------------------------------------------------------------------------------------
# BFCL: the ground truth passes the official checker through the whole evaluation path
# ---------------------------------------------------------------------------------------------
@needs_bfcl
def test_bfcl_gold_replay_scores_100_percent(tmp_path, capsys):
    code, out, err = run_cli(["--replay", "gold", "--benchmarks", "bfcl", "--bfcl-limit", 10, "--out", tmp_path],
                             capsys)
    assert code == 0, err
    results, examples = read_results(tmp_path)
    bfcl = results["benchmarks"]["bfcl"]
    # Web Search has no backend here: not run, and not a column.
    assert list(bfcl["categories"]) == [key for key, _ in BFCL_CATEGORIES if key != "web_search"]
    for key, cat in bfcl["categories"].items():
        # Memory: the first 10 questions of each offline backend (kv, rec_sum).
        assert (cat["n"], cat["accuracy"]) == (20 if key == "memory" else 10, 1.0), key
    assert bfcl["score"] == 1.0 and results["overall"] == 1.0
    assert len(examples) == 60
    assert all(e["metrics"]["bfcl_pass"] == 1.0 and e["finish_reason"] == "answer" for e in examples)
    # The Table 1 row as printed, and which subsets the average covers.
    assert "| replay: gold | 100.00 | 100.00 | 100.00 | 100.00 | 100.00 | 100.00 |" in out
    assert ("| Model | Base | Missing Function | Missing Parameter | Long Context | Memory (kv, rec_sum) | Avg |"
            in out)
    assert ("Avg over: Base, Missing Function, Missing Parameter, Long Context, Memory (kv, rec_sum). Not run: "
            "Memory (vector) (needs a local embedding model: --bfcl-memory-embedding-model DIR); Web Search "
            "(base, no_snippet) (needs a search backend: --bfcl-search-backend corpus:PATH or module:attr).\n"
            in out)
    assert bfcl["not_run"] == {
        "Memory (vector)": "needs a local embedding model: --bfcl-memory-embedding-model DIR",
        "Web Search (base, no_snippet)": "needs a search backend: --bfcl-search-backend corpus:PATH or module:attr"}
    assert bfcl["not_selected"] == []  # the default: every subset of the paper's average
    assert "BFCL categories: multi_turn_base, multi_turn_miss_func, multi_turn_miss_param, " \
           "multi_turn_long_context, memory_kv, memory_rec_sum, memory_vector, web_search_base, " \
           "web_search_no_snippet.\n" in out
    # Each example carries the decoded conversation and the executed calls with their results.
    first = examples[0]
    assert first["task_id"] == "multi_turn_base_0" and first["category"] == "multi_turn_base"
    assert first["text"].startswith("<|im_start|>system") and "<tool_response>" in first["text"]
    calls = [c for t in first["turns"] for c in t["calls"]]
    assert len(calls) == first["metrics"]["num_calls"] > 0
    assert all(len(t["results"]) == len(t["calls"]) for t in first["turns"])
    assert "examples" in err  # the progress line


@needs_bfcl
def test_bfcl_categories_select_the_subsets_run(tmp_path, capsys):
    # bfcl-eval's names, a group ("multi_turn" would be all four): base, kv Memory, no_snippet Web Search.
    code, out, err = run_cli(["--replay", "gold", "--benchmarks", "bfcl", "--bfcl-limit", 2, "--quiet",
                              "--bfcl-categories", "multi_turn_base, memory_kv,web_search_no_snippet",
                              "--out", tmp_path], capsys)
    assert code == 0, err
    results, examples = read_results(tmp_path)
    bfcl = results["benchmarks"]["bfcl"]
    assert {k: (c["label"], c["n"], c["accuracy"]) for k, c in bfcl["categories"].items()} == {
        "multi_turn_base": ("Base", 2, 1.0), "memory": ("Memory (kv)", 2, 1.0)}
    assert [e["task_id"] for e in examples] == ["multi_turn_base_0", "multi_turn_base_1",
                                                "memory_kv_0-customer-0", "memory_kv_1-customer-1"]
    assert bfcl["not_run"] == {"Web Search (no_snippet)":
                               "needs a search backend: --bfcl-search-backend corpus:PATH or module:attr"}
    assert bfcl["not_selected"] == ["Missing Function", "Missing Parameter", "Long Context"]
    assert results["settings"]["bfcl_categories"] == ["multi_turn_base", "memory_kv", "web_search_no_snippet"]
    assert ("Avg over: Base, Memory (kv). Not run: Web Search (no_snippet) (needs a search backend: "
            "--bfcl-search-backend corpus:PATH or module:attr). Not selected (--bfcl-categories): Missing "
            "Function, Missing Parameter, Long Context.\n" in out)
    assert "| Model | Base | Memory (kv) | Avg |" in out


@needs_bfcl
def test_bfcl_category_errors(tmp_path, capsys):
    code, _, err = run_cli(["--replay", "gold", "--benchmarks", "bfcl", "--bfcl-categories", "base,memory"], capsys)
    assert code == 2
    assert _error_line(err) == (
        "error: unknown BFCL category 'base' in --bfcl-categories; valid categories: multi_turn_base, "
        "multi_turn_miss_func, multi_turn_miss_param, multi_turn_long_context, memory_kv, memory_rec_sum, "
        "memory_vector, web_search_base, web_search_no_snippet (groups: multi_turn, memory, web_search, all)")
    # Nothing selected can run: said in one line, not an empty table.
    code, _, err = run_cli(["--replay", "gold", "--benchmarks", "bfcl", "--bfcl-categories", "web_search"], capsys)
    assert code == 2
    assert _error_line(err) == (
        "error: --bfcl-categories web_search_base,web_search_no_snippet: none of the selected BFCL subsets can "
        "run (Web Search (base, no_snippet): needs a search backend: --bfcl-search-backend corpus:PATH or "
        "module:attr)")
    code, _, err = run_cli(["--replay", "gold", "--benchmarks", "bfcl", "--bfcl-categories", "web_search",
                            "--bfcl-search-backend", "no_such_module_x:Backend"], capsys)
    assert code == 2
    assert _error_line(err).startswith("error: --bfcl-search-backend 'no_such_module_x:Backend': cannot import "
                                       "module 'no_such_module_x'")


WEB_PAGES = [
    {"url": "https://example.org/tea", "title": "The most expensive teas",
     "text": "Da Hong Pao is the most expensive tea in the world. It grows in Fujian, China."},
    {"url": "https://example.org/forbes-china", "title": "Richest billionaire in China 2025",
     "text": "Forbes, April 2025. The richest billionaire in China is Zhang Yiming, founder of ByteDance."},
]


@needs_bfcl
def test_web_search_corpus_backend_end_to_end(tmp_path, capsys):
    """web_search_*_0 (gold answer "Zhang Yiming") with a two-page corpus: the base question's
    script searches, fetches the page and answers from it; the no_snippet one answers wrongly.
    Scored by BFCL's agentic_checker: 1 of 2, the Web Search column 50.00."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(p) + "\n" for p in WEB_PAGES))
    search = _call("search_engine_query", keywords="richest billionaire China")
    fetch = _call("fetch_url_content", url="https://example.org/forbes-china", mode="truncate")
    scripts = [
        {"task_id": "web_search_base_0", "turns": [search, fetch, '{"answer": "Zhang Yiming", "context": "Forbes"}']},
        {"task_id": "web_search_no_snippet_0", "turns": [search, '{"answer": "Da Hong Pao", "context": "tea"}']},
    ]
    script_file = tmp_path / "scripts.jsonl"
    script_file.write_text("".join(json.dumps(s) + "\n" for s in scripts))
    code, out, err = run_cli(["--replay", script_file, "--benchmarks", "bfcl", "--bfcl-categories", "web_search",
                              "--bfcl-limit", 1, "--bfcl-search-backend", f"corpus:{corpus}", "--quiet",
                              "--out", tmp_path / "out"], capsys)
    assert code == 0, err
    results, examples = read_results(tmp_path / "out")
    bfcl = results["benchmarks"]["bfcl"]
    assert {k: (c["label"], c["n"], c["accuracy"]) for k, c in bfcl["categories"].items()} == {
        "web_search": ("Web Search (base, no_snippet)", 2, 0.5)}
    assert bfcl["not_run"] == {} and bfcl["score"] == 0.5
    base, no_snippet = examples
    assert base["task_id"] == "web_search_base_0"
    assert (base["metrics"]["bfcl_pass"], base["metrics"]["num_calls"]) == (1.0, 2)
    # Ranked by distinct query terms: forbes-china has richest, billionaire, china (3), tea only china (1).
    assert base["turns"][0]["results"] == [str([
        {"title": "Richest billionaire in China 2025", "href": "https://example.org/forbes-china",
         "body": "The richest billionaire in China is Zhang Yiming, founder of ByteDance."},
        {"title": "The most expensive teas", "href": "https://example.org/tea",
         "body": "It grows in Fujian, China."}])]
    assert base["turns"][1]["results"] == [json.dumps({"content": WEB_PAGES[1]["text"]})]
    assert no_snippet["turns"][0]["results"] == [str([
        {"title": "Richest billionaire in China 2025", "href": "https://example.org/forbes-china"},
        {"title": "The most expensive teas", "href": "https://example.org/tea"}])]
    assert no_snippet["metrics"]["bfcl_pass"] == 0.0
    assert no_snippet["metrics"]["error_type"] == "agentic:answer_not_found"
    assert "| replay: scripts.jsonl | 50.00 |" in out


@needs_bfcl
@pytest.mark.slow
def test_bfcl_gold_replay_all_800_entries(tmp_path, capsys):
    # Some long-context gold conversations need more than the default 32,768 tokens of context
    # after the first prompt; with room for them every entry of every category passes (and the
    # 310 offline Memory questions).
    code, _, err = run_cli(["--replay", "gold", "--benchmarks", "bfcl", "--bfcl-max-response-tokens", 70_000,
                            "--batch-size", 200, "--quiet", "--out", tmp_path], capsys)
    assert code == 0, err
    results, _ = read_results(tmp_path)
    cats = results["benchmarks"]["bfcl"]["categories"]
    assert {k: (c["n"], c["accuracy"]) for k, c in cats.items()} == {
        **{k: (200, 1.0) for k, _ in BFCL_CATEGORIES[:4]}, "memory": (310, 1.0)}


# ---------------------------------------------------------------------------------------------
# FTRL: scripted calls on the fixture rows, scores computed by hand
# ---------------------------------------------------------------------------------------------
def _call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# Per fixture row (in file order): (data_source, turns, well-formed calls, calls whose output
# contains a still-unsolved gold answer of their own tool). The hits were read off each tool's
# source in the fixture; a repeated hit on a consumed answer does not count again.
FTRL_SCRIPTS = [
    ("self/multi_hop", [_call("port_amenity_locator", amenity="bait store"), "<answer>Salmon</answer>"], 1, 1),
    ("self/multi_hop", [_call("rental_price_analyzer"), "<answer>Flamenco</answer>"], 1, 0),  # a distractor
    ("self/multi_hop", [_call("historical_event_finder", event_type="terrorist attack",
                              date="2015-06-01 to 2015-06-30", location="Kuwait"),
                        _call("historical_event_finder", event_type="flood", date="2015"),  # error text
                        "<answer>73.5 years</answer>"], 2, 1),
    ("self/parallel_multi_hop", [_call("mountain_range_analyzer", query_type="highest_peak"), "<answer>?</answer>"],
     1, 1),
    ("self/parallel_multi_hop", [_call("invention_inventor_lookup", invention="telephone"),
                                 _call("invention_inventor_lookup", invention="telephone"),  # already solved
                                 "<answer>?</answer>"], 2, 1),
    ("self/parallel_multi_hop", [_call("cultural_heritage_locator", heritage_type="music")
                                 + "\n<tool_call>{not json</tool_call>",  # malformed: not counted
                                 "<answer>?</answer>"], 1, 0),
    ("self/parallel_single_hop", [_call("unified_specification_retriever", brand="Apple", model="latest",
                                        specification="storage") + "\n"
                                  + _call("unified_specification_retriever", brand="Samsung", model="latest",
                                          specification="storage"),
                                  "<answer>2048</answer>"], 2, 2),
    ("self/parallel_single_hop", ["<answer>11</answer>"], 0, 0),  # no calls: Solve-P = 1 by definition
    ("self/parallel_single_hop", [_call("product_specification_retriever", product_name="Herman Miller Aeron chair",
                                        attribute="weight capacity") + "\n"
                                  + _call("product_specification_retriever", product_name="Steelcase Gesture chair",
                                          attribute="color"),
                                  "<answer>340 kg</answer>"], 2, 1),
    ("self/single_hop", [_call("historical_event_search", person="George W. Bush", event_type="speech",
                               location="Islamic Center of Washington",
                               date_range={"start_date": "2001-09-01", "end_date": "2001-09-30"}) + "\n"
                         + _call("historical_event_search", person="George W. Bush", event_type="speech",
                                 location="Islamic Center of Washington",
                                 date_range={"start_date": "2001-09-01", "end_date": "2001-09-30"}),
                         "<answer>2001-9-17</answer>"], 2, 1),
    ("self/single_hop", [_call("historical_weather_data_retriever", event_name="Hurricane Otis", date="2023-10-25",
                               location="Mexico", parameter="wind speed", unit="km/h"),
                         _call("historical_weather_data_retriever", event_name="Hurricane Otis", date="2023-10-25",
                               location="Mexico", parameter="wind speed", unit="mph"),
                         "<answer>165</answer>"], 2, 1),
    ("self/single_hop", [_call("agreement_lookup", year=2001), "<answer>?</answer>"], 1, 0),  # unknown tool
]


def test_ftrl_scripted_replay_matches_hand_computed_table(ftrl_sample_path, tmp_path, capsys):
    rows = [json.loads(line) for line in ftrl_sample_path.read_text().splitlines() if line.strip()]
    assert [r["data_source"] for r in rows] == [s[0] for s in FTRL_SCRIPTS]
    # The loader names rows "<file stem>:<line>" when they have no id.
    ids = [str(r.get("id", f"{ftrl_sample_path.stem}:{i}")) for i, r in enumerate(rows)]
    script_file = tmp_path / "scripts.jsonl"
    script_file.write_text("".join(json.dumps({"task_id": i, "turns": s[1]}) + "\n" for i, s in zip(ids, FTRL_SCRIPTS)))

    # Expected numbers from the fixture's unsolved_set and the scripts alone.
    expected: dict[str, list[tuple[float, float, float]]] = {}
    for row, (source, _, calls, solved) in zip(rows, FTRL_SCRIPTS):
        gold = sum(len(v) for v in json.loads(row["unsolved_set"]).values())
        p = solved / calls if calls else 1.0
        expected.setdefault(source.split("/")[1], []).append((p, solved / gold, 2 * solved / (calls + gold)))
    means = {cat: [sum(x[j] for x in v) / len(v) for j in range(3)] for cat, v in expected.items()}

    out_dir = tmp_path / "out"
    code, out, err = run_cli(["--replay", script_file, "--benchmarks", "ftrl", "--ftrl", ftrl_sample_path,
                              "--batch-size", 5, "--out", out_dir], capsys)
    assert code == 0, err
    results, examples = read_results(out_dir)
    ftrl = results["benchmarks"]["ftrl"]
    assert list(ftrl["categories"]) == [key for key, _ in FTRL_CATEGORIES]
    for cat, (p, r, f1) in means.items():
        got = ftrl["categories"][cat]
        assert got["n"] == 3
        assert got["solve_p"] == pytest.approx(p, abs=1e-12), cat
        assert got["solve_r"] == pytest.approx(r, abs=1e-12), cat
        assert got["solve_f1"] == pytest.approx(f1, abs=1e-12), cat
    avg = [sum(means[c][j] for c in means) / 4 for j in range(3)]
    assert [ftrl["average"][k] for k in ("solve_p", "solve_r", "solve_f1")] == pytest.approx(avg, abs=1e-12)
    assert ftrl["score"] == pytest.approx(sum(avg) / 3, abs=1e-12)
    assert results["overall"] == pytest.approx(ftrl["score"], abs=1e-12)
    # Spot values: single-hop P = (1/2 + 1/2 + 0)/3, F1 = (2/3 + 2/3 + 0)/3.
    assert ftrl["categories"]["single_hop"]["solve_p"] == pytest.approx(1 / 3)
    assert ftrl["categories"]["single_hop"]["solve_f1"] == pytest.approx(4 / 9)
    # The printed table row holds the same numbers, as percentages.
    row = next(line for line in out.splitlines() if line.startswith("| replay: scripts.jsonl |"))
    cells = [float(c) for c in row.strip("|").split("|")[1:]]
    want = [100 * x for cat, _ in FTRL_CATEGORIES for x in means[cat]] + [100 * x for x in avg] + [100 * sum(avg) / 3]
    assert cells == pytest.approx(want, abs=0.006)
    # examples.jsonl: one line per row, in category order, calls and results as executed.
    assert len(examples) == 12
    by_id = {e["task_id"]: e for e in examples}
    ex = by_id[ids[6]]
    assert ex["category"] == "parallel_single_hop"
    assert [c["name"] for c in ex["turns"][0]["calls"]] == ["unified_specification_retriever"] * 2
    assert all("1,024 GB" in r for r in ex["turns"][0]["results"])
    assert "error" in by_id[ids[5]]["turns"][0]["calls"][1]  # the malformed call, recorded as such


def _toolhop_file(tmp_path):
    tool = {"name": "director_of", "description": "Director of a film.",
            "parameters": {"type": "object", "properties": {"film": {"type": "string"}}, "required": ["film"]}}
    rows = [{"id": f"th{i}", "question": f"Who directed {film}?", "answer": who, "tools": [tool],
             "functions": [f"def director_of(film):\n    return {who!r} if film == {film!r} else 'unknown'\n"]}
            for i, (film, who) in enumerate([("X", "Jane Doe"), ("Y", "John Roe"), ("Z", "Ann Poe")])]
    data = tmp_path / "toolhop.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return data


def test_toolhop_scripted_replay_answer_accuracy(tmp_path, capsys):
    data = _toolhop_file(tmp_path)
    scripts = [
        {"task_id": "th0", "turns": [_call("director_of", film="X"), "<answer>Jane Doe</answer>"]},  # correct
        {"task_id": "th1", "benchmark": "toolhop", "turns": ["<answer>Someone</answer>"]},  # wrong
        # the answer turn is wrong, but the last observation before it holds the gold answer
        {"task_id": "th2", "turns": [_call("director_of", film="Z"), "<answer>not sure</answer>"]},
    ]
    script_file = tmp_path / "s.jsonl"
    script_file.write_text("".join(json.dumps(s) + "\n" for s in scripts))
    code, out, err = run_cli(["--replay", script_file, "--benchmarks", "toolhop", "--toolhop", data, "--out",
                              tmp_path / "out", "--toolhop-scenario", "mandatory"], capsys)
    assert code == 0, err
    results, examples = read_results(tmp_path / "out")
    cat = results["benchmarks"]["toolhop"]["categories"]["toolhop"]
    assert (cat["n"], cat["accuracy"]) == (3, pytest.approx(2 / 3))
    assert [e["metrics"]["answer_correct"] for e in examples] == [1.0, 0.0, 1.0]
    assert "| replay: s.jsonl | 66.67 |" in out
    assert "Turns: ToolHop 9 (mandatory scenario)." in out
    assert "you must call the tool at every step" in examples[0]["text"]


@pytest.mark.parametrize("scenario", ["direct", "free"])
def test_toolhop_direct_and_free_scenarios(tmp_path, capsys, scenario):
    """direct (the default): no tools in the prompt, one generation, so th2's call runs against no
    tool (an error, recorded on its turn: issue 58) and its answer turn never comes; free: the
    tools, the prompt without the must-call sentences."""
    data = _toolhop_file(tmp_path)
    scripts = [
        {"task_id": "th0", "turns": ["<answer>Jane Doe</answer>"]},  # correct in both
        {"task_id": "th1", "turns": ["<answer>Someone</answer>"]},  # wrong in both
        # free: the call's observation holds "Ann Poe" -> correct; direct: 1 turn, no answer -> wrong
        {"task_id": "th2", "turns": [_call("director_of", film="Z"), "<answer>not sure</answer>"]},
    ]
    script_file = tmp_path / "s.jsonl"
    script_file.write_text("".join(json.dumps(s) + "\n" for s in scripts))
    argv = ["--replay", script_file, "--benchmarks", "toolhop", "--toolhop", data, "--out", tmp_path / "out"]
    code, out, err = run_cli(argv + ([] if scenario == "direct" else ["--toolhop-scenario", scenario]), capsys)
    assert code == 0, err
    _, examples = read_results(tmp_path / "out")
    prompt = examples[0]["text"].split("<|im_start|>assistant")[0]
    if scenario == "direct":
        assert "Turns: ToolHop 1 (direct scenario)." in out
        assert [e["metrics"]["answer_correct"] for e in examples] == [1.0, 0.0, 0.0]
        assert "<tools>" not in prompt and prompt.count("You will be asked a question, and should provide") == 1
        assert examples[2]["num_turns"] == 1 and [r[:40] for r in examples[2]["turns"][0]["results"]] == [
            "an error occured when call director_of: "]
    else:
        assert "Turns: ToolHop 9 (free scenario)." in out
        assert [e["metrics"]["answer_correct"] for e in examples] == [1.0, 0.0, 1.0]
        assert "<tools>" in prompt and "must call" not in prompt and "with some tools" in prompt


def test_header_states_the_released_defaults(tmp_path, capsys):
    """No flags: greedy, FTRL/built-in 10 turns, no per-turn cap, thinking off for a replay."""
    code, out, err = run_cli(["--replay", "gold", "--benchmarks", "builtin", "--builtin-per-category", 1], capsys)
    assert code == 0, err
    assert out.startswith("Decoding: greedy.\nTurns: Built-in 10.\nToken budget: 13000 response tokens per "
                          "episode, per-turn cap off, prompts up to 10000.\nThinking: off (replay).\n")


def test_replay_file_without_a_script_for_a_task_is_an_error(ftrl_sample_path, tmp_path, capsys):
    script_file = tmp_path / "scripts.jsonl"
    script_file.write_text(json.dumps({"task_id": "nope", "turns": ["<answer>x</answer>"]}) + "\n")
    code, _, err = run_cli(["--replay", script_file, "--benchmarks", "ftrl", "--ftrl", ftrl_sample_path], capsys)
    assert code == 2
    assert err.strip().startswith("error: --replay") and "no script for 12 of 12 ftrl tasks" in err


# ---------------------------------------------------------------------------------------------
# A tiny random model: two runs give identical tables
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    from turnsight_jax.models.config import Qwen3Config
    from turnsight_jax.models.qwen3 import init_model
    from turnsight_jax.models.weights import save_pretrained

    cfg = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    path = tmp_path_factory.mktemp("tiny_hf")
    save_pretrained(init_model(cfg, seed=7), path)
    return path


def test_tiny_model_evaluation_is_deterministic(tiny_hf_dir, tmp_path, capsys):
    argv = ["--hf", tiny_hf_dir, "--benchmarks", "builtin", "--builtin-per-category", 1, "--max-turns", 2,
            "--max-new-tokens", 16, "--batch-size", 4, "--workers", 1]
    code1, out1, err1 = run_cli(argv + ["--out", tmp_path / "a"], capsys)
    code2, out2, err2 = run_cli(argv + ["--out", tmp_path / "b"], capsys)
    assert code1 == 0 and code2 == 0, err1 + err2
    assert out1 == out2
    r1, e1 = read_results(tmp_path / "a")
    r2, e2 = read_results(tmp_path / "b")
    assert r1["benchmarks"] == r2["benchmarks"] and r1["overall"] == r2["overall"]
    assert [e["text"] for e in e1] == [e["text"] for e in e2]
    assert len(e1) == 4 and sorted(e["category"] for e in e1) == sorted(k for k, _ in FTRL_CATEGORIES)
    assert r1["source"]["kind"] == "hf" and r1["model"] == tiny_hf_dir.name
    for e in e1:
        # at most 2 turns of at most 16 new tokens each
        assert 1 <= e["num_turns"] <= 2
        assert e["metrics"]["policy_tokens"] <= 2 * 16
        assert 0.0 <= e["metrics"]["solve_f1"] <= 1.0
    assert "| Model | Single-Hop Solve-P |" in out1


def test_run_folder_checkpoint_gives_the_same_tables_as_the_hf_folder(tiny_hf_dir, tmp_path, capsys):
    """The same weights through --checkpoint (orbax run folder) and --hf give identical results."""
    import jax.numpy as jnp
    from flax import nnx

    from turnsight_jax.assets import default_tokenizer_dir
    from turnsight_jax.checkpointing import Checkpointer, write_run_files
    from turnsight_jax.models.weights import load_pretrained

    model = load_pretrained(tiny_hf_dir)
    run = tmp_path / "run"
    write_run_files(run, model.config, default_tokenizer_dir())
    ckpt = Checkpointer(run)
    ckpt.save(3, nnx.state(model), {"count": jnp.zeros((), jnp.int32)}, {"next_step": 3})
    ckpt.close()
    # --no-thinking: the thinking defaults differ (a run folder without config.json: off; an HF
    # folder of a post-trained Qwen3: on), the tables must not.
    common = ["--benchmarks", "builtin", "--builtin-per-category", 1, "--max-turns", 2, "--max-new-tokens", 16,
              "--batch-size", 4, "--workers", 1, "--quiet", "--no-thinking"]
    code, _, err = run_cli(["--checkpoint", run, "--out", tmp_path / "ckpt"] + common, capsys)
    assert code == 0, err
    code, _, err = run_cli(["--hf", tiny_hf_dir, "--out", tmp_path / "hf"] + common, capsys)
    assert code == 0, err
    r_ckpt, e_ckpt = read_results(tmp_path / "ckpt")
    r_hf, e_hf = read_results(tmp_path / "hf")
    assert r_ckpt["model"] == "run@3" and r_ckpt["source"]["kind"] == "checkpoint" and r_ckpt["source"]["step"] == 3
    assert r_ckpt["benchmarks"] == r_hf["benchmarks"]
    assert [e["text"] for e in e_ckpt] == [e["text"] for e in e_hf]
    code, _, err = run_cli(["--checkpoint", run, "--step", 5] + common, capsys)
    assert code == 2 and _error_line(err) == f"error: {run}: no checkpoint for step 5; have [3]"


# ---------------------------------------------------------------------------------------------
# Input errors: exit status 2, one line naming the problem
# ---------------------------------------------------------------------------------------------
def test_unknown_benchmark(capsys):
    code, out, err = run_cli(["--replay", "gold", "--benchmarks", "builtin,gsm8k"], capsys)
    assert code == 2 and out == ""
    assert _error_line(err) == ("error: unknown benchmark 'gsm8k' in --benchmarks; valid benchmarks: "
                                "ftrl, bfcl, toolhop, builtin")


def test_missing_data_paths(tmp_path, capsys):
    code, _, err = run_cli(["--replay", "gold", "--benchmarks", "builtin,toolhop"], capsys)
    assert code == 2
    assert _error_line(err) == "error: --benchmarks toolhop needs --toolhop PATH (the ToolHop test file)"
    script = tmp_path / "s.jsonl"
    script.write_text('{"task_id": "a", "turns": []}\n')
    code, _, err = run_cli(["--replay", script, "--benchmarks", "ftrl"], capsys)
    assert code == 2 and _error_line(err) == "error: --benchmarks ftrl needs --ftrl PATH (the FTRL test file)"
    missing = tmp_path / "nope.jsonl"
    code, _, err = run_cli(["--replay", script, "--benchmarks", "ftrl", "--ftrl", missing], capsys)
    assert code == 2 and _error_line(err) == f"error: --ftrl {missing}: no such file or folder"


def test_replay_gold_unsupported_for_ftrl(tmp_path, capsys):
    data = tmp_path / "ftrl.jsonl"
    data.write_text("")
    code, _, err = run_cli(["--replay", "gold", "--benchmarks", "ftrl", "--ftrl", data], capsys)
    assert code == 2
    assert _error_line(err).startswith("error: --replay gold is not supported for ftrl: its rows have no per-turn")


def test_wrong_architecture_folder(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                      "vocab_size": 32000}))
    code, _, err = run_cli(["--hf", tmp_path, "--benchmarks", "builtin"], capsys)
    assert code == 2
    line = _error_line(err)
    assert line.startswith(f"error: {tmp_path / 'config.json'}: unsupported architecture: expected model_type 'qwen3'")
    assert "model_type='llama'" in line and "LlamaForCausalLM" in line


def test_checkpoint_folder_that_is_not_a_run(tmp_path, capsys):
    code, _, err = run_cli(["--checkpoint", tmp_path, "--benchmarks", "builtin"], capsys)
    assert code == 2
    assert _error_line(err) == f"error: --checkpoint {tmp_path}: not a turnsight_jax run folder (no model/config.json)"


@pytest.mark.parametrize("benchmarks", ["builtin", "bfcl"])
def test_checkpoint_given_an_export_folder_says_use_hf(tmp_path, capsys, benchmarks):
    """A run's export/ (a Hugging Face folder) passed as --checkpoint: one line pointing at --hf,
    not an AttributeError on the model config read as a run config."""
    from turnsight_jax.models.config import Qwen3Config

    cfg = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    code, _, err = run_cli(["--checkpoint", tmp_path, "--benchmarks", benchmarks], capsys)
    line = _error_line(err)
    assert code == 2 and line.startswith("error: ") and f"--hf {tmp_path}" in line, line


def test_tokenizer_larger_than_model_vocabulary(tmp_path, capsys):
    from turnsight_jax.models.config import Qwen3Config

    cfg = Qwen3Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))  # no weights needed: checked first
    code, _, err = run_cli(["--hf", tmp_path, "--benchmarks", "builtin"], capsys)
    assert code == 2
    line = _error_line(err)
    assert line.startswith(f"error: {tmp_path}: tokenizer has 151669 tokens but the model's embedding has only "
                           "1000 rows")


def test_thinking_default_rule(tmp_path):
    """HF folder: on for a post-trained Qwen3 (template with the switch, name without -Base), off
    for "-Base" folders or templates without the switch; replay: off; flags win (main's parser)."""
    import types

    from turnsight_jax.assets import default_tokenizer
    from turnsight_jax.evaluate import build_parser, thinking_default

    tok = default_tokenizer()
    hf = lambda name: types.SimpleNamespace(checkpoint=None, hf=str(tmp_path / name))  # noqa: E731
    assert thinking_default(hf("Qwen3-8B"), None, tok) == (True, "a post-trained Qwen3")
    assert thinking_default(hf("Qwen3-8B-Base"), None, tok) == (False, "a pre-trained Qwen3 (Qwen3-8B-Base)")
    no_switch = types.SimpleNamespace(chat_template="{{ messages }}")
    assert thinking_default(hf("Qwen3-8B"), None, no_switch) == (False, "its chat template has no thinking switch")
    assert thinking_default(types.SimpleNamespace(checkpoint=None, hf=None), None, tok) == (False, "replay")
    parse = build_parser().parse_args
    assert parse(["--replay", "gold"]).enable_thinking is None
    assert parse(["--replay", "gold", "--enable-thinking"]).enable_thinking is True
    assert parse(["--replay", "gold", "--no-thinking"]).enable_thinking is False


def test_rollout_budgets_per_benchmark():
    """Per-turn cap off by default (= the response budget), given: that cap; BFCL: its 4096 per
    step; turns: FTRL 10, ToolHop 9 (direct 1), or --max-turns for all."""
    from turnsight_jax.eval.suites import EvalSettings, rollout_config

    default = EvalSettings()
    ftrl = rollout_config("ftrl", default, [])
    assert (ftrl.max_turns, ftrl.max_turn_tokens, ftrl.max_response_tokens) == (10, 13_000, 13_000)
    assert rollout_config("toolhop", default, []).max_turns == 1
    assert rollout_config("toolhop", EvalSettings(toolhop_scenario="free"), []).max_turns == 9
    capped = EvalSettings(max_new_tokens=64, max_turns=3)
    assert (rollout_config("builtin", capped, []).max_turn_tokens, rollout_config("toolhop", capped, []).max_turns) \
        == (64, 3)
    assert default.turns_for("builtin") == 10
