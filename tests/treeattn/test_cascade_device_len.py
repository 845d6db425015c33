"""Cascade tree attention over a fixed-capacity prefix buffer whose live length P is a device tensor
(``shared_len``): float64 reference on fresh random inputs, and the property a CUDA graph needs --
one recorded launch (grid, split plan, every argument) gives the right answer for every P.

CPU: the kernels run through Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import pytest
import torch

from tests.treeattn.helpers import DEV, cascade_inputs, rel_error
import treeattn.cascade_kernels as cascade_kernels
import treeattn.kernels as tree_kernels
from treeattn import KernelConfig
from treeattn.cascade import CascadeConfig, cascade_tree_attention
from treeattn.cascade_reference import cascade_tree_attention_ref


def _len(p: int) -> torch.Tensor:
    return torch.tensor([p], dtype=torch.int64, device=DEV)


CASES = [
    # n, Hq, Hkv, t, D, C (capacity), P (live), suffix lens, block_m, block_n, splits
    (1, 4, 4, 1, 16, 37, 1, [0], 32, 16, 3),  # one node, one live key; two splits past P
    (2, 6, 2, 70, 24, 77, 77, [200, 0], 64, 32, 2),  # P = C; 70 nodes (two words); GQA 3
    (3, 8, 2, 21, 40, 130, 45, [0, 17, 90], 32, 16, 4),  # head dim 40; the last split's range only
    (4, 4, 1, 33, 16, 53, 0, [71, 0, 5, 130], 64, 16, None),  # nothing live: level 2 alone
    (5, 2, 1, 9, 24, 19, 18, [3, 0, 7, 1, 2], 16, 16, 2),  # P = C - 1 (a ragged last tile)
    (6, 4, 2, 5, 16, 100, 61, [12, 150, 0, 33, 8, 199], 32, 32, 5),  # more splits than live tiles
    (7, 3, 1, 13, 16, 29, 14, [1, 2, 3, 4, 5, 6, 7], 64, 16, None),  # plan chosen from C
    (8, 2, 2, 2, 16, 45, 44, [0, 0, 9, 10, 64, 65, 100, 3], 16, 16, 3),
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("n,hq,hkv,t,d,cap,live,suffix,block_m,block_n,splits", CASES)
def test_device_length_matches_float64_reference(n, hq, hkv, t, d, cap, live, suffix, block_m, block_n, splits,
                                                 fused):
    """Capacities and live lengths that divide no block size, P from 0 to C, 1..8 sequences, trees of
    1..70 nodes, suffixes 0..200; the slots past P hold noise that must not be read."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(n, hq, hkv, t, d, cap, suffix, seed=cap + live + t)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, shared_len=live)
    cfg = CascadeConfig(prefix=KernelConfig(block_m=block_m, block_n=block_n, num_splits=splits),
                        suffix=None if fused else KernelConfig(block_m=32, block_n=16, num_splits=2, gather=False),
                        fused=fused)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", shared_len=_len(live), config=cfg)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < 1e-5
    assert rel_error(cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="torch", shared_len=_len(live)), ref) < 1e-5


def test_random_shapes_against_the_reference():
    """Fresh random draws of every size (default configs: the plan comes from C)."""
    g = torch.Generator().manual_seed(17)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    for i in range(6):
        n, t, cap = draw(1, 8), draw(1, 70), draw(1, 150)
        live = draw(0, cap)
        hkv, group = draw(1, 2), draw(1, 3)
        suffix = [draw(0, 200) for _ in range(n)]
        q, ks, vs, k, v, sl, mask = cascade_inputs(n, hkv * group, hkv, t, 16, cap, suffix, seed=100 + i)
        ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, shared_len=live)
        out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", shared_len=_len(live))
        assert rel_error(out, ref) < 1e-5, (n, t, cap, live, hkv, group, suffix)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_torch_error(dtype):
    q, ks, vs, k, v, sl, mask = cascade_inputs(3, 8, 2, 45, 64, 150, [3, 60, 0], dtype, seed=7)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, shared_len=101)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", shared_len=_len(101))
    assert out.dtype == dtype
    torch_err = rel_error(cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, compute_dtype=dtype, shared_len=101), ref)
    assert rel_error(out, ref) <= 2 * torch_err + 1e-4


