"""Rewards: outcome rewards (Solve-F1, answer token-F1, BFCL pass) and MatchTIR turn rewards.

MatchTIR turn rewards (docs/spec.md §1.11)
------------------------------------------
*What is matched to what:* every predicted tool call of the whole trajectory (all tool turns,
flattened in turn order) is matched against every gold call of the task (`Task.gold_calls`, all
turns flattened). Matching is therefore trajectory-level and order-free: a correct call made one
turn later than the gold chain has it still gets credit.

*Similarity* of a predicted call p and a gold call g:
  0 if the names differ (or p is malformed), else
  (1 + Jaccard(param names of p, param names of g) + #gold params whose value p gives exactly)
  / (2 + #gold params)
so an exact call scores 1. Jaccard of two empty name sets is 1 (identical sets). "Exactly" is
JSON equality with types respected (True != 1; 1 == 1.0 as JSON numbers).

*Matching:*
  - "assignment": a maximum-weight bipartite matching (Hungarian / Kuhn–Munkres, optimal, via
    `scipy.optimize.linear_sum_assignment`); each predicted call gets the similarity of its
    matched gold call; calls left unmatched (more predictions than golds) get 0.
  - "transport": an entropic optimal-transport plan (Sinkhorn, reg 0.1) between uniform
    marginals over predicted calls (1/P each) and gold calls (1/G each) with cost 1 − similarity;
    a predicted call's reward is its plan-weighted mean similarity Σ_j T_ij S_ij / Σ_j T_ij.

*Turn reward:* a tool turn gets the mean reward of its calls (0 for a turn without calls); the
answer turn (the last turn, when it has no calls and an answer is given) gets the token-F1 of
the answer against the gold answer.
"""

from __future__ import annotations

import collections
import math
import re
import string
from typing import Any, Mapping, Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment
from scipy.special import logsumexp

from turnsight_jax.chat.types import Call, CallError, ToolCall

# ---------------------------------------------------------------------------------------------
# Answers
# ---------------------------------------------------------------------------------------------
_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def extract_answer(text: str | None) -> str:
    """The content of the last `<answer>…</answer>` in `text`; else the text without think blocks."""
    if not text:
        return ""
    found = _ANSWER_RE.findall(text)
    if found:
        return found[-1].strip()
    return _THINK_RE.sub("", text).strip()


def normalize_answer(text: str) -> str:
    """SQuAD-style normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: str | None, gold: str | None) -> float:
    """Token-level F1 between normalised prediction and gold (1.0 when both are empty)."""
    pred_tokens = normalize_answer(prediction or "").split()
    gold_tokens = normalize_answer(gold or "").split()
    if not pred_tokens and not gold_tokens:
        return 1.0
    if not pred_tokens or not gold_tokens:
        return 0.0
    common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


# ---------------------------------------------------------------------------------------------
# MatchTIR
# ---------------------------------------------------------------------------------------------
def _json_equal(a: Any, b: Any) -> bool:
    """Equality of JSON values with their JSON types respected (bool is not a number)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _gold_parts(gold: Mapping[str, Any] | ToolCall) -> tuple[str, Mapping[str, Any]]:
    if isinstance(gold, ToolCall):
        return gold.name, gold.arguments
    try:
        return gold["name"], gold.get("arguments") or {}
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"gold call must be {{'name', 'arguments'}}, got {gold!r:.80}") from None


def call_similarity(pred: Call | Mapping[str, Any], gold: Mapping[str, Any] | ToolCall) -> float:
    """MatchTIR similarity of a predicted call to a gold call (see the module docstring)."""
    if isinstance(pred, CallError):
        return 0.0
    if isinstance(pred, ToolCall):
        p_name, p_args = pred.name, pred.arguments
    else:
        p_name, p_args = _gold_parts(pred)
    g_name, g_args = _gold_parts(gold)
    if p_name != g_name:
        return 0.0
    p_args = p_args if isinstance(p_args, Mapping) else {}
    p_keys, g_keys = set(p_args), set(g_args)
    union = p_keys | g_keys
    jaccard = len(p_keys & g_keys) / len(union) if union else 1.0
    exact = sum(1 for k, v in g_args.items() if k in p_args and _json_equal(p_args[k], v))
    return (1.0 + jaccard + exact) / (2.0 + len(g_args))


def similarity_matrix(
    preds: Sequence[Call | Mapping[str, Any]], golds: Sequence[Mapping[str, Any]]
) -> np.ndarray:
    """[P, G] matrix of `call_similarity`."""
    out = np.zeros((len(preds), len(golds)), dtype=np.float64)
    for i, p in enumerate(preds):
        for j, g in enumerate(golds):
            out[i, j] = call_similarity(p, g)
    return out


