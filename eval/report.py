"""Tables, CSV / JSON summaries and plots of evaluation records (``eval.apps_eval``).

One summary row per (method, tree size) over the records of one configuration:

* ``tau``: mean tokens emitted per target forward (accepted draft tokens + the bonus token);
  ``accepted_per_step``: mean accepted draft tokens per step; ``mean_nodes`` / ``mean_depth``:
  the proposed trees' size and depth;
* ``verify_ms`` / ``draft_ms`` / ``commit_ms``: mean milliseconds per step in each phase;
* ``tokens_per_s``: all new tokens over all wall time of the method;
* ``speedup_vs_<base>``: tokens/s over the base method's tokens/s, both on the problems the two
  have in common (bases: ``hf``, ``hf-static``, ``hf-assisted``);
* ``match_rate``: fraction of compared problems whose greedy tokens equal the ``hf`` reference,
  ``mean_first_divergence``: mean position of the first differing token among the others;
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

__all__ = [
    "COLUMNS",
    "SPEEDUP_BASES",
    "agreement_summary",
    "format_table",
    "plot",
    "summarize",
    "write_csv",
    "write_summary",
]

SPEEDUP_BASES = ("hf", "hf-static", "hf-assisted")
_ORDER = ("hf", "hf-static", "hf-assisted", "hf-lookup", "specdec-plain")

#: Every summary row's fields, in CSV column order.
COLUMNS = (
    "method", "tree_size", "problems", "errors", "new_tokens", "wall_s", "tokens_per_s",
    "mean_problem_tokens_per_s", "steps", "tau", "accepted_per_step", "mean_nodes", "mean_depth",
    "verify_ms", "draft_ms", "commit_ms", *(f"speedup_vs_{b.replace('-', '_')}" for b in SPEEDUP_BASES),
    "compared", "matches", "match_rate", "mean_first_divergence", "attn_prompt_len", "attn_tree_us",
    "attn_sdpa_us", "attn_speedup",
)  # fmt: skip


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def _rate(records: Iterable[Mapping[str, Any]]) -> tuple[float, float]:
    recs = list(records)
    return sum(r["new_tokens"] for r in recs), sum(r["wall_s"] for r in recs)


def _sort_key(key: tuple[str, int | None]) -> tuple:
    method, t = key
    rank = _ORDER.index(method) if method in _ORDER else len(_ORDER)
    return (method.startswith("specdec") and method != "specdec-plain", rank, method, -1 if t is None else t)


def summarize(records: Iterable[Mapping[str, Any]], attn_rows: Sequence[Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per (method, tree size) with the fields in ``COLUMNS`` (None where not applicable)."""
    ok: dict[tuple[str, int | None], dict[str, Mapping[str, Any]]] = defaultdict(dict)
    errors: dict[tuple[str, int | None], int] = defaultdict(int)
    for r in records:
        key = (r["method"], r.get("tree_size"))
        if r.get("error"):
            errors[key] += 1
        else:
            ok[key][str(r["problem_id"])] = r
    rows = []
    for key in sorted(set(ok) | set(errors), key=_sort_key):
        method, t = key
        by_problem = ok.get(key, {})
        recs = list(by_problem.values())
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row.update(method=method, tree_size=t, problems=len(recs), errors=errors.get(key, 0))
        if recs:
            new, wall = _rate(recs)
            row.update(new_tokens=int(new), wall_s=wall, tokens_per_s=new / wall if wall > 0 else None,
                       mean_problem_tokens_per_s=_mean([r["tokens_per_s"] for r in recs if r.get("tokens_per_s")]))
            _add_steps(row, recs)
            for base in SPEEDUP_BASES:
                row[f"speedup_vs_{base.replace('-', '_')}"] = _speedup(by_problem, ok.get((base, None), {}))
            compared = [r for r in recs if r.get("match") is not None]
            if compared:
                diverged = [r["first_divergence"] for r in compared if r["match"] is False]
                row.update(compared=len(compared), matches=sum(bool(r["match"]) for r in compared),
                           match_rate=sum(bool(r["match"]) for r in compared) / len(compared),
                           mean_first_divergence=_mean(diverged))
        if t is not None and attn_rows:
            _add_attention(row, [a for a in attn_rows if a.get("tree_size") == t])
        rows.append(row)
    return rows


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
    row.update(
        steps=count,
        tau=sum(flat["emitted"]) / count,
        accepted_per_step=sum(flat["accepted"]) / count,
        mean_nodes=_mean(flat["nodes"]),
        mean_depth=_mean(flat["depth"]),
        verify_ms=1e3 * sum(flat["verify_s"]) / count,
        draft_ms=1e3 * sum(flat["draft_s"]) / count,
        commit_ms=1e3 * sum(flat["commit_s"]) / count,
    )


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
    return format(val, spec)


