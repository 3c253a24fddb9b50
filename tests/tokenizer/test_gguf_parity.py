"""The built-in default model's GGUF file read by kvprefix against transformers' own GGUF loading of the same file
(which kvprefix never imports): every weight equal once dequantized and un-permuted, and greedy chat outputs
identical in float32. Its tokenizer against llama.cpp's rules is test_gguf_tokenizer.py's. Slow: a 30-layer
model, loaded by both, generating 5 x 32 tokens each. (Was benchmarks/gguf_parity.py; docs/model.md has the
figures.)"""

from __future__ import annotations

import pytest
import torch

from kvprefix import LLM, SamplingParams
from kvprefix.cache.default_model import default_model_path
from kvprefix.model import load_model
from kvprefix.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

QUESTIONS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Explain in one sentence what a cache is.",
)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def transformers_model():
    """transformers' LlamaForCausalLM with the weights of its own GGUF loader, and those tensors."""
    pytest.importorskip("gguf")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    raw = load_gguf_checkpoint(path)["config"]
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in raw.items() if not k.startswith("_")}))
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.to(torch.float32).eval(), tensors


def test_every_weight_equals_transformers_gguf_loading(transformers_model) -> None:
    _, tensors = transformers_model
    mine = load_model(default_model_path(), torch.float32)
    diffs = {name: (p - tensors[name].float()).abs().max().item() for name, p in mine.checkpoint_views().items()
             if name in tensors}
    assert len(diffs) == 272 and max(diffs.values()) == 0.0, {k: v for k, v in diffs.items() if v}


def test_greedy_chat_outputs_equal_transformers_in_float32(transformers_model) -> None:
    model, _ = transformers_model
    path = default_model_path()
    tok = Tokenizer(path)
    llm = LLM(path, dtype="float32", num_gpu_blocks=256)
    differ = []
    for question in QUESTIONS:
        ids = tok.apply_chat_template([{"role": "user", "content": question}])
        got = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        got = got[0].outputs[0].token_ids
        with torch.inference_mode():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=len(got), do_sample=False)[0, len(ids):].tolist()
        if got != ref:
            differ.append((question, tok.decode(got), tok.decode(ref)))
    assert differ == []
