"""General-text workloads: a user's own prompt files and Spec-Bench.

Both give :class:`ChatProblem` s -- a conversation whose last user turn the model answers -- that
``eval.datasets.chat_prompt`` / ``prompt_ids`` turn into prompts like any other problem. They have
no tests: the evaluation measures speed and tau on them, never pass@1.

**Prompt files** (:func:`load_prompt_file`; ``specdec eval prompts --data FILE`` and
``specdec train-eagle|train-medusa --prompts FILE``):

* a ``.jsonl`` file, one JSON object a line, read here (errors name the file and line);
* a local ``datasets`` directory (``Dataset.save_to_disk``; a ``DatasetDict`` with one split or a
  ``train`` split), a ``.parquet`` file or a ``.json`` file (a list of rows, or JSON lines), read
  through ``datasets`` (errors name the file and row).

Each row is ``{"prompt": "..."}`` (one user turn) or ``{"messages": [{"role": ..., "content": ...},
...]}`` (a chat conversation, roles ``system`` / ``user`` / ``assistant``): the *last user turn* is
the one answered; the turns before it are context, and anything after it (a recorded answer) is
dropped. Optional fields: ``id`` (default: the line or row number) and ``category`` (default
``"prompts"``; the report has a row per category). A bad row raises ``ValueError`` naming the file,
the line (or row) and the field.

**Spec-Bench** (:func:`load_specbench`): ``question.jsonl`` of Xia et al. (2024), 480 rows
``{"question_id", "category", "turns": [...]}`` in :data:`SPECBENCH_CATEGORIES` (MT-bench's eight
kinds of 10 two-turn questions, then 80 one-turn questions each of translation, summarization,
qa, math_reasoning and rag). Where it comes from: the ``path`` argument, else
``$SPECDEC_SPECBENCH``, else ``../shared/data/specbench/question.jsonl`` beside the project root
(read in place, never copied). ``turns=1``: the first turn of every question; ``turns=2`` adds
the second turn of the two-turn questions, asked after the model's own answer to the first
(:attr:`ChatProblem.context`, filled in by the runner: ``ChatProblem.with_answer``). Evaluation
only: never train or tune on it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_DATASETS",
    "ROLES",
    "SHARED_DATA",
    "SPECBENCH_CATEGORIES",
    "ChatProblem",
    "data_path",
    "default_specbench_path",
    "load_prompt_file",
    "load_specbench",
    "parse_prompt_row",
    "prompt_file_rows",
]

#: The datasets of this module: general text, no tests (speed and tau only).
CHAT_DATASETS = ("specbench", "prompts")
#: Spec-Bench's categories in file order: MT-bench's eight (10 questions each, two turns), then
#: five of 80 one-turn questions.
SPECBENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
                        "translation", "summarization", "qa", "math_reasoning", "rag")  # fmt: skip
ROLES = ("system", "user", "assistant")
#: The category of prompt-file rows without one.
DEFAULT_CATEGORY = "prompts"
_SPECBENCH_ENV = "SPECDEC_SPECBENCH"
#: The shared data folder beside the project: ``<project root>/../shared/data``.
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@dataclass(frozen=True)
class ChatProblem:
    """A conversation to answer: its last message is the user turn the model answers.

    Attributes:
        id: a stable id (Spec-Bench: the ``question_id``, ``"<id>/turn2"`` for a second turn;
            prompt files: the row's ``id``, else its line or row number).
        turns: ``(role, content)`` pairs, the last one ``"user"``.
        category: the report's group (Spec-Bench's category; a prompt file's ``category`` field).
        context: an earlier problem whose prompt and *answer* come before ``turns`` (Spec-Bench's
            second turn follows the model's own answer to the first); None: none.
        answer: the model's answer to ``context`` (None until the runner fills it in,
            :meth:`with_answer`).
        turn: which user turn of the question this is (1 for a first turn).
    """

    id: str
    turns: tuple[tuple[str, str], ...]
    category: str = DEFAULT_CATEGORY
    context: ChatProblem | None = None
    answer: str | None = None
    turn: int = 1

    @property
    def difficulty(self) -> str:
        """The category (records keep it as ``difficulty``, as APPS records keep theirs)."""
        return self.category

    @property
    def needs_answer(self) -> bool:
        """Whether the model must answer :attr:`context` before this problem has a prompt."""
        return self.context is not None and self.answer is None

    def with_answer(self, answer: str) -> ChatProblem:
        """This problem with the model's answer to :attr:`context` filled in."""
        return replace(self, answer=answer)

    def messages(self) -> list[dict[str, str]]:
        """The chat messages: the context's, the answer to it, then :attr:`turns`."""
        msgs: list[dict[str, str]] = []
        if self.context is not None:
            if self.answer is None:
                raise ValueError(f"problem {self.id}: the answer to the earlier turn is not known yet (with_answer)")
            msgs = self.context.messages() + [{"role": "assistant", "content": self.answer}]
        return msgs + [{"role": role, "content": content} for role, content in self.turns]

    def plain_prompt(self) -> str:
        """A prompt for tokenizers without a chat template: ``Role: content`` paragraphs, then
        ``Assistant:``."""
        body = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in self.messages())
        return f"{body}\n\nAssistant:"

    def last_user(self) -> str:
        """The text of the user turn answered."""
        return self.turns[-1][1]