def test_equals_the_shape_api_on_the_live_slice():
    """The buffer with a device length equals the exact prefix (its first P slots) passed by shape."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(3, 4, 2, 12, 16, 90, [4, 0, 50], seed=3)
    cfg = CascadeConfig(prefix=KernelConfig(block_m=32, block_n=16, num_splits=3))
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", shared_len=_len(58), config=cfg)
    want = cascade_tree_attention(q, ks[:, :58], vs[:, :58], k, v, sl, mask, impl="triton", config=cfg)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


# ---- one launch for every P (what a captured CUDA graph replays) -------------------------------------


class _Recorded:
    """Stands in for a ``@triton.jit`` kernel: records every launch ``(name, grid, args, kwargs)``
    into ``log`` and runs it."""

    def __init__(self, name, kernel, log):
        self.name, self.kernel, self.log = name, kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def launches(monkeypatch):
    """Every cascade / tree kernel launch of the test, in order (the op imports the kernels at call time)."""
    log = []
    for module, name in ((cascade_kernels, "cascade_fused_kernel"), (cascade_kernels, "cascade_prefix_kernel"),
                         (cascade_kernels, "cascade_merge_kernel"), (tree_kernels, "tree_attn_fwd_kernel"),
                         (tree_kernels, "tree_attn_merge_kernel")):  # fmt: skip
        monkeypatch.setattr(module, name, _Recorded(name, getattr(module, name), log))
    return log


def _signature(launch):
    """A launch with each tensor argument replaced by its shape, dtype and strides (its address may
    differ between calls: outputs and partial states are allocated per call)."""
    def sig(x):
        return ("tensor", tuple(x.shape), x.dtype, x.stride()) if isinstance(x, torch.Tensor) else x

    name, grid, args, kwargs = launch
    return name, grid, tuple(sig(a) for a in args), {key: sig(val) for key, val in kwargs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("fused,splits", [(True, 1), (True, 3), (False, 3)])
def test_one_recorded_launch_serves_every_live_length(launches, fused, splits):
    """Record the launches of one call, then -- like a CUDA-graph replay -- change only the device
    length (and the data) and re-run exactly those launches: right for every P in [0, C], including
    P = 0 and the Ps that leave some splits empty."""
    cap = 37
    q, ks, vs, k, v, sl, mask = cascade_inputs(3, 4, 2, 9, 16, cap, [0, 6, 41], seed=5)
    shared_len = _len(cap)
    cfg = CascadeConfig(prefix=KernelConfig(block_m=32, block_n=16, num_splits=splits),
                        suffix=None if fused else KernelConfig(block_m=32, block_n=16, num_splits=2, gather=False),
                        fused=fused)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", shared_len=shared_len, config=cfg,
                                 check_suffix_lens=False)
    recorded = list(launches)
    assert {name for name, *_ in recorded} == ({"cascade_fused_kernel"} | ({"tree_attn_merge_kernel"} if splits > 1
                                               else set()) if fused else
                                               {"cascade_prefix_kernel", "tree_attn_fwd_kernel", "cascade_merge_kernel"})
    g = torch.Generator().manual_seed(8)
    for live in range(cap + 1):
        shared_len.fill_(live)
        q.copy_(torch.randn(q.shape, generator=g))  # fresh queries in the same buffer
        for name, grid, args, kwargs in recorded:
            getattr(cascade_kernels if name.startswith("cascade") else tree_kernels, name).kernel[grid](*args, **kwargs)
        ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, shared_len=live)
        assert rel_error(out, ref) < 1e-5, live


def test_the_launch_does_not_depend_on_the_live_length(launches):
    """Two calls with different P over the same buffers make launches equal in every argument."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(2, 4, 2, 7, 16, 75, [3, 20], seed=9)
    cfg = CascadeConfig(prefix=KernelConfig(block_m=32, block_n=16, num_splits=3))
    calls = []
    for live in (1, 74):
        launches.clear()
        cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", shared_len=_len(live), config=cfg,
                               check_suffix_lens=False)
        calls.append([_signature(x) for x in launches])
    assert calls[0] == calls[1]
    assert len(calls[0]) == 2  # the fused kernel and the merge of its 3 splits


