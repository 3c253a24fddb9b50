"""`kvprefix serve`: the OpenAI-compatible server. Light at import; the engine and web stack load in run()."""

from __future__ import annotations

import argparse
import dataclasses
import json

from kvprefix.cache import COLLISION_SAFE_ALGOS, HASH_ALGOS
from kvprefix.cache.default_model import DEFAULT_MODEL_NAME
from kvprefix.engine.args import DEFAULT_KV_DISK_SIZE, QUANTIZATION_CHOICES
from kvprefix.engine.sampling_params import MAX_LOGPROBS
from kvprefix.paths import ReadableFile, WritableDir, WritableFile, fraction, positive_float, positive_int
from kvprefix.tiers.redis_store import DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT
from kvprefix.tiers.retention import RETENTIONS
from kvprefix.tiers.sizes import size_argument
from kvprefix.tokenizer import chat_template

# The KV cache fraction shared out as tenants' reserved room when there are tenants (docs/security.md): half stays
# shared LRU room for whoever is busy; the other half is what idle tenants are owed and others cannot cache in.
DEFAULT_TENANT_KV_RESERVE = 0.5


def _add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    tier = parser.add_argument_group("persistent KV tier (docs/tiers.md)")
    tier.add_argument("--kv-disk", default=None, metavar="DIR", action=WritableDir,
                      help="keep computed blocks' KV in DIR (verified on load): cached prefixes survive restarts")
    tier.add_argument("--kv-disk-size", type=size_argument, default=DEFAULT_KV_DISK_SIZE, metavar="SIZE",
                      help=f"with --kv-disk: its byte budget, least recently used blocks deleted past it "
                           f"(e.g. 20GiB, 500MB; default {DEFAULT_KV_DISK_SIZE})")
    tier.add_argument("--kv-disk-queue", type=positive_int, default=256, metavar="BLOCKS",
                      help="with --kv-disk: blocks waiting to be written; past it writes are dropped (counted)")
    tier.add_argument("--kv-retention", default=None, choices=RETENTIONS,
                      help="with --kv-disk: what a request that asks for no retention gets (prompt_cache_retention, "
                           "cache_control.ttl): in_memory = never written below the pool; 5m, 1h, 24h = written and "
                           "kept at least that long (default: written, least recently used deleted first)")
    tier.add_argument("--kv-retention-budget", type=size_argument, default=None, metavar="SIZE",
                      help="with --kv-disk: bytes of retained blocks each tenant may hold; a request past it gets "
                           "400 (default: half of --kv-disk-size)")
    shared = parser.add_argument_group("shared KV tier on Redis (docs/tiers.md)")
    shared.add_argument("--kv-shared", default=None, metavar="URL",
                        help="redis://[:password@]HOST:PORT/DB (rediss:// for TLS): blocks every replica on that "
                             "Redis reads and writes, so a prefix is computed once per fleet; Redis down or slow is "
                             "a miss, never an error. Set maxmemory and maxmemory-policy allkeys-lru on it")
    shared.add_argument("--kv-shared-timeout", type=positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                        help=f"with --kv-shared: the longest one call to Redis may take before it is a miss "
                             f"(default {DEFAULT_TIMEOUT})")
    shared.add_argument("--kv-shared-prefix", default=DEFAULT_KEY_PREFIX, metavar="PREFIX",
                        help=f"with --kv-shared: the prefix of every key written (default {DEFAULT_KEY_PREFIX!r})")


