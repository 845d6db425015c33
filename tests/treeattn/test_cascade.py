"""Shared-prefix ("cascade") tree attention (CPU: the kernels through Triton's interpreter)
against the float64 reference and against the unshared kernel on the equivalent layout."""

import math
from dataclasses import replace
from unittest import mock

import pytest
import torch

from tests.treeattn.helpers import DEV, cascade_inputs, rel_error
from treeattn import KernelConfig, TreeMask, tree_attention
from treeattn.cascade import (
    CascadeConfig,
    cascade_plan,
    cascade_tree_attention,
    fused_cost,
    level2_tiles,
    pick_prefix_config,
    prefix_splits,
)
from treeattn.cascade_reference import cascade_tree_attention_ref, unshared_layout
from treeattn.layout import random_tree_parents

CASES = [
    # n, Hq, Hkv, t, D, P, suffix lens
    (1, 4, 4, 1, 64, 37, [0]),  # one node, no suffix
    (3, 8, 2, 21, 40, 130, [0, 17, 90]),  # head dim 40 (padded to 64), GQA 4
    (2, 6, 2, 70, 32, 65, [300, 9]),  # GQA 3: row blocks cut nodes' head groups; two words per query
    (4, 4, 1, 33, 128, 200, [71, 0, 5, 130]),
    (5, 4, 2, 9, 24, 1, [3, 0, 7, 1, 2]),  # a one-key prefix
    (2, 4, 2, 7, 16, 0, [10, 0]),  # nothing shared: level 2 alone
    (2, 2, 1, 256, 16, 40, [5, 100]),  # t = 256: level 2's gathered tree tiles
]


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("n,hq,hkv,t,d,prefix,suffix", CASES)
def test_cascade_matches_float64_reference(n, hq, hkv, t, d, prefix, suffix, fused):
    q, ks, vs, k, v, sl, mask = cascade_inputs(n, hq, hkv, t, d, prefix, suffix, seed=t + d)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", config=CascadeConfig(fused=fused))
    assert out.shape == q.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < 1e-5


def test_sixty_four_sequences():
    """n = 64: level 1 folds 64 x 3 nodes x 2 heads = 384 rows of the KV head (three 128-row
    blocks, each spanning many sequences); level 2 runs 64 sequences."""
    g = torch.Generator().manual_seed(1)
    suffix = torch.randint(0, 41, (64,), generator=g).tolist()
    q, ks, vs, k, v, sl, mask = cascade_inputs(64, 2, 1, 3, 16, 50, suffix, seed=2)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton")
    assert rel_error(out, ref) < 1e-5


def test_long_suffix_splits_level_two():
    """A 3000-token suffix: level 2 splits it over several programs (merged with level 1's state)."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(2, 2, 1, 8, 16, 100, [3000, 20], seed=4)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton")
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("prefix_splits_,suffix_splits", [(1, 1), (2, 3), (5, 1), (3, 2)])
def test_two_level_split_states_merge(prefix_splits_, suffix_splits):
    """Not fused, explicit split counts: 1..5 prefix states and 1..3 suffix states per row."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(3, 8, 2, 12, 32, 150, [40, 0, 77], seed=prefix_splits_)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask)
    cfg = CascadeConfig(prefix=KernelConfig(block_m=32, block_n=16, num_splits=prefix_splits_),
                        suffix=KernelConfig(block_m=32, block_n=16, num_splits=suffix_splits, gather=False),
                        fused=False)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", config=cfg)
    assert rel_error(out, ref) < 1e-5


FUSED_CASES = [
    # n, Hq, Hkv, t, block_m, block_n, splits, prefix, suffix lens, tree
    (3, 8, 2, 12, 32, 16, 1, 150, [40, 0, 77], "random"),  # 48 rows per sequence: blocks straddle two
    (3, 8, 2, 12, 32, 16, 4, 150, [40, 0, 77], "chain"),  # the last split: a short prefix range + level 2
    (5, 2, 1, 3, 64, 32, 3, 100, [9, 31, 0, 64, 2], "star"),  # 6 rows per sequence: 5 sequences per block
    (2, 4, 1, 80, 64, 32, 2, 45, [33, 70], "chain"),  # 320 rows per sequence; 2 words, tiles cut a node
    (2, 6, 3, 40, 16, 16, 7, 33, [16, 17], "random"),  # more splits than the prefix keeps busy
    (6, 6, 1, 1, 16, 32, 3, 70, [0, 5, 64, 17, 33, 2], "chain"),  # plain decoding: 6 rows a sequence, blocks straddle
]


