"""(a) plain (non-speculative) greedy decoding: HF ``generate`` (default and static cache) and the
engine eager / graphed / compiled, tokens/s and agreement with the reference."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from specdec.cli.bench.common import fmt
from specdec.cli.bench.setup import Setup, agreement, cut_at_eos, make_engine, reference_tokens


def _hf_generate(setup: Setup, prompt, new: int, static: bool) -> list[int]:
    import torch

    kwargs: dict[str, Any] = dict(max_new_tokens=new, do_sample=False, eos_token_id=setup.eos or None,
                                  pad_token_id=setup.pad, attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                                                    device=setup.device))  # fmt: skip
    if static:
        kwargs.update(cache_implementation="static", max_cache_len=setup.capacity)
    out = setup.target.generate(prompt[None].to(setup.device), **kwargs)
    return out[0, len(prompt) :].tolist()


def run_plain_method(setup: Setup, method: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Warm up, then greedy-decode every prompt with ``method``; tokens/s and agreement."""
    cfg = setup.cfg
    new = cfg.max_new_tokens
    if method.startswith("hf"):
        static = method == "hf-static"
        gen = lambda p, k: _hf_generate(setup, p, k, static)  # noqa: E731
        warm = 2 if static else 1
    else:
        base = method.removesuffix("-step")  # -step: one host round trip per token (decode_chunk=0)
        dec = make_engine(setup, None, 0, graph=base != "engine-eager", compile=base == "engine-compiled",
                          decode_chunk=0 if method.endswith("-step") else None)  # fmt: skip
        gen = lambda p, k: dec.generate(p, k, eos_token_id=setup.eos or None,  # noqa: E731
                                        pad_token_id=setup.pad).new_tokens(0).tolist()
        warm = 1
    t0 = time.perf_counter()
    for _ in range(warm):
        gen(setup.prompts[0], min(8, new))
    warm_s = time.perf_counter() - t0
    tokens, seconds = [], []
    for prompt in setup.prompts:
        sec, out = setup.timer(lambda: gen(prompt, new))
        tokens.append(cut_at_eos(out, setup.eos, new))
        seconds.append(sec)
    total_new = sum(len(t) for t in tokens)
    total_s = sum(seconds)
    setup.reference[method] = tokens
    ref_name, ref = reference_tokens(setup)
    row = {
        "method": method,
        "captured": method.startswith(("engine-graph", "engine-compiled")) and setup.device.type == "cuda",
        "new_tokens": total_new,
        "seconds": total_s,
        "tokens_per_s": total_new / total_s if total_s > 0 else math.nan,
        "ms_per_token": 1e3 * total_s / total_new if total_new else math.nan,
        "warmup_s": warm_s,
        "per_problem_s": seconds,
        "reference": ref_name,
        **agreement(ref if ref_name != method else None, tokens),
    }
    log(f"  {method:<13} {row['tokens_per_s']:8.1f} tok/s  {row['ms_per_token']:7.2f} ms/token  "
        f"identical to {ref_name}: {row['identical']}/{len(tokens)}")  # fmt: skip
    return row


def format_plain(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'method':<14}{'tok/s':>9}{'ms/token':>10}{'identical':>11}  vs",
             "-" * 56]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<14} error: {r['error']}")
            continue
        ident = "-" if r["identical"] is None else f"{r['identical']}/{len(r['per_problem_s'])}"
        lines.append(f"{r['method']:<14}{fmt(r['tokens_per_s'], '9.1f')}{fmt(r['ms_per_token'], '10.2f')}"
                     f"{ident:>11}  {r['reference'] or '-'}")  # fmt: skip
    return "\n".join(lines)
