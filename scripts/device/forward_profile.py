"""Where the compiled fixed-shape forward's time goes, at a model's shapes with random weights
(no staging): per node count, the replayed forward's median time, then the kernels of the same
compiled body run uncaptured (count per layer, GEMM / attention / other, the costliest kernels),
against the weight-streaming floor.

    python scripts/device/forward_profile.py --config llama3-8b --prompt 1024 --nodes 1 65 --out $OUT/fp-8b.json
    python scripts/device/forward_profile.py --config qwen2.5-1.5b --prompt 1024 --nodes 1 65 --out $OUT/fp-15.json

``--compile none`` profiles the eager body captured (what ``specdec generate`` replays; ``--no-fuse-norms``:
with the stock RMSNorms, the A/B of ``specdec.fused.fuse_norms``).

On a CPU (inductor's C++ code; the check column compares the compiled forward with the uncompiled one):

    python scripts/device/forward_profile.py --config qwen2.5-1.5b --layers 8 --prompt 256 --nodes 65 --device cpu --reps 2 --profile-reps 1 --out fp-cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from specdec import hf  # noqa: E402
from specdec.fused import fused_norms, unfuse_norms  # noqa: E402
from specdec.cli.bench.common import Timer, median_ms, random_tree, set_inductor_options  # noqa: E402
from specdec.cli.bench.config import SCALE_CONFIGS  # noqa: E402
from specdec.cli.bench.floor import forward_floors  # noqa: E402
from specdec.cli.bench.kernels import profile_kernels, summarize_kernels  # noqa: E402
from specdec.cli.bench.scale import build_scale_model  # noqa: E402
from specdec.graphs import GraphedForward  # noqa: E402
from specdec.kv import KVCache  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(SCALE_CONFIGS), default="llama3-8b")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens in the cache (random ids)")
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 65], help="tree nodes per forward (root included)")
    p.add_argument("--reps", type=int, default=20, help="timed replays per node count")
    p.add_argument("--profile-reps", type=int, default=5)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--bandwidth-gbs", type=float, default=3000.0)
    p.add_argument("--device", default="cuda", help="cuda (cpu: a smoke test, nothing captured)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers instead of the config's (a CPU check at the real widths)")
    p.add_argument("--compile", choices=["model", "layers", "none"], default="layers",
                   help="each decoder layer compiled once for all (compile='layers', what compile=True does; the "
                        "default since PERF.md v20), the whole forward (compile='inductor') or none (the eager "
                        "body captured, what specdec generate runs)")
    p.add_argument("--no-fuse", action="store_true", help="separate q / k / v and gate / up GEMMs and stock norms "
                   "(the A/B of specdec.fused)")
    p.add_argument("--no-fuse-norms", action="store_true", help="the stock RMSNorms, fused GEMMs (the A/B of fuse_norms)")
    p.add_argument("--inductor", nargs="+", default=[], metavar="NAME=VALUE",
                   help="torch._inductor.config settings for this run (a Python literal each), e.g. combo_kernels=True")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    inductor = set_inductor_options(args.inductor)
    device = torch.device(args.device)
    torch.set_grad_enabled(False)  # the uncaptured body (``_run``) is called here, outside ``forward``'s no_grad
    cap = -(-(args.prompt + max(args.nodes) + 8) // 256) * 256
    model = build_scale_model(args.config, device, torch.bfloat16, max_positions=cap, layers=args.layers)
    hf.prepare_model(model, fuse=not args.no_fuse)
    if args.no_fuse_norms:
        unfuse_norms(model)
    gen = torch.Generator().manual_seed(0)
    vocab = hf.vocab_size(model)
    prompt = torch.randint(0, vocab, (args.prompt,), generator=gen)
    prefix = args.prompt - 1
    cache = KVCache(1, cap, num_layers=hf.num_layers(model))
    hf.prefill(model, prompt[None, :prefix], cache)
    layers = hf.num_layers(model)
    floors = forward_floors(model, prefix, {"flag_gbs": args.bandwidth_gbs, "measured_gbs": args.bandwidth_gbs})
    timer = Timer(device)
    res = {"config": args.config, "fused": not args.no_fuse, "fused_norms": len(fused_norms(model)), "compile": args.compile, "inductor": inductor, "prompt": args.prompt, "capacity": cap, "layers": layers,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "floors": floors, "rows": []}  # fmt: skip
    for n in args.nodes:
        tree = random_tree(n, int(prompt[-1]), vocab, gen)
        g = GraphedForward(model, cache, 1, n, capture=device.type == "cuda",
                           compile={"model": "inductor", "layers": "layers", "none": False}[args.compile])
        g.load([tree], [prefix])
        g.forward()  # compiles and captures
        for _ in range(3):
            g.forward()
        replay_ms = median_ms([timer(g.forward)[0] for _ in range(args.reps)])
        check = _check_against_uncompiled(model, cache, g.forward()[0], tree, prefix)
        for _ in range(2):
            g._run()
        uncaptured_ms = median_ms([timer(g._run)[0] for _ in range(args.reps)])
        summary = summarize_kernels(profile_kernels(g._run, device, args.profile_reps), args.profile_reps, args.top)
        row = {"nodes": n, "replay_ms": replay_ms, "uncaptured_ms": uncaptured_ms, "check": check,
               "compile_s": g.first_run_s, "kernels_per_layer": summary["kernels_per_forward"] / layers, **summary}
        res["rows"].append(row)
        cats = ", ".join(f"{c} {v['ms']:.3f} ms ({v['kernels']:.0f})" for c, v in summary["categories"].items())
        print(f"n={n}: replay {replay_ms:.3f} ms, uncaptured {uncaptured_ms:.3f} ms, kernels "
              f"{summary['kernel_ms']:.3f} ms in {summary['kernels_per_forward']:.0f} ({row['kernels_per_layer']:.1f} "
              f"a layer): {cats}; floor {floors['floor_ms']:.3f} ms; vs the uncompiled body: argmax "
              f"{check['argmax_agree']:.3f} equal, max |logit diff| {check['max_abs_diff']:.3g}", flush=True)  # fmt: skip
        for t in summary["top"]:
            print(f"   {t['ms']:7.3f} ms {t['count']:6.1f} x {t['us_each']:8.2f} us  {t['category']:<9} {t['name']}")
        Path(args.out).write_text(json.dumps(res, indent=1))
        del g
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


def _check_against_uncompiled(model, cache, logits, tree, prefix: int) -> dict:
    """The replayed compiled forward's ``logits`` ``[1, n, V]`` against the same forward run as is (no
    compile, no capture) on the same inputs: the share of nodes with the same argmax and the largest
    logit difference (bf16 rounds differently in fused kernels: near-ties may flip)."""
    want = logits.float().clone()
    ref = GraphedForward(model, cache, 1, want.shape[1], capture=False, compile=False)
    ref.load([tree], [prefix])
    got = ref.forward()[0].float()  # rewrites the same cache slots (the body is idempotent)
    return {"argmax_agree": (got.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "max_abs_diff": (got - want).abs().max().item(), "max_abs_logit": want.abs().max().item()}


if __name__ == "__main__":
    sys.exit(main())
