"""BFCL v4 multi-turn (base, miss_func, miss_param, long_context), Memory and Web Search on `bfcl-eval`.

Install without the package's 6 GB of unrelated dependencies::

    pip install --no-deps bfcl-eval==2026.3.23 && pip install filelock mpmath overrides rank-bm25

(`filelock` for its data loader, `mpmath` for MathAPI, `overrides` and `rank-bm25` for the
Memory backends: the only third-party modules these paths import; the vector Memory backend
also needs sentence-transformers + faiss and a local embedding model, see `memory_vector_module`). `import_bfcl()` points `BFCL_PROJECT_ROOT` at a scratch folder before
the first import, because the package creates result/score/lock folders at import time.

What the environment does, and what it never does
-------------------------------------------------
* The episode's backend is a *fresh* set of the entry's class instances (`involved_classes`,
  loaded from `initial_config`, long-context data for long_context), owned by the episode; the
  package's module-level instance cache is not used while acting.
* Calls are parsed JSON (`ToolCall`), dispatched by name to a bound method of those instances,
  drawn from a whitelist: the functions the entry documents, including miss_func's held-out
  ones (BFCL's executor runs those too if called early). Anything else — unknown names, private names, `__import__`, non-identifier argument
  names — is refused with an error observation. Nothing is `eval`-ed here.
* User turns are sent as BFCL's Qwen FC handler (prompting path, `inference_multi_turn_prompting`)
  sends them: the first turn is the prompt; a policy turn without calls ends the user turn and
  the next user message follows; a held-out-function turn of miss_func is the message
  `"{functions}\\nI have updated some more functions you can choose from. What about now?"`;
  miss_param's clarification turn is simply its next user message. More than 20 steps in one
  user turn force-quits the episode (BFCL's MAXIMUM_STEP_LIMIT); as in BFCL's eval runner, a
  force-quit fails the entry only when it leaves fewer user turns than the ground truth (a
  force-quit in the last user turn is still scored by the checker).
* Memory (`load_memory_tasks`): the backends' prerequisite conversations write a memory
  snapshot (`finish()` flushes it, as BFCL's loop does after a prereq entry) into the episode's
  `memory_dir`; the questions load the scenario's final snapshot and get BFCL's memory system
  prompt (`first_turn_messages`); they are scored by BFCL's `agentic_checker` on the last
  non-call message (`check_agentic`). Memory methods go through the same whitelist.
* Web Search (`load_web_search_tasks`): BFCL's `WebSearchAPI` needs SerpAPI and the network, so
  its two tools run as `envs.web_search.WebSearchTools` on a user-chosen search backend (the
  episode's `search_backend`; same method names, arguments and return values), dispatched
  through the same whitelist; questions are scored by `check_agentic` like Memory's.
* Scoring is the package's own `multi_turn_checker`. It needs each executed call as a call
  string; we build it from the parsed name and arguments as `name(k=repr(v),...)` — the format
  of BFCL's `convert_to_function_call` — i.e. text generated from JSON data, validated to be a
  call of a whitelisted name with literal arguments only. The checker caches instances in module
  globals keyed by model name; every scoring uses a unique model name and removes its globals
  afterwards, so nothing is left behind.
"""

from __future__ import annotations

import ast
import atexit
import copy
import dataclasses
import functools
import importlib
import inspect
import json
import keyword
import math
import os
import shutil
import tempfile
import threading
import uuid
from typing import Any, Mapping, Sequence

from turnsight_jax.chat.types import Call, CallError, Task, ToolCall
from turnsight_jax.envs.base import Environment, Episode, EpisodeScore, StepResult
from turnsight_jax.envs.base import malformed_observation
from turnsight_jax.envs.executor import short_name
from turnsight_jax.envs.web_search import WebSearchTools

