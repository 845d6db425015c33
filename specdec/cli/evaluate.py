"""``specdec eval apps|humaneval|mbpp|specbench|prompts`` and ``specdec sweep``: the evaluation's command line.

``specbench`` (``--dataset specbench``) is Spec-Bench's 480 general-text questions (``--data``
defaults to ``$SPECDEC_SPECBENCH``, else ``../shared/data/specbench/question.jsonl``): the first turn
of each through the chat template, ``--turns 2`` adds the second turns after the target's own
answer, ``--categories`` picks some of its 13 categories. ``prompts`` (``--dataset prompts --data
FILE``) is a user's own prompt file (JSONL of ``{"prompt": ...}`` or ``{"messages": [...]}``, or a
``datasets`` directory / parquet / JSON file; ``eval.workloads``). Neither has tests: the table has
no pass@1 (it says so), ``--check`` refuses them, and a second table gives every category its own
rows (tau, tokens/s, the speedup over ``specdec-plain`` and HF static, stalls) and an overall one.

``mbpp`` (``--dataset mbpp``) is the tuning set: pick methods and tree sizes on it, report on APPS /
HumanEval. Its problems are HumanEval-shaped (``eval.datasets.load_mbpp_problems``); ``--data``
defaults to train-medusa's MBPP file (``$SPECDEC_MBPP``, else ``../shared/data/mbpp/mbpp.jsonl``).

Both parse their flags into an ``eval.config.EvalConfig`` and call ``eval.runner.run_eval``; the
sweep then times attention alone on the recorded trees (CUDA), and writes one table, CSV, summary
JSON and plot for every (method, drafter, tree size) through ``eval.report``. The drafters are given
as specs, several per run (``--drafters lookup medusa:heads=DIR model:draft=NAME``, syntax in
``eval.config.DRAFTER_SYNTAX``); the baselines run once per problem and are shared by every row.
``--check`` then runs the completions against their tests (``eval.passk``, as ``specdec check``
does) so that the table has pass@1. ``--samples N`` (with ``--temperature`` > 0) makes N completions
per problem and method in one batched call (``num_return_sequences=N``; ``hf-assisted`` and
``hf-lookup`` cannot and are skipped): the table's tokens/s is then the batch's aggregate, and
``--check`` gives pass@1 / pass@10 (unbiased estimator, bootstrap intervals over problems).

Distributed (data-parallel) evaluation, one whole model per process (``eval.shard``)::

    torchrun --standalone --nproc-per-node 2 -m specdec.cli sweep ... --out results/apps.jsonl --shard auto
    specdec sweep --report-only ... --out results/apps.jsonl --shards 2

``--shard auto`` reads this process's place from the launcher's environment (torchrun / accelerate:
``RANK`` / ``WORLD_SIZE``, else ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``; none: a single process);
``--shard RANK/WORLD`` gives it by hand (e.g. two runs one after the other, or on two machines).
With WORLD > 1 the process evaluates only its shard of the problems (by position: problem i of the
run's list goes to shard i % WORLD, ``eval.shard.shard``) into ``eval.shard.shard_path(OUT, RANK,
WORLD)`` (``OUT.rank0-of-2.jsonl``), skipping what any of the run's shard files next to it holds (a
changed problem list can move a problem to another shard; shards run on two machines see each
other's records only once the files are copied together); ``sweep`` then prints its own partial
table only (no attention timings, CSV, summary or plot). Under ``--shard auto`` with more than one
process and a CUDA device given without an index (``--device cuda`` or the default), each process
takes ``cuda:$LOCAL_RANK`` (also made the current device); ``--shard R/W`` leaves the device as
given (pick it with ``--device cuda:N`` or ``CUDA_VISIBLE_DEVICES``). Merging is explicit: ``sweep
--report-only --shards WORLD`` merges ``eval.shard.shard_paths(OUT, WORLD)`` (``eval.shard.merge``)
and writes the one table, CSV, summary and plot next to OUT as a single process would.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from specdec.cli import args as cliargs

__all__ = ["main_eval", "main_sweep", "parser"]

_DTYPES = ("auto", "fp32", "bf16", "fp16")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def parser(prog: str, sweep: bool, report_only: bool = False) -> argparse.ArgumentParser:
    """The flags of ``specdec eval`` / ``sweep``. ``report_only``: ``--device`` names the device a
    results file was made on and is not checked against this machine (reports of GPU runs are
    rebuilt anywhere)."""
    from eval.config import DEFAULT_METHODS, DRAFTER_SYNTAX
    from eval.datasets import DATASETS, SPECBENCH_CATEGORIES
    from eval.methods import METHODS

    p = cliargs.ArgumentParser(
        prog=prog,
        description=(
            "Sweep drafters x tree sizes: run the evaluation (each baseline once per problem, shared by "
            "every row), time attention alone on the proposed trees (CUDA), and write one table, CSV, "
            "summary JSON and plot."
            if sweep
            else "Evaluate speculative decoding against HF baselines on the same prompts; one JSON line "
            "per (problem, method, drafter, tree size) in --out; reruns resume."
        ),
        epilog=DRAFTER_SYNTAX + "\n\nexample: " + prog + " --drafters lookup medusa:heads=/tmp/medusa "
        "model:draft=qwen2.5-coder-0.5b --tree-sizes 32 64 128 256",
        formatter_class=_Formatter,
    )
    which = ("which problems (mbpp: for tuning only, never report on it; specbench: Spec-Bench's general-text "
             "questions; prompts: your own prompt file, --data FILE)")
    if not sweep:
        p.add_argument("dataset", choices=list(DATASETS), help=which)
    else:
        p.add_argument("--dataset", choices=list(DATASETS), default="apps", help=which)
    p.add_argument("--problems", type=cliargs.int_at_least(0), default=8,
                   help="number of problems (0 = all); specbench: questions, the categories' first ones in turn")
    p.add_argument("--difficulty", nargs="+", choices=["introductory", "interview", "competition"],
                   help="APPS difficulties to keep")  # fmt: skip
    p.add_argument("--data", dest="data_path", type=cliargs.existing_path, default=None,
                   help="APPS / HumanEval / MBPP / Spec-Bench file (default: the loaders' own; MBPP: $SPECDEC_MBPP, "
                   "else ../shared/data/mbpp/mbpp.jsonl, as train-medusa; Spec-Bench: $SPECDEC_SPECBENCH, else "
                   "../shared/data/specbench/question.jsonl), or the prompt file of --dataset prompts (JSONL of "
                   "{\"prompt\": ...} or {\"messages\": [...]}, a datasets directory, parquet or JSON)")
    p.add_argument("--categories", nargs="+", default=None, metavar="CATEGORY",
                   help="specbench / prompts: keep these categories (Spec-Bench: " + ", ".join(SPECBENCH_CATEGORIES)
                   + "; a prompt file: its rows' 'category' values); default: all")
    p.add_argument("--turns", type=int, choices=(1, 2), default=1,
                   help="specbench: 1 = the first turn of every question; 2 = also the second turns of the two-turn "
                   "questions, asked after the target's own greedy answer to the first")  # fmt: skip
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target model: default name, HF id, directory or .gguf")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b",
                   help="draft model for hf-assisted and for drafters without draft= ('' = none)")  # fmt: skip
    p.add_argument("--drafters", nargs="+", metavar="SPEC", default=None,
                   help="the drafters of the specdec method, each [LABEL=]NAME[:KEY=VALUE,...] (see below), each "
                   "run at every --tree-sizes; default: model")  # fmt: skip
    p.add_argument("--drafter", default=None, metavar="NAME",
                   help="one drafter (shorthand of --drafters NAME:KEY=VALUE,... with --drafter-option)")
    p.add_argument("--drafter-option", dest="drafter_options", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of --drafter, repeatable (VALUE parsed as JSON if it can be, else a string)")
    p.add_argument("--tree-sizes", type=cliargs.tree_size(1), nargs="+", default=[32, 64, 128, 256] if sweep else [64],
                   help="node budgets t of the specdec method; auto: each step's budget from measured costs, up "
                        "to 64")  # fmt: skip
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), help=f"methods to run: {', '.join(METHODS)}")
    p.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=128)
    p.add_argument("--temperature", type=cliargs.float_in(0.0), default=0.0,
                   help="0 = greedy (outputs compared with target-only)")  # fmt: skip
    p.add_argument("--samples", type=cliargs.int_at_least(1), default=1, metavar="N",
                   help="completions per problem and method, made in one batched call (num_return_sequences=N; "
                   "needs --temperature > 0; hf-assisted / hf-lookup are skipped); with --check: pass@1 and "
                   "pass@10 (N >= 10) by the unbiased estimator, tokens/s aggregated over the batch")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=_DTYPES, default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", type=cliargs.device_name if report_only else cliargs.device, default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--out", type=cliargs.output_file, default="results/sweep.jsonl" if sweep else None,
                   help="results JSONL (appended; reruns skip what it holds). Default results/<dataset>.jsonl")
    p.add_argument("--pad-prompt-to", type=cliargs.int_at_least(1), default=None,
                   help="prepend few-shot problems until every prompt has at least N tokens (e.g. 4000)")
    p.add_argument("--attn-impl", choices=["auto", "triton", "torch"], default="auto", help="the engine's attention")
    p.add_argument("--compile", action="store_true",
                   help="the engine's target forward through torch.compile (inductor) before its CUDA graph")
    p.add_argument("--compile-prefill", action="store_true",
                   help="the compiled rows' prompt-prefill chunks compiled too (SpecDecoder(compile_prefill=True))")
    p.add_argument("--calibrate", type=cliargs.int_at_least(0), default=0, metavar="N",
                   help="in a process with a drafter's rows to run and no HF static of its own, time HF static "
                   "again on the first N problems first ('calibration' records): the table's 'vs hf-static same "
                   "process' then compares each row with the baseline at its own process's speed. 0: none")
    p.add_argument("--no-shared-prompt", action="store_true",
                   help="with --samples N: every row keeps its own copy of the prompt's KV (the copy layout), "
                   "to compare with the default, one copy for the N rows")  # fmt: skip
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="do not gc.collect() + gc.freeze() after each warm-up (by default later full garbage "
                   "collections skip the models and graphs alive by then; each record keeps gc_s, the call's "
                   "seconds in collections)")
    p.add_argument("--warmup", type=cliargs.int_at_least(0), default=1,
                   help="untimed generations per method (drafter, tree size) before timing, after the engine's "
                   "SpecDecoder.warmup; both timed as first-call latency. 0: the first timed call is the first call")
    p.add_argument("--home", default=None, help="model store root (default $SPECDEC_HOME)")
    p.add_argument("--method-problems", nargs="+", type=_method_limit, default=[], metavar="METHOD=N",
                   help="run METHOD on the first N problems only (e.g. hf=50 hf-assisted=50: the slow greedy "
                   "reference on a stated subset); every other method runs on all")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--check", action="store_true",
                   help="pass@1: after the generations, run every completion of this configuration that has no "
                   "verdict yet against its tests (sandboxed, in parallel; never between timed calls) and write "
                   "'passed' / 'check_status' into the records (as 'specdec check' does; with --samples every "
                   "sample: 'sample_passed', 'num_correct', and pass@1 / pass@10 in the table)"
                   + ("; with --report-only: check, then report" if sweep else ""))  # fmt: skip
    from specdec.cli.check import add_limit_arguments

    add_limit_arguments(p, prefix="check-")
    p.add_argument("--shard", type=shard_arg, default=None, metavar="auto|RANK/WORLD",
                   help="evaluate one shard of the problems (every W-th from the R-th) into OUT.rankR-of-W.jsonl "
                   "(resumable: skips what any shard file of OUT holds): 'auto' from the launcher's environment "
                   "(torchrun: RANK / WORLD_SIZE; each process on cuda:LOCAL_RANK), or RANK/WORLD by hand; "
                   "default: no sharding"
                   + ("; merge with --report-only --shards WORLD" if sweep else ""))  # fmt: skip
    if sweep:
        p.add_argument("--shards", type=cliargs.int_at_least(1), default=None, metavar="WORLD",
                       help="with --report-only: merge the WORLD shard files of --out (written with --shard R/WORLD) "
                       "and report them as one run")  # fmt: skip
        p.add_argument("--report-only", action="store_true", help="only rebuild table / CSV / plot from --out")
        p.add_argument("--configs", choices=("last", "all"), default="last",
                       help="with --report-only: the configuration to report, the file's last, or all of them in "
                       "one table (they must agree on dataset, target, tokens, temperature, seed, dtype, device; "
                       "e.g. HF baselines run with --draft next to drafter rows run without)")  # fmt: skip
        p.add_argument("--no-attn", action="store_true", help="skip the attention-only timings")
        p.add_argument("--attn-trees", type=cliargs.int_at_least(1), default=8,
                       help="trees per tree size for the attention timings")  # fmt: skip
    return p


def drafter_specs(ns: argparse.Namespace):
    """The run's drafters from ``--drafters`` or ``--drafter`` / ``--drafter-option`` (ValueError naming
    the flag on malformed specs, unknown names, or both forms at once)."""
    from eval.config import DrafterSpec, parse_drafter_spec, parse_options

    if ns.drafters is not None and (ns.drafter is not None or ns.drafter_options):
        raise ValueError("--drafters: give the drafters either as --drafters SPEC ... or as one --drafter NAME "
                         "with --drafter-option KEY=VALUE, not both")  # fmt: skip
    if ns.drafters is not None:
        return tuple(parse_drafter_spec(text, "--drafters") for text in ns.drafters)
    if ns.drafter_options and ns.drafter is None:
        raise ValueError("--drafter-option: needs --drafter NAME (or write the options into --drafters NAME:KEY=VALUE)")
    name = ns.drafter or "model"
    if name == "":
        return ()
    options = parse_options(ns.drafter_options, "--drafter-option")
    try:
        return (DrafterSpec(name, options),)
    except ValueError as e:
        raise ValueError(str(e).replace("drafters:", "--drafter:", 1)) from None


def shard_arg(text: str) -> str | tuple[int, int]:
    """argparse type of ``--shard``: ``auto`` or ``RANK/WORLD`` (ints, 0 <= RANK < WORLD)."""
    if text == "auto":
        return text
    rank, sep, world = text.partition("/")
    if not sep or not rank.strip().isdigit() or not world.strip().isdigit():
        raise argparse.ArgumentTypeError(f"expected auto or RANK/WORLD (e.g. 0/2), got {text!r}")
    r, w = int(rank), int(world)
    if w < 1 or r >= w:
        raise argparse.ArgumentTypeError(f"expected RANK/WORLD with 0 <= RANK < WORLD, got {text!r}")
    return r, w


def resolve_shard(ns: argparse.Namespace) -> tuple[tuple[int, int] | None, str | None]:
    """``(shard, device)`` of this process: ``--shard`` (``auto``: ``eval.shard.shard_env``) and
    ``--device``, which under ``auto`` with more than one process and a CUDA device without an index
    becomes ``cuda:$LOCAL_RANK``. ValueError naming ``--shard`` on a bad environment."""
    device = ns.device
    if getattr(ns, "shard", None) is None:
        import os

        world = os.environ.get("WORLD_SIZE", "").strip()
        if world.isdigit() and int(world) > 1:
            print(f"note: WORLD_SIZE={world} but no --shard: every process evaluates every problem into the same "
                  "--out; add --shard auto to split the problems", file=sys.stderr)  # fmt: skip
        return None, device
    if ns.shard != "auto":
        return ns.shard, device
    import os

    from eval.shard import shard_env

    try:
        place = shard_env()
    except ValueError as e:
        raise ValueError(f"--shard auto: {e}") from None
    if place[1] > 1 and (device is None or device == "cuda"):
        import torch

        if torch.cuda.is_available():  # (a report-only run may name cuda on a machine without one)
            local = os.environ.get("LOCAL_RANK", "").strip()
            index = int(local) if local.isdigit() else place[0]
            count = torch.cuda.device_count()
            if index >= count:
                raise ValueError(f"--shard auto: LOCAL_RANK {index} has no CUDA device (this process sees {count})")
            device = f"cuda:{index}"
    return place, device


def config_from(ns: argparse.Namespace, dataset: str):
    from eval.config import EvalConfig
    from eval.datasets import TESTED_DATASETS, check_tested_dataset

    if getattr(ns, "check", False) and dataset not in TESTED_DATASETS:
        check_tested_dataset(dataset, "--check")

    out = ns.out or f"results/{dataset}.jsonl"
    shard, device = resolve_shard(ns)
    if device is not None and device.startswith("cuda:") and shard is not None and ns.shard == "auto":
        import torch

        if torch.cuda.is_available():
            torch.cuda.set_device(device)
    from specdec.cli.check import flag_error

    specs = drafter_specs(ns)
    if not getattr(ns, "report_only", False) and "specdec" in (ns.methods or ()):  # before any model loads or
        # downloads (a report, or a run of baselines only, needs no heads)
        from eval.config import check_drafter_paths

        check_drafter_paths(specs, "--drafters")
    try:
        return EvalConfig(
            dataset=dataset, target=ns.target, draft=ns.draft or None, drafters=specs,
            tree_sizes=tuple(ns.tree_sizes), methods=tuple(ns.methods), problems=ns.problems or None,
            difficulty=tuple(ns.difficulty) if ns.difficulty else None, data_path=ns.data_path,
            categories=tuple(ns.categories) if ns.categories else None, turns=ns.turns,
            max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, samples=ns.samples, seed=ns.seed,
            dtype=ns.dtype, device=device, out=out, pad_prompt_to=ns.pad_prompt_to, attn_impl=ns.attn_impl,
            compile=ns.compile, compile_prefill=ns.compile_prefill, warmup=ns.warmup, calibrate=ns.calibrate, gc_freeze=not ns.no_gc_freeze,
            shared_prompt=not ns.no_shared_prompt, progress=not ns.no_progress, home=ns.home,
            method_problems=tuple(ns.method_problems), shard=shard,
        )  # fmt: skip
    except ValueError as e:
        raise flag_error(e, {"samples": "--samples", "shared_prompt": "--no-shared-prompt", "categories": "--categories",
                             "turns": "--turns", "data_path": "--data", "pad_prompt_to": "--pad-prompt-to"}) from None


def _method_limit(text: str) -> tuple[str, int]:
    """``METHOD=N`` -> ``(METHOD, N)`` (argparse type of ``--method-problems``)."""
    name, sep, num = text.partition("=")
    if not sep or not name or not num.isdigit():
        raise argparse.ArgumentTypeError(f"expected METHOD=N with N >= 0 (e.g. hf=50), got {text!r}")
    return name, int(num)


def verdict(result) -> int:
    """Print the greedy-agreement summary; 1 on errors or float32 mismatches, else 0."""
    from eval import report

    print(report.agreement_summary(result.records, strict=result.strict))
    if result.errors:
        print(f"FAILED: {len(result.errors)} generation(s) raised (see 'error' in the records)", file=sys.stderr)
    if result.strict and result.mismatches:
        print(f"FAILED: {len(result.mismatches)} greedy fp32 output(s) differ from target-only generate:",
              file=sys.stderr)  # fmt: skip
        for r in result.mismatches:
            who = r["method"] + (f"[{r['drafter_label']}]" if r.get("drafter_label") else "")
            print(f"  GREEDY MISMATCH problem {r['problem_id']} method {who} t={r['tree_size']} "
                  f"first divergence at token {r['first_divergence']}", file=sys.stderr)  # fmt: skip
    return 1 if result.failed else 0


def _run(cfg, ns: argparse.Namespace | None = None):
    from eval.runner import run_eval

    result = run_eval(cfg)
    if ns is not None and ns.check:
        _check(cfg, ns, result.records)
    return result


def _check(cfg, ns: argparse.Namespace, records=None, key: str | None = None, dataset: str | None = None,
           path: str | None = None) -> None:  # fmt: skip
    """``--check``: verdicts for the records of configuration ``key`` (default: ``cfg``'s) in
    ``path`` (default: ``cfg.results_path``; ``eval.passk``), after all generations (the sandboxes
    never run beside a timed call), and into ``records`` (in memory) too."""
    from eval import passk
    from eval.config import config_key
    from eval.execution import Limits
    from specdec.cli.check import flag_error

    key = config_key(cfg) if key is None else key
    dataset = dataset or cfg.dataset
    try:
        res = passk.check_file(path or cfg.results_path, dataset=dataset, data=cfg.data_path, config_key=key,
                               limits=Limits(timeout_s=ns.check_timeout), workers=ns.check_workers,
                               progress=cfg.progress, unsafe=ns.unsafe_no_isolation)  # fmt: skip
    except ValueError as e:
        raise flag_error(e, {"data": "--data", "workers": "--check-workers", "timeout_s": "--check-timeout"}) from None
    if records is not None:
        passk.apply_verdicts(records, res.verdicts, dataset=dataset, config_key=key)
    print(f"pass@1 check: {res.summary()}", file=sys.stderr)


def main_eval(argv: Sequence[str] | None = None) -> int:
    """``specdec eval apps|humaneval|mbpp|specbench|prompts [...]`` (mbpp: tuning only)."""
    from eval import report

    ns = parser("specdec eval", sweep=False).parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = config_from(ns, ns.dataset)
    result = _run(cfg, ns)
    rows = report.summarize(result.all_records)
    print(report.format_table(rows))
    print_categories(cfg.dataset, result.all_records)
    print(f"{result.new} new record(s), {result.skipped} already in {cfg.results_path}")
    return verdict(result)


def print_categories(dataset: str, records) -> list[dict] | None:
    """Spec-Bench and prompt files: the no-pass@1 note and the per-category table (a row per
    category and method row, then the overall rows); the category rows (None for other datasets)."""
    from eval import report
    from eval.datasets import CHAT_DATASETS

    if dataset not in CHAT_DATASETS:
        return None
    print(report.dataset_note(dataset))
    rows = report.category_rows(records)
    print(f"\nper category ({dataset}):")
    print(report.format_category_table(rows))
    return rows


def _merged_result(cfg, ns: argparse.Namespace):
    """``--report-only --shards W``: the records of ``shard_paths(OUT, W)`` as one run (``--check``
    first checks each shard file). The configuration reported: the last record's of the newest file."""
    from eval.records import load_records, result_from_records
    from eval.shard import merge, shard_paths

    paths = [p for p in shard_paths(cfg.out, ns.shards) if p.exists()] if ns.shards > 1 else [Path(cfg.out)]
    if not paths:
        raise ValueError(f"--shards: none of the {ns.shards} shard files of {cfg.out} exists "
                         f"({shard_paths(cfg.out, ns.shards)[0].name}, ...)")  # fmt: skip
    missing = ns.shards - len(paths) if ns.shards > 1 else 0
    if missing:
        print(f"note: {missing} of {ns.shards} shard file(s) of {cfg.out} missing (shards without problems write "
              "none)", file=sys.stderr)  # fmt: skip
    lasts = {}
    for p in paths:
        recs = load_records(p)
        if recs:
            lasts[p] = recs[-1]
    if not lasts:
        raise ValueError(f"--shards: no records in the shard files of {cfg.out}")
    newest = max(lasts, key=lambda p: p.stat().st_mtime)
    key = lasts[newest].get("config_key")
    if ns.check:
        for p in lasts:
            _check(cfg, ns, key=key, dataset=lasts[newest].get("dataset"), path=str(p))
    try:
        records = merge(paths)
    except ValueError as e:
        raise ValueError(str(e).replace("paths:", "--shards:", 1)) from None
    source = f"{cfg.out} ({len(paths)} shard file(s))" if ns.shards > 1 else cfg.out
    return result_from_records(records, source, key=key)


def main_sweep(argv: Sequence[str] | None = None) -> int:
    """``specdec sweep [...]``: evaluation over drafters x tree sizes + attention timings + table/CSV/plot."""
    from eval import attn_timing, report
    from eval.records import load_records, result_from_file

    args = list(sys.argv[1:] if argv is None else argv)
    ns = parser("specdec sweep", sweep=True, report_only="--report-only" in args).parse_args(args)
    if ns.shards is not None and not ns.report_only:
        raise ValueError("--shards: only with --report-only (merging the shard files of --out); to run one shard "
                         "use --shard RANK/WORLD or --shard auto")  # fmt: skip
    if ns.shards is not None and ns.shard is not None:
        raise ValueError("--shards: give either --shards WORLD (merge every shard) or --shard (one shard), not both")
    if ns.configs != "last" and (not ns.report_only or ns.shards is not None):
        raise ValueError(f"--configs: {ns.configs!r} only with --report-only (without --shards), got a "
                         + ("shard merge" if ns.report_only else "run"))  # fmt: skip
    cfg = config_from(ns, ns.dataset)
    if ns.report_only and ns.shards is not None:
        result = _merged_result(cfg, ns)
    elif ns.report_only:
        result = result_from_file(cfg.results_path, configs=ns.configs)
        if ns.check:  # the configurations reported: the file's last, or all
            for key in dict.fromkeys(r.get("config_key") for r in result.records):
                _check(cfg, ns, result.records, key=key, dataset=result.records[-1].get("dataset"))
    else:
        result = _run(cfg, ns)
    if cfg.sharded and not ns.report_only:  # one shard's records: its own table only
        rank, world = cfg.shard
        print(f"shard {rank}/{world} of {cfg.out}: partial table (this shard's problems only)")
        if result.all_records:
            print(report.format_table(report.summarize(result.all_records)))
        print(f"{result.new} new record(s), {result.skipped} already in {cfg.results_path}")
        print(f"after every shard: specdec sweep --report-only --out {cfg.out} --shards {world} ... "
              "(the same settings) for the merged table, CSV, summary and plot")  # fmt: skip
        return verdict(result)
    stem = Path(cfg.out).with_suffix("")
    attn_rows = None
    attn_path = Path(f"{stem}.attn.jsonl")
    if not ns.no_attn and not ns.report_only:
        attn_rows = attn_timing.sweep_attention(result.records, result.model_shape, cfg.resolved_dtype(),
                                                cfg.resolved_device(), max_trees=ns.attn_trees)  # fmt: skip
        if attn_rows is not None:
            attn_timing.write_rows(attn_rows, attn_path)
    elif attn_path.exists():
        attn_rows = load_records(attn_path)
    rows = report.summarize(result.all_records, attn_rows)
    print(report.format_table(rows))
    categories = print_categories(cfg.dataset, result.all_records)
    report.write_csv(rows, f"{stem}.csv")
    report.write_summary(rows, f"{stem}.summary.json", config=cfg.describe(), categories=categories,
                         note=report.dataset_note(cfg.dataset))  # fmt: skip
    png = report.plot(rows, f"{stem}.png")
    wrote = [f"{stem}.csv", f"{stem}.summary.json", *([str(png)] if png else []), *([str(attn_path)] if attn_rows else [])]
    print("wrote " + ", ".join(wrote))
    if not ns.report_only:
        print(f"{result.new} new record(s), {result.skipped} already in {cfg.out}")
    return verdict(result)
