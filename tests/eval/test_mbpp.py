"""MBPP as a tuning dataset: rows -> HumanEval-shaped problems, the real file, the HumanEval checking
path on its reference code, and ``--dataset mbpp`` through the config and the CLI parsers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import datasets as D
from eval import execution as E
from eval import passk
from eval.config import EvalConfig
from eval.prompts import load_eval_problems

SHARED_MBPP = (Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "mbpp" / "mbpp.jsonl").resolve()
needs_mbpp = pytest.mark.skipif(not SHARED_MBPP.exists(), reason="../shared/data/mbpp is not beside this checkout")
FAST = E.Limits(timeout_s=5.0, memory_mb=512)
#: task ids of the shared file that cannot be HumanEval problems: their code defines ``check``
SKIPPED = ("56", "349", "899", "967")


def _row(**over):
    row = {
        "task_id": 7, "text": "Write a function to add R to a number.",
        "code": "R = 3\r\ndef helper(x):\r\n  return x\r\ndef add_r(n): \r\n  return helper(n) + R",
        "test_setup_code": "", "test_list": ["assert add_r(1) == 4", "assert add_r(2)==5"], "challenge_test_list": [],
    }  # fmt: skip
    row.update(over)
    return row


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------
# rows -> problems


def test_row_becomes_a_humaneval_problem():
    p = D.mbpp_problem(_row())
    assert (p.id, p.entry_point, p.dataset, p.difficulty) == ("MBPP/7", "add_r", "mbpp", "mbpp")
    # the prelude (constant, helper) before the stub; a docstring with the text and the first test only
    assert p.prompt == (
        'R = 3\ndef helper(x):\n  return x\n\n\ndef add_r(n):\n'
        '    """Write a function to add R to a number.\n    >>> add_r(1)\n    4\n    """\n'
    )
    assert p.canonical_solution == _row()["code"].replace("\r", "") + "\n"
    assert p.test == "def check(candidate):\n    assert add_r(1) == 4\n    assert add_r(2)==5\n"
    assert "add_r(2)" not in p.plain_prompt() and p.prompt.strip() in p.messages()[0]["content"]
    assert E.check(p, p.canonical_solution, FAST).passed
    assert E.check(p, "    return helper(n) + R\n", FAST).passed  # a plain completion of the stub
    assert E.check(p, "```python\ndef add_r(n):\n    return n + 3\n```", FAST).passed  # a chat answer
    assert E.check(p, "    return None\n", FAST).status == "fail"


def test_setup_code_runs_inside_check():
    row = _row(code="class Box:\n  def __init__(self, v): self.v = v\ndef unbox(b):\n  return b.v",
               test_setup_code="b = Box(2)\r\nc = Box(5)", test_list=["assert unbox(b) == 2", "assert unbox(c) == 5"])  # fmt: skip
    p = D.mbpp_problem(row)
    assert p.test == "def check(candidate):\n    b = Box(2)\n    c = Box(5)\n    assert unbox(b) == 2\n    assert unbox(c) == 5\n"
    assert p.prompt.startswith("class Box:") and E.check(p, p.canonical_solution, FAST).passed


def test_rows_without_an_entry_point_are_skipped_with_a_warning(tmp_path):
    rows = [_row(), _row(task_id=8, code="x = 1", test_list=["assert x == 1"]),
            _row(task_id=9, code="def check(n):\n  return n > 0", test_list=["assert check(1) == True"]),
            _row(task_id=10)]  # fmt: skip
    path = _jsonl(tmp_path / "mbpp.jsonl", rows)
    with pytest.warns(UserWarning, match=r"MBPP: skipped 2 row\(s\) of .*mbpp\.jsonl .*: task_id 8, 9$"):
        problems = D.load_mbpp_problems(path)
    assert [p.id for p in problems] == ["MBPP/7", "MBPP/10"]
    assert [p.id for p in D.load_problems("mbpp", path, limit=1)] == ["MBPP/7"]
    assert D.mbpp_problem(_row(test_list=[])) is None


def test_errors(tmp_path, monkeypatch):
    bad = _row()
    del bad["code"]
    path = _jsonl(tmp_path / "bad.jsonl", [_row(), bad])
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 1 \(task_id 7\): missing field 'code' \(MBPP format\)"):
        D.load_mbpp_problems(path)
    with pytest.raises(ValueError, match=r"row \(task_id 7\): field 'test_list': expected a list of asserts, got str"):
        D.mbpp_problem(_row(test_list="assert add_r(1) == 4"))
    with pytest.raises(ValueError, match=r"path: expected the MBPP jsonl file .*nope\.jsonl"):
        D.load_problems("mbpp", tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"difficulty: MBPP has no difficulty levels, got 'interview'"):
        D.load_problems("mbpp", path, difficulty="interview")
    with pytest.raises(ValueError, match=r"limit: expected None or an int >= 0, got -1"):
        D.load_mbpp_problems(path, limit=-1)
    # the default path: $SPECDEC_MBPP, as train-medusa resolves it
    monkeypatch.setenv("SPECDEC_MBPP", str(_jsonl(tmp_path / "env.jsonl", [_row(task_id=3)])))
    assert [p.id for p in D.load_problems("mbpp")] == ["MBPP/3"]


# ------------------------------------------------------------------------------------------------
# the real file


@pytest.fixture(scope="module")
def mbpp():
    if not SHARED_MBPP.exists():
        pytest.skip("../shared/data/mbpp is not beside this checkout")
    with pytest.warns(UserWarning, match=f"skipped {len(SKIPPED)} row"):
        return D.load_mbpp_problems(SHARED_MBPP)


@needs_mbpp
@pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")  # the reference regexes
def test_real_file_problems(mbpp):
    assert len(mbpp) >= 970
    assert len({p.id for p in mbpp}) == len(mbpp) and all(p.id.startswith("MBPP/") for p in mbpp)
    assert not {f"MBPP/{t}" for t in SKIPPED} & {p.id for p in mbpp}
    for p in mbpp:
        assert f"def {p.entry_point}(" in p.prompt, p.id
        assert p.test.startswith("def check(candidate):\n") and p.entry_point in p.test, p.id
        compile(p.prompt, p.id, "exec")
    by_id = {p.id: p for p in mbpp}
    assert by_id["MBPP/1"].prompt.startswith("R = 3\nC = 3\n") and by_id["MBPP/1"].entry_point == "min_cost"
    assert "root = Node(1)" in by_id["MBPP/367"].test  # test_setup_code


@needs_mbpp
@pytest.mark.filterwarnings("ignore:invalid escape sequence:DeprecationWarning")
def test_real_file_sample_checks_through_the_humaneval_path(mbpp):
    ids = {"MBPP/1", "MBPP/367", "MBPP/927"}  # a prelude constant; setup code using a prelude class
    sample = [p for i, p in enumerate(mbpp) if i % 57 == 0 or p.id in ids][:20]
    assert len(sample) == 20
    good = E.score(sample, [p.canonical_solution for p in sample], limits=FAST, workers=8, progress=False)
    assert [(v.problem_id, v.status) for v in good if not v.passed] == []
    assert all(v.difficulty == "mbpp" for v in good)
    wrong = E.score(sample, {p.id: "    return None\n" for p in sample}, limits=FAST, workers=8, progress=False)
    assert sum(not v.passed for v in wrong) >= 18


# ------------------------------------------------------------------------------------------------
# config and CLI


def test_config_and_cli_accept_mbpp(tmp_path):
    from specdec.cli import check as check_cli
    from specdec.cli import evaluate

    assert EvalConfig(dataset="mbpp", out=str(tmp_path / "r.jsonl")).dataset == "mbpp"
    with pytest.raises(ValueError, match=r"dataset: expected one of 'apps', 'humaneval', 'mbpp', 'specbench', 'prompts', got 'mbpp2'"):
        EvalConfig(dataset="mbpp2")
    assert evaluate.parser("specdec sweep", sweep=True).parse_args(["--dataset", "mbpp"]).dataset == "mbpp"
    assert evaluate.parser("specdec eval", sweep=False).parse_args(["mbpp"]).dataset == "mbpp"
    results = tmp_path / "r.jsonl"
    results.write_text("")
    assert check_cli.parser().parse_args([str(results), "--dataset", "mbpp"]).dataset == "mbpp"
    assert "tuning" in evaluate.parser("specdec sweep", sweep=True).format_help()


def test_eval_and_check_load_mbpp(tmp_path):
    path = _jsonl(tmp_path / "mbpp.jsonl", [_row(task_id=i) for i in range(1, 5)])
    cfg = EvalConfig(dataset="mbpp", data_path=str(path), problems=2, out=str(tmp_path / "r.jsonl"))
    chosen, pool = load_eval_problems(cfg)
    assert [p.id for p in chosen] == ["MBPP/1", "MBPP/2"] and len(pool) == 4
    with pytest.raises(ValueError, match="difficulty: MBPP has no difficulty levels"):
        load_eval_problems(EvalConfig(dataset="mbpp", data_path=str(path), difficulty=("interview",), out=cfg.out))
    assert sorted(passk.load_check_problems("mbpp", path)) == ["MBPP/1", "MBPP/2", "MBPP/3", "MBPP/4"]
    with pytest.raises(ValueError, match=r"data: expected the MBPP jsonl file"):
        passk.load_check_problems("mbpp", tmp_path / "nope.jsonl")
