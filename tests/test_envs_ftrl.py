"""FTRL: loader, FTRL-exact tool observations (differential vs. a direct exec) and Solve-P/R/F1."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from _ftrl_rows import GT_CALLS, GT_GOLD, gt_row, gt_rows
from turnsight_jax.chat.parsing import parse_turn
from turnsight_jax.chat.types import CallError, ToolCall
from turnsight_jax.rewards import matchtir_turn_rewards
from turnsight_jax.envs.ftrl import (
    FTRLEnv,
    FTRLFormatError,
    answer_verify,
    load_tasks,
    solve_metrics,
)


# ------------------------------------------------------------------------------- solve_metrics
def test_solve_metrics_no_calls():
    m = solve_metrics([], {"a": ["x"], "b": ["y", "z"]})
    assert m["solve_p"] == 1.0
    assert m["solve_r"] == 0.0
    assert m["solve_f1"] == 0.0
    assert m["num_gold"] == 3


def test_solve_metrics_each_call_solves_at_most_one_answer_of_its_tool():
    # The first call's output contains both gold answers of tool a, but solves only one.
    outs = [("a", "Paris and London"), ("a", "London"), ("b", "London")]
    m = solve_metrics(outs, {"a": ["Paris", "London"], "b": ["Rome"]})
    assert m["solved"] == 2  # a: Paris (call 1), London (call 2); b: Rome never seen
    assert m["solve_p"] == pytest.approx(2 / 3)
    assert m["solve_r"] == pytest.approx(2 / 3)
    assert m["solve_f1"] == pytest.approx(2 * 2 / (3 + 3))


def test_solve_metrics_repeated_calls_do_not_resolve_twice():
    outs = [("a", "Paris")] * 4
    m = solve_metrics(outs, {"a": ["Paris"]})
    assert m["solved"] == 1
    assert m["solve_p"] == pytest.approx(0.25)
    assert m["solve_r"] == 1.0
    assert m["solve_f1"] == pytest.approx(2 / 5)


def test_solve_metrics_duplicate_gold_answers_need_two_calls():
    gold = {"spec": ["1,024", "1,024"]}
    assert solve_metrics([("spec", "1024 MB")], gold)["solved"] == 1
    m = solve_metrics([("spec", "1024 MB"), ("spec", '{"size": "1,024"}')], gold)
    assert m["solved"] == 2 and m["solve_f1"] == 1.0


def test_solve_metrics_multi_part_answer_and_wrong_tool():
    gold = {"f": ["b, c, a"]}
    assert solve_metrics([("f", "A B")], gold)["solved"] == 0  # "c" missing
    assert solve_metrics([("f", "cab")], gold)["solved"] == 1  # all three substrings present
    assert solve_metrics([("g", "a b c")], gold)["solved"] == 0  # other tool's output
    # The first still-unsolved answer that matches is consumed, in list order.
    m = solve_metrics([("f", "x y"), ("f", "x")], {"f": ["x", "x, y"]})
    assert m["solved"] == 1  # call 1 consumes "x"; call 2 lacks "y"


def test_solve_metrics_does_not_mutate_and_rejects_empty_gold():
    gold = {"a": ["p"]}
    solve_metrics([("a", "p")], gold)
    assert gold == {"a": ["p"]}
    with pytest.raises(ValueError, match="no gold answers"):
        solve_metrics([], {"a": []})


def test_answer_verify_ftrl_semantics():
    assert answer_verify("The answer is 2048.", "2,048")
    assert answer_verify({"v": "Seattle Port"}, "seattle port")
    assert answer_verify(73.5, "73.5")
    assert not answer_verify("Salmo", "Salmon")
    # FTRL splits on ", " (comma space), not on a bare comma.
    assert answer_verify("a,b", "a,b")
    assert not answer_verify("a b", "a,b")


# ------------------------------------------------------------------------------------ loading
def test_fixture_rows_load(ftrl_sample_path):
    tasks = load_tasks(ftrl_sample_path)
    assert len(tasks) == 12
    cats = [t.category for t in tasks]
    assert sorted(set(cats)) == sorted(
        ["single_hop", "parallel_single_hop", "multi_hop", "parallel_multi_hop"]
    )
    assert all(cats.count(c) == 3 for c in set(cats))
    t0 = tasks[0]
    assert t0.answer == "Salmon"
    assert t0.unsolved_set["regional_fish_identifier"] == ["Salmon"]
    assert t0.messages[0]["role"] == "user"
    assert {t["function"]["name"] for t in t0.tools} == set(t0.codes)
    assert len(t0.codes) == 12


def test_loader_errors_name_file_row_and_key(tmp_path, ftrl_sample_path):
    rows = [json.loads(l) for l in open(ftrl_sample_path)][:2]
    rows[1]["codes"] = json.dumps(["not", "a", "dict"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows))
    # JSONL rows are named by their 1-based line number.
    with pytest.raises(FTRLFormatError, match=r"bad.jsonl: line 2: key 'codes': expected dict, got list"):
        load_tasks(bad)
    del rows[1]["answer"]
    bad.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(FTRLFormatError, match=r"line 2: missing key 'answer'"):
        load_tasks(bad)


def test_parquet_layout_round_trip(tmp_path, ftrl_sample_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [json.loads(l) for l in open(ftrl_sample_path)]
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    from_parquet = load_tasks(path)
    from_jsonl = load_tasks(ftrl_sample_path)
    assert len(from_parquet) == 12
    for a, b in zip(from_parquet, from_jsonl):
        assert (a.messages, a.tools, a.codes, a.unsolved_set, a.answer, a.category) == (
            b.messages, b.tools, b.codes, b.unsolved_set, b.answer, b.category)


# ------------------------------------------------------------------ ground_truth -> gold_calls
def test_ground_truth_loads_as_gold_calls_jsonl_and_parquet(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gt_rows()))
    tasks = load_tasks(path)
    assert [t.gold_calls for t in tasks] == GT_GOLD  # one call per gold turn, in the file's order
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = gt_rows()
    rows[1]["ground_truth"] = json.dumps(GT_CALLS[1])  # parquet: JSON text (see the module docstring)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    assert [t.gold_calls for t in load_tasks(tmp_path / "train.parquet")] == GT_GOLD
    # Rows without the column load with gold_calls None (FTRL's test rows).
    (tmp_path / "test.jsonl").write_text(json.dumps(gt_row(2, None)) + "\n")
    assert load_tasks(tmp_path / "test.jsonl")[0].gold_calls is None


@pytest.mark.parametrize("semantics,method", [("clean", "assignment"), ("clean", "greedy"),
                                              ("released", "greedy"), ("released", "assignment")])
def test_replayed_gold_trajectory_earns_full_turn_rewards(tmp_path, semantics, method):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in gt_rows()))
    for task in load_tasks(path):
        # Each tool turn makes exactly the gold calls (as the policy would write them), then the
        # answer turn states the gold answer.
        texts = ["".join(f'<tool_call>\n{json.dumps(c)}\n</tool_call>' for c in turn) for turn in task.gold_calls]
        texts.append(f"<answer>{task.answer}</answer>")
        parsed = [parse_turn(t) for t in texts]
        answer = texts[-1] if semantics == "released" else parsed[-1].answer
        r = matchtir_turn_rewards([p.calls for p in parsed], task.gold_calls, answer, task.answer,
                                  method=method, semantics=semantics)
        np.testing.assert_array_equal(r, [1.0, 1.0, 1.0])  # two tool turns, the answer turn


@pytest.mark.parametrize("value,message", [
    ({"name": "f"}, r"line 1: key 'ground_truth': expected list, got dict"),
    ("[{", r"line 1: key 'ground_truth': expected a JSON list, got unparseable text"),
    ([], r"line 1: key 'ground_truth': expected a non-empty list of calls, got \[\]"),
    (["director_of"], r"line 1: key 'ground_truth'\[0\]: expected \{'name', 'parameters'\}, got str"),
    ([{"parameters": {}}], r"line 1: key 'ground_truth'\[0\]: 'name' must be a non-empty string, got None"),
    ([{"name": "f", "params": {}}], r"line 1: key 'ground_truth'\[0\]: missing 'parameters' \(or 'arguments'\); "
                                    r"got keys \['name', 'params'\]"),
    ([{"name": "f", "parameters": [1]}], r"line 1: key 'ground_truth\[0\].parameters': expected dict, got list"),
])
def test_malformed_ground_truth_names_file_line_and_column(tmp_path, value, message):
    path = tmp_path / "gt.jsonl"
    path.write_text(json.dumps(gt_row(0, value)) + "\n")
    with pytest.raises(FTRLFormatError, match=r"gt.jsonl: " + message):
        load_tasks(path)


def _with(row: dict, **changes) -> dict:
    return {**row, **{k: json.dumps(v) for k, v in changes.items()}}


@pytest.mark.parametrize("change,message", [
    (lambda r: _with(r, tools=[{"type": "function", "function": {"description": "no name"}}]),
     r"line 1: key 'tools'\[0\].function.name: expected a non-empty string, got None"),
    (lambda r: _with(r, tools=json.loads(r["tools"])[:1] * 2),
     r"line 1: key 'tools'\[1\]: the tool name 'director_of' is declared twice"),
    (lambda r: _with(r, codes={**json.loads(r["codes"]), "helper": "def helper():\n    return 1\n"}),
     r"line 1: key 'codes' names tools absent from 'tools': \['helper'\] \(tools: \['director_of', 'birthplace'\]\)"),
    (lambda r: _with(r, unsolved_set={"director_of": ["Ada"], "ghost": ["x"]}),
     r"line 1: key 'unsolved_set' names tools absent from 'tools': \['ghost'\]"),
])
def test_rows_whose_tools_do_not_match_their_code_are_refused(tmp_path, change, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(change(gt_row(0, None))) + "\n")
    with pytest.raises(FTRLFormatError, match=r"rows.jsonl: " + message):
        load_tasks(path)


def test_required_gold_calls_name_the_row(tmp_path):
    rows = gt_rows() + [gt_row(2, None)]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert len(load_tasks(path)) == 3  # not required: loads
    with pytest.raises(FTRLFormatError, match=r"train.jsonl: line 3: key 'ground_truth' is missing"):
        load_tasks(path, require=("gold_calls",))


# ------------------------------------------------------------------ differential vs. FTRL exec
_SAMPLE = {"string": "ABC Factory", "integer": 2020, "number": 2.5, "boolean": True,
           "array": ["Paris"], "object": {"key": "value"}}


def _valid_args(schema: dict) -> dict:
    params = schema.get("parameters", {}) or {}
    props = params.get("properties", {}) or {}
    args = {}
    for name, spec in props.items():
        if "enum" in spec and spec["enum"]:
            args[name] = spec["enum"][0]
        else:
            args[name] = _SAMPLE.get(spec.get("type"), "x")
    return args


def _call_cases(tasks):
    cases = []
    for t in tasks:
        for tool in t.tools:
            fn = tool["function"]
            name = fn["name"]
            valid = _valid_args(fn)
            required = (fn.get("parameters") or {}).get("required") or list(valid)[:1]
            variants = [valid, {k: valid[k] for k in required if k in valid}]
            if required:
                missing = dict(valid)
                missing.pop(required[0], None)
                variants.append(missing)  # invalid: a required argument missing
                wrong = dict(valid)
                wrong[required[0]] = 12345 if isinstance(valid.get(required[0]), str) else "12345"
                variants.append(wrong)  # invalid: wrong type
            variants.append({**valid, "no_such_param": 1})  # invalid: unknown keyword
            variants.append({"__import__('os').system('echo pwned')": "open('/etc/passwd').read()"})
            for args in variants:
                cases.append((name, t.codes[name], args))
    return cases


# FTRL's own execution (Code/utils/utils.py: call_function + get_feedback), verbatim semantics:
# a fresh namespace per call, exec of the tool source, the call with **arguments, FTRL's text.
_REFERENCE = textwrap.dedent(
    """
    import json, sys
    def call_function(name, arguments, code):
        namespace = {}
        exec(code, namespace, namespace)
        if name in namespace:
            predict = namespace[name](**arguments)
        else:
            raise NameError(f"name {name} is not defined")
        if type(predict) == dict or type(predict) == list:
            predict = json.dumps(predict, ensure_ascii=False)
        elif type(predict) != str:
            predict = str(predict)
        return predict
    out = []
    for name, code, args in json.load(open(sys.argv[1])):
        try:
            out.append(call_function(name, args, code))
        except Exception as e:
            out.append(f"an error occured when call {name}: {str(e)}")
    json.dump(out, open(sys.argv[2], "w"))
    """
)


def test_observations_match_ftrl_exec_exactly(ftrl_sample_path, tmp_path):
    tasks = load_tasks(ftrl_sample_path)
    cases = _call_cases(tasks)
    assert len(cases) > 300
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    (tmp_path / "ref.py").write_text(_REFERENCE)
    subprocess.run(
        [sys.executable, str(tmp_path / "ref.py"), str(tmp_path / "cases.json"),
         str(tmp_path / "ref.json")], check=True, timeout=120, cwd=tmp_path,
    )
    expected = json.loads((tmp_path / "ref.json").read_text())

    by_id = {t.task_id: t for t in tasks}
    with FTRLEnv(num_workers=2, timeout_s=10.0) as env:
        got = []
        # Through the environment (one episode per task, all calls of a tool in one turn).
        for t in tasks:
            ep = env.start(by_id[t.task_id], seed=0)
            calls = [ToolCall(n, a) for n, code, a in cases if t.codes.get(n) == code]
            got.extend(ep.step(calls).observations)
    assert len(got) == len(expected)
    mismatches = [(c[0], c[2], e, g) for c, e, g in zip(cases, expected, got) if e != g]
    assert not mismatches, mismatches[:3]
    # Both valid results and error observations are exercised.
    assert sum(e.startswith("an error occured when call") for e in expected) > 50
    assert sum(not e.startswith("an error occured when call") for e in expected) > 50


def test_ftrl_episode_scores_gold_answers(ftrl_sample_path):
    tasks = load_tasks(ftrl_sample_path)
    task = next(t for t in tasks if t.category == "single_hop")
    with FTRLEnv(num_workers=1) as env:
        ep = env.start(task, seed=3)
        res = ep.step([CallError("bad json", raw="{"), ToolCall("no_such_tool", {"x": 1})])
        assert res.observations == ("bad json", "an error occured when call no_such_tool: 'no_such_tool'")
        assert not res.done
        assert ep.step([]).done
        score = ep.score(f"<answer>{task.answer}</answer>")
    # FTRL counts the executed (well-formed) call only; it solved nothing.
    assert score.metrics["num_calls"] == 1
    assert score.metrics["solve_p"] == 0.0 and score.reward == 0.0
    assert score.metrics["answer_correct"] == 1.0
