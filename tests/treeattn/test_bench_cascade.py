"""The cascade benchmark's host side on CPU: inputs, roofline and memory arithmetic, baseline, CLI."""

import json

import pytest
import torch

from specdec.cli import bench_attn
from treeattn import bench_cascade
from treeattn.cascade import sdpa_lse_cascade, suffix_bias
from treeattn.cascade_reference import cascade_tree_attention_ref


def _cell(P=40, n=3, t=9, seed=3):
    shape = bench_cascade.CascadeShape(P=P, n=n, t=t, heads=8, kv_heads=2, head_dim=32, suffix_max=20, max_depth=4)
    return shape, bench_cascade.make_cascade_inputs(shape, torch.float32, "cpu", seed)


def test_inputs_spread_suffixes_and_fit_the_cache():
    shape, (q, ks, vs, k, v, sl, mask) = _cell(n=5)
    assert sl.tolist() == [0, 5, 10, 15, 20]
    assert q.shape == (5, 8, 9, 32) and ks.shape == (2, 40, 32) and k.shape == (5, 2, 29, 32)
    assert mask.batch_size == 5 and mask.n == 9
    assert bench_cascade.CascadeShape(P=1, n=1, t=1).suffix_lens() == [0]


def test_roofline_counts_the_prefix_once():
    """FLOPs: every query sees P + its suffix + depth + 1 keys; bytes: the prefix's K and V once,
    each sequence's suffix + tree K and V, Q and O."""
    shape, (q, ks, vs, k, v, sl, mask) = _cell(P=50, n=3, t=6)
    floor, compute, memory, flops, nbytes = bench_cascade.cascade_roofline(shape, mask, torch.bfloat16, 1e12, 1e9)
    visible = sum(50 + int(sl[b]) + int(mask.depth[b, i]) + 1 for b in range(3) for i in range(6))
    assert flops == 4 * 32 * 8 * visible
    kv_tokens = 50 + sum(int(x) + 6 for x in sl)
    assert nbytes == 2 * 32 * (2 * 2 * kv_tokens + 2 * 8 * 3 * 6)
    assert (compute, memory) == (flops / 1e12, nbytes / 1e9) and floor == max(compute, memory)


def test_prompt_kv_bytes_qwen_1_5b():
    """n = 16 sequences over a 4000-token prompt, 28 layers x 2 KV heads x d 128 in bf16:
    28,672 bytes per token; 114.7 MB shared vs 1.835 GB as per-sequence copies."""
    shared, unshared = bench_cascade.prompt_kv_bytes(4000, 16, layers=28, kv_heads=2, head_dim=128, esize=2)
    assert shared == 4000 * 28_672 == 114_688_000
    assert unshared == 16 * shared == 1_835_008_000
    assert "shared 114.7 MB" in bench_cascade.memory_report() and "1835.0 MB" in bench_cascade.memory_report()


def test_sdpa_lse_baseline_computes_cascade_attention():
    _, (q, ks, vs, k, v, sl, mask) = _cell()
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask)
    bias = suffix_bias(sl, mask, k.shape[2], 4, q.dtype)
    out = sdpa_lse_cascade(q, ks, vs, k, v, bias)
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_device_len_inputs_pad_the_prefix_to_a_power_of_two():
    _, x = _cell(P=40)
    (q, ks, vs, k, v, sl, mask), shared_len = bench_cascade.device_len_inputs(x)
    assert ks.shape == (2, 64, 32) and shared_len.tolist() == [40] and shared_len.dtype == torch.int64
    assert torch.equal(ks[:, :40], x[1]) and not ks[:, 40:].any() and torch.equal(vs[:, :40], x[2])
    assert bench_cascade.device_len_inputs(x, capacity=41)[0][1].shape == (2, 41, 32)
    assert bench_cascade.device_len_inputs(_cell(P=64)[1])[0][1].shape == (2, 64, 32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the CLI runs the full benchmark")
def test_cli_cascade_cpu_demo_writes_rows(tmp_path, capsys):
    out = tmp_path / "cascade.json"
    assert bench_attn.main(["--cascade", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["args"]["cascade"] and data["meta"]["args"]["t"] == [16, 64]
    (row,) = data["rows"]
    assert row["err_torch"] < 1e-5 and row.get("err_triton", 0.0) < 1e-5
    assert row["err_torch_dev"] < 1e-5 and row.get("err_triton_dev", 0.0) < 1e-5  # a 128-slot buffer, P = 100
    assert "prompt KV, Qwen2.5-1.5B" in capsys.readouterr().out
