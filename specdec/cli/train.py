"""``specdec train-medusa`` and ``specdec train-eagle``: flags -> ``training.medusa.MedusaRun`` /
``training.eagle.EagleRun`` -> ``run_medusa`` / ``run_eagle``.

Both train on MBPP by default, on a user's own prompts with ``--prompts FILE`` (JSONL of
``{"prompt": ...}`` or ``{"messages": [...]}``, or a ``datasets`` directory / parquet / JSON file),
on prompts the target writes itself with ``--seed-prompts FILE --self-prompts N``, and on MBPP plus
general prompts written from built-in seeds of every Spec-Bench kind with ``--mix general``
(``training.sources``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdec.cli import args as cliargs


def _run_fields(ns: argparse.Namespace) -> dict:
    """The parsed flags as the run's fields (``--no-chat`` / ``--no-progress`` as ``chat`` / ``progress``)."""
    kw = dict(vars(ns))
    kw["chat"] = not kw.pop("no_chat")
    kw["progress"] = not kw.pop("no_progress")
    return kw


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prompts``, ``--seed-prompts``, ``--self-prompts``, ``--self-prompt-temperature``, ``--mix``,
    ``--mix-per-kind`` and ``--heldout`` (shared by both commands; ``training.sources``)."""
    from training.sources import MIXES

    parser.add_argument("--prompts", type=cliargs.existing_path, default=None, metavar="FILE",
                        help="train on your own prompts: JSONL of {\"prompt\": ...} or {\"messages\": [...]} (a chat: "
                             "the last user turn is answered, earlier turns are context), or a datasets directory / "
                             "parquet / JSON file; the target answers them. MBPP is then used only with --data")
    parser.add_argument("--seed-prompts", type=cliargs.existing_path, default=None, metavar="FILE",
                        help="a prompt file of a few examples (with an optional 'category' per row): the target writes "
                             "--self-prompts new prompts in their style (each request shows up to 3 seeds of one "
                             "category), saved to OUT/self_prompts.jsonl, then answers them. MBPP then only with --data")
    parser.add_argument("--self-prompts", type=cliargs.int_at_least(0), default=0, metavar="N",
                        help="how many prompts the target writes from --seed-prompts")
    parser.add_argument("--self-prompt-temperature", type=cliargs.float_in(0.0, low_open=True), default=0.8,
                        help="sampling temperature of the prompt writing")
    parser.add_argument("--mix", choices=tuple(MIXES), default=None,
                        help="a built-in training mix: MBPP plus prompts the target writes (as with --seed-prompts) "
                             "from the package's own seed prompts: general = of each Spec-Bench kind of task "
                             "(writing, roleplay, reasoning, math, coding, extraction, stem, humanities, translation, "
                             "summarization, qa, math_reasoning, rag), so the drafter serves chat as well as code; "
                             "contest = programs reading standard input, stated as contest problems")
    defaults = ", ".join(f"{n} for {name}" for name, (_, n) in MIXES.items())
    parser.add_argument("--mix-per-kind", type=cliargs.int_at_least(1), default=None, metavar="N",
                        help=f"writing requests per kind of --mix (default {defaults})")
    parser.add_argument("--heldout", type=cliargs.int_at_least(0), default=None,
                        help="held out for the accuracy report: the last N MBPP problems (when MBPP is used), else the "
                             "last N prompts; default 48, at most a fifth of them")


def _add_inputs(parser: argparse.ArgumentParser, trained: str) -> None:
    """``--target``, ``--data`` and ``--out`` (``trained``: what the output folder holds)."""
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="default model name, HF id or local dir")
    parser.add_argument("--data", type=cliargs.existing_path, default=None,
                        help="MBPP jsonl (default $SPECDEC_MBPP or ../shared/data/mbpp; used by default unless --prompts "
                             "or --seed-prompts is given, and with them when given)")
    parser.add_argument("--out", type=cliargs.output_dir, required=True,
                        help=f"output directory ({trained}, config, self-distillation cache)")


def _add_distillation(parser: argparse.ArgumentParser, *, max_new_tokens: int, gen_batch_size: int) -> None:
    """The self-distillation's flags: the prompts (``--num-prompts``, :func:`add_source_arguments`) and
    how the target answers them (``--max-new-tokens``, ``--gen-batch-size``, ``--temperature``)."""
    parser.add_argument("--num-prompts", type=cliargs.int_at_least(1), default=None,
                        help="use only the first N MBPP problems (and the first N prompts of --prompts)")
    add_source_arguments(parser)
    parser.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=max_new_tokens,
                        help="answer length of the self-distillation")
    parser.add_argument("--gen-batch-size", type=cliargs.int_at_least(1), default=gen_batch_size)
    parser.add_argument("--temperature", type=cliargs.float_in(0.0), default=0.0, help="self-distillation sampling (0 = greedy)")


def _add_runtime(parser: argparse.ArgumentParser, trains: str) -> None:
    """``--no-chat``, ``--device``, ``--dtype``, ``--seed``, ``--no-progress`` (``trains``: what trains in fp32)."""
    from specdec.dtypes import DTYPE_NAMES

    parser.add_argument("--no-chat", action="store_true", help="plain prompts instead of the chat template")
    parser.add_argument("--device", type=cliargs.device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default=None,
                        help=f"target dtype (default bf16 on cuda, fp32 on cpu); {trains} in fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")


def main_medusa(argv: Sequence[str] | None = None) -> int:
    """``specdec train-medusa``: self-distill the target on its training prompts and train Medusa heads."""
    from training.medusa import MedusaRun, run_medusa

    parser = cliargs.ArgumentParser(
        prog="specdec train-medusa",
        description="Train Medusa heads on the frozen target's own answers (self-distillation) to MBPP prompts, "
                    "your own prompts (--prompts), prompts it writes in the style of yours (--seed-prompts) or "
                    "MBPP plus general prompts it writes from built-in seeds (--mix general).",
    )
    _add_inputs(parser, "heads")
    parser.add_argument("--num-heads", type=cliargs.int_at_least(1), default=4)
    parser.add_argument("--num-layers", type=cliargs.int_at_least(1), default=1, help="residual blocks per head")
    parser.add_argument("--steps", type=cliargs.int_at_least(0), default=1000)
    parser.add_argument("--lr", type=cliargs.float_in(0.0, low_open=True), default=1e-3)
    parser.add_argument("--batch-size", type=cliargs.int_at_least(1), default=8)
    parser.add_argument("--max-positions", type=cliargs.int_at_least(1), default=2048, help="answer positions per step (subsampled)")
    _add_distillation(parser, max_new_tokens=256, gen_batch_size=16)
    _add_runtime(parser, "heads train")
    parser.add_argument("--table-ranks", type=cliargs.int_at_least(1), default=16,
                        help="ranks of the held-out acceptance table saved with the heads (tree building)")
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    run_medusa(MedusaRun(**_run_fields(ns)))
    return 0


def _styles(text: str) -> tuple[str, ...]:
    from training.distill import PROMPT_STYLES

    styles = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in styles if s not in PROMPT_STYLES]
    if not styles or bad or len(set(styles)) != len(styles):
        raise argparse.ArgumentTypeError(f"expected distinct styles of {', '.join(PROMPT_STYLES)} separated by "
                                         f"commas, got {text!r}")
    return styles


def _feature_spec(text: str) -> str:
    from training.eagle import check_feature_spec

    try:
        return check_feature_spec(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("feature_layers: ")) from None


def main_eagle(argv: Sequence[str] | None = None) -> int:
    """``specdec train-eagle``: self-distill the target on its training prompts and train an EAGLE head."""
    from training.distill import PROMPT_STYLES
    from training.eagle import AUTO_MAX_STEPS, AUTO_MIN_STEPS, AUTO_PASSES, EagleRun, EagleTrainConfig, run_eagle

    d = EagleTrainConfig()
    parser = cliargs.ArgumentParser(
        prog="specdec train-eagle",
        description="Train an EAGLE head (fc + one decoder layer on the outputs of three of the target's "
                    "layers, EAGLE-3; --feature-layers final: on its final hidden state) on the frozen "
                    "target's own answers (self-distillation) to MBPP prompts, your own prompts (--prompts) or "
                    "prompts it writes in the style of yours (--seed-prompts) or MBPP plus general prompts it "
                    "writes from built-in seeds (--mix general). The defaults take about 6 minutes "
                    "on one H100 for Qwen2.5-Coder-1.5B (bf16), data generation included.",
    )  # fmt: skip
    _add_inputs(parser, "head")
    parser.add_argument("--cache", type=cliargs.output_file, default=None,
                        help="self-distillation cache (default OUT/selfdistill.jsonl; a train-medusa cache made with "
                             "the same settings is reused)")  # fmt: skip
    parser.add_argument("--steps", type=cliargs.int_at_least(0), default=d.steps,
                        help=f"optimizer steps, 0: the data only (default: about {AUTO_PASSES} passes over the training "
                             f"sequences, {AUTO_MIN_STEPS}-{AUTO_MAX_STEPS} steps)")  # fmt: skip
    parser.add_argument("--lr", type=cliargs.float_in(0.0, low_open=True), default=d.lr)
    parser.add_argument("--batch-size", type=cliargs.int_at_least(1), default=d.batch_size)
    parser.add_argument("--unroll", type=cliargs.int_at_least(1), default=d.unroll, help="unrolled steps of the training-time test")
    parser.add_argument("--max-positions", type=cliargs.int_at_least(1), default=d.max_positions, help="positions per unrolled step in the cross-entropy")
    parser.add_argument("--max-len", type=cliargs.int_at_least(1), default=d.max_len,
                        help=f"leave out training sequences longer than this many tokens (default {d.max_len}): a batch "
                             "pads to its longest, and the head's attention scores grow with its square")
    parser.add_argument("--train-vocab", type=cliargs.int_at_least(1), default=None, metavar="N",
                        help="cross-entropy over the N most frequent answer tokens only (default: the whole vocabulary)")
    parser.add_argument("--reg-weight", type=cliargs.float_in(0.0), default=d.reg_weight, help="smooth-L1 feature loss weight")
    parser.add_argument("--ce-weight", type=cliargs.float_in(0.0), default=d.ce_weight, help="cross-entropy weight")
    parser.add_argument("--feature-layers", type=_feature_spec, default=EagleRun.feature_layers, metavar="SPEC",
                        help="the target features the head reads: 'low,mid,high' (default; EAGLE-3: the outputs of "
                             "layers 2, L/2 and L-3, fused by a trained 3H -> H projection), 'final' (the final "
                             "hidden state, EAGLE-1) or comma-separated layer indices (negative: from the end)")
    _add_distillation(parser, max_new_tokens=192, gen_batch_size=120)
    parser.add_argument("--answers-per-prompt", type=cliargs.int_at_least(1), default=1,
                        help="answers per training prompt: the first as --temperature says, each further one sampled at "
                             "--sample-temperature (more, more varied data; held-out problems keep one answer)")
    parser.add_argument("--sample-temperature", type=cliargs.float_in(0.0, low_open=True), default=0.8,
                        help="temperature of the extra answers")
    parser.add_argument("--time-budget", type=cliargs.float_in(0.0, low_open=True), default=None,
                        help="seconds the optimization may take: fewer steps (schedule rescaled) if --steps would not fit")
    parser.add_argument("--prompt-styles", type=_styles, default=("mbpp",),
                        help="comma-separated instruction styles of the training prompts, each MBPP problem in every "
                             f"one: {', '.join(PROMPT_STYLES)} (see training.distill.PROMPT_STYLES; default mbpp)")
    parser.add_argument("--exercises", type=cliargs.int_at_least(0), default=0, metavar="N",
                        help="the target first writes N new exercises (function stubs with typed signatures and "
                             "docstrings, each from a training MBPP task) and answers them too: more varied training "
                             "sequences (training.exercises; default 0)")
    parser.add_argument("--exercise-temperature", type=cliargs.float_in(0.0, low_open=True), default=0.8,
                        help="sampling temperature of the exercise writing")
    _add_runtime(parser, "the head trains")
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    run_eagle(EagleRun(**_run_fields(ns)))
    return 0
