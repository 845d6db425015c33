"""Functional correctness: run generated programs against APPS / HumanEval tests (pass@1).

Public API:

* :func:`check` (:func:`check_humaneval`, :func:`check_apps`) -- one problem, one completion ->
  :class:`Verdict` (``passed``, ``status`` in ``pass / fail / timeout / error``, ``seconds``,
  ``stderr`` tail, tests run / passed);
* :func:`score` -- many (problem, completion) pairs in parallel with a tqdm progress bar;
  :func:`summarize` -- pass@1 overall, per status and per difficulty;
* :func:`run_program` -- one Python program with a given stdin, in the same sandbox;
* :func:`extract_code`, :func:`humaneval_program`, :func:`apps_program` -- what gets run;
* :func:`pass_at_k` -- the unbiased pass@k estimator of Chen et al. (2021);
* :func:`paired_diff_ci` -- a confidence interval for the pass@1 difference of two methods on the
  same problems (Tango's paired score interval by default; Newcombe's or a paired bootstrap);
  :func:`bootstrap_mean_ci` -- the percentile bootstrap interval of a mean over problems.

What runs. HumanEval: ``prompt + completion + test + check(entry_point)`` (a chat answer that
defines the whole function replaces the prompt's stub instead, see :func:`humaneval_program`);
it passes iff it finishes within the limit without an exception. APPS: the code extracted from
the completion (:func:`extract_code`), after :data:`APPS_HEADER`'s imports; standard-input
problems run once per test with the test's input on stdin and the output compared by
:func:`outputs_match`; call-based problems (``fn_name``) call the function (or
``Solution().fn_name``) once per test and compare the return value by :func:`values_match` (an
answer that also reads stdin at top level, an unrequested ``main``, gets empty stdin; the
``EOFError`` is ignored once the function is defined). A problem passes iff all its tests pass
(the first :attr:`Limits.max_tests`; testing stops at the first failure unless
:attr:`Limits.stop_on_failure` is False). Each test runs in a fresh process: no state carries
over from one test to the next.

Sandbox (see ``eval/_sandbox_child.py`` for the details). Each check starts one
``python -I -B -X utf8`` driver process in a new session, with a fresh temporary directory as cwd,
HOME and TMPDIR (removed afterwards) and a minimal environment (no proxies, one BLAS thread).
The driver sets ``RLIMIT_AS`` (:attr:`Limits.memory_mb`), ``RLIMIT_FSIZE``
(:attr:`Limits.file_size_mb`, which also caps stdout and stderr) and no core files, tries a
private network namespace, installs Python-level guards, then forks one process per test,
killed with SIGKILL after :attr:`Limits.timeout_s` (``RLIMIT_CPU`` as a backstop). The parent
kills the whole process group when the driver finishes or passes its own overall limit.

Limits of the sandbox, stated plainly: the guards are Python-level and best effort (like
HumanEval's ``reliability_guard``): ``open``/``os.*`` writes outside the temporary directory,
process creation (``os.system``, ``subprocess``, ``os.fork``, ``multiprocessing``), signals to
other processes, raising resource limits and sockets raise ``PermissionError``; ``ctypes`` and
C modules that create files themselves (``sqlite3``, ``dbm``, POSIX shared memory) cannot be
imported; reading files anywhere is allowed. Code that sets out to escape can (it can
recover the original functions), so run untrusted code in a container or VM as well. No network
is kernel-enforced only when ``unshare(CLONE_NEWNET)`` is granted (root, or unprivileged user
namespaces enabled; :attr:`RunResult.network_namespace` says); otherwise only the Python-level
``socket`` guard stands, and the C-level ``_socket`` module is not covered. ``RLIMIT_NPROC`` is not set: Linux
counts it per user (all of the user's processes, threads included) and ignores it for root, so
process creation is stopped by the guards instead.
"""

from __future__ import annotations

import ast
import json
import math
import os
import pickle
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

