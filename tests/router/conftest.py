"""Three real `kvprefix serve` replicas on 127.0.0.1 with small pools, started once for the router tests, and
real `kvprefix route` processes in front of them. The replicas are started with the server tests' helpers."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.routers import REPLICA_BLOCKS, start_router
from support.servers import Server, start_server, stop_server

POLICIES_UNDER_TEST = ("round-robin", "prefix", "kv-events", "session")


@pytest.fixture(scope="session")
def router_tmp(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> Path:
    return tmp_path_factory.mktemp("router")


@pytest.fixture(scope="session")
def replicas(router_tmp: Path) -> Iterator[list[Server]]:
    args = ("--num-gpu-blocks", str(REPLICA_BLOCKS), "--max-num-seqs", "16")
    # One after another: three starting at once on a loaded 2-core machine can each miss the start deadline.
    servers = [start_server(router_tmp, *args) for _ in range(3)]
    yield servers
    _stop_all(servers)


@pytest.fixture(scope="session")
def routers(router_tmp: Path, replicas: list[Server], default_model_dir: str) -> Iterator[dict[str, Server]]:
    """One router per policy under test, all over the same three replicas, started side by side; without --model:
    the hashing policies find the checkpoint the replicas announce."""
    urls = [s.url for s in replicas]
    with ThreadPoolExecutor(len(POLICIES_UNDER_TEST)) as pool:
        started = dict(zip(POLICIES_UNDER_TEST, pool.map(
            lambda policy: start_router(router_tmp, urls, policy, None), POLICIES_UNDER_TEST),
            strict=True))
    yield started
    _stop_all(list(started.values()))


def _stop_all(servers: list[Server]) -> None:
    """Stops every one (a failing one must not leave the others running), then checks each exited cleanly."""
    codes = [stop_server(s) for s in servers]
    for s, code in zip(servers, codes, strict=True):
        assert code in (0, -15) and "Traceback" not in s.log_path.read_text(), s.log_path.read_text()
