"""(d) batch throughput: speculative decoding (Medusa heads, prompt lookup, an EAGLE head) at each batch
size and node budget -- fixed, ``auto`` (every step's budget) and 0 (``specdec-plain``, the engine without
a drafter) -- vs HF ``generate`` with the static cache on left-padded batches; ``batch_summary`` holds
``auto`` against plain decoding and the best fixed budget at each batch size."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from specdec.cli.bench.common import fmt, free_memory
from specdec.cli.bench.setup import Setup, cut_at_eos, make_engine


def _batch_groups(num_prompts: int, batch: int) -> list[list[int]]:
    """Prompt indices per call: rows cycle through the prompts; enough calls to cover them all."""
    calls = -(-num_prompts // batch)
    return [[(k * batch + i) % num_prompts for i in range(batch)] for k in range(calls)]


def _hf_generate_batch(setup: Setup, prompts: list, new: int) -> list[list[int]]:
    """HF ``generate`` with the static cache on a left-padded batch; new tokens per row (cut at eos)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), setup.pad, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    out = setup.target.generate(ids.to(setup.device), attention_mask=mask.to(setup.device), max_new_tokens=new,
                                do_sample=False, eos_token_id=setup.eos or None, pad_token_id=setup.pad,
                                cache_implementation="static", max_cache_len=setup.capacity)  # fmt: skip
    return [cut_at_eos(out[b, width:].tolist(), setup.eos, new) for b in range(len(prompts))]


#: the batch section's method name of the engine without a drafter (a batch tree size of 0)
PLAIN = "specdec-plain"


def batch_tree_sizes(cfg) -> tuple[int | str, ...]:
    """The batch rows' node budgets: ``cfg.batch_tree_sizes``, else ``(cfg.spec_tree_size,)``."""
    return tuple(cfg.batch_tree_sizes) or (cfg.spec_tree_size,)


def _make_drafter(setup: Setup, method: str, tree_size: int | str, compiled: bool):
    from drafters import make_drafter

    if method == "medusa":
        return make_drafter("medusa", target=setup.target, heads=setup.medusa)
    if method == "eagle":
        options = {"compile_head": compiled, **dict(setup.cfg.eagle_options)}  # --eagle-option compile_head=... wins
        return make_drafter("eagle", target=setup.target, heads=setup.cfg.eagle_heads, device=setup.device,
                            dtype=setup.dtype, **options)  # fmt: skip
    return make_drafter(method, tree_size=None if tree_size == "auto" else tree_size)  # auto: each step's budget caps it