def optimal_assignment(similarity: np.ndarray) -> list[tuple[int, int]]:
    """Maximum-weight bipartite matching of rows (predicted) to columns (gold): (row, col) pairs.

    Optimal (Hungarian algorithm), not greedy; with P != G, min(P, G) pairs are returned.
    """
    similarity = np.asarray(similarity, dtype=np.float64)
    if similarity.size == 0:
        return []
    rows, cols = linear_sum_assignment(similarity, maximize=True)
    return list(zip(rows.tolist(), cols.tolist()))


def sinkhorn_plan(
    similarity: np.ndarray, *, reg: float = 0.1, max_iter: int = 2000, tol: float = 1e-9
) -> np.ndarray:
    """Entropic OT plan between uniform marginals (1/P rows, 1/G columns), cost 1 − similarity.

    Log-domain Sinkhorn, so small `reg` does not underflow. Rows of the plan sum to 1/P and
    columns to 1/G (to `tol`).
    """
    similarity = np.asarray(similarity, dtype=np.float64)
    n_rows, n_cols = similarity.shape
    if n_rows == 0 or n_cols == 0:
        return np.zeros_like(similarity)
    if reg <= 0:
        raise ValueError(f"sinkhorn_plan: reg must be > 0, got {reg}")
    log_a = np.full(n_rows, -math.log(n_rows))
    log_b = np.full(n_cols, -math.log(n_cols))
    log_k = -(1.0 - similarity) / reg
    f = np.zeros(n_rows)
    g = np.zeros(n_cols)
    for _ in range(max_iter):
        f = log_a - logsumexp(log_k + g[None, :], axis=1)
        g = log_b - logsumexp(log_k + f[:, None], axis=0)
        # After the g update the columns are exact; iterate until the rows are too.
        row_sums = np.exp(logsumexp(log_k + f[:, None] + g[None, :], axis=1))
        if np.max(np.abs(row_sums - np.exp(log_a))) < tol:
            break
    return np.exp(log_k + f[:, None] + g[None, :])


def matched_call_rewards(
    preds: Sequence[Call], golds: Sequence[Mapping[str, Any]], *, method: str = "assignment"
) -> np.ndarray:
    """Per predicted call: its similarity to its matched gold call (see the module docstring)."""
    preds = list(preds)
    out = np.zeros(len(preds), dtype=np.float64)
    if not preds or not golds:
        return out
    sim = similarity_matrix(preds, golds)
    if method == "assignment":
        for i, j in optimal_assignment(sim):
            out[i] = sim[i, j]
    elif method == "transport":
        plan = sinkhorn_plan(sim, reg=0.1)
        mass = plan.sum(axis=1)
        out = np.where(mass > 0, (plan * sim).sum(axis=1) / np.maximum(mass, 1e-300), 0.0)
    else:
        raise ValueError(f"method must be 'assignment' or 'transport', got {method!r}")
    return out


def _flatten_gold(gold_calls) -> list[Mapping[str, Any]]:
    if gold_calls is None:
        return []
    flat: list[Mapping[str, Any]] = []
    for item in gold_calls:
        if isinstance(item, (Mapping, ToolCall)):
            flat.append(item)  # already a flat list of calls
        else:
            flat.extend(item)  # one list per gold turn
    return flat


def matchtir_turn_rewards(
    pred_turns: Sequence[Sequence[Call]],
    gold_calls,
    answer_pred: str | None,
    answer_gold: str | None,
    *,
    method: str = "assignment",
) -> np.ndarray:
    """MatchTIR turn rewards, one per policy turn: shape [K] with K = len(pred_turns).

    pred_turns: the parsed calls of every policy turn, in order (the answer turn has none).
    gold_calls: the gold call chain, one list of {"name", "arguments"} per turn (or flat).
    answer_pred / answer_gold: the policy's final answer and the gold answer.
    method: "assignment" (optimal bipartite matching) or "transport" (Sinkhorn, reg 0.1).

    All predicted calls of the trajectory are matched against all gold calls; a tool turn's
    reward is the mean of its calls' matched similarities; the last turn, when it has no calls
    and `answer_pred` is not None, is the answer turn and gets token-F1(answer_pred, answer_gold).
    """
    if method not in ("assignment", "transport"):
        raise ValueError(f"method must be 'assignment' or 'transport', got {method!r}")
    k = len(pred_turns)
    rewards = np.zeros(k, dtype=np.float64)
    if k == 0:
        return rewards
    flat_preds: list[Call] = []
    owner: list[int] = []
    for t, calls in enumerate(pred_turns):
        for c in calls:
            flat_preds.append(c)
            owner.append(t)
    per_call = matched_call_rewards(flat_preds, _flatten_gold(gold_calls), method=method)
    sums = np.zeros(k)
    counts = np.zeros(k)
    np.add.at(sums, owner, per_call)
    np.add.at(counts, owner, 1.0)
    rewards = np.where(counts > 0, sums / np.maximum(counts, 1.0), 0.0)
    if len(pred_turns[-1]) == 0 and answer_pred is not None:
        rewards[-1] = token_f1(extract_answer(answer_pred), answer_gold or "")
    return rewards
