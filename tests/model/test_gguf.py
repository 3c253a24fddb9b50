"""GGUF checkpoints: tiny random models written as real GGUF files (F32, F16, Q8_0, Q4_1), loaded against the
values the file holds and against transformers' forward on those values; bad files give one-line errors."""

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from support.gguf_files import reference_model, write_gguf
from test_parity import PROMPT, all_logits

from kvprefix.model import ModelConfig, load_model, write_random_checkpoint
from kvprefix.tokenizer import Tokenizer

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0)
Q = GGMLQuantizationType


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("llama")), "llama", seed=3, **CONFIG)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_1], ids=lambda q: q.name)
def test_weights_and_logits_match_the_dequantized_reference(llama_dir, tmp_path, qtype) -> None:
    path = str(tmp_path / f"tiny-{qtype.name}.gguf")
    held = write_gguf(path, llama_dir, CONFIG, qtype)
    model = load_model(path)
    params = model.checkpoint_views()  # the checkpoint's names, stacked projections split
    assert held.keys() == params.keys()
    # Exact: the same dequantization, and the q/k rows back in Hugging Face order.
    assert all(torch.equal(params[k], torch.from_numpy(v)) for k, v in held.items())
    prompt = Tokenizer(path).encode(PROMPT)
    with torch.no_grad():
        theirs = reference_model(llama_dir, held)(torch.tensor([prompt])).logits[0]
    assert theirs.std() > 0.5
    assert (all_logits(model, prompt) - theirs).abs().max().item() <= 1e-4


def test_qwen2_rows_are_not_permuted_and_tied_embeddings_load(tmp_path) -> None:
    config = {**CONFIG, "tie_word_embeddings": True}
    ckpt = write_random_checkpoint(str(tmp_path / "qwen2"), "qwen2", seed=4, **config)
    path = str(tmp_path / "qwen2.gguf")
    held = write_gguf(path, ckpt, config, Q.Q8_0, pre="qwen2", arch="qwen2")
    model = load_model(path)
    assert model.config.qkv_bias and model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    prompt = Tokenizer(path).encode(PROMPT)
    with torch.no_grad():
        theirs = reference_model(ckpt, held)(torch.tensor([prompt])).logits[0]
    assert (all_logits(model, prompt) - theirs).abs().max().item() <= 1e-4


def test_llama31_rope_freqs_scale_like_the_llama3_rope_type(tmp_path) -> None:
    from kvprefix.model.rope import inverse_frequencies

    # A small original context, so that the scaled band matters at the test's positions.
    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
            "original_max_position_embeddings": 32}
    config = {**CONFIG, "rope_scaling": rope, "rope_theta": 500000.0}
    ckpt = write_random_checkpoint(str(tmp_path / "llama31"), "llama", seed=5, **config)
    hf = ModelConfig.from_path(ckpt)
    plain = inverse_frequencies(dataclasses.replace(hf, rope_type="default", rope_parameters={}))
    path = str(tmp_path / "llama31.gguf")
    held = write_gguf(path, ckpt, config, Q.F32, rope_freqs=(plain / inverse_frequencies(hf)).numpy())
    model = load_model(path)
    assert "freq_factors" in model.config.rope_parameters
    prompt = Tokenizer(path).encode(PROMPT)
    with torch.no_grad():
        theirs = reference_model(ckpt, held)(torch.tensor([prompt])).logits[0]
    assert (all_logits(model, prompt) - theirs).abs().max().item() <= 1e-4


def test_config_comes_from_the_metadata(llama_dir, tmp_path) -> None:
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, llama_dir, CONFIG, Q.F32)
    ours, hf = ModelConfig.from_path(path), ModelConfig.from_path(llama_dir)
    assert ours.num_key_value_heads == hf.num_key_value_heads == 2 and ours.head_dim == hf.head_dim == 16
    assert (ours.vocab_size, ours.hidden_size, ours.num_hidden_layers) == (hf.vocab_size, 64, 2)
    assert ours.eos_token_ids == (Tokenizer(path).hf.convert_tokens_to_ids("<|im_end|>"),)
    assert not ours.tie_word_embeddings and not ours.qkv_bias


def one_line_error(exc: pytest.ExceptionInfo, path: str) -> str:
    message = str(exc.value)
    assert "\n" not in message and path in message, message
    return message