BFCL_VERSION = "2026.3.23"
BFCL_CATEGORIES = (
    "multi_turn_base",
    "multi_turn_miss_func",
    "multi_turn_miss_param",
    "multi_turn_long_context",
)
MAXIMUM_STEP_LIMIT = 20
# BFCL refuses these names before its eval (multi_turn_utils.execute_multi_turn_func_call).
_BFCL_BLOCKED = frozenset({"kill", "exit", "quit", "remove", "unlink", "popen", "Popen", "run"})

_import_lock = threading.Lock()
# The checker itself mutates module globals (its instance cache); scoring is serialised.
_checker_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def import_bfcl() -> dict[str, Any]:
    """Imports the parts of `bfcl-eval` the multi-turn path needs; returns them by name.

    Raises ImportError with install instructions when the package is missing.
    """
    with _import_lock:
        if not os.environ.get("BFCL_PROJECT_ROOT"):
            # The package writes result/, score/ and .file_locks/ under this root on import. The
            # process that made the folder removes it at exit (processes it starts inherit the
            # variable and reuse the folder).
            root = tempfile.mkdtemp(prefix="turnsight_bfcl_")
            os.environ["BFCL_PROJECT_ROOT"] = root
            atexit.register(shutil.rmtree, root, ignore_errors=True)
        try:
            checker = importlib.import_module(
                "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_checker"
            )
            utils = importlib.import_module("bfcl_eval.utils")
            mt_utils = importlib.import_module(
                "bfcl_eval.eval_checker.multi_turn_eval.multi_turn_utils"
            )
            backend = importlib.import_module("bfcl_eval.constants.executable_backend_config")
            prompts = importlib.import_module("bfcl_eval.constants.default_prompts")
            agentic = importlib.import_module("bfcl_eval.eval_checker.agentic_eval.agentic_checker")
        except ImportError as e:
            raise ImportError(
                f"BFCL needs the bfcl-eval package: pip install --no-deps "
                f"bfcl-eval=={BFCL_VERSION} && pip install filelock mpmath ({e})"
            ) from e
    return {
        "multi_turn_checker": checker.multi_turn_checker,
        "load_dataset_entry": utils.load_dataset_entry,
        "load_ground_truth_entry": utils.load_ground_truth_entry,
        "mt_utils": mt_utils,
        "CLASS_FILE_PATH_MAPPING": backend.CLASS_FILE_PATH_MAPPING,
        "STATELESS_CLASSES": frozenset(backend.STATELESS_CLASSES),
        "ADDITIONAL_FUNCTION_PROMPT": prompts.DEFAULT_USER_PROMPT_FOR_ADDITIONAL_FUNCTION_PROMPTING,
        "MAXIMUM_STEP_LIMIT": prompts.MAXIMUM_STEP_LIMIT,
        "MEMORY_AGENT_SETTINGS": prompts.MEMORY_AGENT_SETTINGS,
        "MEMORY_INSTRUCTION_CORE_ARCHIVAL": prompts.MEMORY_BACKEND_INSTRUCTION_CORE_ARCHIVAL,
        "MEMORY_INSTRUCTION_UNIFIED": prompts.MEMORY_BACKEND_INSTRUCTION_UNIFIED,
        "agentic_checker": agentic.agentic_checker,
        "populate_web_search_settings": utils.populate_initial_settings_for_web_search_test_cases,
    }


def _full_category(category: str) -> str:
    name = category if category.startswith("multi_turn_") else f"multi_turn_{category}"
    if name not in BFCL_CATEGORIES:
        raise ValueError(f"unknown BFCL category {category!r}; expected one of {BFCL_CATEGORIES}")
    return name


# ---------------------------------------------------------------------------------------------
# Backend instances and the call whitelist
# ---------------------------------------------------------------------------------------------
MEMORY_BACKENDS = ("kv", "rec_sum", "vector")
# Backends that run offline; "vector" needs an embedding model (`memory_vector_module`).
OFFLINE_MEMORY_BACKENDS = ("kv", "rec_sum")
# bfcl-eval's two Web Search categories: the same 100 questions with and without result snippets.
WEB_SEARCH_CATEGORIES = ("web_search_base", "web_search_no_snippet")
WEB_SEARCH_CLASS = "WebSearchAPI"


