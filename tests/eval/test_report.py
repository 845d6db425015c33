"""Summary rows, table, CSV, JSON, plot and agreement text from synthetic records; attention-only
timing plumbing on CPU (the torch path and a fake timer stand in for Triton and the CUDA-graph timer)."""

from __future__ import annotations

import csv
import json
import sys

import pytest

from eval import attn_timing, report


def _rec(problem, method, t=None, new=10, wall=1.0, match=True, first=None, steps=None, error=None, **extra):
    rec = {"problem_id": problem, "method": method, "tree_size": t, "new_tokens": new, "wall_s": wall,
           "tokens_per_s": new / wall if wall else None, "match": match, "first_divergence": first, "error": error,
           "prompt_len": 100 + 10 * int(problem)}  # fmt: skip
    if steps is not None:
        rec["steps"] = steps
    rec.update(extra)
    return rec


def _steps(emitted, accepted, depth, nodes, verify=0.01, draft=0.002, commit=0.001):
    n = len(emitted)
    return {"emitted": emitted, "accepted": accepted, "depth": depth, "nodes": nodes,
            "verify_s": [verify] * n, "draft_s": [draft] * n, "commit_s": [commit] * n}  # fmt: skip


RECORDS = [
    _rec("1", "hf", wall=2.0),
    _rec("2", "hf", wall=2.0),
    _rec("1", "hf-static", wall=0.5),
    _rec("2", "hf-static", wall=0.5),
    _rec("1", "hf-assisted", wall=4.0),
    _rec("2", "hf-assisted", error="RuntimeError: boom", new=0, wall=0.0),
    _rec("1", "specdec", 32, wall=1.0, steps=_steps([3, 3, 4], [2, 2, 3], [4, 5, 6], [32, 32, 30]),
         tree_samples=[[-1, 0, 1], [-1, 0, 0, 2]]),
    _rec("2", "specdec", 32, wall=1.0, match=False, first=7, steps=_steps([1], [0], [3], [32]),
         tree_samples=[[-1, 0]]),
    _rec("1", "specdec", 64, wall=0.5, steps=_steps([5, 5], [4, 4], [8, 8], [64, 64])),
]


def _cells(table: str) -> list[dict[str, str]]:
    """The rows of a Markdown table as {header: cell}."""
    lines = table.splitlines()
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")))) for line in lines[2:]]


def test_summarize_rows():
    rows = report.summarize(RECORDS)
    assert [(r["method"], r["tree_size"]) for r in rows] == [
        ("hf", None), ("hf-static", None), ("hf-assisted", None), ("specdec", 32), ("specdec", 64)]
    by = {(r["method"], r["tree_size"]): r for r in rows}
    hf, sp32, sp64 = by[("hf", None)], by[("specdec", 32)], by[("specdec", 64)]
    assert hf["tokens_per_s"] == pytest.approx(5.0) and hf["speedup_vs_hf"] == pytest.approx(1.0)
    assert by[("hf-assisted", None)]["errors"] == 1 and by[("hf-assisted", None)]["problems"] == 1
    assert sp32["problems"] == 2 and sp32["steps"] == 4
    assert sp32["tau"] == pytest.approx(11 / 4) and sp32["accepted_per_step"] == pytest.approx(7 / 4)
    assert sp32["mean_depth"] == pytest.approx(18 / 4) and sp32["mean_nodes"] == pytest.approx(126 / 4)
    assert sp32["verify_ms"] == pytest.approx(10.0) and sp32["draft_ms"] == pytest.approx(2.0)
    assert sp32["speedup_vs_hf"] == pytest.approx(2.0)  # 10 tok/s vs 5 tok/s
    assert sp32["speedup_vs_hf_static"] == pytest.approx(0.5)
    assert sp32["speedup_vs_hf_assisted"] == pytest.approx(4.0)  # on the one problem both finished
    assert (sp32["compared"], sp32["matches"], sp32["match_rate"]) == (2, 1, 0.5)
    assert sp32["mean_first_divergence"] == 7
    assert sp64["speedup_vs_hf"] == pytest.approx(4.0) and sp64["tau"] == 5
    assert sp64["attn_tree_us"] is None


