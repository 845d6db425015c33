"""(e) kernel profile of one verify forward (graphed, or compiled before the capture): captured and
uncaptured wall time, kernels per forward and per layer, GEMM / attention / other, top kernels,
against the weight-streaming floor."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from specdec.cli.bench.common import Timer, fmt, free_memory, gb, guarded, median_ms, num, random_tree
from specdec.cli.bench.floor import bandwidth_info, forward_floors
from specdec.cli.bench.kernels import profile_kernels, summarize_kernels
from specdec.cli.bench.setup import Setup, prefill_first_prompt


def _median_of(timer: Timer, fn: Callable[[], Any], reps: int) -> float:
    """Median ms of ``reps`` timed calls of ``fn``."""
    return median_ms([timer(fn)[0] for _ in range(reps)])


def run_profile_mode(setup: Setup, cache, tree, prefix: int, mode: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Time and profile one verify forward of ``tree`` over ``cache`` in ``mode`` (graph / compiled)."""
    import torch

    from specdec import hf
    from specdec.graphs import GraphedForward

    cfg = setup.cfg
    cuda = setup.device.type == "cuda"
    layers = hf.num_layers(setup.target) or 1
    g = GraphedForward(setup.target, cache, 1, tree.n, impl=cfg.attn_impl, capture=cuda, compile=mode == "compiled")
    g.load([tree], [prefix])
    t0 = time.perf_counter()
    g.forward()  # captures (and compiles) on first use
    if cuda:
        torch.cuda.synchronize(setup.device)
    first_s = time.perf_counter() - t0
    for _ in range(2):
        g.forward()
    forward_ms = _median_of(setup.timer, g.forward, cfg.reps)  # a graph replay on CUDA
    # The same body called eagerly (compiled or not), outside the graph: what a profiler sees launched
    # one by one. On CPU g.forward() is that already.
    uncaptured = getattr(g, "_run", None) if cuda else g.forward
    if uncaptured is None:  # graphs.py without _run: an uncaptured instance of the same forward
        uncaptured = GraphedForward(setup.target, cache, 1, tree.n, impl=cfg.attn_impl, capture=False,
                                    compile=mode == "compiled").forward  # fmt: skip
    if cuda:
        for _ in range(2):
            uncaptured()
    uncaptured_ms = _median_of(setup.timer, uncaptured, cfg.reps) if cuda else forward_ms
    replay_kernels = None
    if cuda:
        kernels = profile_kernels(g.forward, setup.device, cfg.profile_reps)
        replay_kernels = len(kernels) / cfg.profile_reps
        source, wall = "graph replay", forward_ms
        if replay_kernels < layers:  # the profiler saw the graph launch, not the kernels inside it
            kernels = profile_kernels(uncaptured, setup.device, cfg.profile_reps)
            source, wall = "uncaptured forward", uncaptured_ms
    else:
        kernels = profile_kernels(g.forward, setup.device, cfg.profile_reps)
        source, wall = "cpu ops", forward_ms
    summary = summarize_kernels(kernels, cfg.profile_reps, cfg.profile_top)
    row = {
        "mode": mode,
        "source": source,
        "unit": "gpu kernels" if cuda else "cpu ops",
        "captured": cuda,
        "captured_ms": forward_ms if cuda else None,
        "uncaptured_ms": uncaptured_ms,
        "wall_ms": wall,
        "first_call_s": first_s,
        "graph_replay_kernels": replay_kernels,
        "kernels_per_layer": summary["kernels_per_forward"] / layers,
        "kernel_share": summary["kernel_ms"] / wall if wall > 0 else math.nan,
        **summary,
    }
    log(f"  {mode:<9} {row['kernels_per_forward']:7.1f} {row['unit']}/forward, {row['kernel_ms']:.3f} ms of them "
        f"in a {wall:.3f} ms forward ({source})")  # fmt: skip
    del g
    free_memory(setup.device)
    return row


