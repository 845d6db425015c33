"""Steady state, stalls, first-call latency and the streaming latency distribution of a method's calls.

Pure functions over evaluation records (``eval.runner``); ``eval.report`` puts their results in the
summary rows. Definitions (also in docs/RESULTS.md):

**Emissions.** Every timed call records when its tokens became visible on the host: ``emit_t``
(seconds since the call started, device synchronized) and ``emit_n`` (tokens made visible at that
moment). The engine reports each step's tokens through its ``on_tokens`` callback (after the
step's KV commit); HF ``generate`` through a streamer (``put`` after each step's tokens reach the
host; HF's loop reads them every step anyway). A step of a speculative method that emits k tokens
is one emission of k tokens.

**Time to first token** (``ttft``): ``emit_t[0]``, the prompt prefill plus the first step.

**Time between tokens** (inter-token latency, what a streaming user sees): for every emitted token
after the first, the time since the previous token became visible. The first token of an emission
gets the time since the previous emission; the other k - 1 tokens of the same emission get 0 (they
arrive together). A call of N tokens gives N - 1 gaps; a method's p50 / p90 / p99 are taken over
the gaps of all its timed calls pooled (warm-up calls excluded; linear interpolation between
ranks). With speculative decoding at τ > 2 more than half the gaps are 0, so p50 can be 0 and p90 /
p99 show the step time.

**Steady state and stalls.** A call's pace is its wall time per forward step: ``wall_s / num_steps``
for a speculative call (one verify step each, whatever it accepted), ``wall_s / new_tokens`` for a
call without ``num_steps`` (HF ``generate``: one forward per token). Among a method's timed calls
that are not its first call in a process (a call with no warm-up before it is flagged
``first_call`` and left out), a call whose pace is at least ``STALL_RATIO`` (3) x the median pace
of those calls is a *stall*. Per step, not per token: a drafter accepts more on some problems than
on others (prompt lookup: τ 1 to 8), so a call's time per token varies by several x without any
stall, while its time per step stays put unless something (a recompile, a capture, an allocator
stall) took time outside the steps' usual work. Steady-state tokens/s is all new tokens over all
wall time of the remaining calls (neither first calls nor stalls). ``stall_s`` is the stalls' total
wall time and ``stall_excess_s`` what they took beyond the median pace (``wall - steps x
median``). Detecting a stall needs at least three steady calls (with two, the median is their mean).

**First-call latency** (``first_call_s``): what a method costs in a fresh process before its first
generation returns, compile and capture included: the declared warm-up (``SpecDecoder.warmup``:
every fixed-shape forward compiled / captured ahead) plus the wall time of the first warm-up
generation (``WARMUP_TOKENS`` new tokens; HF static compiles its decode there). Loading weights
(the drafter's heads, a draft model) is apart (``load_s``). From the first process that ran the
method on this results file; without warm-up records, from the method's ``first_call`` record.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "STALL_RATIO",
    "clip_emissions",
    "first_call_summary",
    "latency_summary",
    "percentile",
    "stall_summary",
    "token_gaps",
]

#: A call whose time per forward step is at least this multiple of its method's median is a stall.
STALL_RATIO = 3.0


def clip_emissions(emit_t: Sequence[float], emit_n: Sequence[int], total: int | None = None) -> tuple[list[float], list[int]]:
    """The emissions up to ``total`` tokens (the call's kept tokens: a streamer may have seen tokens
    past eos or ``max_new_tokens`` that the result cuts); empty emissions dropped."""
    if len(emit_t) != len(emit_n):
        raise ValueError(f"emit_n: expected one count per time ({len(emit_t)}), got {len(emit_n)}")
    ts, ns, left = [], [], math.inf if total is None else int(total)
    for t, n in zip(emit_t, emit_n):
        n = min(int(n), left)
        if n <= 0:
            continue
        ts.append(float(t))
        ns.append(n)
        left -= n
        if left <= 0:
            break
    return ts, ns


def token_gaps(emit_t: Sequence[float], emit_n: Sequence[int], total: int | None = None) -> list[float]:
    """Seconds between consecutive visible tokens of one call (``len = tokens - 1``): the first
    token of an emission gets the time since the previous emission, the rest of it 0."""
    ts, ns = clip_emissions(emit_t, emit_n, total)
    gaps: list[float] = []
    for i, (t, n) in enumerate(zip(ts, ns)):
        if i > 0:
            gaps.append(max(t - ts[i - 1], 0.0))
        gaps.extend([0.0] * (n - 1))
    return gaps


def percentile(xs: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of ``xs`` by linear interpolation between ranks (numpy's
    default); None for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: expected a percentile in [0, 100], got {q}")
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def latency_summary(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """p50 / p90 / p99 of the time between tokens (ms) pooled over the records' calls, and the
    median / p90 time to first token; None where no record has emission times."""
    gaps: list[float] = []
    ttft: list[float] = []
    for r in records:
        t, n = r.get("emit_t"), r.get("emit_n")
        if not t or not n:
            continue
        ts, _ = clip_emissions(t, n, r.get("new_tokens"))
        if not ts:
            continue
        ttft.append(ts[0])
        gaps.extend(token_gaps(t, n, r.get("new_tokens")))

    def ms(x: float | None) -> float | None:
        return None if x is None else 1e3 * x

    return {
        "itl_p50_ms": ms(percentile(gaps, 50)), "itl_p90_ms": ms(percentile(gaps, 90)),
        "itl_p99_ms": ms(percentile(gaps, 99)), "itl_max_ms": ms(max(gaps)) if gaps else None,
        "latency_gaps": len(gaps), "ttft_p50_ms": ms(percentile(ttft, 50)), "ttft_p90_ms": ms(percentile(ttft, 90)),
    }  # fmt: skip


def _steps(r: Mapping[str, Any]) -> int:
    """Forward steps of a call: ``num_steps`` where recorded (speculative), else one per new token."""
    return int(r.get("num_steps") or r["new_tokens"])


def stall_summary(records: Sequence[Mapping[str, Any]], ratio: float = STALL_RATIO) -> dict[str, Any]:
    """Steady state and stalls of one method's timed calls (records without errors, any order).

    Returns ``first_calls`` (calls flagged ``first_call``, left out), ``steady_calls``,
    ``median_ms_per_step`` (the pace the stall test compares against), ``median_ms_per_token``,
    ``steady_tokens_per_s``, ``stalls``, ``stall_s``, ``stall_excess_s``, ``stall_problems``
    (problem ids) and ``steady_problems`` (ids of the steady calls).
    """
    if ratio <= 1:
        raise ValueError(f"ratio: expected a multiple > 1 of the median time per step, got {ratio}")
    first = [r for r in records if r.get("first_call")]
    calls = [r for r in records if not r.get("first_call") and r.get("new_tokens") and r.get("wall_s")]
    out: dict[str, Any] = {
        "first_calls": len(first), "steady_calls": 0, "median_ms_per_step": None, "median_ms_per_token": None,
        "steady_tokens_per_s": None, "stalls": None, "stall_s": None, "stall_excess_s": None, "stall_problems": [],
        "steady_problems": [],
    }  # fmt: skip
    if not calls:
        return out
    pace = [r["wall_s"] / _steps(r) for r in calls]
    med = statistics.median(pace)
    bar = ratio * med * (1 - 1e-9)  # "at least ratio x", robust to rounding
    stalled = [r for r, p in zip(calls, pace) if p >= bar]
    steady = [r for r, p in zip(calls, pace) if p < bar]
    new, wall = sum(r["new_tokens"] for r in steady), sum(r["wall_s"] for r in steady)
    out.update(
        steady_calls=len(steady), median_ms_per_step=1e3 * med,
        median_ms_per_token=1e3 * statistics.median(r["wall_s"] / r["new_tokens"] for r in calls),
        steady_tokens_per_s=new / wall if wall > 0 else None,
        stalls=len(stalled), stall_s=sum(r["wall_s"] for r in stalled),
        stall_excess_s=sum(r["wall_s"] - _steps(r) * med for r in stalled),
        stall_problems=[str(r.get("problem_id")) for r in stalled],
        steady_problems=[str(r.get("problem_id")) for r in steady],
    )  # fmt: skip
    return out


def first_call_summary(warmups: Sequence[Mapping[str, Any]], records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """First-call latency of one method: from its first warm-up record (file order), else from its
    timed record flagged ``first_call``; ``first_call_processes``: how many processes warmed it up."""
    out: dict[str, Any] = {"first_call_s": None, "first_call_tokens": None, "first_call_prep_s": None,
                           "load_s": None, "first_call_processes": len(warmups)}  # fmt: skip
    src = warmups[0] if warmups else next((r for r in records if r.get("first_call")), None)
    if src is None or src.get("wall_s") is None:
        return out
    prep = float(src.get("prep_s") or 0.0)
    out.update(first_call_s=prep + float(src["wall_s"]), first_call_tokens=src.get("new_tokens"),
               first_call_prep_s=prep, load_s=src.get("load_s"))  # fmt: skip
    return out
