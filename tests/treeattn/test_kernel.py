"""The Triton kernel (CPU: through the interpreter) against float64 references."""

import math

import pytest
import torch

from treeattn import KernelConfig, TreeMask, tree_attention
from treeattn.layout import random_tree_parents
from treeattn.reference import tree_attention_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _tree(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "chain":
        return torch.arange(-1, n - 1)
    if kind == "star":
        return torch.tensor([-1] + [0] * (n - 1))
    return random_tree_parents(n, max_depth=8, generator=g)


def _inputs(batch, hq, hkv, n, d, prefix, dtype, kind="random", seed=0, extra=3):
    """Fresh random inputs; cache length S = max(prefix) + n + extra (unused tail slots)."""
    g = torch.Generator().manual_seed(seed)
    prefix_lens = torch.tensor(prefix[:batch], dtype=torch.int32)
    seq_len = int(prefix_lens.max()) + n + extra
    q = torch.randn(batch, hq, n, d, generator=g)
    k = torch.randn(batch, hkv, seq_len, d, generator=g)
    v = torch.randn(batch, hkv, seq_len, d, generator=g)
    parents = torch.stack([_tree(kind, n, g) for _ in range(batch)])
    mask = TreeMask.from_parents(parents)
    to = lambda t: t.to(DEV, dtype)  # noqa: E731
    return to(q), to(k), to(v), prefix_lens.to(DEV), mask.to(DEV)


def _rel(x, ref):
    return ((x.double() - ref).norm() / ref.norm()).item()


SHAPES = [
    # batch, Hq, Hkv, n, D, prefix lens
    (1, 4, 4, 1, 64, [0]),
    (1, 8, 2, 5, 80, [37]),
    (2, 8, 1, 70, 96, [130, 9]),
    (1, 4, 1, 300, 64, [20]),
    (2, 4, 1, 33, 128, [200, 71]),
    (1, 2, 1, 65, 256, [50]),
]


@pytest.mark.parametrize("batch,hq,hkv,n,d,prefix", SHAPES)
@pytest.mark.parametrize("kind", ["random", "star", "chain"])
def test_kernel_matches_float64_reference(batch, hq, hkv, n, d, prefix, kind):
    q, k, v, pl, mask = _inputs(batch, hq, hkv, n, d, prefix, torch.float32, kind, seed=n + d)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    out = tree_attention(q, k, v, pl, mask, impl="triton")
    assert out.shape == q.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("splits,warp_specialize", [(1, False), (2, False), (5, False), (2, True)])
def test_split_prompt_merge_equals_single_stage(splits, warp_specialize):
    q, k, v, pl, mask = _inputs(2, 8, 2, 40, 64, [300, 170], torch.float32, seed=splits)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    cfg = KernelConfig(block_m=64, block_n=32, num_splits=splits, warp_specialize=warp_specialize)
    out = tree_attention(q, k, v, pl, mask, impl="triton", config=cfg)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,n,prefix", [(8, 1, 45, [100, 3]), (8, 8, 17, [64, 64])])
def test_low_precision_within_twice_torch_error(dtype, hq, hkv, n, prefix):
    q, k, v, pl, mask = _inputs(2, hq, hkv, n, 64, prefix, dtype, seed=7)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    out = tree_attention(q, k, v, pl, mask, impl="triton")
    assert out.dtype == dtype
    # The plain-PyTorch low-precision error: the same math in the input dtype.
    torch_err = _rel(tree_attention_ref(q, k, v, pl, mask, compute_dtype=dtype), ref)
    assert _rel(out, ref) <= 2 * torch_err + 1e-4


# Gathered tree tiles: per row block, the union of its rows' ancestors is compacted into tiles of
# block_t keys, window by window (256 positions). A star's union is the root plus the block's own
# nodes; a chain's is every position up to the block's last node (many windows and tiles).
GATHER_CASES = [
    # n, Hq, Hkv, block_m, block_t, splits, prefix lens
    (70, 4, 4, 32, 16, 1, [0, 37]),  # GQA 1: 32 nodes per block, several 16-key tiles
    (70, 6, 2, 32, 32, 3, [0, 90]),  # GQA 3: blocks of 32 rows split nodes between blocks
    (150, 4, 1, 64, 64, 2, [150, 0]),  # GQA 4: 16 nodes per block
    (150, 4, 1, 128, 128, 1, [33, 5]),
    pytest.param(300, 4, 4, 64, 64, 1, [0, 200], marks=pytest.mark.slow),  # two windows
    pytest.param(300, 4, 1, 128, 32, 3, [260, 0], marks=pytest.mark.slow),
    pytest.param(300, 4, 4, 128, 16, 2, [7, 0], marks=pytest.mark.slow),
]


@pytest.mark.parametrize("n,hq,hkv,block_m,block_t,splits,prefix", GATHER_CASES)
@pytest.mark.parametrize("kind", ["random", "star", "chain"])
def test_gathered_tree_tiles_match_float64_reference(n, hq, hkv, block_m, block_t, splits, prefix, kind):
    q, k, v, pl, mask = _inputs(2, hq, hkv, n, 32, prefix, torch.float32, kind, seed=n + block_t)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    cfg = KernelConfig(block_m=block_m, block_n=64, num_splits=splits, block_t=block_t)
    out = tree_attention(q, k, v, pl, mask, impl="triton", config=cfg)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("kind,block_t", [("chain", 128), ("random", 64)])
def test_gathered_tree_tiles_past_a_thousand_nodes(kind, block_t):
    """n > 1024: five windows; a chain's last blocks gather every earlier position."""
    n = 1100
    q, k, v, pl, mask = _inputs(1, 2, 2, n, 16, [40], torch.float32, kind, seed=11)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    cfg = KernelConfig(block_m=128, block_n=64, num_splits=2, block_t=block_t)
    out = tree_attention(q, k, v, pl, mask, impl="triton", config=cfg)
    assert _rel(out, ref) < 1e-5


@pytest.mark.parametrize("prompt,extra,block_n,seed", [(20, 3, 16, 2), (45, 5, 32, 4)])
def test_keys_no_row_of_a_block_sees_are_never_read(prompt, extra, block_n, seed):
    """White-box: a row block loads only the union of its rows' ancestors and, with a prompt tail
    (45 % 32 = 13 keys), only the tail's own keys. NaN in node 40's K/V (a star: only node 40 sees
    it) and in every cache slot past the tree reaches node 40's row block only; every other row is
    exact (v3's 64-key word tiles read node 40 for every block of nodes 0..63)."""
    n = 70
    q, k, v, pl, mask = _inputs(1, 1, 1, n, 16, [prompt], torch.float32, kind="star", seed=seed, extra=extra)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    for pos in [prompt + 40] + list(range(prompt + n, prompt + n + extra)):
        k[:, :, pos] = float("nan")
        v[:, :, pos] = float("nan")
    cfg = KernelConfig(block_m=16, block_n=block_n, num_splits=1, block_t=16)
    out = tree_attention(q, k, v, pl, mask, impl="triton", config=cfg)
    clean = torch.ones(n, dtype=torch.bool)
    clean[32:48] = False  # the block of node 40
    assert torch.isnan(out[0, 0, 40]).all()
    assert _rel(out[:, :, clean], ref[:, :, clean]) < 1e-5


# v7: the last split attends the prompt's ragged tail (prefix_len % block_n keys, per sequence) in
# the tree part's gathered tiles, ahead of the tree union, instead of a masked block_n tile.
TAIL_CASES = [
    # n, Hq, Hkv, block_m, block_n, block_t, splits, prefix lens (batch 2: tails differ)
    (20, 4, 2, 32, 64, 64, 1, [100, 64]),  # tail 36 + union fit one tile; the second has no tail
    (20, 4, 1, 64, 128, 16, 3, [250, 128]),  # tail 122 > block_t: eight gathered chunks
    (12, 2, 2, 16, 32, 32, 3, [200, 40]),  # the short sequence's last split has no prompt tile
    (9, 4, 4, 32, 64, 32, 2, [0, 50]),  # prefix 0; a prompt shorter than one tile (all tail)
    (260, 1, 1, 128, 64, 128, 2, [191, 64]),  # two windows: the tail leads the root's window
    (40, 6, 2, 32, 32, 64, 1, [96, 31]),  # GQA 3 (a block splits a node's rows); one tail 0
]


@pytest.mark.parametrize("n,hq,hkv,block_m,block_n,block_t,splits,prefix", TAIL_CASES)
@pytest.mark.parametrize("kind", ["random", "star", "chain"])
def test_prompt_tail_in_gathered_tiles_matches_float64_reference(n, hq, hkv, block_m, block_n, block_t,
                                                                 splits, prefix, kind):
    q, k, v, pl, mask = _inputs(2, hq, hkv, n, 16, prefix, torch.float32, kind, seed=n + block_n)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    cfg = KernelConfig(block_m=block_m, block_n=block_n, num_splits=splits, block_t=block_t)
    out = tree_attention(q, k, v, pl, mask, impl="triton", config=cfg)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5


def test_default_configs_at_the_h100_shapes():
    """Host side at the H100 shapes (132 SMs), the measured rules: gathered tiles for t = 256 under
    prompts < 8192 (block_t: the smallest power of two >= block_m / group + 8, at most 64), at
    4000/256 with 64x64 tiles and two programs per SM (v10); v3's word tiles and
    main's split rule elsewhere (same splits and chunks as main's v3). Gathered cells are balanced
    in tile steps (a gathered step worth two prompt tiles, the masked ragged-end tile one)."""
    from unittest import mock

    from treeattn import ops

    cuda = torch.device("cuda", 0)
    with mock.patch.object(ops, "_num_sms", lambda _: 132), mock.patch.object(ops, "_shared_limit", lambda _: 232448):
        # (block_m, block_n, block_t, programs per SM, 16-bit partials, plan)
        gathered = {(4000, 256): (64, 64, 32, 2, False, ops.SplitPlan(2, 2048, 1984)),
                    (1024, 256): (64, 128, 32, 1, False, ops.SplitPlan(1, 1024, 1024))}
        for (prefix, n), (block_m, block_n, block_t, per_sm, partials, plan) in gathered.items():
            cfg, got = ops.pick_config(1, 8, 4, n, prefix + n, 128, cuda)
            assert cfg.gather
            assert (cfg.block_m, cfg.block_n, cfg.block_t) == (block_m, block_n, block_t)
            assert (cfg.programs_per_sm, cfg.partials_in_input_dtype, got) == (per_sm, partials, plan)
        # 4000/256: the last split runs 31 prompt tiles + one gathered step (worth 2), the other 31
        # full tiles + the masked 32-key end: 33 vs 32 tile steps.
        cfg, plan = ops.pick_config(1, 8, 4, 256, 4256, 128, cuda)
        assert plan.first // 64 + 2 * ops._tree_steps_estimate(cfg, 4, 256) == 33
        assert math.ceil((4000 - plan.first) / 64) == 32
        # (block_m, block_n, splits, chunk) as main's v3 picks them
        v3 = {(1024, 64): (64, 64, 4, 320), (1024, 128): (64, 64, 2, 576), (4000, 64): (64, 64, 4, 1024),
              (4000, 128): (128, 128, 4, 1152), (16000, 64): (128, 128, 8, 2048),
              (16000, 128): (128, 128, 4, 4096), (16000, 256): (128, 128, 2, 8192)}
        for (prefix, n), want in v3.items():
            cfg, plan = ops.pick_config(1, 8, 4, n, prefix + n, 128, cuda)
            assert not cfg.gather and plan.first == 0
            assert (cfg.block_m, cfg.block_n, plan.count, plan.chunk) == want


@pytest.mark.parametrize("block_n,block_t,group,n", [(64, 32, 4, 256), (128, 64, 4, 256), (32, 16, 1, 40)])
@pytest.mark.parametrize("splits", [None, 2, 3, 5])
def test_gathered_split_plan_covers_the_prompt_once(block_n, block_t, group, n, splits):
    """GATHER mode: the last split's [0, first) (whole tiles) and the others' chunks [first + i *
    chunk, ...) clipped to the prompt partition it, for prompts that do and don't divide the tile."""
    from treeattn import ops

    cfg = KernelConfig(block_m=64, block_n=block_n, block_t=block_t, num_splits=splits)
    for max_prefix in (0, 1, block_n - 1, block_n, 3 * block_n + 7, 1000, 4000):
        plan = ops._splits(cfg, 1, 8, group * n, max_prefix, n, torch.device("cpu"))
        assert plan.count >= 1 and plan.first % block_n == 0
        if plan.count == 1:
            assert plan.first >= max_prefix  # one program: the whole prompt, its tail gathered
            continue
        assert plan.chunk % block_n == 0 and plan.first <= max_prefix
        ranges = [(0, plan.first)] + [(plan.first + i * plan.chunk, min(plan.first + (i + 1) * plan.chunk, max_prefix))
                                      for i in range(plan.count - 1)]
        covered = [p for lo, hi in ranges for p in range(lo, hi)]
        assert covered == list(range(max_prefix)), (max_prefix, plan)
        assert all(hi > lo for lo, hi in ranges[1:])  # no split without work


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("gather,splits", [(True, 2), (False, 2), (True, 3)])
def test_partials_in_input_dtype(dtype, gather, splits):
    """16-bit partials add one rounding per split: within twice the plain-PyTorch low-precision
    error; fp32 inputs are unaffected (their partials are float32 either way)."""
    q, k, v, pl, mask = _inputs(2, 8, 2, 70, 64, [130, 61], dtype, seed=5)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    cfg = KernelConfig(block_m=64, block_n=32, num_splits=splits, block_t=32, gather=gather,
                       partials_in_input_dtype=True)
    out = tree_attention(q, k, v, pl, mask, impl="triton", config=cfg)
    assert out.dtype == dtype and torch.isfinite(out).all()
    if dtype == torch.float32:
        assert _rel(out, ref) < 1e-5
    else:
        torch_err = _rel(tree_attention_ref(q, k, v, pl, mask, compute_dtype=dtype), ref)
        assert _rel(out, ref) <= 2 * torch_err + 1e-4


# v8: one kernel, a constexpr switch for the tree part (gathered tiles or v3's 64-key word tiles
# with a masked prompt-tail tile), times 1-3 splits (several: merged by the second kernel).
V8_CASES = [
    # batch 2, Hq, Hkv, n, block_m, block_n, prefix lens, tree
    (8, 2, 45, 32, 32, [100, 37], "random"),  # GQA 4, tails 4 and 5, blocks split nothing evenly
    pytest.param(4, 1, 300, 128, 64, [64, 128], "chain", marks=pytest.mark.slow),  # no tail; a chain gathers every earlier position
    (4, 1, 130, 64, 64, [0, 77], "star"),  # prefix 0: that sequence's prompt splits are all empty
]
V8_MODES = [(g, s) for g in (True, False) for s in (1, 2, 3)]


@pytest.mark.parametrize("gather,splits", V8_MODES)
@pytest.mark.parametrize("hq,hkv,n,block_m,block_n,prefix,kind", V8_CASES)
def test_tree_part_and_merge_modes_match_float64_reference(hq, hkv, n, block_m, block_n, prefix, kind,
                                                           gather, splits):
    q, k, v, pl, mask = _inputs(2, hq, hkv, n, 16, prefix, torch.float32, kind, seed=n + splits)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    cfg = KernelConfig(block_m=block_m, block_n=block_n, num_splits=splits, block_t=32, gather=gather)
    out = tree_attention(q, k, v, pl, mask, impl="triton", config=cfg)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-5


def test_pick_block_t_smallest_power_of_two_holding_the_union():
    from treeattn.ops import _pick_block_t

    cases = [((64, 128), 4, 256, 32), ((128, 128), 4, 256, 64), ((128, 128), 1, 256, 64), ((16, 64), 4, 256, 16),
             ((64, 32), 4, 256, 32), ((128, 128), 4, 5, 16), ((32, 64), 1, 300, 64)]
    for (bm, bn), group, n, want in cases:
        cfg = _pick_block_t(KernelConfig(block_m=bm, block_n=bn, block_t=128), group, n)
        assert cfg.block_t == want, (bm, bn, group, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gathered_tree_tiles_low_precision(dtype):
    q, k, v, pl, mask = _inputs(2, 8, 2, 70, 64, [60, 0], dtype, seed=3)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    cfg = KernelConfig(block_m=64, block_n=64, num_splits=2, block_t=32)
    out = tree_attention(q, k, v, pl, mask, impl="triton", config=cfg)
    torch_err = _rel(tree_attention_ref(q, k, v, pl, mask, compute_dtype=dtype), ref)
    assert out.dtype == dtype and _rel(out, ref) <= 2 * torch_err + 1e-4


def test_chain_equals_causal_attention_over_prompt_and_chain():
    """A chain tree is ordinary causal decoding of n tokens after the prompt."""
    prompt, n, d = 77, 9, 64
    q, k, v, pl, mask = _inputs(1, 4, 2, n, d, [prompt], torch.float32, kind="chain", extra=0)
    out = tree_attention(q, k, v, pl, mask, impl="triton")
    seq = prompt + n
    causal = torch.arange(seq).view(1, seq) <= (prompt + torch.arange(n)).view(n, 1)  # [n, S]
    kr = k.double().repeat_interleave(2, dim=1)
    vr = v.double().repeat_interleave(2, dim=1)
    scores = (q.double() @ kr.transpose(-1, -2)) / math.sqrt(d)
    expect = torch.softmax(scores.masked_fill(~causal.to(DEV), -math.inf), -1) @ vr
    assert _rel(out, expect) < 1e-5


def test_star_query_sees_prompt_root_and_itself_only():
    """Metamorphic: changing a sibling's K/V must not change a star leaf's output."""
    q, k, v, pl, mask = _inputs(1, 4, 1, 10, 64, [30], torch.float32, kind="star")
    out = tree_attention(q, k, v, pl, mask, impl="triton")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30 + 5] += 3.0  # node 5's key: visible to node 5 only
    v2[:, :, 30 + 5] -= 2.0
    out2 = tree_attention(q, k2, v2, pl, mask, impl="triton")
    changed = (out - out2).abs().amax(dim=(0, 1, 3)) > 0
    assert changed.tolist() == [i == 5 for i in range(10)]


def test_one_hot_values_are_exact_attention_weights():
    """With V = identity rows, the output row is the attention distribution itself."""
    n, prompt = 6, 10  # prompt + n = 16 = head_dim
    q, k, _, pl, mask = _inputs(1, 2, 1, n, 16, [prompt], torch.float32, extra=0)
    v = torch.eye(16, device=DEV).reshape(1, 1, 16, 16)
    out = tree_attention(q, k, v, pl, mask, impl="triton")
    ones = torch.ones(1, 2, n, dtype=torch.float64, device=DEV)
    assert torch.allclose(out.double().sum(-1), ones, atol=1e-6)
    assert _rel(out, tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)) < 1e-5
    hidden = ~mask.to_dense()[0]  # [n, n]: tree node j is not an ancestor of query i
    assert (out[0][:, hidden.nonzero()[:, 0], prompt + hidden.nonzero()[:, 1]] == 0).all()


