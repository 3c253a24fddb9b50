"""The FastAPI application: routes, body parsing, auth, admin endpoints, start-up log and shutdown."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Query, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError

from kvprefix.engine import LoraNotFoundError
from kvprefix.engine.client import EngineClient
from kvprefix.engine.sampling_params import MAX_LOGPROBS
from kvprefix.http.bodies import read_body
from kvprefix.http.browsers import BrowserGuard
from kvprefix.http.errors import APIError, bad_request, from_validation_error, install_error_handlers
from kvprefix.http.metrics import metrics_response
from kvprefix.http.request_ids import RequestIdMiddleware
from kvprefix.http.tenancy import Auth, Caller
from kvprefix.logs import RequestLogWriter
from kvprefix.server.admission import Admission
from kvprefix.server.cache_detail import CacheTracker
from kvprefix.server.kv_events import add_kv_event_routes
from kvprefix.server.metrics import ServerMetrics
from kvprefix.server.model_info import ModelInfo
from kvprefix.server.models import ServedModels
from kvprefix.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
)
from kvprefix.server.serving import Serving

log = logging.getLogger("kvprefix.server")


@dataclass
class ServerConfig:
    """Server settings that are not engine settings."""

    served_model_name: str | None = None
    auth: Auth | None = None
    max_pending: int = 256
    max_pending_per_tenant: int | None = None
    request_log: str | None = None
    request_log_prompts: bool = False
    cache_detail: bool = True  # whether the opt-in per-request diagnosis may be asked for at all
    replica_id: str = "replica-0"  # names this replica in KV events and the request log
    allowed_hosts: frozenset[str] | None = None  # Host names served (browsers.py); None: any, same-origin only
    metrics_names: str = "kvprefix"  # "vllm": vLLM's metric names (docs/metrics.md)
    max_logprobs: int = MAX_LOGPROBS  # vLLM's --max-logprobs
    return_tokens_as_token_ids: bool = False  # vLLM's --return-tokens-as-token-ids


_PARSE_INLINE_BYTES = 256 * 1024


async def _parse(raw: Request, model: type[BaseModel]) -> Any:
    """Reads and validates a JSON body, turning every way it can be wrong into a 400 that says what is wrong."""
    return await _validate(await _body_text(raw), model)


async def _body_text(raw: Request) -> str:
    body = await read_body(raw)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (invalid byte at offset {exc.start})") from None
    if not text.strip():
        raise bad_request("request body is empty; send a JSON object")
    return text


async def _validate(text: str, model: type[BaseModel]) -> Any:
    try:
        if len(text) < _PARSE_INLINE_BYTES:
            return model.model_validate_json(text)
        # Large bodies validate off the event loop, so streams keep flowing.
        return await asyncio.to_thread(model.model_validate_json, text)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


def _body_keys(text: str) -> set[str]:
    """The top-level keys of a JSON object body, to pick its model (empty when it is not one: validation says how)."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError):
        return set()
    return set(body) if isinstance(body, dict) else set()


def _log_startup(engine: EngineClient, info: ModelInfo, config: ServerConfig) -> None:
    num_blocks = engine.num_kv_blocks
    log.info("serving model %s (max_model_len %d tokens)", info.name, info.max_model_len)
    if engine.uses_default_model:
        log.info("the built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF); --model serves another")
    # dtype, then the compact method where there is one: "bfloat16+gguf+a8" runs a GGUF file's own blocks.
    log.info("weights and KV: %s (--dtype; --quantization, none for dense weights)", engine.identity.context.kv_dtype)
    log.info(
        "prefix cache: %s, block size %d tokens (the minimum shareable prefix; only full blocks are cached), "
        "%d blocks = %d tokens of KV, hash %s",
        "on" if info.enable_prefix_caching else "OFF", info.block_size, num_blocks,
        num_blocks * info.block_size, info.hash_algo,
    )
    auth = config.auth or Auth()
    log.info("tenancy: %s; request log: %s; max pending requests %d (per tenant: %s)",
             f"{auth.num_tenants} tenant(s), cache salted per tenant" if auth.enabled
             else "off (one shared cache namespace)",
             config.request_log or "off", config.max_pending, config.max_pending_per_tenant or "no limit")
    if not auth.enabled and not auth.has_admin_key:
        log.warning("no API keys: the admin endpoints (cache reset, KV events, /metrics) are open to anyone who can "
                    "reach this server; see docs/security.md")