# ----------------------------------------------------------------------------------------------
# prompt files


def _text(value: Any, where: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        got = repr(value) if isinstance(value, str) else type(value).__name__
        raise ValueError(f"{where}: field {field!r}: expected a non-empty string, got {got}")
    return value


def _messages(value: Any, where: str) -> tuple[tuple[str, str], ...]:
    """``messages`` cut after its last user turn; ValueError naming the bad entry."""
    if not isinstance(value, (list, tuple)) or not value:
        got = "an empty list" if isinstance(value, (list, tuple)) else type(value).__name__
        raise ValueError(f"{where}: field 'messages': expected a non-empty list of {{'role', 'content'}} objects, "
                         f"got {got}")  # fmt: skip
    turns = []
    for i, m in enumerate(value):
        field = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{where}: field {field!r}: expected an object with 'role' and 'content', "
                             f"got {type(m).__name__}")  # fmt: skip
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}: field '{field}.role': expected one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{where}: field '{field}.content': expected a string, got {type(content).__name__}")
        turns.append((role, content))
    last = max((i for i, (role, _) in enumerate(turns) if role == "user"), default=None)
    if last is None:
        raise ValueError(f"{where}: field 'messages': expected at least one turn with role 'user', got roles "
                         f"{[r for r, _ in turns]}")  # fmt: skip
    _text(turns[last][1], where, f"messages[{last}].content")
    return tuple(turns[: last + 1])


def parse_prompt_row(row: Any, where: str, default_id: str) -> ChatProblem:
    """One prompt-file row -> :class:`ChatProblem` (``where`` names the file and line or row)."""
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object with 'prompt' or 'messages', got {type(row).__name__}")
    has_prompt, has_messages = row.get("prompt") is not None, row.get("messages") is not None
    if has_prompt == has_messages:
        raise ValueError(f"{where}: expected exactly one of the fields 'prompt' (a string) and 'messages' (a chat "
                         f"conversation), got {'both' if has_prompt else f'fields {sorted(row)}'}")  # fmt: skip
    turns = (("user", _text(row["prompt"], where, "prompt")),) if has_prompt else _messages(row["messages"], where)
    rid = row.get("id")
    if rid is not None and not isinstance(rid, (str, int)):
        raise ValueError(f"{where}: field 'id': expected a string or an int, got {type(rid).__name__}")
    category = row.get("category")
    if category is not None:
        _text(category, where, "category")
    return ChatProblem(str(default_id if rid is None else rid), turns, category or DEFAULT_CATEGORY)


def _jsonl_rows(path: Path) -> Iterator[tuple[Any, str, str]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            yield row, where, str(lineno)


def _datasets_rows(path: Path) -> Iterator[tuple[Any, str, str]]:
    """Rows of a ``datasets`` directory, a parquet file or a JSON file, through ``datasets``."""
    import datasets

    try:
        if path.is_dir():
            ds = datasets.load_from_disk(str(path))
        else:
            kind = "parquet" if path.suffix == ".parquet" else "json"
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # datasets' errors are many; say which file
        raise ValueError(f"{path}: could not be read through datasets ({type(e).__name__}: {' '.join(str(e).split())})") \
            from None  # fmt: skip
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) != 1 and "train" not in ds:
            raise ValueError(f"{path}: a DatasetDict with splits {splits}; expected one split or a 'train' split")
        ds = ds[splits[0] if len(splits) == 1 else "train"]
    for i, row in enumerate(ds):
        yield row, f"{path}: row {i}", str(i)


