"""Scores `kvprefix doctor` on the planted-cause corpus: runs `kvprefix doctor LOG --json` on each log (writing
the corpus first where it is missing, ``make_doctor_corpus.py``) and counts a log right when the cause ranked
first is the cause planted (a log with nothing planted: ``no-sharing`` first, no fixable cause before it).
Prints a table (the hit rate now and after the planted cause's fix) and writes JSON.

    python benchmarks/score_doctor_corpus.py [--corpus results/doctor_corpus] [--model DIR]
        [--out results/score_doctor_corpus.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from make_doctor_corpus import DEFAULT_OUT, SHAPES, make_corpus


def run_doctor(log: Path, args: tuple[str, ...], model: str | None) -> dict:
    cmd = [sys.executable, "-m", "kvprefix.cli", "doctor", str(log), "--json", "--no-progress", *args]
    if model:
        cmd += ["--model", model]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"kvprefix doctor {log} failed: {out.stderr.strip()}")
    return json.loads(out.stdout)


def score(name: str, report: dict) -> dict:
    planted = SHAPES[name].cause
    causes = report["causes"]
    first = causes[0]["kind"] if causes else None
    entry = next((c for c in causes if c["kind"] == planted), None)
    return {"log": name, "planted": planted, "first": first, "right": first == planted,
            "hit_rate": report["hit_rate"], "hit_rate_after": entry["hit_rate_after"] if entry else None,
            "causes": [c["kind"] for c in causes]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=DEFAULT_OUT, help=f"the logs (default {DEFAULT_OUT}; written if missing)")
    parser.add_argument("--model", help="checkpoint to render with (default: kvprefix's default model)")
    parser.add_argument("--out", default="results/score_doctor_corpus.json")
    args = parser.parse_args()
    corpus = Path(args.corpus)
    if not all((corpus / f"{name}.jsonl").exists() for name in SHAPES):
        make_corpus(corpus)
    rows = []
    for name, shape in SHAPES.items():
        row = score(name, run_doctor(corpus / f"{name}.jsonl", shape.args, args.model))
        rows.append(row)
        after = "" if row["hit_rate_after"] is None else f"{row['hit_rate_after']:.2f}"
        print(f"{name:26} {row['planted']:16} {row['first'] or '-':16} {'right' if row['right'] else 'WRONG':5} "
              f"{row['hit_rate']:.2f} {after:>5}  {' '.join(row['causes'])}", flush=True)
    right = sum(r["right"] for r in rows)
    print(f"{right} of {len(rows)} right")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"right": right, "logs": rows}, indent=2))


if __name__ == "__main__":
    main()
