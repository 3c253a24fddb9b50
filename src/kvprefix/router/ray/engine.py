"""The engine deployment: each replica an AsyncLLM behind `kvprefix serve`'s own app, called over ASGI."""

import dataclasses
from collections.abc import AsyncIterator, Callable
from typing import Any

from ray import serve

from kvprefix.router.hashing import RouteRequest
from kvprefix.router.ray.asgi import call_asgi

REPLICA_HEADER = "x-kvprefix-replica"


@serve.deployment
class Engine:
    """One engine replica: an AsyncLLM behind `kvprefix serve`'s app, both made by ``make_replica(engine_args,
    config)`` (``kvprefix.cli.engine_replica``: the router imports neither the engine nor the server; Ray pickles the
    function by name and the replica imports them). Every answer names the replica."""

    async def __init__(self, make_replica: Callable[[dict[str, Any], Any], tuple[Any, Any]],
                       engine_args: dict[str, Any], config: Any):
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.engine, self.app = make_replica(engine_args, dataclasses.replace(config, replica_id=self.replica_id))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()

    def block_identity(self) -> tuple[Any, Any, int, list[Any]]:
        """What the ingress needs to hash prompts as this replica does: its tokenizer, ``BlockIdentity`` and context
        length (a hasher does not pickle); and where it holds blocks (``kv_media``: its tiers and their load costs,
        for `prefix`, which follows no event stream)."""
        return self.engine.tokenizer, self.engine.identity, self.engine.max_sequence_tokens, self.engine.kv_media()

    async def handle(self, method: str, path: str, query: bytes, headers: list[tuple[str, str]], body: bytes,
                     route: RouteRequest | None, exclude: tuple[str, ...] | None = None,
                     forget: tuple[tuple[str, int], ...] = ()) -> AsyncIterator[Any]:
        # ``route``, ``exclude`` and ``forget`` are for the request router (it reads the call's kwargs); the
        # replica has no use for them.
        async for item in call_asgi(self.app, method, path, query, headers, body):
            if isinstance(item, tuple):
                status, response_headers = item
                item = status, [*response_headers, (REPLICA_HEADER, self.replica_id)]
            yield item

    async def __del__(self):
        await self._lifespan.__aexit__(None, None, None)
