"""The identity of a block's KV: the execution context that roots every hash chain, and the cache namespace.

One implementation for every process that names blocks: the engine, the server, the planner and the router all
build their ``ExecutionContext`` with ``context_for_checkpoint`` and their namespace salt with ``namespace_salt``,
so the same prompt under the same checkpoint and tenant gets the same hashes everywhere, however the checkpoint's
path is spelled. Pure Python (no torch): a router computes roots without loading a model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass

import xxhash

_NAMESPACE_DOMAIN = b"kvprefix/namespace/v1"
# Files whose bytes decide a checkpoint's weights and architecture. Mistral's consolidated*.safetensors repeat
# the weights in another layout, and the loader never reads them.
_WEIGHT_SUFFIXES = (".safetensors", ".gguf")
_CONFIG_FILES = ("config.json",)
# Files that define a Hugging Face tokenizer (whichever of them a checkpoint ships).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_HUB_SNAPSHOT = re.compile(r"[/\\]snapshots[/\\]([0-9a-f]{40})[/\\]?$")
_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class ExecutionContext:
    """Everything outside the tokens that changes the KV a block holds.

    Any change here changes the root hash and so makes every block miss. ``salt`` is the namespace (tenant and
    client salt, from ``namespace_salt``); the other fields are fingerprints of what was loaded, not names.
    """

    model: str = ""  # fingerprint of the checkpoint's config and weights
    revision: str = ""  # the hub commit, when the checkpoint came from a hub snapshot
    tokenizer: str = ""  # fingerprint of the tokenizer files
    chat_template: str = ""  # hash of the chat template text
    kv_dtype: str = ""  # e.g. "bfloat16": the bytes of the KV
    salt: str = ""

    def fields(self) -> tuple[tuple[str, str], ...]:
        return (
            ("model", self.model),
            ("revision", self.revision),
            ("tokenizer", self.tokenizer),
            ("chat_template", self.chat_template),
            ("kv_dtype", self.kv_dtype),
            ("salt", self.salt),
        )

    def public_fields(self) -> dict[str, str]:
        """The fields a replica may publish (for routers to check they hash alike): all but the salt."""
        return {name: value for name, value in self.fields() if name != "salt"}


def namespace_salt(tenant: str | None, cache_salt: str | None) -> str:
    """The one derivation of a cache namespace from (tenant, client cache salt). "" is the shared namespace.

    JSON keeps pairs unambiguous (no choice of names makes two pairs encode alike); a request with only a
    ``cache_salt`` lands in the same namespace whether it went through ``LLM``, the server or the planner.
    """
    if tenant is None and cache_salt is None:
        return ""
    return json.dumps([tenant or "", cache_salt or ""], separators=(",", ":"))


def namespace_id(root: bytes) -> str:
    """A public name for the namespace rooted at ``root``: safe to publish in events and logs, since it is a hash
    of the root (itself a hash of the salt), never the salt."""
    return hashlib.sha256(_NAMESPACE_DOMAIN + root).hexdigest()[:16]


# What computes a replica's KV, as its root names it: the activation dtype, then "+method" for compact weights
# (kvprefix.model.quantized_linear), whose rounding changes the KV. A router matches a replica's root against these.
KV_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("int8", "int4", "gguf")


def kv_label(dtype: str, quantization: str | None) -> str:
    return dtype + (f"+{quantization}" if quantization else "")


def kv_labels() -> list[str]:
    """Every label a replica's root may carry."""
    return [kv_label(d, q) for d in KV_DTYPES for q in (None, *QUANTIZATION_METHODS)]


def chat_template_hash(template: str | None) -> str:
    return hashlib.sha256(template.encode()).hexdigest()[:16] if template else ""


def context_for_checkpoint(path: str, kv_dtype: str, chat_template: str | None = None) -> ExecutionContext:
    """The execution context of a checkpoint (a directory, or a single .gguf file), from its own bytes.

    The model and tokenizer fields are content fingerprints, so two replicas of one checkpoint produce identical
    roots however the path is spelled, and a re-trained checkpoint under the same path never hits old blocks.
    """
    path = os.path.realpath(os.path.expanduser(path))
    match = _HUB_SNAPSHOT.search(path)
    return ExecutionContext(
        model=checkpoint_fingerprint(path),
        revision=match.group(1) if match else "",
        tokenizer=tokenizer_fingerprint(path),
        chat_template=chat_template_hash(chat_template),
        kv_dtype=kv_dtype,
    )


def checkpoint_fingerprint(path: str) -> str:
    """XXH3-128 over the config and every weight file (names, sizes and bytes), in name order; "" for a
    directory with neither (a tokenizer alone, as the planner may be given)."""
    if os.path.isfile(path):
        return _fingerprint_files([path])
    names = sorted(
        n
        for n in os.listdir(path)
        if (n.endswith(_WEIGHT_SUFFIXES) and not n.startswith("consolidated")) or n in _CONFIG_FILES
    )
    return _fingerprint_files([os.path.join(path, n) for n in names]) if names else ""


def tokenizer_fingerprint(path: str) -> str:
    """XXH3-128 over the tokenizer files a checkpoint directory has ("" for none; a .gguf file carries its
    tokenizer inside, so its checkpoint fingerprint covers it)."""
    if os.path.isfile(path):
        return ""
    files = [os.path.join(path, n) for n in _TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
    return _fingerprint_files(files) if files else ""


def _fingerprint_files(files: list[str]) -> str:
    # Memoized on (path, size, mtime): tests and processes build many engines over one checkpoint, and a
    # multi-GB checkpoint takes seconds to read.
    stats = tuple((f, st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)])
    return _fingerprint(stats)


@functools.lru_cache(maxsize=64)
def _fingerprint(stats: tuple[tuple[str, int, int], ...]) -> str:
    h = xxhash.xxh3_128()
    for file, size, _ in stats:
        name = os.path.basename(file).encode()
        h.update(len(name).to_bytes(4, "little") + name + size.to_bytes(8, "little"))
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()
