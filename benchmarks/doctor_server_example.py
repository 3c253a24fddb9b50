"""The loop a user runs on production traffic, end to end: `kvprefix serve --request-log --request-log-prompts`,
a client whose system prompt starts with the current time, then `kvprefix doctor` on the log the server wrote.

Prints the server's own cached tokens per request, then the doctor's report; writes both as JSON. Uses the
default model (or --model) and a free port on 127.0.0.1.

    python benchmarks/doctor_server_example.py [--requests 12] [--model DIR] [--out results/doctor_example.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness import start_serve, write_results
from openai import OpenAI

SYSTEM = ("You are the support assistant of a company that runs a prefix cache for language models. Answer in two "
          "sentences, cite the documentation page you used, and never invent a configuration option.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--model")
    parser.add_argument("--out", default="results/doctor_example.json")
    args = parser.parse_args()
    model = ["--model", args.model] if args.model else []
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "requests.jsonl"
        server = start_serve([*model, "--request-log", str(log), "--request-log-prompts"], log_level="info",
                             timeout_s=150, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            url = server.url
            client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            served = client.models.list().data[0].id
            cached = []
            for i in range(args.requests):
                now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
                r = client.chat.completions.create(model=served, max_tokens=4, messages=[
                    {"role": "system", "content": f"Current time: {now}. {SYSTEM}"},
                    {"role": "user", "content": f"Question {i}: why did my request miss the cache?"}])
                cached.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
                time.sleep(1.1)  # the next request sees another second
        finally:
            server.stop()
        print("server: (prompt tokens, cached tokens) per request:", cached)
        print(f"server: {sum(c for _, c in cached)} of {sum(p for p, _ in cached)} prompt tokens cached")
        doctor = [sys.executable, "-m", "kvprefix.cli", "doctor", str(log), *model, "--no-progress"]
        print(subprocess.run(doctor, check=True, capture_output=True, text=True).stdout)
        report = json.loads(subprocess.run([*doctor, "--json"], check=True, capture_output=True, text=True).stdout)
    write_results(args.out, {"server_cached": cached, "doctor": report})


if __name__ == "__main__":
    main()
