"""`kvprefix simulate`: replay a trace (or the seed example) on the real cache code.

This module stays light (argparse only); the replay machinery is imported inside ``run``.
"""

from __future__ import annotations

import argparse
import math
import sys

from kvprefix.cache.media import DEFAULT_LOAD_COST
from kvprefix.paths import ReadableFile, ReadablePath, WritableFile, fraction, positive_float, positive_int
from kvprefix.sim.formats import FORMATS
from kvprefix.sim.replay import DEFAULT_KV_BYTES_PER_TOKEN, MODES, ROUTINGS
from kvprefix.tiers.sizes import size_argument
from kvprefix.tokenizer import chat_template


def _sizes(text: str) -> list[float]:
    """Comma-separated sizes like 1e5,3e6; 'inf' or 'unbounded' for no limit."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("inf", "unbounded"):
            out.append(math.inf)
            continue
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected sizes like 1e6,3e6 or 'unbounded', got {part!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"sizes must be > 0, got {part!r}")
        out.append(value)
    return out


def _int_list(text: str) -> list[int]:
    return [positive_int(p.strip()) for p in text.split(",")]


def _routing_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",")]
    for name in names:
        if name not in ROUTINGS:
            raise argparse.ArgumentTypeError(f"unknown routing {name!r}; choose from {', '.join(ROUTINGS)}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "trace", nargs="?", action=ReadableFile, help="trace file (JSONL): Mooncake rows, a kvprefix request log, or OpenAI request bodies"
    )
    parser.add_argument("--example", choices=["seed"], help="run a built-in example instead of a trace")
    _trace_arguments(parser.add_argument_group("trace"))
    _fleet_arguments(parser)
    _timing_and_output_arguments(parser)


def _trace_arguments(t) -> None:
    t.add_argument("--format", choices=FORMATS, default="auto", help="trace format (default: from the first row)")
    t.add_argument(
        "--trace-block-size",
        type=positive_int,
        help="block size the trace's ids were made with "
        "(Mooncake: from a '_bs16' file name, else 512; request log: each row's block_size)",
    )
    t.add_argument(
        "--block-size",
        type=positive_int,
        help="block size to replay at, a multiple of the trace's (default: the trace's own; for OpenAI bodies "
        "the --identity's, else 16)",
    )
    t.add_argument("--tokenizer", action=ReadablePath,
                   help="local Hugging Face tokenizer directory or GGUF file (OpenAI request bodies)")
    t.add_argument("--identity", metavar="URL|FILE",
                   help="OpenAI request bodies: hash under a replica's block identity, from its base URL or a JSON "
                        "file of its /v1/models listing (default: the --tokenizer checkpoint's own, float32, sha256)")
    chat_template.add_arguments(t)  # OpenAI request bodies: render as the replicas do


def _fleet_arguments(parser: argparse.ArgumentParser) -> None:
    c = parser.add_argument_group("cache and fleet (comma-separated lists make a sweep)")
    size = c.add_mutually_exclusive_group()
    size.add_argument(
        "--capacity", type=_sizes, help="KV capacity per replica in tokens, e.g. 1e6,3e6,1e7 (default: unbounded)"
    )
    size.add_argument("--capacity-blocks", type=_sizes, help="KV capacity per replica in blocks")
    c.add_argument("--replicas", type=_int_list, default=[1], help="number of replicas (default 1)")
    c.add_argument(
        "--routing",
        type=_routing_list,
        default=["round-robin"],
        help=f"{', '.join(ROUTINGS)} (default round-robin; 'shared' = one pool of replicas x capacity)",
    )
    c.add_argument(
        "--load-cap",
        type=float,
        default=1.25,
        help="session, prefix, kv-events: pass over replicas above this x the mean load (default 1.25)",
    )
    c.add_argument("--seed", type=int, default=0, help="seed of the random routing (default 0)")
    c.add_argument("--disk-capacity", type=size_argument, default=None, metavar="BYTES",
                   help="a disk tier of this many bytes below each replica's pool (e.g. 20GiB; as kvprefix serve "
                        "--kv-disk-size), reporting the hit rate per tier: pool, disk, miss (default: none)")
    c.add_argument("--shared-capacity", type=size_argument, default=None, metavar="BYTES",
                   help="one shared tier of this many bytes below every replica's pool (as kvprefix serve --kv-shared "
                        "on a Redis of that maxmemory), reporting its hit rate beside the pool's (default: none)")
    c.add_argument("--kv-bytes-per-token", type=positive_int, default=DEFAULT_KV_BYTES_PER_TOKEN, metavar="BYTES",
                   help="a block's size in a tier per token (default "
                        f"{DEFAULT_KV_BYTES_PER_TOKEN:,}: the default model's KV in bfloat16)")
    for tier in ("disk", "shared"):
        c.add_argument(f"--{tier}-load-cost", type=fraction, default=DEFAULT_LOAD_COST, metavar="BLOCKS",
                       help=f"blocks of prefill time one block loaded from the {tier} tier costs: timed mode's prefill "
                            f"time and the routing policies' credit (default {DEFAULT_LOAD_COST}, what a replica "
                            "announces until it has measured it)")


def _timing_and_output_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("timing")
    m.add_argument(
        "--mode",
        choices=MODES,
        default="timed",
        help="timed: requests hold blocks while they run (default); order: only request order matters "
        "(as published simulations)",
    )
    m.add_argument(
        "--prefill-tps",
        type=positive_float,
        default=10_000.0,
        help="prefill throughput per replica, tokens/s, for durations and the TTFT estimate (default 10000)",
    )
    m.add_argument(
        "--decode-tps", type=positive_float, default=50.0, help="decode speed per request, tokens/s (default 50)"
    )
    o = parser.add_argument_group("output")
    o.add_argument("--json", action=WritableFile, help="write the summaries as JSON to this path")
    o.add_argument("--plot", action=WritableFile, help="write a PNG of hit rate vs capacity, one line per routing, to this path")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    if args.example == "seed":
        from kvprefix.sim.seed_example import seed_report

        print("\n".join(seed_report()))
        return 0
    if not args.trace:
        return _fail("give a trace file, or --example seed")
    try:
        return _simulate(args)
    except (ValueError, OSError) as e:  # TraceError is a ValueError: bad input, not a bug
        return _fail(str(e))


def _simulate(args: argparse.Namespace) -> int:
    from kvprefix.sim.formats import load_trace
    from kvprefix.sim.replay import ReplayConfig
    from kvprefix.sim.report import format_table, plot_hit_rate, write_json
    from kvprefix.sim.sweep import sweep

    replica = None
    if args.identity:
        from kvprefix.sim.openai_bodies import read_replica_model

        replica = read_replica_model(args.identity)
    trace = load_trace(args.trace, args.format, args.block_size, args.trace_block_size, args.tokenizer, replica,
                       chat_template.from_arguments(args))
    if not trace.requests:
        return _fail(f"{args.trace}: the trace has no requests")
    bs = trace.block_size
    if args.capacity_blocks:
        capacities = [None if math.isinf(c) else int(c) for c in args.capacity_blocks]
    elif args.capacity:
        capacities = [None if math.isinf(c) else int(c) // bs for c in args.capacity]
    else:
        capacities = [None]
    if 0 in capacities:
        return _fail(f"a capacity is smaller than one {bs}-token block")
    base = ReplayConfig(
        capacity_blocks=None,
        mode=args.mode,
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        load_cap=args.load_cap,
        seed=args.seed,
        disk_capacity_bytes=args.disk_capacity,
        shared_capacity_bytes=args.shared_capacity,
        kv_bytes_per_token=args.kv_bytes_per_token,
        disk_load_cost=args.disk_load_cost,
        shared_load_cost=args.shared_load_cost,
    )
    summaries = sweep(trace, capacities, args.replicas, args.routing, base, progress=not args.no_progress)
    print(format_table(summaries))
    if args.json:
        write_json(summaries, args.json)
    if args.plot:
        plot_hit_rate(summaries, args.plot)
    return 0


def _fail(message: str) -> int:
    print(f"kvprefix simulate: error: {message}", file=sys.stderr)
    return 2
