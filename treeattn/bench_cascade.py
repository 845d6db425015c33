"""Shared-prefix ("cascade") tree attention benchmark: ``specdec bench-attn --cascade``.

n sequences share a prompt of P tokens, each has its own suffix (its generated tokens; lengths
spread evenly over ``[0, --suffix-max]``) and its own random tree of t nodes. Per (P, n, t) cell,
timed as ``treeattn.bench`` times (median of CUDA-graph replays over rotating input sets larger
than L2; every output checked against the float32 reference):

* ``cascade``: ``cascade_tree_attention`` (prefix KV once; the fused kernel);
* ``cascade_dev``: the same with the prefix in a fixed-capacity buffer (C = the power of two >= P,
  as the engine's default cache buckets) and P as a device tensor (``shared_len``): the form a
  captured CUDA graph runs, its split plan chosen for C;
* ``two_level``: the same with ``CascadeConfig(fused=False)`` (level 2 as a second launch of the
  tree kernel, a merge of the two levels' states);
* ``prefix``: level 1 alone (``cascade_prefix_kernel``, the two-level variant's first launch);
* ``unshared``: today's ``tree_attention`` on the equivalent layout, the prefix copied into every
  sequence's cache (``P + suffix`` as its prompt);
* ``sdpa_lse``: two SDPA calls (flash attention over the folded prefix, memory-efficient attention
  with the suffix + tree mask) merged by log-sum-exp.

Floor = max(visible-pair FLOPs / matmul peak, bytes / copy bandwidth), both measured in the same
run; bytes = the prefix's K and V once, every sequence's suffix + tree K and V, Q and O. Both
parts are reported (``compute_floor_us``, ``mem_floor_us``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from treeattn.cascade import (
    CascadeConfig,
    cascade_plan,
    cascade_tree_attention,
    launch_prefix,
    sdpa_lse_cascade,
    suffix_bias,
)
from treeattn.cascade_reference import cascade_tree_attention_ref, unshared_layout
from treeattn.layout import TreeMask, random_tree_parents
from treeattn.ops import tree_attention
from treeattn.timing import markdown_row, markdown_table

__all__ = ["CascadeShape", "cascade_roofline", "device_len_inputs", "make_cascade_inputs", "memory_report",
           "prompt_kv_bytes", "run_cascade_cpu_demo", "run_cascade_gpu"]


@dataclass(frozen=True)
class CascadeShape:
    """One cell: n sequences sharing a prompt of P tokens, suffixes spread over [0, suffix_max],
    a tree of t nodes each."""

    P: int
    n: int
    t: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    suffix_max: int = 256
    max_depth: int = 8

    def suffix_lens(self) -> list[int]:
        """Sequence b's own tokens: ``round(b * suffix_max / (n - 1))`` (mean ``suffix_max / 2``)."""
        return [round(b * self.suffix_max / max(self.n - 1, 1)) for b in range(self.n)]


def make_cascade_inputs(shape: CascadeShape, dtype: torch.dtype, device: str, seed: int):
    """Random ``q, k_shared, v_shared, k, v, suffix_lens, TreeMask`` (caches of S = max suffix + t)."""
    s = shape
    g = torch.Generator().manual_seed(seed)
    sl = torch.tensor(s.suffix_lens(), dtype=torch.int32)
    seq_len = int(sl.max()) + s.t

    def rnd(*size):
        return torch.randn(*size, generator=g).to(device, dtype)

    q = rnd(s.n, s.heads, s.t, s.head_dim)
    ks, vs = rnd(s.kv_heads, s.P, s.head_dim), rnd(s.kv_heads, s.P, s.head_dim)
    k, v = rnd(s.n, s.kv_heads, seq_len, s.head_dim), rnd(s.n, s.kv_heads, seq_len, s.head_dim)
    parents = torch.stack([random_tree_parents(s.t, s.max_depth, g) for _ in range(s.n)])
    return q, ks, vs, k, v, sl.to(device), TreeMask.from_parents(parents, device=device)


def device_len_inputs(inputs: tuple, capacity: int | None = None) -> tuple[tuple, torch.Tensor]:
    """``make_cascade_inputs``' tuple with the prefix copied into ``[Hkv, C, D]`` buffers (zeros after
    P; C = ``capacity``, default the power of two >= P) and P as an int64 ``[1]`` on the device:
    ``(inputs, shared_len)`` for ``cascade_tree_attention(*inputs, shared_len=shared_len)``."""
    q, ks, vs, k, v, sl, mask = inputs
    hkv, p_len, d = ks.shape
    capacity = 1 << max(p_len - 1, 0).bit_length() if capacity is None else capacity
    ks_buf, vs_buf = (torch.zeros(hkv, capacity, d, dtype=x.dtype, device=x.device) for x in (ks, vs))
    ks_buf[:, :p_len], vs_buf[:, :p_len] = ks, vs
    return (q, ks_buf, vs_buf, k, v, sl, mask), torch.tensor([p_len], dtype=torch.int64, device=q.device)


