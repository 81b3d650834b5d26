"""Rewards: outcome rewards (Solve-F1, answer token-F1, BFCL pass), MatchTIR turn rewards and the
ToolRL reward.

MatchTIR turn rewards (docs/spec.md §1.11)
------------------------------------------
*What is matched to what:* every predicted tool call of the whole trajectory (all tool turns,
flattened in turn order) is matched against every gold call of the task (`Task.gold_calls`, all
turns flattened). Matching is therefore trajectory-level and order-free: a correct call made one
turn later than the gold chain has it still gets credit.

Two sets of conventions (`semantics`), both one switch (`rl.matchtir_semantics`) apart:

* **"clean"** (the default; this project's reading of the paper):
  - *similarity* of a predicted call p and a gold call g: 0 if the names differ (exact
    comparison) or p is malformed, else
    (1 + Jaccard(param names of p, param names of g) + #gold params whose value p gives exactly)
    / (2 + #gold params), so an exact call scores 1. Jaccard of two empty name sets is 1.
    "Exactly" is JSON equality with types respected (True != 1; 1 == 1.0 as JSON numbers).
    A malformed call (`CallError`) is a call of its turn that scores 0.
  - *transport* reward of a call: its plan-weighted mean similarity Σ_j T_ij S_ij / Σ_j T_ij,
    with T a log-domain Sinkhorn plan (reg 0.1, cost 1 − S, uniform marginals) run until its
    row marginals are exact to 1e-9 (`sinkhorn_plan`).
  - *answer* reward: `token_f1` (SQuAD normalisation: lower case, punctuation deleted, articles
    removed; multiset overlap; 1 when both are empty) of `extract_answer(answer)`, so an
    untagged answer counts as its whole text.
* **"released"** (the released MatchTIR code, quchangle1/MatchTIR
  `Code/verl/utils/reward_score/tool.py`: `tool_similarity`, `hungarian_assignment`,
  `assign_rewards_ot`, `compute_process_KM` / `compute_process_ot`):
  - *similarity*: names compared case-insensitively; parameter names by `multiset_jaccard`
    (their `match_score`); values with Python `==` (so True == 1 == 1.0, [1] == [True]).
    Malformed calls are dropped (their parser skips a block it cannot decode): they are not
    calls of their turn at all.
  - *transport* reward: Σ_j T_ij S_ij, NOT divided by the row mass (≈ 1/P), with T from
    `pot_sinkhorn_plan` (POT's default `ot.sinkhorn`, cost −S, reg 0.1, uniform marginals).
  - *answer* reward: `released_answer_f1`: the first `<answer>…</answer>` of the turn's raw
    text (0 without one), lower-cased with punctuation turned into spaces (articles kept), and
    the F1 of the two token *sets* (0 when either is empty).

*Matching* (`method`, `rl.matchtir_matching`), for either semantics:
  - "greedy": the released code's "Hungarian" (`greedy_assignment`): all (score, pred, gold)
    pairs with score > 0, stably sorted by descending score (ties: lower predicted index first,
    then lower gold index), each taken while its predicted and gold call are both free.
  - "assignment": the optimal maximum-weight bipartite matching (`optimal_assignment`,
    Kuhn–Munkres via `scipy.optimize.linear_sum_assignment`).
  - "transport": the entropic optimal-transport plan above.
  A predicted call left unmatched gets 0.

*Turn reward:* a tool turn gets the mean reward of its calls (0 for a turn without calls); the
answer turn (the last turn, when it has no calls and an answer is given) gets the answer reward.

ToolRL reward (docs/spec.md §1.12)
------------------------------------
R = R_format + R_correct (`toolrl_reward`). R_correct ∈ [−3, 3] is the released MatchTIR code's
`compute_toolrl` (`toolrl_correctness`); R_format ∈ {0, 1} (`toolrl_format`) is ToolRL's format
term in this project's chat format, dropped with `with_format=False` (the released code has none).
"""

from __future__ import annotations

import collections
import math
import string
from typing import Any, Mapping, Sequence

import numpy as np