def test_shared_tree_mask_broadcasts_and_views_of_a_bigger_cache():
    g = torch.Generator().manual_seed(3)
    batch, n, d = 2, 12, 64
    cache_k = torch.randn(batch, 2, 200, d, generator=g).to(DEV)
    cache_v = torch.randn(batch, 2, 200, d, generator=g).to(DEV)
    k, v = cache_k[:, :, :150], cache_v[:, :, :150]  # non-contiguous views, like a static cache
    q = torch.randn(batch, 8, n, d, generator=g).to(DEV)
    shared = TreeMask.from_parents(random_tree_parents(n, 3, g)).to(DEV)
    pl = torch.tensor([100, 33], device=DEV)
    out = tree_attention(q, k, v, pl, shared, impl="triton")
    per_seq = TreeMask(words=shared.words.expand(batch, -1, -1).contiguous(),
                       depth=shared.depth.expand(batch, -1).contiguous())
    ref = tree_attention_ref(q, k, v, pl, per_seq, compute_dtype=torch.float64)
    assert _rel(out, ref) < 1e-5
    assert _rel(tree_attention(q, k, v, pl, shared, impl="torch"), ref) < 1e-5


def test_torch_impl_matches_reference():
    q, k, v, pl, mask = _inputs(2, 8, 2, 70, 64, [100, 5], torch.float32)
    ref = tree_attention_ref(q, k, v, pl, mask, compute_dtype=torch.float64)
    assert _rel(tree_attention(q, k, v, pl, mask, impl="torch"), ref) < 1e-5


