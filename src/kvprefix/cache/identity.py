"""The identity of a block's KV: ``BlockIdentity`` (block size, hash algorithm, the execution context that roots
every hash chain) and the cache namespace.

One implementation for every process that names blocks: the engine builds its identity with ``block_identity``
from its checkpoint, dtype and quantization; a replica publishes it (``to_dict``: KV-event hello, ``/v1/models``),
and the router, the Ray ingress, the planner and the doctor build their hashers from it. Namespaces come from
``namespace_salt`` alone. Pure Python (no torch): a router computes roots without loading a model.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from kvprefix.cache.hashing import BlockHasher

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


def namespace_salt(tenant: str | None, cache_salt: str | None, lora: str | None = None) -> str:
    """The one derivation of a cache namespace from (tenant, client cache salt, LoRA adapter fingerprint). "" is
    the shared namespace of the base model.

    JSON keeps the fields unambiguous (no choice of names makes two tuples encode alike); a request with only a
    ``cache_salt`` lands in the same namespace whether it went through ``LLM``, the server or the planner. An
    adapter's requests live in a namespace of their own (``lora`` is ``adapter_fingerprint``: its content, so two
    names for one adapter share blocks and reloaded weights under one name do not).
    """
    if lora:
        return json.dumps([tenant or "", cache_salt or "", lora], separators=(",", ":"))
    if tenant is None and cache_salt is None:
        return ""
    return json.dumps([tenant or "", cache_salt or ""], separators=(",", ":"))


def namespace_id(root: bytes) -> str:
    """A public name for the namespace rooted at ``root``: safe to publish in events and logs, since it is a hash
    of the root (itself a hash of the salt), never the salt."""
    return hashlib.sha256(_NAMESPACE_DOMAIN + root).hexdigest()[:16]


QUANTIZATION_METHODS = ("int8", "int4", "gguf")  # compact weights (kvprefix.model.quantized_linear)
NO_QUANTIZATION = "none"  # asks for dense weights where a quantized GGUF would run compact by default
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, NO_QUANTIZATION)  # what --quantization accepts
IDENTITY_VERSION = 1  # of BlockIdentity.to_dict (docs/hashing.md)
_CONTEXT_FIELDS = ("model", "revision", "tokenizer", "chat_template", "kv_dtype")


def kv_label(dtype: str, quantization: str | None, numerics: str = "") -> str:
    """What computes the KV, as the root names it: the activation dtype, then "+method" for compact weights, whose
    rounding changes the KV, then "+numerics" for deterministic mode (the kernels' settings that must match for its
    bytes to be reproducible: docs/determinism.md)."""
    return dtype + (f"+{quantization}" if quantization else "") + (f"+{numerics}" if numerics else "")


@dataclass(frozen=True)
class BlockIdentity:
    """What names a block: its size, the hash algorithm and the (unsalted) execution context; ``checkpoint`` is
    where the replica loaded the checkpoint from, a hint for whoever needs its tokenizer (the fingerprints decide
    whether a local file is the same checkpoint). Frozen; ``to_dict``/``from_dict`` is its JSON form."""

    block_size: int
    hash_algo: str
    context: ExecutionContext
    checkpoint: str = ""

    def hasher(self) -> BlockHasher:
        """A new hasher of the shared namespace (keep it: it memoizes the namespaces' hashers)."""
        from kvprefix.cache.hashing import BlockHasher  # hashing imports this module

        return BlockHasher(self.block_size, self.hash_algo, self.context)

    def to_dict(self) -> dict[str, Any]:
        context = self.context.public_fields()
        return {"version": IDENTITY_VERSION, "block_size": self.block_size, "hash_algo": self.hash_algo,
                "context": context, "checkpoint": self.checkpoint}

    @classmethod
    def from_dict(cls, d: Any) -> BlockIdentity:
        """ValueError, naming the field, for anything but a ``to_dict`` of this version."""
        if not isinstance(d, dict) or d.get("version") != IDENTITY_VERSION:
            version = d.get("version") if isinstance(d, dict) else None
            raise ValueError(f"block identity version {version!r}; this reader knows {IDENTITY_VERSION}")
        context = d.get("context")
        if not isinstance(context, dict) or not all(isinstance(context.get(k), str) for k in _CONTEXT_FIELDS):
            raise ValueError(f"block identity 'context' must have the string fields {', '.join(_CONTEXT_FIELDS)}")
        block_size, algo, checkpoint = d.get("block_size"), d.get("hash_algo"), d.get("checkpoint", "")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"block identity 'block_size' must be a positive integer, got {block_size!r}")
        if not isinstance(algo, str) or not isinstance(checkpoint, str):
            raise ValueError("block identity 'hash_algo' and 'checkpoint' must be strings")
        return cls(block_size, algo, ExecutionContext(**{k: context[k] for k in _CONTEXT_FIELDS}), checkpoint)

    def checkpoint_differences(self, path: str) -> list[str]:
        """What makes the checkpoint at ``path`` tokenize or compute otherwise than this identity's: its tokenizer
        files, or its weights where it has any (a tokenizer directory alone tokenizes alike). Empty: ``path`` is
        the replica's checkpoint (compare its chat template with ``template_difference``)."""
        path = os.path.realpath(os.path.expanduser(path))
        model = checkpoint_fingerprint(path)
        local = {"tokenizer": tokenizer_fingerprint(path), **({"model": model} if model else {})}
        return [f"{k} {_short(v)} vs {_short(getattr(self.context, k))}" for k, v in local.items()
                if v != getattr(self.context, k)]

    def template_difference(self, chat_template: str | None, content_format: str = "string") -> list[str]:
        """``["chat_template ..."]`` when ``chat_template`` (rendered in ``content_format``) is not the one this
        identity was computed with."""
        mine = chat_template_hash(chat_template, content_format)
        return [] if mine == self.context.chat_template else [
            f"chat_template {_short(mine)} vs {_short(self.context.chat_template)}"]

    def differences(self, other: BlockIdentity) -> list[str]:
        """What differs from ``other`` (the checkpoint path aside), as "name: this vs other"."""
        mine = {"block_size": self.block_size, "hash_algo": self.hash_algo, **self.context.public_fields()}
        theirs = {"block_size": other.block_size, "hash_algo": other.hash_algo, **other.context.public_fields()}
        return [f"{k} {_short(v)} vs {_short(theirs[k])}" for k, v in mine.items() if v != theirs[k]]


