"""``specdec bench-engine`` end to end on tiny random models saved to disk (CPU: no capture)."""

from __future__ import annotations

import json
import math

import pytest

from specdec import cli
from specdec.cli import bench_engine

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.eval.tiny import apps_rows, save_pair

    root = tmp_path_factory.mktemp("bench")
    target, draft = save_pair(root)
    return target, draft, apps_rows(root / "apps.jsonl", 3)


def test_bench_engine_cli_writes_well_formed_json(tiny, tmp_path, capsys):
    target, draft, data = tiny
    out = tmp_path / "engine.json"
    argv = ["bench-engine", "--target", str(target), "--draft", str(draft), "--data", str(data), "--problems", "2",
            "--max-new-tokens", "10", "--tree-sizes", "4", "9", "--spec-tree-size", "6", "--reps", "2",
            "--device", "cpu", "--attn-impl", "torch", "--no-progress", "--seed", "1", "--out", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    for title in ("(a) plain decoding", "(b) one verify forward", "(c) speculative decoding per step"):
        assert title in printed
    res = json.loads(out.read_text())
    assert res["config"]["problems"] == 2 and res["env"]["device"] == "cpu" and res["env"]["dtype"] == "float32"
    assert len(res["prompts"]) == 2 and res["capacity"] % 256 == 0

    plain = {r["method"]: r for r in res["plain"]}
    assert list(plain) == ["hf", "engine-eager", "engine-graph", "engine-compiled", "hf-static"]  # hf-static last
    for name, row in plain.items():
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["new_tokens"] > 0 and len(row["per_problem_s"]) == 2
        assert not row["captured"]  # no capture on CPU
        if name != "hf":  # fp32 greedy: every method gives HF's text
            assert row["reference"] == "hf" and row["identical"] == 2

    verify = res["verify"]
    assert [r["nodes"] for r in verify["rows"]] == [1, 4, 9]  # 1 (a plain step) is always measured
    for r in verify["rows"]:
        assert r["eager_ms"] > 0 and r["graph_ms"] > 0 and r["max_abs_logit_diff"] == 0.0
        assert not r["graph_captured"]
    assert verify["rows"][0]["eager_x_plain"] == 1.0 and verify["plain_ms_per_token"]["engine-graph"] > 0

    spec = res["spec"]
    assert [(r["drafter"], r["mode"]) for r in spec] == [("model", "eager"), ("model", "graph"), ("lookup", "eager"),
                                                          ("lookup", "graph")]  # fmt: skip
    for r in spec:
        assert "error" not in r, r
        assert r["identical"] == 2 and r["tree_size"] == 6 and r["steps"] > 0
        assert 1.0 <= r["tokens_per_step"] <= 1.0 + r["accepted_per_step"] + 1e-9  # the last step may be cut
        parts = r["draft_ms"] + r["verify_ms"] + r["commit_ms"] + r["host_ms"]
        assert math.isclose(parts, r["step_ms"], rel_tol=1e-6) and 0 < r["forward_ms"] <= r["verify_ms"]


def test_bench_engine_sections_and_errors(tiny, tmp_path, monkeypatch, capsys):
    target, draft, data = tiny
    out = tmp_path / "plain.json"
    real = bench_engine.run_plain_method

    def failing(setup, method, log):
        if method == "engine-graph":
            raise RuntimeError("boom")
        return real(setup, method, log)

    monkeypatch.setattr(bench_engine, "run_plain_method", failing)
    cfg = bench_engine.BenchConfig(target=str(target), data=str(data), problems=1, max_new_tokens=4,
                                   sections=("plain",), plain_methods=("engine-eager", "engine-graph"), device="cpu",
                                   attn_impl="torch", progress=False, out=str(out))  # fmt: skip
    res = bench_engine.run_bench(cfg, log=lambda msg: None)
    assert json.loads(out.read_text())["plain"] == json.loads(json.dumps(res["plain"]))
    assert "verify" not in res and "spec" not in res
    assert res["plain"][0]["reference"] == "engine-eager" and res["plain"][0]["identical"] is None
    assert res["plain"][1] == {"method": "engine-graph", "error": "RuntimeError: boom"}  # reported, the run goes on
    assert "engine-graph   error: RuntimeError: boom" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"sections: expected some of \('plain', 'verify', 'spec'\), got \['x'\]"):
        bench_engine.BenchConfig(sections=("x",))
    with pytest.raises(ValueError, match=r"tree_sizes: expected node counts >= 1, got \[0\]"):
        bench_engine.BenchConfig(tree_sizes=(0,))
    with pytest.raises(SystemExit):
        bench_engine.main(["--sections", "plain,bogus"])


def test_bench_engine_compiled_spec_mode(tiny, tmp_path):
    """(c) in the opt-in 'compiled' mode: target and draft forwards through inductor (CPU here)."""
    target, draft, data = tiny
    cfg = bench_engine.BenchConfig(target=str(target), draft=str(draft), data=str(data), problems=1, max_new_tokens=6,
                                   sections=("spec",), drafters=("model",), spec_modes=("compiled",),
                                   spec_tree_size=5, device="cpu", attn_impl="torch", progress=False)  # fmt: skip
    (row,) = bench_engine.run_bench(cfg, log=lambda msg: None)["spec"]
    assert "error" not in row, row
    assert row["mode"] == "compiled" and row["steps"] > 0 and row["tokens_per_step"] >= 1.0
    with pytest.raises(ValueError, match=r"spec_modes: expected some of \('eager', 'graph', 'compiled'\), got \['jit'\]"):
        bench_engine.BenchConfig(spec_modes=("jit",))