def test_out_of_range_lengths_are_clamped_without_checks():
    """Unchecked (inside a graph), a length past C reads no key past C and a negative one none at all."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(2, 4, 2, 6, 16, 40, [5, 0], seed=4)
    for bad, live in ((41, 40), (1000, 40), (-3, 0)):
        out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", shared_len=_len(bad),
                                     check_suffix_lens=False)
        assert rel_error(out, cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, shared_len=live)) < 1e-5


def test_shared_len_errors_name_the_argument():
    q, ks, vs, k, v, sl, mask = cascade_inputs(2, 4, 2, 5, 16, 10, [3, 4])
    base = dict(q=q, k_shared=ks, v_shared=vs, k=k, v=v, suffix_lens=sl, tree_mask=mask)
    cases = [
        (3, r"shared_len: expected None or an int32/int64 tensor of shape \[1\], got int"),
        (torch.tensor([3.0], device=DEV), r"shared_len: expected None or an int32/int64 tensor .* got torch.float32"),
        (torch.tensor(3, device=DEV), r"shared_len: expected shape \[1\], got \(\)"),
        (torch.tensor([3, 4], device=DEV), r"shared_len: expected shape \[1\], got \(2,\)"),
        (torch.tensor([11], device=DEV), r"shared_len: expected 0 <= shared_len <= C = 10 \(k_shared's capacity\), "
                                         r"got 11"),
        (torch.tensor([-1], device=DEV), r"shared_len: expected 0 <= shared_len <= C = 10 .* got -1"),
    ]
    if DEV == "cpu":
        cases.append((torch.tensor([3], device="meta"), r"shared_len: expected device cpu \(q's\), got meta"))
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            cascade_tree_attention(**base, shared_len=bad)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,t,cap", [(4, 20, 1000), (16, 64, 4100)])
def test_cuda_graph_capture_serves_every_live_length(dtype, n, t, cap):
    """A real CUDA-graph capture of the op (default plan, chosen for C), replayed for several P."""
    g = torch.Generator().manual_seed(n)
    suffix = torch.randint(0, 200, (n,), generator=g).tolist()
    q, ks, vs, k, v, sl, mask = cascade_inputs(n, 8, 2, t, 64, cap, suffix, dtype, seed=n + t)
    shared_len = _len(cap)
    cascade_tree_attention(q, ks, vs, k, v, sl, mask, shared_len=shared_len)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, shared_len=shared_len, check_suffix_lens=False)
    for live in (cap, 0, 1, 37, cap // 2 + 3, cap - 1):
        shared_len.fill_(live)
        graph.replay()
        torch.cuda.synchronize()
        ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, shared_len=live)
        assert rel_error(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2), live


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_custom_op_equals_the_function_in_the_heads_inner_layout(impl):
    """treeattn::cascade_tree_attention (what torch.compile sees): the function's values, laid out as
    ``[n, t, Hq, D]`` (what the fake declares: an HF layer's transpose + reshape then copy nothing),
    and a schema / fake that pass opcheck."""
    from treeattn.cascade import cascade_tree_attention_op

    q, ks, vs, k, v, sl, mask = cascade_inputs(3, 6, 2, 21, 16, 40, [0, 17, 9], seed=11)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # HF's layout: a non-contiguous view
    args = (q, ks, vs, k, v, sl, _len(29), mask.words, mask.depth, 0.25, impl)
    got = cascade_tree_attention_op(*args)
    want = cascade_tree_attention(q, ks, vs, k, v, sl, mask, scale=0.25, impl=impl, shared_len=_len(29))
    torch.testing.assert_close(got, want)
    assert got.shape == q.shape and got.transpose(1, 2).is_contiguous()
    torch.library.opcheck(cascade_tree_attention_op, args)
