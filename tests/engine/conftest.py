"""Engine fixtures: LLMs over the tiny random Llama checkpoint (float32 on CPU, so results are exact to compare)."""

from collections.abc import Callable

import pytest
import torch

from kvprefix import LLM


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The tiny model's ops take microseconds; a second thread only adds synchronisation (and stalls badly when
    other processes share the 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def make_llm(tiny_llama_path: str) -> Callable[..., LLM]:
    """LLM(tiny model, **overrides); a small KV pool by default so tests allocate little memory."""

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_gpu_blocks", 256)
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("device", "cpu")
        return LLM(tiny_llama_path, **kwargs)

    return make


@pytest.fixture(scope="session")
def assert_no_leaks() -> Callable[[LLM], None]:
    """Checks an idle LLM: every block free and unreferenced, no request holding a block table."""

    def check(llm: LLM) -> None:
        manager = llm.llm_engine.manager
        assert manager.pool.num_free_blocks == manager.pool.num_blocks
        assert all(b.ref_cnt == 0 for b in manager.pool.blocks)
        assert not manager.req_to_blocks

    return check
