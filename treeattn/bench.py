"""Tree-attention benchmark: the Triton kernel against eager, SDPA and FlexAttention baselines.

    specdec bench-attn [--L 1024 4000 16000] [--t 32 64 128 256] [--out bench.json]
    specdec bench-attn --cascade [--L 1024 4000 16000] [--n 4 16 64] [--t 16 64]  (shared prompt)

(the flags are parsed by ``specdec.cli.bench_attn``; this module holds the measurements.)

On a GPU it measures the copy bandwidth and the bf16 matmul peak in the same run, times every
(L, t) cell and every method the same way (median of CUDA-graph replays over rotating input sets
larger than L2: cold K/V, no host launch overhead), checks every output against the float32
reference, and prints µs per method, the speedup over the best baseline and the fraction of the
roofline floor ``max(visible-pair FLOPs / peak, bytes / bandwidth)``. Without a GPU it runs a
small correctness demo of the kernel through Triton's interpreter and times the torch path.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from treeattn.layout import TreeMask, random_tree_parents
from treeattn.ops import KernelConfig, pick_config, tree_attention
from treeattn.reference import dense_tree_mask, flex_tree_mask_mod, tree_attention_ref
from treeattn.timing import markdown_row, markdown_table, measure_ceilings, time_rotating_graph, write_rows

__all__ = ["DTYPES", "BenchShape", "make_inputs", "run_cpu_demo", "run_gpu", "sweep_configs"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""The ``--dtype`` names of the benchmark (treeattn sits below the library's own dtype parser)."""


@dataclass(frozen=True)
class BenchShape:
    """One benchmark cell: a prompt of L tokens shared by a tree of t nodes."""

    L: int
    t: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    batch: int = 1
    max_depth: int = 8


def make_inputs(shape: BenchShape, dtype: torch.dtype, device: str, seed: int):
    """Random q, k, v, prefix_lens, TreeMask for one cell (cache exactly holds prompt + tree)."""
    g = torch.Generator().manual_seed(seed)
    s = shape
    seq_len = s.L + s.t
    q = torch.randn(s.batch, s.heads, s.t, s.head_dim, generator=g).to(device, dtype)
    k = torch.randn(s.batch, s.kv_heads, seq_len, s.head_dim, generator=g).to(device, dtype)
    v = torch.randn(s.batch, s.kv_heads, seq_len, s.head_dim, generator=g).to(device, dtype)
    parents = torch.stack([random_tree_parents(s.t, s.max_depth, g) for _ in range(s.batch)])
    mask = TreeMask.from_parents(parents, device=device)
    prefix_lens = torch.full((s.batch,), s.L, dtype=torch.int32, device=device)
    return q, k, v, prefix_lens, mask


def roofline(shape: BenchShape, mask: TreeMask, dtype: torch.dtype, peak_flops: float, bandwidth: float):
    """(floor seconds, FLOPs, bytes): visible query-key pairs x 4·D FLOPs; K, V, Q, O bytes once."""
    s = shape
    visible = (s.L + mask.depth.double() + 1).sum().item()  # keys each query sees, summed
    flops = 4.0 * s.head_dim * s.heads * visible
    esize = torch.finfo(dtype).bits // 8
    nbytes = esize * s.head_dim * s.batch * (2 * s.kv_heads * (s.L + s.t) + 2 * s.heads * s.t)
    return max(flops / peak_flops, nbytes / bandwidth), flops, nbytes


BASELINES = ("eager", "sdpa", "sdpa_repeat_kv", "flex")


