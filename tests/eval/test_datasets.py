"""APPS loader (both row formats) and HumanEval: real files, tiny synthetic rows, malformed rows,
prompts through a chat template and without one."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from eval import datasets as D
from eval.datasets import AppsProblem, HumanEvalProblem, IOExample

SHARED_APPS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "apps" / "apps_selected150.jsonl"
needs_shared = pytest.mark.skipif(not SHARED_APPS.exists(), reason="../shared/data/apps is not beside this checkout")


def _mapcoder_row(**over):
    row = {
        "name": "17", "id": 17, "description": "Add two numbers.", "difficulty": "introductory",
        "starter_code": "def add(a, b):\n\t",
        "sample_io": [{"input": "[1, 2]", "output": [3]}],
        "test_list": "[{'input': '[2, 2]', 'output': [4]}, {'input': '[0, 5]', 'output': [5]}]",
    }  # fmt: skip
    row.update(over)
    return row


def _original_row(**over):
    row = {
        "problem_id": 4000, "question": "Read n and print n + 1.", "difficulty": "interview", "starter_code": "",
        "url": "https://example.org/4000",
        "input_output": json.dumps({"inputs": ["1\n", "41\n"], "outputs": ["2\n", "42\n"]}),
        "solutions": json.dumps(["print(int(input()) + 1)\n"]),
    }  # fmt: skip
    row.update(over)
    return row


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class FakeTokenizer:
    """A stand-in with (or without) a chat template, recording what it was asked."""

    def __init__(self, template: bool = True):
        self.chat_template = "{{ messages }}" if template else None
        self.calls = []

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        self.calls.append((messages, tokenize, add_generation_prompt))
        return "<s>" + "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}


# ------------------------------------------------------------------------------------------------
# the real 150-row file


@needs_shared
def test_real_mapcoder_file():
    problems = D.load_apps(SHARED_APPS)
    assert len(problems) == 150
    assert Counter(p.difficulty for p in problems) == {"introductory": 50, "interview": 52, "competition": 48}
    assert sum(p.call_based for p in problems) == 98
    assert all(p.source == "mapcoder" and p.question and p.tests for p in problems)
    assert all(6 <= len(p.tests) <= 50 for p in problems)
    first = problems[0]
    assert (first.id, first.fn_name, first.difficulty) == ("3554", "get_score", "introductory")
    assert first.examples[0] == IOExample("[1, 2, 3]", [100])
    stdin = next(p for p in problems if not p.call_based)
    assert stdin.fn_name is None and isinstance(stdin.tests[0].input, str)
    assert len(D.load_apps(SHARED_APPS, unique=True)) == 128


@needs_shared
def test_default_path_env_and_filters(monkeypatch):
    monkeypatch.delenv("SPECDEC_APPS", raising=False)
    assert D.default_apps_path() == SHARED_APPS.resolve()
    assert len(D.load_apps()) == 150
    comp = D.load_apps(difficulty="competition", limit=5)
    assert len(comp) == 5 and {p.difficulty for p in comp} == {"competition"}
    two = D.load_apps(difficulty=["introductory", "interview"])
    assert len(two) == 102
    assert D.load_apps(limit=0) == []
    assert [p.id for p in D.load_apps(limit=3)] == [p.id for p in D.load_apps()[:3]]
    monkeypatch.setenv("SPECDEC_APPS", "/nonexistent/apps.jsonl")
    with pytest.raises(ValueError, match=r"\$SPECDEC_APPS: expected an existing \.json or \.jsonl file"):
        D.load_apps()


# ------------------------------------------------------------------------------------------------
# synthetic rows of both formats


def test_both_formats_in_one_file(tmp_path):
    path = _jsonl(tmp_path / "mixed.jsonl", [_mapcoder_row(), _original_row(), _original_row(problem_id=4001, starter_code="class Solution:\n    def f(self, x):\n", input_output=json.dumps({"inputs": [[1]], "outputs": [2], "fn_name": "f"}))])
    a, b, c = D.load_apps(path)
    assert a == AppsProblem(
        id="17", difficulty="introductory", question="Add two numbers.", starter_code="def add(a, b):\n\t",
        fn_name="add", examples=(IOExample("[1, 2]", [3]),), tests=(IOExample("[2, 2]", [4]), IOExample("[0, 5]", [5])),
        source="mapcoder",
    )  # fmt: skip
    assert (b.id, b.source, b.call_based, b.fn_name) == ("4000", "apps", False, None)
    assert b.tests == (IOExample("1\n", "2\n"), IOExample("41\n", "42\n"))
    assert b.solutions == ("print(int(input()) + 1)\n",) and b.examples == ()
    assert (c.fn_name, c.call_based, c.tests) == ("f", True, (IOExample([1], 2),))


def test_json_list_file_and_rows_without_tests(tmp_path):
    path = tmp_path / "apps.json"
    path.write_text(json.dumps([_original_row(input_output="", solutions="")]))
    (p,) = D.load_apps(path)
    assert p.tests == () and p.solutions == ()
    rows = [_original_row(), _mapcoder_row()]
    assert [q.id for q in D.parse_apps_rows(rows)] == ["4000", "17"]


@pytest.mark.parametrize(
    "row, match",
    [
        (_mapcoder_row(description=None), r"line 2 \(id 17\): missing field 'description' \(MapCoder"),
        ({k: v for k, v in _mapcoder_row().items() if k != "test_list"}, r"line 2 \(id 17\): missing field 'test_list'"),
        (_mapcoder_row(sample_io="[{'input': '1'"), r"line 2 \(id 17\): field 'sample_io' is not a valid Python literal"),
        (_mapcoder_row(test_list="[{'input': '1'}]"), r"line 2 \(id 17\): field 'test_list'\[0\]: expected a dict with 'input' and 'output'"),
        (_mapcoder_row(test_list="{'input': 1}"), r"field 'test_list': expected a list of"),
        (_mapcoder_row(difficulty="hard"), r"line 2 \(id 17\): field 'difficulty': expected one of introductory, interview, competition, got 'hard'"),
        ({k: v for k, v in _original_row().items() if k != "difficulty"}, r"line 2 \(id 4000\): missing field 'difficulty' \(original APPS"),
        (_original_row(input_output="{not json"), r"line 2 \(id 4000\): field 'input_output' is not valid JSON"),
        (_original_row(input_output=json.dumps({"inputs": ["1"], "outputs": []})), r"expected lists 'inputs' and 'outputs' of equal length, got list of 1 and list of 0"),
        (_original_row(solutions=json.dumps([1])), r"field 'solutions': expected a JSON list of strings"),
        ({"id": 5, "prompt": "x"}, r"line 2 \(id 5\): unknown row format: expected the original APPS fields .* got fields \['id', 'prompt'\]"),
        ([1, 2], r"line 2: expected a JSON object \(an APPS row\), got list"),
        ("{oops", r"line 2: not valid JSON"),
    ],
)
def test_malformed_rows_name_the_row_and_field(tmp_path, row, match):
    path = _jsonl(tmp_path / "bad.jsonl", [_mapcoder_row(), row])
    with pytest.raises(ValueError, match=match):
        D.load_apps(path)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"path: expected an existing \.json or \.jsonl file of APPS rows or a hub dataset id, got '.*missing\.jsonl'"):
        D.load_apps(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match=r"path: expected an existing"):
        D.load_apps(tmp_path)  # a directory
    good = _jsonl(tmp_path / "ok.jsonl", [_mapcoder_row()])
    with pytest.raises(ValueError, match=r"difficulty: expected one or more of introductory, interview, competition, got \['easy'\]"):
        D.load_apps(good, difficulty="easy")
    with pytest.raises(ValueError, match=r"limit: expected None or an int >= 0, got -1"):
        D.load_apps(good, limit=-1)
    with pytest.raises(ValueError, match=r"dataset: expected one of 'apps', 'humaneval', 'mbpp', 'specbench', 'prompts', got 'codecontests'"):
        D.load_problems("codecontests")
    with pytest.raises(ValueError, match=r"json list of rows|expected a JSON list of rows, got dict"):
        (tmp_path / "obj.json").write_text('{"a": 1}')
        D.load_apps(tmp_path / "obj.json")


# ------------------------------------------------------------------------------------------------
# prompts


def test_chat_prompt_uses_the_template_and_falls_back():
    call, stdin = D.parse_apps_rows([_mapcoder_row(), _original_row()])
    tok = FakeTokenizer()
    text = D.chat_prompt(call, tok)
    (messages, tokenize, gen), = tok.calls
    assert tokenize is False and gen is True and [m["role"] for m in messages] == ["user"]
    assert "Add two numbers." in text and "def add(a, b):" in text and text.endswith("<assistant>")
    assert "standard input" in D.chat_prompt(stdin, tok)
    assert D.prompt_ids(call, tok) == [ord(c) for c in text]  # the template's own specials, no extra BOS
    plain = FakeTokenizer(template=False)
    assert D.chat_prompt(call, plain) == call.plain_prompt() == D.chat_prompt(call, None)
    assert "Use Call-Based format" in call.plain_prompt() and "Use Standard Input format" in stdin.plain_prompt()
    assert D.prompt_ids(stdin, plain)[0] == 1  # plain prompts get the tokenizer's BOS


# ------------------------------------------------------------------------------------------------
# HumanEval


def test_humaneval_from_the_package():
    problems = D.load_humaneval()
    assert len(problems) == 164
    first = problems[0]
    assert isinstance(first, HumanEvalProblem)
    assert (first.id, first.entry_point) == ("HumanEval/0", "has_close_elements")
    assert "def has_close_elements" in first.prompt and "def check(candidate)" in first.test
    assert first.plain_prompt() == first.prompt
    assert first.prompt.strip() in D.chat_prompt(first, FakeTokenizer())
    assert len(D.load_problems("humaneval", limit=3)) == 3


def test_humaneval_malformed(tmp_path):
    row = {"task_id": "X/1", "prompt": "def f():\n", "entry_point": "f", "canonical_solution": "  pass\n"}
    path = _jsonl(tmp_path / "he.jsonl", [row])
    with pytest.raises(ValueError, match=r"he\.jsonl: line 1 \(id X/1\): missing field 'test' \(HumanEval format\)"):
        D.load_humaneval(path)
    with pytest.raises(ValueError, match="path: expected an existing HumanEval"):
        D.load_humaneval(tmp_path / "nope.jsonl")


def _qwen_converted() -> bool:
    from specdec import models

    return models.is_converted("qwen2.5-coder-0.5b")


@needs_shared
@pytest.mark.skipif(not _qwen_converted(), reason="qwen2.5-coder-0.5b is not converted in $SPECDEC_HOME (specdec models fetch)")
def test_qwen_chat_prompts_on_real_problems():
    from specdec import models

    tok = models.load_tokenizer("qwen2.5-coder-0.5b", progress=False)
    problems = D.load_apps(SHARED_APPS, difficulty="interview", limit=4) + D.load_humaneval(limit=2)
    for p in problems:
        text = D.chat_prompt(p, tok)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        ids = D.prompt_ids(p, tok)
        assert ids == tok.apply_chat_template(p.messages(), tokenize=True, add_generation_prompt=True, return_dict=False)
        assert 50 < len(ids) < 4000
