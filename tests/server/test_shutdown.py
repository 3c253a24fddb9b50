"""Graceful shutdown on SIGTERM: in-flight requests that finish within --shutdown-timeout complete normally;
the rest are aborted (their blocks freed by the engine's shutdown), and the process exits promptly."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
from support.servers import start_server


@pytest.mark.slow
def test_sigterm_finishes_short_requests_and_aborts_long_ones(server_tmp) -> None:
    server = start_server(server_tmp, "--num-gpu-blocks", "512", "--shutdown-timeout", "3")
    results: dict[str, object] = {}
    started = {name: threading.Event() for name in ("short", "long")}

    def stream(name: str, max_tokens: int) -> None:
        try:
            s = server.client().completions.create(model="default-model-v1", prompt=f"{name} request",
                                                   max_tokens=max_tokens, stream=True,
                                                   extra_body={"ignore_eos": True})
            finish = None
            for chunk in s:
                started[name].set()
                finish = chunk.choices[0].finish_reason or finish
            results[name] = finish
        except Exception as exc:  # the long stream is cut off at the deadline
            results[name] = exc
        finally:
            started[name].set()

    threads = [threading.Thread(target=stream, args=(name, n)) for name, n in (("short", 30), ("long", 5000))]
    for t in threads:
        t.start()
    assert all(e.wait(30) for e in started.values())
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=60)
    for t in threads:
        t.join(30)
    assert code in (0, -15)
    assert time.monotonic() - t0 < 30
    assert results["short"] == "length"
    assert results["long"] == "abort"  # ended in-band, not cut off
    assert "Traceback" not in server.log_path.read_text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