from eval._sandbox_child import FLOAT_TOLERANCE, arg_candidates, outputs_match, values_match
from eval.datasets import AppsProblem, HumanEvalProblem

__all__ = [
    "APPS_HEADER",
    "FLOAT_TOLERANCE",
    "STATUSES",
    "Limits",
    "PairedDiff",
    "RunResult",
    "Verdict",
    "apps_program",
    "arg_candidates",
    "bootstrap_mean_ci",
    "check",
    "check_apps",
    "check_humaneval",
    "extract_code",
    "humaneval_program",
    "outputs_match",
    "paired_diff_ci",
    "pass_at_k",
    "run_program",
    "score",
    "summarize",
    "values_match",
]

STATUSES = ("pass", "fail", "timeout", "error")
"""``pass``: every test passed. ``fail``: a wrong answer or a failed assertion. ``timeout``: a test
ran past :attr:`Limits.timeout_s` (or the CPU limit). ``error``: any other exception, a crash, a
memory error, a refused sandbox operation, no code, or a missing function."""

APPS_HEADER = """\
import sys, os, math, itertools, collections, heapq, bisect, functools, re, string, random
from typing import List, Dict, Tuple, Set, Optional, Any, Union
from collections import Counter, defaultdict, deque, OrderedDict
from functools import lru_cache, reduce, cmp_to_key
from itertools import accumulate, permutations, combinations, product
from heapq import heappush, heappop, heapify
from bisect import bisect_left, bisect_right
from math import gcd, sqrt, ceil, floor, inf, log, log2
"""
"""Imports run before every APPS program, in its namespace (line numbers stay the program's own):
LeetCode-style answers use ``List`` without importing it, as the APPS harness assumes. A
smaller set than APPS's own header: no ``from math import *`` (it would shadow ``pow``), no numpy."""

_CHILD = Path(__file__).with_name("_sandbox_child.py")
_STDERR_TAIL = 2000
_CAPTURE_STDOUT = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Resource limits for one check.

    Attributes:
        timeout_s: wall-clock seconds per test: one APPS test (one stdin run or one call), or
            the whole HumanEval program.
        memory_mb: address-space limit (``RLIMIT_AS``) in MiB; None for none.
        file_size_mb: largest file the program may write (``RLIMIT_FSIZE``) in MiB, its stdout
            and stderr included; None for none.
        max_tests: run only the first this many tests of an APPS problem; None (default): all.
        stop_on_failure: stop at a problem's first failing test (its verdict is decided).
        isolate_network: also try a private network namespace (``unshare``); the socket guard
            is always on.
        startup_s: slack for interpreter start-up on top of the per-test limits, after which the
            parent kills the whole process group.
    """

    timeout_s: float = 5.0
    memory_mb: int | None = 2048
    file_size_mb: int | None = 16
    max_tests: int | None = None
    stop_on_failure: bool = True
    isolate_network: bool = True
    startup_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("timeout_s", "startup_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")
        for name in ("memory_mb", "file_size_mb", "max_tests"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}: expected None or an int >= 1, got {value!r}")


@dataclass(frozen=True)
class Verdict:
    """The outcome of one completion on one problem.

    Attributes:
        problem_id: the problem's id (``"HumanEval/0"``, an APPS id).
        difficulty: APPS difficulty, or ``"humaneval"``.
        passed: whether every test passed (``status == "pass"``).
        status: one of :data:`STATUSES`.
        seconds: wall-clock seconds of the whole check (start-up included).
        tests_total: tests considered (after :attr:`Limits.max_tests`; 1 for HumanEval).
        tests_run: tests run (fewer than ``tests_total`` after a failure).
        tests_passed: tests passed.
        detail: what went wrong first (e.g. ``"test 3: wrong answer: expected ..."``), else "".
        stderr: the last 2000 characters of the program's stderr (tracebacks).
    """

    problem_id: str
    difficulty: str
    passed: bool
    status: str
    seconds: float
    tests_total: int = 0
    tests_run: int = 0
    tests_passed: int = 0
    detail: str = ""
    stderr: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (one JSONL record)."""
        return asdict(self)