def _short(value: Any) -> str:
    text = str(value)
    return (text[:12] + "...") if len(text) > 15 else (text or '""')


def block_identity(checkpoint: str, dtype: str, quantization: str | None, chat_template: str | None, *,
                   content_format: str = "string", block_size: int = 16, hash_algo: str = "sha256",
                   numerics: str = "") -> BlockIdentity:
    """The one constructor: the identity of ``checkpoint``'s blocks computed in ``dtype`` (e.g. "bfloat16") with
    ``quantization`` (None, or a method of ``QUANTIZATION_METHODS``), under the tokenizer's ``chat_template``
    rendered in ``content_format``; ``numerics``: deterministic mode's fingerprint ("" otherwise)."""
    context = context_for_checkpoint(checkpoint, kv_label(dtype, quantization, numerics), chat_template,
                                     content_format)
    return BlockIdentity(block_size, hash_algo, context, os.path.realpath(os.path.expanduser(checkpoint)))


def chat_template_hash(template: str | None, content_format: str = "string") -> str:
    """The template's fingerprint in the execution context: SHA-256 of its text, and of the content format too
    where that is not "string" (the one every template was rendered in before the option: their hashes stay)."""
    if not template:
        return ""
    text = template if content_format == "string" else f"{template}\0content_format={content_format}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def context_for_checkpoint(path: str, kv_dtype: str, chat_template: str | None = None,
                           content_format: str = "string") -> ExecutionContext:
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
        chat_template=chat_template_hash(chat_template, content_format),
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


ADAPTER_CONFIG_FILE = "adapter_config.json"  # a PEFT LoRA adapter directory's two files
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def adapter_fingerprint(path: str) -> str:
    """XXH3-128 over a PEFT adapter directory's config and weights (names, sizes and bytes): the adapter's content,
    whatever it is named or where it lies."""
    return _fingerprint_files([os.path.join(path, n) for n in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE)])


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
