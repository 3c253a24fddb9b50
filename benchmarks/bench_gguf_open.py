"""Opening a GGUF file: the `gguf` package's GGUFReader against kvprefix's reader (kvprefix.tokenizer.gguf_file),
interleaved in one process, and the tokenizer built on top. Every process that serves, routes or plans a .gguf
model opens it once; GGUFReader spends its time making numpy views of each metadata string.

    python benchmarks/bench_gguf_open.py [--model FILE.gguf] [--rounds 3] [--out results/gguf_open.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness import write_results


def main() -> None:
    from gguf import GGUFReader

    from kvprefix.cache.default_model import default_model_path
    from kvprefix.tokenizer import Tokenizer, gguf_file
    from kvprefix.tokenizer.gguf_file import GGUFFile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: the built-in default model's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results/gguf_open.json")
    args = parser.parse_args()
    path = args.model or default_model_path()
    seconds: dict[str, list[float]] = {"GGUFReader": [], "kvprefix GGUFFile": [], "kvprefix Tokenizer": []}
    for _ in range(args.rounds):  # interleaved, so that the machine's load falls on both alike
        for name, open_once in (("GGUFReader", GGUFReader), ("kvprefix GGUFFile", GGUFFile),
                                ("kvprefix Tokenizer", Tokenizer)):
            gguf_file._open.cache_clear()  # the Tokenizer parses the file too, as a fresh process does
            start = time.perf_counter()
            open_once(path)
            seconds[name].append(time.perf_counter() - start)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"{'reader':<20} {'median s':>9}  rounds")
    for name, s in seconds.items():
        print(f"{name:<20} {median[name]:>9.2f}  {', '.join(f'{x:.2f}' for x in s)}")
    ratio = median["GGUFReader"] / median["kvprefix GGUFFile"]
    print(f"GGUFReader / kvprefix GGUFFile: {ratio:.1f}x")
    write_results(args.out, {"model": path, "seconds": seconds, "median": median, "ratio": ratio})


if __name__ == "__main__":
    main()