def _lora_module(text: str) -> tuple[str, str, str | None]:
    """vLLM's two forms: NAME=PATH, or JSON {"name": ..., "path": ..., "base_model_name": ...} (the base optional)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
        name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name")
        if not (isinstance(name, str) and name and isinstance(path, str) and path) or \
                not (base is None or isinstance(base, str)) or set(spec) - {"name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(f'expected {{"name": NAME, "path": PATH, "base_model_name": BASE}} '
                                             f"(base_model_name optional), got {text!r}")
        return name, path, base
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH (an adapter name and its PEFT directory), got {text!r}")
    return name, path, None


def _add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument("--enable-lora", action="store_true",
                      help="serve PEFT LoRA adapters on the base model; a request's \"model\" picks one, and each "
                           "adapter's prefix cache is its own")
    lora.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None, metavar="NAME=PATH",
                      help="adapters to load at start, as NAME=PATH or vLLM's JSON {\"name\": ..., \"path\": ..., "
                           "\"base_model_name\": ...} (more load at run time: POST /v1/load_lora_adapter)")
    lora.add_argument("--max-loras", type=positive_int, default=1,
                      help="most adapters in one engine step (requests of another adapter wait; default 1)")
    lora.add_argument("--max-lora-rank", type=positive_int, default=16,
                      help="largest adapter rank accepted (default 16)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _server_arguments(parser)
    _tenancy_and_log_arguments(parser)
    _add_tier_arguments(parser)
    _add_lora_arguments(parser)
    _engine_arguments(parser)


def _server_arguments(parser: argparse.ArgumentParser) -> None:
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                     help="comma-separated Host names (any port) to serve, * for any; a cross-site browser Origin "
                          "must be one of them (default: localhost, 127.0.0.1, ::1 when bound to loopback, else any "
                          "Host and same-origin browsers only)")
    net.add_argument("--served-model-name", default=None, help="model id clients send (default: the model's name)")
    net.add_argument("--max-pending", type=int, default=256,
                     help="engine requests admitted at once (queued or running); more get 503 at once")
    net.add_argument("--max-pending-per-tenant", type=int, default=None,
                     help="engine requests one tenant may have pending; more get 429 (default: no per-tenant limit)")
    net.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds to let in-flight requests finish on SIGTERM/SIGINT before aborting them")
    net.add_argument("--timeout-keep-alive", type=positive_float, default=5.0,
                     help="seconds a connection may stay idle after a response before it is closed (default 5)")
    net.add_argument("--timeout-headers", type=positive_float, default=20.0,
                     help="seconds a client has to send a request's headers, from connecting or from the previous "
                          "response; then the connection is closed (default 20)")
    net.add_argument("--timeout-body", type=positive_float, default=60.0,
                     help="seconds a client has to send a request's body once its headers are in (default 60)")
    net.add_argument("--limit-concurrency", type=positive_int, default=512,
                     help="open connections at most; a request on one more gets 503 at once (default 512)")
    net.add_argument("--metrics-names", default="kvprefix", choices=["kvprefix", "vllm"],
                     help="vllm: expose vLLM's metric names (vllm:*), so its dashboards and the Gateway API Inference "
                     "Extension read them (docs/metrics.md)")
    net.add_argument("--max-logprobs", type=int, default=MAX_LOGPROBS, metavar="K",
                     help="most alternatives per token a request may ask for in logprobs, top_logprobs or "
                          "prompt_logprobs (vLLM's option; -1: no limit, and prompt_logprobs -1 is allowed)")
    net.add_argument("--return-tokens-as-token-ids", action="store_true",
                     help="logprob tokens as 'token_id:N' unless a request says otherwise (vLLM's option)")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    net.add_argument("--replica-id", default=None,
                     help="this replica's name in KV events and the request log (default: HOSTNAME:PORT)")



def _tenancy_and_log_arguments(parser: argparse.ArgumentParser) -> None:
    sec = parser.add_argument_group("tenancy and admin (docs/security.md)")
    sec.add_argument("--api-key", default=None, help="one API key; its callers form the tenant 'default'")
    sec.add_argument("--api-keys-file", default=None, action=ReadableFile,
                     help='JSON object {"<key>": "<tenant>"}: each tenant gets its own cache salt')
    sec.add_argument("--admin-key", default=None,
                     help="key for POST /reset_prefix_cache, /flush_cache and GET /metrics")
    sec.add_argument("--no-cache-detail", dest="cache_detail", action="store_false",
                     help="refuse the per-request cache_detail extension")
    sec.add_argument("--tenant-kv-reserve", type=fraction, default=None, metavar="FRACTION",
                     help="KV cache fraction shared out as tenants' reserved room, so that one tenant cannot see "
                          f"another's traffic in its own evictions; 0 = one LRU for all (default: "
                          f"{DEFAULT_TENANT_KV_RESERVE} with keys, else 0)")

    logs = parser.add_argument_group("request log (docs/request-log.md)")
    logs.add_argument("--request-log", default=None, metavar="PATH", action=WritableFile, help="append one JSON line per prompt")
    logs.add_argument("--request-log-prompts", action="store_true",
                      help="also log raw prompt text (off by default: prompts may hold private data)")



def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    eng = parser.add_argument_group("engine")
    eng.add_argument("--model", default=None,
                     help="checkpoint directory, .gguf file or hub id (default: the built-in SmolLM2-135M-Instruct)")
    eng.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    eng.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_CHOICES,
                     help="CPU: weight-only int8 (per channel), int4 (groups of 32), gguf (a .gguf model's own "
                          "blocks) or none (dense); default: a quantized .gguf file's own blocks on a CPU with "
                          "VNNI and bfloat16 matmuls, else dense (docs/model.md)")
    eng.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    eng.add_argument("--cpu-threads", type=positive_int, default=None,
                     help="threads for the CPU ops (default: OMP_NUM_THREADS, else physical cores - 1; "
                          "docs/model.md#cpu-threads)")
    eng.add_argument("--deterministic", action="store_true",
                     help="batch-invariant numerics: a token's KV, logits and logprobs never depend on batching, "
                          "chunking or cache hits (slower; docs/determinism.md)")
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument("--block-size", type=int, default=16, help="tokens per KV block: the minimum shareable prefix")
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    eng.add_argument("--prefix-caching-hash-algo", default="sha256", choices=HASH_ALGOS)
    eng.add_argument("--max-num-seqs", type=int, default=64)
    eng.add_argument("--max-num-batched-tokens", type=int, default=2048)
    eng.add_argument("--max-model-len", type=int, default=None)
    eng.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks to allocate (overrides memory sizing)")
    eng.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache budget in bytes")
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--share-inflight-prefixes", action=argparse.BooleanOptionalAction, default=True,
                     help="a request whose prompt blocks a running request is computing waits for them and hits")
    eng.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "cache_aware"],
                     help="admission order: arrival, or most cached prompt tokens first (with --max-wait-steps)")
    eng.add_argument("--max-wait-steps", type=positive_int, default=100,
                     help="cache_aware: a request waiting this many engine steps is admitted before cached ones")
    chat_template.add_arguments(parser.add_argument_group("chat template (docs/server.md#chat-template)"))


def prepare(args: argparse.Namespace):
    """Checks the options (a bad one fails in a moment, before torch loads) and returns the engine's arguments and
    the server's config, for one server (``run``) or for every replica of a Ray deployment."""
    import logging
    import socket

    from kvprefix.http.browsers import allowed_hosts
    from kvprefix.http.tenancy import Auth

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        auth = Auth.from_options(args.api_key, args.api_keys_file, args.admin_key)
        hosts = allowed_hosts(args.allowed_hosts, args.host)
    except ValueError as exc:
        raise SystemExit(f"kvprefix serve: {exc}") from None
    if auth.enabled and args.prefix_caching_hash_algo not in COLLISION_SAFE_ALGOS:
        # A crafted prompt that collides with another tenant's block hash would be served that block's KV.
        raise SystemExit(f"kvprefix serve: with API keys (tenants), --prefix-caching-hash-algo must be collision "
                         f"resistant: one of {', '.join(COLLISION_SAFE_ALGOS)}")
    if args.tenant_kv_reserve is None:
        args.tenant_kv_reserve = DEFAULT_TENANT_KV_RESERVE if auth.enabled else 0.0
    if args.kv_disk:
        from kvprefix.tiers.disk_layout import prepare as prepare_disk

        try:  # a path that is a file or cannot be written fails now, in one line, not after the model loads
            args.kv_disk = prepare_disk(args.kv_disk)
        except ValueError as exc:
            raise SystemExit(f"kvprefix serve: {exc}") from None
    if args.kv_shared:
        _check_shared(args, auth.enabled)
    if args.lora_modules is not None:
        _check_lora_modules(args)
    from kvprefix.engine import EngineArgs
    # Every engine option we expose has EngineArgs' field name; a field without an option keeps its default.
    engine_args = EngineArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs)
                                if hasattr(args, f.name)})
    return engine_args, server_config(args, auth, hosts, args.replica_id or f"{socket.gethostname()}:{args.port}")


