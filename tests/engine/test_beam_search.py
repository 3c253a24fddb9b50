"""Beam search in the engine: equal to a brute-force search over transformers' full-sequence logprobs, width 1 is
greedy, the prompt hits the prefix cache, beams share their prefix's blocks and free them, and it runs batched with
other requests, under tight seats and a small pool (parked and queued beams) alike."""

import pytest
import torch
import transformers

from kvprefix import BeamSearchParams, SamplingParams
from kvprefix.engine.outputs import RequestOutputKind

PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 59)), list(range(100, 132))]  # 5, 19 and 32 tokens: partial, full blocks


@pytest.fixture(scope="module")
def hf(tiny_llama_path):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def reference_beam_search(hf, prompt, width, max_tokens, eos, length_penalty=1.0):
    """vLLM's beam search written out plainly: every live beam's whole sequence through transformers each step, its
    2 x width most likely next tokens as candidates; EOS candidates finish, the best ``width`` others live on."""
    live, finished = [([], 0.0)], []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens for tokens, _ in live])).logits[:, -1]
        candidates = []
        for (tokens, cum), row in zip(live, torch.log_softmax(logits.float(), dim=-1), strict=True):
            values, ids = row.topk(2 * width)
            for value, token in zip(values.tolist(), ids.tolist(), strict=True):
                if token in eos:
                    finished.append((tokens + [token], cum + value, "stop"))
                else:
                    candidates.append((tokens + [token], cum + value))
        live = sorted(candidates, key=lambda c: -c[1])[:width]
    finished += [(tokens, cum, "length") for tokens, cum in live]

    def score(item):
        tokens, cum, _ = item
        return cum / (len(prompt) + len(tokens) - (tokens[-1] in eos)) ** length_penalty

    return sorted(finished, key=score, reverse=True)[:width]


def run(engine, request_id, prompt, params):
    """Steps the engine until the request is done; its final output."""
    state = engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.request_id == request_id:
                state.apply(delta)
    return state.output(RequestOutputKind.CUMULATIVE)


@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize(("width", "length_penalty"), [(2, 1.0), (3, 0.5), (4, 2.0)])
def test_equals_a_brute_force_beam_search(make_llm, hf, block_size, width, length_penalty):
    llm = make_llm(block_size=block_size)
    eos = llm.llm_engine.eos_token_ids
    text_prompt = llm.get_tokenizer().encode("hello world")
    params = BeamSearchParams(beam_width=width, max_tokens=10, length_penalty=length_penalty)
    outs = llm.beam_search([*PROMPTS, text_prompt], params)
    reasons = set()
    for prompt, out in zip([*PROMPTS, text_prompt], outs, strict=True):
        expected = reference_beam_search(hf, prompt, width, 10, eos, length_penalty)
        got = [(s.tokens[len(prompt):], s.cum_logprob, s.finish_reason) for s in out.sequences]
        assert [(t, r) for t, _, r in got] == [(t, r) for t, _, r in expected]
        assert [c for _, c, _ in got] == pytest.approx([c for _, c, _ in expected], abs=1e-3)
        reasons |= {r for _, _, r in got}
    assert reasons == {"stop", "length"}  # both ways of ending were exercised


def test_results_have_vllms_shape(make_llm):
    llm = make_llm()
    (out,) = llm.beam_search([PROMPTS[1]], BeamSearchParams(beam_width=3, max_tokens=6))
    assert len(out.sequences) == 3
    tokenizer = llm.get_tokenizer()
    for s in out.sequences:
        assert s.tokens[:19] == PROMPTS[1] and len(s.tokens) == 19 + len(s.logprobs)
        assert s.text == tokenizer.decode(s.tokens, False)  # the whole sequence, as vLLM decodes it
        assert s.cum_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(s.logprobs, s.tokens[19:], strict=True)))
        assert all(len(e) >= 6 for e in s.logprobs)  # each step's 2 x width candidates


def test_width_one_is_greedy(make_llm):
    llm = make_llm()
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    assert [b.sequences[0].tokens for b in beams] == [p + g.outputs[0].token_ids
                                                      for p, g in zip(PROMPTS, greedy, strict=True)]


def test_the_prompt_hits_the_cache_and_every_block_is_freed(make_llm, assert_no_leaks):
    llm = make_llm()
    engine = llm.llm_engine
    prompt = list(range(200, 240))  # 40 tokens: two full blocks
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    first = run(engine, "a", prompt, params)
    assert_no_leaks(llm)
    second = run(engine, "b", prompt, params)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    metrics = llm.get_metrics()
    # The prompt is looked up once per search, not once per beam or step.
    assert (metrics["prefix_cache_queries"], metrics["prefix_cache_hits"]) == (80, 32)
    assert metrics["requests_finished"] == 2
    assert_no_leaks(llm)


