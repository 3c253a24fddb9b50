"""`kvprefix cache stats|verify|clear DIR` on a real tier directory, as processes: stats counts blocks per
namespace, verify finds (and with --delete removes) every object that does not verify and exits 1, clear empties
the directory at once; a directory that is not a tier is refused in one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
from support.tier_blocks import SPEC, chain

from kvprefix.tiers import DiskStore
from kvprefix.tiers import disk_layout as layout


def cache(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kvprefix.cli", "cache", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def filled(tmp_path) -> tuple[str, list]:
    store = DiskStore(str(tmp_path / "tier"), 1 << 30, SPEC)
    blocks = chain(5) + [dataclasses.replace(b, namespace="f" * 16) for b in chain(3, seed=1)]
    for b in blocks:
        store.store(b)
    return store.root, blocks


def test_stats_counts_bytes_blocks_and_namespaces(tmp_path) -> None:
    root, blocks = filled(tmp_path)
    r = cache("stats", root, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["blocks"] == 8 and out["bytes"] == sum(e.size for e in layout.iter_objects(root))
    assert out["namespaces"] == {blocks[0].namespace: 5, "f" * 16: 3}


@pytest.mark.slow
def test_verify_finds_and_deletes_what_does_not_verify(tmp_path) -> None:
    root, blocks = filled(tmp_path)
    assert cache("verify", root).returncode == 0
    bad = layout.object_path(root, blocks[2].block_hash)
    with open(bad, "r+b") as f:
        f.seek(300)
        f.write(b"\xff")
    os.replace(layout.object_path(root, blocks[3].block_hash), layout.object_path(root, blocks[6].block_hash))
    r = cache("verify", root, "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["ok"] == 5 and out["bad"] == {"checksum": 1, "misplaced": 1}
    r = cache("verify", root, "--delete")
    assert r.returncode == 1 and "deleted 2" in r.stdout and "verified 7/7 objects" in r.stderr
    assert cache("verify", root).returncode == 0


def test_clear_empties_the_tier_and_refuses_other_directories(tmp_path) -> None:
    root, _ = filled(tmp_path)
    r = cache("clear", root)
    assert r.returncode == 0 and "cleared 8 objects" in r.stdout
    assert not list(layout.iter_objects(root)) and sorted(os.listdir(root)) == ["kvprefix-tier", "objects", "tmp"]
    r = cache("clear", str(tmp_path))
    assert r.returncode != 0 and r.stderr.strip().count("\n") == 0 and "not a kvprefix tier" in r.stderr
