"""Randomized stress test of the engine in one process: argparse -> StressConfig -> run_stress.

Runs ``--calls`` random ``SpecDecoder.generate`` calls (random batch sizes, prompt lengths, tree
sizes, drafters, greedy / sampling, CUDA graphs and torch.compile on / off) interleaved with the
target's own HF ``generate`` (default and static cache), checks every output (in fp32 every greedy
row against the same prompt decoded alone), prints a table, writes ``--out`` (JSON) and exits 1
if any call crashed or mismatched (see ``specdec.cli.stress``). Bad arguments exit 2 with one line
(``--debug`` shows the traceback instead).

On the device machine (repository root; tiny models need no staging). The budget stops the run
between calls; a call that compiles can outlast the estimate by up to a minute, so keep that much
between ``--budget-s`` and the command's time limit:

    timeout 590 python3 scripts/device/stress.py --models tiny --calls 240 --seed 0 --device cuda \
        --dtype fp32 --budget-s 500 --out $OUT/stress-tiny.json > $OUT/stress-tiny.log 2> $OUT/stress-tiny.err

The real Qwen pair (staged and converted first: scripts/device/setup_models.sh; Medusa heads from
``specdec train-medusa`` when this machine trained them, else untrained heads). The 1.5B compiles
for about a minute per batch size under HF's static cache, and the 0.5B drafts slowly without
graphs, hence fewer batch sizes, fewer static-cache calls, no engine compile, mostly graphs:

    SPECDEC_HOME=/tmp/specdec-home timeout 590 python3 scripts/device/stress.py --models qwen \
        --calls 200 --seed 0 --device cuda --dtype fp32 --batch-sizes 1 4 --new-tokens 1 32 \
        --tree-sizes 32 64 --hf-static-share 0.3 --compile-share 0 --graphs-share 0.8 \
        $([ -d /tmp/medusa ] && echo --medusa-heads /tmp/medusa) --budget-s 500 \
        --out $OUT/stress-qwen.json > $OUT/stress-qwen.log 2> $OUT/stress-qwen.err
"""

from __future__ import annotations

import sys

from specdec.cli import args as cliargs
from specdec.cli.stress.config import DTYPES, REFERENCES, STRESS_DRAFTERS, StressConfig

#: ``--models`` choices: tiny random models, or the default Qwen pair (``specdec.models``).
MODEL_CHOICES = ("tiny", "qwen")
QWEN_TARGET, QWEN_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
#: Default share of compiled engine calls on CUDA: each new (engine, batch size) compiles for seconds
#: (tiny models) to about a minute (the 1.5B), so a few percent keep a 200-call run within minutes.
CUDA_COMPILE_SHARE = 0.05


