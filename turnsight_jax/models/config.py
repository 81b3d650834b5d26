"""Qwen3 hyper-parameters: the Hugging Face presets, tiny test shapes, and config.json I/O."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Architecture of a dense Qwen3 decoder (the fields of a Hugging Face `Qwen3Config`)."""

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 40960
    # Token ids written into an exported config.json (not used by the forward pass).
    bos_token_id: int | None = 151643
    eos_token_id: int | None = 151645

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (self.num_heads * 2 + self.num_kv_heads * 2) + 2 * h
        layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * layer + d + head

    # ---- Hugging Face config.json ----
    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Qwen3Config":
        """Validate a Hugging Face config dict; unsupported architectures fail with the reason."""
        arch = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if model_type != "qwen3" or (arch and arch != ["Qwen3ForCausalLM"]):
            raise ValueError(
                f"{source}: unsupported architecture: expected model_type 'qwen3' / "
                f"Qwen3ForCausalLM (dense Qwen3), got model_type={model_type!r}, architectures={arch}"
            )
        for moe_key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if raw.get(moe_key):
                raise ValueError(f"{source}: unsupported architecture: MoE key {moe_key!r} is set (dense Qwen3 only)")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act expected 'silu', got {raw['hidden_act']!r}")
        if raw.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias=True is not supported (Qwen3 has no attention bias)")
        rope = raw.get("rope_parameters") or {}
        scaling = raw.get("rope_scaling")
        rope_type = rope.get("rope_type") or (scaling or {}).get("rope_type") or (scaling or {}).get("type")
        if rope_type not in (None, "default"):
            raise ValueError(f"{source}: rope type {rope_type!r} is not supported (default RoPE only)")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported")
        missing = [
            k
            for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
            if k not in raw
        ]
        if missing:
            raise ValueError(f"{source}: missing required keys {missing}")
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )

    @classmethod
    def from_pretrained(cls, path: str | pathlib.Path) -> "Qwen3Config":
        cfg_path = pathlib.Path(path) / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face Qwen3 model folder)")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: not valid JSON: {e}") from e
        return cls.from_hf_dict(raw, source=str(cfg_path))


# Exact hyper-parameters of the released Qwen3 dense checkpoints (their config.json files).
_COMMON = dict(vocab_size=151936, head_dim=128, num_kv_heads=8, rope_theta=1_000_000.0, rms_norm_eps=1e-6)
PRESETS: dict[str, Qwen3Config] = {
    "qwen3-0.6b": Qwen3Config(**_COMMON, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, tie_word_embeddings=True),
    "qwen3-1.7b": Qwen3Config(**_COMMON, hidden_size=2048, intermediate_size=6144, num_layers=28,
                              num_heads=16, tie_word_embeddings=True),
    "qwen3-4b": Qwen3Config(**_COMMON, hidden_size=2560, intermediate_size=9728, num_layers=36,
                            num_heads=32, tie_word_embeddings=True),
    "qwen3-8b": Qwen3Config(**_COMMON, hidden_size=4096, intermediate_size=12288, num_layers=36,
                            num_heads=32, tie_word_embeddings=False),
    "qwen3-14b": Qwen3Config(**_COMMON, hidden_size=5120, intermediate_size=17408, num_layers=40,
                             num_heads=40, tie_word_embeddings=False),
    "qwen3-32b": Qwen3Config(**_COMMON, hidden_size=5120, intermediate_size=25600, num_layers=64,
                             num_heads=64, tie_word_embeddings=False),
    # Test and CPU shapes. `tiny` keeps the real vocabulary so the real tokenizer works.
    "tiny": Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=192, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=32, tie_word_embeddings=True),
    "tiny-untied": Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=192, num_layers=2,
                               num_heads=4, num_kv_heads=1, head_dim=24, tie_word_embeddings=False),
    # The embedded default's model: the real vocabulary on a tiny trunk; the 151,936 x 64 embedding
    # is most of its 10M parameters and compute. head_dim 64 (> hidden/heads, as in Qwen3 itself):
    # q and k are RMS-normalised per head, so an attention logit is at most ~sqrt(head_dim); at 16
    # that is 4, too flat to single out one entity token among hundreds, and the copy the built-in
    # tasks need did not form.
    "tiny-default": Qwen3Config(vocab_size=151936, hidden_size=64, intermediate_size=256, num_layers=4,
                                num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=True),
    # ~100M parameters with the real vocabulary: the CPU benchmark shape.
    "bench-100m": Qwen3Config(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_layers=8,
                              num_heads=8, num_kv_heads=4, head_dim=64, tie_word_embeddings=True),
}


def get_preset(name: str) -> Qwen3Config:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown Qwen3 preset {name!r}; known: {sorted(PRESETS)}") from None


def teacher_architecture(checkpoint: str, preset: str, policy: Qwen3Config) -> Qwen3Config:
    """The architecture of an external teacher (teacher.weights='external'): `checkpoint`'s
    config.json, the policy's for 'warm_start' (the run's own warm-start folder), else `preset`
    (a dry run on a machine without the folder). ValueError unless its vocabulary is the policy's:
    the teacher scores the policy's token ids."""
    if checkpoint == "warm_start":
        qcfg = policy
    elif checkpoint and (pathlib.Path(checkpoint) / "config.json").is_file():
        qcfg = Qwen3Config.from_pretrained(checkpoint)
    elif preset:
        qcfg = get_preset(preset)
    else:
        raise ValueError(f"teacher.checkpoint={checkpoint!r} is not a Hugging Face folder with a config.json (and no "
                         f"teacher.preset names its architecture)")
    if qcfg.vocab_size != policy.vocab_size:
        raise ValueError(f"the external teacher's vocabulary has {qcfg.vocab_size} ids, the policy's "
                         f"{policy.vocab_size}: the teacher must share the policy's tokenizer")
    return qcfg
