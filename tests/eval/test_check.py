"""Pass@1 of results files (eval.passk, ``specdec check``, ``specdec eval|sweep --check``): verdicts
written into the records, identical completions run once, resumption, the paired interval, the
report's pass@1 columns. Synthetic HumanEval-style problems; every sandboxed run is a real process
(~0.2 s), so the files are small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import execution as E
from eval import passk, stats
from eval.datasets import HumanEvalProblem
from specdec import cli

FAST = E.Limits(timeout_s=2.0, memory_mb=512)


def _problems() -> list[HumanEvalProblem]:
    add = HumanEvalProblem(
        "Synthetic/0", 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n', "add", "    return a + b\n",
        "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-4, 4) == 0\n")  # fmt: skip
    neg = HumanEvalProblem(
        "Synthetic/1", 'def neg(x: int) -> int:\n    """Return -x."""\n', "neg", "    return -x\n",
        "def check(candidate):\n    assert candidate(3) == -3\n")  # fmt: skip
    return [add, neg]


def _write_problems(path: Path) -> Path:
    rows = [{"task_id": p.id, "prompt": p.prompt, "entry_point": p.entry_point,
             "canonical_solution": p.canonical_solution, "test": p.test} for p in _problems()]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ADD_OK = "    return a + b\n"
ADD_CHAT = "Here it is:\n```python\ndef add(a, b):\n    return b + a\n```<|im_end|>"  # as the runner decodes it
ADD_BAD = "    return a - b\n"
NEG_OK = "    return -x\n"
NEG_BAD = "    return x\n"


def _rec(problem, method, text, t=None, drafter=None, **extra):
    rec = {"config_key": "k", "dataset": "humaneval", "problem_id": problem, "method": method, "tree_size": t,
           "new_tokens": 10, "wall_s": 1.0, "tokens_per_s": 10.0, "text": text, "token_ids": [1, 2], "error": None,
           "match": True, "first_divergence": None, "temperature": 0.0, "dtype": "bf16"}  # fmt: skip
    if drafter is not None:
        rec.update(drafter=drafter, drafter_label=drafter)
    rec.update(extra)
    return rec


def _records() -> list[dict]:
    return [
        {"config_key": "k", "kind": "warmup", "dataset": "humaneval", "problem_id": "Synthetic/0", "method": "hf",
         "tree_size": None, "wall_s": 0.5, "warmup_walls": [0.5], "error": None},
        _rec("Synthetic/0", "hf", ADD_OK), _rec("Synthetic/1", "hf", NEG_OK),
        _rec("Synthetic/0", "hf-static", ADD_OK), _rec("Synthetic/1", "hf-static", NEG_BAD),
        _rec("Synthetic/0", "specdec", ADD_CHAT, 4, "lookup"), _rec("Synthetic/1", "specdec", NEG_OK, 4, "lookup"),
        _rec("Synthetic/0", "specdec", ADD_BAD, 8, "lookup"),
        _rec("Synthetic/1", "specdec", None, 8, "lookup", error="RuntimeError: boom"),
    ]  # fmt: skip


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


@pytest.fixture
def calls(monkeypatch):
    """(problem id, completion) of every sandboxed check (the real ones run)."""
    seen = []
    real = E.check

    def counting(problem, completion, limits=None, *, unsafe=False):
        seen.append((problem.id, completion))
        return real(problem, completion, limits, unsafe=unsafe)

    monkeypatch.setattr(E, "check", counting)
    return seen


def test_completion_text_cuts_at_end_markers():
    assert passk.completion_text("x = 1\n```<|im_end|>") == "x = 1\n```"
    assert passk.completion_text("a<|endoftext|>b<|im_end|>") == "a"
    assert passk.completion_text("print('</s>')\n</s>") == "print('</s>')\n"  # only trailing </s> goes
    assert passk.completion_text("plain") == "plain"


def test_check_file_verdicts_shared_texts_and_untouched_lines(tmp_path, calls):
    path = _write(tmp_path / "r.jsonl", _records())
    before = _lines(path)
    res = passk.check_file(path, problems=_problems(), limits=FAST, workers=2, progress=False)
    # 7 timed records with text, 5 distinct (problem, completion) pairs: ADD_OK and NEG_OK are shared
    assert sorted(calls) == sorted({("Synthetic/0", ADD_OK), ("Synthetic/0", ADD_CHAT.replace("<|im_end|>", "")),
                                    ("Synthetic/0", ADD_BAD), ("Synthetic/1", NEG_OK), ("Synthetic/1", NEG_BAD)})
    assert (res.dataset, res.considered, res.checked, res.run, res.already, res.skipped) == ("humaneval", 7, 7, 5, 0, 2)
    assert res.statuses == {"pass": 5, "fail": 2} and res.written and res.path == path
    after = _lines(path)
    assert len(after) == len(before)
    got = {(r["problem_id"], r["method"], r["tree_size"]): (r.get("passed"), r.get("check_status")) for r in after[1:]}
    assert got == {
        ("Synthetic/0", "hf", None): (True, "pass"), ("Synthetic/1", "hf", None): (True, "pass"),
        ("Synthetic/0", "hf-static", None): (True, "pass"), ("Synthetic/1", "hf-static", None): (False, "fail"),
        ("Synthetic/0", "specdec", 4): (True, "pass"), ("Synthetic/1", "specdec", 4): (True, "pass"),
        ("Synthetic/0", "specdec", 8): (False, "fail"), ("Synthetic/1", "specdec", 8): (None, None),  # error record
    }  # fmt: skip
    assert "AssertionError" in after[4]["check_detail"] or "assertion" in after[4]["check_detail"]
    assert "passed" not in after[0]  # the warm-up record is left alone
    for old, new in zip(before, after):  # nothing else changed
        assert {k: v for k, v in new.items() if k not in ("passed", "check_status", "check_detail", "check_isolation")} == old
        assert new.get("check_isolation", "bubblewrap") == "bubblewrap"
    assert not list(tmp_path.glob(".r.jsonl.*"))  # no temporary file left behind


def test_rerun_skips_checked_records_reuses_identical_texts_and_recheck(tmp_path, calls):
    path = _write(tmp_path / "r.jsonl", _records())
    passk.check_file(path, problems=_problems(), limits=FAST, workers=2, progress=False, checkpoint_s=0)
    assert len(calls) == 5
    calls.clear()
    again = passk.check_file(path, problems=_problems(), limits=FAST, progress=False)
    assert calls == [] and (again.checked, again.already, again.run, again.written) == (0, 7, 0, False)
    # new records: one repeats a checked completion (its verdict is reused), one is new
    with open(path, "a") as f:
        f.write(json.dumps(_rec("Synthetic/0", "hf-lookup", ADD_BAD)) + "\n")
        f.write(json.dumps(_rec("Synthetic/1", "hf-lookup", "    return 0 - x\n")) + "\n")
    more = passk.check_file(path, problems=_problems(), limits=FAST, progress=False)
    assert calls == [("Synthetic/1", "    return 0 - x\n")] and (more.checked, more.run, more.already) == (2, 1, 7)
    lookup = [r for r in _lines(path) if r["method"] == "hf-lookup"]
    assert [(r["passed"], r["check_status"]) for r in lookup] == [(False, "fail"), (True, "pass")]
    calls.clear()
    redo = passk.check_file(path, problems=_problems(), limits=FAST, workers=2, progress=False, recheck=True)
    assert len(calls) == 6 and (redo.checked, redo.run, redo.already) == (9, 6, 0)


def test_check_interrupted_keeps_finished_verdicts(tmp_path, monkeypatch):
    path = _write(tmp_path / "r.jsonl", _records())
    done = []

    def flaky(problem, completion, limits=None, *, unsafe=False):
        if done:
            raise KeyboardInterrupt
        done.append(completion)
        return E.Verdict(problem.id, "humaneval", True, "pass", 0.1)

    monkeypatch.setattr(E, "check", flaky)
    with pytest.raises(KeyboardInterrupt):
        passk.check_file(path, problems=_problems(), workers=1, progress=False)
    recs = [r for r in _lines(path) if r.get("passed") is not None]
    assert recs and all(passk.completion_text(r["text"]) == done[0] for r in recs)


def test_pass_rows_and_paired_interval(tmp_path):
    path = _write(tmp_path / "r.jsonl", _records())
    res = passk.check_file(path, problems=_problems(), limits=FAST, workers=2, progress=False)
    rows = passk.pass_rows(res.records)
    by = {(r["method"], r["tree_size"]): r for r in rows}
    assert [(r["method"], r["tree_size"]) for r in rows] == [("hf", None), ("hf-static", None), ("specdec", 4),
                                                              ("specdec", 8)]  # fmt: skip
    assert all(r["reference"] == "hf-static" for r in rows) and by[("hf-static", None)]["diff"] is None
    hf = by[("hf", None)]
    assert (hf["checked"], hf["passed"], hf["pass_at_1"], hf["paired"], hf["better"], hf["worse"]) == (2, 2, 1.0, 2, 1, 0)
    want = stats.paired_diff_ci([True, True], [True, False], method="tango")
    assert (hf["diff"], hf["low"], hf["high"]) == pytest.approx((0.5, want.low, want.high))
    sp8 = by[("specdec", 8)]  # one problem only (the other raised): paired over it
    assert (sp8["checked"], sp8["pass_at_1"], sp8["paired"], sp8["diff"]) == (1, 0.0, 1, -1.0)
    assert by[("specdec", 4)]["drafter"] == "lookup"
    # the reference can be chosen; without hf-static the default is hf
    assert passk.pass_rows(res.records, "hf")[1]["diff"] == pytest.approx(-0.5)
    no_static = [r for r in res.records if r.get("method") != "hf-static"]
    assert {r["reference"] for r in passk.pass_rows(no_static)} == {"hf"}
    table = passk.format_pass_table(rows)
    assert "| hf | - | - | 2 | 2 | 100.0% | +50.0 |" in table and "Δ vs hf-static (pp)" in table
    with pytest.raises(ValueError, match="reference: no checked records of method 'hf-assisted'"):
        passk.pass_rows(res.records, "hf-assisted")
    with pytest.raises(ValueError, match="reference: method 'specdec' has a row per drafter / tree size"):
        passk.pass_rows(res.records, "specdec")


def test_check_file_errors(tmp_path):
    with pytest.raises(ValueError, match="results: no such file"):
        passk.check_file(tmp_path / "nope.jsonl", problems=_problems())
    path = _write(tmp_path / "r.jsonl", _records())
    with pytest.raises(ValueError, match=r"problems: 1 problem id\(s\) of .* not among the given problems \(1\)"):
        passk.check_file(path, problems=_problems()[:1], progress=False)
    with pytest.raises(ValueError, match="dataset: no apps records in"):
        passk.check_file(path, dataset="apps", problems=_problems())
    with pytest.raises(ValueError, match="dataset: expected one of 'apps', 'humaneval', 'mbpp', 'specbench', 'prompts', got 'codecontests'"):
        passk.check_file(path, dataset="codecontests", problems=_problems())
    with pytest.raises(ValueError, match="dataset: no mbpp records in"):
        passk.check_file(path, dataset="mbpp", problems=_problems())
    mixed = _write(tmp_path / "m.jsonl", [*_records(), _rec("7", "hf", "x", dataset="apps")])
    with pytest.raises(ValueError, match="dataset: .* holds records of apps and humaneval; check one at a time"):
        passk.check_file(mixed, problems=_problems())
    with pytest.raises(ValueError, match="workers: expected an int >= 1, got 0"):
        passk.check_file(path, problems=_problems(), workers=0)
    assert "passed" not in Path(path).read_text()  # nothing was written


# ------------------------------------------------------------------------------------------------
# the command line


def test_check_cli_then_report_only_shows_pass_at_1(tmp_path, capsys, calls):
    data = _write_problems(tmp_path / "he.jsonl")
    path = _write(tmp_path / "r.jsonl", _records())
    out = tmp_path / "checked.jsonl"
    assert cli.main(["check", str(path), "--data", str(data), "--workers", "2", "--timeout", "2",
                     "--out", str(out), "--no-progress"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "7 record(s) of humaneval checked (5 program(s) run, 2 shared an identical completion)" in text
    assert f"wrote {out}" in text and "| specdec | lookup | 8 | 1 | 0 | 0.0% | -100.0 |" in text
    assert "passed" not in path.read_text() and len(_lines(out)) == len(_records())  # --out: source untouched
    calls.clear()
    assert cli.main(["check", str(out), "--data", str(data), "--no-progress"]) == 0  # resumes: nothing to run
    assert calls == [] and "nothing new to check" in capsys.readouterr().out
    # the sweep's report reads the verdicts
    assert cli.main(["sweep", "--report-only", "--out", str(out)]) == 1  # 1: the record whose method raised
    table = capsys.readouterr().out
    head = [h.strip() for h in table.splitlines()[0].strip("|").split("|")]
    assert "pass@1" in head and "Δpass@1 vs hf-static pp (95% CI)" in head
    summary = json.loads((tmp_path / "checked.summary.json").read_text())
    rows = {(r["method"], r["tree_size"]): r for r in summary["rows"]}
    assert rows[("hf", None)]["pass_at_1"] == 1.0 and rows[("hf-static", None)]["pass_at_1"] == 0.5
    assert rows[("hf", None)]["pass_at_1_diff"] == pytest.approx(0.5)
    assert rows[("hf", None)]["pass_at_1_diff_low"] < 0.5 < rows[("hf", None)]["pass_at_1_diff_high"]
    assert rows[("hf-static", None)]["pass_at_1_diff"] is None and rows[("specdec", 8)]["pass_at_1"] == 0.0
    assert "pass_at_1_diff" in summary["definitions"]


@pytest.mark.parametrize("extra, message", [
    (["--dataset", "codecontests"], "argument --dataset: invalid choice: 'codecontests'"),
    (["--dataset", "mbpp"], "specdec check: error: --dataset: no mbpp records in"),
    (["--dataset", "apps"], "specdec check: error: --dataset: no apps records in"),
    (["--reference", "nope"], "specdec check: error: --reference: no checked records of method 'nope'"),
    (["--workers", "0"], "argument --workers: expected an int >= 1, got 0"),
    (["--timeout", "0"], "argument --timeout: expected a number in (0, inf), got 0"),
])  # fmt: skip
def test_check_cli_errors_are_one_line(tmp_path, capsys, extra, message):
    data = _write_problems(tmp_path / "he.jsonl")
    path = _write(tmp_path / "r.jsonl", _records())
    if "--reference" in extra:
        path = _write(tmp_path / "r.jsonl", [dict(r, passed=True, check_status="pass") for r in _records()])
    assert _code(["check", str(path), "--data", str(data), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_check_cli_unknown_ids_and_missing_file(tmp_path, capsys):
    data = _write_problems(tmp_path / "he.jsonl")
    path = _write(tmp_path / "r.jsonl", [*_records(), _rec("HumanEval/999", "hf", "x")])
    assert cli.main(["check", str(path), "--data", str(data), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec check: error: --data: 1 problem id(s) of") and "['HumanEval/999']" in err
    assert _code(["check", str(tmp_path / "nope.jsonl")]) == 2
    assert "argument RESULTS: no such file or directory" in capsys.readouterr().err


def _code(argv) -> int:
    """The exit status of ``specdec ARGV`` (argparse errors exit, library errors return 2)."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


