"""`kvprefix route` learns the replicas' block identity from their KV event hellos: without --model it finds the
checkpoint the identity names (the tests' model by its path; the built-in default model on any machine with kvprefix
installed), and a replica whose identity it cannot reproduce is a one-line error naming the replica."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest
from support.routers import start_router
from support.servers import LONG_PREFIX, free_port, start_server, stop_server


def cached_tokens(router, question: str, system: str = LONG_PREFIX) -> int:
    reply = router.client().chat.completions.create(
        model="default-model-v1", max_tokens=1,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])
    return reply.usage.prompt_tokens_details.cached_tokens


def wait_for_events(router, blocks: int = 16, timeout: float = 30.0) -> None:
    """Until the router knows ``blocks`` blocks from the replicas' event streams."""
    deadline = time.monotonic() + timeout
    while sum(v for k, v in router.metrics().items() if k.startswith("kvprefix:router_kv_events_blocks")) < blocks:
        assert time.monotonic() < deadline, router.metrics()
        time.sleep(0.05)


def route_refusing(replica_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvprefix.cli", "route", "--port", str(free_port()), "--policy",
                           "kv-events", "--replica", replica_url, "--log-level", "warning", *args],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # a real replica and router processes: ~8 s
def test_the_router_finds_the_replicas_checkpoint_or_names_the_replica(tmp_path, default_model_dir) -> None:
    copy = shutil.copytree(default_model_dir, tmp_path / "copy")
    replica = start_server(tmp_path, "--model", str(copy), "--num-gpu-blocks", "256")
    try:
        router = start_router(tmp_path, [replica.url], "kv-events", None)  # the checkpoint the identity names
        try:
            assert cached_tokens(router, "First?") == 0
            wait_for_events(router)
            assert cached_tokens(router, "Second?") >= 256
        finally:
            assert stop_server(router) in (0, -15)
        (copy / "config.json").write_text((copy / "config.json").read_text() + " ")  # not the replica's any more
        refused = route_refusing(replica.url)
        assert refused.returncode == 1, refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith(f"kvprefix route: replica {replica.url} runs {copy}, which this router cannot find: "
                               f"{copy} differs (model "), refused.stderr
        assert "give --model" in line and "Traceback" not in refused.stderr
        given = route_refusing(replica.url, "--model", str(copy))
        assert given.stderr.strip().splitlines()[-1].startswith(
            f"kvprefix route: --model {copy} is not the checkpoint of replica {replica.url}: model "), given.stderr
    finally:
        stop_server(replica)


@pytest.mark.slow
def test_three_replicas_of_the_default_model_route_without_model(tmp_path) -> None:
    replicas = [start_server(tmp_path, "--num-gpu-blocks", "128", "--max-num-seqs", "4", builtin_model=True)
                for _ in range(3)]
    try:
        router = start_router(tmp_path, [r.url for r in replicas], "kv-events", None)
        try:
            # One system prompt per replica (the load cap spreads them), then each again: where its blocks are.
            systems = [f"Variant {k}. {LONG_PREFIX}" for k in range(3)]  # about 440 tokens each
            assert [cached_tokens(router, "First?", system) for system in systems] == [0, 0, 0]
            wait_for_events(router, 3 * 16)
            assert all(cached_tokens(router, "Again?", system) >= 256 for system in systems)
        finally:
            assert stop_server(router) in (0, -15)
    finally:
        for r in replicas:
            stop_server(r)
