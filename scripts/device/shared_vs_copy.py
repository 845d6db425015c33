"""N samples of one prompt through the engine, the prompt's KV kept once (shared layout,
``shared_prefix=True``) against a copy per row (``shared_prefix=False``), at a real model's shapes
with random weights (no staging): time per step (draft / verify / commit), per call and the peak
GPU memory of each layout.

Medusa heads with zero-initialised residual blocks fill a static topology, so every step verifies
the full tree of ``--tree`` nodes per row; random weights accept next to nothing, so a call of
``--new`` tokens is ``--new`` steps. What it answers: is the shared layout, opt-in on CUDA, at least
as fast as the copy layout (then it can become the default), and what memory does it save.

    python scripts/device/shared_vs_copy.py --config qwen2.5-1.5b --prompts 150 1000 4000 \\
        --samples 16 --trees 16 --new 64 --out $OUT/shared_vs_copy.json

``--trees 0 4 16 --compile true --layouts shared`` gives the cost of a step per tree size (0: plain
decoding, one sampled token per sequence a step) with the compiled forward the evaluation uses.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from drafters.medusa import MedusaDrafter, MedusaHeads  # noqa: E402
from specdec import SpecDecoder  # noqa: E402
from specdec.cli.bench.config import SCALE_CONFIGS  # noqa: E402
from specdec.cli.bench.scale import build_scale_model  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_layout(model, drafter, shared: bool, tree: int, prompts: list[torch.Tensor], args, device) -> list[dict]:
    """One engine of this layout and tree size (0: no drafter, one token a step); per prompt one
    untimed call (capture), then ``args.repeats`` timed."""
    # the caches of the evaluation's --samples runs (eval.methods.Session._cache_options): the prompt's
    # bucket of the longest prompt + new + tree slots and, shared, the rows' small bucket of 1 + new + tree
    top = max(p.numel() for p in prompts) + args.new + tree
    caches = {"cache_buckets": (1 + args.new + tree, top)} if shared else {"max_cache_len": top}
    dec = SpecDecoder(model, drafter if tree else None, tree_size=tree, shared_prefix=shared, compile=args.compile,
                      **caches)  # fmt: skip
    rows = []
    for prompt in prompts:
        gen = torch.Generator(device=device).manual_seed(0)
        sampling = dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else {}
        kw = dict(num_return_sequences=args.samples, generator=gen, **sampling)
        t0 = time.perf_counter()
        dec.generate(prompt, args.new, **kw)
        _sync(device)
        first = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        walls, steps = [], []
        for _ in range(args.repeats):
            _sync(device)
            t0 = time.perf_counter()
            out = dec.generate(prompt, args.new, **kw)
            _sync(device)
            walls.append(time.perf_counter() - t0)
            steps += list(out.steps)
        n_steps = len(steps) / args.repeats
        row = {
            "layout": "shared" if shared else "copy", "prompt_len": int(prompt.numel()), "samples": args.samples,
            "tree": tree, "temperature": args.temperature, "compile": args.compile, "new_tokens": args.new, "first_call_s": first,
            "wall_s_median": statistics.median(walls), "steps_per_call": n_steps,
            "ms_per_step": 1e3 * statistics.median(walls) / max(n_steps, 1),
            "draft_ms": 1e3 * statistics.mean(s.draft_s for s in steps),
            "verify_ms": 1e3 * statistics.mean(s.verify_s for s in steps),
            "commit_ms": 1e3 * statistics.mean(s.commit_s for s in steps),
            "forward_ms": 1e3 * statistics.mean(s.forward_s for s in steps),
            "nodes_per_step": statistics.mean(sum(s.nodes_proposed) for s in steps),
            "engine_shared": bool(dec.shared_prefix),
        }  # fmt: skip
        if device.type == "cuda":
            row["peak_gib_over_start"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        row["kv_cache_mib"] = sum(c.nbytes for c in dec.caches.values()) / 2**20  # every bucket this engine holds
        if args.profile:
            row["profile"] = _profile_call(dec, prompt, args, kw, device)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        rows.append(row)
    if hasattr(dec, "release"):
        dec.release()
    del dec
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _profile_call(dec, prompt, args, kw, device, top: int = 25) -> dict:
    """One more call under ``torch.profiler``: the costliest operations (device kernels on CUDA, CPU
    ops elsewhere) per step, the kernel count per step, the busy time per step against the wall and
    the ops of most host time; then one more under ``cProfile``: the Python functions of most own
    time per step (``python``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        out = dec.generate(prompt, args.new, **kw)
        _sync(device)
        wall = time.perf_counter() - t0
    steps = max(len(out.steps), 1)
    host = sorted((e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: e.self_cpu_time_total,
                  reverse=True)[:top]  # fmt: skip
    # the host's Python: one more call under cProfile (its own overhead inflates every call alike)
    import cProfile
    import pstats

    py = cProfile.Profile()
    py.enable()
    dec.generate(prompt, args.new, **kw)
    _sync(device)
    py.disable()
    funcs = sorted(pstats.Stats(py).stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # by own time
    if cuda:  # the kernels themselves: device time of their own, not the aten ops that launched them
        events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
        cost = lambda e: e.self_device_time_total  # noqa: E731
    else:
        events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        cost = lambda e: e.self_cpu_time_total  # noqa: E731
    events.sort(key=cost, reverse=True)
    busy = sum(cost(e) for e in events) / 1e3  # ms (the profiler counts µs)
    return {
        "wall_ms_per_step": 1e3 * wall / steps, "busy_ms_per_step": busy / steps,
        "events_per_step": sum(e.count for e in events) / steps,
        "top": [{"name": e.key[:120], "calls_per_step": e.count / steps, "ms_per_step": cost(e) / 1e3 / steps}
                for e in events[:top]],
        "host_ops": [{"name": e.key[:120], "calls_per_step": e.count / steps,
                      "ms_per_step": e.self_cpu_time_total / 1e3 / steps} for e in host],
        "python": [{"function": f"{Path(f).name}:{line}({name})", "calls_per_step": st[1] / steps,
                    "own_ms_per_step": 1e3 * st[2] / steps, "cum_ms_per_step": 1e3 * st[3] / steps}
                   for (f, line, name), st in funcs],
    }  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(SCALE_CONFIGS), default="qwen2.5-1.5b")
    p.add_argument("--prompts", type=int, nargs="+", default=[150, 1000, 4000])
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--trees", type=int, nargs="+", default=[16],
                   help="Medusa tree sizes per sequence, each its own engine (0: no drafter, one token a step)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (0: greedy)")
    p.add_argument("--compile", default="false", choices=("false", "true", "inductor"),
                   help="SpecDecoder(compile=): true = layer-wise (the default of compile=True), inductor = whole forward")
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--layouts", nargs="+", choices=("shared", "copy"), default=["shared", "copy"])
    p.add_argument("--profile", action="store_true", help="one more call per (layout, prompt) under torch.profiler: "
                   "kernels per step, busy vs wall time, the 25 costliest kernels")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build_scale_model(args.config, device, dtype, max_positions=max(args.prompts) + args.new + max(args.trees) + 64)
    heads = MedusaHeads(model.config.hidden_size, num_heads=4).to(device, dtype)
    drafter = MedusaDrafter(model, heads, table="prior")
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=gen).to(device) for n in args.prompts]
    args.compile = {"false": False, "true": True}.get(args.compile, args.compile)
    rows = []
    for layout in args.layouts:
        for tree in args.trees:
            rows += run_layout(model, drafter, layout == "shared", tree, prompts, args, device)
            if args.out:  # row by row: what finished comes back if the call runs out of time
                Path(args.out).write_text(json.dumps({"config": args.config, "rows": rows}, indent=1))
    result = {"config": args.config, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "dtype": args.dtype, "rows": rows}  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
