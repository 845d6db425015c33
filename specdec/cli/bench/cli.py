"""``specdec bench-engine``'s flags: ``build_parser`` and ``main`` (flags -> ``BenchConfig`` ->
``run_bench``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from eval.config import parse_options
from specdec.cli import args as cliargs
from specdec.cli.bench.config import (
    BATCH_DRAFTERS,
    DEFAULT_BANDWIDTH_GBS,
    DEFAULT_DRAFT,
    DEFAULT_SECTIONS,
    DEFAULT_TARGET,
    DRAFTERS,
    DTYPES,
    DEFAULT_PLAIN_METHODS,
    PLAIN_METHODS,
    PROFILE_MODES,
    SCALE_CONFIGS,
    SCALE_PARTS,
    SCALE_TREE_SIZES,
    SECTIONS,
    SPEC_MODES,
    BenchConfig,
)
from specdec.cli.bench.run import run_bench


def _csv(kind: Callable[[str], Any], allowed: Sequence[str] | None = None):
    def parse(text: str):
        vals = tuple(kind(x) for x in text.split(",") if x.strip())
        if allowed is not None:
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {', '.join(bad)}")
        return vals

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(
        prog="specdec bench-engine",
        description="The engine's own speed: (a) plain decode tokens/s (engine eager / CUDA graph vs HF default "
        "and static cache), (b) one verify forward per tree size, (c) per-step breakdown of speculative "
        "decoding (draft model, prompt lookup); opt-in: (d) batch throughput vs HF static cache, (e) kernel "
        "profile of one verify forward, (f) the engine at Llama-3-8B shapes with random weights vs the "
        "weight-streaming floor. Tables on stdout, JSON with --out.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"default model name, HF id, local dir or .gguf (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for the 'model' drafter (default {DEFAULT_DRAFT})")
    p.add_argument("--data", type=cliargs.existing_path, default=None, help="APPS .json/.jsonl file (default: $SPECDEC_APPS or the shared 150-row file)")
    p.add_argument("--problems", type=cliargs.int_at_least(1), default=4, help="APPS problems (first unique ones in file order; default 4)")
    p.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=128)
    p.add_argument("--tree-sizes", type=cliargs.int_at_least(1), nargs="+", default=[1, 16, 32, 64, 128, 256],
                   help="(b) nodes per verify forward, root included (default 1 16 32 64 128 256; 1 is always measured)")
    p.add_argument("--spec-tree-size", type=cliargs.int_at_least(0), default=64,
                   help="(c), (d) draft nodes per step besides the root (default 64)")
    p.add_argument("--sections", type=_csv(str, SECTIONS), default=DEFAULT_SECTIONS,
                   help="comma list of plain, verify, spec, batch, profile, scale (default plain,verify,spec)")
    p.add_argument("--plain-methods", type=_csv(str, PLAIN_METHODS), default=DEFAULT_PLAIN_METHODS,
                   help="(a) comma list of hf, hf-static, engine-eager, engine-graph, engine-compiled, and "
                   "engine-graph-step, engine-compiled-step: the same with decode_chunk=0 (default all but the -step ones)")
    p.add_argument("--drafters", type=_csv(str, DRAFTERS), default=DRAFTERS, help="(c) comma list (default model,lookup)")
    p.add_argument("--spec-modes", type=_csv(str, SPEC_MODES), default=("eager", "graph"),
                   help="(c) comma list of eager, graph, compiled (default eager,graph)")
    p.add_argument("--reps", type=cliargs.int_at_least(1), default=20, help="(b), (e), (f) timed forwards per tree size and mode (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=cliargs.device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--attn-impl", choices=["auto", "triton", "torch"], default="auto",
                   help="tree attention implementation (auto: Triton on CUDA)")
    p.add_argument("--no-fuse", action="store_true",
                   help="keep q / k / v and gate / up as separate GEMMs in specdec's forwards (an A/B of specdec.fused)")
    p.add_argument("--no-progress", action="store_true", help="no model fetch/convert progress bars")
    p.add_argument("--out", type=cliargs.output_file, default=None, help="write the results as JSON here (rewritten after every section)")
    g = p.add_argument_group("(d) batch throughput (--sections batch)")
    g.add_argument("--batch-sizes", type=cliargs.int_at_least(1), nargs="+", default=[1, 2, 4, 8, 16],
                   help="batch sizes (default 1 2 4 8 16); rows cycle through the --problems prompts")
    g.add_argument("--batch-drafter", type=_csv(str, BATCH_DRAFTERS), default=("medusa",),
                   help="comma list of medusa, lookup, eagle (default medusa: needs --medusa-heads; eagle --eagle-heads)")
    g.add_argument("--batch-tree-sizes", type=cliargs.tree_size(0), nargs="+", default=None,
                   help="node budgets of the batch rows: ints (0: specdec-plain, the engine without a drafter, once "
                        "per batch size) and auto (every step's budget); default: --spec-tree-size")
    g.add_argument("--medusa-heads", type=_medusa_dir, default=None, help="Medusa heads directory (specdec train-medusa --out)")
    g.add_argument("--eagle-heads", type=cliargs.existing_path, default=None,
                   help="EAGLE head directory (specdec train-eagle --out) for --batch-drafter eagle")
    g.add_argument("--eagle-option", nargs="+", default=[], metavar="KEY=VALUE",
                   help="more EagleDrafter options of the eagle rows (VALUE as JSON where it parses), e.g. "
                        "batch_expansion=true batch_streams=0")
    g.add_argument("--batch-mode", choices=SPEC_MODES, default="graph", help="engine mode of the batch rows (default graph)")
    g.add_argument("--batch-skip-hf", action="store_true", help="leave out the HF static-cache rows (they compile per batch size)")
    g = p.add_argument_group("(e) kernel profile (--sections profile)")
    g.add_argument("--profile-tree-size", type=cliargs.int_at_least(0), default=64,
                   help="draft nodes of the profiled verify forward besides the root (default 64)")
    g.add_argument("--profile-modes", type=_csv(str, PROFILE_MODES), default=PROFILE_MODES,
                   help="comma list of graph, compiled (default both)")
    g.add_argument("--profile-reps", type=cliargs.int_at_least(1), default=5, help="forwards under the profiler (default 5)")
    g.add_argument("--profile-top", type=cliargs.int_at_least(1), default=15, help="kernels listed by total time (default 15)")
    g = p.add_argument_group("(f) the engine at scale, random weights (--sections scale; no --target needed)")
    g.add_argument("--scale-config", choices=sorted(SCALE_CONFIGS), default=None,
                   help="model shape (default: llama3-8b on CUDA, tiny on CPU)")
    g.add_argument("--scale-prompts", type=cliargs.int_at_least(2), nargs="+", default=None,
                   help="prompt lengths, random token ids (default 1024 16384 for llama3-8b, 512 for the qwen2.5 shapes, 64 256 for tiny)")
    g.add_argument("--scale-new-tokens", type=cliargs.int_at_least(2), default=64, help="plain decode tokens timed (default 64)")
    g.add_argument("--scale-tree-sizes", type=cliargs.int_at_least(1), nargs="+", default=list(SCALE_TREE_SIZES),
                   help="verify forwards of t draft nodes + the root (t = 0 always; default 1 2 4 ... 256)")
    g.add_argument("--scale-parts", type=_csv(str, SCALE_PARTS), default=("engine-graph", "hf-static", "verify"),
                   help="comma list of engine-graph, engine-compiled (compile=True: layer-wise), engine-inductor (the "
                   "whole forward compiled), engine-compiled-step (decode_chunk=0), hf-static, verify "
                   "(default engine-graph,hf-static,verify)")
    p.add_argument("--bandwidth-gbs", type=cliargs.float_in(0.0, low_open=True), default=DEFAULT_BANDWIDTH_GBS,
                   help="(e), (f) memory bandwidth of the floor, GB/s (default 3000: the H100's copy bandwidth; the run "
                   "also measures one and reports both)")
    return p


def _medusa_dir(text: str) -> str:
    """argparse type: a directory holding saved Medusa heads."""
    from pathlib import Path

    from drafters.medusa import CONFIG_NAME, WEIGHTS_NAME

    path = Path(cliargs.existing_path(text))
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (path / n).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"expected a Medusa heads directory with {' and '.join(missing)}, got {text!r}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = BenchConfig(
        target=ns.target, draft=ns.draft, data=ns.data, problems=ns.problems, max_new_tokens=ns.max_new_tokens,
        tree_sizes=tuple(ns.tree_sizes), spec_tree_size=ns.spec_tree_size, sections=tuple(ns.sections),
        plain_methods=tuple(ns.plain_methods), drafters=tuple(ns.drafters), spec_modes=tuple(ns.spec_modes),
        reps=ns.reps, seed=ns.seed,
        device=ns.device, dtype=ns.dtype, attn_impl=ns.attn_impl, fuse=not ns.no_fuse, progress=not ns.no_progress, out=ns.out,
        batch_sizes=tuple(ns.batch_sizes), batch_drafters=tuple(ns.batch_drafter), batch_mode=ns.batch_mode,
        batch_skip_hf=ns.batch_skip_hf, batch_tree_sizes=tuple(ns.batch_tree_sizes or ()),
        medusa_heads=ns.medusa_heads, eagle_heads=ns.eagle_heads,
        eagle_options=parse_options(ns.eagle_option, "--eagle-option"), profile_tree_size=ns.profile_tree_size,
        profile_modes=tuple(ns.profile_modes), profile_reps=ns.profile_reps, profile_top=ns.profile_top,
        scale_config=ns.scale_config, scale_prompts=None if ns.scale_prompts is None else tuple(ns.scale_prompts),
        scale_new_tokens=ns.scale_new_tokens, scale_tree_sizes=tuple(ns.scale_tree_sizes),
        scale_parts=tuple(ns.scale_parts), bandwidth_gbs=ns.bandwidth_gbs,
    )  # fmt: skip
    run_bench(cfg)
    return 0
