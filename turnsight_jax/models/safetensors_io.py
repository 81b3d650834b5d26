"""Minimal safetensors reading by slice and streaming writing, bfloat16 included.

Reading memory-maps each file and returns numpy views, so a loader can pull just the slice one
device shard needs. Writing streams one tensor at a time, so a host never holds the whole model.
Format: 8-byte little-endian header size, a JSON header {name: {dtype, shape, data_offsets}},
then the raw little-endian bytes.
"""

from __future__ import annotations

import json
import pathlib
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one .safetensors file: `shape(name)`, `dtype(name)`, `get(name)` (a
    memory-mapped numpy array; slicing it reads only the touched pages)."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path}: not a readable safetensors file: {e}") from e
        self._data_start = 8 + n
        header.pop("__metadata__", None)
        self._header = header
        self._mmap = None

    def keys(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._header[name]["shape"])

    def dtype(self, name: str) -> np.dtype:
        code = self._header[name]["dtype"]
        if code not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        return _DTYPES[code]

    def get(self, name: str) -> np.ndarray:
        if name not in self._header:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = self._header[name]["data_offsets"]
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(self.dtype(name)).reshape(self.shape(name))


def write_safetensors(path: str | pathlib.Path, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, callable]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write tensors given as (name, shape, dtype, produce) where produce() returns the array.

    The header is written first from shapes alone, then each tensor is produced and written in
    turn, so only one tensor is in host memory at a time. The file appears atomically (written
    to a temporary name, then renamed).
    """
    path = pathlib.Path(path)
    entries = list(tensors)
    header: dict[str, dict] = {}
    offset = 0
    for name, shape, dtype, _ in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype, produce in entries:
            arr = np.ascontiguousarray(produce(), dtype=dtype)
            if arr.shape != tuple(shape):
                raise ValueError(f"{path}: tensor {name!r} produced shape {arr.shape}, header says {tuple(shape)}")
            f.write(arr.tobytes())
    tmp.replace(path)
