"""`kvprefix doctor` on a large log, on one core: seconds and peak memory, for each log format.

The log is chat bodies as clients send them: 16 system prompts of 120 words, a quarter of them with a timestamp
before the stable text (so each of those requests has its own system-prompt blocks: distinct blocks grow with
the log), a tenth with their three tools shuffled, each followed by a question from a pool of 5,000; arrivals
5 ms apart over four replicas, round robin. The same traffic is also written as the server's request log (hashes
only, and with prompts), rendered and hashed as `kvprefix serve` does. Each log is analysed by
`kvprefix doctor LOG --json` in a fresh process pinned to one CPU (``taskset -c 0`` where available).

    python benchmarks/bench_doctor.py [--sizes 25000,100000] [--formats bodies,request-log,request-log-prompts]
        [--model DIR] [--logs DIR] [--no-pin] [--out results/bench_doctor.json]

``--logs DIR`` keeps the logs there and uses the ones already there (writing 100,000 requests as a request log
takes minutes), so two versions of the doctor can be timed on the same files.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FORMATS = ("bodies", "request-log", "request-log-prompts")
WORDS = ("cache block prefix token request replica tenant prompt system tool schema memory evict hash chain "
         "server router planner doctor answer question window history template render").split()
TOOLS = [{"type": "function", "function": {"name": f"tool_{k}", "description": f"tool number {k}",
                                            "parameters": {"type": "object", "properties": {
                                                "arg": {"type": "string"}, "n": {"type": "integer"}}}}}
         for k in range(3)]


def write_log(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    systems = [" ".join(random.Random(g).choice(WORDS) for _ in range(120)) for g in range(16)]
    questions = [" ".join(random.Random(10_000 + q).choice(WORDS) for _ in range(20)) + "?" for q in range(5000)]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            g = rng.randrange(16)
            system = systems[g]
            if g % 4 == 0:
                system = f"Now: 2026-12-01T{i // 3600 % 24:02d}:{i // 60 % 60:02d}:{i % 60:02d}Z. " + system
            tools = rng.sample(TOOLS, len(TOOLS)) if g % 10 == 1 else TOOLS
            body = {"model": "m", "messages": [{"role": "system", "content": system},
                                               {"role": "user", "content": rng.choice(questions)}],
                    "tools": tools, "timestamp": i * 5, "replica": f"r{i % 4}"}
            f.write(json.dumps(body) + "\n")


def write_request_log(bodies: Path, path: Path, model: str, with_prompts: bool) -> None:
    """What `kvprefix serve --request-log` would write for these bodies (its renderer, its sha256 hashes)."""
    from kvprefix.cache import BlockHasher
    from kvprefix.logs import RequestLogWriter, RequestRecord
    from kvprefix.prompts import render_bodies
    from kvprefix.tokenizer import SegmentCachedTokenizer, Tokenizer

    tokenizer = SegmentCachedTokenizer(Tokenizer(model))
    hasher = BlockHasher(16, "sha256")
    writer = RequestLogWriter(str(path), include_prompts=with_prompts)
    with open(bodies, encoding="utf-8") as f:
        lines = list(f)
    for start in range(0, len(lines), 256):  # render_bodies: render_body's prompts, in fewer calls
        batch = [json.loads(line) for line in lines[start:start + 256]]
        for i, (body, prompts) in enumerate(zip(batch, render_bodies(tokenizer, batch), strict=True), start):
            prompt = prompts[0]
            ts = 1_796_000_000.0 + body["timestamp"] / 1000
            writer.write(RequestRecord(
                timestamp=ts, prompt_tokens=len(prompt.token_ids), output_tokens=16, block_size=16,
                block_hashes=[h.hex() for h in hasher.hash_blocks(prompt.token_ids)], hash_algo="sha256",
                request_id=f"chatcmpl-{i}-0", endpoint="chat", model="m", namespace=hasher.namespace_id,
                replica=body["replica"], timings={"ttft_s": 0.02, "e2e_s": 0.3}, finish_time=ts + 0.3,
                prompt=prompt.text, message_spans=[list(s) if s else None for s in prompt.message_spans]))
    writer.close()


def run_doctor(log: Path, model: str | None, pin: bool = True) -> dict:
    """`kvprefix doctor LOG --json` in a fresh process on one CPU (``pin``: CPU 0 only; else one thread each for
    the tokenizer and BLAS, wherever the OS runs it): seconds, CPU seconds, peak memory."""
    cmd = [sys.executable, "-m", "kvprefix.cli", "doctor", str(log), "--json", "--no-progress"]
    if model:
        cmd += ["--model", model]
    if pin and shutil.which("taskset"):
        cmd = ["taskset", "-c", "0", *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"kvprefix doctor failed: {out.stderr.strip()}")
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    report = json.loads(out.stdout)
    return {"wall_s": wall, "cpu_s": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "peak_rss_mb": after.ru_maxrss / 1024, "hit_rate": report["hit_rate"],
            "causes": [(c["kind"], c["tokens_lost"], c["hit_rate_after"]) for c in report["causes"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="25000,100000")
    parser.add_argument("--model", help="checkpoint to render with (default: kvprefix's default model)")
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated, of {', '.join(FORMATS)}")
    parser.add_argument("--no-pin", action="store_true",
                        help="do not pin the doctor to CPU 0 (a machine whose CPUs someone else assigns)")
    parser.add_argument("--logs", help="directory to keep the logs in and reuse them from (default: a temporary one)")
    parser.add_argument("--out", default="results/bench_doctor.json")
    args = parser.parse_args()
    model = args.model
    if model is None:
        from kvprefix.cache.default_model import default_model_path

        model = default_model_path()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for n in (int(s) for s in args.sizes.split(",")):
            bodies = logs / f"bodies_{n}.jsonl"
            if not bodies.exists():
                write_log(bodies, n)
            for fmt in args.formats.split(","):
                log = bodies
                if fmt != "bodies":
                    log = logs / f"{fmt}_{n}.jsonl"
                    if not log.exists():
                        write_request_log(bodies, log, model, with_prompts=fmt.endswith("prompts"))
                result = {"format": fmt, "requests": n, "log_mb": log.stat().st_size / 2**20,
                          **run_doctor(log, model if fmt != "request-log" else None, not args.no_pin)}
                rows.append(result)
                print(f"{fmt:>20} {n:>8} requests  {result['log_mb']:7.1f} MB  {result['wall_s']:6.1f} s wall  "
                      f"{result['cpu_s']:6.1f} s cpu  peak RSS {result['peak_rss_mb']:7.0f} MB  "
                      f"hit rate {result['hit_rate']:.1%}", flush=True)
                for kind, lost, after in result["causes"]:
                    print(f"{'':>22}{kind:16} {lost:>12} tokens  {'' if after is None else f'-> {after:.1%}'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