# ---- input validation ---------------------------------------------------------------------------


def _ok():
    return _inputs(1, 4, 2, 5, 16, [10], torch.float32)


def test_errors_name_the_argument():
    q, k, v, pl, mask = _ok()
    cases = [
        (dict(q=q[0]), r"q: expected 4 dims, got shape \(4, 5, 16\)"),
        (dict(k=k.to(torch.float16)), r"k, v: expected q's dtype torch.float32"),
        (dict(q=q.to(torch.int32), k=k.to(torch.int32), v=v.to(torch.int32)), r"q: expected dtype float16, bfloat16 or float32"),
        (dict(v=v[:, :1]), r"v: expected k's shape"),
        (dict(q=torch.randn(1, 3, 5, 16, device=DEV)), r"q: expected a head count divisible by k's 2 KV heads"),
        (dict(k=k.transpose(2, 3).contiguous().transpose(2, 3)), r"k: expected a contiguous last \(head\) dim"),
        (dict(tree_mask=TreeMask.from_parents(torch.arange(-1, 6)).to(DEV)), r"tree_mask: expected a tree of n = 5 nodes"),
        (dict(tree_mask="nope"), r"tree_mask: expected a treeattn.TreeMask, got str"),
        (dict(prefix_lens=torch.tensor([10.0], device=DEV)), r"prefix_lens: expected an int32/int64 tensor"),
        (dict(prefix_lens=torch.tensor([10, 10], device=DEV)), r"prefix_lens: expected shape \[1\], got \(2,\)"),
        (dict(prefix_lens=torch.tensor([14], device=DEV)), r"prefix_lens: expected 0 <= prefix_len and prefix_len \+ n <= S = 18 \(n = 5\), got values in \[14, 14\]"),
        (dict(prefix_lens=torch.tensor([-1], device=DEV)), r"prefix_lens: expected 0 <= prefix_len"),
        (dict(impl="cuda"), r"impl: expected one of \('auto', 'triton', 'torch'\), got 'cuda'"),
    ]
    base = dict(q=q, k=k, v=v, prefix_lens=pl, tree_mask=mask)
    for override, match in cases:
        with pytest.raises(ValueError, match=match):
            tree_attention(**{**base, **override})


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    q, k, v, pl, mask = (t.cpu() if isinstance(t, torch.Tensor) else t.to("cpu") for t in _ok())
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="impl: 'triton' needs CUDA tensors or TRITON_INTERPRET=1"):
        tree_attention(q, k, v, pl, mask, impl="triton")