def _openapi(app: FastAPI) -> dict:
    """The generated schema, plus the request bodies that we parse ourselves (for clients and fuzzers)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    app.openapi_schema = schema
    return schema


@dataclass
class _Parts:
    """What the routes share: the engine client and the server's own state around it."""

    engine: EngineClient
    config: ServerConfig
    auth: Auth
    info: ModelInfo
    metrics: ServerMetrics
    admission: Admission
    tracker: CacheTracker | None
    request_log: RequestLogWriter | None
    serving: Serving

    def tenant(self, raw: Request) -> str | None:
        return self.auth.tenant(raw.headers.get("authorization"))


def create_app(engine: EngineClient, config: ServerConfig | None = None) -> FastAPI:
    """An app serving ``engine`` (an AsyncLLM). Shutting the app down shuts the engine down."""
    parts = _parts(engine, config or ServerConfig())

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        unsubscribe = engine.subscribe_kv_events(parts.tracker.on_event) if parts.tracker is not None else None
        _log_startup(engine, parts.info, parts.config)
        try:
            yield
        finally:
            parts.admission.closing = True
            if unsubscribe is not None:
                unsubscribe()
            await engine.shutdown()
            if parts.request_log is not None:
                parts.request_log.close()

    app = FastAPI(title="kvprefix", version="0.1.0", lifespan=lifespan)
    app.openapi = lambda: _openapi(app)
    install_error_handlers(app)
    app.add_middleware(BrowserGuard, allowed_hosts=parts.config.allowed_hosts)
    app.add_middleware(RequestIdMiddleware)  # outermost: the guard's refusals carry the id too
    app.state.drain = lambda timeout: _drain(engine, parts.admission, timeout)
    _add_info_routes(app, parts)
    _add_generation_routes(app, parts)
    _add_admin_routes(app, parts)
    add_kv_event_routes(app, engine, parts.auth, parts.config.replica_id)
    return app


def _parts(engine: EngineClient, config: ServerConfig) -> _Parts:
    name = config.served_model_name or engine.model_name
    info = ModelInfo.of(engine, name, config.replica_id, config.max_logprobs, config.return_tokens_as_token_ids)
    cache_config = {"block_size": str(info.block_size), "enable_prefix_caching": str(info.enable_prefix_caching),
                    "num_gpu_blocks": str(engine.num_kv_blocks), "prefix_caching_hash_algo": info.hash_algo}
    metrics = ServerMetrics(name, engine.get_metrics, config.metrics_names, cache_config, info.max_model_len,
                            read_lora=lambda: engine.lora_activity)
    labels = metrics.labels()
    admission = Admission(config.max_pending, config.max_pending_per_tenant,
                          on_reject=lambda reason: metrics.rejected.labels(*labels, reason).inc())
    metrics.in_flight.labels(*labels).set_function(lambda: admission.pending)
    # The tracker mirrors every cached block (tokens included): only when cache detail may be asked for.
    tracker = CacheTracker(engine.hasher, enabled=info.enable_prefix_caching) if config.cache_detail else None
    request_log = RequestLogWriter(config.request_log, config.request_log_prompts,
                                   on_error=metrics.request_log_errors.labels(*labels).inc) if config.request_log else None
    serving = Serving(engine, info, admission, metrics, tracker, request_log,
                      ServedModels(engine, name, info.max_model_len))
    return _Parts(engine, config, config.auth or Auth(), info, metrics, admission, tracker, request_log, serving)


