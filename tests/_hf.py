"""Random Hugging Face Qwen3 checkpoints for parity tests (torch, float32, CPU)."""

from __future__ import annotations

import pathlib

import numpy as np


def make_hf_checkpoint(path: pathlib.Path, seed: int = 0, **overrides):
    """Save a random Qwen3ForCausalLM to `path`; return the torch model (eval mode)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
              tie_word_embeddings=True, max_position_embeddings=4096)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
    # Random norm weights too, so a swapped or missing norm cannot hide behind all-ones.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


def hf_logits(model, tokens: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=None if mask is None else torch.tensor(mask, dtype=torch.long),
        )
    return out.logits.float().numpy()
