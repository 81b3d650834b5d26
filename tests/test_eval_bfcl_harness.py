"""BFCL's own loop (eval/bfcl_harness.py): rendering, parsing, force-quit and Memory.

The oracle for rendering and parsing is bfcl-eval's own `QwenFCHandler` code: its module cannot
be imported here (it pulls openai, requests, tree_sitter, tenacity), so the test reads the three
methods and `convert_to_function_call` out of the installed source files with `ast` and runs
them as they are: the package's code, never model text.
"""

from __future__ import annotations

import ast
import json
import pathlib
import types

import pytest

pytest.importorskip("bfcl_eval")

from turnsight_jax.assets import default_tokenizer  # noqa: E402
from turnsight_jax.chat.parsing import render_tool_call  # noqa: E402
from turnsight_jax.envs import bfcl  # noqa: E402
from turnsight_jax.eval import bfcl_harness as H  # noqa: E402


def _functions_from(path: pathlib.Path, names: set[str], cls: str | None) -> dict:
    tree = ast.parse(path.read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    for n in found:
        n.decorator_list = []  # @override / @staticmethod
    module = ast.Module(body=found, type_ignores=[])
    namespace: dict = {"json": json, "re": __import__("re"), "Any": object}
    exec(compile(module, str(path), "exec"), namespace)  # the installed package's own code
    return {n: namespace[n] for n in names}


@pytest.fixture(scope="module")
def oracle():
    import bfcl_eval

    root = pathlib.Path(bfcl_eval.__file__).parent
    qwen = _functions_from(root / "model_handler/local_inference/qwen_fc.py",
                           {"_format_prompt", "_extract_tool_calls", "_parse_query_response_prompting",
                            "decode_execute"}, "QwenFCHandler")
    utils = _functions_from(root / "model_handler/utils.py", {"convert_to_function_call"}, None)
    qwen["decode_execute"].__globals__["convert_to_function_call"] = utils["convert_to_function_call"]
    handler = types.SimpleNamespace(_extract_tool_calls=qwen["_extract_tool_calls"])

    def parse(text):
        response = types.SimpleNamespace(choices=[types.SimpleNamespace(text=text)],
                                         usage=types.SimpleNamespace(prompt_tokens=0, completion_tokens=0))
        return qwen["_parse_query_response_prompting"](handler, response)

    def decode(text):
        try:
            return qwen["decode_execute"](handler, text, False)
        except Exception:  # noqa: BLE001 - the handler's decoding failure
            return None

    return types.SimpleNamespace(render=lambda msgs, fns: qwen["_format_prompt"](None, msgs, fns),
                                 parse=parse, decode=decode)


def _call(name, **arguments):
    return render_tool_call(name, arguments)


# Replies for multi_turn_base_0 (4 user turns): think blocks, text around calls, a duplicated
# call, non-ASCII arguments, a broken JSON block, a reply with only text.
BASE0_REPLIES = [
    "<think>\nFirst go to document.\n</think>\n\nSure." + "\n" + _call("cd", folder="document"),
    _call("mkdir", dir_name="temp") + "\n" + _call("mv", source="final_report.pdf", destination="temp"),
    "<think>\nDone with turn one.\n</think>\n\nAll moved.",
    _call("cd", folder="temp") + "\n" + _call("cd", folder="temp") + "\n<tool_call>\n{not json}\n</tool_call>",
    _call("grep", file_name="final_report.pdf", pattern="budget análisis ✓"),
    "Found it.",
    "<think>\nsort\n</think>\n\n" + _call("sort", file_name="final_report.pdf"),
    "Sorted.",
    '<tool_call>\n["not", "an object"]\n</tool_call>',  # decoding fails: ends the user turn
]


def _play(task, replies, oracle=None, *, enable_thinking=True):
    """Plays `replies` through a Conversation; with `oracle`, checks every prompt and parse."""
    env = bfcl.BFCLEnv()
    conv = H.Conversation(task, env.start(task), enable_thinking=enable_thinking)
    tok = default_tokenizer() if oracle is not None else None
    for reply in replies:
        if not conv.active:
            break
        if oracle is not None:
            # the incremental ids equal a full encode of the prompt
            assert conv.prompt_ids(tok) == tok(conv.prompt(), add_special_tokens=False)["input_ids"]
            expected = oracle.render(conv.messages, conv.functions)
            if not enable_thinking:
                expected += "<think>\n\n</think>\n\n"
            assert conv.prompt() == expected
            parsed = oracle.parse(reply)
            text, message = H.split_response(reply)
            assert (text, message) == (parsed["model_responses"], parsed["model_responses_message_for_chat_history"])
            calls = H.decode_calls(text)
            official = oracle.decode(text)
            if official is None:
                assert calls is None
            else:
                assert [bfcl.call_string(c.name, c.arguments) for c in calls] == official
        conv.feed(reply)
    return conv


@pytest.mark.parametrize("thinking", [True, False])
def test_rendering_and_parsing_equal_bfcls_qwen_fc_handler(oracle, thinking):
    (task,) = bfcl.load_tasks("base", limit=1)
    conv = _play(task, BASE0_REPLIES, oracle, enable_thinking=thinking)
    # "All moved." / "Found it." / "Sorted." end turns 1-3; the non-object call fails decoding and ends turn 4.
    assert conv.finished and len(conv.turns) == 4 and conv.turns[3][0].calls is None
    # The non-object call is in the history: BFCL's renderer crashes on it, ours says so.
    with pytest.raises(TypeError):
        oracle.render(conv.messages, conv.functions)
    with pytest.raises(H.RenderError):
        conv.prompt()
    prompt = H.render_prompt(conv.messages[:-1], conv.functions)  # the last prompt the model saw
    assert prompt == oracle.render(conv.messages[:-1], conv.functions)
    # Reasoning of turns before the last user query is gone; tools are raw docs, ASCII-escaped.
    assert "First go to document" not in prompt and "Done with turn one" not in prompt
    assert '{"name": "cd", "description": "This tool belongs to the Gorilla file system.' in prompt
    assert "budget an\\u00e1lisis \\u2713" in prompt
    # The duplicated call is rendered without a newline between the two blocks (the handler's
    # by-value comparison), and the broken block is not in the history.
    assert ('</tool_call><tool_call>\n{"name": "cd", "arguments": {"folder": "temp"}}' in prompt
            and "{not json}" not in prompt)


def test_tokens_of_a_prompt_equal_the_official_template_when_it_applies(oracle, hf_tok):
    """BFCL's rendering differs from the official Qwen3 template only in the tool lines (raw
    docs, ASCII JSON): with OpenAI-wrapped ASCII tools both give the same ids."""
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"x": 1}}],
                 "reasoning_content": "think"},
                {"role": "tool", "content": "r"}]
    ours = H.render_prompt(messages, tools)
    official = hf_tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours == official == oracle.render(messages, tools)


