"""Prompts of an evaluation: the problems to run and few-shot padding to a long shared prompt.

:func:`load_eval_problems` picks the problems of an :class:`eval.config.EvalConfig`;
:func:`pad_problems` wraps each in a :class:`PaddedProblem` whose prompt starts with other problems of
the same dataset (every padded problem uses the same example order, so all prompts share their
leading examples) until it has at least ``pad_prompt_to`` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eval.config import EvalConfig

__all__ = ["PaddedProblem", "example_text", "load_eval_problems", "pad_problems"]


@dataclass(frozen=True)
class PaddedProblem:
    """A problem whose prompt starts with other problems of the same dataset (few-shot padding).

    Works with ``eval.datasets.chat_prompt`` / ``prompt_ids`` like the problem it wraps. Every
    padded problem uses the same example order, so all prompts share their leading examples.
    """

    base: Any
    examples: tuple[str, ...]

    @property
    def id(self) -> str:
        return self.base.id

    @property
    def difficulty(self) -> str:
        return self.base.difficulty

    def _preamble(self) -> str:
        if not self.examples:
            return ""
        body = "\n\n".join(self.examples)
        return f"Here are other problems, for reference only:\n\n{body}\n\n---\n\nNow the problem to solve.\n\n"

    def messages(self) -> list[dict[str, str]]:
        msgs = [dict(m) for m in self.base.messages()]
        msgs[0]["content"] = self._preamble() + msgs[0]["content"]
        return msgs

    def plain_prompt(self) -> str:
        return self._preamble() + self.base.plain_prompt()


def example_text(problem: Any, index: int) -> str:
    """One few-shot example: the statement and, where the dataset has one, a reference solution."""
    if hasattr(problem, "question"):  # APPS
        text = f"Example problem {index}:\n{problem.question.strip()}"
        if problem.starter_code.strip():
            text += f"\n```python\n{problem.starter_code.strip()}\n```"
        if problem.solutions:
            text += f"\nSolution:\n```python\n{problem.solutions[0].strip()}\n```"
        return text
    return f"Example {index}:\n```python\n{problem.prompt.rstrip()}\n{problem.canonical_solution.rstrip()}\n```"


def pad_problems(problems: Sequence[Any], pool: Sequence[Any], tokenizer: Any, pad_to: int) -> list[Any]:
    """Wrap each problem in a :class:`PaddedProblem` with the fewest leading examples of ``pool``
    (in order, skipping the problem itself) that make its prompt at least ``pad_to`` tokens.

    Raises ValueError when the pool runs out before a prompt reaches ``pad_to`` tokens.
    """
    from eval.datasets import prompt_ids

    out = []
    for problem in problems:
        examples: list[str] = []
        candidates = iter(p for p in pool if p.id != problem.id)
        padded = PaddedProblem(problem, ())
        while len(prompt_ids(padded, tokenizer)) < pad_to:
            nxt = next(candidates, None)
            if nxt is None:
                raise ValueError(
                    f"pad_prompt_to: {pad_to} tokens not reached for problem {problem.id} with all "
                    f"{len(examples)} other problems prepended ({len(prompt_ids(padded, tokenizer))} tokens)"
                )
            examples.append(example_text(nxt, len(examples) + 1))
            padded = PaddedProblem(problem, tuple(examples))
        out.append(padded)
    return out


def _first_questions(pool: Sequence[Any], n: int, across_categories: bool) -> list[str]:
    """Ids of ``n`` questions of ``pool`` (first turns; ``ChatProblem.context`` None): the first ``n``
    in file order, or with ``across_categories`` the categories' first questions taken in turn (a
    small Spec-Bench run covers every category picked), in file order."""
    firsts = [p for p in pool if p.context is None]
    if not across_categories:
        return [p.id for p in firsts[:n]]
    groups: dict[str, list[Any]] = {}
    for p in firsts:
        groups.setdefault(p.category, []).append(p)
    picked: set[str] = set()
    rank = 0
    while len(picked) < min(n, len(firsts)):
        for group in groups.values():
            if rank < len(group) and len(picked) < n:
                picked.add(group[rank].id)
        rank += 1
    return [p.id for p in firsts if p.id in picked]


def load_eval_problems(cfg: EvalConfig) -> tuple[list[Any], list[Any]]:
    """(problems to evaluate, pool of all problems for few-shot padding)."""
    from eval.datasets import CHAT_DATASETS, load_apps, load_problems

    if cfg.dataset == "apps":
        pool = load_apps(cfg.data_path, difficulty=cfg.difficulty, unique=True)
    elif cfg.dataset in CHAT_DATASETS:  # Spec-Bench (a second turn right after its first), prompt files
        pool = load_problems(cfg.dataset, cfg.data_path, categories=cfg.categories, turns=cfg.turns)
        if cfg.problems is not None:  # N questions, with their second turns
            keep = set(_first_questions(pool, cfg.problems, across_categories=cfg.dataset == "specbench"))
            chosen = [p for p in pool if (p.context.id if p.context is not None else p.id) in keep]
            return chosen, list(pool)
    else:  # HumanEval, or MBPP (tuning) in HumanEval's shape
        pool = load_problems(cfg.dataset, cfg.data_path, difficulty=cfg.difficulty or None)
    chosen = pool if cfg.problems is None else pool[: cfg.problems]
    if not chosen:
        raise ValueError(f"problems: no {cfg.dataset} problems left after filtering (difficulty={cfg.difficulty!r})")
    return list(chosen), list(pool)
