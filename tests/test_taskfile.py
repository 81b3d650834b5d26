"""Task files (turnsight_jax.taskfile, docs/data.md): the shipped sample, the validator that
reports every bad row, and the converter from verl's RL parquet layout."""

from __future__ import annotations

import json

from turnsight_jax import taskfile
from turnsight_jax.envs.ftrl import load_tasks
from turnsight_jax.envs.synthetic import generate_tasks

FIELDS = ("task_id", "messages", "tools", "codes", "unsolved_set", "answer", "data_source", "category")


def test_the_shipped_sample_is_the_built_in_tasks_as_rows(tmp_path):
    shipped = load_tasks(taskfile.SAMPLE, require=("gold_calls",))
    want = generate_tasks(4, seed=0)
    assert [[getattr(t, f) for f in FIELDS] for t in shipped] == [[getattr(t, f) for f in FIELDS] for t in want]
    # the gold chain, flattened to one call per turn (the file does not say which calls were parallel)
    assert [[c for turn in t.gold_calls for c in turn] for t in shipped] == \
        [[c for turn in t.gold_calls for c in turn] for t in want]
    assert taskfile.main(["sample", str(tmp_path / "s.jsonl")]) == 0  # it is regenerated from the code
    assert (tmp_path / "s.jsonl").read_text() == taskfile.SAMPLE.read_text()


def test_validate_reports_every_bad_row_with_its_number(tmp_path, capsys):
    good = taskfile.SAMPLE.read_text().splitlines()
    no_answer = json.loads(good[1])
    del no_answer["answer"]
    bad_tools = json.loads(good[2])
    bad_tools["tools"] = json.dumps([{"type": "function"}])
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join([good[0], json.dumps(no_answer), "{not json", json.dumps(bad_tools), good[3]]) + "\n")
    assert taskfile.main(["validate", str(path)]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(f"{path}: line 2: missing key 'answer'")
    assert lines[1].startswith(f"{path}: line 3: invalid JSON")
    assert lines[2].startswith(f"{path}: line 4: key 'tools'[0]: expected {{'type': 'function', 'function'")
    assert out.strip() == f"{path}: 5 rows, 2 valid, 3 bad"
    assert taskfile.main(["validate", str(taskfile.SAMPLE), "--require-gold"]) == 0


def _verl_table(rows):
    import pyarrow as pa

    return pa.Table.from_pylist(rows)


def _verl_rows(tasks):
    """The built-in tasks in verl's RL layout: the chat in `prompt`, the gold chain in
    `reward_model.ground_truth`, the tools, their code and the gold answers in `extra_info`."""
    rows = []
    for i, t in enumerate(tasks):
        row = taskfile.task_row(t)
        rows.append({"data_source": t.data_source, "prompt": [dict(m) for m in t.messages], "ability": "tool_use",
                     "reward_model": {"style": "rule", "ground_truth": row["ground_truth"]},
                     "extra_info": {"index": 100 + i, "split": "train", "tools": row["tools"], "codes": row["codes"],
                                    "unsolved_set": row["unsolved_set"], "answer": t.answer}})
    return rows


def test_convert_verl_parquet_to_task_rows(tmp_path, capsys):
    import pyarrow.parquet as pq

    tasks = generate_tasks(4, seed=3)
    src = tmp_path / "train.parquet"
    pq.write_table(_verl_table(_verl_rows(tasks)), src)
    dst = tmp_path / "train.jsonl"
    assert taskfile.main(["convert-verl", str(src), str(dst)]) == 0
    loaded = load_tasks(dst, require=("gold_calls",))
    assert [t.task_id for t in loaded] == ["100", "101", "102", "103"]
    for got, want in zip(loaded, tasks):
        assert [getattr(got, f) for f in FIELDS[1:]] == [getattr(want, f) for f in FIELDS[1:]]
        assert [c for turn in got.gold_calls for c in turn] == [c for turn in want.gold_calls for c in turn]
        assert got.extra["split"] == "train"
    assert taskfile.main(["validate", str(dst), "--require-gold"]) == 0

    # a row without its tools' code, one without a gold answer: both reported, nothing written
    rows = _verl_rows(tasks)
    del rows[1]["extra_info"]["codes"]
    rows[3]["extra_info"]["unsolved_set"] = "{}"
    for r in rows:  # one extra_info schema for the parquet column
        r["extra_info"].setdefault("codes", None)
    pq.write_table(_verl_table(rows), src)
    capsys.readouterr()
    assert taskfile.main(["convert-verl", str(src), str(tmp_path / "out.jsonl")]) == 1
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"{src}: row 1: no codes in the row or its extra_info") and len(lines) == 2
    assert lines[1] == f"{src}: row 3: key 'unsolved_set': expected at least one gold answer, got none"
    assert "2 did not, nothing written" in out and not (tmp_path / "out.jsonl").exists()


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert taskfile.main(["validate", str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == f"error: task file not found: {tmp_path / 'none.jsonl'}"
