"""`kvprefix simulate`."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--example", choices=["seed"], help="run a built-in example instead of a trace")


def run(args: argparse.Namespace) -> int:
    if args.example == "seed":
        from kvprefix.sim.seed_example import seed_report

        print("\n".join(seed_report()))
        return 0
    print("give --example seed (trace replay arrives with the planner)")
    return 2
