"""``specdec bench-attn``: the tree-attention kernel against SDPA / eager / FlexAttention
(``treeattn.bench``; ``--cascade``: the shared-prefix kernel, ``treeattn.bench_cascade``)."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdec.cli import args as cliargs
from treeattn import bench
from treeattn.timing import write_rows

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """``specdec bench-attn``: parse the flags, run the kernel benchmark (``treeattn.bench``)."""
    p = cliargs.ArgumentParser(prog="specdec bench-attn", description=bench.__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--L", type=cliargs.int_at_least(1), nargs="+", default=[1024, 4000, 16000], help="prompt lengths")
    p.add_argument("--t", type=cliargs.int_at_least(1), nargs="+", default=None,
                   help="tree sizes (nodes); default 32 64 128 256 (--cascade: 16 64)")
    p.add_argument("--heads", type=cliargs.int_at_least(1), default=32)
    p.add_argument("--kv-heads", type=cliargs.int_at_least(1), default=8)
    p.add_argument("--head-dim", type=cliargs.int_at_least(1), default=128)
    p.add_argument("--batch", type=cliargs.int_at_least(1), default=1)
    p.add_argument("--max-depth", type=cliargs.int_at_least(1), default=8, help="depth limit of the random trees")
    p.add_argument("--dtype", choices=sorted(bench.DTYPES), default="bf16")
    p.add_argument("--sweep", action="store_true", help="also try a grid of kernel configs, keep the best per cell")
    p.add_argument("--baselines", nargs="*", choices=bench.BASELINES, default=list(bench.BASELINES),
                   help="baselines to time (default: all; none: the kernel only)")
    p.add_argument("--skip-baselines", action="store_const", const=[], dest="baselines",
                   help="time the kernel only (same as --baselines with no names)")
    p.add_argument("--cascade", action="store_true",
                   help="shared-prefix mode (treeattn.bench_cascade): n sequences share a prompt of each --L tokens")
    p.add_argument("--n", type=cliargs.int_at_least(1), nargs="+", default=[4, 16, 64], help="--cascade: sequences per prompt")
    p.add_argument("--suffix-max", type=int, default=256,
                   help="--cascade: sequences' own tokens after the prompt, spread evenly over [0, this]")
    p.add_argument("--cascade-baselines", nargs="*", choices=("unshared", "sdpa_lse"), default=["unshared", "sdpa_lse"],
                   help="--cascade: baselines to time (default both)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    if args.heads % args.kv_heads:
        p.error(f"argument --heads: expected a multiple of --kv-heads = {args.kv_heads}, got {args.heads}")
    if args.out:  # fail now, not after the sweep
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a"):
            pass
    if args.t is None:
        args.t = [16, 64] if args.cascade else [32, 64, 128, 256]
    if args.cascade:
        from treeattn.bench_cascade import run_cascade_cpu_demo, run_cascade_gpu

        rows = run_cascade_gpu(args) if torch.cuda.is_available() else run_cascade_cpu_demo(args)
    else:
        rows = bench.run_gpu(args) if torch.cuda.is_available() else bench.run_cpu_demo(args)
    if args.out:
        write_rows(args, rows)
    return 0

