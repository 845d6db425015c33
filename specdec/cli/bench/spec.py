"""(c) speculative decoding per step: draft model and prompt lookup in each mode (eager, graph,
compiled): phase times, acceptance, tokens/s."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from specdec.cli.bench.common import fmt
from specdec.cli.bench.setup import Setup, agreement, cut_at_eos, make_engine, reference_tokens


def run_spec(setup: Setup, drafter_name: str, mode: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Speculative greedy decoding of every prompt; per-step phase times, acceptance, tokens/s.

    ``mode``: ``"eager"``, ``"graph"`` (CUDA graphs on CUDA) or ``"compiled"`` (graphs of forwards
    compiled by inductor; the compile falls in the warm-up)."""
    from drafters import make_drafter

    cfg = setup.cfg
    t = cfg.spec_tree_size
    graph, compile = mode != "eager", mode == "compiled"
    # The draft model's per-depth forwards follow the mode too (fixed shapes + CUDA graphs, or eager).
    opts = ({"static_shapes": graph, "cuda_graphs": graph and setup.device.type == "cuda", "compile": compile}
            if drafter_name == "model" else {})  # fmt: skip
    drafter = make_drafter(drafter_name, target=setup.target, draft_model=setup.draft, tree_size=t, **opts)
    dec = make_engine(setup, drafter, t, graph=graph, compile=compile)
    new = cfg.max_new_tokens
    kwargs = dict(eos_token_id=setup.eos or None, pad_token_id=setup.pad)
    dec.generate(setup.prompts[0], min(16, new), **kwargs)  # warm-up: capture, kernel compiles
    tokens, walls = [], []
    totals = {k: 0.0 for k in ("steps", "draft_s", "verify_s", "forward_s", "commit_s", "prefill_s", "emitted",
                               "accepted")}  # fmt: skip
    for prompt in setup.prompts:
        wall, out = setup.timer(lambda: dec.generate(prompt, new, **kwargs))
        walls.append(wall)
        tokens.append(cut_at_eos(out.new_tokens(0).tolist(), setup.eos, new))
        tot = out.totals()
        for k in ("steps", "draft_s", "verify_s", "forward_s", "commit_s", "prefill_s"):
            totals[k] += tot[k]
        totals["emitted"] += sum(s.tokens_emitted[0] for s in out.steps)
        totals["accepted"] += tot["tokens_accepted"]
    steps = max(totals["steps"], 1)
    wall = sum(walls)
    phases = totals["draft_s"] + totals["verify_s"] + totals["commit_s"]
    new_tokens = sum(len(x) for x in tokens)
    ref_name, ref = reference_tokens(setup)
    row = {
        "drafter": drafter_name,
        "mode": mode,
        "captured": graph and setup.device.type == "cuda",
        "tree_size": t,
        "steps": int(totals["steps"]),
        "new_tokens": new_tokens,
        "seconds": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else math.nan,
        "accepted_per_step": totals["accepted"] / steps,
        "tokens_per_step": totals["emitted"] / steps,
        "draft_ms": 1e3 * totals["draft_s"] / steps,
        "verify_ms": 1e3 * totals["verify_s"] / steps,
        "forward_ms": 1e3 * totals["forward_s"] / steps,
        "commit_ms": 1e3 * totals["commit_s"] / steps,
        "host_ms": 1e3 * (wall - totals["prefill_s"] - phases) / steps,
        "step_ms": 1e3 * (wall - totals["prefill_s"]) / steps,
        "prefill_ms": 1e3 * totals["prefill_s"] / len(setup.prompts),
        "reference": ref_name,
        **agreement(ref, tokens),
    }
    log(f"  {drafter_name:<6} {row['mode']:<8} {row['tokens_per_s']:8.1f} tok/s  {row['tokens_per_step']:.2f} tokens/step")
    return row


def format_spec(rows: list[dict[str, Any]]) -> str:
    head = (f"{'drafter':<8}{'mode':<9}{'t':>4}{'tok/s':>8}{'acc/step':>9}{'tok/step':>9}{'draft':>8}{'verify':>8}"
            f"{'(fwd)':>8}{'commit':>8}{'host':>7}{'step':>8}{'identical':>10}")
    lines = ["per-step ms; host = wall time outside draft / verify / commit (prefill excluded)", head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['drafter']:<8}{r['mode']:<9} error: {r['error']}")
            continue
        ident = "-" if r["identical"] is None else f"{r['identical']}/{len(r['first_mismatch'])}"
        lines.append(f"{r['drafter']:<8}{r['mode']:<9}{r['tree_size']:>4}{fmt(r['tokens_per_s'], '8.1f')}"
                     f"{fmt(r['accepted_per_step'], '9.2f')}{fmt(r['tokens_per_step'], '9.2f')}"
                     f"{fmt(r['draft_ms'], '8.2f')}{fmt(r['verify_ms'], '8.2f')}{fmt(r['forward_ms'], '8.2f')}"
                     f"{fmt(r['commit_ms'], '8.2f')}{fmt(r['host_ms'], '7.2f')}{fmt(r['step_ms'], '8.2f')}"
                     f"{ident:>10}")  # fmt: skip
    return "\n".join(lines)
