"""Writes the support-agents workload (issue 27) as OpenAI chat bodies, one per line, reproducibly.

Four support-agent system prompts of 60 short rules each, six questions per prompt, shuffled with a fixed seed;
timestamps one minute apart, so a timed replay sends one request at a time (nothing is ever queued). It is the
shape on which a router that spreads prefixes while nothing is loaded loses hits to one shared pool: the prefix
policies must keep each prompt on the replica that holds it. The checked-in copy is
tests/data/support_agents.jsonl (the planner test and `bench_router.py --live --workload` read it):

    python benchmarks/make_support_agents.py tests/data/support_agents.jsonl
    kvprefix simulate tests/data/support_agents.jsonl --tokenizer DEFAULT_MODEL --replicas 3 \\
        --routing round-robin,prefix,kv-events,shared --capacity-blocks 364
"""

from __future__ import annotations

import argparse
import json
import random

AGENTS = ("billing", "shipping", "accounts", "returns")
SUBJECTS = ("refunds", "invoices", "passwords", "parcels", "exchanges", "warranties", "discounts", "addresses",
            "cards", "orders", "subscriptions", "gift cards")
ACTIONS = ("confirm", "never promise", "always link", "escalate", "apologise once for", "summarise",
           "ask for the order number before discussing", "quote the policy on")


def system_prompt(agent: str) -> str:
    """One agent's prompt: a header and 60 numbered one-line rules (about 700 tokens with SmolLM2's tokenizer)."""
    rules = [f"Rule {n + 1}: {ACTIONS[(n * 3 + len(agent)) % len(ACTIONS)]} {SUBJECTS[(n * 7 + len(agent)) % len(SUBJECTS)]}"
             f" when the customer writes about {agent}." for n in range(60)]
    return f"You are the {agent} support agent of an online shop. Follow these rules.\n" + "\n".join(rules)


def bodies(seed: int = 27, questions: int = 6) -> list[dict]:
    """The workload: every (agent, question) pair once, in a seeded shuffle, 60 s apart."""
    rng = random.Random(seed)
    pairs = [(agent, q) for agent in AGENTS for q in range(questions)]
    rng.shuffle(pairs)
    return [{"timestamp": i * 60_000, "max_tokens": 16, "messages": [
        {"role": "system", "content": system_prompt(agent)},
        {"role": "user", "content": f"Customer {i}: question {q} about my {SUBJECTS[(i + q) % len(SUBJECTS)]}?"}]}
        for i, (agent, q) in enumerate(pairs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--seed", type=int, default=27)
    args = parser.parse_args()
    with open(args.out, "w") as f:
        for body in bodies(args.seed):
            f.write(json.dumps(body) + "\n")


if __name__ == "__main__":
    main()