def test_summarize_with_attention_rows():
    attn = [
        {"tree_size": 32, "prompt_len": 100, "tree_us": 5.0, "sdpa_us": 20.0, "speedup": 4.0},
        {"tree_size": 32, "prompt_len": 110, "tree_us": 6.0, "sdpa_us": 21.0, "speedup": 3.5},
        {"tree_size": 32, "prompt_len": 120, "tree_us": 7.0, "sdpa_us": 22.0, "speedup": 3.1},
    ]
    rows = {(r["method"], r["tree_size"]): r for r in report.summarize(RECORDS, attn)}
    row = rows[("specdec", 32)]
    assert (row["attn_prompt_len"], row["attn_tree_us"], row["attn_sdpa_us"]) == (110, 6.0, 21.0)
    assert rows[("specdec", 64)]["attn_tree_us"] is None and rows[("hf", None)]["attn_tree_us"] is None


def test_table_csv_summary(tmp_path):
    rows = report.summarize(RECORDS)
    table = report.format_table(rows)
    lines = table.splitlines()
    assert lines[0].startswith("| method | t | problems | tau |") and "vs hf-static" in lines[0]
    assert "attn tree µs" not in lines[0]  # no attention timings: column left out
    assert len(lines) == 2 + len(rows)
    cells = _cells(table)
    sp32 = next(c for c in cells if (c["method"], c["t"]) == ("specdec", "32"))
    assert (sp32["problems"], sp32["tau"], sp32["vs hf"], sp32["vs hf-static"], sp32["vs assisted"],
            sp32["same as hf"]) == ("2", "2.75", "2.00x", "0.50x", "4.00x", "50%")  # fmt: skip
    assert sp32["stalls"] == "0" and "drafter" not in sp32  # stalls shown even when 0; no drafters: no column
    path = report.write_csv(rows, tmp_path / "out" / "t.csv")
    with open(path) as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == list(report.COLUMNS) and len(got) == len(rows)
    assert got[0]["tau"] == "" and float(got[3]["tau"]) == pytest.approx(2.75)
    summary = json.loads(report.write_summary(rows, tmp_path / "s.json", config={"seed": 0}).read_text())
    assert summary["config"] == {"seed": 0} and len(summary["rows"]) == len(rows)


