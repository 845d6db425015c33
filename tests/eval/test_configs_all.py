"""``sweep --report-only --configs all``: records of several configurations of one file in one table
(e.g. HF baselines run with a draft model next to drafter rows run without one)."""

from __future__ import annotations

import json

import pytest

from eval import runner
from eval.config import EvalConfig
from eval.records import result_from_records
from tests.eval import tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny.pair_files(tmp_path_factory.mktemp("tiny"), n=2)


def _cfg(pair, out, **over) -> EvalConfig:
    return tiny.apps_config(pair, out, **{"problems": 2, **over})


def _report(pair, out, *extra) -> list[str]:
    return ["sweep", "--report-only", "--out", str(out), "--target", pair["target"], "--draft", pair["draft"],
            "--data", pair["data"], "--max-new-tokens", "6", "--dtype", "fp32", "--device", "cpu", "--no-attn",
            *extra]  # fmt: skip


def _rows(text: str) -> set[tuple[str, str]]:
    """(method, t) of each row of the printed table."""
    rows = set()
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) > 3 and cells[0] not in ("method", "---"):
            rows.add((cells[0], cells[2]))
    return rows


def test_all_reports_every_configuration_in_one_table(pair, tmp_path, capsys):
    from specdec import cli

    out = tmp_path / "r.jsonl"
    assert not runner.run_eval(_cfg(pair, out, methods=("specdec", "hf-static"))).failed
    # a second configuration (another attention setting: another key) adds HF prompt lookup
    # (no `hf` reference there: one table holds each problem's `hf` once, see the refusal below)
    cfg = _cfg(pair, out, methods=("hf-lookup",), attn_impl="auto", method_problems=(("hf", 0),))
    assert not runner.run_eval(cfg).failed
    keys = {json.loads(line)["config_key"] for line in out.read_text().splitlines()}
    assert len(keys) == 2
    capsys.readouterr()
    assert cli.main(_report(pair, out)) == 0  # the last configuration only, with a note naming the other
    got = capsys.readouterr()
    assert {m for m, _ in _rows(got.out)} == {"hf-lookup"} and "--configs all" in got.err
    assert cli.main(_report(pair, out, "--configs", "all")) == 0
    table = capsys.readouterr().out
    assert {m for m, _ in _rows(table)} == {"hf", "hf-static", "hf-lookup", "specdec"}
    lookup = next(line for line in table.splitlines() if line.startswith("| hf-lookup "))
    assert "x" in lookup.split("|")[13]  # its ratio to HF static, which ran under the other configuration
    # the same problem's `hf` reference timed under both configurations would count twice: refused
    assert not runner.run_eval(_cfg(pair, out, methods=("hf-lookup",), attn_impl="auto")).failed
    assert cli.main(_report(pair, out, "--configs", "all")) == 2
    assert "timed under configurations" in capsys.readouterr().err


def test_all_refuses_configurations_that_mean_different_things(pair, tmp_path, capsys):
    from specdec import cli

    out = tmp_path / "r.jsonl"
    assert not runner.run_eval(_cfg(pair, out, methods=("hf-static",), drafters=())).failed
    assert not runner.run_eval(_cfg(pair, out, methods=("hf-lookup",), drafters=(), max_new_tokens=5)).failed
    capsys.readouterr()
    assert cli.main(_report(pair, out, "--configs", "all")) == 2
    err = capsys.readouterr().err
    assert "configs: 'all' needs" in err and "'max_new_tokens', got 5, 6" in err


def _rec(key: str, problem: str, method: str = "hf-static", **over) -> dict:
    rec = {"config_key": key, "dataset": "apps", "target": "t", "max_new_tokens": 8, "temperature": 0.0, "seed": 0,
           "dtype": "fp32", "device": "cpu", "problem_id": problem, "method": method, "tree_size": None,
           "new_tokens": 8, "wall_s": 1.0, "token_ids": [1] * 8}  # fmt: skip
    rec.update(over)
    return rec


def test_all_checks_shared_fields_and_rows_timed_twice():
    recs = [_rec("a", "1"), _rec("b", "1", method="hf-lookup")]
    res = result_from_records(recs, "f.jsonl", configs="all")
    assert sorted(r["method"] for r in res.records) == ["hf-lookup", "hf-static"]
    assert [r["method"] for r in result_from_records(recs, "f.jsonl").records] == ["hf-lookup"]
    with pytest.raises(ValueError, match=r"configs: 'all' needs .* agree on 'max_new_tokens', got 8, 9"):
        result_from_records([_rec("a", "1"), _rec("b", "2", max_new_tokens=9)], "f.jsonl", configs="all")
    with pytest.raises(ValueError, match=r"configs: 'all' found .* under configurations a and b"):
        result_from_records([_rec("a", "1"), _rec("b", "1")], "f.jsonl", configs="all")
    # side records (warm-ups) are not rows: the same problem's warm-up under another key is fine
    warm = _rec("b", "1", kind="warmup", max_new_tokens=16)
    assert len(result_from_records([_rec("a", "1"), warm], "f.jsonl", configs="all").records) == 1
    with pytest.raises(ValueError, match=r"configs: expected 'last' or 'all', got 'every'"):
        result_from_records(recs, "f.jsonl", configs="every")


def test_configs_all_only_with_report_only(pair, tmp_path, capsys):
    from specdec import cli

    argv = ["sweep", "--out", str(tmp_path / "x.jsonl"), "--target", pair["target"], "--data", pair["data"],
            "--configs", "all", "--device", "cpu", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 2
    assert "--configs: 'all' only with --report-only" in capsys.readouterr().err
