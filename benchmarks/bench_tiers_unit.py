"""Which unit a disk tier stores: one block per object, or one run of 16 blocks per object?

Writes 125 blocks (2,000 tokens) of the default model's bf16 KV (368,640 bytes per 16-token block) the way
`DiskStore` does (temporary file, rename) and reads them back with the XXH3-128 checksum, alternating the two
units three times. The answer is in docs/tiers.md.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import xxhash

from kvprefix.tiers import disk_layout as layout

BLOCK_BYTES = 30 * 16 * 6 * 64 * 2  # layers x tokens x (K+V heads) x head size x bf16
NUM_BLOCKS = 125


def run(root: str, per_object: int) -> tuple[float, float]:
    shutil.rmtree(root, ignore_errors=True)
    layout.prepare(root)
    payload = os.urandom(BLOCK_BYTES * per_object)
    names = [layout.object_path(root, i.to_bytes(32, "big")) for i in range(0, NUM_BLOCKS, per_object)]
    t = time.perf_counter()
    for path in names:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "wb") as f:
            f.write(payload + xxhash.xxh3_128_digest(payload))
        os.replace(path + ".tmp", path)
    written = time.perf_counter() - t
    t = time.perf_counter()
    for path in names:
        with open(path, "rb") as f:
            data = f.read()
        assert xxhash.xxh3_128_digest(data[:-16]) == data[-16:]
    return written, time.perf_counter() - t


def main() -> None:
    root = tempfile.mkdtemp(prefix="tiers-unit-")
    try:
        for per in (1, 16) * 3:
            w, r = run(os.path.join(root, "tier"), per)
            gbs = NUM_BLOCKS * BLOCK_BYTES / r / 1e9
            print(f"{per:>2} blocks/object: write {w * 1000:6.1f} ms  read {r * 1000:6.1f} ms  ({gbs:.2f} GB/s)")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
