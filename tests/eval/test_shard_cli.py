"""``specdec eval|sweep --shard``: each process runs its shard of the problems into its own file, and
``sweep --report-only --shards W`` reports the merged files as one run (``eval.shard``)."""

from __future__ import annotations

import json

import pytest

from eval.config import EvalConfig
from eval.records import is_warmup, record_key
from eval.shard import merge, shard_path, shard_paths
from tests.eval import tiny

N = 4  # problem ids 100..103 at positions 0..3: shard 0 of 2 holds 100, 102; shard 1 holds 101, 103


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target, draft = tiny.save_pair(root)
    return {"target": str(target), "draft": str(draft), "data": str(tiny.apps_rows(root / "apps.jsonl", n=N))}


def _argv(pair, out, *extra) -> list[str]:
    return ["sweep", "--target", pair["target"], "--draft", pair["draft"], "--drafters",
            "tests.eval.tiny:make_drafter", "--tree-sizes", "4", "--problems", str(N), "--data", pair["data"], "--max-new-tokens", "6", "--dtype",
            "fp32", "--device", "cpu", "--attn-impl", "torch", "--warmup", "0", "--no-progress", "--no-attn",
            "--methods", "hf-static", "specdec", "--method-problems", "hf-static=3", "--out", str(out), *extra]  # fmt: skip


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _timed(recs) -> dict:
    return {record_key(r): r for r in recs if not is_warmup(r)}


_SAME = ("problem_id", "problem_index", "method", "drafter", "tree_size", "token_ids", "match", "prompt_len")


@pytest.fixture(scope="module")
def runs(pair, tmp_path_factory):
    """One unsharded sweep, then shard 0/2 and shard 1/2 of the same sweep one after the other."""
    from specdec import cli

    root = tmp_path_factory.mktemp("runs")
    single, sharded = root / "single.jsonl", root / "dp.jsonl"
    assert cli.main(_argv(pair, single)) == 0
    for rank in range(2):
        assert cli.main(_argv(pair, sharded, "--shard", f"{rank}/2")) == 0
    return single, sharded


def test_shards_hold_disjoint_problems_and_together_the_single_runs_records(runs):
    single, sharded = runs
    files = [shard_path(sharded, r, 2) for r in range(2)]
    assert [f.name for f in files] == ["dp.rank0-of-2.jsonl", "dp.rank1-of-2.jsonl"]
    assert not sharded.exists()  # only the shard files are written
    per = [_timed(_records(f)) for f in files]
    pids = [{k[2] for k in p} for p in per]
    assert pids == [{"100", "102"}, {"101", "103"}]
    assert not set(per[0]) & set(per[1])
    want = _timed(_records(single))
    got = {**per[0], **per[1]}
    assert set(got) == set(want)
    # method_problems counts in the whole problem list: hf-static on 100, 101, 102 (101 in shard 1)
    assert sorted(k[2] for k in got if k[3] == "hf-static") == ["100", "101", "102"]
    for k, rec in want.items():
        assert {f: got[k].get(f) for f in _SAME} == {f: rec.get(f) for f in _SAME}, k


def test_report_only_merges_the_shards_into_one_table(pair, runs, capsys):
    from specdec import cli

    single, sharded = runs
    capsys.readouterr()
    assert cli.main(_argv(pair, single, "--report-only")) == 0
    assert cli.main(_argv(pair, sharded, "--report-only", "--shards", "2")) == 0
    out = capsys.readouterr().out
    assert "hf-static" in out and "specdec" in out

    def rows(stem):
        doc = json.loads((stem.parent / f"{stem.stem}.summary.json").read_text())
        return {(r["method"], r["drafter"], r["tree_size"]): (r["problems"], r["errors"], r["compared"], r["matches"])
                for r in doc["rows"]}  # fmt: skip

    assert rows(sharded) == rows(single)
    assert (sharded.parent / "dp.csv").exists()


def test_resuming_a_shard_recomputes_nothing(pair, runs, capsys, monkeypatch):
    from specdec import cli

    _, sharded = runs
    f0 = shard_path(sharded, 0, 2)
    before = f0.read_text()
    capsys.readouterr()
    assert cli.main(_argv(pair, sharded, "--shard", "0/2")) == 0
    out = capsys.readouterr().out
    assert "0 new record(s)" in out and "partial table" in out
    assert f0.read_text() == before
    # --shard auto reads the place from torchrun's environment: rank 1 of 2 resumes its own file
    f1 = shard_path(sharded, 1, 2)
    before = f1.read_text()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert cli.main(_argv(pair, sharded, "--shard", "auto")) == 0
    assert "0 new record(s)" in capsys.readouterr().out
    assert f1.read_text() == before