# ------------------------------------------------------------------------------------------------
# --check in a tiny sweep (random tiny models: their completions fail, but each gets a verdict)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tests.eval import tiny

    root = tmp_path_factory.mktemp("tiny")
    target, draft = tiny.save_pair(root)
    data = tiny.apps_rows(root / "apps.jsonl", n=2)
    return {"target": str(target), "draft": str(draft), "data": str(data)}


def test_sweep_check_fills_passed(pair, tmp_path, capsys, calls):
    out = tmp_path / "s.jsonl"
    base = ["sweep", "--problems", "2", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", "tests.eval.tiny:make_drafter", "--tree-sizes", "4", "--methods", "specdec", "hf",
            "--max-new-tokens", "6", "--dtype", "fp32", "--device", "cpu", "--attn-impl", "torch", "--out", str(out),
            "--warmup", "0", "--no-progress", "--no-attn"]  # fmt: skip
    assert cli.main([*base, "--check", "--check-workers", "2", "--check-timeout", "2"]) == 0
    captured = capsys.readouterr()
    timed = [r for r in _lines(out) if r.get("kind") != "warmup"]
    assert len(timed) == 4 and all(r["check_status"] in E.STATUSES and r["passed"] is False for r in timed)
    # greedy fp32: specdec's text equals hf's, so each problem's completion ran once
    assert sorted(pid for pid, _ in calls) == ["100", "101"]
    assert "pass@1 check: 4 record(s) of apps checked (2 program(s) run" in captured.err
    assert "| pass@1 |" in captured.out.splitlines()[0].replace("pass@1 | Δ", "pass@1 |")
    summary = json.loads((tmp_path / "s.summary.json").read_text())
    assert {r["method"]: r["pass_at_1"] for r in summary["rows"]} == {"hf": 0.0, "specdec": 0.0}
    # a rerun resumes: nothing generated, nothing checked again
    calls.clear()
    assert cli.main([*base, "--check"]) == 0
    assert calls == [] and len(_lines(out)) == 4
    # --report-only --check on records without verdicts checks them, then reports
    _write(out, [{k: v for k, v in r.items() if k not in ("passed", "check_status", "check_detail")} for r in timed])
    assert cli.main(["sweep", "--report-only", "--check", "--out", str(out), "--data", pair["data"],
                     "--no-progress"]) == 0  # fmt: skip
    assert len(calls) == 2 and all(r.get("passed") is False for r in _lines(out))
    assert "| pass@1 |" in capsys.readouterr().out.splitlines()[0].replace("pass@1 | Δ", "pass@1 |")