def test_kernel_config_validation():
    with pytest.raises(ValueError, match="block_m: expected a power of two >= 16, got 48"):
        KernelConfig(block_m=48)
    with pytest.raises(ValueError, match="num_splits: expected None or >= 1, got 0"):
        KernelConfig(num_splits=0)
    with pytest.raises(ValueError, match="programs_per_sm: expected >= 1, got 0"):
        KernelConfig(programs_per_sm=0)
    for bad in (8, 48, 256):
        with pytest.raises(ValueError, match=f"block_t: expected 16, 32, 64 or 128, got {bad}"):
            KernelConfig(block_t=bad)


def test_default_configs_fit_shared_memory_and_shrink_in_order():
    from unittest import mock

    from treeattn.ops import _shared_bytes, _shrink, pick_config

    h100 = 232448
    for dtype in (torch.bfloat16, torch.float32):
        for d in (64, 80, 128, 256):
            for n, seq in ((32, 1100), (256, 1300), (64, 16100), (256, 16300)):
                cfg, plan = pick_config(1, 8, 4, n, seq, d, torch.device("cpu"), dtype)
                assert plan.count >= 1 and plan.chunk >= 1
                if dtype == torch.bfloat16 and d <= 128:
                    assert _shared_bytes(cfg, d, 2) <= h100
        # two programs per SM (4000/256) only where two fit: bf16 at d <= 128, fp32 at d = 64 (at 128
        # it shrinks to 2 stages of 164 KB; d > 128 takes its own config)
        with mock.patch("treeattn.ops._shared_limit", lambda _: h100), mock.patch("treeattn.ops._num_sms", lambda _: 132):
            for d in (64, 128, 256):
                cfg, _ = pick_config(1, 8, 4, 256, 4256, d, torch.device("cuda", 0), dtype)
                fits = 2 * (_shared_bytes(cfg, d, dtype.itemsize) + 1024) <= h100 + 1024
                assert cfg.programs_per_sm == (2 if d <= 128 and fits else 1)
                assert fits == (dtype == torch.bfloat16 or d == 64)
    seen = [KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)]
    while True:
        try:
            seen.append(_shrink(seen[-1]))
        except ValueError as exc:
            assert "no smaller kernel config" in str(exc)
            break
    sizes = [_shared_bytes(c, 128, 4) for c in seen]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes)
    assert seen[-1].block_m == 16 and seen[-1].block_n == 16 and seen[-1].num_stages == 1


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_custom_op_equals_the_function_and_passes_opcheck(impl):
    """treeattn::tree_attention (what torch.compile sees): same output, consistent fake, schema."""
    from treeattn.ops import tree_attention_op

    q, k, v, pl, mask = _inputs(2, 4, 2, 19, 64, [30, 7], torch.float32, seed=5)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # HF's layout: a non-contiguous view
    want = tree_attention(q, k, v, pl, mask, impl=impl)
    got = tree_attention_op(q, k, v, pl, mask.words, mask.depth, 0.125, impl)
    torch.testing.assert_close(got, tree_attention(q, k, v, pl, mask, scale=0.125, impl=impl))
    assert got.transpose(1, 2).is_contiguous() and want.shape == got.shape  # new_output's [B, n, Hq, D] order
    torch.library.opcheck(tree_attention_op, (q, k, v, pl, mask.words, mask.depth, 0.125, impl))
