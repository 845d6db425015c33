"""The benchmark's host side on CPU: its baselines compute the same attention, its roofline
arithmetic, its CLI (the timing itself needs CUDA and is not tested here)."""

import json

import pytest
import torch

from specdec.cli import bench_attn
from treeattn import bench
from treeattn.reference import tree_attention_ref


def _cell(L=40, t=9, seed=3):
    shape = bench.BenchShape(L=L, t=t, heads=8, kv_heads=2, head_dim=32, max_depth=4)
    return shape, bench.make_inputs(shape, torch.float32, "cpu", seed)


@pytest.mark.parametrize("names", [("eager",), ("sdpa", "sdpa_repeat_kv"), ("eager", "sdpa", "sdpa_repeat_kv")])
def test_baselines_are_the_selected_ones_and_compute_tree_attention(names):
    """Each baseline (dense-mask eager, SDPA, SDPA over repeated K/V) equals the float64 reference:
    a speedup over a baseline that computed something else would mean nothing."""
    _, (q, k, v, pl, mask) = _cell()
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    fns = bench._baselines(q, k, v, pl, mask, names=names)
    assert tuple(fns) == names
    for name, fn in fns.items():
        out = fn()
        assert out.shape == q.shape
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-5, name


def test_roofline_counts_visible_pairs_and_bytes_once():
    """FLOPs = 4 * D * heads * sum over queries of (prompt + depth + 1) keys; bytes = K and V of
    prompt + tree and Q and O once; the floor is the larger of the two times."""
    shape, (q, k, v, pl, mask) = _cell(L=50, t=6)
    floor, flops, nbytes = bench.roofline(shape, mask, torch.bfloat16, peak_flops=1e12, bandwidth=1e9)
    visible = sum(50 + int(d) + 1 for d in mask.depth.flatten())
    assert flops == 4 * 32 * 8 * visible
    assert nbytes == 2 * 32 * (2 * 2 * (50 + 6) + 2 * 8 * 6)
    assert floor == max(flops / 1e12, nbytes / 1e9)


def test_cli_cpu_demo_writes_rows(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench_attn.main(["--baselines", "sdpa", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["meta"]["args"]["baselines"] == ["sdpa"]
    assert [(r["L"], r["t"]) for r in data["rows"]] == [(100, 32), (300, 64)]
    assert all(r["err_torch"] < 1e-5 for r in data["rows"])
    assert "correctness demo only" in capsys.readouterr().out


def test_cli_rejects_an_unknown_baseline(capsys):
    with pytest.raises(SystemExit):
        bench_attn.main(["--baselines", "cudnn"])
    assert "invalid choice: 'cudnn'" in capsys.readouterr().err
    assert bench_attn.main(["--skip-baselines", "--L", "64"]) == 0  # the CPU demo ignores the cells
