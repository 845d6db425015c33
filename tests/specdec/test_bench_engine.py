"""``specdec bench-engine`` end to end on tiny random models saved to disk (CPU: no capture)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specdec import cli
from specdec.cli import bench

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.eval.tiny import apps_rows, save_pair

    root = tmp_path_factory.mktemp("bench")
    target, draft = save_pair(root)
    return target, draft, apps_rows(root / "apps.jsonl", 3)


@pytest.mark.slow
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
    real = bench.plain.run_plain_method

    def failing(setup, method, log):
        if method == "engine-graph":
            raise RuntimeError("boom")
        return real(setup, method, log)

    monkeypatch.setattr(bench.plain, "run_plain_method", failing)
    cfg = bench.BenchConfig(target=str(target), data=str(data), problems=1, max_new_tokens=4,
                            sections=("plain",), plain_methods=("engine-eager", "engine-graph"), device="cpu",
                            attn_impl="torch", progress=False, out=str(out))  # fmt: skip
    res = bench.run_bench(cfg, log=lambda msg: None)
    assert json.loads(out.read_text())["plain"] == json.loads(json.dumps(res["plain"]))
    assert "verify" not in res and "spec" not in res
    assert res["plain"][0]["reference"] == "engine-eager" and res["plain"][0]["identical"] is None
    assert res["plain"][1] == {"method": "engine-graph", "error": "RuntimeError: boom"}  # reported, the run goes on
    assert "engine-graph   error: RuntimeError: boom" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"sections: expected some of \('plain', 'verify', 'spec', 'batch', 'profile', "
                       r"'scale'\), got \['x'\]"):  # fmt: skip
        bench.BenchConfig(sections=("x",))
    with pytest.raises(ValueError, match=r"tree_sizes: expected node counts >= 1, got \[0\]"):
        bench.BenchConfig(tree_sizes=(0,))
    with pytest.raises(SystemExit):
        bench.main(["--sections", "plain,bogus"])


def test_bench_engine_step_rows_decode_one_token_per_forward(tiny, tmp_path):
    """(a) engine-graph-step: decode_chunk=0, the same tokens as engine-graph (chunks of 8 here)."""
    target, _, data = tiny
    cfg = bench.BenchConfig(target=str(target), data=str(data), problems=2, max_new_tokens=19, sections=("plain",),
                            plain_methods=("engine-graph-step", "engine-graph"), device="cpu", attn_impl="torch",
                            progress=False)  # fmt: skip
    res = bench.run_bench(cfg, log=lambda msg: None)
    rows = {r["method"]: r for r in res["plain"]}
    assert list(rows) == ["engine-graph", "engine-graph-step"]
    assert rows["engine-graph-step"]["reference"] == "engine-graph"
    assert rows["engine-graph-step"]["identical"] == 2 and rows["engine-graph"]["new_tokens"] > 0


@pytest.mark.slow
def test_bench_engine_compiled_spec_mode(tiny, tmp_path):
    """(c) in the opt-in 'compiled' mode: target and draft forwards through inductor (CPU here)."""
    target, draft, data = tiny
    cfg = bench.BenchConfig(target=str(target), draft=str(draft), data=str(data), problems=1, max_new_tokens=6,
                            sections=("spec",), drafters=("model",), spec_modes=("compiled",),
                            spec_tree_size=5, device="cpu", attn_impl="torch", progress=False)  # fmt: skip
    (row,) = bench.run_bench(cfg, log=lambda msg: None)["spec"]
    assert "error" not in row, row
    assert row["mode"] == "compiled" and row["steps"] > 0 and row["tokens_per_step"] >= 1.0
    with pytest.raises(ValueError, match=r"spec_modes: expected some of \('eager', 'graph', 'compiled'\), got \['jit'\]"):
        bench.BenchConfig(spec_modes=("jit",))


# ---------------------------------------------------------------------------------------------
# the batch, profile and scale sections


@pytest.fixture(scope="module")
def medusa_dir(tmp_path_factory):
    """Fresh (identity) Medusa heads for the tiny target: they predict the LM head's own next token."""
    from drafters.medusa import MedusaHeads

    return MedusaHeads(64, num_heads=2).save(tmp_path_factory.mktemp("medusa") / "heads")


