"""``specdec check RESULTS.jsonl``: pass@1 of an evaluation's completions, after the fact.

Runs every completion of a results file (``specdec eval`` / ``sweep``) against its problem's tests
in ``eval.execution``'s sandbox, writes ``passed`` / ``check_status`` into the records (atomically,
in place or to ``--out``; resumable), and prints pass@1 per (method, drafter, tree size) with the
paired difference to a reference method and its 95% interval. Records of ``--samples n`` runs have
every sample checked (``sample_passed``, ``num_correct``) and get pass@1 / pass@10 (unbiased
estimator, bootstrap intervals over problems). The library side is
``eval.passk``; ``specdec sweep --report-only`` then shows the same pass@1 in its table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from specdec.cli import args as cliargs

__all__ = ["add_limit_arguments", "flag_error", "main", "parser"]

#: Library argument names -> the flags that set them, for one-line errors.
_FLAGS = {"results": "RESULTS", "dataset": "--dataset", "data": "--data", "workers": "--workers",
          "reference": "--reference", "timeout_s": "--timeout"}  # fmt: skip


def flag_error(e: ValueError, flags: dict[str, str] | None = None) -> ValueError:
    """``e`` with its leading ``name:`` replaced by the flag that sets it."""
    msg = str(e)
    name, sep, rest = msg.partition(":")
    table = flags or _FLAGS
    if sep and name in table:
        return ValueError(f"{table[name]}:{rest}")
    return e


def add_limit_arguments(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--{prefix}workers`` and ``--{prefix}timeout`` (shared with ``specdec eval|sweep --check``)."""
    p.add_argument(f"--{prefix}workers", type=cliargs.int_at_least(1), default=None,
                   help="programs checked at once, each in its own sandbox (None: the CPU count)")  # fmt: skip
    p.add_argument(f"--{prefix}timeout", type=cliargs.float_in(0.0, low_open=True), default=5.0,
                   help="seconds per test (an APPS test, or a whole HumanEval program)")  # fmt: skip
    p.add_argument("--unsafe-no-isolation", action="store_true",
                   help="run generated code without bubblewrap when it is not installed (no kernel isolation: "
                   "only resource limits and Python-level guards); recorded as check_isolation='none' in every "
                   "verdict")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    from eval.datasets import DATASETS

    p = cliargs.ArgumentParser(
        prog="specdec check",
        description="Run the completions of a results file (specdec eval / sweep) against their problems' tests "
        "(sandboxed, see eval/execution.py), write 'passed' / 'check_status' into the records (in place unless "
        "--out; records that already have a verdict are skipped, so an interrupted check resumes), and print "
        "pass@1 per method with the paired difference to --reference (Tango's 95% interval; for records with "
        "several samples, --samples: every sample checked, pass@1 / pass@10 with bootstrap intervals).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("results", metavar="RESULTS", type=cliargs.existing_path, help="results JSONL")
    p.add_argument("--dataset", choices=list(DATASETS), default=None,
                   help="the dataset to check (None: the one the records name; mbpp: tuning only; specbench and "
                   "prompts have no tests and are refused)")  # fmt: skip
    p.add_argument("--data", type=cliargs.existing_path, default=None,
                   help="the APPS / HumanEval / MBPP file the run used (None: the loaders' own)")  # fmt: skip
    add_limit_arguments(p)
    p.add_argument("--reference", default=None, metavar="METHOD",
                   help="the baseline of the paired pass@1 difference (None: hf-static, else hf)")  # fmt: skip
    p.add_argument("--out", type=cliargs.output_file, default=None,
                   help="write the checked records here (None: back into RESULTS)")  # fmt: skip
    p.add_argument("--recheck", action="store_true", help="check records that already have a verdict again")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _refuse_untested(ns: argparse.Namespace) -> None:
    """A one-line ValueError when the dataset to check (``--dataset``, else the one the records
    name) has no tests: Spec-Bench and prompt files (speed and tau only)."""
    from eval.datasets import CHAT_DATASETS, check_tested_dataset
    from eval.records import is_timed, load_records

    if ns.dataset is not None:
        if ns.dataset in CHAT_DATASETS:
            check_tested_dataset(ns.dataset, "--dataset")
        return
    named = {r.get("dataset") for r in load_records(ns.results) if is_timed(r)}
    untested = sorted(d for d in named if d in CHAT_DATASETS)
    if untested and len(named) == 1:
        check_tested_dataset(untested[0], f"RESULTS ({ns.results})")


def main(argv: Sequence[str] | None = None) -> int:
    """``specdec check RESULTS.jsonl [...]``."""
    from eval import passk
    from eval.execution import Limits

    ns = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    _refuse_untested(ns)
    try:
        res = passk.check_file(ns.results, dataset=ns.dataset, data=ns.data, out=ns.out,
                               limits=Limits(timeout_s=ns.timeout), workers=ns.workers,
                               progress=not ns.no_progress, recheck=ns.recheck,
                               unsafe=ns.unsafe_no_isolation)  # fmt: skip
        rows = passk.pass_rows(res.records, ns.reference, dataset=res.dataset)
    except ValueError as e:
        raise flag_error(e) from None
    print(res.summary())
    print(f"wrote {res.path}" if res.written else f"{res.path}: nothing new to check")
    print(passk.format_pass_table(rows))
    return 0
