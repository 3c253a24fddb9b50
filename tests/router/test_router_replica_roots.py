"""A router reproduces the block identity every replica announces, quantized ones included (the root names the
dtype and the weight format the KV was computed with), from the checkpoint the identity names or from --model; a
checkpoint with other fingerprints is a one-line error naming the replica."""

import dataclasses
import shutil

import pytest

from kvprefix.cache.event_wire import Hello
from kvprefix.engine.args import EngineArgs
from kvprefix.engine.llm_engine import LLMEngine
from kvprefix.router.hashing import RequestHasher


def hello_of(engine: LLMEngine) -> Hello:
    h = engine.hasher
    return Hello("r0", "e0", h.block_size, h.algo, h.root, 0, False, identity=engine.identity, max_model_len=64)


@pytest.mark.parametrize("dtype, quantization", [("float32", None), ("bfloat16", "int8"), ("bfloat16", "int4")])
def test_the_router_hashes_like_a_replica(default_model_dir, dtype, quantization):
    engine = LLMEngine(EngineArgs(model=default_model_dir, dtype=dtype, quantization=quantization, device="cpu",
                                  num_gpu_blocks=16))
    for model in (None, default_model_dir):  # the checkpoint the identity names, or the one given
        hasher = RequestHasher.for_replica(hello_of(engine), model)
        assert hasher.hasher.root == engine.hasher.root and hasher.max_model_len == 64


def test_a_checkpoint_the_router_cannot_reproduce_is_named(default_model_dir, tmp_path):
    engine = LLMEngine(EngineArgs(model=default_model_dir, dtype="float32", device="cpu", num_gpu_blocks=16))
    hello = hello_of(engine)
    copy = shutil.copytree(default_model_dir, tmp_path / "copy")
    assert RequestHasher.for_replica(hello, str(copy)).hasher.root == engine.hasher.root  # same bytes elsewhere
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    with pytest.raises(ValueError, match=r"^--model .* is not the checkpoint of replica r0: model \w+"):
        RequestHasher.for_replica(hello, str(copy))
    gone = dataclasses.replace(hello, identity=dataclasses.replace(engine.identity, checkpoint=str(tmp_path / "x")))
    with pytest.raises(ValueError, match=r"^replica http://h:1 runs .*/x, which this router cannot find: .*/x is not "
                                         r"here, .* give --model"):
        RequestHasher.for_replica(gone, None, "http://h:1")