def cascade_roofline(shape: CascadeShape, mask: TreeMask, dtype: torch.dtype, peak_flops: float, bandwidth: float):
    """``(floor s, compute floor s, memory floor s, FLOPs, bytes)``: visible pairs x 4·D FLOPs
    (every query sees P + its suffix + depth + 1 keys); bytes = prefix K, V once + every
    sequence's suffix + tree K, V + Q + O."""
    s = shape
    suffix = torch.tensor(s.suffix_lens(), dtype=torch.float64)
    visible = (s.P + suffix.view(-1, 1) + mask.depth.double().cpu() + 1).sum().item()
    flops = 4.0 * s.head_dim * s.heads * visible
    esize = torch.finfo(dtype).bits // 8
    kv_tokens = s.P + (suffix + s.t).sum().item()
    nbytes = esize * s.head_dim * (2 * s.kv_heads * kv_tokens + 2 * s.heads * s.n * s.t)
    compute, memory = flops / peak_flops, nbytes / bandwidth
    return max(compute, memory), compute, memory, flops, nbytes


def prompt_kv_bytes(prompt_len: int, n: int, layers: int, kv_heads: int, head_dim: int, esize: int) -> tuple[int, int]:
    """``(shared, unshared)`` bytes of the prompt's K and V over all layers: once, or once per
    sequence (today's layout)."""
    once = 2 * layers * kv_heads * head_dim * esize * prompt_len
    return once, n * once


