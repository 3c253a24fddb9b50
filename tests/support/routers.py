"""Start a real `kvprefix route` in front of replicas; traffic with a few long shared system prompts; its hit rate
through a router and the bound one shared pool would reach."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

from kvprefix.cache import cdiv
from kvprefix.cache.event_wire import loads
from kvprefix.router.hashing import RequestHasher
from kvprefix.sim.metrics import summarize
from kvprefix.sim.replay import ReplayConfig, replay
from kvprefix.sim.trace import Trace, TraceRequest
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


def client(router: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0, timeout=120)


def hit_rate(router: Server, conversations: list[list[dict]], model: str = "default-model-v1") -> float:
    """Token-weighted hit rate of a sequence of chats sent one after another, from the replicas' own reports."""
    c, prompt, cached = client(router), 0, 0
    for messages in conversations:
        usage = c.chat.completions.create(model=model, messages=messages, max_tokens=1).usage
        prompt += usage.prompt_tokens
        cached += usage.prompt_tokens_details.cached_tokens
    return cached / prompt


def shared_pool_hit_rate(replica: Server, model_dir: str, conversations: list[list[dict]]) -> float:
    """The bound "one shared pool": the planner's replay of the same requests (the same hashes, from the replica's
    hello) on one real ``KVCacheManager`` of three replicas' pools."""
    with httpx.stream("GET", replica.url + "/v1/kv_events", timeout=10) as r:
        hello = loads(next(r.iter_lines()))
    hasher = RequestHasher.for_replica(hello, model_dir)
    bs = hello.block_size
    requests = []
    for messages in conversations:
        ids = hasher.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        hashes, _ = hasher.hash_prompt({"messages": messages}, None)
        requests.append(TraceRequest(0.0, len(ids), 1, hashes, cdiv(len(ids), bs)))
    trace = Trace("e2e", bs, requests)
    cfg = ReplayConfig(REPLICA_BLOCKS, replicas=3, routing="shared", mode="order")
    return summarize(trace, cfg, replay(trace, cfg)).token_hit_rate
