"""The judge's settings (the run config's `judge.*` section) as a typed, checked value.

`config.base_config` declares the keys with their defaults; `judge_settings` turns the section
into a `JudgeSettings` and refuses bad values with a one-line ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import pathlib

from turnsight_jax.errors import ConfigError

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class JudgeSettings:
    """checkpoint: the judge, a Hugging Face Qwen3 folder (its own tokenizer, else the bundled
    Qwen3 one). rationale: the judge writes a rationale before its verdict (False: the verdict
    only, the ablation). reference: the judge is shown the task's reference answer (False: only
    what a verifier-free environment has: the question, the calls, the results, the final answer).
    max_new_tokens: the judge's decode cap. max_prompt_tokens: longer prompts have the middle of
    their transcript cut. batch_size: prompts judged at once. default_label: the label of a
    malformed judgment. verifier_threshold: an environment reward at or above it counts as the
    verifier's success (what agreement is measured against). dtype: the judge's weights."""

    checkpoint: str = ""
    rationale: bool = True
    reference: bool = False
    max_new_tokens: int = 256
    max_prompt_tokens: int = 4096
    batch_size: int = 32
    default_label: int = 0
    verifier_threshold: float = 1.0
    dtype: str = "float32"


# The smallest prompt budget that leaves the transcript room after the instruction (~200 tokens).
MIN_PROMPT_TOKENS = 384
# The shortest well-formed output, "<verdict>0</verdict>" plus the stop token, is 7 Qwen3 tokens.
MIN_NEW_TOKENS = 8


def _int(node, key: str, minimum: int) -> int:
    value = node[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"judge.{key} must be an int >= {minimum}, got {value!r}")
    return value


def _bool(node, key: str) -> bool:
    value = node[key]
    if not isinstance(value, bool):
        raise ConfigError(f"judge.{key} must be True or False, got {value!r}")
    return value


def judge_settings(node, *, need_checkpoint: bool = False) -> JudgeSettings:
    """The `judge` ConfigDict (or any mapping with its keys) -> JudgeSettings. need_checkpoint:
    the run judges (rl.method=judge): judge.checkpoint must name a Hugging Face folder here."""
    missing = [f.name for f in dataclasses.fields(JudgeSettings) if f.name not in node]
    if missing:
        raise ConfigError(f"judge.{missing[0]} is missing from the config (every key: turnsight_jax/config.py)")
    if node["default_label"] not in (0, 1) or isinstance(node["default_label"], bool):
        raise ConfigError(f"judge.default_label must be 0 or 1, got {node['default_label']!r}")
    threshold = node["verifier_threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ConfigError(f"judge.verifier_threshold must be a number, got {threshold!r}")
    if node["dtype"] not in DTYPES:
        raise ConfigError(f"judge.dtype must be one of {DTYPES}, got {node['dtype']!r}")
    checkpoint = str(node["checkpoint"] or "")
    if need_checkpoint:
        if not checkpoint:
            raise ConfigError("rl.method=judge needs judge.checkpoint: a Hugging Face Qwen3 folder (e.g. one "
                              "`python -m turnsight_jax.judge distill` wrote)")
        if not (pathlib.Path(checkpoint) / "config.json").is_file():
            raise ConfigError(f"judge.checkpoint={checkpoint!r} is not a Hugging Face Qwen3 folder on this machine "
                              f"(no config.json)")
    return JudgeSettings(checkpoint=checkpoint, rationale=_bool(node, "rationale"), reference=_bool(node, "reference"),
                         max_new_tokens=_int(node, "max_new_tokens", MIN_NEW_TOKENS),
                         max_prompt_tokens=_int(node, "max_prompt_tokens", MIN_PROMPT_TOKENS),
                         batch_size=_int(node, "batch_size", 1), default_label=int(node["default_label"]),
                         verifier_threshold=float(threshold), dtype=node["dtype"])
