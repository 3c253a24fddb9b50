"""Request ids: n > 1 sample ids (f"{i}_{request_id}") must not clash with other requests' ids, and an engine whose
requests the scheduler lost fails loudly instead of stepping forever."""

import pytest

from kvprefix import SamplingParams

P = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
P2 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=2)


def test_a_sample_id_that_equals_a_request_id_is_rejected(make_llm, assert_no_leaks):
    llm = make_llm(num_gpu_blocks=64)
    engine = llm.llm_engine
    states = {"0_x": engine.add_request("0_x", list(range(10, 50)), P)}
    with pytest.raises(ValueError, match="'0_x'"):
        engine.add_request("x", list(range(100, 140)), P2)  # its first sample would be "0_x"
    states["y"] = engine.add_request("y", list(range(100, 140)), P2)  # samples "0_y", "1_y"
    with pytest.raises(ValueError, match="'1_y'"):
        engine.add_request("1_y", list(range(10, 50)), P)
    finals = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for delta in engine.step():
            states[delta.request_id].apply(delta)
            if delta.finished:
                finals[delta.request_id] = states[delta.request_id].output()
    assert sorted(finals) == ["0_x", "y"]
    assert [len(c.token_ids) for c in finals["y"].outputs] == [8, 8]
    assert_no_leaks(llm)


def test_unfinished_requests_the_scheduler_lost_fail_the_step(make_llm):
    engine = make_llm(num_gpu_blocks=64).llm_engine
    engine.add_request("lost", list(range(10, 50)), P)
    engine.scheduler.waiting.clear()  # an inconsistent state, as a clashing id used to leave behind
    with pytest.raises(RuntimeError, match="'lost'"):
        engine.step()
