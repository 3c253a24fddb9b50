"""A GGUF file opened once per process: its metadata and tensor descriptions, read from the file format's layout
(ggml's docs/gguf.md) with ``struct`` over a memory map; tensor data stays memory-mapped.

Not the `gguf` package's GGUFReader, whose per-string numpy views make opening a large vocabulary slow
(docs/model.md). Tensors are described as GGUFReader does: ``tensor_type``, ``shape`` (innermost first) and ``data``
(plain arrays, or the raw bytes of quantized blocks). Torch-free. Every problem with the file is a ValueError whose
one-line message names the file.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_MISSING = object()
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct formats (little-endian) of the scalar ones; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Tensor types stored as plain numbers (the rest are blocks of bytes): gguf.GGMLQuantizationType values.
_PLAIN = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


def is_gguf(path: str) -> bool:
    """A single-file GGUF checkpoint (rather than a checkpoint directory)."""
    return path.endswith(".gguf") and not os.path.isdir(path)


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray


class _Cursor:
    """Reads the header's values in order; running past the end is a struct.error."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.offset + length
        if end > len(self.buffer):
            raise struct.error("string runs past the end of the file")
        text = self.buffer[self.offset:end].decode("utf-8")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _SCALARS and item != 7:  # numbers in one read
                dtype = np.dtype(_SCALARS[item])
                values = np.frombuffer(self.buffer, dtype, count, self.offset)
                self.offset += dtype.itemsize * count
                return values.tolist()
            return [self.value(item) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.scalar(_SCALARS[kind])


class GGUFFile:
    """The metadata (``get``/``require``) and tensors (by name) of one file; tensor data stays memory-mapped."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise FileNotFoundError(f"GGUF file {path!r} does not exist") from None
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): it is empty") from None
        try:
            self.fields, self.tensors = _read(buffer)
        except (ValueError, KeyError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
            _close_quietly(buffer)  # a corrupt file's map is not left to the garbage collector
            raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from None

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise ValueError(f"{self.path}: GGUF metadata lacks {key!r}")
        return value


def _close_quietly(buffer: mmap.mmap) -> None:
    try:
        buffer.close()
    except BufferError:  # a view made before the error still points into it: the collector closes it later
        pass


def _read(buffer: mmap.mmap) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    cursor = _Cursor(buffer)
    if buffer[:4] != _MAGIC:
        raise ValueError("no GGUF magic at its start")
    cursor.offset = 4
    version = cursor.scalar("<I")
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version} (a big-endian file reads as a huge one); accepted: 2, 3")
    tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
    fields: dict[str, Any] = {}
    for _ in range(kv_count):
        key = cursor.string()
        if key in fields:
            raise ValueError(f"metadata key {key!r} appears twice")
        fields[key] = cursor.value(cursor.scalar("<I"))
    infos = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
        infos.append((name, dims, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
    alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    start = -(-cursor.offset // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, kind, offset in infos:
        if name in tensors:
            raise ValueError(f"tensor {name!r} appears twice")
        elements = math.prod(dims)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        size = elements * block_bytes // block
        if start + offset + size > len(buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        shape = tuple(reversed(dims))
        if kind.value in _PLAIN:
            data = np.frombuffer(buffer, _PLAIN[kind.value], elements, start + offset).reshape(shape)
        else:
            data = np.frombuffer(buffer, np.uint8, size, start + offset).reshape(quant_shape_to_byte_shape(shape, kind))
        tensors[name] = GGUFTensor(name, kind, dims, data)
    return fields, tensors


def open_gguf(path: str) -> GGUFFile:
    """The file at ``path``, parsed once per process and content version (the config, the tokenizer and the
    weights all read it)."""
    path = os.path.realpath(os.path.expanduser(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file {path!r} does not exist") from None
    return _open(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)
