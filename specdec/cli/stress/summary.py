"""A stress run's result: per-call records summed up, and the table printed at the end."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specdec.cli.stress.config import StressConfig

__all__ = ["StressResult", "format_summary", "summarize"]


@dataclass
class StressResult:
    """What ``run_stress`` returns (and writes to ``cfg.out`` as JSON).

    Attributes:
        ok: no crash and no mismatch (near ties excepted) in the calls that ran.
        summary: counts and the notable calls (see ``format_summary``).
        engines: per engine key, builds, first call and steady-state statistics.
        calls: one record per call that ran.
        config: the ``StressConfig`` as a dict.
    """

    ok: bool
    summary: dict[str, Any]
    engines: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    config: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary, "engines": self.engines, "calls": self.calls,
                "config": self.config}  # fmt: skip


def _config_dict(cfg: StressConfig) -> dict[str, Any]:
    d = asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _tally(records: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in records:
        t = out.setdefault(key(r), {"calls": 0, "ok": 0, "mismatch": 0, "error": 0, "tokens": 0})
        t["calls"] += 1
        t[r["status"]] += 1
        t["tokens"] += r.get("new_tokens", 0)
    return dict(sorted(out.items()))


def summarize(records: Sequence[dict[str, Any]], planned: int, elapsed: float, stopped: str | None) -> dict[str, Any]:
    """Counts and notable calls over ``records`` (see ``StressResult``)."""
    crashes = [{k: r.get(k) for k in ("call", "kind", "drafter", "tree_size", "mode", "batch", "stage", "error", "fatal")}
               for r in records if r["status"] == "error"]  # fmt: skip
    mism = [m for r in records for m in r.get("mismatches", [])]
    invalid = [{"call": r["call"], "problems": r["problems"]} for r in records
               if r["status"] == "mismatch" and not r.get("mismatches")]  # fmt: skip
    failing = [r for r in records if r["status"] == "mismatch" and not r.get("near_tie")]
    near = [r for r in records if r["status"] == "mismatch" and r.get("near_tie")]
    timed = [r for r in records if "wall_s" in r]
    slowest = max(timed, key=lambda r: r["wall_s"], default=None)
    slowest_keys = ("call", "kind", "drafter", "tree_size", "mode", "batch", "prompt_lens", "max_new_tokens", "wall_s",
                    "engine_new", "new_shape")  # fmt: skip
    stepped = [r for r in records if "slowest_step" in r]
    steady = [r for r in stepped if not r.get("engine_new") and not r.get("new_shape")]

    def step_of(r):
        return None if r is None else {"call": r["call"], "mode": r["mode"], "drafter": r["drafter"], "batch": r["batch"],
                                       **r["slowest_step"]}  # fmt: skip

    top_step = lambda rs: max(rs, key=lambda r: r["slowest_step"]["s"], default=None)  # noqa: E731
    fatal = next((r for r in records if r.get("fatal")), None)
    return {
        "ok": not crashes and not failing,
        "planned": planned,
        "ran": len(records),
        "stopped": stopped,
        "aborted": None if fatal is None else f"call {fatal['call']}: {fatal['error']}",
        "elapsed_s": round(elapsed, 2),
        "counts": {s: sum(r["status"] == s for r in records) for s in ("ok", "mismatch", "error")},
        "crashes": crashes,
        "mismatching_calls": len(failing),
        "near_tie_calls": len(near),
        "mismatches": mism,
        "invalid": invalid,
        "rows_compared": sum(r.get("rows_compared", 0) for r in records),
        "rows_checked": sum(r["batch"] for r in records if r["status"] != "error"),
        "by_kind": _tally(records, lambda r: r["kind"]),
        "by_drafter": _tally([r for r in records if r["kind"] == "spec"], lambda r: r["drafter"]),
        "by_mode": _tally(records, lambda r: r["mode"]),
        "by_decoding": _tally(records, lambda r: "sample" if r["do_sample"] else "greedy"),
        "by_group": _tally(records, lambda r: f"{r['kind']} {r['drafter'] or '-'} {r['mode']}" if r["kind"] == "spec"
                           else f"{r['kind']} - -"),  # fmt: skip
        "slowest_call": None if slowest is None else {k: slowest.get(k) for k in slowest_keys},
        "slowest_step": step_of(top_step(stepped)),
        "slowest_steady_step": step_of(top_step(steady)),
        "hf_first_calls": [{k: r.get(k) for k in ("call", "kind", "batch", "wall_s")} for r in records
                           if r["kind"] != "spec" and r.get("new_shape") and "wall_s" in r],
    }  # fmt: skip


def format_summary(result: StressResult) -> str:
    """A short table of the run for stdout."""
    s = result.summary
    c = s["counts"]
    lines = [
        f"stress: {s['ran']}/{s['planned']} calls in {s['elapsed_s']:.1f} s on {s['device']} ({s['models']})"
        + (f", stopped: {s['stopped']}" if s["stopped"] else ""),
        f"  ok {c['ok']}, mismatch {c['mismatch']} ({s['near_tie_calls']} near ties only), crashes {c['error']}; "
        f"rows compared with the prompt alone: {s['rows_compared']}, rows checked: {s['rows_checked']}",
    ]
    if s.get("aborted"):
        lines.append(f"  ABORTED (CUDA context lost) at {s['aborted']}")
    lines.append(f"  {'kind':<10} {'drafter':<8} {'mode':<16} {'calls':>5} {'ok':>4} {'mism':>4} {'err':>4} {'tokens':>7}")
    for group, t in s["by_group"].items():
        kind, drafter, mode = group.split(" ")
        lines.append(f"  {kind:<10} {drafter:<8} {mode:<16} {t['calls']:>5} {t['ok']:>4} {t['mismatch']:>4} "
                     f"{t['error']:>4} {t['tokens']:>7}")  # fmt: skip
    if s["slowest_call"]:
        sc = s["slowest_call"]
        lines.append(f"  slowest call: #{sc['call']} {sc['kind']} {sc['drafter'] or ''} {sc['mode']} batch {sc['batch']} "
                     f"new {sc['max_new_tokens']}: {sc['wall_s']:.3f} s"
                     + (" (engine built)" if sc.get("engine_new") else " (new shape)" if sc.get("new_shape") else ""))
    for label in ("slowest_step", "slowest_steady_step"):
        st = s[label]
        if st:
            lines.append(f"  {label.replace('_', ' ')}: #{st['call']} {st['drafter']} {st['mode']} batch {st['batch']} "
                         f"step {st['step']}: {st['s'] * 1e3:.1f} ms (draft {st['draft_s'] * 1e3:.1f}, verify "
                         f"{st['verify_s'] * 1e3:.1f}, commit {st['commit_s'] * 1e3:.1f})")  # fmt: skip
    firsts = [e for e in result.engines if e["first_call_s"] is not None]
    if firsts:
        worst = max(firsts, key=lambda e: e["first_call_s"] + e["build_s"])
        lines.append(f"  engines: {len(result.engines)} ({s['engines_dropped']} drops); slowest first call: "
                     f"{worst['engine']} "
                     f"build {worst['build_s']:.2f} s + first call {worst['first_call_s']:.2f} s, steady median "
                     f"{worst['steady_median_s'] if worst['steady_median_s'] is not None else '-'} s")  # fmt: skip
    for cr in s["crashes"][:5]:
        lines.append(f"  CRASH #{cr['call']} {cr['kind']} {cr['drafter'] or ''} {cr['mode']} batch {cr['batch']} "
                     f"(in the {cr['stage']}): {cr['error'][:200]}")  # fmt: skip
    for m in s["mismatches"][:5]:
        tie = f", near tie (gap {m['logit_gap']:.2e})" if m.get("near_tie") else ""
        lines.append(f"  MISMATCH #{m['call']} row {m['row']} {m['kind']} {m['drafter'] or ''} {m['mode']} at new token "
                     f"{m['position']}: got {m['got']}, want {m['want']}{tie}")  # fmt: skip
    for inv in s["invalid"][:5]:
        lines.append(f"  INVALID #{inv['call']}: {'; '.join(inv['problems'][:3])}")
    lines.append("  result: " + ("OK" if result.ok else "FAILED"))
    return "\n".join(lines)


def _write_json(path: str, result: StressResult) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=1, default=str) + "\n")
    os.replace(tmp, p)
