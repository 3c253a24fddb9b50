"""kvprefix's decoder against transformers on the same checkpoint: logits and greedy generations."""

import pytest
import torch
import transformers
from support.paged import Chunk, greedy_generate, run_batch

from kvprefix.model import allocate_kv_cache, load_model, write_random_checkpoint
from kvprefix.tokenizer import Tokenizer

BLOCK = 4
PROMPT = "A prefix cache keeps the keys and values of a shared prompt prefix, computed once. Caché über 🙂!"


def reference(path: str) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def all_logits(model, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position from one paged prefill."""
    kv = allocate_kv_cache(model.config, 64, BLOCK, torch.float32, "cpu")
    chunk = Chunk(prompt, 0, len(prompt), list(range(1, 64)))
    hidden = {}
    # run_batch returns only the last position; capture the final hidden states instead.
    handle = model.model.norm.register_forward_hook(lambda _m, _i, out: hidden.setdefault("h", out))
    run_batch(model, kv, BLOCK, [chunk])
    handle.remove()
    return model.compute_logits(hidden["h"])


def test_logits_match_transformers(arch_checkpoint: str) -> None:
    prompt = Tokenizer(arch_checkpoint).encode(PROMPT)
    ours = all_logits(load_model(arch_checkpoint), prompt)
    with torch.no_grad():
        theirs = reference(arch_checkpoint)(torch.tensor([prompt])).logits[0]
    assert ours.dtype == torch.float32
    assert theirs.std() > 0.5  # logits far from flat, so a wrong RoPE or mask would show
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_greedy_generation_matches_transformers(arch_checkpoint: str) -> None:
    prompt = Tokenizer(arch_checkpoint).encode(PROMPT)
    model = load_model(arch_checkpoint)
    kv = allocate_kv_cache(model.config, 64, BLOCK, torch.float32, "cpu")
    ours = greedy_generate(model, kv, BLOCK, prompt, 24, block_ids=list(range(63, 0, -1)))
    with torch.no_grad():
        out = reference(arch_checkpoint).generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None
        )
    assert ours == out[0, len(prompt) :].tolist()


def test_sliding_window_matches_transformers(tmp_path) -> None:
    path = write_random_checkpoint(str(tmp_path), "mistral", seed=2, sliding_window=8)
    prompt = Tokenizer(path).encode(PROMPT)
    model = load_model(path)
    assert model.config.sliding_windows == (8, 8)
    with torch.no_grad():
        theirs = reference(path)(torch.tensor([prompt])).logits[0]
    assert (all_logits(model, prompt) - theirs).abs().max().item() <= 1e-4
    # Decode reads the window from the paged cache too.
    kv = allocate_kv_cache(model.config, 64, BLOCK, torch.float32, "cpu")
    blocks = list(range(1, 64))
    run_batch(model, kv, BLOCK, [Chunk(prompt, 0, len(prompt) - 1, blocks)])
    last = run_batch(model, kv, BLOCK, [Chunk(prompt, len(prompt) - 1, 1, blocks)])
    assert (last[0] - theirs[-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(tiny_llama_path: str, dtype: torch.dtype) -> None:
    prompt = Tokenizer(tiny_llama_path).encode(PROMPT)
    model = load_model(tiny_llama_path, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    kv = allocate_kv_cache(model.config, 64, BLOCK, dtype, "cpu")
    half = run_batch(model, kv, BLOCK, [Chunk(prompt, 0, len(prompt), list(range(1, 64)))])
    kv32 = allocate_kv_cache(model.config, 64, BLOCK, torch.float32, "cpu")
    full = run_batch(load_model(tiny_llama_path), kv32, BLOCK, [Chunk(prompt, 0, len(prompt), list(range(1, 64)))])
    assert half.dtype == torch.float32
    assert (half - full).abs().max().item() < 0.1 * full.abs().max().item()
