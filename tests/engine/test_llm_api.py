"""The offline LLM API with vLLM's names: prompt forms, chat, metrics, TTFT, reset, salts, and clear errors."""

import pytest

from kvprefix import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(20, 60))  # 40 tokens: two full blocks can hit


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def test_text_prompts_and_chat(default_model_dir):
    llm = LLM(default_model_dir, num_gpu_blocks=64)
    out = llm.generate(["The capital of France is", "Hello"], GREEDY)
    assert [len(o.outputs[0].token_ids) for o in out] == [6, 6]
    assert all(
        isinstance(o.outputs[0].text, str) and o.prompt == p
        for o, p in zip(out, ["The capital of France is", "Hello"], strict=True)
    )
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    single = llm.chat(conversation, GREEDY)
    both = llm.chat([conversation, conversation + [{"role": "assistant", "content": "Hey"}]], GREEDY)
    assert len(single) == 1 and len(both) == 2
    assert single[0].prompt.startswith("<|im_start|>system\nBe brief.")
    assert both[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    # The second conversation extends the first: its rendered prefix is served from the cache.
    assert both[1].num_cached_tokens > 0


def test_prompt_forms_agree(llm):
    text = "a prefix cache keeps keys and values"
    ids = llm.get_tokenizer().encode(text)
    outs = llm.generate([text, ids, {"prompt_token_ids": ids}, {"prompt": text}], GREEDY)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    assert [o.prompt_token_ids for o in outs] == [ids] * 4


def test_one_params_per_prompt(llm):
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate([PROMPT] * 3, [GREEDY, GREEDY])


def test_cached_tokens_ttft_and_metrics(make_llm):
    llm = make_llm()
    first = llm.generate(PROMPT, GREEDY)[0]
    second = llm.generate(PROMPT + [7, 8], GREEDY)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    m = second.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert 0 < m.ttft <= m.latency
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_queries"] == 40 + 42 and metrics["prefix_cache_hits"] == 32
    assert metrics["prefix_cache_hit_rate"] == pytest.approx(32 / 82)
    assert metrics["prompt_tokens_computed"] == 82 - 32 and metrics["generation_tokens"] == 12
    assert metrics["requests_finished"] == 2 and metrics["num_free_blocks"] == metrics["num_blocks"]


def test_reset_prefix_cache_forgets_blocks(make_llm):
    llm = make_llm()
    llm.generate(PROMPT, GREEDY)
    assert llm.reset_prefix_cache() is True
    assert llm.generate(PROMPT, GREEDY)[0].num_cached_tokens == 0


def test_cache_salt_isolates(make_llm):
    llm = make_llm()
    llm.generate(PROMPT, GREEDY)
    assert llm.generate(PROMPT, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 0
    assert llm.generate(PROMPT, GREEDY, cache_salt="tenant-a")[0].num_cached_tokens == 32
    assert llm.generate(PROMPT, GREEDY, cache_salt="tenant-b")[0].num_cached_tokens == 0
    assert llm.generate(PROMPT, GREEDY)[0].num_cached_tokens == 32


def test_output_stops_at_the_context_limit(make_llm):
    llm = make_llm(max_model_len=48)
    out = llm.generate(PROMPT, SamplingParams(max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([[]], "empty prompt"),
        ([1, 2, 100_000], "token id 100000 is outside the vocabulary"),
        (list(range(10, 60)), "max_model_len is 48"),
        ({"text": "hi"}, "'prompt_token_ids' or 'prompt'"),
        (3.5, "a prompt must be"),
    ],
)
def test_bad_prompts_are_rejected_clearly(make_llm, prompt, message):
    llm = make_llm(max_model_len=48)
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, GREEDY)
    assert llm.get_metrics()["num_free_blocks"] == llm.get_metrics()["num_blocks"]


def test_bad_engine_arguments_are_rejected_clearly(tiny_llama_path):
    with pytest.raises(TypeError, match="accepted keywords"):
        LLM(tiny_llama_path, num_blocks=8)
    with pytest.raises(ValueError, match="prefix_caching_hash_algo 'md5'"):
        LLM(tiny_llama_path, prefix_caching_hash_algo="md5")
    with pytest.raises(ValueError, match="dtype 'int8'"):
        LLM(tiny_llama_path, dtype="int8")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        LLM(tiny_llama_path, max_num_seqs=0, num_gpu_blocks=8)
    with pytest.raises(ValueError, match="less than one KV block"):
        LLM(tiny_llama_path, kv_cache_memory=100)


def test_progress_bar(llm, capsys):
    assert len(llm.generate([PROMPT, PROMPT[:10]], GREEDY, use_tqdm=True)) == 2
    assert "Processed prompts" in capsys.readouterr().err