def _check_lora_modules(args: argparse.Namespace) -> None:
    """--lora-modules as EngineArgs takes them (name -> path), after the checks only the whole list allows."""
    names = [name for name, _, _ in args.lora_modules]
    if not args.enable_lora:
        raise SystemExit("kvprefix serve: --lora-modules needs --enable-lora")
    if len(set(names)) < len(names):
        raise SystemExit(f"kvprefix serve: --lora-modules names an adapter twice: {', '.join(names)}")
    served = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    for name, _, base in args.lora_modules:
        if base is not None and base != served:
            raise SystemExit(f"kvprefix serve: --lora-modules: adapter {name!r} names base_model_name {base!r}, "
                             f"but this server serves {served!r}")
    args.lora_modules = {name: path for name, path, _ in args.lora_modules}


def server_config(args: argparse.Namespace, auth, hosts: frozenset[str] | None, replica_id: str):
    """The ``ServerConfig`` of parsed options (the one mapping from options to it: ``prepare`` and the tests' apps)."""
    from kvprefix.server.app import ServerConfig

    return ServerConfig(
        served_model_name=args.served_model_name,
        auth=auth,
        max_pending=args.max_pending,
        max_pending_per_tenant=args.max_pending_per_tenant,
        request_log=args.request_log,
        request_log_prompts=args.request_log_prompts,
        cache_detail=args.cache_detail,
        replica_id=replica_id,
        allowed_hosts=hosts,
        metrics_names=args.metrics_names,
        max_logprobs=args.max_logprobs,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
    )