def _tiny_argv(tiny, out, *extra):
    target, _, data = tiny
    return ["bench-engine", "--target", str(target), "--data", str(data), "--device", "cpu", "--attn-impl", "torch",
            "--no-progress", "--reps", "2", "--out", str(out), *extra]  # fmt: skip


@pytest.mark.slow
def test_bench_engine_batch_section(tiny, medusa_dir, tmp_path, capsys):
    out = tmp_path / "batch.json"
    argv = _tiny_argv(tiny, out, "--sections", "batch", "--problems", "3", "--max-new-tokens", "6",
                      "--spec-tree-size", "5", "--batch-sizes", "1", "2", "--batch-drafter", "medusa,lookup",
                      "--medusa-heads", str(medusa_dir))  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "(d) batch throughput" in printed and "(d) batch throughput, with hf-static" in printed
    res = json.loads(out.read_text())
    assert "plain" not in res and "profile" not in res and "scale" not in res
    rows = res["batch"]
    assert [(r["method"], r["batch"]) for r in rows] == [("medusa", 1), ("medusa", 2), ("lookup", 1), ("lookup", 2),
                                                         ("hf-static", 1), ("hf-static", 2)]  # HF last: it compiles
    for r in rows:
        assert "error" not in r, r
        # 3 problems: 3 calls of one row, 2 calls of two rows (problems 0 1 | 2 0: rows cycle)
        assert (r["calls"], r["rows"]) == ((3, 3) if r["batch"] == 1 else (2, 4))
        assert r["new_tokens"] > 0 and r["tokens_per_s"] > 0 and r["row_tokens_per_s"] > 0 and r["warmup_s"] >= 0
        assert math.isclose(r["tokens_per_s"], r["new_tokens"] / r["seconds"])
        assert math.isclose(r["row_tokens_per_s"], r["tokens_per_s"] / r["batch"])
        assert r["reference"] == "medusa B=1" and r["identical"] == r["rows"]  # fp32 greedy: every row is the target's
        assert not r["captured"]
        if r["method"] == "hf-static":
            assert r["mode"] is None and r["tokens_per_step"] is None and r["steps"] is None
        else:
            assert r["mode"] == "graph" and r["tree_size"] == 5 and r["steps"] > 0 and r["step_ms"] > 0
            assert 1.0 <= r["tokens_per_step"] == pytest.approx(1.0 + r["accepted_per_step"])
            # the phases' share of a step; nothing captured on a CPU
            assert 0 < r["draft_ms"] + r["verify_ms"] + r["commit_ms"] <= r["step_ms"] and r["capture_s"] == 0.0


def test_bench_engine_batch_table_with_plain_fixed_and_auto_budgets(tiny, tmp_path, capsys):
    """``--batch-tree-sizes 0 4 auto``: specdec-plain once per batch size, then each drafter (prompt lookup and
    an EAGLE head) at t = 4 and auto; every row the target's fp32 greedy tokens; the auto rows carry their
    budgets, and the summary puts auto against plain and the best fixed t of its batch size."""
    from drafters.eagle import EagleHead
    from transformers import AutoModelForCausalLM

    target, _, _ = tiny
    torch.manual_seed(0)
    heads = tmp_path / "eagle"
    EagleHead(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)).save(heads, target=str(target))
    out = tmp_path / "batch.json"
    argv = _tiny_argv(tiny, out, "--sections", "batch", "--problems", "3", "--max-new-tokens", "6",
                      "--batch-sizes", "1", "2", "--batch-drafter", "lookup,eagle", "--eagle-heads", str(heads),
                      "--batch-tree-sizes", "0", "4", "auto", "--batch-skip-hf")  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = res["batch"]
    assert [(r["method"], r["batch"], r["tree_size"]) for r in rows] == [
        ("specdec-plain", 1, 0), ("specdec-plain", 2, 0),
        *[(d, b, t) for d in ("lookup", "eagle") for b in (1, 2) for t in (4, "auto")]]  # fmt: skip
    for r in rows:
        assert "error" not in r, r
        assert r["reference"] == "specdec-plain B=1" and r["identical"] == r["rows"]  # fp32 greedy
        assert (r["budget_steps"] is not None) == (r["tree_size"] == "auto")
    summary = res["batch_summary"]
    assert [(s["drafter"], s["batch"]) for s in summary] == [("lookup", 1), ("lookup", 2), ("eagle", 1), ("eagle", 2)]
    by = {(r["method"], r["batch"], r["tree_size"]): r["steady_tokens_per_s"] for r in rows}
    for r in rows:
        if r["tree_size"] == "auto":  # each step's budget and the sequences that emitted at it, per call
            counted = {}
            for call in r["budget_trace"]:
                for n, _ in call:
                    counted[str(n)] = counted.get(str(n), 0) + 1
            assert counted == r["budget_steps"]
            assert sum(len(call) for call in r["budget_trace"]) == r["steps"]
            assert all(0 < active <= r["batch"] for call in r["budget_trace"] for _, active in call)
        else:
            assert r["budget_trace"] is None
    for r in rows:  # captures inside the timed calls left out of the steady rate, nothing else
        assert r["steady_tokens_per_s"] == pytest.approx(r["new_tokens"] / (r["seconds"] - r["capture_s"]))
    for s in summary:
        assert s["best_fixed_tree_size"] == 4
        assert s["vs_plain"] == pytest.approx(by[(s["drafter"], s["batch"], "auto")] / by[("specdec-plain", s["batch"], 0)])
        assert s["vs_best_fixed"] == pytest.approx(by[(s["drafter"], s["batch"], "auto")] / by[(s["drafter"], s["batch"], 4)])
    assert "the adaptive budget (t = auto) against specdec-plain" in printed


