"""LoRA adapters in the engine: greedy outputs equal transformers + peft for a batch mixing the base model and two
adapters (caching on and off, chunked, preempted), and each adapter's blocks live in a namespace of its content."""

import random
import shutil

import pytest
from support.lora_adapters import peft_greedy

from kvprefix import LoRARequest, SamplingParams
from kvprefix.engine import LoraNotFoundError
from kvprefix.model import write_random_lora_adapter

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tiny_llama_path, tmp_path_factory) -> dict[str, str]:
    """Two adapters: every projection at rank 8, and q/v/down only at rank 4."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all8": write_random_lora_adapter(tiny_llama_path, str(root / "all8"), rank=8, seed=1),
        "qvd4": write_random_lora_adapter(tiny_llama_path, str(root / "qvd4"), rank=4, seed=2,
                                   targets=("q_proj", "v_proj", "down_proj")),
    }


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Nine prompts over a shared 40-token prefix, each with its own tail."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 500) for _ in range(40)]
    return [prefix + [rng.randrange(3, 500) for _ in range(rng.randint(2, 12))] for _ in range(9)]


@pytest.fixture(scope="module")
def assignment(adapters) -> list[str | None]:
    return [[None, "all8", "qvd4"][i % 3] for i in range(9)]


@pytest.fixture(scope="module")
def reference(tiny_llama_path, adapters, prompts, assignment) -> list[list[int]]:
    """transformers + peft, per prompt with its adapter (or none)."""
    out: list = [None] * len(prompts)
    for name in (None, "all8", "qvd4"):
        rows = [i for i, a in enumerate(assignment) if a == name]
        for i, tokens in zip(rows, peft_greedy(tiny_llama_path, name and adapters[name], [prompts[i] for i in rows],
                                               MAX_TOKENS), strict=True):
            out[i] = tokens
    return out


def lora_requests(adapters, assignment) -> list[LoRARequest | None]:
    ids = {"all8": 1, "qvd4": 2}
    return [None if a is None else LoRARequest(a, ids[a], adapters[a]) for a in assignment]


@pytest.mark.parametrize("overrides", [
    dict(enable_prefix_caching=False, max_num_seqs=1),
    dict(enable_prefix_caching=False),
    dict(),
    dict(max_num_batched_tokens=24, max_num_seqs=4),  # chunks end mid-block
    dict(num_gpu_blocks=10, max_num_seqs=9),  # 10 blocks for 9 requests of 3-4 blocks: preemption
], ids=["off-sequential", "off-batched", "on", "chunked", "preempted"])
def test_mixed_batch_matches_transformers_peft(make_llm, assert_no_leaks, adapters, prompts, assignment, reference,
                                              overrides):
    llm = make_llm(enable_lora=True, max_loras=2, **overrides)
    outputs = llm.generate(prompts, GREEDY, lora_request=lora_requests(adapters, assignment))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert len({tuple(reference[i]) for i in range(3)}) == 3  # the adapters really change the outputs
    if overrides.get("num_gpu_blocks"):
        assert llm.get_metrics()["num_preemptions"] > 0
    assert_no_leaks(llm)


def test_each_adapter_hits_only_its_own_blocks(make_llm, assert_no_leaks, adapters, prompts):
    llm = make_llm(enable_lora=True)
    a = LoRARequest("all8", 1, adapters["all8"])
    long_prompt = prompts[0] * 2  # 84+ tokens: 5 full blocks
    first = [llm.generate([long_prompt], GREEDY, lora_request=r)[0] for r in (None, a)]
    assert [o.num_cached_tokens for o in first] == [0, 0]  # the base's blocks never serve the adapter
    assert first[0].namespace_id != first[1].namespace_id
    again = [llm.generate([long_prompt], GREEDY, lora_request=r)[0] for r in (a, None)]
    full = (len(long_prompt) - 1) // 16 * 16
    assert [o.num_cached_tokens for o in again] == [full, full]
    assert again[0].outputs[0].token_ids == first[1].outputs[0].token_ids
    assert_no_leaks(llm)


def test_namespace_follows_content_not_name(make_llm, tiny_llama_path, adapters, prompts, tmp_path):
    llm = make_llm(enable_lora=True, max_loras=2)
    copy = shutil.copytree(adapters["all8"], tmp_path / "copy")
    llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("all8", 1, adapters["all8"]))
    twin = llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("twin", 3, str(copy)))[0]
    assert twin.num_cached_tokens == 32  # another name for the same bytes shares the blocks
    # The name "twin" unloaded and loaded again with other weights: a new namespace.
    llm.llm_engine.loras.unload("twin")
    write_random_lora_adapter(tiny_llama_path, str(copy), rank=8, seed=9)
    retrained = llm.generate([prompts[0]], GREEDY, lora_request=LoRARequest("twin", 3, str(copy)))[0]
    assert retrained.num_cached_tokens == 0
    assert retrained.namespace_id != twin.namespace_id


def test_max_loras_bounds_the_adapters_of_a_step(make_llm, assert_no_leaks, adapters, prompts, assignment,
                                                 reference):
    llm = make_llm(enable_lora=True, max_loras=1)
    seen = []
    scheduler = llm.llm_engine.scheduler
    schedule = scheduler.schedule

    def spy():
        out = schedule()
        seen.append({id(s.request.lora) for s in out.scheduled if s.request.lora is not None})
        return out

    scheduler.schedule = spy
    outputs = llm.generate(prompts, GREEDY, lora_request=lora_requests(adapters, assignment))
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 2
    assert_no_leaks(llm)


def test_unknown_and_disabled_adapters_are_refused(make_llm, adapters, prompts):
    with pytest.raises(ValueError, match="enable_lora=True"):
        make_llm().generate([prompts[0]], GREEDY, lora_request=LoRARequest("all8", 1, adapters["all8"]))
    llm = make_llm(enable_lora=True)
    with pytest.raises(LoraNotFoundError, match="The model `nope` does not exist"):
        llm.llm_engine.add_request("x", prompts[0], GREEDY, lora_request=LoRARequest("nope", 1))
    with pytest.raises(ValueError, match="deterministic=True does not serve LoRA adapters"):
        make_llm(enable_lora=True, deterministic=True)


def test_adapters_apply_to_compact_weights(make_llm, adapters, prompts):
    """int8 weights replace the projections; the adapter hooks them all the same (its shapes come from the config)."""
    llm = make_llm(enable_lora=True, quantization="int8", dtype="bfloat16")
    base, adapted = llm.generate([prompts[0]] * 2, GREEDY, lora_request=[None, LoRARequest("all8", 1,
                                                                                           adapters["all8"])])
    assert base.outputs[0].token_ids != adapted.outputs[0].token_ids
    assert base.namespace_id != adapted.namespace_id


@pytest.mark.slow
def test_adapter_on_the_builtin_default_model_matches_transformers_peft(tmp_path):
    """SmolLM2-135M-Instruct (the GGUF the engine serves by default, dequantized) written as a transformers
    checkpoint, an adapter made by peft on it, and the greedy tokens of both engines for a base and an adapted
    request in one batch."""
    import torch
    import transformers

    from kvprefix import LLM
    from kvprefix.cache.default_model import default_model_path
    from kvprefix.model import load_model

    ours = load_model(default_model_path(), dtype=torch.float32)
    c = ours.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings)
    reference = transformers.LlamaForCausalLM(config)
    reference.load_state_dict(ours.checkpoint_views(), strict=False)
    reference.save_pretrained(tmp_path / "smollm2")
    del ours, reference
    adapter = write_random_lora_adapter(str(tmp_path / "smollm2"), str(tmp_path / "adapter"), rank=16, seed=5,
                                        scale=0.05)
    llm = LLM(enable_lora=True, dtype="float32", quantization="none", device="cpu", num_gpu_blocks=128)
    prompt = llm.get_tokenizer().encode("The capital of France is")
    outs = llm.generate([prompt, prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        lora_request=[None, LoRARequest("smol", 1, adapter)])
    base, adapted = (o.outputs[0].token_ids for o in outs)
    assert base == peft_greedy(str(tmp_path / "smollm2"), None, [prompt], 12)[0]
    assert adapted == peft_greedy(str(tmp_path / "smollm2"), adapter, [prompt], 12)[0]
    assert base != adapted