_TABLE = (  # (header, field, format)
    ("method", "method", "s"), ("t", "tree_size", "d"), ("problems", "problems", "d"), ("tau", "tau", ".2f"),
    ("acc/step", "accepted_per_step", ".2f"), ("depth", "mean_depth", ".1f"), ("verify ms/step", "verify_ms", ".2f"),
    ("draft ms/step", "draft_ms", ".2f"), ("tok/s", "tokens_per_s", ".1f"), ("vs hf", "speedup_vs_hf", "x"),
    ("vs hf-static", "speedup_vs_hf_static", "x"), ("vs assisted", "speedup_vs_hf_assisted", "x"),
    ("same as hf", "match_rate", "%"), ("attn L", "attn_prompt_len", "d"), ("attn tree µs", "attn_tree_us", ".1f"),
    ("attn sdpa µs", "attn_sdpa_us", ".1f"), ("errors", "errors", "d"),
)  # fmt: skip


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown table of the summary rows (columns with no value in any row are left out)."""
    cols = [c for c in _TABLE if c[1] in ("method", "tree_size") or any(r.get(c[1]) not in (None, 0) for r in rows)]
    head = "| " + " | ".join(c[0] for c in cols) + " |"
    rule = "| " + " | ".join("---" for _ in cols) + " |"
    body = ["| " + " | ".join(_fmt(r.get(f), spec) for _, f, spec in cols) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def agreement_summary(records: Iterable[Mapping[str, Any]], strict: bool = False) -> str:
    """Per (method, t): how many greedy outputs equal the reference and where the others diverge."""
    groups: dict[tuple[str, int | None], list[Mapping[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("match") is not None:
            groups[(r["method"], r.get("tree_size"))].append(r)
    if not groups:
        return "greedy agreement: not compared (sampling, or no reference outputs)"
    lines = ["greedy agreement with target-only generate (hf)" + (" [fp32: any difference is a failure]" if strict else "")]
    for key in sorted(groups, key=_sort_key):
        method, t = key
        recs = groups[key]
        same = sum(bool(r["match"]) for r in recs)
        label = method if t is None else f"{method} t={t}"
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


def write_summary(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], config: Mapping[str, Any] | None = None) -> Path:
    """``{"config": ..., "rows": [...]}`` as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": dict(config or {}), "rows": list(rows)}, indent=1, default=str) + "\n")
    return path


def plot(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path | None:
    """τ and speedup against tree size as a PNG (two panels). Without matplotlib, or without
    any tree-size rows, prints why and returns None."""
    tree_rows = sorted((r for r in rows if r.get("tree_size") is not None and r.get("problems")),
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
    for method in sorted({r["method"] for r in tree_rows}):
        mine = [r for r in tree_rows if r["method"] == method]
        ts = [r["tree_size"] for r in mine]
        ax_tau.plot(ts, [r["tau"] for r in mine], marker="o", label=method)
        for base in SPEEDUP_BASES:
            ys = [r[f"speedup_vs_{base.replace('-', '_')}"] for r in mine]
            if any(y is not None for y in ys):
                ax_sp.plot(ts, [float("nan") if y is None else y for y in ys], marker="o", label=f"{method} vs {base}")
    ticks = sorted({r["tree_size"] for r in tree_rows})
    for ax in (ax_tau, ax_sp):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("tree size t (nodes)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_tau.set_ylabel("tokens per target forward (τ)")
    ax_sp.set_ylabel("end-to-end speedup (tokens/s ratio)")
    ax_sp.axhline(1.0, color="gray", linewidth=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
