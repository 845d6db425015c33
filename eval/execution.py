"""Functional correctness: run generated programs against APPS / HumanEval tests (pass@1).

Public API:

* :func:`check` (:func:`check_humaneval`, :func:`check_apps`) -- one problem, one completion ->
  :class:`Verdict` (``passed``, ``status`` in ``pass / fail / timeout / error``, ``seconds``,
  ``stderr`` tail, tests run / passed);
* :func:`score` -- many (problem, completion) pairs in parallel with a tqdm progress bar;
  :func:`summarize` -- pass@1 overall, per status and per difficulty;
* :func:`run_program` -- one Python program with a given stdin, in the same sandbox;
* :func:`extract_code`, :func:`humaneval_program`, :func:`apps_program` -- what gets run;
* pass@k and the paired intervals are in :mod:`eval.stats`.

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

Isolation (``eval/sandbox.py``, ``eval/_sandbox_child.py``). Every test runs as a fresh
interpreter inside bubblewrap: uid 65534 with no capabilities in its own user, pid, network, ipc
and uts namespaces, read-only system files, a private size-limited ``/tmp``, a pids cgroup (or
``RLIMIT_NPROC``), and hard resource limits (address space, file size, CPU); when the test ends the
kernel kills whatever it left behind. The verdict is taken outside the tested process: a
standard-input program's output is compared here; a call-based answer comes back as plain data
(builtin types only) and is compared here; a HumanEval test runs in a second sandboxed process (the
judge) that holds only the dataset's prompt and test, calls the completion's function in the
first process and receives plain data back. Python-level guards (``install_guards``) stay inside as
a second layer. Without bubblewrap the checks refuse to run (:class:`eval.sandbox.IsolationUnavailable`)
unless ``unsafe=True``; every :class:`Verdict` records its :attr:`~Verdict.isolation`.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
import signal
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eval import sandbox
from eval._sandbox_child import MAX_FRAME_BYTES, _short, arg_candidates, loads_plain
from eval.compare import FLOAT_TOLERANCE, outputs_match, values_match
from eval.datasets import AppsProblem, HumanEvalProblem
from eval.sandbox import Isolation, IsolationUnavailable

__all__ = [
    "APPS_HEADER",
    "FLOAT_TOLERANCE",
    "STATUSES",
    "IsolationUnavailable",
    "Limits",
    "RunResult",
    "Verdict",
    "apps_program",
    "arg_candidates",
    "check",
    "check_apps",
    "check_humaneval",
    "extract_code",
    "humaneval_program",
    "humaneval_solution",
    "outputs_match",
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

_RUNNER = str(Path(__file__).with_name("_sandbox_child.py"))
_STDERR_TAIL = 2000
_CAPTURE_STDOUT = 1 << 20
_START_S = 2.0
"""Wall-clock allowance per process on top of its limit, for interpreter start-up (and the sandbox's)."""


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
        max_procs: processes (threads included) one test may hold at once.
    """

    timeout_s: float = 5.0
    memory_mb: int | None = 2048
    file_size_mb: int | None = 16
    max_tests: int | None = None
    stop_on_failure: bool = True
    max_procs: int = 64

    def __post_init__(self) -> None:
        for name in ("timeout_s",):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name}: expected a finite number of seconds > 0, got {value!r}")
        if isinstance(self.max_procs, bool) or not isinstance(self.max_procs, int) or self.max_procs < 2:
            raise ValueError(f"max_procs: expected an int >= 2, got {self.max_procs!r}")
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
        isolation: ``"bubblewrap"``, or ``"none"`` for a check run with ``unsafe=True`` without it.
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
    isolation: str = "bubblewrap"

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
        isolation: ``"bubblewrap"`` or ``"none"``.
    """

    status: str
    stdout: str
    stderr: str
    seconds: float
    detail: str = ""
    isolation: str = "bubblewrap"


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


def humaneval_solution(problem: HumanEvalProblem, completion: str) -> str:
    """What a HumanEval completion defines: ``prompt + completion``.

    A plain completion (the function body continuing the prompt) is appended to the prompt as is.
    A chat answer with code fences is reduced by :func:`extract_code`; when that code defines the
    entry point itself, it is put after the prompt (``prompt + "\\n" + code``): the prompt's stub
    (signature and docstring, a valid function) keeps its imports and helper functions and is
    then redefined by the answer.
    """
    code = extract_code(completion, fn_name=problem.entry_point) if "```" in completion else completion
    if _defines(code, problem.entry_point):
        return problem.prompt.rstrip() + "\n\n" + code
    return problem.prompt + code


def humaneval_program(problem: HumanEvalProblem, completion: str) -> str:
    """The whole HumanEval program, ``solution + test + check(entry_point)``, as the dataset's
    harness would run it in one process. :func:`check_humaneval` does not run this: it runs the
    solution and the test in two processes (see the module docstring)."""
    return f"{humaneval_solution(problem, completion)}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"


def apps_program(problem: AppsProblem, completion: str) -> str:
    """The program for an APPS completion: :func:`extract_code` (preferring blocks that define the
    problem's ``fn_name``). :data:`APPS_HEADER` runs before it."""
    return extract_code(completion, fn_name=problem.fn_name)


# ----------------------------------------------------------------------------------------------
# running


def _spec(mode: str, limits: Limits, iso: Isolation, root: str, **fields: Any) -> dict[str, Any]:
    return {
        "mode": mode, "root": root, "guards": True, "cpu_s": float(limits.timeout_s) + 1.0,
        "memory_bytes": None if limits.memory_mb is None else limits.memory_mb << 20,
        "fsize_bytes": None if limits.file_size_mb is None else limits.file_size_mb << 20,
        "max_procs": limits.max_procs if iso.tool == "bubblewrap" else None, "site_dirs": _site_dirs(), **fields,
    }  # fmt: skip


@functools.cache
def _site_dirs() -> tuple[str, ...]:
    """This interpreter's site-packages, which the runner (started with ``-S``) puts on its path."""
    import site

    return tuple(d for d in site.getsitepackages() if os.path.isdir(d))


def _launch(iso: Isolation, spec: dict[str, Any], limits: Limits, *, fds: Sequence[int] = (), stdin: int | None = None,
            stdout: int | None = None, stderr: int | None = None, workdir: str | None = None) -> sandbox.Spawned:  # fmt: skip
    """One fresh runner process in the sandbox, its spec handed over on an in-memory file."""
    with sandbox.memfd("spec", json.dumps(spec).encode()) as spec_fd:
        argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", "{runner}", str(spec_fd)]
        tmp = max(16 << 20, 4 * ((limits.file_size_mb or 16) << 20))
        return sandbox.spawn(iso, argv, fds=(spec_fd, *fds), stdin=stdin, stdout=stdout, stderr=stderr,
                             max_procs=limits.max_procs, tmp_bytes=tmp, runner=_RUNNER, workdir=workdir)  # fmt: skip


def _ended(returncode: int, iso: Isolation) -> tuple[int | None, int | None]:
    """(exit status, terminating signal) of a runner, through bwrap (which exits 128 + signal) or not."""
    if returncode < 0:
        return None, -returncode
    if iso.tool == "bubblewrap" and returncode > 128:
        return None, returncode - 128
    return returncode, None


def _signal_outcome(sig: int) -> tuple[str, str]:
    if sig == signal.SIGXCPU:
        return "timeout", "CPU time limit exceeded"
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    hint = " (out of memory?)" if sig == signal.SIGKILL else ""
    return "error", f"killed by {name}{hint}"


def _text(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


def _last_line(text: str, prefix: str = "specdec-sandbox: ") -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1][len(prefix):] if lines and lines[-1].startswith(prefix) else ""


@dataclass
class _Run:
    """One test's run: ``outcome`` in pass / fail / error / timeout, what went wrong, its output."""

    outcome: str
    detail: str = ""
    stdout: str = ""
    stderr: str = ""


def _run_stdin_test(iso: Isolation, code: str, header: str, stdin_text: str, expected: str | None, limits: Limits,
                    capture: int = _CAPTURE_STDOUT) -> _Run:  # fmt: skip
    """The program with ``stdin_text`` on stdin; its stdout compared here with ``expected`` (None: any)."""
    root = sandbox.workdir(iso)
    spec = _spec("stdin", limits, iso, root, code=code, header=header)
    with sandbox.memfd("stdin", stdin_text.encode("utf-8")) as fin, sandbox.memfd("stdout") as fout, \
            sandbox.memfd("stderr") as ferr:  # fmt: skip
        run = _launch(iso, spec, limits, stdin=fin, stdout=fout, stderr=ferr, workdir=root)
        in_time = run.wait(limits.timeout_s + _START_S)
        returncode = run.finish()
        stdout = _text(sandbox.read_fd(fout, capture))
        stderr = _text(sandbox.read_fd(ferr, 1 << 20))[-_STDERR_TAIL:]
    if not in_time:
        return _Run("timeout", f"no answer within {limits.timeout_s:g} s (killed)", stdout, stderr)
    status, sig = _ended(returncode, iso)
    if sig is not None:
        outcome, detail = _signal_outcome(sig)
        return _Run(outcome, detail, stdout, stderr)
    if status != 0:
        return _Run("error", _last_line(stderr) or f"exit status {status}", stdout, stderr)
    if expected is None or outputs_match(stdout, expected):
        return _Run("pass", "", stdout, stderr)
    return _Run("fail", f"wrong answer: expected {_short(expected, 80)}, got {_short(stdout, 80)}", stdout, stderr)


def _judge_answers(message: Any, test: dict[str, Any]) -> _Run:
    """A call-based test's verdict from the answers the program sent (plain data, compared here)."""
    if not isinstance(message, dict):
        return _Run("error", "the program sent no answer")
    if "outcome" in message:
        outcome = message["outcome"] if message["outcome"] in ("fail", "error") else "error"
        return _Run(outcome, str(message.get("detail", ""))[:600])
    answers = message.get("answers")
    if not isinstance(answers, list) or not answers:
        return _Run("error", "the program sent no answer")
    expected = test["expected"]
    shown = expected[0] if test["wrapped"] and isinstance(expected, list) and len(expected) == 1 else expected
    failed: list[str] = []
    errors: list[str] = []
    for answer in answers:
        if not isinstance(answer, dict):
            continue
        args = str(answer.get("args", ""))
        if "value" in answer:
            if values_match(answer["value"], expected, test["wrapped"]):
                return _Run("pass")
            failed.append(f"args {args}: expected {_short(shown)}, got {_short(answer['value'])}")
        elif "opaque" in answer:
            failed.append(f"args {args}: expected {_short(shown)}, got a {answer['opaque']} ({answer.get('repr', '')})")
        elif answer.get("raised") == "SystemExit":
            errors.append(f"args {args}: {answer.get('detail', '')}")
        else:
            errors.append(f"args {args}: {answer.get('raised')}: {answer.get('detail', '')}".replace(": :", ":"))
    # a wrong value outranks an exception: the exception may only mean a wrong guess at the types
    if failed:
        return _Run("fail", failed[0][:600])
    return _Run("error", (errors[0] if errors else "the program sent no answer")[:600])


def _run_call_test(iso: Isolation, code: str, fn_name: str, test: dict[str, Any], limits: Limits) -> _Run:
    """Define the solution and call ``fn_name`` in the sandbox; the answers are compared here."""
    root = sandbox.workdir(iso)
    call = {k: v for k, v in test.items() if k in ("args", "text")}
    with sandbox.memfd("reply") as reply, sandbox.memfd("stderr") as ferr:
        spec = _spec("call", limits, iso, root, code=code, header=APPS_HEADER, fn_name=fn_name, test=call, reply_fd=reply)
        run = _launch(iso, spec, limits, fds=(reply,), stderr=ferr, workdir=root)
        in_time = run.wait(limits.timeout_s + _START_S)
        returncode = run.finish()
        data = sandbox.read_fd(reply, MAX_FRAME_BYTES + 8)
        stderr = _text(sandbox.read_fd(ferr, 1 << 20))[-_STDERR_TAIL:]
    if not in_time:
        return _Run("timeout", f"no answer within {limits.timeout_s:g} s (killed)", "", stderr)
    status, sig = _ended(returncode, iso)
    if sig is not None:
        outcome, detail = _signal_outcome(sig)
        return _Run(outcome, detail, "", stderr)
    try:
        message = loads_plain(data[8:]) if len(data) > 8 else None
    except ValueError as e:
        return _Run("error", f"the program sent {e}", "", stderr)
    if message is None:
        return _Run("error", f"the program exited (status {status}) before answering", "", stderr)
    run_ = _judge_answers(message, test)
    run_.stderr = stderr
    return run_


def _run_humaneval(iso: Isolation, problem: HumanEvalProblem, solution: str, limits: Limits) -> _Run:
    """The completion's definitions in one sandbox (answering calls), the dataset's test in another."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    procs: list[sandbox.Spawned] = []
    try:
        with sandbox.memfd("result") as result, sandbox.memfd("stderr") as err_program, \
                sandbox.memfd("stderr") as err_judge:  # fmt: skip
            root = sandbox.workdir(iso)
            serve = _spec("serve", limits, iso, root, code=solution, fn_name=problem.entry_point,
                          request_fd=req_r, reply_fd=rep_w)  # fmt: skip
            procs.append(_launch(iso, serve, limits, fds=(req_r, rep_w), stderr=err_program, workdir=root))
            root = sandbox.workdir(iso)
            judge = _spec("judge", limits, iso, root, prompt=problem.prompt, test=problem.test, fn_name=problem.entry_point,
                          request_fd=req_w, reply_fd=rep_r, result_fd=result)  # fmt: skip
            procs.append(_launch(iso, judge, limits, fds=(req_w, rep_r, result), stderr=err_judge, workdir=root))
            for fd in (req_r, req_w, rep_r, rep_w):
                os.close(fd)
            req_r = req_w = rep_r = rep_w = -1
            in_time = procs[1].wait(limits.timeout_s + 2 * _START_S)
            raw = sandbox.read_fd(result, 1 << 16)
            if in_time and b"exited before" in raw:  # the program is on its way out: let it finish dying, so
                procs[0].wait(_START_S)  # its own exit status (a CPU-limit signal) is the one read, not our kill
            program_rc = procs[0].finish()
            procs[1].finish()
            stderr = _text(sandbox.read_fd(err_program, 1 << 20))[-_STDERR_TAIL:]
            judged = _text(sandbox.read_fd(err_judge, 1 << 20)).strip()
            if judged:
                stderr = (stderr + ("\n" if stderr else "") + judged)[-_STDERR_TAIL:]
    finally:
        for fd in (req_r, req_w, rep_r, rep_w):
            if fd >= 0:
                os.close(fd)
        for proc in procs:
            proc.finish()
    if not in_time:
        return _Run("timeout", f"the tests did not finish within {limits.timeout_s:g} s (killed)", "", stderr)
    try:
        message = json.loads(raw.decode()) if raw else None
    except ValueError:
        message = None
    if not isinstance(message, dict) or message.get("outcome") not in STATUSES:
        return _Run("error", "the test harness failed", "", stderr)
    detail = str(message.get("detail", ""))
    status, sig = _ended(program_rc, iso)
    if message["outcome"] == "error" and "exited before" in detail:
        if sig is not None:
            outcome, what = _signal_outcome(sig)
            return _Run(outcome, what, "", stderr)
        detail = f"the program exited (status {status}) before the tests finished"
    return _Run(message["outcome"], detail, "", stderr)


def _isolation(unsafe: bool) -> Isolation:
    return sandbox.isolation(unsafe=unsafe)


def run_program(source: str, stdin: str = "", *, limits: Limits | None = None, unsafe: bool = False) -> RunResult:
    """Run ``source`` as a script (``__name__ == "__main__"``) with ``stdin`` as its standard input,
    in the sandbox (see the module docstring; ``unsafe=True`` runs it without isolation where
    bubblewrap is missing). ``status`` is ``ok`` when it exited with status 0."""
    limits = limits or Limits()
    if not isinstance(source, str):
        raise ValueError(f"source: expected the program text (str), got {type(source).__name__}")
    if not isinstance(stdin, str):
        raise ValueError(f"stdin: expected str, got {type(stdin).__name__}")
    iso = _isolation(unsafe)
    start = time.monotonic()
    run = _run_stdin_test(iso, source, "", stdin, None, limits)
    status = {"pass": "ok"}.get(run.outcome, run.outcome)
    return RunResult(status, run.stdout, run.stderr, time.monotonic() - start, run.detail, iso.tool)


def _tests_verdict(problem_id: str, difficulty: str, runs: Sequence[_Run], n_tests: int, seconds: float,
                   iso: Isolation) -> Verdict:  # fmt: skip
    status, detail, stderr = "pass", "", ""
    for i, run in enumerate(runs):
        if run.outcome != "pass" and status == "pass":
            status, stderr = run.outcome, run.stderr
            detail = f"test {i}: {run.detail}" if n_tests > 1 else run.detail
    if status == "pass" and runs:
        stderr = runs[-1].stderr
    return Verdict(problem_id=problem_id, difficulty=difficulty, passed=status == "pass", status=status,
                   seconds=round(seconds, 4), tests_total=n_tests, tests_run=len(runs),
                   tests_passed=sum(r.outcome == "pass" for r in runs), detail=detail, stderr=stderr,
                   isolation=iso.tool)  # fmt: skip


def check_humaneval(problem: HumanEvalProblem, completion: str, limits: Limits | None = None, *,
                    unsafe: bool = False) -> Verdict:  # fmt: skip
    """Run the completion's :func:`humaneval_solution` against the problem's test: pass iff
    ``check(entry_point)`` finishes within :attr:`Limits.timeout_s` without an exception (a failed
    assertion is ``fail``, anything else ``error``; a program that exits before the tests finish is
    an ``error``). The test runs in its own process and calls the solution's function across the
    sandbox boundary (see the module docstring)."""
    limits = limits or Limits()
    iso = _isolation(unsafe)
    start = time.monotonic()
    run = _run_humaneval(iso, problem, humaneval_solution(problem, completion), limits)
    return _tests_verdict(problem.id, problem.difficulty, [run], 1, time.monotonic() - start, iso)


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


def check_apps(problem: AppsProblem, completion: str, limits: Limits | None = None, *, unsafe: bool = False) -> Verdict:
    """Run an APPS completion against the problem's tests (see the module docstring), one fresh
    sandboxed interpreter per test.

    Call-based tests of MapCoder rows store the arguments as text; :func:`arg_candidates` says
    how they are turned back into arguments. A problem without tests, or a call-based problem
    without a function name, gets an ``error`` verdict without running anything."""
    limits = limits or Limits()
    iso = _isolation(unsafe)
    tests = _apps_tests(problem, limits)
    if not tests:
        return Verdict(problem.id, problem.difficulty, False, "error", 0.0, detail="the problem has no tests",
                       isolation=iso.tool)  # fmt: skip
    if problem.call_based and not problem.fn_name:
        return Verdict(problem.id, problem.difficulty, False, "error", 0.0, len(tests),
                       detail="call-based problem without a function name", isolation=iso.tool)  # fmt: skip
    code = apps_program(problem, completion)
    if not code.strip():
        return Verdict(problem.id, problem.difficulty, False, "error", 0.0, len(tests), detail="no code in the completion",
                       isolation=iso.tool)  # fmt: skip
    start = time.monotonic()
    runs: list[_Run] = []
    for test in tests:
        if problem.call_based:
            run = _run_call_test(iso, code, problem.fn_name, test, limits)
        else:
            run = _run_stdin_test(iso, code, APPS_HEADER, test["input"], test["expected"], limits, capture=1 << 24)
        runs.append(run)
        if run.outcome != "pass" and limits.stop_on_failure:
            break
    return _tests_verdict(problem.id, problem.difficulty, runs, len(tests), time.monotonic() - start, iso)


def check(problem: AppsProblem | HumanEvalProblem, completion: str, limits: Limits | None = None, *,
          unsafe: bool = False) -> Verdict:  # fmt: skip
    """:func:`check_humaneval` or :func:`check_apps` by the problem's type.

    Raises:
        IsolationUnavailable: bubblewrap is missing or cannot start a sandbox here, and not ``unsafe``.
    """
    if not isinstance(completion, str):
        raise ValueError(f"completion: expected str, got {type(completion).__name__}")
    if isinstance(problem, HumanEvalProblem):
        return check_humaneval(problem, completion, limits, unsafe=unsafe)
    if isinstance(problem, AppsProblem):
        return check_apps(problem, completion, limits, unsafe=unsafe)
    raise ValueError(f"problem: expected an AppsProblem or a HumanEvalProblem, got {type(problem).__name__}")


def score(
    problems: Sequence[AppsProblem | HumanEvalProblem],
    completions: Sequence[str] | Mapping[str, str],
    *,
    limits: Limits | None = None,
    workers: int | None = None,
    progress: bool = True,
    desc: str = "tests",
    unsafe: bool = False,
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
        unsafe: run without kernel isolation where bubblewrap is missing (recorded in each verdict).

    Raises:
        ValueError: completions that do not match the problems, or a bad ``workers``.
        IsolationUnavailable: no bubblewrap, and not ``unsafe``.
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
    _isolation(unsafe)  # refuse before starting anything
    verdicts: list[Verdict | None] = [None] * len(problems)
    from tqdm.auto import tqdm

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        with tqdm(total=len(problems), desc=desc, disable=not progress) as bar:
            futures = {pool.submit(check, p, t, limits, unsafe=unsafe): i for i, (p, t) in enumerate(zip(problems, texts))}
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