def test_bench_engine_profile_section(tiny, tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = _tiny_argv(tiny, out, "--sections", "profile", "--problems", "1", "--profile-tree-size", "6",
                      "--profile-modes", "graph", "--profile-reps", "2", "--profile-top", "4", "--bandwidth-gbs", "100")
    assert cli.main(argv) == 0
    assert "(e) kernel profile of one verify forward" in capsys.readouterr().out
    prof = json.loads(out.read_text())["profile"]
    assert (prof["tree_size"], prof["nodes"], prof["layers"], prof["reps"]) == (6, 7, 2, 2)
    # The tiny Qwen2 (tests/eval/tiny.py), fp32, untied: per layer q, k, v (+ biases) 3 * (64 * 64 / 2^(k, v)) ...
    per_layer = (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    params = 2 * per_layer + 2 * 300 * 64 + 64
    floor = prof["floor"]
    assert (floor["params"], floor["param_bytes"], floor["embedding_bytes"]) == (params, 4 * params, 4 * 300 * 64)
    assert floor["streamed_bytes"] == 4 * (params - 300 * 64)
    assert floor["kv_bytes"] == 2 * 2 * 2 * 16 * prof["prefix_len"] * 4  # layers x (k, v) x kv heads x d x tokens x fp32
    assert floor["floor_ms"] == pytest.approx(floor["streamed_bytes"] / 100e9 * 1e3)
    assert prof["bandwidth"]["flag_gbs"] == 100 and prof["bandwidth"]["measured_gbs"] > 0
    (row,) = prof["rows"]
    assert "error" not in row, row
    assert row["mode"] == "graph" and row["source"] == "cpu ops" and row["captured_ms"] is None
    assert row["wall_ms"] == row["uncaptured_ms"] > 0 and row["kernel_ms"] > 0
    assert row["kernels_per_layer"] == pytest.approx(row["kernels_per_forward"] / 2)
    cats = row["categories"]
    assert list(cats) == ["gemm", "attention", "other"]
    assert cats["gemm"]["kernels"] >= 2 * 4  # at least the layers' four GEMMs (q / k / v and gate / up fused)
    assert sum(c["kernels"] for c in cats.values()) == pytest.approx(row["kernels_per_forward"])
    assert sum(c["share"] for c in cats.values()) == pytest.approx(1.0)
    assert len(row["top"]) == 4 and row["top"][0]["ms"] >= row["top"][-1]["ms"]


@pytest.mark.slow
def test_bench_engine_scale_section(tmp_path, capsys):
    out = tmp_path / "scale.json"
    argv = ["bench-engine", "--sections", "scale", "--device", "cpu", "--attn-impl", "torch", "--scale-config", "tiny",
            "--scale-prompts", "24", "40", "--scale-new-tokens", "4", "--scale-tree-sizes", "2", "64", "--reps", "2",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0  # no --target: the section builds its own model
    assert "(f) the engine at scale" in capsys.readouterr().out
    res = json.loads(out.read_text())
    assert "capacity" not in res and res["env"]["dtype"] == "float32"
    sc = res["scale"]
    assert sc["config"] == "tiny" and sc["bandwidth"]["flag_gbs"] == 3000.0
    assert [p["prompt_len"] for p in sc["prompts"]] == [24, 40]
    for p in sc["prompts"]:  # tiny: 2 layers, 2 KV heads of 16, fp32
        assert p["kv_bytes"] == 2 * 2 * 2 * 16 * p["prompt_len"] * 4 and p["capacity"] % 256 == 0
        assert p["floor_ms"] == pytest.approx(p["streamed_bytes"] / 3000e9 * 1e3)
        assert p["floor_kv_ms"] == pytest.approx((p["streamed_bytes"] + p["kv_bytes"]) / 3000e9 * 1e3)
    assert [(r["prompt_len"], r["method"]) for r in sc["decode"]] == [(24, "engine-graph"), (24, "hf-static"),
                                                                      (40, "engine-graph"), (40, "hf-static")]  # fmt: skip
    floors = {p["prompt_len"]: p for p in sc["prompts"]}
    for r in sc["decode"]:
        assert "error" not in r, r
        assert r["ms_per_token"] > 0 and r["new_tokens"] == 4 and r["prefill_ms"] > 0
        assert r["x_floor"] == pytest.approx(r["ms_per_token"] / floors[r["prompt_len"]]["floor_ms"])
        assert r["x_floor_measured"] == pytest.approx(r["ms_per_token"] / floors[r["prompt_len"]]["floor_measured_ms"])
    assert all(isinstance(r["identical_to_engine_graph"], bool) for r in sc["decode"] if r["method"] == "hf-static")
    assert [(r["prompt_len"], r["t"], r["nodes"]) for r in sc["verify"]] == [
        (24, 0, 1), (24, 2, 3), (24, 64, 65), (40, 0, 1), (40, 2, 3), (40, 64, 65)]  # fmt: skip
    assert all(r["ms"] > 0 and not r["captured"] for r in sc["verify"])
    for bar in sc["bars"]:
        v = {r["t"]: r for r in sc["verify"] if r["prompt_len"] == bar["prompt_len"]}
        assert v[0]["x_t0"] == 1.0 and bar["verify_t64_x_t0"] == pytest.approx(v[64]["ms"] / v[0]["ms"])
        assert set(bar) == {"prompt_len", "engine-graph_x_floor", "engine-graph_x_floor_measured", "hf-static_x_floor",
                            "hf-static_x_floor_measured", "verify_t64_x_t0"}  # fmt: skip


def test_floor_arithmetic_by_hand():
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specdec.cli.bench.floor import floor_ms, kv_bytes, measure_copy_bandwidth, weight_bytes

    # Llama-3-8B shapes on the meta device (sizes only): 32 layers of q 4096^2, k / v 4096 x 1024, o 4096^2, three
    # 4096 x 14336 MLP matrices and two norms; embedding and LM head 128256 x 4096 (untied); the final norm.
    model = bench.build_scale_model("llama3-8b", "meta", torch.bfloat16, max_positions=16896)
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert layer == 218_112_000
    w = weight_bytes(model)
    assert w["params"] == 32 * layer + 2 * 128256 * 4096 + 4096 == 8_030_261_248
    assert w["param_bytes"] == 2 * 8_030_261_248 and w["embedding_bytes"] == 2 * 128256 * 4096 == 1_050_673_152
    assert w["streamed_bytes"] == 15_009_849_344  # the embedding table is gathered, not streamed
    assert floor_ms(w["streamed_bytes"], 3000) == pytest.approx(5.003283, rel=1e-6)  # ms per decode step at 3 TB/s
    assert kv_bytes(model, 16384) == 32 * 2 * 8 * 128 * 16384 * 2 == 2 << 30  # a 16k-token cache: 2 GiB
    assert model.config.max_position_embeddings == 17408 and model.config.rope_parameters["rope_theta"] == 500000.0

    # A tied model: the one table is the LM head's weight, streamed every forward.
    cfg = LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=10, tie_word_embeddings=True)  # fmt: skip
    with torch.device("meta"):
        tied = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # embedding 80 + q 64 + k 32 + v 32 + o 64 + MLP 3 * 128 + norms 3 * 8 = 680 parameters, 4 bytes each
    assert weight_bytes(tied) == {"params": 680, "param_bytes": 2720, "embedding_bytes": 0, "streamed_bytes": 2720}
    assert floor_ms(2720, 1.0) == pytest.approx(0.00272)  # 2720 bytes at 1 GB/s
    assert kv_bytes(tied, 100) == 1 * 2 * 1 * 4 * 100 * 4
    with pytest.raises(ValueError, match=r"gbs: expected a bandwidth > 0, got 0"):
        floor_ms(1, 0)
    bw = measure_copy_bandwidth("cpu", nbytes=1 << 20, reps=2)
    assert bw["gbs"] > 0 and bw["bytes"] == 1 << 20 and bw["reps"] == 2


@pytest.mark.slow
def test_bench_engine_scale_whole_forward_compile_row(tmp_path):
    """``--scale-parts engine-inductor``: plain decoding with the whole forward compiled as one
    (``compile="inductor"``, the A/B of the layer-wise ``compile=True``), a row like the others."""
    out = tmp_path / "scale.json"
    argv = ["bench-engine", "--sections", "scale", "--device", "cpu", "--attn-impl", "torch", "--scale-config", "tiny",
            "--scale-prompts", "24", "--scale-new-tokens", "3", "--scale-parts", "engine-inductor", "--reps", "1",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    (row,) = json.loads(out.read_text())["scale"]["decode"]
    assert "error" not in row, row
    assert row["method"] == "engine-inductor" and row["ms_per_token"] > 0 and row["new_tokens"] == 3


def test_build_scale_model_values_are_small_and_finite():
    import torch

    model = bench.build_scale_model("tiny", "cpu", torch.float32, max_positions=2048, seed=3)
    assert model.config.max_position_embeddings == 2048 and model.generation_config.eos_token_id is None
    w = model.model.layers[0].mlp.up_proj.weight.detach()
    assert torch.isfinite(w).all() and 0.015 < float(w.std()) < 0.025
    assert bool((model.model.norm.weight == 1).all())
    with torch.no_grad():
        logits = model(torch.arange(8)[None]).logits
    assert torch.isfinite(logits).all()
    with pytest.raises(ValueError, match=r"name: expected one of \('llama3-8b', .*'tiny'\), got 'gpt'"):
        bench.build_scale_model("gpt", "cpu", torch.float32)
    assert bench.build_scale_model("qwen2.5-1.5b", "meta", torch.bfloat16, layers=3).config.num_hidden_layers == 3
    with pytest.raises(ValueError, match=r"layers: expected None or an int >= 1, got 0"):
        bench.build_scale_model("tiny", "cpu", torch.float32, layers=0)


def test_build_scale_model_qwen_shapes_match_the_loaded_defaults():
    import torch

    from specdec.cli.bench.floor import weight_bytes

    # The GGUF load unties the embedding: 630M and 1.78B parameters (../shared/MODELS.md), with q / k / v biases.
    for name, params in (("qwen2.5-0.5b", 630_167_424), ("qwen2.5-1.5b", 1_777_088_000)):
        model = bench.build_scale_model(name, "meta", torch.bfloat16, max_positions=4096)
        assert type(model).__name__ == "Qwen2ForCausalLM"
        assert model.model.layers[0].self_attn.k_proj.bias is not None
        assert weight_bytes(model)["params"] == params


def test_summarize_kernels_categories_and_names():
    from specdec.cli.bench.kernels import category, short_name, summarize_kernels

    gemm = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)"
    assert short_name(gemm) == "cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8"
    elementwise = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, at::detail::Array<char*, 1> >(int, at::native::FillFunctor<float>, at::detail::Array<char*, 1>)"
    assert short_name(elementwise) == "at::native::vectorized_elementwise_kernel<>"
    assert short_name("x" * 100, width=10) == "x" * 9 + "~"
    names = {gemm: "gemm", "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm", "tree_attn_fwd_kernel": "attention",
             "tree_attn_merge_kernel": "attention", "triton_poi_fused_add_mul_0": "other", elementwise: "other",
             "Memset (Device)": "other", "aten::mm": "gemm", "aten::addmm": "gemm", "aten::add": "other",
             "flash_fwd_kernel": "attention", "triton_tem_fused_mm_0": "gemm"}  # fmt: skip
    assert {n: category(n) for n in names} == names
    # two forwards, each: 2 GEMMs of 10 us, one tree-attention kernel of 30 us, 4 elementwise of 1 us
    one = [(gemm, 10.0), ("nvjet_tst_x", 10.0), ("tree_attn_fwd_kernel", 30.0)] + [(elementwise, 1.0)] * 4
    s = summarize_kernels(one * 2, reps=2, top=2)
    assert s["kernels_per_forward"] == 7 and s["kernel_ms"] == pytest.approx(0.054)
    assert s["categories"]["gemm"] == pytest.approx({"kernels": 2, "ms": 0.020, "share": 20 / 54})
    assert s["categories"]["attention"] == pytest.approx({"kernels": 1, "ms": 0.030, "share": 30 / 54})
    assert s["categories"]["other"] == pytest.approx({"kernels": 4, "ms": 0.004, "share": 4 / 54})
    top = s["top"]
    assert [t["name"] for t in top] == ["tree_attn_fwd_kernel", short_name(gemm)]
    assert top[0] == pytest.approx({"name": "tree_attn_fwd_kernel", "category": "attention", "count": 1.0,
                                    "us_each": 30.0, "ms": 0.030, "share": 30 / 54})  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sections", "batch"], "medusa_heads: the batch section's 'medusa' drafter needs trained heads"),
        (["--batch-sizes", "0"], "argument --batch-sizes: expected an int >= 1, got 0"),
        (["--batch-drafter", "model"], "argument --batch-drafter: expected some of medusa, lookup, eagle, got model"),
        (["--sections", "batch", "--batch-drafter", "eagle"], "eagle_heads: the batch section's 'eagle' drafter needs"),
        (["--batch-tree-sizes", "-1"], "argument --batch-tree-sizes: expected 'auto' or an int >= 0, got -1"),
        (["--medusa-heads", "/nonexistent/heads"], "argument --medusa-heads: no such file or directory"),
        (["--bandwidth-gbs", "0"], r"argument --bandwidth-gbs: expected a number in (0, inf), got 0"),
        (["--scale-config", "gpt"], "argument --scale-config: invalid choice: 'gpt'"),
        (["--scale-prompts", "1"], "argument --scale-prompts: expected an int >= 2, got 1"),
        (["--scale-new-tokens", "1"], "argument --scale-new-tokens: expected an int >= 2, got 1"),
        (["--scale-parts", "verify,plain"], "argument --scale-parts: expected some of engine-graph, engine-compiled, "
                                            "engine-inductor, engine-compiled-step, hf-static, verify, got plain"),
        (["--profile-modes", "eager"], "argument --profile-modes: expected some of graph, compiled, got eager"),
        (["--profile-tree-size", "-1"], "argument --profile-tree-size: expected an int >= 0, got -1"),
    ],
)
def test_bench_engine_new_flags_one_line_errors(extra, message, capsys):
    argv = ["bench-engine", "--device", "cpu", *extra]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec bench-engine: error: ") and err.count("\n") == 1, err
    assert message in err


