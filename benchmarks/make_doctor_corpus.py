"""Writes the doctor's planted-cause corpus: one request log (OpenAI bodies, JSONL) per shape of
``tests/support/doctor_corpus.py``, each with one cause planted, a few hundred requests, from a fixed seed (so the
corpus is the same wherever it is written and need not be committed).

    python benchmarks/make_doctor_corpus.py [--out results/doctor_corpus] [--requests 300] [--seed 27]

Then ``python benchmarks/score_doctor_corpus.py`` runs the doctor on each log and scores it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' support package
from support.doctor_corpus import REQUESTS, SEED, SHAPES, write  # noqa: E402

DEFAULT_OUT = "results/doctor_corpus"


def make_corpus(out: Path, requests: int = REQUESTS, seed: int = SEED) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [write(out / f"{name}.jsonl", name, requests, seed) for name in SHAPES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"directory of the logs (default {DEFAULT_OUT})")
    parser.add_argument("--requests", type=int, default=REQUESTS, help=f"requests per log (default {REQUESTS})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"default {SEED}")
    args = parser.parse_args()
    for path in make_corpus(Path(args.out), args.requests, args.seed):
        print(path)


if __name__ == "__main__":
    main()