@dataclass(frozen=True)
class RunResult:
    """One sandboxed run of a program (:func:`run_program`).

    Attributes:
        status: ``"ok"`` (exited with status 0), ``"error"`` or ``"timeout"``.
        stdout: its standard output (at most 1 MiB).
        stderr: the last 2000 characters of its standard error.
        seconds: wall-clock seconds, start-up included.
        detail: what went wrong, else "".
        network_namespace: whether the run had a private network namespace.
    """

    status: str
    stdout: str
    stderr: str
    seconds: float
    detail: str = ""
    network_namespace: bool = False


# ----------------------------------------------------------------------------------------------
# what gets run

_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\n`]*)\n(.*?)(?:^[ \t]*```[ \t]*$|\Z)", re.DOTALL | re.MULTILINE)
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


def _defines(code: str, name: str) -> bool:
    """Whether ``code`` defines ``name`` at top level (a function or class ``Solution`` method)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return True
        if isinstance(node, ast.ClassDef) and node.name == "Solution":
            if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name for n in node.body):
                return True
    return False


def extract_code(text: str, fn_name: str | None = None) -> str:
    """The program in a (chat) model's answer.

    Drops ``<think>...</think>`` sections, then looks for fenced blocks (```` ```python ... ``` ````;
    an unterminated last fence, as when generation stopped at the token limit, runs to the end).
    Blocks tagged ``python``/``py...`` or untagged are candidates (any block when none is); among
    them those defining ``fn_name`` at top level (or as a ``Solution`` method) are preferred, then
    the longest wins (the answer rather than an example-usage snippet). Without fences the text
    is returned unchanged (a plain completion).
    """
    text = _THINK.sub("", text)
    blocks = [(tag.strip().lower(), body) for tag, body in _FENCE.findall(text)]
    if not blocks:
        return text
    python = [body for tag, body in blocks if not tag or tag.startswith("py")]
    candidates = python or [body for _, body in blocks]
    if fn_name:
        defining = [body for body in candidates if _defines(body, fn_name)]
        candidates = defining or candidates
    return max(candidates, key=len).rstrip() + "\n"


def humaneval_program(problem: HumanEvalProblem, completion: str) -> str:
    """The program for a HumanEval completion: ``prompt + completion + test + check(entry_point)``.

    A plain completion (the function body continuing the prompt) is appended to the prompt as is.
    A chat answer with code fences is reduced by :func:`extract_code`; when that code defines the
    entry point itself, it is put after the prompt (``prompt + "\\n" + code``): the prompt's stub
    (signature and docstring, a valid function) keeps its imports and helper functions and is
    then redefined by the answer.
    """
    code = extract_code(completion, fn_name=problem.entry_point) if "```" in completion else completion
    if _defines(code, problem.entry_point):
        body = problem.prompt.rstrip() + "\n\n" + code
    else:
        body = problem.prompt + code
    return f"{body}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def apps_program(problem: AppsProblem, completion: str) -> str:
    """The program for an APPS completion: :func:`extract_code` (preferring blocks that define the
    problem's ``fn_name``). :data:`APPS_HEADER` runs before it."""
    return extract_code(completion, fn_name=problem.fn_name)


# ----------------------------------------------------------------------------------------------
# running


def _child_env(sandbox: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": sandbox, "TMPDIR": sandbox, "TMP": sandbox, "TEMP": sandbox,
        "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
        "NO_PROXY": "*", "no_proxy": "*",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
    }  # fmt: skip


def _rmtree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):  # a program made a directory unwritable: open it up (not through links), retry
        for root, dirs, _ in os.walk(path):
            for d in dirs:
                full = os.path.join(root, d)
                if not os.path.islink(full):
                    try:
                        os.chmod(full, 0o700)
                    except OSError:
                        pass
        shutil.rmtree(path, ignore_errors=True)


