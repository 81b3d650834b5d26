"""Built-in synthetic tasks in FTRL format (the training default; no download needed).

Each task is a small lookup world: relation tools `get_<relation>(name)` whose Python source
(`Task.codes`) holds a tiny table from entity to entity, run through the same isolated executor
as FTRL's tools. The four FTRL categories:

  single_hop           'What is the city of "Kato"?'            1 turn, 1 call
  parallel_single_hop  'What are the city of "Kato" and ...?'   1 turn, `width` calls
  multi_hop            'What is the pet of the city of "Kato"?' `hops` turns, 1 call each
  parallel_multi_hop   `width` chains of `hops` hops          `hops` turns, `width` calls each

plus 1–2 distractor tools (other relations over the same entities). Gold call chains are in
`Task.gold_calls` (one list per turn), the gold intermediate answers in `Task.unsolved_set`
(tool name -> outputs of its gold calls, FTRL's Solve-P/R/F1), the final answer in `Task.answer`
(", "-joined for parallel questions, FTRL's multi-part format).

Designed so that a tiny Qwen3 can learn it on a CPU in minutes after a short supervised
warm-start: short tool names and descriptions, one string argument per tool, four-letter
entity names, short questions, and a user message that mirrors FTRL's wording ("Please call
given tools to answer the question." ...). `gold_turn_texts(task)` gives the ideal policy
turns in Qwen3's tool-call format for that warm-start.

Difficulty knobs (`SyntheticConfig`): hops, parallel width, number of distractor tools,
entity vocabulary size, extra table rows. Generation is a pure function of (category, seed,
config).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from typing import Sequence

from turnsight_jax.chat.parsing import render_tool_call
from turnsight_jax.chat.types import Task, ToolCall

SYNTHETIC_CATEGORIES = ("single_hop", "parallel_single_hop", "multi_hop", "parallel_multi_hop")

RELATIONS = (
    "city", "boss", "pet", "team", "home", "job", "song", "car",
    "club", "book", "coach", "friend", "school", "color", "food", "star",
    # more relations for long chains (data.num_relations > 16); the first 16 keep their order, so
    # tasks drawn from them are unchanged
    "bank", "game", "film", "tree", "ship", "room", "lake", "hill",
    "shop", "road", "park", "farm", "band", "tool", "drink", "bird",
)
DEFAULT_RELATIONS = 16
# First names that the Qwen3 tokenizer keeps as one token after a quote, a newline and a tag
# alike, so copying one is a single-token copy (no name is a substring of another).
SINGLE_TOKEN_NAMES = (
    "Bob", "Carl", "Emma", "Jack", "Paul", "Sam", "Tom", "Anna", "Ben", "Eric", "Mike", "Adam", "Alan",
    "Andy", "Bill", "Chris", "David", "Frank", "George", "Harry", "Henry", "James", "Joe", "Kim", "Leo",
    "Mark", "Max", "Steve", "Will", "Kevin", "Ray",
)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"

FTRL_PROMPT = (
    "Please call given tools to answer the question. Please note that all your information must "
    "be obtained by calling tools and not by answering the question directly.\n"
    "If the call fails, you need to try to correct it and continue until you arrive at an "
    "answer.\nQuestion: {question}"
)
SHORT_PROMPT = "Please call given tools to answer the question.\nQuestion: {question}"
UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
    """Difficulty knobs of the built-in tasks.

    hops: chain length of the multi-hop categories (>= 2).
    max_hops: 0 (every multi-hop task has `hops` hops), or the longest chain: each multi-hop task's
      length is then drawn uniformly from [hops, max_hops] (long horizons: a chain of n hops takes
      n tool turns and the answer turn, so 19 hops take 20 turns).
    width: number of parallel sub-questions of the parallel categories (>= 2).
    min_distractors / max_distractors: distractor tools per task (uniform in the range).
    vocab_size: number of distinct entity names the generator draws from.
    num_relations: how many of the 32 relation names (tools) tasks draw from (16 by default; a
      chain uses each relation once, so hops + max_distractors must fit).
    entity_style: "cvcv" (four-letter made-up words, up to 9,800) or "names" (single-token first
      names, up to 31: easiest to copy for a tiny model).
    extra_rows: table rows per tool beyond those the gold chain needs.
    prompt_style: "short" (FTRL's first sentence + the question) or "ftrl" (FTRL's full text).
    min_result_words / max_result_words: 0 / 0 (a tool returns the bare entity), or each table row
      carries a record note of uniform [min, max] words after its entity ("Kato\nrecord: ...";
      FTRL's tool results are long JSON records, the built-in tables' one word), and an unknown
      name's "unknown" a note of the tool's own. The notes are lower-case words that contain no
      entity of the vocabulary, so they never solve a gold answer; drawn from a stream of their
      own, so tasks without notes are unchanged.
    """

    hops: int = 2
    max_hops: int = 0
    width: int = 2
    min_distractors: int = 1
    max_distractors: int = 2
    vocab_size: int = 64
    num_relations: int = DEFAULT_RELATIONS
    entity_style: str = "cvcv"
    extra_rows: int = 2
    prompt_style: str = "short"
    min_result_words: int = 0
    max_result_words: int = 0

    def validate(self) -> None:
        if self.hops < 2:
            raise ValueError(f"SyntheticConfig.hops must be >= 2, got {self.hops}")
        if self.max_hops and self.max_hops < self.hops:
            raise ValueError(f"SyntheticConfig.max_hops must be 0 (off) or >= hops={self.hops}, got {self.max_hops}")
        if self.width < 2:
            raise ValueError(f"SyntheticConfig.width must be >= 2, got {self.width}")
        if not 0 <= self.min_distractors <= self.max_distractors:
            raise ValueError(
                f"SyntheticConfig: need 0 <= min_distractors <= max_distractors, got "
                f"{self.min_distractors}, {self.max_distractors}"
            )
        if not 1 <= self.num_relations <= len(RELATIONS):
            raise ValueError(f"SyntheticConfig.num_relations must be in [1, {len(RELATIONS)}], got {self.num_relations}")
        if self.longest + self.max_distractors > self.num_relations:
            raise ValueError(
                f"SyntheticConfig: {'max_hops' if self.max_hops else 'hops'} + max_distractors must be <= "
                f"num_relations={self.num_relations}"
            )
        if self.entity_style not in ("cvcv", "names"):
            raise ValueError(f"SyntheticConfig.entity_style must be 'cvcv' or 'names', got {self.entity_style!r}")
        needed = self.width * (self.longest + 1) + self.extra_rows * 2 + 2
        most = len(SINGLE_TOKEN_NAMES) if self.entity_style == "names" else len(_CONSONANTS) ** 2 * len(_VOWELS) ** 2
        if not needed <= self.vocab_size <= most:
            raise ValueError(
                f"SyntheticConfig.vocab_size must be in [{needed}, {most}] for these knobs, got {self.vocab_size}"
            )
        if self.prompt_style not in ("short", "ftrl"):
            raise ValueError(f"SyntheticConfig.prompt_style must be 'short' or 'ftrl', got {self.prompt_style!r}")
        if not 0 <= self.min_result_words <= self.max_result_words:
            raise ValueError(
                f"SyntheticConfig: need 0 <= min_result_words <= max_result_words, got "
                f"{self.min_result_words}, {self.max_result_words}"
            )


    @property
    def longest(self) -> int:
        """The longest chain a task can have."""
        return max(self.hops, self.max_hops)


def entity_vocabulary(size: int, style: str = "cvcv") -> list[str]:
    """The first `size` names of a fixed shuffled list of consonant-vowel-consonant-vowel words.

    All names have four letters, so none is a substring of another (FTRL's substring check can
    never credit the wrong entity).
    """
    if style == "names":
        return list(SINGLE_TOKEN_NAMES[:size])
    return list(_all_entities()[:size])


@functools.lru_cache(maxsize=1)
def _all_entities() -> tuple[str, ...]:
    words = [
        (c1 + v1 + c2 + v2).capitalize()
        for c1 in _CONSONANTS for v1 in _VOWELS for c2 in _CONSONANTS for v2 in _VOWELS
    ]
    random.Random(20240601).shuffle(words)  # fixed seed: the vocabulary never changes
    return tuple(words)


def tool_name(relation: str) -> str:
    return f"get_{relation}"


def _tool_schema(relation: str) -> dict:
    return {
        "type": "function",
        "function": {
            "name": tool_name(relation),
            "description": f"Get the {relation} of a name.",
            "parameters": {
                "type": "object",
                "properties": {"name": {"type": "string", "description": "A name."}},
                "required": ["name"],
            },
        },
    }


def _tool_source(relation: str, table: dict[str, str], notes: dict[str, str] | None = None,
                 missing: str = "") -> str:
    """The tool's Python source: a table lookup, plus each row's record note (and `missing`, an
    unknown name's) when there are notes. The dicts are emitted with json.dumps: valid Python
    literals of plain strings."""
    lines = [f"def {tool_name(relation)}(name):", f"    table = {json.dumps(table, ensure_ascii=False)}"]
    result = f"table.get(name, {UNKNOWN!r})"
    if notes:
        lines.append(f"    notes = {json.dumps(notes, ensure_ascii=False)}")
        result += f" + notes.get(name, {json.dumps(missing, ensure_ascii=False)})"
    return "\n".join([*lines, f"    return {result}"]) + "\n"


# The record notes' words (SyntheticConfig.max_result_words): lower-case, so a capitalised entity
# can only match inside one of them case-insensitively; those that would are dropped per task.
NOTE_WORDS = (
    "record", "entry", "updated", "source", "registry", "field", "value", "listed", "since",
    "verified", "archive", "region", "status", "active", "index", "section", "level", "report",
    "year", "month", "number", "address", "contact", "notes", "history", "owner", "previous",
    "current", "category", "type", "public", "private", "open", "closed", "pending", "approved",
    "north", "south", "east", "west", "central", "district", "office", "branch", "unit", "group",
    "member", "annual", "weekly", "daily", "summary", "detail", "reference", "origin", "copy",
    "version", "changed", "created", "removed", "added", "checked", "audit", "survey", "ledger",
)


def _notes(keys, vocab: Sequence[str], rng: random.Random, config: SyntheticConfig) -> tuple[dict[str, str], str]:
    """(one record note per table row (keys), the note an unknown name gets), each
    "\nrecord: w1 w2 ..." of [min, max] result words. An unknown name gets one too: a real API's
    error body is long as well, so a wrong call costs as many tokens as a right one and the
    lengths do not hinge on the policy's skill."""
    lowered = [e.lower() for e in vocab]
    words = [w for w in NOTE_WORDS if not any(e in w for e in lowered)]

    def note() -> str:
        n = rng.randint(config.min_result_words, config.max_result_words)
        return "\nrecord: " + " ".join(rng.choice(words) for _ in range(n)) if n else ""

    rows = {key: note() for key in keys}
    return rows, note()


def _phrase(relations: Sequence[str], start: str) -> str:
    """'the pet of the city of "Kato"' for relations (city, pet) applied to Kato.

    The entity is quoted so that it tokenises exactly as in the call's JSON string (a bare
    ' Kato' starts with a different, space-prefixed token): copying it is then a plain token
    copy, which a tiny model learns quickly."""
    text = '"' + start + '"'
    for rel in relations:
        text = f"the {rel} of {text}"
    return text


def generate_task(category: str, seed: int, config: SyntheticConfig = SyntheticConfig()) -> Task:
    """One built-in task of `category`, a pure function of (category, seed, config)."""
    if category not in SYNTHETIC_CATEGORIES:
        raise ValueError(f"unknown synthetic category {category!r}; expected one of {SYNTHETIC_CATEGORIES}")
    config.validate()
    rng = random.Random(f"turnsight-synthetic|{category}|{seed}")
    vocab = entity_vocabulary(config.vocab_size, config.entity_style)
    hops = 1 if category.endswith("single_hop") else config.hops
    if hops > 1 and config.max_hops > config.hops:  # drawn only then: fixed-length tasks are unchanged
        hops = rng.randint(config.hops, config.max_hops)
    width = config.width if category.startswith("parallel") else 1
    n_distractors = rng.randint(config.min_distractors, config.max_distractors)
    relations = rng.sample(RELATIONS[: config.num_relations], hops + n_distractors)
    chain_rel, distractor_rel = relations[:hops], relations[hops:]

    # Distinct entities for every chain position: no entity is both an input and an output
    # elsewhere in the task, so only the intended call produces a gold answer.
    entities = rng.sample(vocab, width * (hops + 1))
    chains = [entities[i * (hops + 1) : (i + 1) * (hops + 1)] for i in range(width)]
    used = set(entities)
    spare = [e for e in vocab if e not in used]

    tables: dict[str, dict[str, str]] = {}
    for h, rel in enumerate(chain_rel):
        rows = {chain[h]: chain[h + 1] for chain in chains}
        gold_values = set(rows.values())
        for key in rng.sample(spare, config.extra_rows):
            # Extra rows never return a gold value of this tool (no accidental credit).
            rows[key] = rng.choice([e for e in spare if e not in gold_values and e != key])
        tables[rel] = dict(sorted(rows.items(), key=lambda kv: rng.random()))
    for rel in distractor_rel:
        keys = {chain[h] for chain in chains for h in range(hops)}
        keys.update(rng.sample(spare, config.extra_rows))
        rows = {k: rng.choice([e for e in spare if e != k]) for k in sorted(keys)}
        tables[rel] = dict(sorted(rows.items(), key=lambda kv: rng.random()))

    tool_order = list(relations)
    rng.shuffle(tool_order)
    tools = tuple(_tool_schema(rel) for rel in tool_order)
    notes = {rel: ({}, "") for rel in tool_order}
    if config.max_result_words:  # a stream of their own: the tables and the rest stay as without notes
        note_rng = random.Random(f"turnsight-synthetic-notes|{category}|{seed}")
        notes = {rel: _notes(tables[rel], vocab, note_rng, config) for rel in tool_order}
    codes = {tool_name(rel): _tool_source(rel, tables[rel], *notes[rel]) for rel in tool_order}

    gold_calls = tuple(
        tuple(
            {"name": tool_name(rel), "arguments": {"name": chain[h]}} for chain in chains
        )
        for h, rel in enumerate(chain_rel)
    )
    unsolved_set = {
        tool_name(rel): [chain[h + 1] for chain in chains] for h, rel in enumerate(chain_rel)
    }
    answers = [chain[-1] for chain in chains]
    phrases = [_phrase(chain_rel, chain[0]) for chain in chains]
    if width == 1:
        question = f"What is {phrases[0]}?"
    else:
        question = "What are " + ", ".join(phrases[:-1]) + f" and {phrases[-1]}?"
    template = SHORT_PROMPT if config.prompt_style == "short" else FTRL_PROMPT
    return Task(
        task_id=f"synthetic-{category}-{seed}",
        messages=({"role": "user", "content": template.format(question=question)},),
        tools=tools,
        codes=codes,
        unsolved_set=unsolved_set,
        answer=", ".join(answers),
        data_source=f"synthetic/{category}",
        category=category,
        gold_calls=gold_calls,
        extra={"question": question, "seed": seed},
    )


def generate_tasks(
    n: int,
    *,
    seed: int = 0,
    categories: Sequence[str] = SYNTHETIC_CATEGORIES,
    config: SyntheticConfig = SyntheticConfig(),
) -> list[Task]:
    """`n` tasks cycling through `categories`; task i uses seed `seed * 1_000_003 + i`."""
    if not categories:
        raise ValueError("generate_tasks: categories is empty")
    return [
        generate_task(categories[i % len(categories)], seed * 1_000_003 + i, config)
        for i in range(n)
    ]


def gold_tool_calls(task: Task) -> list[list[ToolCall]]:
    """The gold chain as `ToolCall`s, one list per tool turn."""
    if task.gold_calls is None:
        raise ValueError(f"task {task.task_id} has no gold_calls")
    return [
        [ToolCall(c["name"], dict(c["arguments"]), raw=json.dumps(c, ensure_ascii=False)) for c in turn]
        for turn in task.gold_calls
    ]


def tool_call_text(name: str, arguments: dict) -> str:
    """One call in Qwen3's format (the chat template's `<tool_call>` block), as the parser's
    `render_tool_call` writes it."""
    return render_tool_call(name, arguments)


def gold_turn_texts(task: Task) -> list[str]:
    """The policy's ideal turn texts: one per gold tool turn, then `<answer>…</answer>`.

    Tool turns are the turn's calls as Qwen3 `<tool_call>` blocks joined by newlines.
    """
    turns = [
        "\n".join(tool_call_text(c["name"], dict(c["arguments"])) for c in turn)
        for turn in (task.gold_calls or ())
    ]
    turns.append(f"<answer>{task.answer}</answer>")
    return turns
