"""Former home of the evaluation (configuration, prompts, methods, runner and command line in one
file), split by job in issue 15:

* ``eval.config``   -- ``EvalConfig``, ``DrafterSpec`` (``NAME[:KEY=VALUE,...]``), ``config_key``;
* ``eval.prompts``  -- problems and few-shot padding (``PaddedProblem``, ``pad_problems``);
* ``eval.methods``  -- the methods and the ``Session`` holding the models (``METHODS``, ``Method``,
  ``MethodOutput``, ``RecordingDrafter``, ``build_drafter``);
* ``eval.records``  -- the JSONL records (``load_records``, ``compare_tokens``, ``EvalResult``);
* ``eval.runner``   -- ``run_eval``;
* ``eval.latency``  -- steady state, stalls, first-call latency, time between tokens;
* ``specdec.cli.evaluate`` -- ``specdec eval`` / ``specdec sweep``.

The names below stay importable from here for existing scripts.
"""

from eval.config import (
    BASELINE_METHODS,
    DEFAULT_METHODS,
    REFERENCE,
    TREE_SAMPLES,
    WARMUP_TOKENS,
    DrafterSpec,
    EvalConfig,
    config_key,
)
from eval.methods import METHODS, Method, MethodOutput, RecordingDrafter, build_drafter, tree_depth
from eval.prompts import PaddedProblem, pad_problems
from eval.records import EvalResult, compare_tokens, load_records
from eval.runner import run_eval


def main_eval(argv=None) -> int:
    from specdec.cli.evaluate import main_eval as _main

    return _main(argv)


def main_sweep(argv=None) -> int:
    from specdec.cli.evaluate import main_sweep as _main

    return _main(argv)


__all__ = [
    "BASELINE_METHODS",
    "DEFAULT_METHODS",
    "METHODS",
    "REFERENCE",
    "TREE_SAMPLES",
    "WARMUP_TOKENS",
    "DrafterSpec",
    "EvalConfig",
    "EvalResult",
    "Method",
    "MethodOutput",
    "PaddedProblem",
    "RecordingDrafter",
    "build_drafter",
    "compare_tokens",
    "config_key",
    "load_records",
    "main_eval",
    "main_sweep",
    "pad_problems",
    "run_eval",
    "tree_depth",
]