from turnsight_jax.chat.types import Call, CallError, ToolCall
from turnsight_jax.envs.answers import ANSWER_RE, THINK_RE, extract_answer, normalize_answer, token_f1  # noqa: F401  (re-exported)
from turnsight_jax.rl.config import MATCHTIR_MATCHINGS, MATCHTIR_SEMANTICS  # the switches' values

# ---------------------------------------------------------------------------------------------
# Answers (extraction and token F1: turnsight_jax.envs.answers, which the environments share)
# ---------------------------------------------------------------------------------------------
_STOP_SUFFIXES = ("<|endoftext|>", "<|im_end|>")


def released_answer_text(text: str) -> str:
    """The released code's answer preprocessing: lower case, every ASCII punctuation character
    replaced by a space, whitespace runs collapsed, stripped (articles are kept)."""
    text = text.lower()
    for ch in string.punctuation:
        text = text.replace(ch, " ")
    return " ".join(text.split())


def released_answer_f1(turn_text: str | None, gold: str | None) -> float:
    """The released MatchTIR answer reward of one turn's raw text.

    The first `<answer>…</answer>` (closed; searched in the whole text, think block included, as
    the released regex does) after stripping a trailing stop token; 0 when there is none. Both
    sides go through `released_answer_text`; the F1 is over token *sets* (duplicates count once)
    and is 0 when either set is empty.
    """
    text = (turn_text or "").strip()
    for suffix in _STOP_SUFFIXES:
        text = text.removesuffix(suffix).strip()
    found = ANSWER_RE.search(text)
    if found is None:
        return 0.0
    pred = set(released_answer_text(found.group(1).strip()).split())
    ref = set(released_answer_text(gold or "").split())
    common = len(pred & ref)
    precision = common / len(pred) if pred else 0.0
    recall = common / len(ref) if ref else 0.0
    if precision + recall <= 0:
        return 0.0
    return 2 * precision * recall / (precision + recall)


# ---------------------------------------------------------------------------------------------
# Call similarity
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


def multiset_jaccard(a: Sequence[Any], b: Sequence[Any]) -> float:
    """The released code's `match_score`: 1 when the two lists are equal (same order, both
    empty included); else 0 when either is empty; else |a ∩ b| / (|a| + |b| − |a ∩ b|) with
    multiset intersection (an element counts min(count in a, count in b) times)."""
    a, b = list(a), list(b)
    if a == b:
        return 1.0
    if not a or not b:
        return 0.0
    ca, cb = collections.Counter(a), collections.Counter(b)
    common = sum(min(ca[k], cb[k]) for k in ca.keys() & cb.keys())
    return common / (len(a) + len(b) - common)


def _gold_parts(gold: Mapping[str, Any] | ToolCall) -> tuple[str, Mapping[str, Any]]:
    if isinstance(gold, ToolCall):
        return gold.name, gold.arguments
    try:
        return gold["name"], gold.get("arguments") or {}
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"gold call must be {{'name', 'arguments'}}, got {gold!r:.80}") from None


def _check_semantics(semantics: str) -> None:
    if semantics not in MATCHTIR_SEMANTICS:
        raise ValueError(f"semantics must be one of {MATCHTIR_SEMANTICS}, got {semantics!r}")


def call_similarity(pred: Call | Mapping[str, Any], gold: Mapping[str, Any] | ToolCall, *,
                    semantics: str = "clean") -> float:
    """MatchTIR similarity of a predicted call to a gold call (see the module docstring)."""
    _check_semantics(semantics)
    if isinstance(pred, CallError):
        return 0.0
    if isinstance(pred, ToolCall):
        p_name, p_args = pred.name, pred.arguments
    else:
        p_name, p_args = _gold_parts(pred)
    g_name, g_args = _gold_parts(gold)
    p_args = p_args if isinstance(p_args, Mapping) else {}
    if semantics == "released":
        if str(p_name).lower() != str(g_name).lower():
            return 0.0
        names = multiset_jaccard(list(g_args), list(p_args))
        exact = sum(1 for k, v in g_args.items() if k in p_args and p_args[k] == v)
        return (1.0 + names + exact) / (2.0 + len(g_args))
    if p_name != g_name:
        return 0.0
    p_keys, g_keys = set(p_args), set(g_args)
    union = p_keys | g_keys
    jaccard = len(p_keys & g_keys) / len(union) if union else 1.0
    exact = sum(1 for k, v in g_args.items() if k in p_args and _json_equal(p_args[k], v))
    return (1.0 + jaccard + exact) / (2.0 + len(g_args))