# ------------------------------------------------------------------------------------------------
# several samples per record (--samples n): every sample checked, pass@k


def _sampled(problem, method, texts, t=None, drafter=None, **extra):
    """A record of ``specdec eval --samples n`` holding the completions ``texts``."""
    rec = _rec(problem, method, None, t, drafter, temperature=0.8, match=None, **extra)
    for key in ("text", "token_ids"):
        rec.pop(key)
    rec.update(num_samples=len(texts), sample_texts=list(texts), sample_new_tokens=[10] * len(texts),
               sample_token_ids=[[1, 2]] * len(texts), new_tokens=10 * len(texts))  # fmt: skip
    return rec


def test_check_file_runs_every_sample_once_per_distinct_text(tmp_path, capsys, calls):
    records = [
        _sampled("Synthetic/0", "hf", [ADD_OK, ADD_BAD, ADD_OK, ADD_CHAT]),
        _sampled("Synthetic/1", "hf", [NEG_OK, NEG_BAD, NEG_BAD, NEG_BAD]),
        _sampled("Synthetic/0", "specdec", [ADD_BAD] * 4, 4, "lookup"),
        _sampled("Synthetic/1", "specdec", [NEG_OK] * 4, 4, "lookup"),
    ]  # fmt: skip
    path = _write(tmp_path / "r.jsonl", records)
    res = passk.check_file(path, problems=_problems(), limits=FAST, workers=2, progress=False)
    assert len(calls) == len(set(calls)) == 5  # 16 completions, 5 distinct (problem, completion) pairs
    assert (res.considered, res.checked, res.completions, res.run) == (4, 4, 16, 5)
    assert res.statuses == {"pass": 8, "fail": 8}
    assert "4 record(s) of humaneval checked, 16 completions (5 program(s) run, 11 shared" in res.summary()
    got = _lines(path)
    assert [r["sample_passed"] for r in got] == [[True, False, True, True], [True, False, False, False],
                                                 [False] * 4, [True] * 4]  # fmt: skip
    assert [r["num_correct"] for r in got] == [3, 1, 0, 4] and all("passed" not in r for r in got)
    assert got[0]["sample_status"] == ["pass", "fail", "pass", "pass"]
    assert got[0]["sample_detail"][0] is None and "assert" in got[0]["sample_detail"][1].lower()
    assert [passk.record_counts(r) for r in got] == [(3, 4), (1, 4), (0, 4), (4, 4)]
    # resumable: nothing runs again; a single-sample record reuses a sample's verdict
    calls.clear()
    with open(path, "a") as f:
        f.write(json.dumps(_rec("Synthetic/1", "hf-static", NEG_BAD)) + "\n")
    again = passk.check_file(path, problems=_problems(), limits=FAST, progress=False)
    assert calls == [] and (again.already, again.checked, again.run) == (4, 1, 0)
    assert _lines(path)[-1]["passed"] is False and _lines(path)[-1]["check_status"] == "fail"
    # specdec check prints pass@1 per row with the samples per problem
    assert cli.main(["check", str(path), "--data", str(_write_problems(tmp_path / "he.jsonl")), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "| hf | - | - | 2 | 4 | 4 | 50.0% | [" in table and "| hf-static | - | - | 1 | 1 | 0 | 0.0% |" in table


def _checked(problem, method, correct, n=10, t=None, drafter=None):
    """A checked record of n samples, the first ``correct`` of them passing."""
    rec = _sampled(problem, method, [f"# sample {i}\n" for i in range(n)], t, drafter)
    rec.update(sample_passed=[i < correct for i in range(n)], num_correct=correct,
               sample_status=["pass" if i < correct else "fail" for i in range(n)])  # fmt: skip
    return rec


def _known_records():
    """Three problems, 10 samples each: hf-static c = 10, 5, 0; specdec c = 9, 5, 1; hf as hf-static."""
    recs = []
    for p, (base, spec) in enumerate([(10, 9), (5, 5), (0, 1)]):
        recs += [_checked(str(p), "hf", base), _checked(str(p), "hf-static", base),
                 _checked(str(p), "specdec", spec, t=4, drafter="lookup")]  # fmt: skip
    return recs


def test_pass_at_k_rows_from_known_correctness():
    rows = {r["method"]: r for r in passk.pass_rows(_known_records())}
    static, spec, hf = rows["hf-static"], rows["specdec"], rows["hf"]
    assert (static["checked"], static["samples"], static["completions"], static["passed"]) == (3, 10, 30, 15)
    assert static["pass_at_1"] == pytest.approx(0.5) and spec["pass_at_1"] == pytest.approx(0.5)
    # pass@10 with n = 10: 1 as soon as one sample is correct
    assert static["pass_at_10"] == pytest.approx(2 / 3) and spec["pass_at_10"] == pytest.approx(1.0)
    for r in rows.values():
        for k in (1, 10):
            assert r[f"pass_at_{k}_low"] <= r[f"pass_at_{k}"] <= r[f"pass_at_{k}_high"]
    # paired differences to hf-static: per-problem pass@1 -0.1, 0, +0.1; pass@10 0, 0, +1
    assert spec["diff"] == pytest.approx(0.0, abs=1e-12) and spec["low"] < 0 < spec["high"]
    assert spec["pass_at_10_diff"] == pytest.approx(1 / 3) and spec["pass_at_10_diff_low"] == pytest.approx(0.0)
    assert (spec["better"], spec["worse"]) == (1, 1)
    assert (hf["diff"], hf["low"], hf["high"]) == (0.0, 0.0, 0.0) and hf["pass_at_10_diff"] == 0.0  # identical
    assert static["diff"] is None and "pass_at_10_diff" not in static
    expect = stats.paired_diff_ci([0.9, 0.5, 0.1], [1.0, 0.5, 0.0], method="bootstrap")
    assert (spec["low"], spec["high"]) == pytest.approx((expect.low, expect.high))
    table = passk.format_pass_table(list(rows.values()))
    head = [h.strip() for h in table.splitlines()[0].strip("|").split("|")]
    assert head[:7] == ["method", "drafter", "t", "problems", "n", "correct", "pass@1"] and "pass@10" in head
    assert "| hf-static | - | - | 3 | 10 | 15 | 50.0% | [" in table
    # fewer than 10 samples: no pass@10
    four = [_checked("0", "hf-static", 2, n=4), _checked("1", "hf-static", 4, n=4)]
    (row,) = passk.pass_rows(four)
    assert (row["samples"], row["pass_at_1"], row.get("pass_at_10")) == (4, 0.75, None)
    assert "pass@10" not in passk.format_pass_table([row])


def test_report_has_pass_at_k_and_aggregate_tokens_per_s():
    from eval import report

    recs = _known_records()
    for r in recs:  # the specdec batches take twice as long as the baselines'
        r["wall_s"] = 2.0 if r["method"] == "specdec" else 1.0
    rows = {r["method"]: r for r in report.summarize(recs)}
    spec = rows["specdec"]
    assert spec["samples"] == 10 and spec["tokens_per_s"] == pytest.approx(3 * 100 / 6.0)  # every sample's tokens
    assert spec["speedup_vs_hf_static"] == pytest.approx(0.5)
    assert spec["pass_at_10"] == pytest.approx(1.0) and spec["pass_at_10_diff"] == pytest.approx(1 / 3)
    assert spec["pass_at_1_reference"] == "hf-static" and spec["pass_at_1_diff"] == pytest.approx(0.0, abs=1e-12)
    assert rows["hf-static"]["pass_at_10_low"] <= 2 / 3 <= rows["hf-static"]["pass_at_10_high"]
    table = report.format_table(list(rows.values()))
    head = [h.strip() for h in table.splitlines()[0].strip("|").split("|")]
    assert {"n", "pass@1", "pass@10", "Δpass@10 vs hf-static pp (95% CI)"} <= set(head)
    cells = dict(zip(head, (c.strip() for c in table.splitlines()[4].strip("|").split("|"))))
    assert cells["n"] == "10" and cells["pass@10"].startswith("100.0% [") and cells["Δpass@10 vs hf-static pp (95% CI)"]
    assert {"samples", "pass_at_10", "pass_at_10_diff_high"} <= set(report.COLUMNS)


def test_check_keeps_unscored_lines_byte_for_byte_and_a_truncated_line_in_place(tmp_path, capsys):
    data = _write_problems(tmp_path / "he.jsonl")
    path = tmp_path / "r.jsonl"
    lines = [json.dumps(r, indent=None) for r in _records()]
    lines[0] = json.dumps(_records()[0], indent=1).replace("\n", " ")  # an odd but valid format: kept as is
    torn = json.dumps(_rec("Synthetic/0", "hf", ADD_OK, note="killed"))[:57]  # a run killed mid-write
    path.write_text("\n".join(lines) + "\n" + torn)
    assert cli.main(["check", str(path), "--data", str(data), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "line(s) 10 not a complete record (left as they are, not checked)" in out
    after = path.read_text().split("\n")
    assert after[-1] == torn and after[0] == lines[0]  # the torn line and the unscored warm-up, untouched
    assert after[8] == lines[8]  # the error record (no text): not scored, not rewritten
    assert all(json.loads(a).get("check_isolation") == "bubblewrap" for a in after[1:8])


def test_check_without_bubblewrap_refuses_before_anything(tmp_path, capsys, monkeypatch):
    from eval import sandbox

    data = _write_problems(tmp_path / "he.jsonl")
    path = _write(tmp_path / "r.jsonl", _records())
    before = path.read_bytes()
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    assert cli.main(["check", str(path), "--data", str(data), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "apt-get install bubblewrap" in err[0] and "--unsafe-no-isolation" in err[0]
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["he.jsonl", "r.jsonl"]
    assert cli.main(["check", str(path), "--data", str(data), "--no-progress", "--unsafe-no-isolation"]) == 0
    assert {r.get("check_isolation") for r in _lines(path)[1:8]} == {"none"}
