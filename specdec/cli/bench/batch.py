"""(d) batch throughput: speculative decoding (Medusa heads, prompt lookup) at each batch size vs HF
``generate`` with the static cache on left-padded batches."""

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


def run_batch(setup: Setup, method: str, batch: int, reference: dict[str, Any],
              log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Decode every call of ``_batch_groups`` at batch size ``batch`` with ``method`` (a batch drafter
    or ``"hf-static"``), after a warm-up call at that batch size; throughput and acceptance.

    ``reference``: ``{"name": str | None, "tokens": {problem index: tokens}}``, filled by the first
    row when empty; rows identical to it are counted."""
    from drafters import make_drafter

    cfg = setup.cfg
    new = cfg.max_new_tokens
    groups = _batch_groups(len(setup.prompts), batch)
    hf_static = method == "hf-static"
    mode = None if hf_static else cfg.batch_mode
    t = 0 if hf_static else cfg.spec_tree_size
    if hf_static:
        gen = lambda idx, k: (_hf_generate_batch(setup, [setup.prompts[i] for i in idx], k), None)  # noqa: E731
        warm = 2
    else:
        drafter = (make_drafter("medusa", target=setup.target, heads=setup.medusa) if method == "medusa"
                   else make_drafter(method, tree_size=t))  # fmt: skip
        dec = make_engine(setup, drafter, t, graph=mode != "eager", compile=mode == "compiled")

        def gen(idx, k):
            prompts = [setup.prompts[i] for i in idx]
            out = dec.generate(prompts, k, eos_token_id=setup.eos or None, pad_token_id=setup.pad)
            return [cut_at_eos(out.new_tokens(b).tolist(), setup.eos, k) for b in range(len(idx))], out

        warm = 1
    t0 = time.perf_counter()
    for _ in range(warm):
        gen(groups[0], min(16, new))
    warm_s = time.perf_counter() - t0
    walls, rows = [], []
    emitted = accepted = row_steps = steps = 0
    prefill_s = 0.0
    for idx in groups:
        wall, (tokens, out) = setup.timer(lambda: gen(idx, new))
        walls.append(wall)
        rows.extend(zip(idx, tokens))
        if out is not None:
            steps += len(out.steps)
            prefill_s += out.prefill_s
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
        "row_tokens_per_s": new_tokens / (batch * wall) if wall > 0 else math.nan,  # = tokens_per_s / B
        "tokens_per_step": emitted / row_steps if row_steps else None,
        "accepted_per_step": accepted / row_steps if row_steps else None,
        "steps": steps if not hf_static else None,
        "step_ms": 1e3 * (wall - prefill_s) / steps if steps else None,
        "warmup_s": warm_s,
        "reference": reference["name"],
        "identical": sum(1 for i, tok in rows if ref.get(i) == tok),
    }
    log(f"  {method:<9} B={batch:<3} {row['tokens_per_s']:8.1f} tok/s  {row['row_tokens_per_s']:7.1f} per row"
        + (f"  {row['tokens_per_step']:.2f} tokens/step" if row["tokens_per_step"] else ""))  # fmt: skip
    if not hf_static:
        del dec, drafter
    free_memory(setup.device)
    return row


def load_medusa(setup: Setup) -> None:
    """``setup.medusa``: the ``--medusa-heads`` heads, on the LM head's device and in its dtype."""
    from drafters.medusa import MedusaHeads

    lm = setup.target.get_output_embeddings().weight
    setup.medusa = MedusaHeads.load(setup.cfg.medusa_heads, device=lm.device, dtype=lm.dtype)


def format_batch(rows: list[dict[str, Any]]) -> str:
    head = (f"{'method':<10}{'mode':<9}{'B':>4}{'tok/s':>9}{'per row':>9}{'tok/step':>9}{'acc/step':>9}"
            f"{'step ms':>9}{'warm-up s':>10}{'identical':>11}")
    lines = ["tok/s: new tokens of all rows / wall time; per row: tok/s / B (what one sequence sees)",
             head, "-" * len(head)]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<10}{'':<9}{r.get('batch', '-'):>4} error: {r['error']}")
            continue
        ident = f"{r['identical']}/{r['rows']}"
        lines.append(f"{r['method']:<10}{r['mode'] or '-':<9}{r['batch']:>4}{fmt(r['tokens_per_s'], '9.1f')}"
                     f"{fmt(r['row_tokens_per_s'], '9.1f')}{fmt(r['tokens_per_step'], '9.2f')}"
                     f"{fmt(r['accepted_per_step'], '9.2f')}{fmt(r['step_ms'], '9.2f')}{fmt(r['warmup_s'], '10.1f')}"
                     f"{ident:>11}")  # fmt: skip
    return "\n".join(lines)
