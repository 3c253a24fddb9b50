"""What a replica receives of a relayed request: the headers of ``http.forwarding`` (the session key included, as
the Ray ingress forwards it), through a real `kvprefix route` to a real HTTP server on loopback that records them
(a `kvprefix serve` reads no session header, so it could not tell)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from support.routers import start_router
from support.servers import Server, stop_server

from kvprefix.http.forwarding import FORWARD_HEADERS

ANSWER = json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}})


class RecordingReplica(BaseHTTPRequestHandler):
    """Answers health checks, and every POST with a fixed completion, keeping the request's headers."""

    seen: list[dict[str, str]] = []

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._answer(200 if self.path == "/health" else 404, b"{}")

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        self._answer(200, ANSWER.encode())

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def replica() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), RecordingReplica)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def router(tmp_path, replica: str) -> Iterator[Server]:
    started = start_router(tmp_path, [replica], "round-robin", "unused: round-robin reads no checkpoint")
    yield started
    assert stop_server(started) in (0, -15) and "Traceback" not in started.log_path.read_text()


def test_the_session_header_reaches_the_replica_through_the_relay(router: Server):
    RecordingReplica.seen.clear()
    sent = {"authorization": "Bearer k1", "content-type": "application/json", "accept": "application/json",
            "x-session-id": "conversation-7", "x-not-forwarded": "no"}
    answer = httpx.post(router.url + "/v1/chat/completions", content=b'{"messages": []}', headers=sent, timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["prompt_tokens"] == 3
    [seen] = RecordingReplica.seen
    assert seen["x-session-id"] == "conversation-7"
    assert {k: seen.get(k) for k in FORWARD_HEADERS} == {k: sent[k] for k in FORWARD_HEADERS}
    assert "x-not-forwarded" not in seen
