"""A router finds the hash root of every replica it may sit in front of, quantized ones included: the root names
the dtype and the weight format the KV was computed with."""

import pytest

from kvprefix.cache.event_wire import Hello
from kvprefix.engine.args import EngineArgs
from kvprefix.engine.llm_engine import LLMEngine
from kvprefix.router.hashing import RequestHasher


@pytest.mark.parametrize("dtype, quantization", [("float32", None), ("bfloat16", "int8"), ("bfloat16", "int4")])
def test_the_router_hashes_like_a_replica(default_model_dir, dtype, quantization):
    engine = LLMEngine(EngineArgs(model=default_model_dir, dtype=dtype, quantization=quantization, device="cpu",
                                  num_gpu_blocks=16))
    hello = Hello("r0", "e0", engine.hasher.block_size, engine.hasher.algo, engine.hasher.root, 0, False)
    assert RequestHasher.for_replica(default_model_dir, hello).hasher.root == engine.hasher.root
