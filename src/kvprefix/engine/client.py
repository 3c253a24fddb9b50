"""EngineClient: everything a server may ask of an engine. ``AsyncLLM`` implements it; the server's code is typed
against it and calls nothing else, so what crosses the engine -> server seam is written down in one place."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Protocol

from kvprefix.cache import BlockHasher, BlockIdentity, KVCacheEvent
from kvprefix.cache.media import Medium
from kvprefix.engine.beam_search import BeamSearchParams
from kvprefix.engine.lora_request import LoraActivity, LoraInfo, LoRARequest
from kvprefix.engine.outputs import RequestOutput, RequestOutputKind
from kvprefix.engine.sampling_params import SamplingParams
from kvprefix.tokenizer import Tokenizer

# Every block held as (hash, parent hash, namespace id, medium): the pool's and the tiers' (``cache.media``); a
# KV-event stream starts from them.
CacheSnapshot = list[tuple[bytes, bytes | None, str, str]]


class EngineClient(Protocol):
    # Fixed for the engine's lifetime.
    tokenizer: Tokenizer
    model_name: str
    uses_default_model: bool  # the built-in default model (no checkpoint was named)
    vocab_size: int
    max_sequence_tokens: int  # the longest prompt + output: the model's limit or the KV cache's, whichever is less
    identity: BlockIdentity  # what names its blocks: the KV-event hello and /v1/models carry it to routers
    hasher: BlockHasher  # identity.hasher(), unsalted; a namespace's chain is ``hasher.for_namespace(tenant, salt)``
    num_kv_blocks: int
    enable_prefix_caching: bool
    enable_lora: bool
    # Read on the event loop; the engine replaces each whole (never mutated in place).
    lora_adapters: dict[str, LoraInfo]  # the loaded LoRA adapters by name
    lora_activity: LoraActivity | None  # the adapters of running and waiting requests; None when LoRA is off

    @property
    def errored(self) -> bool: ...

    @property
    def is_running(self) -> bool: ...

    def generate(
        self,
        prompt: list[int],
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        cache_salt: str | None = None,
        tenant: str | None = None,
        *,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs until one has ``finished``; closing the stream early aborts the request. With
        ``lora_request`` (a loaded adapter's name, no path) it runs with that adapter, in its cache namespace. With
        ``BeamSearchParams`` one output, once the search is done, holds its best beams (vLLM's ``beam_search``)."""
        ...

    async def load_lora_adapter(self, name: str, path: str, inplace: bool = False) -> LoraInfo:
        """ValueError (one line) for a bad adapter or a name already loaded (unless ``inplace``: replaced)."""
        ...

    async def unload_lora_adapter(self, name: str) -> None:
        """``LoraNotFoundError`` for a name not loaded; running requests keep their adapter."""
        ...

    async def abort(self, request_id: str) -> None:
        """Frees the request's blocks before returning; its stream ends with finish_reason "abort"."""
        ...

    async def reset_prefix_cache(self) -> bool:
        """False (nothing changed) while requests hold blocks."""
        ...

    def get_metrics(self) -> dict[str, int | float]: ...

    def kv_media(self) -> list[Medium]:
        """Where the engine holds blocks (the pool, then its tiers), each with its capacity and load cost now."""
        ...

    def subscribe_kv_events(self, callback: Callable[[KVCacheEvent], None]) -> Callable[[], None]:
        """``callback`` runs on the engine thread; returns the unsubscribe function."""
        ...

    async def subscribe_kv_events_from_snapshot(
        self, on_snapshot: Callable[[CacheSnapshot], None], on_event: Callable[[KVCacheEvent], None]
    ) -> Callable[[], None]:
        """The blocks held now, then every change after it, each exactly once (the pool's on the engine thread, the
        tiers' on their threads: ``on_snapshot`` may be called once per source, ``on_event`` from any thread);
        returns the unsubscribe function."""
        ...

    async def shutdown(self) -> None:
        """Aborts every request (their streams end with finish_reason "abort") and stops the engine."""
        ...
