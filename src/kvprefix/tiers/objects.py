"""The stored block object: a documented, verified, self-describing binary format (docs/tiers.md).

One object holds one block's KV with everything needed to check it belongs where it is loaded: the identity
fields that change KV bytes (namespace id, block size, model fingerprint, KV dtype, layout), the block's hash,
parent hash and token ids, and an XXH3-128 checksum of everything before it. ``decode`` bounds every size before
allocating and raises ``ObjectError`` (with a short reason, for the counters) on anything that does not verify:
a tier turns that into a miss, never a crash. No pickle: fixed little-endian fields only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"KVPB"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHHIQ")  # magic, version, reserved (0), header length, payload length
PREFIX_SIZE = _PREFIX.size  # 20
CHECKSUM_SIZE = 16
MAX_HEADER_BYTES = 1 << 16  # far above any real header (a block of 4,096 tokens is 16 KiB of ids)
MAX_PAYLOAD_BYTES = 1 << 32  # 4 GiB: a bound before allocating; the reader also requires its spec's exact size
_MAX_STR = 256
_DIMS = struct.Struct("<IIII")  # block size, layers, KV heads, head size


class ObjectError(ValueError):
    """An object that does not verify; ``reason`` is one word for the counters (``verify_failures{reason}``)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class KVSpec:
    """What the KV bytes of a block depend on, beside its tokens: the identity fields a loader checks.

    ``model`` is the checkpoint fingerprint (``BlockIdentity.context.model``), ``kv_dtype`` the KV label
    ("bfloat16", "float32+int4"), ``element_size`` its bytes per element; the layout is the engine's per-layer
    block ``[block_size, 2 * num_kv_heads, head_size]`` (K heads then V heads), layers in order."""

    model: str
    kv_dtype: str
    element_size: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int

    @property
    def payload_bytes(self) -> int:
        return self.num_layers * self.block_size * 2 * self.num_kv_heads * self.head_size * self.element_size


@dataclass(frozen=True)
class BlockObject:
    """One stored block: its identity in the chain and its KV payload (bytes in the spec's layout)."""

    spec: KVSpec
    namespace: str  # the public namespace id (``cache.identity.namespace_id``)
    block_hash: bytes
    parent_hash: bytes  # the namespace root for a request's first block
    token_ids: tuple[int, ...]
    payload: bytes | bytearray | memoryview  # any bytes-like object of ``spec.payload_bytes`` bytes


def _text(value: str) -> bytes:
    data = value.encode()
    if len(data) > _MAX_STR:
        raise ValueError(f"a header string is longer than {_MAX_STR} bytes: {value[:40]!r}...")
    return struct.pack("<H", len(data)) + data


def _blob(value: bytes) -> bytes:
    if len(value) > _MAX_STR:
        raise ValueError(f"a header hash is longer than {_MAX_STR} bytes")
    return struct.pack("<H", len(value)) + value


def encode_header(obj: BlockObject) -> bytes:
    s = obj.spec
    if len(obj.token_ids) != s.block_size:
        raise ValueError(f"a block of {s.block_size} tokens has {len(obj.token_ids)} token ids")
    return b"".join((
        _text(obj.namespace), _text(s.model), _text(s.kv_dtype), struct.pack("<I", s.element_size),
        _DIMS.pack(s.block_size, s.num_layers, s.num_kv_heads, s.head_size),
        _blob(obj.block_hash), _blob(obj.parent_hash), struct.pack(f"<{s.block_size}I", *obj.token_ids),
    ))


def checksum(*parts) -> bytes:
    """XXH3-128 over ``parts`` (bytes-like) in order: the object's last 16 bytes cover prefix, header, payload."""
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


def encode(obj: BlockObject) -> bytes:
    """The object's bytes: prefix, header, payload, checksum of all three."""
    if len(obj.payload) != obj.spec.payload_bytes:
        raise ValueError(f"payload of {len(obj.payload)} bytes, the spec says {obj.spec.payload_bytes}")
    header = encode_header(obj)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header), len(obj.payload))
    return b"".join((prefix, header, obj.payload, checksum(prefix, header, obj.payload)))


def object_bytes(spec: KVSpec, namespace: str, hash_bytes: int) -> int:
    """The size of one object of ``spec`` (budgets count it before the block exists)."""
    header = len(namespace.encode()) + len(spec.model.encode()) + len(spec.kv_dtype.encode()) + 3 * 2 + 4 \
        + _DIMS.size + 2 * (2 + hash_bytes) + 4 * spec.block_size
    return PREFIX_SIZE + header + spec.payload_bytes + CHECKSUM_SIZE


@dataclass(frozen=True)
class Prefix:
    header_len: int
    payload_len: int

    @property
    def total(self) -> int:
        return PREFIX_SIZE + self.header_len + self.payload_len + CHECKSUM_SIZE