def similarity_matrix(
    preds: Sequence[Call | Mapping[str, Any]], golds: Sequence[Mapping[str, Any]], *,
    semantics: str = "clean",
) -> np.ndarray:
    """[P, G] matrix of `call_similarity`."""
    out = np.zeros((len(preds), len(golds)), dtype=np.float64)
    for i, p in enumerate(preds):
        for j, g in enumerate(golds):
            out[i, j] = call_similarity(p, g, semantics=semantics)
    return out


# ---------------------------------------------------------------------------------------------
# Matchings
# ---------------------------------------------------------------------------------------------
def optimal_assignment(similarity: np.ndarray) -> list[tuple[int, int]]:
    """Maximum-weight bipartite matching of rows (predicted) to columns (gold): (row, col) pairs.

    Optimal (Hungarian algorithm), not greedy; with P != G, min(P, G) pairs are returned.
    """
    from scipy.optimize import linear_sum_assignment  # scipy.optimize costs ~0.7 s to import: only here

    similarity = np.asarray(similarity, dtype=np.float64)
    if similarity.size == 0:
        return []
    rows, cols = linear_sum_assignment(similarity, maximize=True)
    return list(zip(rows.tolist(), cols.tolist()))


def greedy_assignment(similarity: np.ndarray) -> list[tuple[int, int]]:
    """The released code's matching: (row, col) pairs taken greedily by descending score.

    similarity [P, G]. Only pairs with score > 0 are candidates; they are stably sorted by
    descending score (ties keep row-major order: lower row, then lower column), and a pair is
    taken when its row and its column are both still free. Not optimal: [[0.9, 0.8], [0.85, 0.1]]
    takes (0, 0) and (1, 1), total 1.0, where the optimum is 1.65.
    """
    similarity = np.asarray(similarity, dtype=np.float64)
    n_rows, n_cols = similarity.shape
    candidates = [(similarity[i, j], i, j) for i in range(n_rows) for j in range(n_cols)
                  if similarity[i, j] > 0]
    candidates.sort(key=lambda c: -c[0])  # list.sort is stable: ties stay row-major
    rows_used, cols_used, pairs = set(), set(), []
    for _, i, j in candidates:
        if i not in rows_used and j not in cols_used:
            rows_used.add(i)
            cols_used.add(j)
            pairs.append((i, j))
    return pairs


def sinkhorn_plan(
    similarity: np.ndarray, *, reg: float = 0.1, max_iter: int = 2000, tol: float = 1e-9
) -> np.ndarray:
    """Entropic OT plan between uniform marginals (1/P rows, 1/G columns), cost 1 − similarity.

    Log-domain Sinkhorn, so small `reg` does not underflow. Rows of the plan sum to 1/P and
    columns to 1/G (to `tol`). The "clean" transport plan.
    """
    from scipy.special import logsumexp

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