def is_memory_entry(entry_id: str) -> bool:
    return entry_id.startswith("memory_")


def is_memory_prereq(entry_id: str) -> bool:
    return is_memory_entry(entry_id) and "_prereq" in entry_id


_embedding_model_path: list[str] = []


def use_embedding_model(path: str) -> None:
    """Loads the vector Memory backend with the sentence-transformers model in folder `path`.

    BFCL's memory_vector module builds its encoder at import time from the hub name
    "all-MiniLM-L6-v2" (a download); here that name resolves to the user's local folder instead,
    the only model this process then uses. Needs sentence-transformers and faiss."""
    import pathlib

    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise OSError("no such folder (a local sentence-transformers model, e.g. all-MiniLM-L6-v2)")
    if _embedding_model_path:
        if _embedding_model_path[0] != str(folder.resolve()):
            raise ValueError(f"the vector backend already uses {_embedding_model_path[0]}")
        return
    try:
        import faiss  # noqa: F401
        import sentence_transformers
    except ImportError as e:
        raise ImportError(f"the vector Memory backend needs sentence-transformers and faiss-cpu ({e})") from None
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    original = sentence_transformers.SentenceTransformer
    sentence_transformers.SentenceTransformer = lambda *a, **k: model  # the import-time encoder
    try:
        import_bfcl()
        importlib.import_module(f"{import_bfcl()['CLASS_FILE_PATH_MAPPING']['MemoryAPI_vector']}")
    finally:
        sentence_transformers.SentenceTransformer = original
    _embedding_model_path.append(str(folder.resolve()))


def _memory_config(entry: Mapping[str, Any], memory_dir) -> dict:
    """BFCL's initial config of a Memory class (`populate_initial_settings_for_memory_test_cases`)."""
    import pathlib

    if memory_dir is None:
        raise ValueError(f"{entry['id']}: a Memory entry needs a memory_dir for its snapshots")
    return {"model_result_dir": pathlib.Path(memory_dir), "scenario": entry["scenario"], "test_id": entry["id"],
            "test_category": entry["id"].rsplit("_", 1)[0]}  # BFCL's extract_test_category_from_id


def make_instances(entry: Mapping[str, Any], memory_dir=None, search_backend=None) -> dict[str, Any]:
    """Fresh class instances of an entry, loaded from its initial config (BFCL's loader logic).

    Memory classes load the snapshot of their scenario under `memory_dir` (a folder per
    evaluation chain: prereq conversations write it, questions read it). `WebSearchAPI` is
    `envs.web_search.WebSearchTools` on `search_backend` (BFCL's class needs SerpAPI and the
    network), loaded with the entry's show_snippet setting."""
    bfcl = import_bfcl()
    long_context = "long_context" in entry["id"]
    instances = {}
    for class_name in entry["involved_classes"]:
        if class_name == WEB_SEARCH_CLASS:
            instances[class_name] = _web_search_instance(entry, search_backend)
            continue
        module = importlib.import_module(bfcl["CLASS_FILE_PATH_MAPPING"][class_name])
        instance = getattr(module, class_name)()
        if class_name.startswith("MemoryAPI"):
            instance._load_scenario(_memory_config(entry, memory_dir), long_context=long_context)
        elif class_name not in bfcl["STATELESS_CLASSES"]:
            config = entry.get("initial_config", {}).get(class_name, {})
            instance._load_scenario(copy.deepcopy(config), long_context=long_context)
        instances[class_name] = instance
    return instances