def test_beams_share_the_prefix_blocks_and_copy_only_the_partial_one(make_llm, assert_no_leaks):
    llm = make_llm(block_size=4)
    engine = llm.llm_engine
    manager = engine.manager
    prompt = list(range(300, 318))  # 18 tokens: 4 full blocks and a partial one
    engine.add_request("s", prompt, BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True))
    for _ in range(6):  # the prompt's step, then five decode steps: every beam holds 24 tokens, 23 computed
        engine.step()
    beams = engine._requests["s"].samples
    assert len(beams) == 4 and all(b.num_tokens == 24 and b.num_computed_tokens == 23 for b in beams)
    tables = [manager.req_to_blocks[b.request_id] for b in beams]
    prompt_blocks = tables[0][:4]
    assert all(t[:4] == prompt_blocks for t in tables)  # the prompt's full blocks: shared, not copied
    assert all(b.ref_cnt == 4 for b in prompt_blocks)
    last = [t[-1] for t in tables]
    assert len({b.block_id for b in last}) == 4 and all(b.ref_cnt == 1 for b in last)  # written: one each
    # Four beams of 24 tokens hold far fewer than 4 x 6 blocks: what they have in common is stored once.
    assert manager.pool.num_used_blocks < 4 * 6
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(llm)


@pytest.mark.parametrize("tight", [dict(max_num_seqs=3, max_num_batched_tokens=24, num_gpu_blocks=24),
                                   dict(max_num_seqs=6, max_num_batched_tokens=32, num_gpu_blocks=14)])
def test_tight_seats_and_a_small_pool_give_the_same_beams(make_llm, assert_no_leaks, tight):
    """Fewer seats than beams, or a pool that preempts: forks that find no seat or block are queued, beams computed
    before their siblings are parked (both re-admitted from their cached blocks); the search is the same."""
    params = BeamSearchParams(beam_width=4, max_tokens=14)
    free = make_llm().beam_search(PROMPTS, params)
    llm = make_llm(block_size=4, **tight)
    assert [[s.tokens for s in o.sequences] for o in llm.beam_search(PROMPTS, params)] == \
        [[s.tokens for s in o.sequences] for o in free]
    metrics = llm.get_metrics()
    assert metrics["prefix_cache_preempted_admissions"] > 0
    assert tight["max_num_seqs"] < 4 or metrics["num_preemptions"] > 0
    assert_no_leaks(llm)


def test_beams_run_in_the_same_steps_as_other_requests(make_llm, assert_no_leaks):
    llm = make_llm()
    engine = llm.llm_engine
    runner = engine.runner
    steps = []
    execute = runner.execute

    def recording(sched, *args):
        steps.append({s.request.request_id for s in sched.scheduled})
        return execute(sched, *args)

    runner.execute = recording
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    states = {"g": engine.add_request("g", PROMPTS[2], greedy), "s": engine.add_request("s", PROMPTS[1], params)}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            states[delta.request_id].apply(delta)
    runner.execute = execute
    assert sum(1 for ids in steps if "g" in ids and any(i.startswith("s") for i in ids)) >= 9
    alone = llm.generate([PROMPTS[2]], greedy)[0].outputs[0].token_ids
    (searched,) = llm.beam_search([PROMPTS[1]], params)
    assert states["g"].output(RequestOutputKind.CUMULATIVE).outputs[0].token_ids == alone
    assert [o.token_ids for o in states["s"].output(RequestOutputKind.CUMULATIVE).outputs] == \
        [s.tokens[19:] for s in searched.sequences]
    assert_no_leaks(llm)


def test_an_abort_ends_every_result_and_frees_the_beams(make_llm, assert_no_leaks):
    llm = make_llm()
    engine = llm.llm_engine
    engine.add_request("s", PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=30, ignore_eos=True))
    for _ in range(5):
        assert engine.step() == []  # nothing is reported before the search is done
    last = engine.abort_request("s")
    assert last.finished and [s.finish_reason for s in last.samples] == ["abort"] * 3
    assert not engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_bad_parameters_are_one_line_errors(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1, got 0"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))
    with pytest.raises(ValueError, match="beam_width 300 needs 600 candidate tokens; the vocabulary has 512"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=300, max_tokens=4))
    with pytest.raises(ValueError, match="concurrency_limit must be >= 1"):
        llm.beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4), concurrency_limit=0)


def test_concurrency_limit_runs_the_prompts_in_parts(make_llm):
    llm = make_llm()
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    together = llm.beam_search(PROMPTS, params)
    parts = llm.beam_search(PROMPTS, params, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in parts] == [[s.tokens for s in o.sequences] for o in together]
