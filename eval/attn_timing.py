"""Attention alone on the trees an evaluation proposed: ``treeattn.tree_attention`` vs SDPA.

For each tree size t the evaluation records a few of the drafter's trees (``tree_samples``, parents
arrays) and the prompt lengths it saw. This module rebuilds one decoder layer's attention inputs
with the target's shape (query heads, KV heads, head dim, dtype) for those trees at those prompt
lengths -- the minimum, median and maximum prompt length seen -- and times

* ``tree``: ``treeattn.tree_attention`` (the Triton kernel on CUDA), and
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with a precomputed dense boolean
  ``[n, L + n]`` tree mask (the dense-mask path HF / Medusa-style integrations take),

each as one CUDA graph replayed (median over replays; ``treeattn.timing.time_rotating_graph``), after
checking that both agree: the engine runs attention inside CUDA graphs, so host launch overhead
(tens of µs for a Python op wrapper, which ``do_bench`` timed in a first version) is left out for
both methods alike. Trees are padded
to ``t + 1`` nodes (extra nodes hang off the root), as the engine's static-shape forward does.
Timing needs CUDA: on other devices :func:`sweep_attention` returns None and says why.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["attention_inputs", "prompt_lengths", "sweep_attention", "time_tree", "trees_by_size", "write_rows"]



def trees_by_size(records: Iterable[Mapping[str, Any]], max_trees: int) -> dict[int, list[list[int]]]:
    """Up to ``max_trees`` sampled trees (parents lists) per tree size, from successful records (those of
    ``tree_size`` ``"auto"`` left out: their trees have no one size)."""
    out: dict[int, list[list[int]]] = {}
    for rec in records:
        t = rec.get("tree_size")
        if t is None or isinstance(t, str) or rec.get("error") or not rec.get("tree_samples"):
            continue
        have = out.setdefault(int(t), [])
        for parents in rec["tree_samples"]:
            if len(have) < max_trees:
                have.append(list(parents))
    return dict(sorted(out.items()))


def prompt_lengths(records: Iterable[Mapping[str, Any]]) -> list[int]:
    """The minimum, median and maximum prompt length seen (deduplicated, sorted)."""
    lens = sorted({int(r["prompt_len"]) for r in records if r.get("prompt_len")})
    if not lens:
        return []
    return sorted({lens[0], int(statistics.median_low(lens)), lens[-1]})


def _padded(parents: Sequence[int], n: int) -> list[int]:
    """``parents`` extended with nodes under the root up to ``n`` nodes (the engine's padding)."""
    parents = list(parents)[:n]
    return parents + [0] * (n - len(parents))


def attention_inputs(parents: Sequence[int], prompt_len: int, shape: Mapping[str, int], dtype, device, seed: int = 0):
    """Random ``(q, k, v, prefix_lens, TreeMask)`` of one layer for one tree over ``prompt_len`` keys.

    ``q``: ``[1, num_heads, n, head_dim]``; ``k, v``: ``[1, num_kv_heads, prompt_len + n, head_dim]``;
    ``prefix_lens``: int32 ``[1]`` = ``prompt_len``; all in ``dtype`` on ``device``.
    """
    import torch

    from treeattn import TreeMask

    n = len(parents)
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    q = torch.randn(1, hq, n, d, generator=g).to(device, dtype)
    k = torch.randn(1, hkv, prompt_len + n, d, generator=g).to(device, dtype)
    v = torch.randn(1, hkv, prompt_len + n, d, generator=g).to(device, dtype)
    mask = TreeMask.from_parents(torch.tensor([list(parents)], dtype=torch.int64), device=device)
    prefix = torch.tensor([prompt_len], dtype=torch.int32, device=device)
    return q, k, v, prefix, mask


def time_tree(q, k, v, prefix, mask, timer: Callable[[Callable[[], Any]], float], impl: str = "triton") -> dict[str, float]:
    """µs of ``tree_attention(impl=impl)`` and of SDPA with a dense mask on the same inputs.

    ``timer(fn)`` returns seconds per call. Raises RuntimeError if the two outputs disagree.
    """
    import torch
    import torch.nn.functional as F

    from treeattn import tree_attention
    from treeattn.reference import dense_tree_mask

    group = q.shape[1] // k.shape[1]
    dense = dense_tree_mask(prefix, mask, k.shape[2]).unsqueeze(1)  # [1, 1, n, S]

    def tree():
        return tree_attention(q, k, v, prefix, mask, impl=impl, check_prefix_lens=False)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=group > 1)

    a, b = tree().float(), sdpa().float()
    err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
    if not err < 2e-2:
        raise RuntimeError(f"tree attention and SDPA disagree (relative error {err:.2e}) on a tree of {q.shape[2]} nodes")
    del a, b
    with torch.no_grad():
        return {"tree_us": timer(tree) * 1e6, "sdpa_us": timer(sdpa) * 1e6, "rel_err": err}


