"""`kvprefix doctor LOG`: what breaks prefix reuse in a request log, and what fixing each cause would win.

This module stays light (argparse only); the analysis is imported inside ``run``.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvprefix.paths import ReadableFile, WritableFile, positive_int
from kvprefix.tokenizer import chat_template


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("log", action=ReadableFile, help="JSONL of OpenAI request bodies, or a kvprefix serve --request-log file")
    parser.add_argument("--model", help="checkpoint whose tokenizer and chat template render the prompts "
                                        "(default: kvprefix's default model)")
    parser.add_argument("--identity", metavar="URL|FILE",
                        help="hash as a replica does: its base URL, or a JSON file of its /v1/models listing "
                             "(default: the --model checkpoint's own identity, float32, xxhash)")
    chat_template.add_arguments(parser)  # render as the server that wrote the log does: give its options
    parser.add_argument("--block-size", type=positive_int,
                        help="block size (default 16; a request log: its own, or a multiple of it)")
    parser.add_argument("--capacity", type=positive_int,
                        help="KV capacity per replica in tokens, e.g. 1e6 (default: unbounded)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--html", metavar="OUT", action=WritableFile, help="also write the report as an HTML page")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress on stderr (a bar on a terminal, else a line every 10 s)")


def run(args: argparse.Namespace) -> int:
    from kvprefix.doctor.analysis import diagnose
    from kvprefix.doctor.diagnosis import Options
    from kvprefix.doctor.report import format_report

    progress = "off" if args.no_progress else "bar" if sys.stderr.isatty() else "lines"
    options = Options(args.block_size, args.capacity, progress=progress)
    try:
        template = chat_template.from_arguments(args)
        diagnosis = diagnose(args.log, lambda: load_tokenizer(args.model, args.identity, template), options)
    except (ValueError, OSError) as exc:  # kvprefix.logs.LogError is a ValueError
        print(f"kvprefix doctor: error: {exc}", file=sys.stderr)
        return 2
    if args.html:
        from kvprefix.doctor.html import write_html

        write_html(diagnosis, args.html)
    print(json.dumps(diagnosis.to_dict()) if args.json else format_report(diagnosis))
    return 0


def load_tokenizer(model: str | None, identity: str | None = None, template=None):
    """The tokenizer of ``model`` (default: kvprefix's default model), rendering with ``template``
    (``ChatTemplate``) where given, and the identity its blocks are hashed under: the replica's of ``identity``
    (checked against ``model`` and the template), else the checkpoint's own."""
    from kvprefix.sim.openai_bodies import load_tokenizer as load
    from kvprefix.sim.openai_bodies import read_replica_model, replica_model_for

    if model is None:
        from kvprefix.cache.default_model import default_model_path

        model = default_model_path()
    tokenizer = load(model, template)
    replica = read_replica_model(identity) if identity else None
    return tokenizer, replica_model_for(model, tokenizer, 16, "xxhash", replica)
