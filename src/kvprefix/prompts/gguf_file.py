"""A GGUF file opened once per process: its metadata and tensor descriptions, through the `gguf` package's reader.

Torch-free, so the tokenizer (and a router that only tokenizes) can read a .gguf checkpoint without loading a model.
Every problem with the file is a ValueError whose one-line message names the file.
"""

from __future__ import annotations

import functools
import os
from typing import Any

_MISSING = object()


def is_gguf(path: str) -> bool:
    """A single-file GGUF checkpoint (rather than a checkpoint directory)."""
    return path.endswith(".gguf") and not os.path.isdir(path)


class GGUFFile:
    """The metadata (``get``/``require``) and tensors (by name) of one file; tensor data stays memory-mapped."""

    def __init__(self, path: str) -> None:
        from gguf import GGUFReader  # imported here: only GGUF checkpoints need it

        self.path = path
        try:
            reader = GGUFReader(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"GGUF file {path!r} does not exist") from None
        except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError) as e:
            # The reader maps every tensor at open: a short file fails here, as does a file that is not GGUF.
            raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from None
        self.fields = reader.fields
        self.tensors = {t.name: t for t in reader.tensors}

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise ValueError(f"{self.path}: GGUF metadata lacks {key!r}")
        return value


def open_gguf(path: str) -> GGUFFile:
    """The file at ``path``, parsed once per process and content version (parsing a 49k-token vocabulary takes
    seconds, and the config, the tokenizer and the weights all read it)."""
    path = os.path.realpath(os.path.expanduser(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file {path!r} does not exist") from None
    return _open(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)