def prompt_file_rows(path: str | os.PathLike[str]) -> Iterator[tuple[Any, str, str]]:
    """``(row, where, default id)`` of a prompt file (see the module docstring)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ValueError(f"path: expected a .jsonl / .json / .parquet file or a datasets directory, got {str(p)!r}, "
                         "which does not exist")  # fmt: skip
    if p.is_file() and p.suffix == ".jsonl":
        return _jsonl_rows(p)
    if p.is_dir() or p.suffix in (".json", ".parquet"):
        return _datasets_rows(p)
    raise ValueError(f"path: expected a .jsonl / .json / .parquet file or a datasets directory, got {str(p)!r}")


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(f"limit: expected None or an int >= 0, got {limit!r}")


def _categories(categories: Iterable[str] | None, known: Sequence[str] | None) -> frozenset[str] | None:
    if categories is None:
        return None
    wanted = frozenset([categories] if isinstance(categories, str) else categories)
    bad = sorted(wanted - set(known)) if known is not None else []
    if not wanted or bad:
        raise ValueError(f"categories: expected one or more of {', '.join(known or ('the file',))}, got "
                         f"{bad or 'none'}")  # fmt: skip
    return wanted


def load_prompt_file(path: str | os.PathLike[str], *, categories: Iterable[str] | None = None,
                     limit: int | None = None) -> list[ChatProblem]:  # fmt: skip
    """The prompts of a prompt file, in file order (see the module docstring for the formats).

    Args:
        path: a ``.jsonl`` file, a ``.json`` / ``.parquet`` file or a ``datasets`` directory.
        categories: keep only rows of these categories (the rows' ``category`` fields).
        limit: keep at most this many prompts (after filtering).

    Raises:
        ValueError: a missing file, a bad row (naming the file, line or row, and field), two rows
            with one id, no prompt left, or a category no row has.
    """
    _check_limit(limit)
    wanted = _categories(categories, None)
    problems: list[ChatProblem] = []
    seen: dict[str, str] = {}
    cats: set[str] = set()
    for row, where, default_id in prompt_file_rows(path):
        problem = parse_prompt_row(row, where, default_id)
        if problem.id in seen:
            raise ValueError(f"{where}: field 'id': {problem.id!r} was already the id of {seen[problem.id]}")
        seen[problem.id] = where
        cats.add(problem.category)
        if wanted is not None and problem.category not in wanted:
            continue
        if limit is None or len(problems) < limit:
            problems.append(problem)
    if wanted is not None and wanted - cats:
        raise ValueError(f"categories: {sorted(wanted - cats)} not in {path} (its categories: {sorted(cats)})")
    if not problems and limit != 0:
        raise ValueError(f"path: no prompts in {path}")
    return problems


# ----------------------------------------------------------------------------------------------
# Spec-Bench


def data_path(env: str, *parts: str) -> Path:
    """A dataset file: ``$env`` if set (``~`` expanded), else ``SHARED_DATA`` / ``parts``."""
    value = os.environ.get(env)
    return Path(value).expanduser() if value else SHARED_DATA.joinpath(*parts)


def default_specbench_path() -> Path:
    """``$SPECDEC_SPECBENCH`` if set, else ``<project root>/../shared/data/specbench/question.jsonl``."""
    return data_path(_SPECBENCH_ENV, "specbench", "question.jsonl")


def _specbench_row(row: Any, where: str) -> tuple[str, str, tuple[str, ...]]:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: expected a JSON object (a Spec-Bench question), got {type(row).__name__}")
    for field in ("question_id", "category", "turns"):
        if row.get(field) is None:
            raise ValueError(f"{where}: missing field {field!r} (Spec-Bench format)")
    category = row["category"]
    if category not in SPECBENCH_CATEGORIES:
        raise ValueError(f"{where}: field 'category': expected one of {', '.join(SPECBENCH_CATEGORIES)}, got "
                         f"{category!r}")  # fmt: skip
    turns = row["turns"]
    if not isinstance(turns, list) or not turns:
        raise ValueError(f"{where}: field 'turns': expected a non-empty list of strings, got {type(turns).__name__}")
    for i, t in enumerate(turns):
        _text(t, where, f"turns[{i}]")
    return str(row["question_id"]), category, tuple(turns)


def load_specbench(path: str | os.PathLike[str] | None = None, *, categories: Iterable[str] | None = None,
                   turns: int = 1, limit: int | None = None) -> list[ChatProblem]:  # fmt: skip
    """Spec-Bench questions as :class:`ChatProblem` s, in file order.

    Args:
        path: the ``question.jsonl`` (default: :func:`default_specbench_path`).
        categories: keep only these of :data:`SPECBENCH_CATEGORIES`.
        turns: 1: the first turn of every question; 2: also the second turn of every question that
            has one (right after its first turn; a problem with ``context`` = the first turn, whose
            answer the runner fills in).
        limit: keep at most this many questions (after filtering; their second turns come along).

    Raises:
        ValueError: a missing file, a bad row (file:line and field), a repeated question id, an
            unknown category or a bad ``turns``.
    """
    _check_limit(limit)
    if turns not in (1, 2):
        raise ValueError(f"turns: expected 1 or 2, got {turns!r}")
    wanted = _categories(categories, SPECBENCH_CATEGORIES)
    p = Path(path).expanduser() if path is not None else default_specbench_path()
    if not p.is_file():
        raise ValueError(f"path: expected Spec-Bench's question.jsonl (--data or ${_SPECBENCH_ENV}), got {str(p)!r}, "
                         "which does not exist")  # fmt: skip
    problems: list[ChatProblem] = []
    seen: set[str] = set()
    questions = 0
    for row, where, _ in _jsonl_rows(p):
        qid, category, texts = _specbench_row(row, where)
        if qid in seen:
            raise ValueError(f"{where}: field 'question_id': {qid} appears twice")
        seen.add(qid)
        if (wanted is not None and category not in wanted) or (limit is not None and questions >= limit):
            continue
        questions += 1
        first = ChatProblem(qid, (("user", texts[0]),), category)
        problems.append(first)
        if turns == 2 and len(texts) > 1:
            problems.append(ChatProblem(f"{qid}/turn2", (("user", texts[1]),), category, context=first, turn=2))
    return problems