def _web_search_instance(entry: Mapping[str, Any], search_backend):
    if search_backend is None:
        raise ValueError(f"{entry['id']}: a Web Search entry needs a search backend")
    instance = WebSearchTools(search_backend)
    instance._load_scenario(entry["initial_config"][WEB_SEARCH_CLASS])
    return instance


def public_methods(instances: Mapping[str, Any]) -> dict[str, Any]:
    """Method name -> bound method over the instances (later classes win, as in BFCL)."""
    methods: dict[str, Any] = {}
    for instance in instances.values():
        for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
            if not name.startswith("_"):
                methods[name] = method
    return methods


def _is_json_value(value: Any, depth: int = 0) -> bool:
    if depth > 32:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_is_json_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_value(v, depth + 1) for k, v in value.items())
    return False


def _valid_kwarg_name(name: Any) -> bool:
    # No leading underscore: no backend method takes such a parameter, and it keeps dunder
    # names out of the call strings handed to the checker.
    return (
        isinstance(name, str)
        and name.isidentifier()
        and not keyword.iskeyword(name)
        and not name.startswith("_")
    )


# Environment steps run on threads, and CPython 3.11's AST constructor keeps a recursion counter
# that concurrent parses corrupt ("SystemError: AST constructor recursion depth mismatch",
# cpython gh-106905): parses are serialised. They are tiny, so the lock costs nothing measurable.
_AST_LOCK = threading.Lock()


def _parse_eval(text: str) -> ast.expr:
    with _AST_LOCK:
        return ast.parse(text, mode="eval").body


def call_string(name: str, arguments: Mapping[str, Any]) -> str | None:
    """BFCL's call-string form of a parsed call: `name(k1=repr(v1),k2=repr(v2))`.

    Text generated from JSON data (never evaluated here). Returns None unless the result is
    provably a plain call of `name` with literal keyword arguments: `name` and the keys must be
    identifiers, values JSON (finite floats), and the generated text must parse back to exactly
    that (checked with `ast` + `ast.literal_eval`).
    """
    if not (isinstance(name, str) and name.isidentifier() and not name.startswith("_")):
        return None
    if not isinstance(arguments, Mapping):
        return None
    if not all(_valid_kwarg_name(k) for k in arguments):
        return None
    if not all(_is_json_value(v) for v in arguments.values()):
        return None
    text = f"{name}({','.join(f'{k}={v!r}' for k, v in arguments.items())})"
    try:
        node = _parse_eval(text)
    except SyntaxError:
        return None
    if not (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == name
        and not node.args
        and [kw.arg for kw in node.keywords] == list(arguments)
    ):
        return None
    try:
        values = [ast.literal_eval(kw.value) for kw in node.keywords]
    except (ValueError, SyntaxError, TypeError):
        return None
    if values != list(arguments.values()):
        return None
    return text


def _format_result(value: Any) -> str:
    """BFCL's conversion of a method's return value to observation text."""
    if type(value) is str:
        return value
    if type(value) is dict:
        try:
            return json.dumps(value)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


