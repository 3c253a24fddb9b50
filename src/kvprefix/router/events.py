"""Following a replica's KV event stream (docs/kv-events.md) into its ``StreamMirror``, for ever.

On any end (goodbye, a dropped connection, a read timeout past the heartbeat) the follower reconnects with the
mirror's ``since`` and ``epoch``; the replica resumes or sends a snapshot. A restarted replica has a new epoch,
so it sends a snapshot and the mirror is resynced. A stream that breaks its contract (``StreamError``) starts
over from a snapshot.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import httpx

from kvprefix.cache.event_index import StreamError, StreamMirror
from kvprefix.cache.event_wire import Hello, SnapshotEnd, loads
from kvprefix.router.fleet import Replica

log = logging.getLogger("kvprefix.router")

READ_TIMEOUT_S = 30.0  # past the replica's 10 s heartbeat: silence this long means the replica is gone


async def read_hello(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Hello:
    """The first message of a replica's stream: its block size, hash algorithm and root."""
    async with client.stream("GET", url + "/v1/kv_events", headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            msg = loads(line)
            if isinstance(msg, Hello):
                return msg
            break
    raise ValueError(f"{url}/v1/kv_events did not start with a hello")


# Opens a replica's event stream with these query parameters and yields its lines: over HTTP here, through a
# Ray Serve handle in ``router.ray.ingress``. One follower for both.
Lines = Callable[[dict[str, str]], AsyncIterator[bytes | str]]


def http_lines(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Lines:
    timeout = httpx.Timeout(10.0, read=READ_TIMEOUT_S)

    async def lines(params: dict[str, str]) -> AsyncIterator[bytes | str]:
        async with client.stream("GET", url + "/v1/kv_events", params=params, headers=headers,
                                 timeout=timeout) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                yield line

    return lines


async def follow(lines: Lines, replica: Replica, on_resync: Callable[[Replica], None], retry_s: float = 0.5,
                 on_hello: Callable[[Hello], None] | None = None) -> None:
    """Keeps ``replica.mirror`` exact while the task runs; ``on_resync`` after every snapshot, ``on_hello`` for
    every hello (a replica that restarted may hash otherwise)."""
    replica.mirror = mirror = replica.mirror or StreamMirror()
    while True:
        params = {"since": str(mirror.since), "epoch": mirror.epoch} if mirror.since is not None else {}
        try:
            async for line in lines(params):
                if not line:
                    continue
                msg = loads(line)
                if on_hello is not None and isinstance(msg, Hello):
                    on_hello(msg)
                mirror.apply(msg)
                if isinstance(msg, SnapshotEnd):
                    replica.resyncs += 1
                    on_resync(replica)
        except StreamError as exc:
            log.warning("kv events of %s: %s; starting over from a snapshot", replica.name, exc)
            replica.mirror = mirror = StreamMirror()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica went away (any transport's error): reconnect
            log.debug("kv events of %s: %s; reconnecting", replica.name, exc)
        mirror.ready = False  # until the next resume or snapshot
        await asyncio.sleep(retry_s)