def test_agreement_summary():
    text = report.agreement_summary(RECORDS, strict=True)
    assert "specdec t=32: 1/2 identical; first divergence 2@7  <-- GREEDY MISMATCH" in text
    assert "hf-static: 2/2 identical" in text
    assert "not compared" in report.agreement_summary([_rec("1", "hf", match=None)])


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = report.plot(report.summarize(RECORDS), tmp_path / "p.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_skips_without_matplotlib_or_tree_rows(tmp_path, monkeypatch, capsys):
    assert report.plot(report.summarize(RECORDS[:4]), tmp_path / "a.png") is None
    assert "no rows with a tree size" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert report.plot(report.summarize(RECORDS), tmp_path / "b.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "b.png").exists()


# ------------------------------------------------------------------------------------------------
# attention-only timing


SHAPE = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_layers": 2}


def test_attention_skips_without_cuda(capsys):
    assert attn_timing.sweep_attention(RECORDS, SHAPE, "fp32", "cpu") is None
    assert "attention timing: skipped (needs a CUDA device" in capsys.readouterr().err


def test_attention_rows_on_cpu_with_torch_path(tmp_path):
    assert attn_timing.trees_by_size(RECORDS, max_trees=2) == {32: [[-1, 0, 1], [-1, 0, 0, 2]]}
    assert attn_timing.prompt_lengths(RECORDS) == [110, 120]
    calls = []

    def timer(fn):
        calls.append(fn)
        fn()
        return 1e-6 * len(calls)

    rows = attn_timing.sweep_attention(RECORDS, SHAPE, "fp32", "cpu", max_trees=2, timer=timer, impl="torch",
                                       require_cuda=False)  # fmt: skip
    assert [(r["tree_size"], r["prompt_len"], r["trees"], r["nodes"]) for r in rows] == [(32, 110, 2, 33), (32, 120, 2, 33)]
    assert all(r["max_rel_err"] < 1e-5 and r["tree_us"] > 0 and r["sdpa_us"] > 0 for r in rows)
    assert rows[0]["num_heads"] == 4 and rows[0]["impl"] == "torch"
    assert len(calls) == 2 * 2 * 2  # (tree, sdpa) x trees x prompt lengths
    path = attn_timing.write_rows(rows, tmp_path / "a.jsonl")
    assert [json.loads(x) for x in path.read_text().splitlines()] == rows


def test_attention_inputs_shapes():
    import torch

    q, k, v, prefix, mask = attn_timing.attention_inputs([-1, 0, 1, 0], 7, SHAPE, torch.float32, "cpu")
    assert q.shape == (1, 4, 4, 16) and k.shape == v.shape == (1, 2, 11, 16)
    assert prefix.tolist() == [7] and mask.n == 4


# ------------------------------------------------------------------------------------------------
# several drafters, warm-ups, stalls, latency, pass@1


def _spec(problem, drafter, t, wall, **extra):
    return _rec(problem, "specdec", t, wall=wall, drafter=f"{drafter}:x=1", drafter_label=drafter,
                steps=_steps([2] * 5, [1] * 5, [2] * 5, [t] * 5), **extra)  # fmt: skip


def _multi_records():
    recs = []
    for p in "123":
        recs += [_rec(p, "hf", wall=2.0), _rec(p, "hf-static", wall=0.5 if p != "3" else 50.0, passed=p == "1")]
        for d, w in (("lookup", 1.0), ("medusa", 0.25)):
            for t in (4, 8):
                recs.append(_spec(p, d, t, w * t / 4, passed=True, emit_t=[0.1, 0.2, 0.2 + w], emit_n=[1, 4, 5]))
    warm = {"kind": "warmup", "problem_id": "1", "method": "hf-static", "tree_size": None, "new_tokens": 16,
            "wall_s": 40.0, "prep_s": 0.0, "load_s": 0.0}  # fmt: skip
    warm_spec = dict(warm, method="specdec", tree_size=4, drafter="medusa:x=1", drafter_label="medusa", wall_s=0.5,
                     prep_s=2.0, load_s=0.3)  # fmt: skip
    return [warm, warm_spec, *recs]


def test_summarize_several_drafters_share_the_baselines():
    rows = report.summarize(_multi_records())
    keys = [(r["method"], r["drafter"], r["tree_size"]) for r in rows]
    assert keys == [("hf", None, None), ("hf-static", None, None), ("specdec", "lookup", 4), ("specdec", "lookup", 8),
                    ("specdec", "medusa", 4), ("specdec", "medusa", 8)]  # fmt: skip
    by = {k: r for k, r in zip(keys, rows)}
    static, med4 = by[("hf-static", None, None)], by[("specdec", "medusa", 4)]
    # HF static's 50 s call is a stall: reported apart, out of its steady state
    assert static["stalls"] == 1 and static["stall_problems"] == ["3"] and static["stall_s"] == pytest.approx(50.0)
    assert static["stall_excess_s"] == pytest.approx(50.0 - 10 * 0.05)
    assert static["steady_tokens_per_s"] == pytest.approx(20.0) and static["tokens_per_s"] == pytest.approx(30 / 51)
    assert static["first_call_s"] == pytest.approx(40.0) and static["first_call_processes"] == 1
    assert med4["first_call_s"] == pytest.approx(2.5) and med4["load_s"] == pytest.approx(0.3)
    assert by[("specdec", "lookup", 4)]["first_call_s"] is None  # no warm-up record, no first_call flag
    # speedups against the shared baselines; steady state leaves HF static's stalled problem out
    assert med4["speedup_vs_hf"] == pytest.approx(8.0)
    assert med4["speedup_vs_hf_static"] == pytest.approx((30 / 0.75) / (30 / 51))
    assert med4["steady_speedup_vs_hf_static"] == pytest.approx(2.0)
    assert med4["stalls"] == 0 and med4["steady_calls"] == 3
    # latency: emissions (0.1, 1), (0.2, 4), (0.45, 5) -> gaps 0 x3+..., p99 near 0.25 s
    assert med4["ttft_p50_ms"] == pytest.approx(100.0) and med4["latency_gaps"] == 27
    assert med4["itl_p50_ms"] == 0 and med4["itl_max_ms"] == pytest.approx(250.0)
    assert med4["pass_at_1"] == 1.0 and static["pass_at_1"] == pytest.approx(1 / 3) and by[("hf", None, None)]["pass_at_1"] is None
    text = report.format_table(rows)
    cells = _cells(text)
    assert [(c["method"], c["drafter"], c["t"]) for c in cells][:3] == [("hf", "-", "-"), ("hf-static", "-", "-"),
                                                                        ("specdec", "lookup", "4")]  # fmt: skip
    assert cells[1]["stalls"] == "1" and cells[1]["first call s"] == "40.00" and cells[4]["pass@1"] == "100%"
    assert "itl p99 ms" in text.splitlines()[0] and "steady vs hf-static" in text.splitlines()[0]
    agree = report.agreement_summary(_multi_records())
    assert "specdec medusa t=8: 3/3 identical" in agree


def test_old_records_keep_their_rows():
    """Records written before multi-drafter runs name the run's drafter on every method."""
    old = [dict(r, drafter="medusa") for r in RECORDS]
    rows = report.summarize(old)
    assert [(r["method"], r["drafter"], r["tree_size"]) for r in rows][:3] == [
        ("hf", None, None), ("hf-static", None, None), ("hf-assisted", None, None)]
    assert {r["drafter"] for r in rows if r["method"] == "specdec"} == {"medusa"}


def test_plot_lines_per_drafter(tmp_path):
    rows = report.summarize(_multi_records())
    assert [report._series(r) for r in rows if r["tree_size"]] == ["lookup", "lookup", "medusa", "medusa"]
    assert report._speedup_field(rows)[0] == "steady_speedup_vs_hf_static"
    assert report._speedup_field(report.summarize(RECORDS[:2] + RECORDS[6:]))[0] == "speedup_vs_hf"
    pytest.importorskip("matplotlib")
    path = report.plot(rows, tmp_path / "m.png")
    assert path is not None and path.stat().st_size > 1000


def test_same_run_speedup_scales_hf_static_to_the_process_that_ran_the_row():
    base = [_rec(p, "hf-static", wall=1.0, run_id="A") for p in ("1", "2")]
    # process B ran HF static twice as slowly on its calibration problem
    calib = [_rec("1", "hf-static", wall=2.0, run_id="B", kind="calibration")]
    rows = report.summarize([
        *base, *calib,
        *(_rec(p, "specdec", 32, wall=0.5, run_id="B", drafter="d") for p in ("1", "2")),
        *(_rec(p, "specdec", 64, wall=0.25, run_id="A", drafter="d") for p in ("1", "2")),  # HF static's own process
        _rec("1", "specdec", 128, wall=0.5, run_id="B", drafter="d"),
        _rec("2", "specdec", 128, wall=0.5, run_id="C", drafter="d"),  # a process without calibration
    ])
    by = {(r["method"], r["tree_size"]): r for r in rows}
    # a calibration record is no timed call of HF static's row
    assert by[("hf-static", None)]["problems"] == 2 and by[("hf-static", None)]["tokens_per_s"] == pytest.approx(10.0)
    assert by[("specdec", 32)]["speedup_vs_hf_static"] == pytest.approx(2.0)
    # 20 tokens / 1 s against 20 tokens / (2 x 1 s x 2)
    assert by[("specdec", 32)]["same_run_speedup_vs_hf_static"] == pytest.approx(4.0)
    assert by[("specdec", 64)]["same_run_speedup_vs_hf_static"] == pytest.approx(4.0)  # scale 1 in process A
    assert by[("specdec", 128)]["same_run_speedup_vs_hf_static"] is None
    assert by[("hf-static", None)]["same_run_speedup_vs_hf_static"] is None
    table = _cells(report.format_table(rows))
    assert [c["vs hf-static same process"] for c in table] == ["-", "4.00x", "4.00x", "-"]


def test_steady_speedup_over_specdec_plain_leaves_a_stalled_call_out():
    """A compile inside one timed call of ``auto`` (Spec-Bench, a general head: 1.98 s for a 0.25-s
    call) is a stall: the speedup over all calls counts it, the steady one does not."""
    recs = []
    for p in "12345":
        recs.append(_rec(p, "specdec-plain", wall=1.0))
        recs.append(_rec(p, "specdec", "auto", wall=10.0 if p == "1" else 0.5, num_steps=5, drafter="e:x=1",
                         drafter_label="e", steps=_steps([2] * 5, [1] * 5, [2] * 5, [4] * 5)))  # fmt: skip
    rows = {r["method"]: r for r in report.summarize(recs)}
    auto = rows["specdec"]
    assert auto["stalls"] == 1 and auto["stall_problems"] == ["1"]
    assert auto["speedup_vs_specdec_plain"] == pytest.approx((50 / 12.0) / (50 / 5.0))
    assert auto["steady_speedup_vs_specdec_plain"] == pytest.approx(2.0)
    assert rows["specdec-plain"]["steady_speedup_vs_specdec_plain"] == pytest.approx(1.0)
    cells = _cells(report.format_category_table([{**r, "category": "overall"} for r in rows.values()]))
    assert [c["steady vs specdec-plain"] for c in cells] == ["1.00x", "2.00x"]