def _item(rec) -> tuple:
    return rec.get("problem_id"), rec.get("method"), rec.get("tree_size")


@pytest.mark.parametrize("redo", [False, True])
def test_a_changed_problem_list_recomputes_nothing_any_shard_holds(pair, tmp_path, capsys, redo):
    """Assignment by position: a resumed run with another problem list gives a problem to another
    shard than the one that ran it. That shard skips what the other shard files hold (the reference
    too), writes only what it runs, and the merged files equal one process's file after the same two
    runs. ``redo``: the moved problem's record is an error, which its new shard redoes."""
    from specdec import cli

    single, sharded = tmp_path / "single.jsonl", tmp_path / "dp.jsonl"
    common = ("--methods", "hf", "specdec", "--method-problems", "hf=4")
    first = (*common, "--difficulty", "introductory")  # 100, 102: shard 0 holds 100, shard 1 holds 102
    second = (*common, "--tree-sizes", "4", "8")  # 100..103: 102 moves to shard 0; t = 8 is new for all
    files = shard_paths(sharded, 2)
    assert cli.main(_argv(pair, single, *first)) == 0
    for rank in range(2):
        assert cli.main(_argv(pair, sharded, *first, "--shard", f"{rank}/2")) == 0
    assert [{k[2] for k in _timed(_records(f))} for f in files] == [{"100"}, {"102"}]
    moved = ("102", "specdec", 4)
    if redo:  # the moved problem's t = 4 record failed in the first run (in the single file, likewise)
        for path in (single, files[1]):
            recs = [dict(r, error="RuntimeError: injected") if _item(r) == moved else r for r in _records(path)]
            path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert cli.main(_argv(pair, single, *second)) == 0
    before = [_records(f) for f in files]
    with open(files[1], "a") as f:  # shard 1 is writing a record this moment
        f.write('{"config_key": "')
    partial = files[1].read_text()
    capsys.readouterr()
    assert cli.main(_argv(pair, sharded, *second, "--shard", "0/2")) == 0  # 100 and 102
    assert f"{3 if redo else 2} new record(s)" in capsys.readouterr().out
    assert files[1].read_text() == partial  # only read: the incomplete line is left to its own rank
    new = _records(files[0])[len(before[0]) :]
    want = [("100", "specdec", 8), ("102", "specdec", 8)] + ([moved] if redo else [])
    assert sorted(map(_item, new)) == sorted(want)
    # 102's reference is in shard 1's file: the new records are compared with it
    assert all(r["reference"] == "hf" and r["match"] is True for r in new)
    # 101 and 103, nothing of 102 (with redo: its error in this file, redone by shard 0, fails nothing)
    assert cli.main(_argv(pair, sharded, *second, "--shard", "1/2")) == 0
    assert {r["problem_id"] for r in _records(files[1])[len(before[1]) :]} == {"101", "103"}
    got, want = _timed(merge(files)), _timed(_records(single))
    assert set(got) == set(want) and len(want) == 4 + 4 * 2  # hf on 4 problems, specdec at 2 sizes on 4
    for k, rec in want.items():
        assert {f: got[k].get(f) for f in (*_SAME, "error")} == {f: rec.get(f) for f in (*_SAME, "error")}, k


def test_a_moved_second_turn_reuses_the_answer_to_its_first_from_another_shard(pair, tmp_path, monkeypatch):
    """Spec-Bench's second turns follow the target's answer to the first turn, kept as a context
    record by the shard that computed it: a second turn that moved to another shard reuses it from
    that shard's file (no new answer, no new record)."""
    from eval.methods import Session
    from specdec import cli

    rows = [{"question_id": 161, "category": "translation", "turns": ["Translate to German: good morning."]},
            {"question_id": 81, "category": "writing", "turns": ["Write a poem about the sea.", "Make it rhyme."]}]
    data = tmp_path / "question.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    answers = []
    real = Session.answer
    monkeypatch.setattr(Session, "answer", lambda self, prompt: answers.append(prompt.shape) or real(self, prompt))
    out = tmp_path / "sb.jsonl"
    argv = ["sweep", "--dataset", "specbench", "--data", str(data), "--problems", "0", "--turns", "2",
            "--target", pair["target"], "--draft", pair["draft"], "--methods", "hf", "--max-new-tokens", "5",
            "--device", "cpu", "--attn-impl", "torch", "--warmup", "0", "--no-progress", "--no-attn",
            "--out", str(out)]  # fmt: skip
    files = shard_paths(out, 2)
    for rank in range(2):  # 81, 81/turn2: shard 1 holds the second turn and answers the first
        assert cli.main([*argv, "--categories", "writing", "--shard", f"{rank}/2"]) == 0
    assert len(answers) == 1
    assert [r["problem_id"] for r in _records(files[1]) if r.get("kind") == "context"] == ["81"]
    before = [_records(f) for f in files]
    for rank in range(2):  # 161, 81, 81/turn2: the second turn moves to shard 0, 81 to shard 1
        assert cli.main([*argv, "--categories", "writing", "translation", "--shard", f"{rank}/2"]) == 0
    assert len(answers) == 1  # no second answer to the first turn
    assert _records(files[1]) == before[1]  # 81 is done, in shard 0's file
    new = _records(files[0])[len(before[0]) :]
    assert [(r["problem_id"], r["method"]) for r in new] == [("161", "hf")]


