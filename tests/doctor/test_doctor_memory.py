"""The doctor runs without the cyclic garbage collector, so it must leave no reference cycle per request behind:
ten times the log leaves no more cycles than the tokenizer's loading does once."""

import gc

import pytest
import support.doctor_logs as logs

from kvprefix.doctor.analysis import diagnose
from kvprefix.tokenizer import Tokenizer


def _cycles_left(path, tokenizer_dir) -> int:
    gc.collect()
    diagnose(str(path), lambda: Tokenizer(str(tokenizer_dir)))
    return gc.collect()


@pytest.mark.slow  # ten runs of the doctor over a log: 2 s of the fast lane's 90
def test_no_cycle_left_per_request(tmp_path, tokenizer_dir):
    small = logs.write_jsonl(tmp_path / "small.jsonl", logs.volatile(30) + logs.shuffled_tools(30))
    large = logs.write_jsonl(tmp_path / "large.jsonl", logs.volatile(300) + logs.shuffled_tools(300))
    _cycles_left(small, tokenizer_dir)  # first imports and compiled templates
    assert gc.isenabled()
    assert _cycles_left(large, tokenizer_dir) <= _cycles_left(small, tokenizer_dir) + 10
