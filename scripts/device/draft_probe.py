"""Where the draft model's step and the target's verify spend their time, at the default pair's
shapes with random weights (``SCALE_CONFIGS`` ``qwen2.5-0.5b`` / ``qwen2.5-1.5b``): no staged
weights needed, so it runs in a fresh machine life in a couple of minutes per variant.

One variant per process (dynamo keeps the first compile of a code object, so compile settings
cannot change inside a process): ``--compile`` for both the draft loop and the target's tree
forward (``true``, ``max-autotune`` or ``false``), ``--freeze`` (inductor weight freezing, whose
patterns may concatenate matmuls sharing an input; on the H100 it merged gate / up, PERF.md v14), ``--attention`` of the draft loop.
Random weights accept ~nothing, so every step drafts a full depth-D tree after a one-token catch-up
and verifies t + 1 nodes: the same shapes, hence the same step cost, as a real run (acceptance only
changes how many tokens a step yields).

Prints and writes ``OUT/probe-LABEL.json``: medians of the engine's draft / verify / forward ms per
step (each call's first step apart), plain decode ms per token of the target alone (same compile
setting), and per phase of one profiled call the kernels per step by category (``bench.kernels``
names), GPU busy time and span per step.

    PYTHONPATH=. python3 scripts/device/draft_probe.py --label c1 --compile true --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch


def _median_ms(xs: list[float]) -> float | None:
    return round(1e3 * statistics.median(xs), 3) if xs else None


def _compile_arg(text: str) -> bool | str:
    return {"true": True, "false": False}.get(text, text)


def _phase_kernels(trace: dict, phases: tuple[str, ...]) -> dict:
    """Per phase: the device kernels whose start lies inside one of the phase's host ranges (each
    phase ends with a device sync, so its kernels run inside it), per range: count, busy and span
    by category and the top names."""
    from specdec.cli.bench.kernels import category, short_name

    events = trace.get("traceEvents", [])
    ranges = {p: [] for p in phases}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and name.startswith("specdec."):
            phase = name[len("specdec."):]
            if phase in ranges:
                ranges[phase].append((e["ts"], e["ts"] + e["dur"]))
    kernels = sorted((e["ts"], e["dur"], e.get("name", "")) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))  # fmt: skip
    out = {}
    for phase, spans in ranges.items():
        if not spans:
            continue
        by_cat, by_name = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
        busy, span, count = [], [], []
        for lo, hi in spans:
            inside = [k for k in kernels if lo <= k[0] <= hi]
            if not inside:
                continue
            busy.append(sum(k[1] for k in inside))
            span.append(inside[-1][0] + inside[-1][1] - inside[0][0])
            count.append(len(inside))
            for ts, dur, name in inside:
                c, n = by_cat[category(name)], by_name[short_name(name, 60)]
                c[0] += 1
                c[1] += dur
                n[0] += 1
                n[1] += dur
        m = max(len(busy), 1)
        top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
        out[phase] = {
            "ranges": len(spans), "with_kernels": len(busy),
            "kernels_per_range": round(statistics.median(count), 1) if count else 0,
            "busy_ms_median": round(statistics.median(busy) / 1e3, 3) if busy else None,
            "span_ms_median": round(statistics.median(span) / 1e3, 3) if span else None,
            "categories": {c: {"per_range": round(v[0] / m, 1), "us_each": round(v[1] / max(v[0], 1), 2),
                               "ms_per_range": round(v[1] / m / 1e3, 3)} for c, v in by_cat.items()},
            "top": [{"name": k, "per_range": round(v[0] / m, 1), "us_each": round(v[1] / max(v[0], 1), 2)}
                    for k, v in top],
        }  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True)
    p.add_argument("--compile", default="true", help="true, false or max-autotune (draft loop and target)")
    p.add_argument("--freeze", action="store_true", help="inductor weight freezing (torch._inductor.config.freezing)")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "tree"])
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tree-size", type=int, default=64)
    p.add_argument("--prompt", type=int, default=400, help="prompt tokens (random ids)")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--calls", type=int, default=4, help="timed generate calls")
    p.add_argument("--plain", type=int, default=128, help="tokens of the target-alone decode timed (0: skip)")
    p.add_argument("--shapes", nargs=2, default=["qwen2.5-1.5b", "qwen2.5-0.5b"], metavar=("TARGET", "DRAFT"),
                   help="SCALE_CONFIGS names (tiny tiny: a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv)

    from drafters.draft_model import DraftModelDrafter
    from specdec import SpecDecoder
    from specdec.cli.bench.scale import build_scale_model

    if ns.freeze:
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
    comp = _compile_arg(ns.compile)
    dev = torch.device(ns.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    max_len = ns.prompt + ns.new
    t0 = time.perf_counter()
    target = build_scale_model(ns.shapes[0], dev, dtype, max_positions=4096, seed=0)
    draft = build_scale_model(ns.shapes[1], dev, dtype, max_positions=4096, seed=1)
    row: dict = {"label": ns.label, "args": vars(ns), "build_s": round(time.perf_counter() - t0, 1)}
    drafter = DraftModelDrafter(draft, depth=ns.depth, topk=ns.topk, compile=comp, attention=ns.attention)
    dec = SpecDecoder(target, drafter, ns.tree_size, max_cache_len=max_len + ns.tree_size + 64, compile=comp)
    t0 = time.perf_counter()
    dec.warmup(batch_sizes=(1,), max_len=max_len, log=None)
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size

    def prompt() -> torch.Tensor:
        return torch.randint(0, vocab, (ns.prompt,), generator=gen)

    dec.generate(prompt(), 16)  # the drafter's own captures
    sync()
    row["warm_s"] = round(time.perf_counter() - t0, 1)
    print(f"[{ns.label}] built {row['build_s']} s, warm {row['warm_s']} s", flush=True)

    first, draft_s, verify_s, fwd_s, walls, toks = [], [], [], [], [], 0
    for _ in range(ns.calls):
        sync()
        t0 = time.perf_counter()
        out = dec.generate(prompt(), ns.new)
        sync()
        walls.append(time.perf_counter() - t0)
        toks += out.num_new_tokens
        first.append(out.steps[0].draft_s)
        draft_s += [s.draft_s for s in out.steps[1:]]
        verify_s += [s.verify_s for s in out.steps]
        fwd_s += [s.forward_s for s in out.steps]
    row.update(steps=len(verify_s), tok_per_s=round(toks / sum(walls), 1), draft_ms=_median_ms(draft_s),
               draft_first_ms=_median_ms(first), verify_ms=_median_ms(verify_s), forward_ms=_median_ms(fwd_s),
               draft_max_ms=round(1e3 * max(draft_s), 2), verify_max_ms=round(1e3 * max(verify_s), 2))  # fmt: skip
    print(f"[{ns.label}] draft {row['draft_ms']} ms (first {row['draft_first_ms']}), verify {row['verify_ms']} ms "
          f"(forward {row['forward_ms']}), {row['tok_per_s']} tok/s at tau ~1", flush=True)  # fmt: skip

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])) as prof:
        dec.generate(prompt(), 32)
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            row["kernels"] = _phase_kernels(json.load(f), ("draft", "forward"))
    for phase, k in row["kernels"].items():
        cats = ", ".join(f"{c} {v['per_range']} x {v['us_each']} us" for c, v in k["categories"].items())
        print(f"[{ns.label}] {phase}: {k['kernels_per_range']} kernels, busy {k['busy_ms_median']} ms, "
              f"span {k['span_ms_median']} ms; {cats}", flush=True)  # fmt: skip
        for t in k["top"][:8]:
            print(f"      {t['name']:<60} {t['per_range']:>7} x {t['us_each']} us", flush=True)

    if ns.plain:
        plain = SpecDecoder(target, None, 0, max_cache_len=max_len + 64, compile=comp)
        plain.warmup(batch_sizes=(1,), max_len=max_len, log=None)
        plain.generate(prompt(), 8)
        times = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            plain.generate(prompt(), ns.plain)
            sync()
            times.append((time.perf_counter() - t0) / ns.plain)
        row["plain_ms_per_token"] = round(1e3 * min(times), 3)
        print(f"[{ns.label}] plain decode {row['plain_ms_per_token']} ms/token "
              f"({1e3 / row['plain_ms_per_token']:.0f} tok/s, prefill included)", flush=True)  # fmt: skip

    Path(ns.out).mkdir(parents=True, exist_ok=True)
    Path(ns.out, f"probe-{ns.label}.json").write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
