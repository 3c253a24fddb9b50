"""The thread count a `kvprefix serve` process gives PyTorch: --cpu-threads, else OMP_NUM_THREADS, else physical
cores less one (docs/model.md#cpu-threads); the engine applies what it is given."""

import os

import pytest
import torch

from kvprefix import LLM
from kvprefix.cli import build_parser
from kvprefix.engine.cpu_threads import physical_cores, serving_threads


def test_the_default_leaves_a_core_for_the_rest_of_the_process(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = physical_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert serving_threads(None) == max(1, cores - 1)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert serving_threads(None) == 3
    assert serving_threads(5) == 5  # --cpu-threads wins over the environment


def test_the_option_is_a_positive_count(capsys) -> None:
    assert build_parser().parse_args(["serve", "--cpu-threads", "2"]).cpu_threads == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cpu-threads", "0"])
    assert "--cpu-threads" in capsys.readouterr().err


def test_the_engine_applies_its_thread_count(tiny_llama_path: str) -> None:
    before = torch.get_num_threads()
    try:
        LLM(tiny_llama_path, dtype="float32", num_gpu_blocks=16, cpu_threads=2)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        LLM(tiny_llama_path, dtype="float32", num_gpu_blocks=16)  # None: left as it is
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
