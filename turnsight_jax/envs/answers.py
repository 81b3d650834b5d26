"""Answers in model text: the content of the `<answer>` tags and the SQuAD-style token F1 against a
gold answer. The environments score with them (ToolHop's answer match), and so do the rewards
(turnsight_jax.rewards: MatchTIR's answer turn, ToolRL's format)."""

from __future__ import annotations

import collections
import re
import string

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL)
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def extract_answer(text: str | None) -> str:
    """The content of the last `<answer>…</answer>` in `text`; else the text without think blocks."""
    if not text:
        return ""
    found = ANSWER_RE.findall(text)
    if found:
        return found[-1].strip()
    return THINK_RE.sub("", text).strip()


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
