"""A real KV event subscriber for the server tests: an HTTP stream read line by line into a StreamMirror."""

from __future__ import annotations

import httpx

from kvprefix.cache import BlockHash, BlockHasher
from kvprefix.cache.event_index import StreamMirror
from kvprefix.cache.event_wire import Event, Hello, Message, loads
from support.servers import Server

MODEL = "default-model-v1"


class Subscriber:
    """``GET /v1/kv_events`` held open; ``next`` reads one message and applies it to ``mirror`` (which raises on
    any gap or repeat). Reads time out after 20 s, so a missing event fails the test instead of hanging it."""

    def __init__(self, server: Server, headers: dict | None = None, mirror: StreamMirror | None = None, **params):
        self._cm = httpx.stream("GET", server.url + "/v1/kv_events", params=params, headers=headers or {},
                                timeout=httpx.Timeout(10, read=20))
        self.response = self._cm.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self._lines = self.response.iter_lines()
        self.mirror = mirror or StreamMirror()
        self.received: list[Message] = []
        self.hello = self.next()
        assert isinstance(self.hello, Hello)

    def next(self) -> Message:
        msg = loads(next(self._lines))
        self.mirror.apply(msg)
        self.received.append(msg)
        return msg

    def until(self, seq: int) -> None:
        """Reads until the mirror is complete up to event ``seq``."""
        while not self.mirror.ready or self.mirror.since < seq:
            self.next()

    def sync(self, server: Server, headers: dict | None = None) -> int:
        """Reads everything the server has published so far: its latest number comes from a new stream's hello."""
        probe = Subscriber(server, headers)
        probe.close()
        self.until(probe.hello.seq)
        return probe.hello.seq

    def events(self) -> list[Event]:
        return [m for m in self.received if isinstance(m, Event)]

    def close(self) -> None:
        self._cm.__exit__(None, None, None)


def prompt(base: int, num_tokens: int = 165) -> list[int]:
    """Token ids whose every block is unique to ``base`` (it is the first token of the chain)."""
    return [base] + [(base * 31 + i) % 700 for i in range(1, num_tokens)]


def chain(hello: Hello, tokens: list[int]) -> list[BlockHash]:
    """The block hashes of ``tokens`` in the replica's unsalted namespace, as a router computes them."""
    return BlockHasher(hello.block_size, hello.hash_algo).hash_blocks(tokens, parent=hello.root)


def cached_tokens(server: Server, tokens: list[int], headers: dict | None = None) -> int:
    r = server.post("/v1/completions", {"model": MODEL, "prompt": tokens, "max_tokens": 1, "temperature": 0},
                    headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
