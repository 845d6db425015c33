"""Compile the tree-attention kernel for sm_90 offline (no GPU) and report registers, spills and
shared memory per config: a check for compile errors and spills before a device run.

    python scripts/compile_treeattn_sm90.py [--cells 1024/256 4000/256 ...] [--config '{"gather": false}'] [--sweep]

Each cell (L/t, Llama-3-8B attention: 32 q heads, 8 KV heads, d 128, bf16, batch 1) is launched
through ``treeattn.ops._launch`` with CPU tensors of the benchmark's shapes and the kernel replaced
by a recorder, so the arguments (and Triton's divisibility / ==1 specializations) are the ones a
GPU launch would pass; the recorded call is then compiled with ``triton.compile`` for
``GPUTarget("cuda", 90, 32)``, and the PTX is run through the ``ptxas -v`` Triton uses for sm_90.
Must run without ``TRITON_INTERPRET`` (it makes the kernels interpreter functions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from unittest import mock

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", nargs="+", default=["1024/64", "1024/128", "1024/256", "4000/128", "4000/256",
                                                  "16000/64", "16000/128", "16000/256"])
    p.add_argument("--config", action="append", default=[],
                   help="JSON of KernelConfig fields to override on the cell's default config (repeatable)")
    p.add_argument("--sweep", action="store_true", help="compile treeattn.bench's sweep configs instead")
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--sass", action="store_true", help="also count SASS instructions (HGMMA, LDGSTS, LDG)")
    p.add_argument("--dump", help="write each config's SASS into this folder (with --sass)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        p.error("unset TRITON_INTERPRET: the offline compile needs the real JIT functions")

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from treeattn import kernels, ops
    from treeattn.layout import TreeMask, random_tree_parents

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    fn = kernels.tree_attn_fwd_kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    print(f"triton {triton.__version__}, target {target}")
    overrides = [json.loads(c) for c in args.config] or [{}]
    if args.sweep:
        from treeattn.bench import sweep_configs

        overrides = [asdict(c) for c in sweep_configs() if c is not None]

    class Recorder:
        def __getitem__(self, grid):
            def record(*a, **kw):
                calls.append((grid, a, kw))
            return record

    for cell in args.cells:
        L, t = (int(x) for x in cell.split("/"))
        g = torch.Generator().manual_seed(0)
        q = torch.empty(1, 32, t, 128, dtype=torch.bfloat16)
        k = torch.empty(1, 8, L + t, 128, dtype=torch.bfloat16)
        mask = TreeMask.from_parents(random_tree_parents(t, 8, g).unsqueeze(0))
        pl = torch.full((1,), L, dtype=torch.int32)
        with mock.patch.object(ops, "_num_sms", lambda _: args.sms), \
                mock.patch.object(ops, "_shared_limit", lambda _: 232448):
            base, _ = ops.pick_config(1, 8, 4, t, L + t, 128, torch.device("cuda", 0))
            for ov in overrides:
                cfg = replace(base, **ov)
                plan = ops._splits(cfg, 1, 8, 4 * t, L, t, torch.device("cuda", 0))
                calls: list = []
                with mock.patch.object(kernels, "tree_attn_fwd_kernel", Recorder()), \
                        mock.patch.object(kernels, "tree_attn_merge_kernel", Recorder()):
                    ops._launch(q, k, k, pl, mask, 128**-0.5, cfg, plan)
                grid, a, kw = calls[0]
                bound, spec, opts = binder(*a, **kw)
                options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, opts)
                try:
                    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                              options=options.__dict__)
                except Exception as exc:  # report and go on with the other configs
                    print(f"{cell} {asdict(cfg)} splits {plan.count}: COMPILE ERROR {type(exc).__name__}: {exc}")
                    continue
                with tempfile.TemporaryDirectory() as tmp:
                    ptx = os.path.join(tmp, "k.ptx")
                    with open(ptx, "w") as f:
                        f.write(compiled.asm["ptx"])
                    res = subprocess.run([get_ptxas(90).path, "-v", "--regAllocOptLevel=2", "--gpu-name",
                                          f"sm_{compiled.metadata.target.arch}a", ptx, "-o", os.path.join(tmp, "k.o")],
                                         capture_output=True, text=True)
                    info = res.stdout + res.stderr
                    sass = ""
                    if args.sass:
                        with open(os.path.join(tmp, "k.cubin"), "wb") as f:
                            f.write(compiled.asm["cubin"])
                        sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", os.path.join(tmp, "k.cubin")],
                                              capture_output=True, text=True).stdout
                regs = re.search(r"Used (\d+) registers", info)
                spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
                stack = re.search(r"(\d+) bytes stack frame", info)
                line = (f"{cell}: grid {grid} splits {plan.count} | bm {cfg.block_m} bn {cfg.block_n} w {cfg.num_warps} "
                        f"st {cfg.num_stages} bt {getattr(cfg, 'block_t', '-')} gather {getattr(cfg, 'gather', '-')} "
                        f"ws {cfg.warp_specialize} per_sm {cfg.programs_per_sm} p16 {cfg.partials_in_input_dtype} | regs {regs.group(1) if regs else '?'} "
                        f"spill st/ld {spill.group(1) + '/' + spill.group(2) if spill else '?'} "
                        f"stack {stack.group(1) if stack else '?'} shared {compiled.metadata.shared}")
                if sass and args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    name = f"{L}-{t}-" + "-".join(f"{k}{v}" for k, v in sorted(asdict(cfg).items())) + ".sass"
                    with open(os.path.join(args.dump, name), "w") as f:
                        f.write(sass)
                if sass:
                    ops_ = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass)]
                    ops_ = [o for o in ops_ if o != 'NOP']
                    line += (f" | SASS {len(ops_)} (HGMMA {sum(o == 'HGMMA' for o in ops_)}, "
                             f"LDGSTS {sum(o == 'LDGSTS' for o in ops_)}, LDG {sum(o == 'LDG' for o in ops_)})")
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
