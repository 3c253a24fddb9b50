"""Real block objects for the tier tests: a small spec and chained blocks with random payloads."""

from __future__ import annotations

import hashlib
import random

from kvprefix.tiers import BlockObject, Expected, KVSpec

SPEC = KVSpec(model="m" * 32, kv_dtype="float32", element_size=4, block_size=4, num_layers=2, num_kv_heads=1,
              head_size=8)
NAMESPACE = "0123456789abcdef"
ROOT = hashlib.sha256(b"root").digest()


def chain(n: int, seed: int = 0, spec: KVSpec = SPEC, namespace: str = NAMESPACE) -> list[BlockObject]:
    """``n`` chained blocks: hashes derived from parent and tokens, payloads random."""
    rng = random.Random(seed)
    parent, out = ROOT, []
    for _ in range(n):
        tokens = tuple(rng.randrange(1000) for _ in range(spec.block_size))
        h = hashlib.sha256(parent + repr(tokens).encode()).digest()
        out.append(BlockObject(spec, namespace, h, parent, tokens, rng.randbytes(spec.payload_bytes)))
        parent = h
    return out


def expected(obj: BlockObject) -> Expected:
    return Expected(obj.block_hash, obj.parent_hash, obj.namespace, obj.token_ids)
