"""FTRL rows built in the tests (the layout of MatchTIR's training rows, with `ground_truth`),
shared by tests/test_envs_ftrl.py and tests/test_sources.py."""

from __future__ import annotations

import json


def _tool(name: str, params: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in params.items()}}}}


def gt_row(i: int, ground_truth) -> dict:
    """An FTRL row (the layout of MatchTIR's training rows), two hops, with `ground_truth`."""
    row = {
        "messages": [{"role": "user", "content": f"Where was the director of film {i} born?"}],
        "tools": json.dumps([_tool("director_of", {"film": "string"}), _tool("birthplace", {"person": "string",
                                                                                             "exact": "boolean"})]),
        "codes": json.dumps({"director_of": "def director_of(film):\n    return 'Ada'\n",
                             "birthplace": "def birthplace(person, exact=False):\n    return 'Oslo'\n"}),
        "unsolved_set": json.dumps({"director_of": ["Ada"], "birthplace": ["Oslo"]}),
        "answer": "Oslo",
        "data_source": "self/multi_hop",
    }
    if ground_truth is not None:
        row["ground_truth"] = ground_truth
    return row


GT_CALLS = [[{"name": "director_of", "parameters": {"film": "film 0"}},
             {"name": "birthplace", "parameters": {"person": "Ada", "exact": True}}],
            [{"name": "director_of", "arguments": {"film": "film 1"}},  # "arguments" is accepted too
             {"name": "birthplace", "arguments": json.dumps({"person": "Ada"})}]]  # ... and JSON text of an object
GT_GOLD = [(({"name": "director_of", "arguments": {"film": "film 0"}},),
            ({"name": "birthplace", "arguments": {"person": "Ada", "exact": True}},)),
           (({"name": "director_of", "arguments": {"film": "film 1"}},),
            ({"name": "birthplace", "arguments": {"person": "Ada"}},))]


def gt_rows() -> list[dict]:
    # row 0: JSON text (the released data's form); row 1: an already decoded list.
    return [gt_row(0, json.dumps(GT_CALLS[0])), gt_row(1, GT_CALLS[1])]
