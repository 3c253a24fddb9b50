"""Start a real `kvprefix route` in front of replicas; traffic with a few long shared system prompts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from support.servers import Server, free_port

REPLICA_BLOCKS = 72  # 16-token blocks: a replica holds about three of the system prompts below, not all six
# Six system prompts of about 300 tokens each (built-in tokenizer), distinct from their first block on.
SYSTEM_PROMPTS = [f"Policy {k}: you are assistant number {k}. " + f"Rule {k} says: answer briefly. " * 13
                  for k in range(6)]


def start_router(tmp: Path, replica_urls: list[str], policy: str, model: str | None, *args: str,
                 admin: dict | None = None) -> Server:
    """A `kvprefix route` on a free port (``model`` None: without --model); returns once it is up and every replica
    is healthy (and, for kv-events, every replica's event stream has been synced)."""
    port = free_port()
    log_path = tmp / f"router-{policy}-{port}.log"
    cmd = [sys.executable, "-m", "kvprefix.cli", "route", "--port", str(port), "--policy", policy,
           *(["--model", model] if model else []), "--log-level", "warning", "--health-interval", "0.2", *args]
    for url in replica_urls:
        cmd += ["--replica", url]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    router = Server(f"http://127.0.0.1:{port}", proc, log_path, None)
    wait_synced(router, len(replica_urls), policy == "kv-events", admin)
    return router


def wait_synced(router: Server, num_replicas: int, events: bool, admin: dict | None = None,
                timeout: float = 180.0) -> dict[str, float]:
    """Waits until the router sees every replica healthy (and its event stream synced); returns its metrics."""
    deadline = time.monotonic() + timeout
    while True:
        if router.proc.poll() is not None:
            raise RuntimeError(f"router exited with {router.proc.returncode}:\n{router.log_path.read_text()}")
        try:
            m = router.metrics(admin)
        except (httpx.HTTPError, ValueError):  # not up yet
            m = {}
        healthy = [v for k, v in m.items() if k.startswith("kvprefix:router_replica_healthy")]
        synced = [v for k, v in m.items() if k.startswith("kvprefix:router_kv_events_blocks")]
        if len(healthy) == num_replicas and all(healthy) and (not events or all(v >= 0 for v in synced)):
            return m
        if time.monotonic() > deadline:
            raise RuntimeError(f"router not ready: {m}\n{router.log_path.read_text()}")
        time.sleep(0.1)


def per_replica(metrics: dict[str, float], name: str) -> dict[str, float]:
    """A router metric's samples by replica URL, summed over its other labels."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if key.startswith(f"kvprefix:router_{name}{{"):
            replica = next(p for p in key[key.index("{") + 1 : -1].split(",") if p.startswith("http"))
            out[replica] = out.get(replica, 0.0) + value
    return out


def shared_prefix_traffic(rounds: int = 6) -> list[list[dict]]:
    """Chat message lists: every round asks each system prompt one new question, in a shuffled but fixed order."""
    order = [0, 3, 1, 4, 2, 5]
    return [[{"role": "system", "content": SYSTEM_PROMPTS[k]}, {"role": "user", "content": f"Question {r} for {k}?"}]
            for r in range(rounds) for k in order[r % 2 :] + order[: r % 2]]