@pytest.mark.parametrize("n,hq,hkv,t,block_m,block_n,splits,prefix,suffix,kind", FUSED_CASES)
def test_fused_row_blocks_across_sequences_and_splits(n, hq, hkv, t, block_m, block_n, splits, prefix, suffix, kind):
    """The fused kernel with explicit tiles / splits: row blocks holding one to five sequences
    (each attended with its own suffix and tree), the last split's prefix range shortened."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(n, hq, hkv, t, 16, prefix, suffix, kind=kind, seed=splits + t)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask)
    cfg = CascadeConfig(prefix=KernelConfig(block_m=block_m, block_n=block_n, num_splits=splits))
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", config=cfg)
    assert torch.isfinite(out).all()
    assert rel_error(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,hq,hkv,t,prefix,suffix", [(3, 8, 1, 45, 100, [3, 60, 0]), (2, 4, 4, 17, 64, [64, 5])])
def test_low_precision_within_twice_torch_error(dtype, n, hq, hkv, t, prefix, suffix):
    q, ks, vs, k, v, sl, mask = cascade_inputs(n, hq, hkv, t, 64, prefix, suffix, dtype, seed=7)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton")
    assert out.dtype == dtype
    # The plain-PyTorch low-precision error: the same math in the input dtype.
    torch_err = rel_error(cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask, compute_dtype=dtype), ref)
    assert rel_error(out, ref) <= 2 * torch_err + 1e-4


@pytest.mark.parametrize("kind,fused", [("random", True), ("star", True), ("chain", True), ("random", False)])
def test_equals_unshared_kernel_on_the_copied_layout(kind, fused):
    """The same numbers as today's kernel with the prefix copied in front of every sequence."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(3, 8, 2, 40, 32, 90, [0, 33, 130], kind=kind, seed=11)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton", config=CascadeConfig(fused=fused))
    kf, vf, pl = unshared_layout(ks, vs, k, v, sl)
    want = tree_attention(q, kf, vf, pl, mask, impl="triton")
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_moving_the_prefix_boundary_does_not_change_the_output():
    """Metamorphic: the last m prefix tokens moved into every sequence's own suffix (same keys,
    now unshared) attend identically."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(2, 4, 2, 10, 16, 70, [12, 0], seed=5)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton")
    m = 23
    k2 = torch.cat([ks[:, 70 - m :].unsqueeze(0).expand(2, -1, -1, -1), k], dim=2)
    v2 = torch.cat([vs[:, 70 - m :].unsqueeze(0).expand(2, -1, -1, -1), v], dim=2)
    out2 = cascade_tree_attention(q, ks[:, : 70 - m], vs[:, : 70 - m], k2, v2, sl + m, mask, impl="triton")
    torch.testing.assert_close(out, out2, rtol=1e-5, atol=1e-5)


def test_star_leaf_ignores_its_siblings():
    """Changing node 5's K/V in sequence 1 changes node 5 of sequence 1 only."""
    q, ks, vs, k, v, sl, mask = cascade_inputs(2, 4, 1, 10, 16, 30, [7, 3], kind="star", seed=6)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="triton")
    k2, v2 = k.clone(), v.clone()
    k2[1, :, 3 + 5] += 3.0
    v2[1, :, 3 + 5] -= 2.0
    out2 = cascade_tree_attention(q, ks, vs, k2, v2, sl, mask, impl="triton")
    changed = (out - out2).abs().amax(dim=(1, 3)) > 0  # [n, t]
    expect = torch.zeros(2, 10, dtype=torch.bool)
    expect[1, 5] = True
    assert changed.cpu().equal(expect)


