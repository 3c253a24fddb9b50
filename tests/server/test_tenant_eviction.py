"""Prime and probe across tenants on a real server (docs/security.md, "Eviction isolation").

Bob fills a small pool with his prompts, alice sends a prompt (or does not), bob re-sends his prompts and reads
``cached_tokens``. With one LRU for all (``--tenant-kv-reserve 0``) what bob lost counts alice's blocks; with the
default reservation his view is the same whether alice sent or not.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.servers import ADMIN, ADMIN_KEY, Server, start_server, stop_server

from kvprefix.server.cli import add_arguments

KEYS = {"key-alice": "alice", "key-bob": "bob"}
BS = 16
NUM_BLOCKS = 64  # two tenants, reserve 0.5: 16 blocks each
BOB_PROMPTS = [[400 + i] * (4 * BS) + [7] for i in range(16)]  # 64 cached blocks: more than the pool keeps
ALICE_PROMPT = [200 + (j % 9) for j in range(6 * BS)] + [5]  # with its partial block and her first one: 8 of 16


@pytest.fixture(scope="module", params=["0.5", "0"], ids=["isolated", "one-lru"])
def probed(request: pytest.FixtureRequest, server_tmp: Path) -> Iterator[tuple[str, Server]]:
    keys = server_tmp / "eviction-keys.json"
    keys.write_text(json.dumps(KEYS))
    s = start_server(server_tmp, "--api-keys-file", str(keys), "--admin-key", ADMIN_KEY,
                     "--num-gpu-blocks", str(NUM_BLOCKS), "--tenant-kv-reserve", request.param)
    yield request.param, s
    assert stop_server(s) in (0, -15) and "Traceback" not in s.log_path.read_text(), s.log_path.read_text()


def _cached(server: Server, key: str, prompt: list[int]) -> int:
    r = server.client(key).completions.create(model="default-model-v1", prompt=prompt, max_tokens=1, temperature=0)
    return r.usage.prompt_tokens_details.cached_tokens


def bob_view(server: Server, alice_sends: bool) -> list[int]:
    server.wait_idle(ADMIN)
    assert httpx.post(server.url + "/reset_prefix_cache", headers=ADMIN, timeout=10).status_code == 200
    _cached(server, "key-alice", [300] * BS + [1])  # alice has been here before: her share is reserved
    for p in BOB_PROMPTS:
        _cached(server, "key-bob", p)
    if alice_sends:
        _cached(server, "key-alice", ALICE_PROMPT)
    return [_cached(server, "key-bob", p) for p in reversed(BOB_PROMPTS)]  # newest first: a miss evicts the oldest


@pytest.mark.slow
def test_bob_cannot_count_alices_blocks_in_his_evictions(probed: tuple[str, Server]) -> None:
    reserve, server = probed
    quiet, probed_view = bob_view(server, alice_sends=False), bob_view(server, alice_sends=True)
    assert sum(quiet) > 0
    if reserve == "0":
        assert sum(probed_view) < sum(quiet)  # the leak: one LRU for all
    else:
        assert probed_view == quiet


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "half"])
def test_a_reserve_that_is_not_a_fraction_is_refused(bad: str, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--tenant-kv-reserve", bad])
    assert "--tenant-kv-reserve" in capsys.readouterr().err