def test_truncated_file_is_a_one_line_error_naming_it(llama_dir, tmp_path) -> None:
    path = str(tmp_path / "whole.gguf")
    write_gguf(path, llama_dir, CONFIG, Q.Q4_1)
    data = open(path, "rb").read()
    for cut in (100, len(data) // 2, len(data) - 1):
        short = str(tmp_path / f"cut-{cut}.gguf")
        with open(short, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(ValueError) as exc:
            load_model(short)
        assert "not a readable GGUF file" in one_line_error(exc, short)


def test_not_a_gguf_file(tmp_path) -> None:
    path = tmp_path / "text.gguf"
    path.write_text("hello")
    with pytest.raises(ValueError) as exc:
        Tokenizer(str(path))
    one_line_error(exc, str(path))


def test_unsupported_architecture_is_a_one_line_error(tmp_path) -> None:
    path = str(tmp_path / "falcon.gguf")
    writer = GGUFWriter(path, "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError) as exc:
        load_model(path)
    assert "unsupported architecture 'falcon'" in one_line_error(exc, path)


@pytest.mark.slow
def test_serve_on_a_bad_file_exits_with_one_line(tmp_path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 20)
    p = subprocess.run([sys.executable, "-m", "kvprefix.cli", "serve", "--model", str(path), "--port", "1"],
                       capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kvprefix serve:") and str(path) in last, p.stderr


def test_engine_serves_a_gguf_like_its_safetensors_twin_and_roots_hashes_in_its_bytes(llama_dir, tmp_path) -> None:
    from kvprefix import LLM, SamplingParams
    from kvprefix.cache import context_for_checkpoint

    f32, q8 = str(tmp_path / "f32.gguf"), str(tmp_path / "q8.gguf")
    write_gguf(f32, llama_dir, CONFIG, Q.F32)
    write_gguf(q8, llama_dir, CONFIG, Q.Q8_0)
    os.symlink(f32, tmp_path / "elsewhere.gguf")
    assert context_for_checkpoint(f32, "float32") == context_for_checkpoint(str(tmp_path / "elsewhere.gguf"), "float32")
    assert context_for_checkpoint(f32, "float32").model != context_for_checkpoint(q8, "float32").model

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(20, 60))}
    gguf_llm = LLM(f32, dtype="float32", num_gpu_blocks=64)
    twin = LLM(llama_dir, dtype="float32", num_gpu_blocks=64).generate(prompt, greedy)[0]
    first, again = gguf_llm.generate([prompt, prompt], greedy)
    assert first.outputs[0].token_ids == twin.outputs[0].token_ids == again.outputs[0].token_ids
    assert gguf_llm.llm_engine.hasher.context == context_for_checkpoint(f32, "float32",
                                                                       gguf_llm.get_tokenizer().chat_template)
    chat = gguf_llm.chat([{"role": "user", "content": "Hi!"}], greedy)[0]
    assert chat.prompt.startswith("<|im_start|>user\nHi!")  # the chat template from the file's metadata


def test_a_quantized_file_runs_its_own_blocks_by_default(llama_dir, tmp_path) -> None:
    """No --quantization: a Q4_1 file runs its blocks where the CPU runs them natively; an F32 file, "none", and
    CUDA stay dense."""
    from torch import nn

    from kvprefix import LLM
    from kvprefix.model.quantized_linear import Int4Linear, compact_by_default, resolve_quantization

    q4, f32 = str(tmp_path / "q4.gguf"), str(tmp_path / "f32.gguf")
    write_gguf(q4, llama_dir, CONFIG, Q.Q4_1)
    write_gguf(f32, llama_dir, CONFIG, Q.F32)
    compact = compact_by_default()
    by_default = LLM(q4, num_gpu_blocks=16).llm_engine
    assert by_default.quantization == ("gguf" if compact else None)
    down = by_default.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Int4Linear if compact else nn.Linear)
    assert by_default.identity.context.kv_dtype.endswith("+gguf+a8") == compact
    dense = LLM(q4, quantization="none", num_gpu_blocks=16).llm_engine
    assert dense.quantization is None and isinstance(dense.runner.model.model.layers[0].mlp.down_proj, nn.Linear)
    assert "gguf" not in dense.identity.context.kv_dtype
    assert resolve_quantization(None, f32, "cpu") is None
    assert resolve_quantization(None, q4, "cuda") is None
    assert resolve_quantization(None, llama_dir, "cpu") is None  # safetensors: dense
    with pytest.raises(ValueError, match="runs on device cpu only"):
        resolve_quantization("gguf", q4, "cuda")


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_the_files_own_blocks_give_the_same_greedy_tokens_with_caching_on_and_off(llama_dir, tmp_path, qtype) -> None:
    """--quantization gguf: Q4_1 as int4 layers, Q8_0 as int8 ones (int8 activations where the CPU has them)."""
    from kvprefix import LLM, SamplingParams
    from kvprefix.model.quantized_linear import Int4Linear, Int8Linear

    path = str(tmp_path / f"{qtype.name}.gguf")
    write_gguf(path, llama_dir, CONFIG, qtype)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    shared = list(range(20, 52))  # two full blocks, hit by the later prompts with caching on
    prompts = [{"prompt_token_ids": shared + tail} for tail in ([7, 9, 11], list(range(60, 80)), [5] * 17)]
    outputs = {}
    for caching in (True, False):
        llm = LLM(path, quantization="gguf", dtype="bfloat16", enable_prefix_caching=caching, num_gpu_blocks=64)
        kind = Int4Linear if qtype == Q.Q4_1 else Int8Linear
        assert isinstance(llm.llm_engine.runner.model.model.layers[0].mlp.down_proj, kind)
        llm.generate(prompts[0], params)
        results = llm.generate(prompts, params)
        assert (results[1].num_cached_tokens > 0) == caching
        outputs[caching] = [r.outputs[0].token_ids for r in results]
    assert outputs[True] == outputs[False]