def _gold_replies(task, last_turn_extra: int = 0):
    replies = []
    for k, calls in enumerate(task.gold_calls):
        if calls:
            replies.append("\n".join(_call(c["name"], **c["arguments"]) for c in calls))
        if k == len(task.gold_calls) - 1 and last_turn_extra:
            replies += [_call("pwd")] * last_turn_extra  # read-only: the state stays the gold one
        replies.append("Done.")
    return replies


def test_force_quit_in_the_last_turn_is_still_scored():
    """BFCL's eval runner fails a force-quit only when turns are missing: gold calls then 20 pwd()
    steps in the last turn (21 steps > 20) force-quit it, yet the checker passes it; the same
    force-quit in the first turn leaves 1 of 4 turns and fails."""
    (task,) = bfcl.load_tasks("base", limit=1)
    gold = _play(task, _gold_replies(task))
    assert gold.finished and not gold.episode.force_quit and gold.verdict()["valid"]
    # last turn: 1 gold step + 20 pwd steps = 21 steps -> force-quit after the 21st
    last = _play(task, _gold_replies(task, last_turn_extra=20))
    assert last.episode.force_quit and last.finished and len(last.turns) == 4
    assert last.verdict()["valid"] is True
    first = _play(task, [_call("pwd")] * 21)
    assert first.episode.force_quit and len(first.turns) == 1
    verdict = first.verdict()
    assert (verdict["valid"], verdict["error_type"]) == (False, "multi_turn:force_terminated")


def test_wrong_calls_fail_the_checker():
    (task,) = bfcl.load_tasks("base", limit=1)
    replies = _gold_replies(task)
    replies[0] = _call("cd", folder="document")  # the first turn's mkdir + mv are missing
    assert _play(task, replies).verdict()["valid"] is False


