"""``specdec bench-stalls``: the stall arithmetic, and both modes end to end on tiny models (CPU)."""

from __future__ import annotations

import json

import pytest

from specdec import cli
from specdec.cli import bench_stalls


def test_stall_summary_flags_a_slow_call():
    calls = [{"wall_s": 0.01 * n, "new_tokens": n} for n in (10, 20, 10, 30)]
    calls.append({"wall_s": 3.0, "new_tokens": 10})  # 3x the 10 ms per token of the others
    res = bench_stalls.stall_summary(calls)
    assert res["median_ms_per_token"] == pytest.approx(10.0)
    assert res["stalls"] == [4] and res["worst_call"] == 4
    assert res["worst_ratio"] == pytest.approx(30.0)
    assert res["ratios"][:4] == pytest.approx([1.0] * 4)
    assert res["tokens_per_s"] == pytest.approx(80 / 3.7)
    assert bench_stalls.stall_summary(calls, ratio=40.0)["stalls"] == []


def test_stall_summary_steps_and_errors():
    calls = [{"wall_s": 1.0, "new_tokens": 4, "max_step_s": 0.3, "median_step_s": 0.25},
             {"wall_s": 1.0, "new_tokens": 4, "max_step_s": 0.9, "median_step_s": 0.25}]
    res = bench_stalls.stall_summary(calls)
    assert res["slowest_step_ms"] == pytest.approx(900.0)
    assert res["slowest_step_ratio"] == pytest.approx(3.6)
    with pytest.raises(ValueError, match="calls: expected at least one"):
        bench_stalls.stall_summary([])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.eval.tiny import apps_rows, save_pair

    root = tmp_path_factory.mktemp("stalls")
    target, _ = save_pair(root)
    return target, apps_rows(root / "apps.jsonl", 3)


def test_full_and_first_token_modes_write_json(tiny, tmp_path, capsys):
    target, data = tiny
    out = tmp_path / "stalls.json"
    base = ["bench-stalls", "--target", str(target), "--data", str(data), "--device", "cpu", "--tree-size", "4",
            "--max-new-tokens", "6", "--no-progress"]
    assert cli.main(base + ["--problems", "3", "--hf-static", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["methods"]) == {"specdec", "hf-static"}
    for m in res["methods"].values():
        assert len(m["calls"]) == 3 and len(m["ratios"]) == 3
        assert all(c["new_tokens"] >= 1 for c in m["calls"])
    assert "specdec" in capsys.readouterr().out
    out2 = tmp_path / "ttft.json"
    assert cli.main(base + ["--mode", "first-token", "--prefill-width", "0", "--out", str(out2)]) == 0
    res = json.loads(out2.read_text())
    assert res["first_token_since_start_s"] >= res["load_s"] > 0
    assert res["load_s"] == pytest.approx(res["model_s"] + res["tokenizer_s"])
    parts = [res[k] for k in ("device_init_s", "model_code_s", "weights_s")]
    assert min(parts) >= 0 and sum(parts) == pytest.approx(res["model_s"])
    assert len(res["buckets"]) == 1 and len(res["warmup"]) == 1 and res["warmup_s"] > 0  # one bucket only
    assert res["buckets"][0] == res["prompt_tokens"] + 1 + 4  # dynamic shapes on CPU: exactly prompt + 1 + tree
    assert "first token" in capsys.readouterr().out


def test_first_token_warms_the_bucket_generate_uses(monkeypatch):
    """--mode first-token asks SpecDecoder.warmup for exactly its request: min_len = max_len = prompt + 1."""
    import types

    calls = {}

    class FakeDecoder:
        forwards, prefill_forwards = {}, {}

        def warmup(self, **kwargs):
            calls["warmup"] = kwargs
            return types.SimpleNamespace(entries=(), compile_cache=None)

        def generate(self, ids, new):
            calls["generate"] = (len(ids), new)

    monkeypatch.setattr(bench_stalls, "_load", lambda ns, log, times=None: (None, None, 1.0))
    monkeypatch.setattr(bench_stalls, "_prompts", lambda ns, tok, limit=None: [list(range(1009))] * (limit or 5))
    monkeypatch.setattr(bench_stalls, "_decoder", lambda ns, target, tok: FakeDecoder())
    ns = bench_stalls.build_parser().parse_args(["--mode", "first-token", "--device", "cpu"])
    res = bench_stalls.run_first_token(ns, lambda m: None)
    assert calls["warmup"]["max_len"] == calls["warmup"]["min_len"] == 1010 and calls["warmup"]["batch_sizes"] == (1,)
    assert calls["generate"] == (1009, 1) and res["prompt_tokens"] == 1009


def test_medusa_without_heads_is_one_line_error(tiny, capsys):
    target, data = tiny
    assert cli.main(["bench-stalls", "--target", str(target), "--drafter", "medusa", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specdec bench-stalls: error: --medusa-heads: expected a heads directory for --drafter medusa, got none"]


def test_compile_option_takes_the_layer_wise_mode():
    """``--compile``: off, the whole forward (True), or ``--compile layers`` (SpecDecoder(compile="layers"))."""
    from specdec.cli.bench_stalls import build_parser

    p = build_parser()
    assert [p.parse_args([*a, "--device", "cpu"]).compile for a in ([], ["--compile"], ["--compile", "layers"])] == [
        False, True, "layers"]
    with pytest.raises(SystemExit):
        p.parse_args(["--compile", "model", "--device", "cpu"])