def run_batch(setup: Setup, method: str, batch: int, reference: dict[str, Any], log: Callable[[str], None],
              tree_size: int | str | None = None) -> dict[str, Any]:  # fmt: skip
    """Decode every call of ``_batch_groups`` at batch size ``batch`` with ``method`` (a batch drafter,
    ``PLAIN`` or ``"hf-static"``) at node budget ``tree_size`` (an int or ``"auto"``; None:
    ``cfg.spec_tree_size``), after a warm-up at that batch size (with static shapes
    ``SpecDecoder.warmup`` first: every forward, with ``"auto"`` every budget's and its timing, and the
    drafter's caches sized for the longest request; then one full-length call, whose drafter captures
    -- EAGLE's per catch-up width -- then do not land in the timed calls); throughput and acceptance.
    ``steady_tokens_per_s`` leaves out the captures that still ran inside the timed calls (``capture_s``).

    ``reference``: ``{"name": str | None, "tokens": {problem index: tokens}}``, filled by the first
    row when empty; rows identical to it are counted."""
    cfg = setup.cfg
    new = cfg.max_new_tokens
    groups = _batch_groups(len(setup.prompts), batch)
    hf_static = method == "hf-static"
    mode = None if hf_static else cfg.batch_mode
    t = 0 if hf_static or method == PLAIN else (cfg.spec_tree_size if tree_size is None else tree_size)
    budgets: dict[int, int] = {}
    warm_s = 0.0
    if hf_static:
        gen = lambda idx, k: (_hf_generate_batch(setup, [setup.prompts[i] for i in idx], k), None)  # noqa: E731
        warm = 2
    else:
        compiled = mode == "compiled"
        drafter = None if method == PLAIN else _make_drafter(setup, method, t, compiled and setup.device.type == "cuda")
        dec = make_engine(setup, drafter, t, graph=mode != "eager", compile=compiled)
        if dec.static_shapes:
            t0 = time.perf_counter()
            dec.warmup((batch,), max_len=max(len(p) for p in setup.prompts) + new, log=None)
            warm_s = time.perf_counter() - t0

        def gen(idx, k):
            prompts = [setup.prompts[i] for i in idx]
            out = dec.generate(prompts, k, eos_token_id=setup.eos or None, pad_token_id=setup.pad)
            return [cut_at_eos(out.new_tokens(b).tolist(), setup.eos, k) for b in range(len(idx))], out

        warm = 1
    t0 = time.perf_counter()
    for _ in range(warm):
        gen(groups[0], min(16, new) if hf_static else new)
    warm_s += time.perf_counter() - t0
    walls, rows = [], []
    emitted = accepted = row_steps = steps = 0
    prefill_s = capture_s = 0.0
    phases = {"draft": 0.0, "verify": 0.0, "commit": 0.0}  # summed StepStats seconds of the timed calls
    reason = None
    trace: list[list[list[int]]] = []  # tree_size "auto": per call, per step [budget, sequences that emitted]
    for idx in groups:
        wall, (tokens, out) = setup.timer(lambda: gen(idx, new))
        walls.append(wall)
        rows.extend(zip(idx, tokens))
        if out is not None:
            steps += len(out.steps)
            prefill_s += out.prefill_s
            capture_s += sum(s.capture_s for s in out.steps)
            for phase in phases:
                phases[phase] += sum(getattr(s, f"{phase}_s") for s in out.steps)
            if out.budget is not None:
                reason = out.budget.reason
                trace.append([[s.budget, sum(1 for e in s.tokens_emitted if e)] for s in out.steps])
                for n, k in out.budget.histogram.items():
                    budgets[n] = budgets.get(n, 0) + k
            for s in out.steps:
                for e, a in zip(s.tokens_emitted, s.tokens_accepted):
                    if e:
                        emitted, accepted, row_steps = emitted + e, accepted + a, row_steps + 1
    if not reference["tokens"]:
        reference["name"] = f"{method} B={batch}"
        for i, tok in rows:
            reference["tokens"].setdefault(i, tok)
    ref = reference["tokens"]
    wall = sum(walls)
    new_tokens = sum(len(tok) for _, tok in rows)
    row = {
        "method": method,
        "mode": mode,
        "batch": batch,
        "tree_size": t,
        "captured": not hf_static and mode != "eager" and setup.device.type == "cuda",
        "calls": len(groups),
        "rows": len(rows),
        "new_tokens": new_tokens,
        "seconds": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else math.nan,
        "steady_tokens_per_s": new_tokens / (wall - capture_s) if wall > capture_s else math.nan,
        "row_tokens_per_s": new_tokens / (batch * wall) if wall > 0 else math.nan,  # = tokens_per_s / B
        "tokens_per_step": emitted / row_steps if row_steps else None,
        "accepted_per_step": accepted / row_steps if row_steps else None,
        "steps": steps if not hf_static else None,
        "step_ms": 1e3 * (wall - prefill_s) / steps if steps else None,
        # a step's phases (host wall time, no device sync: device work lands where the host next waits)
        **{f"{phase}_ms": 1e3 * v / steps if steps else None for phase, v in phases.items()},
        "warmup_s": warm_s,
        "budget_steps": {str(n): k for n, k in sorted(budgets.items())} if budgets else None,
        "budget_reason": reason,  # tree_size "auto": the last call's last decision
        "budget_trace": trace or None,  # tree_size "auto": per call, per step [budget, sequences that emitted]
        "capture_s": capture_s,  # the drafter's captures inside the timed calls (StepStats.capture_s)
        "reference": reference["name"],
        "identical": sum(1 for i, tok in rows if ref.get(i) == tok),
    }
    log(f"  {method:<13} B={batch:<3} t={t!s:<5} {row['tokens_per_s']:8.1f} tok/s  {row['row_tokens_per_s']:7.1f} per row"
        + (f"  {row['tokens_per_step']:.2f} tokens/step" if row["tokens_per_step"] else ""))  # fmt: skip
    if not hf_static:
        del dec, drafter
    free_memory(setup.device)
    return row


