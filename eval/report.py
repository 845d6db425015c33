"""Tables, CSV / JSON summaries and plots of evaluation records (``eval.runner``).

One summary row per (method, drafter, tree size) over the records of one configuration; the
baselines (no drafter, no tree size) are shared by every drafter's rows:

* ``tau``: mean tokens emitted per target forward (accepted draft tokens + the bonus token);
  ``accepted_per_step``: mean accepted draft tokens per step; ``mean_nodes`` / ``mean_depth``:
  the proposed trees' size and depth;
* ``verify_ms`` / ``draft_ms`` / ``commit_ms``: mean milliseconds per step in each phase;
  ``draft_phase_ms`` (summary JSON only, when the records have ``steps.draft_phases``: a profiling
  drafter, e.g. ``eagle:...,profile=true``): ``{phase: mean ms per step}`` inside ``draft_ms``;
* ``samples``: completions per record (``--samples n`` > 1: each call makes n at once; None for one);
* ``tokens_per_s``: all new tokens over all wall time of the method's timed calls (stalls included);
  with several samples per call, every sample's tokens over the batched calls' time (aggregate);
* ``steady_tokens_per_s``, ``stalls``, ``stall_s``, ``stall_excess_s``, ``first_call_s``: steady
  state apart from stalls and from the first call (compile / capture included), ``eval.latency``;
* ``itl_p50_ms`` / ``itl_p90_ms`` / ``itl_p99_ms``: time between streamed tokens, ``ttft_p50_ms``:
  time to first token (``eval.latency``);
* ``gc_ms``: mean milliseconds per timed call spent in Python garbage collection (records' ``gc_s``;
  None for records made before it was kept), ``gc_full``: full collections per call;
* ``speedup_vs_<base>``: tokens/s over the base method's tokens/s, both on the problems the two
  have in common (bases: ``hf``, ``hf-static``, ``hf-assisted``, ``specdec-plain``: the engine
  without a drafter, what speculation itself adds); ``steady_speedup_vs_hf_static`` /
  ``steady_speedup_vs_specdec_plain``: the same over the problems where neither call was a first
  call or a stall;
  ``same_run_speedup_vs_hf_static``: the same ratio with HF static's time on each problem scaled to
  the speed of the process that ran the row's call, measured by that process's calibration records
  (``EvalConfig.calibrate``: HF static timed again there on a few problems); None unless every call
  of the row has one;
* ``match_rate``: fraction of compared problems whose greedy tokens equal the ``hf`` reference,
  ``mean_first_divergence``: mean position of the first differing token among the others;
* ``pass_at_1``: fraction of problems whose completion passed its tests (records' ``passed``,
  written by ``specdec eval|sweep --check`` / ``specdec check``, ``eval.passk``; None otherwise);
  ``pass_at_1_diff`` (``_low`` / ``_high``): pass@1 minus that of ``pass_at_1_reference``
  (``hf-static``, else ``hf``) over the problems both have, with Tango's paired 95% interval;
  with several samples per record (``eval.passk.pass_fields``): pass@1 is the mean of c / n over
  problems, ``pass_at_10`` the mean unbiased pass@10 estimate (when n >= 10), each with a 95%
  percentile bootstrap interval over problems (``_low`` / ``_high``), and ``pass_at_k_diff`` the
  paired bootstrap difference to the reference's;
* ``attn_*``: attention-only µs per layer (``eval.attn_timing``) at the median prompt length.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from eval.latency import STALL_RATIO, first_call_summary, latency_summary, stall_summary
from eval.passk import PASS_KS, default_reference, paired_pass_diff, pass_fields
from eval.records import is_calibration, is_timed, is_warmup, record_drafter, row_sort_key

__all__ = [
    "COLUMNS",
    "DEFINITIONS",
    "SPEEDUP_BASES",
    "OVERALL",
    "agreement_summary",
    "category_rows",
    "dataset_note",
    "format_category_table",
    "format_table",
    "plot",
    "summarize",
    "write_csv",
    "write_summary",
]

SPEEDUP_BASES = ("hf", "hf-static", "hf-assisted", "specdec-plain")

#: Every summary row's fields, in CSV column order (the summary JSON also has ``stall_problems`` and,
#: when recorded, ``draft_phase_ms``).
COLUMNS = (
    "method", "drafter", "tree_size", "drafter_key", "problems", "samples", "errors", "new_tokens", "wall_s",
    "tokens_per_s", "mean_problem_tokens_per_s", "steady_tokens_per_s", "steady_calls", "median_ms_per_step",
    "median_ms_per_token",
    "first_calls", "stalls", "stall_s", "stall_excess_s", "first_call_s", "first_call_tokens", "first_call_prep_s",
    "load_s", "first_call_processes", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "itl_max_ms", "latency_gaps",
    "ttft_p50_ms", "ttft_p90_ms", "gc_ms", "gc_full", "steps", "tau", "accepted_per_step", "mean_nodes",
    "mean_depth", "verify_ms", "draft_ms", "commit_ms", *(f"speedup_vs_{b.replace('-', '_')}" for b in SPEEDUP_BASES),
    "steady_speedup_vs_hf_static", "steady_speedup_vs_specdec_plain", "same_run_speedup_vs_hf_static", "compared",
    "matches", "match_rate", "mean_first_divergence", "checked",
    "pass_at_1", "pass_at_1_low", "pass_at_1_high", "pass_at_1_reference", "pass_at_1_diff", "pass_at_1_diff_low",
    "pass_at_1_diff_high", "pass_at_10", "pass_at_10_low", "pass_at_10_high", "pass_at_10_diff",
    "pass_at_10_diff_low", "pass_at_10_diff_high", "attn_prompt_len", "attn_tree_us", "attn_sdpa_us", "attn_speedup",
)  # fmt: skip

#: What the summary JSON says its timing fields mean (see ``eval.latency``).
DEFINITIONS = {
    "tokens_per_s": "all new tokens / all wall time of the method's timed calls (first calls and stalls included); "
                    "with samples > 1 every sample's tokens / the batched calls' time (aggregate)",
    "samples": "completions per call and record (num_return_sequences); None: one",
    "steady_tokens_per_s": "the same over the calls that are neither a first call in a process nor a stall",
    "stall": f"a timed call whose time per forward step (wall_s / num_steps; HF generate: / new_tokens) is >= "
             f"{STALL_RATIO:g} x the method's median over its non-first calls",
    "stall_s": "total wall time of the stalls; stall_excess_s: their time beyond steps x the median time per step",
    "first_call_s": "declared warm-up (SpecDecoder.warmup: compile / capture) + the first warm-up generation's wall "
                    "time, in the first process that ran the method; load_s (weights, decoder) apart",
    "itl": "time between consecutive streamed tokens: an emission of k tokens gives its first token the time since "
           "the previous emission and the other k - 1 tokens 0; p50 / p90 / p99 over all timed calls pooled",
    "ttft": "time from the call's start to its first visible token (prefill + first step)",
    "gc_ms": "mean ms per timed call spent in Python garbage collection (gc.callbacks around the call); gc_full: "
             "mean full (generation-2) collections per call",
    "same_run_speedup_vs_hf_static": "tokens/s over HF static's, HF static's time on each problem scaled by the "
                                     "ratio of its time in the call's process to its time in its own records, "
                                     "both on that process's calibration problems",
    "pass_at_1": "fraction of the row's problems whose completion passed its tests (records' 'passed')",
    "pass_at_1_diff": "pass_at_1 minus pass_at_1_reference's (hf-static, else hf) over the problems both have a "
                      "verdict for; _low / _high: Tango's paired score interval (95%); with samples > 1 the "
                      "paired percentile bootstrap interval over problems (95%, 10,000 resamplings, seed 0)",
    "pass_at_k": "with samples > 1: mean over problems of the unbiased estimate 1 - C(n - c, k) / C(n, k) (Chen et "
                 "al. 2021; c of n samples correct; k = 1: c / n; k = 10 when n >= 10); _low / _high: percentile "
                 "bootstrap interval over problems (95%, 10,000 resamplings, seed 0); pass_at_k_diff: minus the "
                 "reference's, paired, with the paired bootstrap interval",
}  # fmt: skip


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _rate(records: Iterable[Mapping[str, Any]]) -> tuple[float, float]:
    recs = list(records)
    return sum(r["new_tokens"] for r in recs), sum(r["wall_s"] for r in recs)


_RowKey = tuple  # (method, drafter key or None, tree size or None)


def _row_key(r: Mapping[str, Any]) -> _RowKey:
    return (r["method"], record_drafter(r), r.get("tree_size"))


def summarize(records: Iterable[Mapping[str, Any]], attn_rows: Sequence[Mapping[str, Any]] | None = None,
              stall_ratio: float = STALL_RATIO) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (method, drafter, tree size) with the fields in ``COLUMNS`` (None where not
    applicable), plus ``stall_problems``. ``records`` may hold warm-up records (first-call latency)."""
    records = sorted(records, key=lambda r: not is_timed(r))  # timed first (stable): drafters ordered as they ran
    calibration: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)  # run id -> problem -> record
    warm: dict[_RowKey, list[Mapping[str, Any]]] = defaultdict(list)
    ok: dict[_RowKey, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    errors: dict[_RowKey, int] = defaultdict(int)
    labels: dict[str | None, str] = {}
    drafter_order: dict[str | None, int] = {}
    for r in records:
        if not (is_timed(r) or is_warmup(r) or is_calibration(r)):  # another side record (a context answer)
            continue
        key = _row_key(r)
        if key[1] is not None:
            labels[key[1]] = str(r.get("drafter_label") or key[1])
            drafter_order.setdefault(key[1], len(drafter_order))
        if is_calibration(r):
            calibration[str(r.get("run_id"))][str(r["problem_id"])] = r
        elif is_warmup(r):
            warm[key].append(r)
        elif r.get("error"):
            errors[key] += 1
        else:
            ok[key].pop(str(r["problem_id"]), None)
            ok[key][str(r["problem_id"])] = r
    rows = []
    for key in sorted(set(ok) | set(errors), key=lambda k: row_sort_key(k, drafter_order)):
        method, drafter, t = key
        by_problem = ok.get(key, {})
        recs = list(by_problem.values())
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row.update(method=method, drafter=labels.get(drafter), drafter_key=drafter, tree_size=t, problems=len(recs),
                   errors=errors.get(key, 0), stall_problems=[])  # fmt: skip
        row.update(first_call_summary(warm.get(key, []), recs))
        if recs:
            new, wall = _rate(recs)
            row.update(new_tokens=int(new), wall_s=wall, tokens_per_s=new / wall if wall > 0 else None,
                       mean_problem_tokens_per_s=_mean([r["tokens_per_s"] for r in recs if r.get("tokens_per_s")]))
            stalls = stall_summary(recs, stall_ratio)
            row["_steady"] = set(stalls.pop("steady_problems"))
            row.update(stalls)
            row.update(latency_summary(recs))
            gcs = [r for r in recs if r.get("gc_s") is not None]
            if gcs:
                row.update(gc_ms=1e3 * statistics.fmean(r["gc_s"] for r in gcs),
                           gc_full=statistics.fmean(r.get("gc_full") or 0 for r in gcs))
            _add_steps(row, recs)
            for base in SPEEDUP_BASES:
                row[f"speedup_vs_{base.replace('-', '_')}"] = _speedup(by_problem, ok.get((base, None, None), {}))
            compared = [r for r in recs if r.get("match") is not None]
            if compared:
                diverged = [r["first_divergence"] for r in compared if r["match"] is False]
                row.update(compared=len(compared), matches=sum(bool(r["match"]) for r in compared),
                           match_rate=sum(bool(r["match"]) for r in compared) / len(compared),
                           mean_first_divergence=_mean(diverged))
            sampled = [r["num_samples"] for r in recs if r.get("num_samples")]
            if sampled:
                row["samples"] = min(sampled)
            # verdicts: 'passed' (or 'sample_passed') from the runner's checker or eval.passk.check_file
            row.update({k: v for k, v in pass_fields(by_problem).items() if k in COLUMNS})
        if t is not None and attn_rows:
            _add_attention(row, [a for a in attn_rows if a.get("tree_size") == t])
        rows.append(row)
    for name in ("hf-static", "specdec-plain"):
        base = next((r for r in rows if (r["method"], r["drafter_key"], r["tree_size"]) == (name, None, None)), None)
        for row in rows:
            if base is not None and row.get("_steady") is not None and base.get("_steady") is not None:
                common = row["_steady"] & base["_steady"]
                mine, theirs = ok.get(_key_of(row), {}), ok.get((name, None, None), {})
                field = f"steady_speedup_vs_{name.replace('-', '_')}"
                row[field] = _speedup({p: mine[p] for p in common}, {p: theirs[p] for p in common})
    static = ok.get(("hf-static", None, None), {})
    scales = _run_scales(static, calibration)
    for row in rows:
        if row["drafter_key"] is not None:
            row["same_run_speedup_vs_hf_static"] = _same_run_speedup(ok.get(_key_of(row), {}), static, scales)
    _add_pass_diff(rows, ok)
    for row in rows:
        row.pop("_steady", None)
    return rows


def _run_scales(base: Mapping[str, Mapping[str, Any]],
                calibration: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> dict[str, float]:  # fmt: skip
    """{run id: HF static's time in that process / its time in ``base``}, over the problems the
    process calibrated on that ``base`` has; a process whose own records are ``base``'s counts 1."""
    runs: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for p, r in base.items():
        runs[str(r.get("run_id"))][p] = r
    for run, recs in calibration.items():
        runs[run].update(recs)
    scales = {}
    for run, recs in runs.items():
        common = [p for p in recs if p in base]
        mine, theirs = sum(recs[p]["wall_s"] for p in common), sum(base[p]["wall_s"] for p in common)
        if common and mine > 0 and theirs > 0:
            scales[run] = mine / theirs
    return scales


def _same_run_speedup(mine: Mapping[str, Mapping[str, Any]], base: Mapping[str, Mapping[str, Any]],
                      scales: Mapping[str, float]) -> float | None:  # fmt: skip
    """tokens/s of ``mine`` over HF static's on the same problems, each problem's HF static time
    scaled to the speed of the process that ran ``mine``'s call; None unless all are covered."""
    if not mine or any(p not in base or str(r.get("run_id")) not in scales for p, r in mine.items()):
        return None
    new_m, wall_m = _rate(mine.values())
    new_b = sum(base[p]["new_tokens"] for p in mine)
    wall_b = sum(base[p]["wall_s"] * scales[str(r.get("run_id"))] for p, r in mine.items())
    if wall_m <= 0 or wall_b <= 0 or new_b <= 0:
        return None
    return (new_m / wall_m) / (new_b / wall_b)


def _add_pass_diff(rows: list[dict[str, Any]], ok: Mapping[_RowKey, Mapping[str, Mapping[str, Any]]]) -> None:
    """``pass_at_k_diff`` (``_low`` / ``_high``) of every checked row against the reference baseline,
    for each k the row has a ``pass_at_k`` of."""
    ref = default_reference(r["method"] for r in rows if r.get("checked") and r["drafter_key"] is None
                            and r["tree_size"] is None)  # fmt: skip
    if ref is None:
        return
    for row in rows:
        if not row.get("checked") or _key_of(row) == (ref, None, None):
            continue
        for k in (k for k in PASS_KS if row.get(f"pass_at_{k}") is not None):
            d = paired_pass_diff(ok.get(_key_of(row), {}), ok.get((ref, None, None), {}), k=k)
            if d is not None:
                row.update({"pass_at_1_reference": ref, f"pass_at_{k}_diff": d.diff, f"pass_at_{k}_diff_low": d.low,
                            f"pass_at_{k}_diff_high": d.high})  # fmt: skip


def _key_of(row: Mapping[str, Any]) -> _RowKey:
    return (row["method"], row["drafter_key"], row["tree_size"])


def _add_steps(row: dict[str, Any], recs: Sequence[Mapping[str, Any]]) -> None:
    steps = [r["steps"] for r in recs if r.get("steps")]
    if not steps:
        return
    flat = defaultdict(list)
    for s in steps:
        for name, vals in s.items():
            flat[name].extend(v for v in vals if v is not None)
    count = len(flat["emitted"])
    if not count:
        return

    def per_sequence(name: str) -> float | None:
        """Mean over (step, decoding sequence) pairs: a step of a call with several samples holds the
        sum over its ``active`` sequences (one per step without ``active``); None values left out."""
        total = pairs = 0
        for s in steps:
            vals = s.get(name) or []
            for v, a in zip(vals, s.get("active") or [1] * len(vals)):
                if v is not None:
                    total, pairs = total + v, pairs + a
        return total / pairs if pairs else None

    row.update(
        steps=count,
        tau=per_sequence("emitted"),
        accepted_per_step=per_sequence("accepted"),
        mean_nodes=per_sequence("nodes"),
        mean_depth=per_sequence("depth"),
        verify_ms=1e3 * sum(flat["verify_s"]) / count,
        draft_ms=1e3 * sum(flat["draft_s"]) / count,
        commit_ms=1e3 * sum(flat["commit_s"]) / count,
    )
    phases = flat.pop("draft_phases", [])
    if phases:  # mean over the steps that timed the phase
        names = dict.fromkeys(k for p in phases for k in p)
        row["draft_phase_ms"] = {k: 1e3 * statistics.fmean(p[k] for p in phases if k in p) for k in names}


def _speedup(mine: Mapping[str, Mapping[str, Any]], base: Mapping[str, Mapping[str, Any]]) -> float | None:
    common = sorted(set(mine) & set(base))
    if not common:
        return None
    new_m, wall_m = _rate(mine[p] for p in common)
    new_b, wall_b = _rate(base[p] for p in common)
    if wall_m <= 0 or wall_b <= 0 or new_b <= 0:
        return None
    return (new_m / wall_m) / (new_b / wall_b)


def _add_attention(row: dict[str, Any], attn: Sequence[Mapping[str, Any]]) -> None:
    if not attn:
        return
    lens = sorted(a["prompt_len"] for a in attn)
    mid = statistics.median_low(lens)
    cell = next(a for a in attn if a["prompt_len"] == mid)
    row.update(attn_prompt_len=mid, attn_tree_us=cell["tree_us"], attn_sdpa_us=cell["sdpa_us"],
               attn_speedup=cell.get("speedup"))  # fmt: skip


# ----------------------------------------------------------------------------------------------
# text


def _fmt(val: Any, spec: str) -> str:
    if val is None:
        return "-"
    if spec == "x":
        return f"{val:.2f}x"
    if spec == "%":
        return f"{val:.0%}"
    if spec == "t":  # a tree size: an int or "auto"
        return str(val)
    return format(val, spec)


_TABLE = (  # (header, field, format)
    ("method", "method", "s"), ("drafter", "drafter", "s"), ("t", "tree_size", "t"), ("problems", "problems", "d"),
    ("n", "samples", "d"),
    ("tau", "tau", ".2f"), ("acc/step", "accepted_per_step", ".2f"), ("depth", "mean_depth", ".1f"),
    ("verify ms/step", "verify_ms", ".2f"), ("draft ms/step", "draft_ms", ".2f"), ("tok/s", "tokens_per_s", ".1f"),
    ("steady tok/s", "steady_tokens_per_s", ".1f"), ("vs hf", "speedup_vs_hf", "x"),
    ("vs hf-static", "speedup_vs_hf_static", "x"), ("steady vs hf-static", "steady_speedup_vs_hf_static", "x"),
    ("vs hf-static same process", "same_run_speedup_vs_hf_static", "x"),
    ("vs assisted", "speedup_vs_hf_assisted", "x"), ("vs specdec-plain", "speedup_vs_specdec_plain", "x"),
    ("steady vs specdec-plain", "steady_speedup_vs_specdec_plain", "x"),
    ("stalls", "stalls", "d"), ("stall s", "stall_s", ".2f"),
    ("first call s", "first_call_s", ".2f"), ("itl p50 ms", "itl_p50_ms", ".2f"), ("itl p90 ms", "itl_p90_ms", ".2f"),
    ("itl p99 ms", "itl_p99_ms", ".2f"), ("ttft p50 ms", "ttft_p50_ms", ".1f"), ("gc ms/call", "gc_ms", ".2f"),
    ("same as hf", "match_rate", "%"),
    ("pass@1", "pass_at_1", "pk"), ("Δpass@1", "pass_at_1_diff", "ci"), ("pass@10", "pass_at_10", "pk"),
    ("Δpass@10", "pass_at_10_diff", "ci"), ("attn L", "attn_prompt_len", "d"),
    ("attn tree µs", "attn_tree_us", ".1f"),
    ("attn sdpa µs", "attn_sdpa_us", ".1f"), ("errors", "errors", "d"),
)  # fmt: skip
#: Columns shown even when every row has 0 there (a column of Nones is always left out).
_SHOW_ZERO = ("stalls", "stall_s", "itl_p50_ms", "pass_at_1", "pass_at_1_diff", "pass_at_10", "pass_at_10_diff")


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table of the summary rows (columns with no value in any row are left out)."""

    def shown(field: str) -> bool:
        empty = (None,) if field in _SHOW_ZERO else (None, 0)
        return field in ("method", "tree_size") or any(r.get(field) not in empty for r in rows)

    cols = [c for c in _TABLE if shown(c[1])]
    ref = next((r["pass_at_1_reference"] for r in rows if r.get("pass_at_1_reference")), None)
    names = [f"{name} vs {ref} pp (95% CI)" if spec == "ci" else name for name, f, spec in cols]
    head = "| " + " | ".join(names) + " |"
    rule = "| " + " | ".join("---" for _ in cols) + " |"
    body = ["| " + " | ".join(_cell(r, f, spec) for _, f, spec in cols) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def _cell(row: Mapping[str, Any], field: str, spec: str) -> str:
    if spec == "pk":  # a pass rate, with its interval when it has one (several samples)
        val, low, high = (row.get(f"{field}{s}") for s in ("", "_low", "_high"))
        if val is None or low is None:
            return _fmt(val, "%")
        return f"{100 * val:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"
    if spec != "ci":
        return _fmt(row.get(field), spec)
    diff, low, high = (row.get(f"{field}{s}") for s in ("", "_low", "_high"))
    if diff is None:
        return "-"
    return f"{100 * diff:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}]"


#: The per-category table's columns (``format_category_table``).
_CATEGORY_TABLE = (
    ("category", "category", "s"), ("method", "method", "s"), ("drafter", "drafter", "s"), ("t", "tree_size", "t"),
    ("problems", "problems", "d"), ("tau", "tau", ".2f"), ("tok/s", "tokens_per_s", ".1f"),
    ("steady tok/s", "steady_tokens_per_s", ".1f"), ("vs specdec-plain", "speedup_vs_specdec_plain", "x"),
    ("steady vs specdec-plain", "steady_speedup_vs_specdec_plain", "x"), ("vs hf-static", "speedup_vs_hf_static", "x"),
    ("stalls", "stalls", "d"), ("errors", "errors", "d"),
)  # fmt: skip
#: The category of the rows over every record (``category_rows``).
OVERALL = "overall"


def category_rows(records: Iterable[Mapping[str, Any]], field: str = "difficulty",
                  stall_ratio: float = STALL_RATIO) -> list[dict[str, Any]]:  # fmt: skip
    """:func:`summarize` per category of the timed records (their ``field``: a Spec-Bench category
    or a prompt file's ``category``, kept as ``difficulty``), in the records' order, then over all
    records (category :data:`OVERALL`, warm-ups included); each row gets a ``category`` field.
    Speedups are pooled within each category (its tokens over its time)."""
    records = list(records)
    timed = [r for r in records if is_timed(r)]
    cats = list(dict.fromkeys(str(r[field]) for r in timed if r.get(field) is not None))
    out = []
    for cat in cats:
        rows = summarize([r for r in timed if str(r.get(field)) == cat], stall_ratio=stall_ratio)
        out += [{**row, "category": cat} for row in rows]
    out += [{**row, "category": OVERALL} for row in summarize(records, stall_ratio=stall_ratio)]
    return out


def format_category_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table of :func:`category_rows`: per category and row, tau, tokens/s (all calls and
    steady state), the speedups over ``specdec-plain`` (all calls and steady state) and HF static,
    stalls (columns without a value in any row left out)."""
    cols = [c for c in _CATEGORY_TABLE
            if c[1] in ("category", "method", "tree_size") or any(r.get(c[1]) not in (None,) for r in rows)]  # fmt: skip
    head = "| " + " | ".join(name for name, _, _ in cols) + " |"
    rule = "| " + " | ".join("---" for _ in cols) + " |"
    body = ["| " + " | ".join(_cell(r, f, spec) for _, f, spec in cols) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def dataset_note(dataset: str | None) -> str | None:
    """What a table of ``dataset`` leaves out: pass@1 for the datasets without tests, else None."""
    from eval.datasets import CHAT_DATASETS

    if dataset in CHAT_DATASETS:
        name = "Spec-Bench" if dataset == "specbench" else "a prompt file"
        return f"pass@1: none -- {name} has no tests (speed, tau and stalls only)"
    return None


def agreement_summary(records: Iterable[Mapping[str, Any]], strict: bool = False) -> str:
    """Per (method, drafter, t): how many greedy outputs equal the reference and where the others diverge."""
    groups: dict[_RowKey, list[Mapping[str, Any]]] = defaultdict(list)
    labels: dict[str | None, str] = {}
    order: dict[str | None, int] = {}
    for r in records:
        if not is_timed(r) or r.get("match") is None:
            continue
        key = _row_key(r)
        groups[key].append(r)
        if key[1] is not None:
            labels[key[1]] = str(r.get("drafter_label") or key[1])
            order.setdefault(key[1], len(order))
    if not groups:
        return "greedy agreement: not compared (sampling, or no reference outputs)"
    lines = ["greedy agreement with target-only generate (hf)" + (" [fp32: any difference is a failure]" if strict else "")]
    for key in sorted(groups, key=lambda k: row_sort_key(k, order)):
        method, drafter, t = key
        recs = groups[key]
        same = sum(bool(r["match"]) for r in recs)
        label = method if drafter is None else f"{method} {labels[drafter]}"
        label += "" if t is None else f" t={t}"
        line = f"  {label}: {same}/{len(recs)} identical"
        diverged = sorted((str(r["problem_id"]), r["first_divergence"]) for r in recs if r["match"] is False)
        if diverged:
            line += "; first divergence " + ", ".join(f"{p}@{pos}" for p, pos in diverged)
            if strict:
                line += "  <-- GREEDY MISMATCH"
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# files


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """The summary rows as CSV with the columns in ``COLUMNS`` (empty cells for None)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: "" if r.get(k) is None else r.get(k) for k in COLUMNS})
    return path


def write_summary(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], config: Mapping[str, Any] | None = None,
                  categories: Sequence[Mapping[str, Any]] | None = None, note: str | None = None) -> Path:  # fmt: skip
    """``{"config": ..., "definitions": DEFINITIONS, "rows": [...]}`` as JSON, with
    ``"categories"`` (:func:`category_rows`) and ``"note"`` (:func:`dataset_note`) when given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": dict(config or {}), "definitions": DEFINITIONS, "rows": list(rows)}
    if categories is not None:
        doc["categories"] = list(categories)
    if note is not None:
        doc["note"] = note
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return path


def _series(row: Mapping[str, Any]) -> str:
    """The plot line a tree-size row belongs to: its drafter's label (other methods prefixed)."""
    drafter = row.get("drafter")
    if row["method"] == "specdec":
        return str(drafter or "specdec")
    return f"{row['method']} {drafter}" if drafter else row["method"]


def _speedup_field(rows: Sequence[Mapping[str, Any]]) -> tuple[str | None, str]:
    """The speedup the plot shows: x HF static in steady state, else x HF static over all calls,
    else the first other base with values."""
    choices = [("steady_speedup_vs_hf_static", "× HF static, steady state (tokens/s ratio)"),
               ("speedup_vs_hf_static", "× HF static (tokens/s ratio)")]  # fmt: skip
    choices += [(f"speedup_vs_{b.replace('-', '_')}", f"× {b} (tokens/s ratio)") for b in SPEEDUP_BASES if b != "hf-static"]
    for field, label in choices:
        if any(r.get(field) is not None for r in rows):
            return field, label
    return None, "speedup (no baseline in this run)"


def plot(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path | None:
    """τ and × HF static against tree size as a PNG (two panels, one line per drafter; rows of
    ``tree_size`` ``"auto"`` have no place on that axis). Without matplotlib, or without any
    tree-size rows, prints why and returns None."""
    tree_rows = sorted((r for r in rows if isinstance(r.get("tree_size"), int) and r.get("problems")),
                       key=lambda r: r["tree_size"])  # fmt: skip
    if not tree_rows:
        print("plot: skipped (no rows with a tree size)", file=sys.stderr)
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot: skipped (matplotlib is not installed; pip install 'specdec[plot]')", file=sys.stderr)
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_tau, ax_sp) = plt.subplots(1, 2, figsize=(10, 4))
    field, ylabel = _speedup_field(tree_rows)
    for name in dict.fromkeys(_series(r) for r in tree_rows):
        mine = [r for r in tree_rows if _series(r) == name]
        ts = [r["tree_size"] for r in mine]
        ax_tau.plot(ts, [float("nan") if r.get("tau") is None else r["tau"] for r in mine], marker="o", label=name)
        if field is not None:
            ys = [r.get(field) for r in mine]
            ax_sp.plot(ts, [float("nan") if y is None else y for y in ys], marker="o", label=name)
    ticks = sorted({r["tree_size"] for r in tree_rows})
    for ax in (ax_tau, ax_sp):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tree size t (nodes)")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    ax_tau.set_ylabel("tokens per target forward (τ)")
    ax_sp.set_ylabel(ylabel)
    ax_sp.axhline(1.0, color="gray", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