def test_bench_engine_medusa_heads_must_be_a_heads_directory(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench-engine", "--medusa-heads", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --medusa-heads: expected a Medusa heads directory with medusa_config.json and " in err
    with pytest.raises(ValueError, match=r"scale_prompts: expected prompt lengths >= 2, got \[1\]"):
        bench.BenchConfig(scale_prompts=(1,))
    with pytest.raises(ValueError, match=r"batch_drafters: expected at least one drafter"):
        bench.BenchConfig(sections=("batch",), batch_drafters=(), batch_skip_hf=True)


@pytest.mark.cuda
def test_bench_engine_new_sections_on_cuda(tiny, medusa_dir, tmp_path):
    """The batch, profile and scale sections on a GPU with tiny models (fp32): captured forwards, a kernel profile that
    sees the tree-attention kernel of every layer, batch rows equal to the B = 1 rows, the scale bars."""
    target, _, data = tiny
    out = tmp_path / "cuda.json"
    cfg = bench.BenchConfig(target=str(target), data=str(data), problems=3, max_new_tokens=8, spec_tree_size=6,
                            sections=("batch", "profile", "scale"), batch_sizes=(1, 2),
                            batch_drafters=("medusa", "lookup"), medusa_heads=str(medusa_dir),
                            batch_skip_hf=True, profile_tree_size=6, profile_modes=("graph",), reps=3,
                            scale_config="tiny", scale_prompts=(64,), scale_new_tokens=4,
                            scale_tree_sizes=(4, 64), scale_parts=("engine-graph", "verify"), device="cuda",
                            dtype="fp32", progress=False, out=str(out))  # fmt: skip
    bench.run_bench(cfg, log=lambda msg: None)
    res = json.loads(out.read_text())
    for r in res["batch"]:
        assert "error" not in r, r
        assert r["captured"] and r["identical"] == r["rows"]
    (row,) = res["profile"]["rows"]
    assert "error" not in row, row
    assert row["captured_ms"] > 0 and row["uncaptured_ms"] > 0 and row["unit"] == "gpu kernels"
    assert row["source"] in ("graph replay", "uncaptured forward")
    assert row["categories"]["attention"]["kernels"] >= 2  # the tree-attention kernel in each of the 2 layers
    assert row["categories"]["gemm"]["kernels"] >= 2 * 4  # a layer: q/k/v and gate/up fused (specdec.fused), o, down
    assert 0 < row["kernel_ms"] and res["profile"]["bandwidth"]["measured_gbs"] > 0
    sc = res["scale"]
    assert all("error" not in r and r["captured"] for r in sc["decode"] + sc["verify"])
    assert sc["bars"][0]["verify_t64_x_t0"] > 0


def test_inductor_options_are_set_and_bad_ones_name_themselves():
    """``--inductor NAME=VALUE`` of the device profilers: literals set on ``torch._inductor.config``
    (dotted names reach sub-configs); a missing '=', a non-literal or an unknown name exits naming it."""
    import torch._inductor.config as config

    from specdec.cli.bench.common import set_inductor_options

    saved = (config.max_autotune_gemm, config.triton.cudagraphs)
    try:
        got = set_inductor_options(["max_autotune_gemm=True", "triton.cudagraphs=False"])
        assert got == {"max_autotune_gemm": True, "triton.cudagraphs": False}
        assert config.max_autotune_gemm is True and config.triton.cudagraphs is False
    finally:
        config.max_autotune_gemm, config.triton.cudagraphs = saved
    for bad, message in (("max_autotune_gemm", "expected NAME=VALUE"), ("max_autotune_gemm=yes", "Python literal"),
                         ("no_such_setting=1", "no setting 'no_such_setting'")):  # fmt: skip
        with pytest.raises(SystemExit, match=message):
            set_inductor_options([bad])


def test_eagle_options_override_the_batch_rows_head_compile(monkeypatch):
    """``--eagle-option compile_head=...`` replaces the batch rows' own ``compile_head`` (the mode's),
    not a second keyword for it."""
    import types

    import drafters
    from specdec.cli.bench import batch

    seen = []
    monkeypatch.setattr(drafters, "make_drafter", lambda name, **kw: seen.append((name, kw)))
    cfg = types.SimpleNamespace(eagle_heads="/heads", eagle_options=(("compile_head", True), ("batch_expansion", True)))
    setup = types.SimpleNamespace(target=None, device="cpu", dtype=torch.float32, cfg=cfg)
    batch._make_drafter(setup, "eagle", 4, compiled=False)
    batch._make_drafter(types.SimpleNamespace(**{**vars(setup), "cfg": types.SimpleNamespace(eagle_heads="/h",
                                                                                          eagle_options=())}),
                        "eagle", 4, compiled=True)  # fmt: skip
    assert [(kw["compile_head"], kw.get("batch_expansion")) for _, kw in seen] == [(True, True), (True, None)]