# ---------------------------------------------------------------------------------------------
# Dataset
# ---------------------------------------------------------------------------------------------
def _positional_names(entry: Mapping[str, Any], name: str) -> list[str]:
    """Parameter names of method `name` of the entry's classes (later classes win, as in BFCL)."""
    bfcl = import_bfcl()
    found = None
    for class_name in entry["involved_classes"]:
        cls = getattr(importlib.import_module(bfcl["CLASS_FILE_PATH_MAPPING"][class_name]), class_name)
        if not name.startswith("_") and callable(getattr(cls, name, None)):
            found = getattr(cls, name)
    if found is None:
        raise ValueError(f"{entry['id']}: no method {name!r} to name positional arguments")
    params = [
        p.name for p in inspect.signature(found).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return params[1:]  # drop `self`


def _gt_to_call(text: str, entry: Mapping[str, Any]) -> dict[str, Any]:
    """A ground-truth call string (dataset text) -> {"name", "arguments"}; parsed, not evaluated.

    Positional arguments are named from the method's signature.
    """
    node = _parse_eval(text)
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise ValueError(f"{entry['id']}: ground-truth call {text!r} is not a plain function call")
    name = node.func.id
    args: dict[str, Any] = {}
    if node.args:
        for param, arg in zip(_positional_names(entry, name), node.args):
            args[param] = ast.literal_eval(arg)
    for kw in node.keywords:
        args[kw.arg] = ast.literal_eval(kw.value)
    return {"name": name, "arguments": args}


def entry_to_task(entry: Mapping[str, Any], ground_truth: Sequence[Sequence[str]]) -> Task:
    """A BFCL entry (as `load_dataset_entry` returns it) and its ground truth -> `Task`."""
    category = entry["id"].rsplit("_", 1)[0]
    gold = tuple(tuple(_gt_to_call(s, entry) for s in turn) for turn in ground_truth)
    first = entry["question"][0]
    return Task(
        task_id=entry["id"],
        messages=tuple(dict(m) for m in first),
        tools=tuple({"type": "function", "function": dict(doc)} for doc in entry["function"]),
        codes={},
        unsolved_set={},
        answer="",
        data_source=f"bfcl/{category}",
        category=category,
        gold_calls=gold,
        extra={"bfcl_entry": entry, "ground_truth": [list(t) for t in ground_truth]},
    )


def load_tasks(category: str, *, limit: int | None = None) -> list[Task]:
    """The 200 tasks of a BFCL multi-turn category (e.g. "multi_turn_base" or "base")."""
    bfcl = import_bfcl()
    category = _full_category(category)
    entries = bfcl["load_dataset_entry"](category)
    truths = bfcl["load_ground_truth_entry"](category)
    if len(entries) != len(truths):
        raise ValueError(f"BFCL {category}: {len(entries)} entries but {len(truths)} ground truths")
    tasks = []
    for index, (entry, truth) in enumerate(zip(entries, truths)):
        if limit is not None and index >= limit:
            break
        if entry["id"] != truth["id"]:
            raise ValueError(
                f"BFCL {category}: row {index}: entry id {entry['id']!r} != ground-truth id "
                f"{truth['id']!r}"
            )
        tasks.append(entry_to_task(entry, truth["ground_truth"]))
    return tasks


def memory_entry_to_task(entry: Mapping[str, Any], answers: Sequence[str] | None) -> Task:
    """A Memory entry (question or prerequisite conversation) -> `Task`; `answers`: the accepted
    answers of a question (BFCL's possible answers), None for a prerequisite conversation."""
    category = entry["id"].rsplit("_", 1)[0]
    return Task(
        task_id=entry["id"],
        messages=tuple(dict(m) for m in entry["question"][0]),
        tools=tuple({"type": "function", "function": dict(doc)} for doc in entry["function"]),
        codes={}, unsolved_set={}, answer=answers[0] if answers else "",
        data_source=f"bfcl/{category}", category="memory",
        extra={"bfcl_entry": entry, "bfcl_answers": None if answers is None else list(answers),
               "memory_backend": category.replace("_prereq", "")[len("memory_"):]},
    )


def load_memory_tasks(backend: str, *, limit: int | None = None) -> tuple[list[Task], list[Task]]:
    """(prerequisite conversations, questions) of one Memory backend ("kv", "rec_sum", "vector").

    The 155 questions of a backend (465 over the three) in BFCL's order, the first `limit`; the
    prerequisites are every conversation those questions depend on, in BFCL's order (within a
    scenario each conversation continues the previous one's snapshot)."""
    if backend not in MEMORY_BACKENDS:
        raise ValueError(f"unknown BFCL memory backend {backend!r}; expected one of {MEMORY_BACKENDS}")
    bfcl = import_bfcl()
    category = f"memory_{backend}"
    entries = bfcl["load_dataset_entry"](category)
    answers = {row["id"].replace("memory", category, 1): row["ground_truth"]
               for row in bfcl["load_ground_truth_entry"](category)}
    questions = [e for e in entries if not is_memory_prereq(e["id"])]
    if limit is not None:
        questions = questions[:limit]
    missing = [e["id"] for e in questions if e["id"] not in answers]
    if missing:
        raise ValueError(f"BFCL {category}: no possible answer for {missing[0]!r}")
    needed = {d for e in questions for d in e.get("depends_on", ())}
    prereqs = [memory_entry_to_task(e, None) for e in entries if e["id"] in needed]
    return prereqs, [memory_entry_to_task(e, answers[e["id"]]) for e in questions]


def load_web_search_tasks(category: str, *, limit: int | None = None) -> list[Task]:
    """The 100 questions of a Web Search category ("web_search_base" or "web_search_no_snippet"),
    the first `limit`, as BFCL prepares them: its answer-format system prompt first, the
    `show_snippet` initial config of the category; the accepted answers from its possible-answer
    file. Scored like Memory questions (`agentic_checker`)."""
    if category not in WEB_SEARCH_CATEGORIES:
        raise ValueError(f"unknown BFCL web search category {category!r}; expected one of {WEB_SEARCH_CATEGORIES}")
    bfcl = import_bfcl()
    entries = bfcl["populate_web_search_settings"](bfcl["load_dataset_entry"](category))
    answers = {row["id"].replace("web_search", category, 1): row["ground_truth"]
               for row in bfcl["load_ground_truth_entry"](category)}
    tasks = []
    for index, entry in enumerate(entries[:limit] if limit is not None else entries):
        if entry["id"] not in answers:
            raise ValueError(f"BFCL {category}: row {index}: no possible answer for {entry['id']!r}")
        tasks.append(dataclasses.replace(memory_entry_to_task(entry, answers[entry["id"]]), category="web_search",
                                         extra={"bfcl_entry": entry, "bfcl_answers": list(answers[entry["id"]]),
                                                "web_search_category": category}))
    return tasks


def memory_system_prompt(entry: Mapping[str, Any], instance) -> str:
    """BFCL's memory instruction (`add_memory_instruction_system_prompt`): the scenario's agent
    setting and the backend's current core memory, in the template of its backend."""
    bfcl = import_bfcl()
    template = bfcl["MEMORY_INSTRUCTION_UNIFIED"] if "rec_sum" in entry["id"] else \
        bfcl["MEMORY_INSTRUCTION_CORE_ARCHIVAL"]
    return template.format(scenario_setting=bfcl["MEMORY_AGENT_SETTINGS"][entry["scenario"]],
                           memory_content=instance._dump_core_memory_to_context())


def check_agentic(step_texts: Sequence[str], answers: Sequence[str], decodes: Sequence[bool]) -> dict:
    """BFCL's agentic verdict (`_evaluate_single_agentic_entry`): the last step whose text did not
    decode to calls must contain one of `answers` (`agentic_checker`). `decodes[i]`: step i decoded
    to at least one call."""
    last = None
    for text, is_call in zip(step_texts, decodes):
        if not is_call:
            last = text
    if not last:
        return {"valid": False, "error_type": "agentic:no_last_message",
                "error_message": "Cannot find the last chat message that is not a function call."}
    return import_bfcl()["agentic_checker"](last, list(answers))


# ---------------------------------------------------------------------------------------------
# Episode
# ---------------------------------------------------------------------------------------------
class BFCLEpisode(Episode):
    """One BFCL multi-turn conversation against a fresh backend (see the module docstring)."""

    def __init__(self, task: Task, memory_dir=None, search_backend=None):
        bfcl = import_bfcl()
        self.task = task
        self._entry = task.extra["bfcl_entry"]
        self._ground_truth = task.extra.get("ground_truth")  # None for Memory entries (answers instead)
        self._questions = self._entry["question"]
        self._holdout = self._entry.get("missed_function", {})
        self._additional_prompt = bfcl["ADDITIONAL_FUNCTION_PROMPT"]
        self._step_limit = bfcl["MAXIMUM_STEP_LIMIT"]
        self.instances = make_instances(self._entry, memory_dir, search_backend)
        self._methods = public_methods(self.instances)
        # Whitelist: every function the entry documents, held-out ones included. BFCL's own
        # executor runs any method of the involved classes by name, so a held-out function
        # called before it is announced still executes there (miss_func_49's ground truth even
        # does so); we keep that behaviour but refuse anything the entry does not document.
        self.allowed = {doc["name"] for doc in self._entry["function"]}
        for docs in self._holdout.values():
            self.allowed.update(doc["name"] for doc in docs)
        self.turn_index = 0
        self._steps_in_turn = 0
        self.force_quit = False
        self._done = False
        # Per user turn, per step: the call strings of the executed calls (BFCL's decoded list).
        self.call_strings: list[list[list[str]]] = [[]]

    @property
    def done(self) -> bool:
        return self._done

    def turn_messages(self, index: int) -> list[dict]:
        """The messages that open user turn `index`, as BFCL's loop adds them: the entry's
        messages of that turn (turn 0 with the memory instruction for Memory entries), or
        miss_func's announcement of its held-out functions."""
        key = str(index)
        if key in self._holdout:
            return [{"role": "user", "content": self._additional_prompt.format(functions=self._holdout[key])}]
        messages = [dict(m) for m in self._questions[index]]
        if index == 0 and is_memory_entry(self._entry["id"]):
            (instance,) = self.instances.values()
            prompt = memory_system_prompt(self._entry, instance)
            if messages and messages[0]["role"] == "system":
                messages[0]["content"] = prompt + "\n\n" + messages[0]["content"]
            else:
                messages.insert(0, {"role": "system", "content": prompt})
        return messages

    def finish(self) -> None:
        """End of the conversation: a Memory prerequisite writes its snapshot (BFCL flushes it)."""
        if is_memory_prereq(self._entry["id"]):
            (instance,) = self.instances.values()
            instance._flush_memory_to_local_file()

    def _execute(self, call: ToolCall) -> str:
        name = call.name
        if name in _BFCL_BLOCKED:
            return f"Error during execution: Function call {name} is not allowed."
        if name not in self.allowed or name.startswith("_") or name not in self._methods:
            # What BFCL's executor answers for a name it cannot resolve.
            return f"Error during execution: name {short_name(repr(name))} is not defined"
        if not isinstance(call.arguments, Mapping):
            return f"Error during execution: arguments of {name} must be a JSON object"
        bad = [k for k in call.arguments if not _valid_kwarg_name(k)]
        if bad:
            return f"Error during execution: invalid argument name {short_name(repr(bad[0]))} for {name}"
        try:
            return _format_result(self._methods[name](**call.arguments))
        except Exception as e:  # noqa: BLE001 - backend errors become observations, as in BFCL
            return f"Error during execution: {e}"

    def _next_user_turn(self) -> StepResult:
        """Ends the current user turn; returns the next user message, or finishes."""
        self.turn_index += 1
        self._steps_in_turn = 0
        if self.turn_index >= len(self._questions):
            self._done = True
            return StepResult(observations=(), done=True)
        self.call_strings.append([])
        added: tuple[dict, ...] = ()
        key = str(self.turn_index)
        if key in self._holdout:
            added = tuple({"type": "function", "function": dict(doc)} for doc in self._holdout[key])
        message = "\n".join(m["content"] for m in self.turn_messages(self.turn_index))
        return StepResult(observations=(), done=False, user_message=message, added_tools=added)

    def step(self, calls: Sequence[Call]) -> StepResult:
        if self._done:
            return StepResult(observations=tuple(["episode is over"] * len(calls)), done=True)
        observations: list[str] = []
        step_strings: list[str] = []
        n_valid = 0
        for call in calls:
            if isinstance(call, ToolCall):
                n_valid += 1
                observations.append(self._execute(call))
                if call.name in self.allowed and call.name in self._methods:
                    text = call_string(call.name, call.arguments)
                    if text is not None:
                        step_strings.append(text)
            elif isinstance(call, CallError):
                observations.append(malformed_observation(call))
            else:
                observations.append(f"unsupported call object {type(call).__name__}")
        if n_valid == 0:
            # BFCL: a step that decodes to no call ends the user turn.
            nxt = self._next_user_turn()
            return dataclasses.replace(nxt, observations=tuple(observations))
        self.call_strings[-1].append(step_strings)
        self._steps_in_turn += 1
        if self._steps_in_turn > self._step_limit:
            self.force_quit = True
            self._done = True
            return StepResult(observations=tuple(observations), done=True)
        return StepResult(observations=tuple(observations), done=False)

    def score(self, final_text: str | None = None) -> EpisodeScore:
        result = check_episode(self)
        passed = 1.0 if result.get("valid") else 0.0
        return EpisodeScore(
            reward=passed,
            metrics={"bfcl_pass": passed, "num_user_turns_done": float(self.turn_index)},
        )

    @property
    def checker_result(self) -> dict:
        return check_episode(self)


def check_episode(episode: BFCLEpisode) -> dict:
    """The official verdict for an episode: BFCL's eval-runner checks, then `multi_turn_checker`.

    Returns the checker's dict ({"valid": bool, ...}).
    """
    bfcl = import_bfcl()
    ground_truth = episode._ground_truth
    # BFCL's loop records the force-quit turn, then stops: turns 0..turn_index. A finished episode
    # has all its turns; an unfinished one (cut by a budget) those begun so far.
    if episode.force_quit:
        turns = episode.call_strings[: episode.turn_index + 1]
    else:
        turns = episode.call_strings[: episode.turn_index] if episode.done else episode.call_strings
    # BFCL's eval runner fails an entry only when its turn count differs from the ground truth's,
    # so a force-quit in the last user turn is still scored by the checker.
    if len(turns) != len(ground_truth):
        return {
            "valid": False,
            "error_type": "multi_turn:force_terminated",
            "error_message": (
                f"model result has {len(turns)} turns, ground truth {len(ground_truth)}"
                + (" (force-quit after too many steps)" if episode.force_quit else "")
            ),
        }
    # BFCL's eval runner drops steps that decoded to nothing.
    decoded = [[step for step in turn if step] for turn in turns]
    entry = episode._entry
    test_entry = {
        "id": entry["id"],
        "initial_config": entry.get("initial_config", {}),
        "involved_classes": entry["involved_classes"],
    }
    model_name = f"turnsight_{uuid.uuid4().hex}"
    module_globals = vars(bfcl["mt_utils"])
    with _checker_lock:
        try:
            return bfcl["multi_turn_checker"](
                decoded, ground_truth, test_entry, entry["id"].rsplit("_", 1)[0], model_name
            )
        finally:
            for key in [k for k in module_globals if k.startswith(model_name)]:
                del module_globals[key]


class BFCLEnv(Environment):
    """BFCL multi-turn environment; each `start` builds a fresh backend for the task."""

    name = "bfcl"

    def __init__(self):
        import_bfcl()

    def start(self, task: Task, *, seed: int = 0, memory_dir=None, search_backend=None) -> BFCLEpisode:
        # BFCL backends are deterministic given the entry; `seed` is accepted for the protocol.
        if "bfcl_entry" not in task.extra:
            raise ValueError(f"task {task.task_id} is not a BFCL task (no extra['bfcl_entry'])")
        return BFCLEpisode(task, memory_dir=memory_dir, search_backend=search_backend)
