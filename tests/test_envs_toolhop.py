"""ToolHop: loader (both layouts), isolated execution, answer-match accuracy."""

from __future__ import annotations

import json

import pytest

from turnsight_jax.chat.types import ToolCall
from turnsight_jax.envs.executor import ToolExecutor
from turnsight_jax.envs.toolhop import ToolHopEnv, ToolHopFormatError, load_tasks

DIRECTOR = '''def director_of(movie):
    table = {"Heat": "Michael Mann"}
    return {"director": table.get(movie, "unknown")}
'''
BIRTH = '''def birth_year(person):
    if person == "Michael Mann":
        return 1943
    raise ValueError("person not found")
'''


def _schema(name, param):
    return {"name": name, "description": f"{name}.", "parameters": {
        "type": "object", "properties": {param: {"type": "string"}}, "required": [param]}}


ROWS = [
    {"id": "q0", "question": "When was the director of Heat born?", "answer": 1943,
     "tools": {"director_of": _schema("director_of", "movie"), "birth_year": _schema("birth_year", "person")},
     "functions": {"director_of": DIRECTOR, "birth_year": BIRTH}},
    {"question": "Who directed Heat?", "answer": "Michael Mann",
     "tools": [{"type": "function", "function": _schema("director_of", "movie")}],
     "functions": [DIRECTOR]},
]


@pytest.fixture()
def path(tmp_path):
    p = tmp_path / "toolhop.json"
    p.write_text(json.dumps(ROWS))
    return p


def test_loads_json_and_jsonl(path, tmp_path):
    tasks = load_tasks(path)
    assert [t.task_id for t in tasks] == ["q0", "toolhop:1"]
    assert tasks[0].answer == "1943"
    assert set(tasks[0].codes) == {"director_of", "birth_year"}
    assert tasks[1].codes == {"director_of": DIRECTOR}
    content = tasks[0].messages[0]["content"]
    assert content.startswith("You will be asked a question with some tools")
    assert content.endswith("Question: When was the director of Heat born?")
    jl = tmp_path / "toolhop.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in ROWS))
    assert [t.codes for t in load_tasks(jl)] == [t.codes for t in tasks]


def test_loader_errors_name_row_and_key(tmp_path):
    bad = [dict(ROWS[0]), {**ROWS[1], "functions": {"other": DIRECTOR}}]
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(bad))
    with pytest.raises(ToolHopFormatError, match=r"bad.json: row 1: key 'functions': no code for tools \['director_of'\]"):
        load_tasks(p)
    p.write_text(json.dumps([{k: v for k, v in ROWS[0].items() if k != "answer"}]))
    with pytest.raises(ToolHopFormatError, match="row 0: missing key 'answer'"):
        load_tasks(p)


def test_episode_runs_tools_isolated_and_scores_answers(path):
    task = load_tasks(path)[0]
    with ToolExecutor(1, timeout_s=2.0) as ex, ToolHopEnv(ex) as env:
        ep = env.start(task)
        r1 = ep.step([ToolCall("director_of", {"movie": "Heat"})])
        assert r1.observations == ('{"director": "Michael Mann"}',)
        r2 = ep.step([ToolCall("birth_year", {"person": "Al Pacino"}),
                      ToolCall("birth_year", {"person": "Michael Mann"})])
        assert r2.observations == ("an error occured when call birth_year: person not found", "1943")
        assert ep.step([]).done
        right = ep.score("<answer>1943</answer>")
        assert right.reward == 1.0 and right.metrics["answer_f1"] == 1.0
        # The last tool result before the answer turn holds the answer: counted correct.
        assert ep.score("I think it is 1950").reward == 1.0

        ep2 = env.start(task)
        ep2.step([ToolCall("director_of", {"movie": "Heat"})])
        ep2.step([])
        wrong = ep2.score("<answer>1950</answer>")
        assert wrong.reward == 0.0 and wrong.metrics["answer_f1"] == 0.0
        # An episode that never reached an answer turn is not correct.
        ep3 = env.start(task)
        ep3.step([ToolCall("birth_year", {"person": "Michael Mann"})])
        assert ep3.score("1943").reward == 0.0


def test_scenarios_change_prompt_and_tools(path):
    """direct: no tools/code, the direct prompt; free: tools, no must-call sentence; mandatory:
    the loaded task itself; an unknown scenario or a task already converted is an error."""
    from turnsight_jax.envs.toolhop import scenario_task

    task = load_tasks(path)[1]  # row 1 has no own messages
    direct, free = scenario_task(task, "direct"), scenario_task(task, "free")
    assert scenario_task(task, "mandatory") is task
    assert (direct.tools, direct.codes) == ((), {}) and free.tools == task.tools and free.codes == task.codes
    assert direct.messages[0]["content"].startswith("You will be asked a question, and should provide a short answer.")
    assert "you must call the tool" in task.messages[0]["content"]
    assert "must call" not in free.messages[0]["content"] and "with some tools" in free.messages[0]["content"]
    assert all(t.messages[0]["content"].endswith("Question: " + task.extra["question"]) for t in (direct, free, task))
    with pytest.raises(ValueError, match="unknown ToolHop scenario 'open'; expected one of direct, mandatory, free"):
        scenario_task(task, "open")
    with pytest.raises(ValueError, match="expects a freshly loaded"):
        scenario_task(direct, "free")