def _memory_suite(backend, limit):
    prereqs, questions = bfcl.load_memory_tasks(backend, limit=limit)
    return prereqs, questions


def _run_memory(source, backends, limit, tmp_path, settings_kwargs=None):
    from turnsight_jax.eval.runner import run_bfcl_suite
    from turnsight_jax.eval.suites import EvalSettings, Suite
    from turnsight_jax.rollout.progress import ProgressLine

    prereqs, questions = [], []
    for b in backends:
        p, q = bfcl.load_memory_tasks(b, limit=limit)
        prereqs += p
        questions += q
    suite = Suite("bfcl", {"memory": questions}, {"memory": "Memory"}, prerequisites=prereqs)
    settings = EvalSettings(batch_size=64, **(settings_kwargs or {}))
    return run_bfcl_suite(source, suite, settings, ProgressLine(len(questions), quiet=True))


def test_memory_loading_counts():
    """155 questions per backend (465 over kv, rec_sum, vector), each depending on its scenario's
    prerequisite conversations (37 per backend)."""
    for backend in bfcl.MEMORY_BACKENDS:
        prereqs, questions = bfcl.load_memory_tasks(backend)
        assert (len(prereqs), len(questions)) == (37, 155)
        assert all(q.extra["bfcl_answers"] for q in questions)
        assert {p.task_id for p in prereqs} == {d for q in questions for d in q.extra["bfcl_entry"]["depends_on"]}


def test_memory_gold_replay_offline_backends_all_pass():
    """Every kv and rec_sum question (2 x 155) replays its ground truth through agentic_checker."""
    from turnsight_jax.eval.policies import ReplaySource

    source = ReplaySource("gold", default_tokenizer())
    examples, _ = _run_memory(source, bfcl.OFFLINE_MEMORY_BACKENDS, None, None)
    assert len(examples) == 310
    assert sum(e.metrics["bfcl_pass"] for e in examples) == 310


def test_memory_snapshot_chain_and_whitelist(tmp_path):
    """A scripted first prerequisite stores a core-memory value; the next prerequisite of that
    scenario and the question see it in BFCL's memory system prompt; a private method is refused
    (whitelist) and a wrong answer fails the checker."""
    from turnsight_jax.eval.policies import ReplaySource

    prereqs, questions = bfcl.load_memory_tasks("kv", limit=1)  # memory_kv_0-customer-0
    first = prereqs[0]
    assert first.task_id.endswith("-customer-0")
    scripts = [
        {"task_id": first.task_id, "turns": [_call("core_memory_add", key="favourite_colour", value="teal"),
                                             _call("_flush_memory_to_local_file"), "Noted."]},
        {"task_id": questions[0].task_id, "turns": ['{"answer": "Zork", "context": "guess"}']},
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in scripts))
    source = ReplaySource(str(path), default_tokenizer())
    (example,) = _run_memory(source, ["kv"], 1, tmp_path)[0]
    assert example.metrics["bfcl_pass"] == 0.0  # "Zork" is not "Michael"
    assert '"favourite_colour": "teal"' in example.text  # the question's system prompt
    # The whitelist: the private method was answered with an error, not executed.
    env = bfcl.BFCLEnv()
    conv = H.Conversation(first, env.start(first, memory_dir=tmp_path / "again"), enable_thinking=True)
    conv.feed(_call("_flush_memory_to_local_file"))
    assert conv.turns[0][0].results == ["Error during execution: name '_flush_memory_to_local_file' is not defined"]


def test_memory_question_prompt_has_bfcls_memory_instruction(tmp_path):
    (question,) = bfcl.load_memory_tasks("rec_sum", limit=1)[1]
    env = bfcl.BFCLEnv()
    conv = H.Conversation(question, env.start(question, memory_dir=tmp_path), enable_thinking=True)
    system = conv.messages[0]
    assert system["role"] == "system"
    assert system["content"].startswith("You are a general customer support assistant for an e-commerce platform.")
    assert "Here is the content of your memory system from previous interactions:\n"
    assert "There is no content in the memory at this point." in system["content"]  # no prereq ran
    assert system["content"].endswith("'context': A short reason explaining why this question cannot be answered}.\n")
