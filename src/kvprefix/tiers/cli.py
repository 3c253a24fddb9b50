"""`kvprefix cache stats|verify|clear DIR`: inspect, check and empty a KV tier directory (docs/tiers.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from kvprefix.paths import ReadableDir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["stats", "verify", "clear"],
                        help="stats: bytes, blocks, namespaces; verify: a full checksum pass; clear: delete every "
                             "object at once")
    parser.add_argument("dir", action=ReadableDir, help="the tier directory (kvprefix serve --kv-disk DIR)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--delete", action="store_true", help="verify: delete the objects that do not verify")


def _progress() -> Callable[[int, int], None]:
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= 1.0 or done == total:
            last[0] = now
            print(f"\rverified {done}/{total} objects", end="\n" if done == total else "", file=sys.stderr,
                  flush=True)

    return report


def run(args: argparse.Namespace) -> int:
    from kvprefix.tiers import admin

    try:
        if args.action == "stats":
            result = admin.summary(args.dir)
            out = result.to_dict()
            text = [f"{result.bytes} bytes in {result.blocks} blocks ({result.unreadable} unreadable)",
                    *(f"namespace {ns}: {n} blocks" for ns, n in result.namespaces.most_common()),
                    *(f"model {m}: {n} blocks" for m, n in result.models.most_common()),
                    *(f"retained by tenant {t or '(no keys)'}: {n} blocks" for t, n in result.retained.most_common())]
            bad = False
        elif args.action == "verify":
            result = admin.verify(args.dir, args.delete, None if args.json else _progress())
            out = result.to_dict()
            text = [f"{result.ok} of {result.checked} objects verify ({result.bytes} bytes)",
                    *(f"{reason}: {n}" for reason, n in result.bad.most_common())]
            if args.delete:
                text.append(f"deleted {result.deleted}")
            bad = bool(result.bad)
        else:
            out = {"cleared": admin.clear(args.dir)}
            text, bad = [f"cleared {out['cleared']} objects"], False
    except (ValueError, OSError) as exc:
        raise SystemExit(f"kvprefix cache: {exc}") from None
    print(json.dumps(out) if args.json else "\n".join(text))
    return 1 if bad else 0