@pytest.mark.parametrize("bad", ["2/2", "x", "1/0", "-1/2", "0/2/3", "1", "/2"])
def test_bad_shard_values_are_one_line_errors(pair, tmp_path, capsys, bad):
    from specdec import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(_argv(pair, tmp_path / "r.jsonl", "--shard", bad))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--shard" in err and len(err.strip().splitlines()) == 1


def test_bad_environment_and_flag_combinations_name_the_flag(pair, tmp_path, capsys, monkeypatch):
    from specdec import cli

    out = tmp_path / "r.jsonl"
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(_argv(pair, out, "--shard", "auto")) == 2
    err = capsys.readouterr().err
    assert "--shard auto: RANK" in err and len(err.strip().splitlines()) == 1
    monkeypatch.delenv("RANK")
    assert cli.main(_argv(pair, out, "--shards", "2")) == 2  # not without --report-only
    assert "--shards" in capsys.readouterr().err
    assert cli.main(_argv(pair, out, "--report-only", "--shards", "2")) == 2  # no shard files
    assert "--shards" in capsys.readouterr().err
    assert cli.main(_argv(pair, out, "--report-only", "--shards", "2", "--shard", "0/2")) == 2
    assert "--shards" in capsys.readouterr().err


def test_config_validates_shard():
    assert EvalConfig(shard=(1, 2), out="r.jsonl").results_path == "r.rank1-of-2.jsonl"
    assert EvalConfig(shard=[0, 1], out="r.jsonl").results_path == "r.jsonl"  # one shard: out itself
    assert EvalConfig(out="r.jsonl").results_path == "r.jsonl"
    for bad in [(2, 2), (-1, 2), (0, 0), (0,), (True, 2), (0.0, 2), "0/2"]:
        with pytest.raises(ValueError, match="shard"):
            EvalConfig(shard=bad)
    with pytest.raises(ValueError, match="out"):
        EvalConfig(shard=(0, 2), out="r.rank0-of-2.jsonl")


def test_an_empty_shard_writes_nothing_and_loads_no_model(pair, tmp_path):
    from eval import runner

    cfg = EvalConfig(dataset="apps", target="/nonexistent", draft=None, drafters=("lookup",), methods=("hf-static",),
                     problems=1, data_path=pair["data"], device="cpu", out=str(tmp_path / "r.jsonl"),
                     progress=False, shard=(1, 2))  # fmt: skip
    res = runner.run_eval(cfg)  # problem 100 is in shard 0
    assert res.records == [] and res.new == 0 and not res.failed


def test_a_shard_sizes_its_caches_for_every_problem_of_the_run(pair, tmp_path, monkeypatch):
    """The capacity of a static cache sets the attention's KV split (bf16 rounding): a shard must size
    its caches as the whole run does, from the longest prompt of every shard, or its greedy tokens
    can differ from the unsharded run's."""
    import eval.runner as runner
    from specdec import cli

    rows = [json.loads(line) for line in open(pair["data"], encoding="utf-8")]
    rows[3]["description"] += " Read the input carefully, with many more words than the others." * 3
    data = tmp_path / "apps.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sessions = []

    class Recorded(runner.Session):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            sessions.append(self)

    monkeypatch.setattr(runner, "Session", Recorded)
    argv = [a if a != pair["data"] else str(data) for a in _argv(pair, tmp_path / "x.jsonl")]
    argv[argv.index("--methods") + 1 : argv.index("--methods") + 3] = ["specdec-plain"]
    assert cli.main(argv) == 0
    assert cli.main([*argv[:-1], str(tmp_path / "dp.jsonl"), "--shard", "0/2"]) == 0  # holds 100, 102 only
    whole, shard0 = sessions
    assert shard0.max_cache_len == whole.max_cache_len  # 103's prompt, in shard 1, sizes shard 0 too
    assert shard0.min_len == whole.min_len