def _baselines(q, k, v, prefix_lens, mask, names=BASELINES):
    """Callables for eager (HF/Medusa: repeat_kv, matmul, additive dense mask, fp32 softmax),
    SDPA with a dense boolean mask, SDPA over repeated K/V, and FlexAttention with a tree block
    mask; only those in ``names``."""
    group = q.shape[1] // k.shape[1]
    seq_len = k.shape[2]
    scale = q.shape[-1] ** -0.5
    dense = dense_tree_mask(prefix_lens, mask, seq_len).unsqueeze(1)  # [B, 1, n, S]
    additive = torch.zeros(dense.shape, dtype=q.dtype, device=q.device).masked_fill(~dense, torch.finfo(q.dtype).min)

    def eager():
        kr = k.repeat_interleave(group, dim=1)
        vr = v.repeat_interleave(group, dim=1)
        w = torch.matmul(q, kr.transpose(2, 3)) * scale + additive
        w = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(w, vr)

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=group > 1)

    def sdpa_repeat():
        kr = k.repeat_interleave(group, dim=1)
        vr = v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, kr, vr, attn_mask=dense)

    fns = {name: fn for name, fn in (("eager", eager), ("sdpa", sdpa), ("sdpa_repeat_kv", sdpa_repeat))
           if name in names}
    if "flex" not in names:
        return fns
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        block = create_block_mask(flex_tree_mask_mod(prefix_lens, mask), q.shape[0], None, q.shape[2], seq_len,
                                  device=q.device)
        compiled = torch.compile(flex_attention, dynamic=False)
        fns["flex"] = lambda: compiled(q, k, v, block_mask=block, enable_gqa=group > 1)
    except Exception as exc:  # FlexAttention is optional: report, don't fail the whole run
        print(f"flex: unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
    return fns


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def _num_input_sets(shape: BenchShape, dtype: torch.dtype) -> int:
    """Enough input sets to exceed 4x the L2 cache, at most 32."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    per_set = torch.finfo(dtype).bits // 8 * 2 * shape.batch * shape.kv_heads * (shape.L + shape.t) * shape.head_dim
    return max(2, min(32, math.ceil(4 * l2 / per_set)))


def run_gpu(args) -> list[dict]:
    dtype = DTYPES[args.dtype]
    peak, bw = measure_ceilings("cuda")
    print(f"measured: bf16 matmul {peak / 1e12:.0f} TFLOP/s, copy {bw / 1e12:.2f} TB/s "
          f"({torch.cuda.get_device_name()})")
    configs = sweep_configs() if args.sweep else [None]
    rows = []
    for L in args.L:
        for t in args.t:
            shape = BenchShape(L=L, t=t, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                               batch=args.batch, max_depth=args.max_depth)
            sets = [make_inputs(shape, dtype, "cuda", args.seed + 1000 * i + L + t)
                    for i in range(_num_input_sets(shape, dtype))]
            q, k, v, pl, mask = sets[0]
            ref = tree_attention_ref(q, k, v, pl, mask)
            floor, flops, nbytes = roofline(shape, mask, dtype, peak, bw)
            row = {"L": L, "t": t, "input_sets": len(sets), "floor_us": floor * 1e6, "flops": flops, "bytes": nbytes}
            timings = []  # (µs, config, error) of every config that ran
            for cfg in configs:
                res = _time_config(sets, cfg, ref, args)
                if res is not None:
                    timings.append(res)
            if args.sweep:  # second phase: vary the prompt split count of the three best configs
                top = sorted(timings, key=lambda x: x[0])[:3]
                for cfg0 in [c or pick_config(shape.batch, shape.kv_heads, shape.heads // shape.kv_heads, t,
                                              L + t, shape.head_dim, q.device)[0] for _, c, _ in top]:
                    for splits in (1, 2, 4, 8):  # 16 and 32 put these cells into a second wave
                        res = _time_config(sets, replace(cfg0, num_splits=splits), ref, args)
                        if res is not None:
                            timings.append(res)
                row["sweep"] = [[us, asdict(c) if c else "auto"] for us, c, _ in timings]
            if args.sweep:
                row["auto_us"] = next((us for us, c, _ in timings if c is None), None)
            # torch.compile (the flex baseline) points Triton at torch's ptxas for every kernel
            # compiled after it in this process; the SASS and the timings differ (PERF.md, v10).
            row["ptxas"] = os.environ.get("TRITON_PTXAS_PATH", "triton's bundled")
            best_us, best_cfg, row["err_triton"] = min(timings, key=lambda x: x[0])
            row["triton_us"] = best_us
            row["triton_config"] = asdict(best_cfg) if best_cfg else "auto"
            if args.baselines:
                per_set = [_baselines(*s, names=args.baselines) for s in sets]
                for name in per_set[0]:
                    try:
                        row[f"err_{name}"] = _rel_err(per_set[0][name](), ref)
                        row[f"{name}_us"] = time_rotating_graph([fns[name] for fns in per_set])
                    except Exception as exc:
                        print(f"{name} failed at L={L} t={t}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
                del per_set
            base = {n: row[f"{n}_us"] for n in ("eager", "sdpa", "sdpa_repeat_kv", "flex") if f"{n}_us" in row}
            if base:
                best_name = min(base, key=base.get)
                row.update(best_baseline=best_name, best_baseline_us=base[best_name], speedup=base[best_name] / best_us)
            row.update(floor_frac=row["floor_us"] / best_us,
                       tflops=flops / best_us * 1e-6, gbps=nbytes / best_us * 1e-3)
            rows.append(row)
            print(_fmt_row(row), flush=True)
            if args.out:  # after every cell: a run cut short by a time limit keeps its finished cells
                write_rows(args, rows)
            del sets, q, k, v, ref
            torch.cuda.empty_cache()
    print()
    print(_table(rows))
    return rows


def _time_config(sets, cfg, ref, args):
    """(median µs, cfg, rel. error) of the kernel with ``cfg``; None if a sweep config cannot run."""
    calls = [lambda s=s: tree_attention(*s, check_prefix_lens=False, config=cfg) for s in sets]
    try:
        out = calls[0]()
    except Exception as exc:  # e.g. a config needing more shared memory than the GPU has
        if not args.sweep:
            raise
        print(f"  config {cfg} skipped: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
        return None
    err = _rel_err(out, ref)
    if not err < 2e-2:
        raise RuntimeError(f"kernel output wrong at L={sets[0][1].shape[2]} config={cfg}: rel err {err:.2e}")
    return time_rotating_graph(calls), cfg, err


def sweep_configs() -> list[KernelConfig | None]:
    """The auto config plus 14: per tile shape (64x128 / 4 warps, 128x128 / 8 warps over auto and
    2 splits, 64x64 / 4 warps; 3 stages) the tree part (v3's word tiles or gathered tiles of 32 or
    64 keys; 32 only at 64x64), 128x128 over 2 splits with warp specialization, and 64x64 split
    for two programs per SM with float32 and 16-bit partials. Every field of a config is recorded
    (``asdict``); the second phase varies the split count of the three best."""
    cfgs: list[KernelConfig | None] = [None]
    for bm, bn, w, splits, tree_tiles in [(64, 128, 4, None, (None, 32, 64)), (128, 128, 8, None, (None, 32, 64)),
                                          (128, 128, 8, 2, (None, 32, 64)), (64, 64, 4, None, (None, 32))]:
        for bt in tree_tiles:  # None: v3's word tiles
            cfgs.append(KernelConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=3, num_splits=splits,
                                     block_t=bt or 64, gather=bt is not None))
    cfgs.append(KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, num_splits=2, block_t=64,
                             gather=True, warp_specialize=True))
    for partials in (False, True):
        cfgs.append(KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, block_t=32, programs_per_sm=2,
                                 partials_in_input_dtype=partials))
    return cfgs


_COLS = ["L", "t", "triton_us", "eager_us", "sdpa_us", "sdpa_repeat_kv_us", "flex_us", "speedup", "floor_us",
         "floor_frac", "tflops", "gbps"]


def _fmt(col: str, val) -> str | None:
    return f"{val:.0%}" if col == "floor_frac" and isinstance(val, float) else None


def _fmt_row(row: dict) -> str:
    return markdown_row(row, _COLS, _fmt)


def _table(rows: list[dict]) -> str:
    return markdown_table(rows, _COLS, _fmt)


def run_cpu_demo(args) -> list[dict]:
    """No GPU: check the kernel (Triton interpreter when enabled) and time the torch path."""
    import time

    rows = []
    for L, t in [(100, 32), (300, 64)]:
        shape = BenchShape(L=L, t=t, heads=8, kv_heads=2, head_dim=64, max_depth=args.max_depth)
        q, k, v, pl, mask = make_inputs(shape, torch.float32, "cpu", args.seed + L + t)
        ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
        row = {"L": L, "t": t}
        impls = ["torch"] + (["triton"] if os.environ.get("TRITON_INTERPRET") == "1" else [])
        for impl in impls:
            start = time.perf_counter()
            out = tree_attention(q, k, v, pl, mask, impl=impl)
            row[f"{impl}_ms"] = (time.perf_counter() - start) * 1e3
            row[f"err_{impl}"] = ((out.double() - ref).norm() / ref.norm()).item()
        rows.append(row)
        print(" ".join(f"{key}={val:.3g}" if isinstance(val, float) else f"{key}={val}" for key, val in row.items()))
    print("no CUDA device: correctness demo only (set TRITON_INTERPRET=1 to also run the kernel on CPU)")
    return rows