def test_shared_tree_4d_prefix_and_views_of_bigger_caches():
    """One tree for all sequences (TreeMask batch 1), the prefix as [1, Hkv, P, D], and k / v /
    k_shared as non-contiguous views into bigger buffers (a static cache), q in HF's layout."""
    g = torch.Generator().manual_seed(3)
    n, hq, hkv, t, d, p = 3, 8, 2, 12, 32, 77
    cache_k = torch.randn(n, hkv, 200, d, generator=g).to(DEV)
    cache_v = torch.randn(n, hkv, 200, d, generator=g).to(DEV)
    big_ks = torch.randn(1, hkv, 100, d, generator=g).to(DEV)
    big_vs = torch.randn(1, hkv, 100, d, generator=g).to(DEV)
    q = torch.randn(n, t, hq, d, generator=g).to(DEV).transpose(1, 2)
    k, v, ks, vs = cache_k[:, :, :150], cache_v[:, :, :150], big_ks[:, :, :p], big_vs[:, :, :p]
    shared = TreeMask.from_parents(random_tree_parents(t, 3, g)).to(DEV)
    sl = torch.tensor([100, 0, 41], device=DEV)
    out = cascade_tree_attention(q, ks, vs, k, v, sl, shared, impl="triton")
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, shared)
    assert rel_error(out, ref) < 1e-5
    assert rel_error(cascade_tree_attention(q, ks, vs, k, v, sl, shared, impl="torch"), ref) < 1e-5


def test_torch_impl_two_sdpa_calls_merged_by_lse():
    q, ks, vs, k, v, sl, mask = cascade_inputs(3, 6, 2, 19, 32, 45, [0, 8, 30], seed=9)
    ref = cascade_tree_attention_ref(q, ks, vs, k, v, sl, mask)
    assert rel_error(cascade_tree_attention(q, ks, vs, k, v, sl, mask, impl="torch"), ref) < 1e-5
    empty = ks[:, :0]
    ref0 = cascade_tree_attention_ref(q, empty, empty, k, v, sl, mask)
    assert rel_error(cascade_tree_attention(q, empty, empty, k, v, sl, mask, impl="torch"), ref0) < 1e-5


# ---- level 1's launch plan (host arithmetic) -----------------------------------------------------


@pytest.mark.parametrize("block_n", [16, 64, 128])
@pytest.mark.parametrize("splits", [None, 1, 2, 3, 7])
@pytest.mark.parametrize("extra", [0, 3, 40])
def test_prefix_plan_covers_the_prefix_once(block_n, splits, extra):
    """The last split's [0, first) (whole tiles) and the others' chunks partition the prefix."""
    cfg = KernelConfig(block_m=64, block_n=block_n, num_splits=splits)
    for prefix in (1, block_n - 1, block_n, 3 * block_n + 7, 1000, 4000):
        plan = prefix_splits(cfg, 256, 8, prefix, torch.device("cpu"), extra)
        assert plan.count >= 1 and plan.chunk % block_n == 0 and plan.first % block_n == 0
        ranges = [(0, min(plan.first, prefix))] + [
            (plan.first + i * plan.chunk, min(plan.first + (i + 1) * plan.chunk, prefix)) for i in range(plan.count - 1)]
        assert [p for lo, hi in ranges for p in range(lo, hi)] == list(range(prefix)), plan
        assert all(hi > lo for lo, hi in ranges[1:])  # no split without work


