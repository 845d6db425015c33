"""Time between tokens, time to first token, steady state, stalls and first-call latency on
synthetic records (``eval.latency``)."""

from __future__ import annotations

import pytest

from eval import latency as L


def test_token_gaps_give_an_emission_its_time_once():
    # 1 token at 0.1 s, 3 at 0.15 s, 1 at 0.25 s: 5 tokens, 4 gaps
    assert L.token_gaps([0.1, 0.15, 0.25], [1, 3, 1]) == pytest.approx([0.05, 0.0, 0.0, 0.1])
    assert L.token_gaps([0.1], [4]) == [0.0, 0.0, 0.0]  # one emission: everything arrives together
    assert L.token_gaps([], []) == []
    # a streamer saw tokens past eos / max_new_tokens: only the kept ones count
    assert L.clip_emissions([0.1, 0.2, 0.3], [2, 2, 2], total=3) == ([0.1, 0.2], [2, 1])
    assert L.token_gaps([0.1, 0.2, 0.3], [2, 2, 2], total=3) == pytest.approx([0.0, 0.1])
    assert L.clip_emissions([0.1, 0.2], [0, 1]) == ([0.2], [1])
    with pytest.raises(ValueError, match="emit_n: expected one count per time"):
        L.token_gaps([0.1, 0.2], [1])


def test_percentiles_interpolate_between_ranks():
    xs = list(range(1, 101))  # 1..100
    assert L.percentile(xs, 50) == pytest.approx(50.5)
    assert L.percentile(xs, 90) == pytest.approx(90.1)
    assert L.percentile(xs, 99) == pytest.approx(99.01)
    assert L.percentile([3.0], 99) == 3.0 and L.percentile([], 50) is None
    assert L.percentile([4, 1, 3, 2], 0) == 1 and L.percentile([4, 1, 3, 2], 100) == 4
    with pytest.raises(ValueError, match="q: expected a percentile in"):
        L.percentile(xs, 101)


def test_latency_summary_pools_calls():
    recs = [
        # plain decoding: one token per step, 10 ms apart (ttft 50 ms)
        {"new_tokens": 11, "emit_t": [0.05 + 0.01 * i for i in range(11)], "emit_n": [1] * 11},
        # speculative: 3 tokens per 20 ms step -> gaps 20, 0, 0, ...
        {"new_tokens": 9, "emit_t": [0.03, 0.05, 0.07], "emit_n": [3, 3, 3]},
        {"new_tokens": 5},  # no emission times (an older record): left out
    ]
    got = L.latency_summary(recs)
    gaps = [10.0] * 10 + [0.0, 0.0, 20.0, 0.0, 0.0, 20.0, 0.0, 0.0]
    assert got["latency_gaps"] == len(gaps) == 18
    for q in (50, 90, 99):
        assert got[f"itl_p{q}_ms"] == pytest.approx(L.percentile(gaps, q))
    assert got["itl_p50_ms"] == pytest.approx(10.0) and got["itl_max_ms"] == pytest.approx(20.0)
    assert got["ttft_p50_ms"] == pytest.approx(40.0)
    assert L.latency_summary([{"new_tokens": 3}])["itl_p50_ms"] is None


def _call(pid, new, wall, **kw):
    return {"problem_id": pid, "new_tokens": new, "wall_s": wall, **kw}


def test_stalls_apart_from_steady_state():
    calls = [_call(str(i), 10, 1.0) for i in range(5)]
    calls[2] = _call("2", 10, 3.0)  # exactly 3x the median per-token time: a stall
    calls.append(_call("5", 5, 1.4))  # 2.8x: not one
    calls.append(_call("first", 10, 60.0, first_call=True))  # compile in the first call: apart
    got = L.stall_summary(calls)
    assert got["first_calls"] == 1 and got["steady_calls"] == 5
    assert got["median_ms_per_token"] == pytest.approx(100.0)
    assert (got["stalls"], got["stall_problems"]) == (1, ["2"])
    assert got["stall_s"] == pytest.approx(3.0) and got["stall_excess_s"] == pytest.approx(2.0)
    assert got["steady_tokens_per_s"] == pytest.approx(45 / 5.4)
    assert got["steady_problems"] == ["0", "1", "3", "4", "5"]
    assert L.stall_summary(calls, ratio=10)["stalls"] == 0
    assert L.stall_summary([_call("a", 1, 1.0, first_call=True)])["stalls"] is None
    with pytest.raises(ValueError, match="ratio: expected a multiple > 1"):
        L.stall_summary(calls, ratio=1.0)


def test_stalls_are_judged_per_step_not_per_token():
    """A drafter that accepts little on one problem is slow per token but not per step: no stall.
    A call whose steps took 4x their usual time is one, whatever it accepted."""
    calls = [_call(str(i), 100, 0.1, num_steps=20) for i in range(6)]  # 5 ms a step, 1 ms a token
    calls.append(_call("low-acceptance", 100, 0.5, num_steps=100))  # 5 ms a step, 5 ms a token
    calls.append(_call("recompile", 100, 0.4, num_steps=20))  # 20 ms a step
    got = L.stall_summary(calls)
    assert got["median_ms_per_step"] == pytest.approx(5.0)
    assert got["median_ms_per_token"] == pytest.approx(1.0)
    assert (got["stalls"], got["stall_problems"]) == (1, ["recompile"])
    assert got["stall_excess_s"] == pytest.approx(0.4 - 20 * 0.005)
    assert "low-acceptance" in got["steady_problems"]


def test_first_call_summary():
    warm = [{"wall_s": 30.0, "prep_s": 12.0, "load_s": 0.5, "new_tokens": 16}, {"wall_s": 2.0, "prep_s": 1.0}]
    got = L.first_call_summary(warm, [])
    assert got == {"first_call_s": 42.0, "first_call_tokens": 16, "first_call_prep_s": 12.0, "load_s": 0.5,
                   "first_call_processes": 2}  # fmt: skip
    timed = [_call("1", 10, 5.0, first_call=True, prep_s=None, load_s=0.1), _call("2", 10, 1.0)]
    assert L.first_call_summary([], timed)["first_call_s"] == 5.0
    assert L.first_call_summary([], timed[1:])["first_call_s"] is None