def run_profile(setup: Setup, log: Callable[[str], None]) -> dict[str, Any]:
    """(e): one random tree of ``profile_tree_size + 1`` nodes over the first prompt, per mode."""
    import torch

    from specdec import hf

    cfg = setup.cfg
    prompt, prefix, cache = prefill_first_prompt(setup)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = cfg.profile_tree_size + 1
    tree = random_tree(n, int(prompt[-1]), hf.vocab_size(setup.target), gen)
    if setup.bandwidth is None:
        setup.bandwidth = bandwidth_info(cfg, setup.device)
    res: dict[str, Any] = {"tree_size": cfg.profile_tree_size, "nodes": n, "prefix_len": prefix,
                           "layers": hf.num_layers(setup.target), "reps": cfg.profile_reps, "timing_reps": cfg.reps,
                           "bandwidth": setup.bandwidth, "floor": forward_floors(setup.target, prefix, setup.bandwidth),
                           "rows": []}  # fmt: skip
    for mode in cfg.profile_modes:
        guarded(res["rows"], {"mode": mode}, lambda: run_profile_mode(setup, cache, tree, prefix, mode, log), log)
    return res


def format_profile(res: dict[str, Any]) -> str:
    fl, bw = res["floor"], res["bandwidth"]
    lines = [f"verify forward of t = {res['tree_size']} draft nodes ({res['nodes']} with the root) over a "
             f"{res['prefix_len']}-token prefix, {res['layers']} layers; profiled {res['reps']} forwards, timed "
             f"{res['timing_reps']} (median)",
             f"floor: weights {gb(fl['streamed_bytes'])} -> {num(fl['floor_ms'])} ms at {bw['flag_gbs']:.0f} GB/s, "
             f"{num(fl['floor_measured_ms'])} ms at {bw['measured_gbs']:.0f} GB/s measured; with the prefix KV "
             f"({gb(fl['kv_bytes'])}) {num(fl['floor_kv_ms'])} / {num(fl['floor_kv_measured_ms'])} ms"]  # fmt: skip
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"\n[{r['mode']}] error: {r['error']}")
            continue
        replay = "" if r["graph_replay_kernels"] is None else f"; the graph replay showed {r['graph_replay_kernels']:.0f}"
        lines.append(
            f"\n[{r['mode']}] profiled: {r['source']}{replay}; forward wall: "
            + (f"captured {r['captured_ms']:.3f} ms, " if r["captured_ms"] is not None else "no capture on CPU, ")
            + f"uncaptured {r['uncaptured_ms']:.3f} ms; first call (capture / compile) {r['first_call_s']:.1f} s\n"
            f"{r['kernels_per_forward']:.1f} {r['unit']} per forward ({r['kernels_per_layer']:.1f} per layer), "
            f"{r['kernel_ms']:.3f} ms of them = {fmt(100 * r['kernel_share'], '.0f')} % of the {r['wall_ms']:.3f} ms "
            f"wall; {num(r['wall_ms'] / fl['floor_ms'])} x the weights floor (flag bandwidth), "
            f"{num(r['wall_ms'] / fl['floor_measured_ms'])} x (measured)"
        )  # fmt: skip
        lines.append(f"{'category':<12}{'count':>8}{'ms':>9}{'share':>7}")
        for name, c in r["categories"].items():
            lines.append(f"{name:<12}{c['kernels']:>8.1f}{c['ms']:>9.3f}{100 * c['share']:>6.0f}%")
        head = f"{'kernel':<72}{'cat':>6}{'count':>7}{'us each':>9}{'ms/fwd':>8}{'share':>7}"
        lines += [head, "-" * len(head)]
        for k in r["top"]:
            lines.append(f"{k['name']:<72}{k['category'][:5]:>6}{k['count']:>7.1f}{k['us_each']:>9.1f}"
                         f"{k['ms']:>8.3f}{100 * k['share']:>6.0f}%")  # fmt: skip
    return "\n".join(lines)
