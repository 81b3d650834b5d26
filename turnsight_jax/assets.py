"""Files shipped inside the package so the embedded default runs from a fresh clone.

The Qwen3 tokenizer (151,669 tokens, the official chat template) is stored xz-compressed
(1.7 MB instead of 8 MB) and unpacked once into a cache folder on first use.
"""

from __future__ import annotations

import functools
import hashlib
import lzma
import os
import pathlib
import shutil

_ASSETS = pathlib.Path(__file__).resolve().parent / "assets"


def cache_dir() -> pathlib.Path:
    root = os.environ.get("TURNSIGHT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "turnsight_jax"
    )
    return pathlib.Path(root)


def default_tokenizer_dir() -> pathlib.Path:
    """Folder holding the bundled Qwen3 tokenizer.json + tokenizer_config.json."""
    src = _ASSETS / "qwen3-tokenizer"
    packed = src / "tokenizer.json.xz"
    digest = hashlib.sha1(packed.read_bytes()).hexdigest()[:12]
    out = cache_dir() / f"qwen3-tokenizer-{digest}"
    if not (out / "tokenizer.json").is_file():
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "tokenizer.json").write_bytes(lzma.decompress(packed.read_bytes()))
        shutil.copyfile(src / "tokenizer_config.json", tmp / "tokenizer_config.json")
        try:
            tmp.rename(out)  # atomic: concurrent first uses never see a half-written folder
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@functools.lru_cache(maxsize=1)
def default_tokenizer():
    """The bundled Qwen3 tokenizer, loaded once per process."""
    from turnsight_jax.chat.tokenizer import load_tokenizer

    return load_tokenizer(default_tokenizer_dir())
