"""Helpers shared by the ``bench-engine`` sections and the device profilers (``scripts/device``): timing,
random trees, freeing device memory between cells, error rows, the number formats of the tables, and
``--inductor NAME=VALUE`` settings."""

from __future__ import annotations

import itertools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

# ----------------------------------------------------------------------------------------------
# timing


class Timer:
    """Wall time of a region: CUDA events + synchronize on CUDA, ``perf_counter`` on CPU."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Run ``fn()``; return (seconds, its result). The device is idle before and after."""
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._start.record()
            out = fn()
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3


def time_graphed(timer: Timer, reps: int, graphed, tree, prefix: int) -> list[float]:
    """Seconds of ``reps`` timed ``graphed.run`` calls after two untimed ones (the first captures)."""
    for _ in range(2):
        graphed.run([tree], [prefix])
    return [timer(lambda: graphed.run([tree], [prefix]))[0] for _ in range(reps)]


# ----------------------------------------------------------------------------------------------
# inputs, memory, errors


def random_tree(n: int, root: int, vocab: int, gen):
    """A random ``TokenTree`` of n nodes (``random_tree_parents``; random tokens, ``root`` at node 0)."""
    import torch

    from specdec.tree import TokenTree
    from treeattn.layout import random_tree_parents

    parents = random_tree_parents(n, generator=gen)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    tokens[0] = int(root)
    return TokenTree(tokens, parents)


def free_memory(device) -> None:
    """Collect garbage and hand cached device memory back (between cells of the big sections)."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def guarded(rows: list, fallback: dict[str, Any], fn: Callable[[], dict[str, Any]], log) -> None:
    """Append ``fn()``, or ``fallback`` plus the error when it raises (the run goes on)."""
    try:
        rows.append(fn())
    except Exception as e:  # noqa: BLE001 - reported in the table and the JSON, the other rows still run
        log(f"  error: {type(e).__name__}: {e}")
        rows.append({**fallback, "error": f"{type(e).__name__}: {e}"})


# ----------------------------------------------------------------------------------------------
# table cells


def fmt(val, spec: str) -> str:
    if val is None or (isinstance(val, float) and math.isnan(val)):
        width = "".join(itertools.takewhile(str.isdigit, spec))
        return "-".rjust(int(width or 0))
    return format(val, spec)


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e7 else f"{nbytes / 1e3:.1f} kB"


def num(val, width: int = 0) -> str:
    """Two decimals, or three significant digits for large / tiny values (ratios against a tiny floor)."""
    if val is None or (isinstance(val, float) and math.isnan(val)):
        return "-".rjust(width)
    text = f"{val:.2f}" if 0.01 <= abs(val) < 1e4 or val == 0 else f"{val:.3g}"
    return text.rjust(width)


def set_inductor_options(items: list[str]) -> dict:
    """Set each ``NAME=VALUE`` of ``--inductor`` on ``torch._inductor.config`` (dotted names reach its
    sub-configs, e.g. ``triton.cudagraphs``); returns them as set. Raises SystemExit naming a bad item."""
    import ast

    import torch._inductor.config as config

    out = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"--inductor: expected NAME=VALUE, got {item!r}")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"--inductor {name}: expected a Python literal, got {text!r}") from None
        *path, leaf = name.split(".")
        target = config
        for part in path:
            target = getattr(target, part, None)
        if target is None or not hasattr(target, leaf):
            raise SystemExit(f"--inductor: torch._inductor.config has no setting {name!r}")
        setattr(target, leaf, value)
        out[name] = value
    return out