def _check_shared(args: argparse.Namespace, tenants: bool) -> None:
    """A ``--kv-shared`` that cannot be used fails now, in one line. With tenants, a Redis without a password off
    this machine would let anyone who reaches it read and write every tenant's blocks: refused (fail closed)."""
    from kvprefix.tiers.redis_store import parse_url, redis_module

    try:
        url = parse_url(args.kv_shared)
        redis_module()
    except ValueError as exc:
        raise SystemExit(f"kvprefix serve: {exc}") from None
    if tenants and not url.has_password and not url.loopback:
        raise SystemExit(f"kvprefix serve: --kv-shared {url.redacted} has no password and is not on loopback: with "
                         f"API keys (tenants) anyone reaching it could read and write every tenant's blocks; put a "
                         f"password in the URL (docs/security.md)")


def run(args: argparse.Namespace) -> int:
    engine_args, config = prepare(args)
    from kvprefix.engine import AsyncLLM
    from kvprefix.engine.cpu_threads import serving_threads

    engine_args = dataclasses.replace(engine_args, cpu_threads=serving_threads(engine_args.cpu_threads))
    from kvprefix.http.connections import timed_protocol
    from kvprefix.http.launch import run_server
    from kvprefix.server.app import create_app

    try:  # a checkpoint that cannot be loaded (missing, truncated, unsupported) is a one-line error
        engine = AsyncLLM(engine_args)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"kvprefix serve: {exc}") from None
    app = create_app(engine, config)
    # Until SIGINT/SIGTERM; then the server's drain (app.state.drain) lets requests in flight finish, uvicorn's
    # own deadline only backing it up.
    run_server(app, args.host, args.port, log_level=args.log_level,
               http=timed_protocol(args.timeout_headers, args.timeout_body),
               timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
               on_shutdown=lambda: app.state.drain(args.shutdown_timeout),
               graceful_timeout_s=args.shutdown_timeout + 10)
    return 0