def build_parser() -> cliargs.ArgumentParser:
    d = StressConfig()
    share = cliargs.float_in(0.0, 1.0)
    p = cliargs.ArgumentParser(prog="stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=cliargs.int_at_least(1), default=d.calls, help="calls to run (default %(default)s)")
    p.add_argument("--seed", type=cliargs.int_at_least(0), default=d.seed, help="seed of the plan (default %(default)s)")
    p.add_argument("--out", type=cliargs.output_file, default=None, help="JSON result, rewritten after every call")
    p.add_argument("--models", choices=MODEL_CHOICES, default="tiny",
                   help="tiny: random tiny models; qwen: the default Qwen2.5-Coder pair (default %(default)s)")
    p.add_argument("--target", default=None, help=f"target model name / HF id / directory (--models qwen: {QWEN_TARGET})")
    p.add_argument("--draft", default=None, help=f"draft model name / HF id / directory (--models qwen: {QWEN_DRAFT})")
    p.add_argument("--medusa-heads", type=cliargs.existing_path, default=None,
                   help="MedusaHeads directory for real models (default: untrained heads)")
    p.add_argument("--budget-s", type=cliargs.float_in(0.0, low_open=True), default=None,
                   help="stop cleanly before a call that would end after this many seconds (default: no limit)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=d.dtype,
                   help="rows are compared only in fp32 (default %(default)s)")
    p.add_argument("--device", type=cliargs.device, default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--batch-sizes", nargs=2, type=cliargs.int_at_least(1), metavar=("LO", "HI"), default=d.batch_sizes)
    p.add_argument("--prompt-lens", nargs=2, type=cliargs.int_at_least(1), metavar=("LO", "HI"), default=d.prompt_lens)
    p.add_argument("--new-tokens", nargs=2, type=cliargs.int_at_least(1), metavar=("LO", "HI"), default=d.new_tokens)
    p.add_argument("--tree-sizes", nargs="+", type=cliargs.int_at_least(1), default=d.tree_sizes)
    p.add_argument("--drafters", nargs="+", choices=STRESS_DRAFTERS, default=d.drafters,
                   help="'none' = plain decoding through the engine (default: %(default)s)")
    p.add_argument("--graphs-share", type=share, default=d.graphs_share, help="engine calls with CUDA graphs")
    p.add_argument("--compile-share", type=share, default=None,
                   help=f"engine calls with torch.compile (default {CUDA_COMPILE_SHARE} on CUDA, 0 on CPU: "
                        f"inductor takes tens of seconds per shape there)")
    p.add_argument("--compile-backend", default=d.compile_backend)
    p.add_argument("--sampling-share", type=share, default=d.sampling_share, help="engine calls that sample")
    p.add_argument("--hf-share", type=share, default=d.hf_share, help="calls to the target's own HF generate")
    p.add_argument("--hf-static-share", type=share, default=d.hf_static_share, help="of those, with the static cache")
    p.add_argument("--eos-share", type=share, default=d.eos_share)
    p.add_argument("--reuse-share", type=share, default=d.reuse_share, help="prompts repeating an earlier one")
    p.add_argument("--max-engines", type=cliargs.int_at_least(1), default=d.max_engines)
    p.add_argument("--tie-tol", type=cliargs.float_in(0.0), default=d.tie_tol,
                   help="logit gap under which a greedy mismatch is a near tie, not a failure (default %(default)s)")
    p.add_argument("--no-check-hf", dest="check_hf", action="store_false", help="do not compare HF generate's rows")
    p.add_argument("--reference", choices=REFERENCES, default=d.reference,
                   help="the plain decoder of the reference: the device's defaults (CUDA graphs on CUDA) or eager "
                        "dynamic shapes (default %(default)s)")
    p.add_argument("--attn-impl", choices=("auto", "triton", "torch"), default=d.attn_impl)
    p.add_argument("--tiny-family", choices=("qwen2", "llama"), default=d.tiny_family)
    p.add_argument("--tiny-layers", type=cliargs.int_at_least(1), default=d.tiny_layers)
    p.add_argument("--tiny-hidden", type=cliargs.int_at_least(8), default=d.tiny_hidden)
    p.add_argument("--tiny-vocab", type=cliargs.int_at_least(16), default=d.tiny_vocab)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def config_from_args(ns) -> StressConfig:
    device = ns.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    target, draft = ns.target, ns.draft
    if ns.models == "qwen":
        target, draft = target or QWEN_TARGET, draft or QWEN_DRAFT
    elif target is not None or draft is not None or ns.medusa_heads is not None:
        raise ValueError("--target / --draft / --medusa-heads: expected --models qwen with them, got --models tiny")
    compile_share = ns.compile_share
    if compile_share is None:
        compile_share = CUDA_COMPILE_SHARE if device.startswith("cuda") else 0.0
    return StressConfig(
        calls=ns.calls, compile_share=compile_share, seed=ns.seed, batch_sizes=tuple(ns.batch_sizes), prompt_lens=tuple(ns.prompt_lens),
        new_tokens=tuple(ns.new_tokens), tree_sizes=tuple(ns.tree_sizes), drafters=tuple(dict.fromkeys(ns.drafters)),
        graphs_share=ns.graphs_share, compile_backend=ns.compile_backend,
        sampling_share=ns.sampling_share, hf_share=ns.hf_share, hf_static_share=ns.hf_static_share,
        eos_share=ns.eos_share, reuse_share=ns.reuse_share, dtype=ns.dtype, device=device, budget_s=ns.budget_s,
        models="tiny" if ns.models == "tiny" else "pretrained", target=target, draft=draft,
        medusa_heads=ns.medusa_heads, tiny_family=ns.tiny_family, tiny_layers=ns.tiny_layers,
        tiny_hidden=ns.tiny_hidden, tiny_vocab=ns.tiny_vocab, max_engines=ns.max_engines, tie_tol=ns.tie_tol,
        check_hf=ns.check_hf, reference=ns.reference, attn_impl=ns.attn_impl, progress=ns.progress, out=ns.out,
    )  # fmt: skip


def handler(argv: list[str]) -> int:
    from specdec.cli.stress.run import run_stress

    cfg = config_from_args(build_parser().parse_args(argv))
    result = run_stress(cfg, log=lambda msg: print(msg, flush=True))
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (0 ok, 1 a crash or mismatch, 2 a bad argument)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        return cliargs.run("stress", handler, [a for a in argv if a != "--debug"], debug=debug)
    except SystemExit as e:  # argparse: --help (0) or a bad argument (2, its line already printed)
        return e.code if isinstance(e.code, int) else 2