def decode_prefix(data: bytes, spec: KVSpec | None = None) -> Prefix:
    """Checks magic, version and bounds (and, given ``spec``, the exact payload size) before anything is read."""
    if len(data) < PREFIX_SIZE:
        raise ObjectError("truncated", f"{len(data)} bytes, less than the {PREFIX_SIZE}-byte prefix")
    magic, version, reserved, header_len, payload_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ObjectError("magic", f"magic {magic!r}, not {MAGIC!r}")
    if version != FORMAT_VERSION or reserved:
        raise ObjectError("version", f"format version {version} (reserved {reserved}); this reader knows {FORMAT_VERSION}")
    if header_len > MAX_HEADER_BYTES or payload_len > MAX_PAYLOAD_BYTES:
        raise ObjectError("bounds", f"header {header_len} or payload {payload_len} bytes past the format's bounds")
    if spec is not None and payload_len != spec.payload_bytes:
        raise ObjectError("identity", f"payload of {payload_len} bytes, this engine's blocks have {spec.payload_bytes}")
    return Prefix(header_len, payload_len)


class _Reader:
    def __init__(self, data: memoryview):
        self.data, self.pos = data, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.data):
            raise ObjectError("header", "header fields run past its length")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def blob(self) -> bytes:
        (n,) = struct.unpack("<H", self.take(2))
        return bytes(self.take(n))

    def text(self) -> str:
        try:
            return self.blob().decode()
        except UnicodeDecodeError:
            raise ObjectError("header", "a header string is not UTF-8") from None


def decode(data: bytes | bytearray | memoryview) -> BlockObject:
    """Parses and checks one whole object (checksum first); ``ObjectError`` for anything that does not verify.
    The payload is a view of ``data`` (writable when ``data`` is a bytearray), not a copy."""
    prefix = decode_prefix(data)
    if len(data) != prefix.total:
        raise ObjectError("truncated", f"{len(data)} bytes, the prefix says {prefix.total}")
    body = memoryview(data)[: prefix.total - CHECKSUM_SIZE]
    if xxhash.xxh3_128_digest(body) != data[-CHECKSUM_SIZE:]:
        raise ObjectError("checksum", "checksum of header and payload does not match")
    head = decode_header(body[: PREFIX_SIZE + prefix.header_len])
    return BlockObject(head.spec, head.namespace, head.block_hash, head.parent_hash, head.token_ids,
                       body[PREFIX_SIZE + prefix.header_len :])


def decode_header(data: bytes | memoryview) -> BlockObject:
    """The prefix and header alone (``payload`` empty, nothing verified by the checksum): what an operator's
    listing reads of each object without reading its KV."""
    prefix = decode_prefix(data)
    if len(data) < PREFIX_SIZE + prefix.header_len:
        raise ObjectError("truncated", "the header is cut short")
    r = _Reader(memoryview(data)[PREFIX_SIZE : PREFIX_SIZE + prefix.header_len])
    namespace, model, kv_dtype = r.text(), r.text(), r.text()
    (element_size,) = struct.unpack("<I", r.take(4))
    block_size, layers, heads, head_size = _DIMS.unpack(r.take(_DIMS.size))
    block_hash, parent_hash = r.blob(), r.blob()
    if block_size * 4 > MAX_HEADER_BYTES:
        raise ObjectError("bounds", f"block size {block_size} past the format's bounds")
    token_ids = struct.unpack(f"<{block_size}I", r.take(4 * block_size))
    if r.pos != prefix.header_len:
        raise ObjectError("header", f"header has {prefix.header_len - r.pos} bytes after its last field")
    spec = KVSpec(model, kv_dtype, element_size, block_size, layers, heads, head_size)
    if spec.payload_bytes != prefix.payload_len:
        raise ObjectError("header", f"layout says {spec.payload_bytes} payload bytes, the prefix {prefix.payload_len}")
    return BlockObject(spec, namespace, block_hash, parent_hash, token_ids, b"")


@dataclass(frozen=True)
class Expected:
    """What a loader knows the block at a position must be: its hash, parent, namespace and tokens."""

    block_hash: bytes
    parent_hash: bytes
    namespace: str
    token_ids: tuple[int, ...]


def verify(obj: BlockObject, spec: KVSpec, expected: Expected) -> None:
    """``ObjectError`` unless ``obj`` is exactly the block ``expected`` names, computed under ``spec``."""
    if obj.spec != spec:
        raise ObjectError("identity", f"computed under {obj.spec}, this engine is {spec}")
    if obj.namespace != expected.namespace:
        raise ObjectError("namespace", f"namespace {obj.namespace!r}, expected {expected.namespace!r}")
    if obj.block_hash != expected.block_hash or obj.parent_hash != expected.parent_hash:
        raise ObjectError("chain", "block or parent hash differs from the requested one")
    if tuple(obj.token_ids) != tuple(expected.token_ids):
        raise ObjectError("tokens", "token ids differ from the request's")
