"""Fixtures shared across test folders."""

from collections.abc import Iterator

import pytest
import torch
from support.server_registry import ServerRegistry, specs_in_order_of_use

from kvprefix.model import write_random_checkpoint

# The suite shares 2 cores with servers, clients and other runs; with more than one OpenMP thread per process the
# threads spin at barriers whenever a core is taken, and tiny-model forwards get several times slower.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random-weight Llama checkpoint (2 layers, hidden 64, 512-token byte-level BPE with a chat template)."""
    return write_random_checkpoint(str(tmp_path_factory.mktemp("tiny-llama")), "llama", seed=0)


# The model the server, router and engine tests serve where a user would get the built-in default
# (SmolLM2-135M, 30 layers, far too slow for them): a random 4-layer Llama, big enough for prompts of several thousand
# tokens, small enough that a 64-client load test is fast on 2 cores. Its text is meaningless.
TEST_MODEL_CONFIG = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=8192)


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The tests' stand-in for the default model, written once per session; KVPREFIX_TEST_MODEL names it for the
    servers the tests start (server_helpers.start_server passes it as --model)."""
    path = write_random_checkpoint(str(tmp_path_factory.mktemp("test-model")), "llama", seed=1234,
                                   tokenizer_vocab_size=1024, **TEST_MODEL_CONFIG)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVPREFIX_TEST_MODEL", path)
        yield path


@pytest.fixture(scope="session")
def server_registry(tmp_path_factory: pytest.TempPathFactory, default_model_dir: str) -> Iterator[ServerRegistry]:
    """The shared `kvprefix serve` processes (tests/server/server_registry.py); stops them all at the end."""
    registry = ServerRegistry(tmp_path_factory.mktemp("servers"))
    yield registry
    registry.close()


@pytest.fixture(scope="session", autouse=True)
def _boot_servers_ahead(request: pytest.FixtureRequest) -> None:
    """The shared servers the selected tests use start booting now, in the background, while the tests before
    them run; a run that uses none starts nothing (and writes no model)."""
    specs = specs_in_order_of_use(request.session.items)
    if specs:
        request.getfixturevalue("server_registry").boot_ahead(specs)
