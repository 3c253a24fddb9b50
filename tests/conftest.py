"""Fixtures shared across test folders."""

from collections.abc import Iterator

import pytest
import torch

from kvprefix.model import write_random_checkpoint

# The suite shares 2 cores with servers, clients and other runs; with more than one OpenMP thread per process the
# threads spin at barriers whenever a core is taken, and tiny-model forwards get several times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama checkpoint (2 layers, hidden 64, 512-token byte-level BPE with a chat template)."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny-llama")), "llama", seed=0)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Points KVPREFIX_CACHE_DIR at a session temp dir (never ~/.cache) and builds the default model there once."""
    from kvprefix.model import default_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPREFIX_CACHE_DIR", str(tmp_path_factory.mktemp("kvprefix-cache")))
        yield default_model_path()
