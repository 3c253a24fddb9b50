"""Helpers for the server tests: start a real `kvprefix serve` on a free loopback port, talk to it, read metrics."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

ADMIN_KEY = "admin-secret"
TENANT_KEYS = {"key-alice": "alice", "key-bob": "bob", "key-alice-2": "alice"}
# About 600 tokens with the built-in tokenizer: long enough to span many 16-token blocks.
LONG_PREFIX = "You are a careful assistant. Follow the policy below to the letter. " * 30
# One TLS context for every HTTP client the tests make: httpx builds one per client otherwise (loading certifi's
# bundle: about 70 ms of CPU each), the tests make thousands, and all of them speak plain http to 127.0.0.1.
TLS = ssl.create_default_context()


class _HttpClient(openai.DefaultHttpxClient):
    """openai's default HTTP client with the shared TLS context, closed when dropped as openai's own one is."""

    def __del__(self) -> None:
        if not self.is_closed:
            self.close()


class Endpoint:
    """What the tests do with a server, in-process (`support.app_server.AppServer`) or a process (`Server`): GET and
    POST a path, read /metrics, wait until idle."""

    url: str

    def get(self, path: str, headers: dict | list | None = None, **kw) -> httpx.Response:
        raise NotImplementedError

    def post(self, path: str, body: bytes | dict | None = None, headers: dict | None = None, **kw) -> httpx.Response:
        raise NotImplementedError

    @staticmethod
    def post_args(body: bytes | dict | None, headers: dict | None) -> dict:
        content = json.dumps(body).encode() if isinstance(body, dict) else body
        return {"content": content, "headers": {"content-type": "application/json", **(headers or {})}}

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """Every sample of /metrics by name plus its non-model labels, e.g. 'kvprefix:request_success_total{stop}'."""
        text = self.get("/metrics", headers=headers or {}, timeout=10).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(v for k, v in sorted(s.labels.items()) if k not in ("model_name", "engine"))
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    def wait_idle(self, headers: dict | None = None, timeout: float = 10.0) -> dict[str, float]:
        """Waits until no request runs or waits and every block is free (aborts settle asynchronously); returns
        the metrics. Fails if blocks stay referenced: that would be a leak."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics(headers)
            idle = (m["kvprefix:num_requests_running"] == 0 and m["kvprefix:num_requests_waiting"] == 0
                    and m["kvprefix:server_requests_in_flight"] == 0)
            if idle and m["kvprefix:kv_cache_free_blocks"] == m["kvprefix:kv_cache_blocks"]:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle or blocks leaked: {m}")
            time.sleep(0.05)


@dataclass
class Server(Endpoint):
    """A `kvprefix serve` process on a loopback port."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    request_log: Path | None

    def client(self, api_key: str = "none", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60,
                             http_client=_HttpClient(verify=TLS), **kwargs)

    def async_client(self, api_key: str = "none") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def get(self, path: str, headers: dict | list | None = None, **kw) -> httpx.Response:
        return httpx.get(self.url + path, headers=headers, verify=TLS, **{"timeout": 60, **kw})

    def post(self, path: str, body: bytes | dict | None = None, headers: dict | None = None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, **self.post_args(body, headers), verify=TLS, **{"timeout": 60, **kw})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *args: str, request_log: bool = False, port: int | None = None,
                 builtin_model: bool = False) -> Server:
    """A `kvprefix serve` on ``port`` (default: a free one; give the old one to restart a replica in place), of the
    tests' random model, or with ``builtin_model`` of the built-in default (SmolLM2-135M-Instruct)."""
    return wait_ready(spawn_server(tmp, *args, request_log=request_log, port=port, builtin_model=builtin_model))


def spawn_server(tmp: Path, *args: str, request_log: bool = False, port: int | None = None,
                 builtin_model: bool = False) -> Server:
    """Starts the process and returns at once; `wait_ready` waits until it serves."""
    port = port or free_port()
    log_path = tmp / f"server-{port}.log"
    rl = tmp / f"requests-{port}.jsonl" if request_log else None
    # The tests' small random model (tests/conftest.py), under the name the tests send; float32 on every machine,
    # so that outputs compare exactly whatever "auto" picks there.
    model = [] if builtin_model else ["--model", os.environ["KVPREFIX_TEST_MODEL"]]
    cmd = [sys.executable, "-m", "kvprefix.cli", "serve", "--port", str(port), "--log-level", "warning",
           *model, "--served-model-name", "default-model-v1", "--dtype", "float32",
           "--max-num-seqs", "80", *args]
    if rl is not None:
        cmd += ["--request-log", str(rl)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    return Server(f"http://127.0.0.1:{port}", proc, log_path, rl)


def wait_ready(server: Server, timeout: float = 120) -> Server:
    """Waits until ``server`` answers /health; kills it and raises, with its log, if it exits or never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_path.read_text()}")
        try:
            if httpx.get(server.url + "/health", timeout=1, verify=TLS).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.proc.kill()
    raise RuntimeError(f"server did not start:\n{server.log_path.read_text()}")


def stop_server(server: Server) -> int:
    """SIGTERM, as an orchestrator would. uvicorn shuts down gracefully, then re-raises the signal, so the exit
    status is -15 (or 0)."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        raise


ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


def greedy_tokens(server: Server, prompt: list[int], detail: list | None = None) -> tuple[list[str], int]:
    """16 greedy tokens of a token-id prompt and its cached tokens (the tier tests compare these across servers);
    its ``cache_detail`` entries are appended to ``detail``."""
    r = server.client().completions.create(model="default-model-v1", prompt=prompt, max_tokens=16, temperature=0,
                                           logprobs=0, extra_body={"cache_detail": True})
    if detail is not None:
        detail += r.usage.model_extra["cache_detail"]
    return r.choices[0].logprobs.tokens, r.usage.prompt_tokens_details.cached_tokens