def pot_sinkhorn_plan(
    a: np.ndarray, b: np.ndarray, cost: np.ndarray, reg: float, *,
    max_iter: int = 1000, stop_thr: float = 1e-9,
) -> np.ndarray:
    """[P, G] Sinkhorn–Knopp plan run the way POT's default `ot.sinkhorn` runs (the "released"
    transport plan; POT itself is not a dependency).

    a [P], b [G]: the marginals; cost [P, G]; K = exp(−cost / reg). Scalings start at u = 1/P,
    v = 1/G; each iteration sets v = b / (Kᵀ u), then u = 1 / ((K / a) v). If Kᵀ u has a 0 or
    u, v stop being finite, the previous u, v are kept and the loop ends. On iterations 0, 10,
    20, ... the column marginal of diag(u) K diag(v) is compared with b (Euclidean norm) and the
    loop ends once that error is below `stop_thr`; otherwise after `max_iter` iterations. After
    the u update the rows are exact and the columns carry the error.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    kernel = np.exp(np.asarray(cost, dtype=np.float64) / -reg)
    kernel_over_a = kernel / a[:, None]
    u = np.full(len(a), 1.0 / len(a))
    v = np.full(len(b), 1.0 / len(b))
    for it in range(max_iter):
        u_prev, v_prev = u, v
        kt_u = kernel.T @ u
        v = b / kt_u
        u = 1.0 / (kernel_over_a @ v)
        if np.any(kt_u == 0) or not (np.all(np.isfinite(u)) and np.all(np.isfinite(v))):
            u, v = u_prev, v_prev  # machine precision reached: keep the last finite scalings
            break
        if it % 10 == 0:
            column_error = np.sqrt(np.sum(np.square(np.einsum("i,ij,j->j", u, kernel, v) - b)))
            if column_error < stop_thr:
                break
    return u[:, None] * kernel * v[None, :]


def matched_call_rewards(
    preds: Sequence[Call], golds: Sequence[Mapping[str, Any]], *, method: str = "assignment",
    semantics: str = "clean",
) -> np.ndarray:
    """[P] per predicted call: its reward under `method` / `semantics` (see the module docstring)."""
    if method not in MATCHTIR_MATCHINGS:
        raise ValueError(f"method must be one of {MATCHTIR_MATCHINGS}, got {method!r}")
    _check_semantics(semantics)
    preds = list(preds)
    out = np.zeros(len(preds), dtype=np.float64)
    if not preds or not golds:
        return out
    sim = similarity_matrix(preds, golds, semantics=semantics)
    if method in ("assignment", "greedy"):
        pairs = optimal_assignment(sim) if method == "assignment" else greedy_assignment(sim)
        for i, j in pairs:
            out[i] = sim[i, j]
    elif semantics == "released":
        n_pred, n_gold = sim.shape
        plan = pot_sinkhorn_plan(np.full(n_pred, 1.0 / n_pred), np.full(n_gold, 1.0 / n_gold), -sim, 0.1)
        out = (plan * sim).sum(axis=1)  # unnormalised: each row carries mass 1/P
    else:
        plan = sinkhorn_plan(sim, reg=0.1)
        mass = plan.sum(axis=1)
        out = np.where(mass > 0, (plan * sim).sum(axis=1) / np.maximum(mass, 1e-300), 0.0)
    return out


def flatten_gold(gold_calls) -> list[Mapping[str, Any]]:
    """`Task.gold_calls` (one tuple of calls per gold turn, or an already flat list) as one flat
    list of calls in turn order; [] for None."""
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
    semantics: str = "clean",
) -> np.ndarray:
    """MatchTIR turn rewards, one per policy turn: shape [K] with K = len(pred_turns).

    pred_turns: the parsed calls of every policy turn, in order (the answer turn has none).
    gold_calls: the gold call chain, one list of {"name", "arguments"} per turn (or flat).
    answer_pred: the answer turn's answer: under "clean" the parsed answer (`extract_answer` is
      applied); under "released" the turn's raw text (it must hold `<answer>…</answer>`).
    answer_gold: the gold answer.
    method: "greedy" | "assignment" | "transport"; semantics: "clean" | "released".

    All predicted calls of the trajectory are matched against all gold calls; a tool turn's
    reward is the mean of its calls' rewards; the last turn, when it has no calls and
    `answer_pred` is not None, is the answer turn and gets the answer reward.
    """
    if method not in MATCHTIR_MATCHINGS:
        raise ValueError(f"method must be one of {MATCHTIR_MATCHINGS}, got {method!r}")
    _check_semantics(semantics)
    k = len(pred_turns)
    if k == 0:
        return np.zeros(0, dtype=np.float64)
    flat_preds: list[Call] = []
    owner: list[int] = []
    for t, calls in enumerate(pred_turns):
        for c in calls:
            if semantics == "released" and isinstance(c, CallError):
                continue  # the released parser drops a block it cannot decode
            flat_preds.append(c)
            owner.append(t)
    per_call = matched_call_rewards(flat_preds, flatten_gold(gold_calls), method=method, semantics=semantics)
    sums = np.zeros(k)
    counts = np.zeros(k)
    np.add.at(sums, owner, per_call)
    np.add.at(counts, owner, 1.0)
    rewards = np.where(counts > 0, sums / np.maximum(counts, 1.0), 0.0)
    if len(pred_turns[-1]) == 0 and answer_pred is not None:
        if semantics == "released":
            rewards[-1] = released_answer_f1(answer_pred, answer_gold)
        else:
            rewards[-1] = token_f1(extract_answer(answer_pred), answer_gold or "")
    return rewards


# ---------------------------------------------------------------------------------------------
# ToolRL
# ---------------------------------------------------------------------------------------------
def toolrl_correctness(pred_calls: Sequence[Call], gold_calls) -> float:
    """ToolRL's R_correct ∈ [−3, 3], as the released MatchTIR code's `compute_toolrl` computes it.

    pred_calls: every call of the trajectory in order (malformed ones are dropped, as the
    released parser drops them); gold_calls: `Task.gold_calls` (flattened here).
    No well-formed call: 0 (the released code returns its initial 0 without the [−3, 3] map).
    Otherwise score = multiset_jaccard(gold names, predicted names) and, for each gold call in
    order, the best still-unused predicted call of exactly the same name (case-sensitive) by
    multiset_jaccard(gold param names, its param names) + #gold params it gives with Python `==`;
    only a best total > 0 is taken (and the call used). max = 1 + Σ_gold (1 + #params);
    R_correct = 6 · score / max − 3, so exact calls give 3.
    """
    golds = [_gold_parts(g) for g in flatten_gold(gold_calls)]
    preds = [c for c in pred_calls if isinstance(c, ToolCall)]
    if not preds:
        return 0.0
    score = multiset_jaccard([name for name, _ in golds], [p.name for p in preds])
    max_score = 1.0
    used: set[int] = set()
    for g_name, g_args in golds:
        max_score += 1.0 + len(g_args)
        best, best_index = 0.0, -1
        for i, p in enumerate(preds):
            if i in used or p.name != g_name:
                continue
            total = multiset_jaccard(list(g_args), list(p.arguments)) + sum(
                1.0 for k, v in g_args.items() if k in p.arguments and p.arguments[k] == v)
            if total > best:  # strictly: the first of equal candidates wins
                best, best_index = total, i
        if best_index >= 0:
            used.add(best_index)
            score += best
    return score * 6.0 / max_score - 3.0


def toolrl_format(pred_turns: Sequence[Sequence[Call]], last_text: str | None) -> float:
    """ToolRL's R_format ∈ {0, 1} in this project's chat format (our reading; the released code
    has no format term): 1 when the trajectory has a turn, every call of every turn parsed, every
    turn but the last made calls, and a last turn without calls states its answer inside
    `<answer>…</answer>` (outside the think block); else 0."""
    if not pred_turns:
        return 0.0
    if any(isinstance(c, CallError) for calls in pred_turns for c in calls):
        return 0.0
    if any(not calls for calls in pred_turns[:-1]):
        return 0.0
    if pred_turns[-1]:
        return 1.0
    return 1.0 if ANSWER_RE.search(THINK_RE.sub("", last_text or "")) else 0.0


def toolrl_reward(pred_turns: Sequence[Sequence[Call]], last_text: str | None, gold_calls, *,
                  with_format: bool = True) -> float:
    """ToolRL's trajectory reward R = R_format + R_correct ∈ [−3, 4] (R_correct alone, the
    released `compute_toolrl`, when `with_format` is False).

    pred_turns: the parsed calls of every policy turn; last_text: the last turn's raw text;
    gold_calls: `Task.gold_calls`.
    """
    correct = toolrl_correctness([c for calls in pred_turns for c in calls], gold_calls)
    return correct + (toolrl_format(pred_turns, last_text) if with_format else 0.0)