def batch_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per drafter and batch size with an ``auto`` row: its steady tokens/s (captures inside the timed
    calls left out, each row's) against ``PLAIN``'s and the best fixed budget's of the same batch size
    (None where that row is missing or failed)."""
    ok = [r for r in rows if "error" not in r]
    plain = {r["batch"]: r["steady_tokens_per_s"] for r in ok if r["method"] == PLAIN}
    out = []
    for auto in (r for r in ok if r["tree_size"] == "auto"):
        fixed = [r for r in ok if r["method"] == auto["method"] and r["batch"] == auto["batch"]
                 and isinstance(r["tree_size"], int) and r["tree_size"] > 0]  # fmt: skip
        best = max(fixed, key=lambda r: r["steady_tokens_per_s"], default=None)
        base = plain.get(auto["batch"])
        rate = auto["steady_tokens_per_s"]
        out.append({"drafter": auto["method"], "batch": auto["batch"], "auto_tokens_per_s": rate,
                    "plain_tokens_per_s": base, "vs_plain": rate / base if base else None,
                    "best_fixed_tree_size": None if best is None else best["tree_size"],
                    "best_fixed_tokens_per_s": None if best is None else best["steady_tokens_per_s"],
                    "vs_best_fixed": rate / best["steady_tokens_per_s"] if best else None})  # fmt: skip
    return out


def format_batch_summary(summary: list[dict[str, Any]]) -> str:
    head = f"{'drafter':<10}{'B':>4}{'auto tok/s':>12}{'x plain':>9}{'best fixed t':>14}{'x best fixed':>14}"
    lines = ["the adaptive budget (t = auto) against specdec-plain and the best fixed t of the same batch size "
             "(steady tok/s: captures inside the timed calls left out)",
             head, "-" * len(head)]  # fmt: skip
    for s in summary:
        lines.append(f"{s['drafter']:<10}{s['batch']:>4}{fmt(s['auto_tokens_per_s'], '12.1f')}"
                     f"{fmt(s['vs_plain'], '9.2f')}{s['best_fixed_tree_size'] or '-':>14}"
                     f"{fmt(s['vs_best_fixed'], '14.2f')}")  # fmt: skip
    return "\n".join(lines)


def load_medusa(setup: Setup) -> None:
    """``setup.medusa``: the ``--medusa-heads`` heads, on the LM head's device and in its dtype."""
    from drafters.medusa import MedusaHeads

    lm = setup.target.get_output_embeddings().weight
    setup.medusa = MedusaHeads.load(setup.cfg.medusa_heads, device=lm.device, dtype=lm.dtype)


def format_batch(rows: list[dict[str, Any]]) -> str:
    head = (f"{'method':<14}{'mode':<9}{'B':>4}{'t':>6}{'tok/s':>9}{'per row':>9}{'tok/step':>9}{'acc/step':>9}"
            f"{'step ms':>9}{'warm-up s':>10}{'capture s':>10}{'identical':>11}")
    lines = ["tok/s: new tokens of all rows / wall time; per row: tok/s / B (what one sequence sees); capture s: "
             "one-time captures inside the timed calls",
             head, "-" * len(head)]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<14}{'':<9}{r.get('batch', '-'):>4}{r.get('tree_size', '-')!s:>6} error: "
                         f"{r['error']}")  # fmt: skip
            continue
        ident = f"{r['identical']}/{r['rows']}"
        t = "-" if r["method"] == "hf-static" else r["tree_size"]
        lines.append(f"{r['method']:<14}{r['mode'] or '-':<9}{r['batch']:>4}{t!s:>6}{fmt(r['tokens_per_s'], '9.1f')}"
                     f"{fmt(r['row_tokens_per_s'], '9.1f')}{fmt(r['tokens_per_step'], '9.2f')}"
                     f"{fmt(r['accepted_per_step'], '9.2f')}{fmt(r['step_ms'], '9.2f')}{fmt(r['warmup_s'], '10.1f')}"
                     f"{fmt(r['capture_s'], '10.3f')}{ident:>11}")  # fmt: skip
    return "\n".join(lines)