def _tail(path: str, chars: int = _STDERR_TAIL) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4 * chars))
            return f.read().decode("utf-8", errors="replace")[-chars:]
    except OSError:
        return ""


def _wait_then_kill_group(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for the driver at most ``timeout`` s, kill its process group, reap it: timed out?

    With a pidfd the driver is waited for without reaping it, so its pid (the group id) cannot
    be reused before the group is killed."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
        if pidfd is not None:
            timed_out = not select.select([pidfd], [], [], timeout)[0]
        else:
            try:
                proc.wait(timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        return timed_out
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _execute(mode: str, code: str, tests: list[dict], limits: Limits, *, header: str = "", fn_name: str | None = None,
             capture_stdout: int = 0) -> tuple[dict, str, float]:  # fmt: skip
    """Run one driver: (its result dict, stderr tail, seconds). Tests carry ``input`` (stdin
    text, written to a file here) and ``expected``."""
    start = time.monotonic()
    base = tempfile.mkdtemp(prefix="specdec-exec-")
    try:
        sandbox = os.path.join(base, "sandbox")
        io_dir = os.path.join(base, "io")
        os.mkdir(sandbox, 0o700)
        os.mkdir(io_dir, 0o700)
        driver_tests = []
        for i, test in enumerate(tests):
            test = dict(test)
            text = test.pop("input", None)
            if text is not None:
                test["input_path"] = os.path.join(io_dir, f"in_{i}.txt")
                with open(test["input_path"], "w", encoding="utf-8", newline="") as f:
                    f.write(text)
            driver_tests.append(test)
        spec = {
            "mode": mode, "code": code, "header": header, "fn_name": fn_name, "tests": driver_tests,
            "sandbox": sandbox, "result_path": os.path.join(io_dir, "result.json"),
            "stdout_path": os.path.join(io_dir, "stdout"), "timeout_s": float(limits.timeout_s),
            "memory_bytes": None if limits.memory_mb is None else limits.memory_mb << 20,
            "fsize_bytes": None if limits.file_size_mb is None else limits.file_size_mb << 20,
            "isolate_network": limits.isolate_network, "stop_on_failure": limits.stop_on_failure,
            "capture_stdout": capture_stdout,
        }  # fmt: skip
        spec_path = os.path.join(io_dir, "spec.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump(spec, f)
        stderr_path = os.path.join(io_dir, "stderr")
        overall = limits.startup_s + len(tests) * (limits.timeout_s + 0.5)
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-B", "-X", "utf8", str(_CHILD), spec_path],
                cwd=sandbox, env=_child_env(sandbox), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=err, start_new_session=True, close_fds=True,
            )  # fmt: skip
            timed_out = _wait_then_kill_group(proc, overall)
        try:
            with open(spec["result_path"], encoding="utf-8") as f:
                result = json.loads(f.read() or "null")
        except (OSError, ValueError):
            result = None
        stderr = _tail(stderr_path)
        if not isinstance(result, dict):
            if timed_out:
                what = f"the sandbox passed its overall limit of {overall:g} s and was killed"
                result = {"status": "timeout", "detail": what, "tests_run": 0, "tests_passed": 0}
            else:
                what = f"the sandbox driver failed (exit status {proc.returncode})"
                result = {"status": "error", "detail": what, "tests_run": 0, "tests_passed": 0}
        return result, stderr, time.monotonic() - start
    finally:
        _rmtree(base)


def run_program(source: str, stdin: str = "", *, limits: Limits | None = None) -> RunResult:
    """Run ``source`` as a script (``__name__ == "__main__"``) in the sandbox with ``stdin`` as
    its standard input; see the module docstring for the sandbox."""
    limits = limits or Limits()
    if not isinstance(source, str):
        raise ValueError(f"source: expected the program text (str), got {type(source).__name__}")
    if not isinstance(stdin, str):
        raise ValueError(f"stdin: expected str, got {type(stdin).__name__}")
    result, stderr, seconds = _execute("stdin", source, [{"input": stdin, "expected": None}], limits,
                                       capture_stdout=_CAPTURE_STDOUT)  # fmt: skip
    status = {"pass": "ok"}.get(result["status"], result["status"])
    return RunResult(status, result.get("stdout", ""), stderr, seconds, result.get("detail", ""),
                     bool(result.get("network_namespace")))  # fmt: skip


def _verdict(problem_id: str, difficulty: str, n_tests: int, result: dict, stderr: str, seconds: float) -> Verdict:
    status = result["status"]
    return Verdict(
        problem_id=problem_id, difficulty=difficulty, passed=status == "pass", status=status,
        seconds=round(seconds, 4), tests_total=n_tests, tests_run=int(result.get("tests_run", 0)),
        tests_passed=int(result.get("tests_passed", 0)), detail=result.get("detail", ""), stderr=stderr,
    )  # fmt: skip


def check_humaneval(problem: HumanEvalProblem, completion: str, limits: Limits | None = None) -> Verdict:
    """Run :func:`humaneval_program` once; pass iff it finishes within :attr:`Limits.timeout_s`
    without an exception (a failed assertion is ``fail``, anything else ``error``; calling
    ``exit()`` before the tests finish is an ``error``, not a pass)."""
    limits = limits or Limits()
    program = humaneval_program(problem, completion)
    result, stderr, seconds = _execute("humaneval", program, [{}], limits)
    return _verdict(problem.id, problem.difficulty, 1, result, stderr, seconds)


def _stdin_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "\n".join(str(v) for v in value)
    return str(value)


def _expected_text(value: Any) -> str:
    if isinstance(value, (list, tuple)):  # MapCoder wraps the output: [text]; some APPS rows: lines
        return "\n".join(str(v) for v in value)
    return str(value)


def _apps_tests(problem: AppsProblem, limits: Limits) -> list[dict]:
    tests = problem.tests[: limits.max_tests] if limits.max_tests is not None else problem.tests
    out = []
    for t in tests:
        if not problem.call_based:
            out.append({"input": _stdin_text(t.input), "expected": _expected_text(t.output)})
        elif problem.source == "mapcoder" or isinstance(t.input, str):
            out.append({"text": _stdin_text(t.input), "expected": t.output, "wrapped": problem.source == "mapcoder"})
        else:
            out.append({"args": t.input, "expected": t.output, "wrapped": False})
    return out


def check_apps(problem: AppsProblem, completion: str, limits: Limits | None = None) -> Verdict:
    """Run an APPS completion against the problem's tests (see the module docstring).

    Call-based tests of MapCoder rows store the arguments as text; :func:`arg_candidates` says
    how they are turned back into arguments. A problem without tests, or a call-based problem
    without a function name, gets an ``error`` verdict without running anything."""
    limits = limits or Limits()
    tests = _apps_tests(problem, limits)
    if not tests:
        return Verdict(problem.id, problem.difficulty, False, "error", 0.0, detail="the problem has no tests")
    if problem.call_based and not problem.fn_name:
        return Verdict(problem.id, problem.difficulty, False, "error", 0.0, len(tests),
                       detail="call-based problem without a function name")  # fmt: skip
    code = apps_program(problem, completion)
    if not code.strip():
        return Verdict(problem.id, problem.difficulty, False, "error", 0.0, len(tests), detail="no code in the completion")
    mode = "call" if problem.call_based else "stdin"
    result, stderr, seconds = _execute(mode, code, tests, limits, header=APPS_HEADER, fn_name=problem.fn_name)
    return _verdict(problem.id, problem.difficulty, len(tests), result, stderr, seconds)


def check(problem: AppsProblem | HumanEvalProblem, completion: str, limits: Limits | None = None) -> Verdict:
    """:func:`check_humaneval` or :func:`check_apps` by the problem's type."""
    if not isinstance(completion, str):
        raise ValueError(f"completion: expected str, got {type(completion).__name__}")
    if isinstance(problem, HumanEvalProblem):
        return check_humaneval(problem, completion, limits)
    if isinstance(problem, AppsProblem):
        return check_apps(problem, completion, limits)
    raise ValueError(f"problem: expected an AppsProblem or a HumanEvalProblem, got {type(problem).__name__}")


def score(
    problems: Sequence[AppsProblem | HumanEvalProblem],
    completions: Sequence[str] | Mapping[str, str],
    *,
    limits: Limits | None = None,
    workers: int | None = None,
    progress: bool = True,
    desc: str = "tests",
) -> list[Verdict]:
    """Check every problem's completion, ``workers`` at a time; verdicts in ``problems`` order.

    Args:
        problems: APPS and/or HumanEval problems.
        completions: one completion per problem (same order), or a mapping problem id ->
            completion (every id must be present).
        limits: :class:`Limits` for every check.
        workers: concurrent sandboxes (threads that each wait on one process); default: the CPU
            count, at most the number of problems.
        progress: show a tqdm progress bar.
        desc: the progress bar's label.

    Raises:
        ValueError: completions that do not match the problems, or a bad ``workers``.
    """
    limits = limits or Limits()
    problems = list(problems)
    if isinstance(completions, Mapping):
        missing = [p.id for p in problems if p.id not in completions]
        if missing:
            raise ValueError(f"completions: no completion for problem id(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        texts = [completions[p.id] for p in problems]
    else:
        texts = list(completions)
        if len(texts) != len(problems):
            raise ValueError(f"completions: expected {len(problems)} (one per problem), got {len(texts)}")
    if workers is None:
        workers = max(1, min(len(problems), os.cpu_count() or 1))
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
    verdicts: list[Verdict | None] = [None] * len(problems)
    from tqdm.auto import tqdm

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        with tqdm(total=len(problems), desc=desc, disable=not progress) as bar:
            futures = {pool.submit(check, p, t, limits): i for i, (p, t) in enumerate(zip(problems, texts))}
            n_pass = 0
            for future in as_completed(futures):
                verdict = future.result()
                verdicts[futures[future]] = verdict
                n_pass += verdict.passed
                bar.update(1)
                bar.set_postfix(passed=n_pass, refresh=False)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # running checks end within their limits
        raise
    pool.shutdown()
    return [v for v in verdicts if v is not None]


def summarize(verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """``{"n", "passed", "pass_at_1", "status": {status: count}, "by_difficulty": {difficulty:
    {"n", "passed", "pass_at_1"}}}`` (pass@1 = passed / n, 0.0 for none)."""
    def part(vs):
        n, passed = len(vs), sum(v.passed for v in vs)
        return {"n": n, "passed": passed, "pass_at_1": passed / n if n else 0.0}

    out = part(verdicts)
    out["status"] = dict(Counter(v.status for v in verdicts))
    groups: dict[str, list[Verdict]] = {}
    for v in verdicts:
        groups.setdefault(v.difficulty, []).append(v)
    out["by_difficulty"] = {d: part(vs) for d, vs in groups.items()}
    return out


# ----------------------------------------------------------------------------------------------
# statistics


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an int, got {value!r}")
    return value


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021):
    ``1 - C(n - c, k) / C(n, k)``, computed as a product so large ``n`` does not overflow.
    Requires ``0 <= c <= n`` and ``1 <= k <= n``; ``pass_at_k(n, c, 1) == c / n``."""
    n, c, k = _count(n, "n"), _count(c, "c"), _count(k, "k")
    if n < 1:
        raise ValueError(f"n: expected at least 1 sample, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c: expected 0 <= c <= n = {n}, got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k: expected 1 <= k <= n = {n}, got {k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def bootstrap_mean_ci(values: Sequence[float], *, confidence: float = 0.95, n_resamples: int = 10_000,
                      seed: int = 0) -> tuple[float, float]:  # fmt: skip
    """The percentile bootstrap interval ``(low, high)`` of the mean of per-problem ``values`` (e.g.
    pass@k estimates, or paired differences): the ``(1 - confidence) / 2`` and ``(1 + confidence) /
    2`` quantiles of the mean over ``n_resamples`` resamplings of the problems with replacement,
    seeded by ``seed`` (the same values give the same interval). Zero width when all values are equal."""
    if not values:
        raise ValueError("values: expected at least one value, got none")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a number in (0, 1), got {confidence!r}")
    n_resamples = _count(n_resamples, "n_resamples")
    if n_resamples < 100:
        raise ValueError(f"n_resamples: expected at least 100, got {n_resamples}")
    import numpy as np

    rng = np.random.default_rng(seed)
    vals = np.asarray(values, dtype=np.float64)
    idx = rng.integers(0, len(vals), size=(n_resamples, len(vals)))
    means = vals[idx].mean(axis=1)
    alpha = 1.0 - confidence
    low, high = (float(x) for x in np.quantile(means, [alpha / 2, 1 - alpha / 2]))
    return low, high


@dataclass(frozen=True)
class PairedDiff:
    """A confidence interval for ``mean(a) - mean(b)`` over the same problems.

    Attributes:
        diff: the observed difference of pass rates (a minus b).
        low, high: the interval's bounds.
        confidence: its nominal coverage, e.g. 0.95.
        method: ``"tango"``, ``"newcombe"`` or ``"bootstrap"``.
        n: problems.
        a_better, b_better: problems where a scored higher (for 0/1 outcomes: a passed, b
            failed) / lower; the rest are ties. Only these discordant problems move the difference.
    """

    diff: float
    low: float
    high: float
    confidence: float
    method: str
    n: int
    a_better: int
    b_better: int


def _outcomes(values: Sequence[Any], name: str) -> list[float]:
    out = []
    for i, v in enumerate(values):
        v = v.passed if isinstance(v, Verdict) else v
        if isinstance(v, bool):
            v = float(v)
        if not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
            raise ValueError(f"{name}[{i}]: expected a bool, a Verdict or a pass rate in [0, 1], got {v!r}")
        out.append(float(v))
    return out


def _wilson(successes: float, n: int, z: float) -> tuple[float, float]:
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _tango(b: int, c: int, n: int, z: float) -> tuple[float, float]:
    """Tango's (1998) score interval for p_b - p_c from b and c discordant pairs among n."""

    def score(delta: float) -> float:  # decreasing in delta
        qa, qb, qc = 2 * n, -b - c + (2 * n - b + c) * delta, -c * delta * (1 - delta)
        q = (math.sqrt(max(0.0, qb * qb - 4 * qa * qc)) - qb) / (2 * qa)  # constrained MLE of p_c
        var = n * (2 * q + delta * (1 - delta))
        num = b - c - n * delta
        if var <= 0:
            return 0.0 if num == 0 else math.copysign(math.inf, num)
        return num / math.sqrt(var)

    def solve(target: float) -> float:
        lo, hi = -1.0, 1.0
        for _ in range(100):
            mid = (lo + hi) / 2
            if score(mid) > target:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    return solve(z), solve(-z)


def _newcombe(both: int, a_only: int, b_only: int, n: int, z: float) -> tuple[float, float]:
    """Newcombe's (1998) method 10: the paired square-and-add of two Wilson intervals."""
    neither = n - both - a_only - b_only
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    l1, u1 = _wilson(both + a_only, n, z)
    l2, u2 = _wilson(both + b_only, n, z)
    margins = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    phi = (both * neither - a_only * b_only) / math.sqrt(margins) if margins > 0 else 0.0
    d1, e1, d2, e2 = p1 - l1, u1 - p1, p2 - l2, u2 - p2
    diff = p1 - p2
    return (diff - math.sqrt(max(0.0, d1 * d1 - 2 * phi * d1 * e2 + e2 * e2)),
            diff + math.sqrt(max(0.0, e1 * e1 - 2 * phi * e1 * d2 + d2 * d2)))  # fmt: skip


def paired_diff_ci(
    a: Sequence[Any],
    b: Sequence[Any],
    *,
    confidence: float = 0.95,
    method: str = "tango",
    n_resamples: int = 10_000,
    seed: int = 0,
) -> PairedDiff:
    """Confidence interval for the difference of pass@1 of methods a and b on the same problems.

    ``a[i]`` and ``b[i]`` are the two methods' outcomes on problem i: bools (or
    :class:`Verdict` s), or, for ``method="bootstrap"``, per-problem pass rates in [0, 1] (e.g.
    ``c/n`` from n samples). The pairing matters: only problems one method solves and the other
    does not (``a_better``, ``b_better``) carry information about the difference.

    Methods:

    * ``"tango"`` (default; 0/1 outcomes): Tango's (1998) asymptotic score interval, the
      inversion of the score test for paired proportions, found by bisection. It contains 0
      exactly when McNemar's test (without continuity correction) does not reject at
      ``1 - confidence``, and stays sensible with few or no discordant problems (no
      discordant problems among n gives ``±z²/(n + z²)``). One of the intervals Fagerland,
      Lydersen & Laake (Stat. Med. 2014) found to perform well for paired proportions.
    * ``"newcombe"`` (0/1 outcomes): Newcombe's (1998) method 10, the square-and-add of the two
      Wilson score intervals corrected by the phi correlation of the pairs. Closed form, but it
      collapses towards zero width when no problem is discordant (e.g. two lossless decoders
      with identical outputs), so it overstates certainty there.
    * ``"bootstrap"``: the percentile interval of ``mean(a) - mean(b)`` over ``n_resamples``
      resamplings of the problems with replacement (pairs kept together), seeded by ``seed``;
      works for pass rates too; also zero width without discordant problems.
    """
    a_vals, b_vals = _outcomes(a, "a"), _outcomes(b, "b")
    if len(a_vals) != len(b_vals):
        raise ValueError(f"b: expected as many outcomes as a ({len(a_vals)}, the same problems), got {len(b_vals)}")
    n = len(a_vals)
    if n == 0:
        raise ValueError("a: expected outcomes for at least one problem, got none")
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence: expected a number in (0, 1), got {confidence!r}")
    diff = (sum(a_vals) - sum(b_vals)) / n
    a_better = sum(x > y for x, y in zip(a_vals, b_vals))
    b_better = sum(x < y for x, y in zip(a_vals, b_vals))
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    if method in ("tango", "newcombe"):
        if any(v not in (0.0, 1.0) for v in a_vals + b_vals):
            raise ValueError(f"method: {method!r} needs 0/1 outcomes; use method='bootstrap' for pass rates")
        if method == "tango":
            low, high = _tango(a_better, b_better, n, z)
        else:
            both = sum(x == 1.0 and y == 1.0 for x, y in zip(a_vals, b_vals))
            low, high = _newcombe(both, a_better, b_better, n, z)
    elif method == "bootstrap":
        deltas = [x - y for x, y in zip(a_vals, b_vals)]
        low, high = bootstrap_mean_ci(deltas, confidence=confidence, n_resamples=n_resamples, seed=seed)
    else:
        raise ValueError(f"method: expected 'tango', 'newcombe' or 'bootstrap', got {method!r}")
    return PairedDiff(diff, max(-1.0, low), min(1.0, high), float(confidence), method, n, a_better, b_better)