def _add_info_routes(app: FastAPI, parts: _Parts) -> None:
    """Health, version, models, /tokenize and /detokenize."""
    engine, serving, tenant = parts.engine, parts.serving, parts.tenant

    @app.get("/health")
    async def health() -> Response:
        if engine.errored or not engine.is_running:
            return APIError(503, "the engine is not running", type="server_error").response()
        return Response(status_code=200)

    @app.get("/ping")
    @app.post("/ping")
    async def ping() -> Response:
        """vLLM's (and SageMaker's) liveness path: the same answer as /health."""
        return await health()

    @app.get("/version")
    async def version(raw: Request) -> dict:
        tenant(raw)
        return {"version": app.version}

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        tenant(raw)
        text = await _body_text(raw)
        chat = _body_keys(text) & {"messages"}
        return await serving.tokenize(await _validate(text, TokenizeChatRequest if chat else TokenizeCompletionRequest))

    @app.get("/tokenizer_info")
    async def tokenizer_info(raw: Request) -> dict:
        """vLLM's: what a client needs to tokenize as the server does (its class, template and special tokens)."""
        tenant(raw)
        tok = engine.tokenizer
        return {"tokenizer_class": type(tok.hf if tok.hf is not None else tok).__name__,
                "chat_template": tok.chat_template, "model_max_length": parts.info.max_model_len,
                "vocab_size": parts.info.vocab_size, "bos_token_id": tok.bos_token_id,
                "eos_token_ids": sorted(tok.eos_token_ids), "added_tokens": tok.added_tokens}

    @app.get("/load")
    async def load(raw: Request) -> dict:
        """vLLM's server load: the engine requests admitted and not finished (queued or running)."""
        tenant(raw)
        return {"server_load": parts.admission.pending}

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        tenant(raw)
        return await serving.detokenize(await _parse(raw, DetokenizeRequest))

    served = serving.models

    def lister(raw: Request) -> None:
        """Tenants, and the admin (a router learning the adapters it must hash for), may list the models."""
        try:
            tenant(raw)
        except APIError as exc:
            try:
                parts.auth.check_admin(raw.headers.get("authorization"))
            except APIError:
                raise exc from None

    @app.get("/v1/models")
    async def models(raw: Request) -> dict:
        lister(raw)
        return {"object": "list", "data": served.cards()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, raw: Request) -> dict:
        lister(raw)
        return served.card(model_id)


def _add_generation_routes(app: FastAPI, parts: _Parts) -> None:
    serving, tenant = parts.serving, parts.tenant

    def check_detail(req: CompletionRequest | ChatCompletionRequest) -> None:
        if req.cache_detail and not parts.config.cache_detail:
            raise bad_request("'cache_detail' is disabled on this server", param="cache_detail")

    async def generate(raw: Request, who: str | None, text: str, chat: bool):
        req = await _validate(text, ChatCompletionRequest if chat else CompletionRequest)
        check_detail(req)
        return await (serving.chat if chat else serving.completions)(req, Caller(who, req.cache_salt), raw)

    @app.post("/v1/completions")
    async def completions(raw: Request):
        who = tenant(raw)  # authentication first: an unknown caller learns nothing from validation errors
        return await generate(raw, who, await _body_text(raw), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        who = tenant(raw)
        return await generate(raw, who, await _body_text(raw), chat=True)

    @app.post("/invocations")
    async def invocations(raw: Request):
        """SageMaker's (and vLLM's) one path: a chat body (``messages``) or a completions body (``prompt``)."""
        who = tenant(raw)
        text = await _body_text(raw)
        keys = _body_keys(text)
        if not keys & {"messages", "prompt"}:
            raise bad_request("an /invocations body needs 'messages' (chat completions) or 'prompt' (completions)",
                              param="messages")
        return await generate(raw, who, text, chat="messages" in keys)


def _add_admin_routes(app: FastAPI, parts: _Parts) -> None:
    """/metrics and the cache reset (under vLLM's and SGLang's names)."""
    auth = parts.auth

    @app.get("/metrics")
    async def metrics_endpoint(raw: Request) -> Response:
        return metrics_response(auth, raw, parts.metrics.render)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request, wait: bool = False,
                                 timeout: float = Query(30.0, ge=0.0, le=600.0)) -> JSONResponse:
        """vLLM's name. Refused (409) while requests hold blocks, unless ``wait`` drains them first."""
        auth.check_admin(raw.headers.get("authorization"))
        return await _reset(parts.engine, parts.admission, wait, timeout)

    @app.post("/flush_cache")
    async def flush_cache(raw: Request, wait: bool = False,
                          timeout: float = Query(30.0, ge=0.0, le=600.0)) -> JSONResponse:
        """SGLang's name for the same operation."""
        auth.check_admin(raw.headers.get("authorization"))
        return await _reset(parts.engine, parts.admission, wait, timeout)

    _add_lora_routes(app, parts)


