"""GPU timing shared by the kernel benchmarks (``treeattn.bench``, ``treeattn.bench_cascade``):
the machine's measured ceilings, CUDA-graph replay timing over rotating inputs, the JSON writer and
the markdown table of the rows."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["markdown_row", "markdown_table", "measure_ceilings", "time_rotating_graph", "write_rows"]


def measure_ceilings(device: str) -> tuple[float, float]:
    """(bf16 matmul FLOP/s, copy bytes/s) measured now on ``device``."""
    from triton.testing import do_bench

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t_mm = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median") * 1e-3
    src = torch.randn(256 * 1024 * 1024, device=device, dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    t_cp = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median") * 1e-3
    return 2 * 8192**3 / t_mm, 2 * 1024**3 / t_cp


_SPIN_CYCLES = 500_000  # ~0.25 ms at the H100's 1.98 GHz


def time_rotating_graph(calls, replays: int = 20) -> float:
    """Median µs of one call: the calls (one per input set) are captured in one CUDA graph and
    replayed; rotating inputs larger than L2 keeps every call's K/V cold, as in decoding, and the
    graph removes host launch overhead for every method alike (the clock starts once the graph is
    queued behind a GPU-side spin)."""
    for fn in calls:  # compile / autotune outside the capture
        fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # A GPU-side spin (~0.25 ms) ahead of the start event, so that the host has queued the graph
        # before the clock starts: otherwise the graph's submission latency (tens of us, more when
        # other processes load the CPU, e.g. torch.compile's workers) is timed as GPU time.
        torch.cuda._sleep(_SPIN_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def write_rows(args, rows: list[dict]) -> None:
    """``{"meta": device / torch / arguments, "rows": rows}`` as JSON into ``args.out``."""
    meta = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "args": vars(args)}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


def markdown_row(row: Mapping[str, Any], cols: Sequence[str],
                 fmt: Callable[[str, Any], str | None] | None = None) -> str:  # fmt: skip
    """One markdown table row of ``row``'s ``cols``: ``-`` for a missing value, else ``fmt(col, value)``
    where it returns a string, else floats with one decimal and anything else as ``str``."""
    cells = []
    for c in cols:
        val = row.get(c)
        special = None if val is None or fmt is None else fmt(c, val)
        if val is None:
            cells.append("-")
        elif special is not None:
            cells.append(special)
        elif isinstance(val, float):
            cells.append(f"{val:.1f}")
        else:
            cells.append(str(val))
    return "| " + " | ".join(cells) + " |"


def markdown_table(rows: Sequence[Mapping[str, Any]], cols: Sequence[str],
                   fmt: Callable[[str, Any], str | None] | None = None) -> str:  # fmt: skip
    """A markdown table: the header of ``cols``, then ``markdown_row`` of each row."""
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)
    return "\n".join([head] + [markdown_row(r, cols, fmt) for r in rows])