def _graph_timer(fn: Callable[[], Any]) -> float:
    """Seconds per call of ``fn`` replayed in a CUDA graph (median of 20 replays)."""
    from treeattn.timing import time_rotating_graph

    return time_rotating_graph([fn]) * 1e-6


def sweep_attention(
    records: Sequence[Mapping[str, Any]],
    shape: Mapping[str, int] | None,
    dtype: str,
    device: str,
    *,
    max_trees: int = 8,
    timer: Callable[[Callable[[], Any]], float] | None = None,
    impl: str = "triton",
    require_cuda: bool = True,
) -> list[dict[str, Any]] | None:
    """One row per (t, prompt length): median µs over the sampled trees of ``tree_attention`` and SDPA.

    Args:
        records: evaluation records (``tree_size``, ``tree_samples``, ``prompt_len``).
        shape: the target's ``num_heads``, ``num_kv_heads``, ``head_dim`` (and ``num_layers``).
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        device: where to time; without CUDA (and ``require_cuda``) nothing is timed.
        max_trees: trees per tree size.
        timer: seconds per call of a function (default: CUDA-graph replay, ``_graph_timer``).
        impl: ``tree_attention``'s implementation (``"triton"``; tests pass ``"torch"``).

    Returns:
        The rows, or None (with a message on stderr) when skipped.
    """
    import torch

    if require_cuda and (not str(device).startswith("cuda") or not torch.cuda.is_available()):
        print("attention timing: skipped (needs a CUDA device; the Triton kernel is only timed on GPU)", file=sys.stderr)
        return None
    if shape is None:
        print("attention timing: skipped (the target's attention shape is unknown)", file=sys.stderr)
        return None
    trees = trees_by_size(records, max_trees)
    lengths = prompt_lengths(records)
    if not trees or not lengths:
        print("attention timing: skipped (no recorded trees)", file=sys.stderr)
        return None
    from specdec.dtypes import parse_dtype  # here: importing this module stays free of torch

    torch_dtype = parse_dtype(dtype, arg="dtype")
    timer = timer or _graph_timer
    rows = []
    for t, samples in trees.items():
        for L in lengths:
            cells = []
            for i, parents in enumerate(samples):
                inputs = attention_inputs(_padded(parents, t + 1), L, shape, torch_dtype, device, seed=i)
                cells.append(time_tree(*inputs, timer=timer, impl=impl))
                del inputs
            tree_us = statistics.median(c["tree_us"] for c in cells)
            sdpa_us = statistics.median(c["sdpa_us"] for c in cells)
            rows.append({
                "tree_size": t, "prompt_len": L, "trees": len(cells), "nodes": t + 1,
                "mean_real_nodes": statistics.fmean(len(p) for p in samples),
                "tree_us": tree_us, "sdpa_us": sdpa_us, "speedup": sdpa_us / tree_us if tree_us > 0 else None,
                "max_rel_err": max(c["rel_err"] for c in cells), "impl": impl, "dtype": dtype,
                **{k: shape[k] for k in ("num_heads", "num_kv_heads", "head_dim", "num_layers") if k in shape},
            })  # fmt: skip
            print(f"attention t={t} L={L}: tree {tree_us:.1f} µs, sdpa {sdpa_us:.1f} µs per layer", file=sys.stderr)
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def write_rows(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Write rows as JSONL (replacing the file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