def _add_lora_routes(app: FastAPI, parts: _Parts) -> None:
    """vLLM's run-time adapter loading (``--enable-lora``), admin only: they change what every tenant is served."""
    auth, engine = parts.auth, parts.engine

    async def lora_body(raw: Request, need_path: bool) -> Any:
        auth.check_admin(raw.headers.get("authorization"))
        if not engine.enable_lora:
            raise bad_request("LoRA is off: start the server with --enable-lora to load adapters")
        return await _parse(raw, LoadLoRAAdapterRequest if need_path else UnloadLoRAAdapterRequest)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request) -> Response:
        body = await lora_body(raw, need_path=True)
        name, path = body.lora_name, body.lora_path
        if name == parts.info.name:
            raise bad_request(f"'{name}' is the base model's name; choose another lora_name", param="lora_name")
        try:
            await engine.load_lora_adapter(name, path, body.load_inplace)
        except ValueError as exc:
            raise bad_request(str(exc), param="lora_path") from None
        log.info("loaded LoRA adapter %s from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request) -> Response:
        name = (await lora_body(raw, need_path=False)).lora_name
        try:
            await engine.unload_lora_adapter(name)
        except LoraNotFoundError as exc:
            raise APIError(404, str(exc), param="lora_name", type="NotFoundError") from None
        log.info("unloaded LoRA adapter %s", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


async def _reset(engine: EngineClient, admission: Admission, wait: bool, timeout: float) -> JSONResponse:
    start = time.monotonic()
    ok = await engine.reset_prefix_cache()
    if not ok and wait:
        async with admission.drained(timeout) as idle:
            # The engine frees a request's blocks just before its last output; retry briefly to be safe.
            while idle:
                ok = await engine.reset_prefix_cache()
                if ok or time.monotonic() - start >= timeout:
                    break
                await asyncio.sleep(0.02)
    waited = round(time.monotonic() - start, 3)
    if ok:
        return JSONResponse({"success": True, "waited_s": waited})
    running = admission.running
    hint = f"still running after waiting {timeout:g} s" if wait else "running; retry with ?wait=true&timeout=30"
    return APIError(409, f"prefix cache not reset: {running} request(s) {hint}", type="conflict_error",
                    code="requests_running").response()


async def _drain(engine: EngineClient, admission: Admission, timeout: float) -> None:
    """Shutdown: refuse new requests, let running ones finish for ``timeout`` s, then abort the rest through the
    engine, so that their streams end in-band (finish_reason "abort", then [DONE]) instead of being cut off."""
    admission.closing = True
    deadline = time.monotonic() + timeout
    while admission.running and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if admission.running:
        log.warning("shutdown: aborting %d request(s) still running after %g s", admission.running, timeout)
        await engine.shutdown()
