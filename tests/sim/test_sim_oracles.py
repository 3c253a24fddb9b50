"""Exact hit rates that follow from how the test traces were built (tests/data/traces/README.md)."""

from fractions import Fraction

import pytest

from kvprefix.cli import main
from kvprefix.sim.seed_example import run_sequential, seed_prompts


def test_sglang_generated_shared_prefix_unbounded(load, run):
    # 64 groups x 16 prompts: every prompt but a group's first reuses the 2,048-token system prompt of 2,176.
    s = run(load("sglang_gsp_default_bs16.jsonl"))
    assert Fraction(s.cached_blocks, s.prompt_blocks) == Fraction(15, 16) * Fraction(2048, 2176)
    assert round(s.block_hit_rate, 5) == 0.88235
    assert s.evictions == 0 and s.rejected == 0


def test_vllm_prefix_repetition_unbounded(load, run):
    # 10 prefixes of 256 tokens, 100 requests each, 256-token unique suffixes.
    s = run(load("vllm_prefix_repetition_default_bs16.jsonl"))
    assert Fraction(s.cached_blocks, s.prompt_blocks) == Fraction(99, 100) * Fraction(1, 2)
    assert s.block_hit_rate == 0.495


@pytest.mark.parametrize("mode", ["order", "timed"])
def test_unbounded_hit_rate_does_not_depend_on_timing(load, run, mode):
    s = run(load("sglang_gsp_default_bs16.jsonl"), mode=mode)
    assert Fraction(s.cached_blocks, s.prompt_blocks) == Fraction(15, 16) * Fraction(2048, 2176)


def test_coarsened_block_size_keeps_the_exact_rate(load, run):
    # 2,048 and 2,176 are multiples of 64: the oracle holds at 64-token blocks too.
    trace = load("sglang_gsp_default_bs16.jsonl", block_size=64)
    assert trace.block_size == 64 and trace.requests[0].num_blocks == 2176 // 64
    s = run(trace)
    assert Fraction(s.cached_blocks, s.prompt_blocks) == Fraction(15, 16) * Fraction(2048, 2176)


def test_seed_example_4296_vs_712():
    bs = 16
    assert run_sequential(seed_prompts(), bs, enable_prefix_caching=False).prefill_tokens == 4296
    assert run_sequential(seed_prompts(), bs, enable_prefix_caching=True).prefill_tokens == 712


def test_seed_example_from_the_cli(capsys):
    assert main(["simulate", "--example", "seed"]) == 0
    out = capsys.readouterr().out
    assert "4296" in out and "712" in out