def test_prefix_config_at_the_h100_shapes():
    """132 SMs, Llama-3-8B heads (32 / 8): many folded rows take 128x128 tiles and one split
    (n = 16, t = 64: 256 programs); few rows split the prefix to fill the SMs, the last split's
    range shortened by its level-2 work."""
    cuda = torch.device("cuda", 0)
    with mock.patch("treeattn.cascade._num_sms", lambda _: 132), \
            mock.patch("treeattn.cascade._shared_limit", lambda _: 232448):
        plan = cascade_plan(16, 32, 8, 64, 4000, 256 + 64, 128, cuda)
        cfg = plan.prefix
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (128, 128, 8, 3)
        assert plan.prefix_plan == (1, 4096, 4096) and plan.suffix is None
        # 64-key steps (suffix 256: 4, tree: 1) per sequence of the block, in 128-key tile units
        assert level2_tiles(cfg, 4, 64, 256) == 3 and level2_tiles(cfg, 4, 16, 256) == 5
        assert level2_tiles(cfg, 6, 16, 256) == math.ceil(3 * 5 / 2)
        plan = cascade_plan(4, 32, 8, 16, 4000, 256 + 16, 128, cuda)  # 16 programs per split
        assert plan.prefix_plan.count == 8 and plan.prefix_plan.first == 0
        cfg, pplan = pick_prefix_config(4 * 16 * 4, 8, 16000, 128, cuda)
        assert 8 <= pplan.count <= 16
        cfg, _ = pick_prefix_config(64, 8, 1000, 128, cuda)
        assert (cfg.block_m, cfg.block_n, cfg.programs_per_sm) == (64, 64, 2)
        # 16 sequences of one node (plain decoding of 16 samples) at Qwen2.5-1.5B's heads (12 / 2): 16-row
        # blocks, ~4 sequences' suffixes in each last split instead of ~12 (fused_cost); trees of 17 nodes
        # have enough rows for 128x128 tiles; an explicit config is kept
        plan = cascade_plan(16, 12, 2, 1, 1024, 130, 128, cuda)
        assert (plan.prefix.block_m, plan.prefix.block_n) == (16, 64)
        wide = replace(plan.prefix, block_m=64)
        extra = level2_tiles(wide, 6, 1, 129)
        wide_plan = prefix_splits(wide, 96, 2, 1024, cuda, extra)
        assert fused_cost(plan.prefix, plan.prefix_plan, 96, 2, level2_tiles(plan.prefix, 6, 1, 129), cuda) < \
            fused_cost(wide, wide_plan, 96, 2, extra, cuda)
        assert cascade_plan(16, 12, 2, 17, 1024, 146, 128, cuda).prefix.block_m == 128
        fixed = KernelConfig(block_m=64, block_n=64)
        assert cascade_plan(16, 12, 2, 1, 1024, 130, 128, cuda, config=CascadeConfig(prefix=fixed)).prefix == fixed
        cfg, _ = pick_prefix_config(4096, 8, 4000, 128, cuda, torch.float32)  # fp32: shrunk to fit
        assert 4 * 128 * (cfg.block_m + 2 * cfg.block_n * cfg.num_stages) <= 232448


# ---- input validation ---------------------------------------------------------------------------


def test_errors_name_the_argument():
    q, ks, vs, k, v, sl, mask = cascade_inputs(2, 4, 2, 5, 16, 10, [3, 4])
    cases = [
        (dict(q=q[0]), r"q: expected 4 dims, got shape \(4, 5, 16\)"),
        (dict(k_shared=ks[0]), r"k_shared: expected shape \[Hkv, P, D\] or \[1, Hkv, P, D\], got \(10, 16\)"),
        (dict(k_shared=ks[:1]), r"k_shared: expected shape \[2, P, 16\]"),
        (dict(v_shared=vs[:, :4]), r"v_shared: expected k_shared's shape \(2, 10, 16\), got \(2, 4, 16\)"),
        (dict(v_shared=vs.to(torch.float16)), r"v_shared: expected q's dtype torch.float32, got torch.float16"),
        (dict(k=k.to(torch.float16)), r"k: expected q's dtype torch.float32"),
        (dict(k_shared=ks.transpose(1, 2).contiguous().transpose(1, 2)), r"k_shared: expected a contiguous last"),
        (dict(v=v[:, :1]), r"v: expected k's shape"),
        (dict(k=k[:1], v=v[:1]), r"k: expected shape \[2, Hkv, S, 16\]"),
        (dict(q=torch.randn(2, 3, 5, 16, device=DEV)), r"q: expected a head count divisible by k's 2 KV heads"),
        (dict(tree_mask=TreeMask.from_parents(torch.arange(-1, 6)).to(DEV)), r"tree_mask: expected a tree of t = 5"),
        (dict(tree_mask="nope"), r"tree_mask: expected a treeattn.TreeMask, got str"),
        (dict(suffix_lens=torch.tensor([1.0, 2.0], device=DEV)), r"suffix_lens: expected an int32/int64 tensor"),
        (dict(suffix_lens=torch.tensor([1], device=DEV)), r"suffix_lens: expected shape \[2\], got \(1,\)"),
        (dict(suffix_lens=torch.tensor([3, 8], device=DEV)),
         r"suffix_lens: expected 0 <= suffix_len and suffix_len \+ t <= S = 12 \(t = 5\), got values in \[3, 8\]"),
        (dict(suffix_lens=torch.tensor([-1, 0], device=DEV)), r"suffix_lens: expected 0 <= suffix_len"),
        (dict(impl="cuda"), r"impl: expected one of \('auto', 'triton', 'torch'\), got 'cuda'"),
    ]
    base = dict(q=q, k_shared=ks, v_shared=vs, k=k, v=v, suffix_lens=sl, tree_mask=mask)
    for override, match in cases:
        with pytest.raises(ValueError, match=match):
            cascade_tree_attention(**{**base, **override})
