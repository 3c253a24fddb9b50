"""Whatever mix of requests, aborts, preemptions, n > 1 and beam searches ran, an idle engine holds no block."""

import random

import pytest

from kvprefix import BeamSearchParams, SamplingParams


@pytest.mark.parametrize("seed", [0, 1])
def test_random_aborts_and_preemptions_leave_every_block_free(make_llm, assert_no_leaks, seed):
    rng = random.Random(seed)
    llm = make_llm(num_gpu_blocks=14, max_num_seqs=6, max_num_batched_tokens=40)
    engine = llm.llm_engine
    shared = [rng.randrange(3, 500) for _ in range(40)]
    live: list[str] = []
    for i in range(40):
        prompt = shared[: rng.randint(1, 40)] + [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.25:  # a beam search: beams forked, parked, queued and freed among the rest
            params = BeamSearchParams(beam_width=rng.choice([2, 3]), max_tokens=rng.randint(1, 30),
                                      temperature=rng.choice([0.0, 1.0]))
        else:
            params = SamplingParams(
                n=rng.choice([1, 1, 2, 3]),
                temperature=rng.choice([0.0, 1.0]),
                max_tokens=rng.randint(1, 40),
                ignore_eos=True,
            )
        engine.add_request(f"r{i}", prompt, params)
        live.append(f"r{i}")
        for _ in range(rng.randint(0, 4)):
            for out in engine.step():
                if out.finished:
                    live.remove(out.request_id)
        if live and rng.random() < 0.3:
            victim = live.pop(rng.randrange(len(live)))
            last = engine.abort_request(victim)  # its unfinished samples end with "abort"
            assert last.finished and last.samples and all(s.finish_reason == "abort" for s in last.samples)
    while engine.has_unfinished_requests():
        engine.step()
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["requests_aborted"] > 0
    assert metrics["requests_finished"] + metrics["requests_aborted"] == 40
    assert_no_leaks(llm)
    assert engine.abort_request("r0") is None  # finished or aborted ids are gone


def test_an_exception_mid_generate_frees_the_batch(make_llm, assert_no_leaks, monkeypatch):
    llm = make_llm()
    engine = llm.llm_engine
    real_step = engine.step
    calls = iter(range(100))

    def failing_step():
        if next(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5] * 40, [6] * 50], SamplingParams(max_tokens=20, ignore_eos=True))
    assert not engine.has_unfinished_requests()
    assert_no_leaks(llm)


@pytest.mark.parametrize("seed", [0, 1])
def test_aborted_and_preempted_leaders_and_followers_leave_every_block_free(make_llm, assert_no_leaks, seed):
    """Bursts of requests over a few cold prefixes (so most of them wait behind an in-flight leader), with leaders
    and followers aborted at random and a pool small enough to preempt them."""
    rng = random.Random(seed)
    llm = make_llm(num_gpu_blocks=20, max_num_seqs=8, max_num_batched_tokens=200)
    engine = llm.llm_engine
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.choice([33, 48, 70]))] for _ in range(3)]
    live: list[str] = []
    for i in range(48):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(n=rng.choice([1, 1, 2]), temperature=0.0, max_tokens=rng.randint(1, 24),
                                ignore_eos=True)
        engine.add_request(f"r{i}", prompt, params)
        live.append(f"r{i}")
        if rng.random() < 0.4:  # bursts: several arrive before the next step
            continue
        for out in engine.step():
            if out.finished:
                live.remove(out.request_id)
        running = {r.request_id.split("_")[-1] for r in engine.scheduler.running}
        if live and rng.random() < 0.4:  # a running one (often a leader) or a waiting one (often a follower)
            pool = [r for r in live if (r in running) == (rng.random() < 0.5)] or live
            victim = rng.choice(pool)
            live.remove(victim)
            engine.abort_request(victim)
    while engine.has_unfinished_requests():
        engine.step()
    metrics = llm.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["requests_aborted"] > 0
    assert metrics["num_inflight_prefix_waits"] > 0
    assert metrics["requests_finished"] + metrics["requests_aborted"] == 48
    assert_no_leaks(llm)