def memory_report(prompt_len: int = 4000, n: int = 16) -> str:
    """The prompt KV of n sequences, Qwen2.5(-Coder)-1.5B shapes (28 layers, 2 KV heads, d 128,
    bf16), shared vs per sequence."""
    shared, unshared = prompt_kv_bytes(prompt_len, n, layers=28, kv_heads=2, head_dim=128, esize=2)
    return (f"prompt KV, Qwen2.5-1.5B (28 layers x 2 KV heads x d 128, bf16), n = {n}, P = {prompt_len}: "
            f"shared {shared / 1e6:.1f} MB ({shared / 2**20:.1f} MiB), per-sequence copies {unshared / 1e6:.1f} MB "
            f"({unshared / 2**20:.1f} MiB); saved {(unshared - shared) / 1e6:.1f} MB ({n}x less)")


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def _num_sets(nbytes: int) -> int:
    """Enough input sets of ``nbytes`` each to exceed 4x the L2 cache, 2 to 32."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(32, math.ceil(4 * l2 / max(nbytes, 1))))


def run_cascade_gpu(args) -> list[dict]:
    from treeattn.timing import measure_ceilings, time_rotating_graph, write_rows

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    esize = torch.finfo(dtype).bits // 8
    print(memory_report())
    peak, bw = measure_ceilings("cuda")
    print(f"measured: bf16 matmul {peak / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s ({torch.cuda.get_device_name()})")
    rows = []
    for p_len in args.L:
        for n in args.n:
            for t in args.t:
                shape = CascadeShape(P=p_len, n=n, t=t, heads=args.heads, kv_heads=args.kv_heads,
                                     head_dim=args.head_dim, suffix_max=args.suffix_max, max_depth=args.max_depth)
                rows.append(_cell(shape, dtype, esize, peak, bw, args, time_rotating_graph))
                print(_fmt_row(rows[-1]), flush=True)
                if args.out:
                    write_rows(args, rows)
                torch.cuda.empty_cache()
    print()
    print(_table(rows))
    return rows


def _cell(shape: CascadeShape, dtype, esize, peak, bw, args, time_rotating_graph) -> dict:
    s = shape
    seq_len = max(s.suffix_lens()) + s.t
    cascade_bytes = esize * s.head_dim * 2 * s.kv_heads * (s.P + s.n * seq_len)
    sets = [make_cascade_inputs(s, dtype, "cuda", args.seed + 1000 * i + s.P + 10 * s.n + s.t)
            for i in range(_num_sets(cascade_bytes))]
    q, ks, vs, k, v, sl, mask = sets[0]
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, compute_dtype=torch.float32)
    floor, compute, memory, flops, nbytes = cascade_roofline(s, mask, dtype, peak, bw)
    plan = cascade_plan(s.n, s.heads, s.kv_heads, s.t, s.P, seq_len, s.head_dim, q.device, dtype)
    two = cascade_plan(s.n, s.heads, s.kv_heads, s.t, s.P, seq_len, s.head_dim, q.device, dtype,
                       CascadeConfig(fused=False))
    row = {"P": s.P, "n": s.n, "t": s.t, "suffix_mean": sum(s.suffix_lens()) / s.n, "input_sets": len(sets),
           "floor_us": floor * 1e6, "compute_floor_us": compute * 1e6, "mem_floor_us": memory * 1e6,
           "flops": flops, "bytes": nbytes,
           "fused_plan": [plan.prefix.block_m, plan.prefix.block_n, plan.prefix.num_warps, plan.prefix.num_stages,
                          *plan.prefix_plan],
           "two_level_plan": {"prefix": [two.prefix.block_m, two.prefix.block_n, *two.prefix_plan],
                              "suffix": [two.suffix.block_m, two.suffix.block_n, two.suffix.gather, *two.suffix_plan]},
           "ptxas": os.environ.get("TRITON_PTXAS_PATH", "triton's bundled")}

    def check(name, fn):
        err = _rel_err(fn(), ref)
        row[f"err_{name}"] = err
        if not err < 2e-2:
            raise RuntimeError(f"{name} output wrong at P={s.P} n={s.n} t={s.t}: rel err {err:.2e}")

    calls = [lambda x=x: cascade_tree_attention(*x, check_suffix_lens=False) for x in sets]
    check("cascade", calls[0])
    row["cascade_us"] = time_rotating_graph(calls)
    dev_sets = [device_len_inputs(x) for x in sets]
    row["cascade_dev_capacity"] = dev_sets[0][0][1].shape[1]
    dev_calls = [lambda x=x, p=p: cascade_tree_attention(*x, shared_len=p, check_suffix_lens=False)
                 for x, p in dev_sets]
    check("cascade_dev", dev_calls[0])
    row["cascade_dev_us"] = time_rotating_graph(dev_calls)
    del dev_sets, dev_calls
    scale = s.head_dim**-0.5
    row["prefix_us"] = time_rotating_graph(
        [lambda x=x: launch_prefix(x[0], x[1], x[2], scale, two.prefix, two.prefix_plan) for x in sets])
    two_level = [lambda x=x: cascade_tree_attention(*x, check_suffix_lens=False, config=CascadeConfig(fused=False))
                 for x in sets]
    check("two_level", two_level[0])
    row["two_level_us"] = time_rotating_graph(two_level)
    if "sdpa_lse" in args.cascade_baselines:
        biases = [suffix_bias(x[5], x[6], x[3].shape[2], s.heads // s.kv_heads, dtype) for x in sets]
        sdpa = [lambda x=x, b=b: sdpa_lse_cascade(x[0], x[1], x[2], x[3], x[4], b, scale) for x, b in zip(sets, biases)]
        try:
            check("sdpa_lse", sdpa[0])
            row["sdpa_lse_us"] = time_rotating_graph(sdpa)
        except Exception as exc:  # a stock kernel may refuse a shape: report, keep the cell
            print(f"sdpa_lse failed at P={s.P} n={s.n} t={s.t}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        del biases, sdpa
    if "unshared" in args.cascade_baselines:
        unshared_bytes = esize * s.head_dim * 2 * s.kv_heads * s.n * (s.P + seq_len)
        full = []
        for x in sets[: _num_sets(unshared_bytes)]:
            kf, vf, pl = unshared_layout(x[1], x[2], x[3], x[4], x[5])
            full.append((x[0], kf, vf, pl.to(torch.int32), x[6]))
        check("unshared", lambda: tree_attention(*full[0]))
        row["unshared_us"] = time_rotating_graph([lambda x=x: tree_attention(*x, check_prefix_lens=False)
                                                  for x in full])
        row["unshared_input_sets"] = len(full)
        del full
    us = row["cascade_us"]
    for name in ("unshared", "sdpa_lse"):
        if f"{name}_us" in row:
            row[f"speedup_vs_{name}"] = row[f"{name}_us"] / us
    row.update(floor_frac=row["floor_us"] / us, tflops=flops / us * 1e-6, gbps=nbytes / us * 1e-3)
    del sets
    return row


_COLS = ["P", "n", "t", "cascade_us", "cascade_dev_us", "two_level_us", "prefix_us", "unshared_us", "sdpa_lse_us",
         "speedup_vs_unshared", "speedup_vs_sdpa_lse", "floor_us", "compute_floor_us", "mem_floor_us", "floor_frac",
         "tflops", "gbps"]


def _fmt(col: str, val) -> str | None:
    if col == "floor_frac":
        return f"{val:.0%}"
    return f"{val:.2f}x" if col.startswith("speedup") else None


def _fmt_row(row: dict) -> str:
    return markdown_row(row, _COLS, _fmt)


def _table(rows: list[dict]) -> str:
    return markdown_table(rows, _COLS, _fmt)


def run_cascade_cpu_demo(args) -> list[dict]:
    """No GPU: the memory report, and one small cell's errors (kernel through the interpreter when
    enabled, the torch path) against the float64 reference."""
    print(memory_report())
    shape = CascadeShape(P=100, n=3, t=9, heads=8, kv_heads=2, head_dim=32, suffix_max=40, max_depth=args.max_depth)
    x = make_cascade_inputs(shape, torch.float32, "cpu", args.seed)
    ref = cascade_tree_attention_ref(*x)
    row = {"P": shape.P, "n": shape.n, "t": shape.t}
    impls = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
    dev, shared_len = device_len_inputs(x)
    for impl in impls:
        start = time.perf_counter()
        out = cascade_tree_attention(*x, impl=impl)
        row[f"{impl}_ms"] = (time.perf_counter() - start) * 1e3
        row[f"err_{impl}"] = _rel_err(out.double(), ref)
        row[f"err_{impl}_dev"] = _rel_err(cascade_tree_attention(*dev, impl=impl, shared_len=shared_len).double(), ref)
    print(" ".join(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}" for key, val in row.items()))
    print("no CUDA device: correctness demo only")
    return [row]
