"""``EvalConfig.method_problems``: slow references on a stated subset, the rest on every problem."""

from __future__ import annotations

import json

import pytest

from eval import config as C
from eval import runner
from eval.config import EvalConfig
from tests.eval import tiny


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny.pair_files(tmp_path_factory.mktemp("tiny"), n=3)


def _cfg(pair, out, **over) -> EvalConfig:
    return tiny.apps_config(pair, out, **{"problems": 3, **over})


def test_a_limited_method_runs_on_the_first_problems_only(pair, tmp_path):
    out = tmp_path / "r.jsonl"
    cfg = _cfg(pair, out, methods=("specdec", "hf-static"), method_problems=(("hf", 1),))
    res = runner.run_eval(cfg)
    assert not res.failed
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    per = {m: sorted(r["problem_id"] for r in recs if r["method"] == m) for m in ("hf", "hf-static", "specdec")}
    assert per == {"hf": ["100"], "hf-static": ["100", "101", "102"], "specdec": ["100", "101", "102"]}
    # compared with the reference where it ran, "not compared" (None) elsewhere -- never a mismatch
    spec = {r["problem_id"]: r["match"] for r in recs if r["method"] == "specdec"}
    assert spec == {"100": True, "101": None, "102": None}
    # raising the limit later adds only the reference's missing records
    more = runner.run_eval(_cfg(pair, out, methods=("specdec", "hf-static")))
    assert more.new == 2 and more.skipped == 7


@pytest.mark.parametrize("bad", [(("hf", -1),), (("hf", 1.5),), (("hf", True),)])
def test_bad_limits_name_the_argument(bad):
    with pytest.raises(ValueError, match="method_problems"):
        EvalConfig(method_problems=bad)


def test_work_items_skip_past_the_limit():
    from eval.methods import METHODS

    items = runner.work_items(["a", "b", "c"], [METHODS["hf"], METHODS["hf-static"]], (), (4,), {"hf": 2})
    assert [(i, m.name) for i, _, m, _, _ in items] == [(0, "hf"), (0, "hf-static"), (1, "hf"), (1, "hf-static"),
                                                         (2, "hf-static")]  # fmt: skip
    assert C.EvalConfig(method_problems=[["hf", 2]]).method_problems == (("hf", 2),)  # JSON-like pairs accepted


def test_cli_flag(pair, tmp_path, capsys):
    from specdec import cli

    out = tmp_path / "c.jsonl"
    argv = ["eval", "apps", "--target", pair["target"], "--draft", pair["draft"], "--drafters",
            "tests.eval.tiny:make_drafter", "--tree-sizes", "4", "--problems", "2", "--data", pair["data"],
            "--max-new-tokens", "6", "--dtype", "fp32", "--device", "cpu", "--attn-impl", "torch", "--warmup", "0",
            "--no-progress", "--methods", "specdec", "--method-problems", "hf=1", "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["method"], r["problem_id"]) for r in recs) == [("hf", "100"), ("specdec", "100"), ("specdec", "101")]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv[:-3] + ["--method-problems", "hf=x", "--out", str(out)])
    assert exc.value.code == 2 and "--method-problems" in capsys.readouterr().err


def test_report_only_rebuilds_a_gpu_runs_report_on_any_machine(pair, tmp_path, capsys):
    """``--device`` only names the device the file was made on: a CPU machine reports a CUDA run."""
    from specdec import cli

    out = tmp_path / "r.jsonl"
    runner.run_eval(_cfg(pair, out, methods=("hf-static",), problems=1))
    argv = ["sweep", "--report-only", "--out", str(out), "--target", pair["target"], "--draft", pair["draft"],
            "--data", pair["data"], "--max-new-tokens", "6", "--dtype", "fp32", "--device", "cuda", "--no-attn"]
    assert cli.main(argv) == 0  # the records were made on cpu: the table is still built from the file
    assert "hf-static" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(argv[:-3] + ["--device", "tpu", "--no-attn"])
    assert exc.value.code == 2 and "--device" in capsys.readouterr().err
