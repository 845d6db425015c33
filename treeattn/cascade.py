"""Shared-prefix ("cascade") tree attention: validation, launch configuration, the torch path.

n sequences that share one prompt keep its KV once (``k_shared, v_shared``) and their own
generated tokens + tree in a per-sequence cache (``k, v``). Level 1 attends every query of every
sequence to the shared prefix (all ``n * t * group`` query rows of a KV head folded together,
each prefix tile loaded once per KV head for all of them, the prefix split across programs when
row blocks are few); level 2 attends each sequence's own suffix + tree. By default both run in
one kernel (``cascade_fused_kernel``): the program that holds a row block's last prefix range
goes on with the suffixes and trees of the sequences in that block, one online-softmax state
through both levels; several prefix splits are merged by log-sum-exp (the tree kernel's merge).
``CascadeConfig(fused=False)``: level 2 as the existing tree kernel in its split mode (partial
states) and a merge of both levels' states (``cascade_merge_kernel``) - measured slower.
The shared prefix is either exactly the prompt (P = its shape) or a fixed-capacity buffer of C
slots with the live length P as a device tensor (``shared_len``): the kernels read P from device
memory and the launch (grid, split plan, every argument) depends on C only, so one captured CUDA
graph serves every prompt length up to C; splits whose key range lies past P contribute the empty
state (``-inf`` log-sum-exp, zero output) to the merge.
Kernels: ``treeattn.cascade_kernels``; reference: ``treeattn.cascade_reference``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from treeattn.layout import TreeMask
from treeattn.ops import (
    check_kv_shapes,
    check_lengths,
    check_tree_mask,
    _DTYPES,
    _IMPLS,
    _LOG2E,
    MAX_HEAD_DIM,
    KernelConfig,
    SplitPlan,
    _next_pow2,
    _num_sms,
    _shared_bytes,
    _shared_limit,
    _shrink,
    _splits,
    heads_inner,
    new_output,
    _window_words,
    interpreter_enabled,
    pick_config,
    tree_attention,
)

__all__ = ["CascadeConfig", "CascadePlan", "PrefixPlan", "cascade_plan", "cascade_tree_attention",
           "cascade_tree_attention_op", "fused_cost", "launch_fused", "launch_prefix", "level2_tiles",
           "pick_prefix_config", "prefix_bias", "prefix_splits", "run_plan", "sdpa_lse_cascade", "suffix_bias"]


@dataclass(frozen=True)
class CascadeConfig:
    """Launch parameters (``None``: chosen from the shapes).

    ``fused`` (default): one kernel, ``cascade_fused_kernel``: each program attends its range of
    the shared prefix and the last program of the split axis goes on with the suffix + tree of
    the sequences its row block holds (one online-softmax state through both levels; a merge
    kernel only with several splits). False: level 2 as a separate launch of the tree kernel in
    its split mode and a merge of the two levels' states (measured slower, PERF.md; kept for the
    comparison).
    ``prefix``: the folded-row kernel's ``block_m`` (query rows per program), ``block_n`` (prefix
    keys per tile; level 2 runs in 64-key steps), ``num_warps``, ``num_stages``, ``num_splits`` (programs sharing
    the prefix of one row block) and ``partials_in_input_dtype``.
    ``suffix``: level 2's config when not fused, as ``tree_attention``'s ``config``.
    """

    prefix: KernelConfig | None = None
    suffix: KernelConfig | None = None
    fused: bool = True


class PrefixPlan(NamedTuple):
    """How the prefix is cut over the split axis (``count`` programs per row block): the last split
    takes keys ``[0, first)`` (whole tiles; fused: then the suffixes and trees), split i < last
    ``[first + i * chunk, first + (i + 1) * chunk)`` clipped to the prefix."""

    count: int
    chunk: int
    first: int


# Fixed cost of one program (Q load, pipeline fill, epilogue), in prefix tile steps: about 4.7 us
# against 2.0 us per 128x128 tile in the tree kernel's per-program timeline (PERF.md).
_FIXED_TILES = 2.5
# Extra cost of one more split (its partial states, written and merged), in tile steps.
_SPLIT_TILES = 0.5


def pick_prefix_config(rows: int, num_kv_heads: int, prefix_len: int, head_dim: int, device: torch.device,
                       dtype: torch.dtype = torch.bfloat16, config: KernelConfig | None = None,
                       extra_tiles: int = 0) -> tuple[KernelConfig, PrefixPlan]:
    """(config, split plan) of the folded-row kernel for ``rows = n * t * group`` query rows per
    KV head over a prefix of ``prefix_len`` keys (``extra_tiles``: the level-2 tile steps the last
    split adds in the fused kernel, ``level2_tiles``).

    Tiles as the tree kernel's (PERF.md): 128x128 / 8 warps / 3 stages (two warpgroups, the
    fewest L2 reads of each K/V tile per FLOP) once there are >= 256 rows per KV head; 64-row tiles
    below (64x128 over prefixes >= 2048, 64x64 otherwise); 64x32 for head dims > 128; shrunk to
    fit the device's shared memory. ``config`` overrides the tile choice (and, with its
    ``num_splits``, the split count). Pure host arithmetic (works inside CUDA-graph capture).
    """
    if config is None:
        if head_dim > 128:
            cfg = KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
        elif rows >= 256:
            cfg = KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
        elif prefix_len >= 2048:
            cfg = KernelConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)
        else:
            cfg = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, programs_per_sm=2)
        cfg = replace(cfg, block_t=16)  # unused; keeps the shared-memory estimate to block_n
        esize = torch.finfo(dtype).bits // 8
        while _shared_bytes(cfg, head_dim, esize) > _shared_limit(device):
            cfg = _shrink(cfg)
        if cfg.programs_per_sm * (_shared_bytes(cfg, head_dim, esize) + 1024) > _shared_limit(device) + 1024:
            cfg = replace(cfg, programs_per_sm=1)
    else:
        cfg = config
    return cfg, prefix_splits(cfg, rows, num_kv_heads, prefix_len, device, extra_tiles)


def level2_tiles(cfg: KernelConfig, group: int, t: int, max_suffix: int) -> int:
    """Prefix-tile steps (``block_n`` keys) that the fused kernel's last split spends on level 2
    per row block, estimated from the shapes (the suffix lengths are data): for each sequence the
    block holds, its suffix (``max_suffix`` = S - t, the cache's bound) and its tree in 64-key
    tiles."""
    seq_rows = group * t
    if seq_rows % cfg.block_m == 0:
        seqs = 1
    elif cfg.block_m % seq_rows == 0:
        seqs = cfg.block_m // seq_rows
    else:
        seqs = math.ceil(cfg.block_m / seq_rows) + 1
    return math.ceil(seqs * (math.ceil(max(max_suffix, 0) / 64) + math.ceil(t / 64)) * 64 / cfg.block_n)


def prefix_splits(cfg: KernelConfig, rows: int, num_kv_heads: int, prefix_len: int, device: torch.device,
                  extra_tiles: int = 0, max_splits: int = 32) -> PrefixPlan:
    """Cut the prefix over the split axis: ``cfg.num_splits`` programs or the count that minimises
    a wave model, ``waves(s) * (ceil((tiles + extra) / s) + fixed) + (s - 1) * per_split`` with
    ``waves(s) = ceil(programs(s) / (SMs * programs_per_sm))``: more splits fill the SMs when row
    blocks are few, fewer amortize each program's fixed cost and the merge. The last split's
    prefix range is shortened by the ``extra_tiles`` it adds (``PrefixPlan``); chunks are whole
    tiles, the one reaching the prefix's ragged end with one masked tile."""
    bn = cfg.block_n
    tiles = max(1, math.ceil(prefix_len / bn))
    work = tiles + extra_tiles
    if cfg.num_splits is not None:
        want = min(cfg.num_splits, tiles)
    else:
        per_split = math.ceil(rows / cfg.block_m) * num_kv_heads
        slots = _slots(cfg, device)

        def cost(s: int) -> float:
            return math.ceil(per_split * s / slots) * (math.ceil(work / s) + _FIXED_TILES) + (s - 1) * _SPLIT_TILES

        want = min(range(1, min(tiles, max_splits) + 1), key=cost)
    one = PrefixPlan(1, tiles * bn, tiles * bn)
    if want <= 1:
        return one
    first_tiles = max(0, min(tiles, math.ceil(work / want) - extra_tiles))
    rest = tiles - first_tiles
    if rest <= 0:
        return one
    chunk_tiles = math.ceil(rest / (want - 1))
    return PrefixPlan(1 + math.ceil(rest / chunk_tiles), chunk_tiles * bn, first_tiles * bn)


def _slots(cfg: KernelConfig, device: torch.device) -> int:
    """Programs of ``cfg`` the device runs at once (4 SMs off CUDA, as the plans assume)."""
    return (_num_sms(device.index or 0) if device.type == "cuda" else 4) * cfg.programs_per_sm


def fused_cost(cfg: KernelConfig, plan: PrefixPlan, rows: int, num_kv_heads: int, extra_tiles: int,
               device: torch.device) -> float:
    """The fused kernel's estimated time in tile steps: waves of programs times the longest
    program (the last split: its prefix range and ``extra_tiles`` of level 2; or another split's
    chunk) plus the fixed cost of one, plus the merge's share per extra split.

    Why ``cascade_plan`` compares row blocks with it: level 2 is serial over the sequences of a row
    block, so with few rows per sequence (plain decoding of n samples: ``group`` rows each) a
    64-row block walks about 64 / group sequences' suffixes in one program (PERF.md v21: 36 us a
    layer for 16 sequences of one node each at the 1.5B's heads, on an H100)."""
    slots = _slots(cfg, device)
    programs = math.ceil(rows / cfg.block_m) * num_kv_heads * plan.count
    last = math.ceil(plan.first / cfg.block_n) + extra_tiles
    other = math.ceil(plan.chunk / cfg.block_n) if plan.count > 1 else 0
    return math.ceil(programs / slots) * (max(last, other) + _FIXED_TILES) + (plan.count - 1) * _SPLIT_TILES


def _shared_3d(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 4 and t.shape[0] == 1:
        return t[0]
    if t.dim() != 3:
        raise ValueError(f"{name}: expected shape [Hkv, P, D] or [1, Hkv, P, D], got {tuple(t.shape)}")
    return t


def _check(q, k_shared, v_shared, k, v, suffix_lens, shared_len, tree_mask, impl) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate; return ``(k_shared, v_shared)`` as 3-D ``[Hkv, P or C, D]`` views."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims, got shape {tuple(t.shape)}")
    ks, vs = _shared_3d("k_shared", k_shared), _shared_3d("v_shared", v_shared)
    for name, t in (("q", q), ("k_shared", ks), ("v_shared", vs), ("k", k), ("v", v)):
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last (head) dim, got stride {t.stride(-1)}")
    n, _, t_len, d = q.shape
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head_dim in [1, {MAX_HEAD_DIM}], got {d}")
    hkv, seq_len = check_kv_shapes(q, k, v)
    if ks.shape[0] != hkv or ks.shape[2] != d:
        raise ValueError(f"k_shared: expected shape [{hkv}, P, {d}] (k's KV heads, q's head dim), got {tuple(ks.shape)}")
    if vs.shape != ks.shape:
        raise ValueError(f"v_shared: expected k_shared's shape {tuple(ks.shape)}, got {tuple(vs.shape)}")
    check_tree_mask(tree_mask, t_len, n, q.device, "t")
    check_lengths("suffix_lens", suffix_lens, n)
    if suffix_lens.device != q.device:
        raise ValueError(f"suffix_lens: expected device {q.device} (q's), got {suffix_lens.device}")
    if shared_len is not None:
        if not isinstance(shared_len, torch.Tensor) or shared_len.dtype not in (torch.int32, torch.int64):
            got = shared_len.dtype if isinstance(shared_len, torch.Tensor) else type(shared_len).__name__
            raise ValueError(f"shared_len: expected None or an int32/int64 tensor of shape [1], got {got}")
        if tuple(shared_len.shape) != (1,):
            raise ValueError(f"shared_len: expected shape [1], got {tuple(shared_len.shape)}")
        if shared_len.device != q.device:
            raise ValueError(f"shared_len: expected device {q.device} (q's), got {shared_len.device}")
    if t_len > seq_len:
        raise ValueError(f"k: expected S >= t = {t_len} (the tree KV must be in the cache), got S = {seq_len}")
    if impl not in _IMPLS:
        raise ValueError(f"impl: expected one of {_IMPLS}, got {impl!r}")
    return ks, vs


def cascade_tree_attention(
    q: torch.Tensor,
    k_shared: torch.Tensor,
    v_shared: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    suffix_lens: torch.Tensor,
    tree_mask: TreeMask,
    scale: float | None = None,
    impl: str = "auto",
    *,
    shared_len: torch.Tensor | None = None,
    check_suffix_lens: bool = True,
    config: CascadeConfig | None = None,
) -> torch.Tensor:
    """Tree attention of n sequences that share one prompt, its KV stored once.

    Args:
        q: ``[n, Hq, t, D]`` float16 / bfloat16 / float32, the t tree nodes' queries of each of
            the n sequences.
        k_shared, v_shared: ``[Hkv, P, D]`` or ``[1, Hkv, P, D]``, same dtype and device: the
            shared prompt's KV (``P >= 0``); with ``shared_len``, ``[Hkv, C, D]`` or
            ``[1, Hkv, C, D]``: a buffer of capacity C whose slots ``[0, P)`` hold it (the rest is
            never read).
        k, v: ``[n, Hkv, S, D]``: sequence b's own tokens after the shared prompt at
            ``[0, suffix_lens[b])`` and its tree's KV at ``[suffix_lens[b], suffix_lens[b] + t)``.
            ``Hq % Hkv == 0`` (GQA). Only the last dim of each tensor must be contiguous.
        suffix_lens: int32 / int64 ``[n]`` on q's device.
        shared_len: None (P is the shape of ``k_shared``), or int32 / int64 ``[1]`` on q's device:
            the live prefix length P, ``0 <= P <= C``, as data: the Triton launch (grid, split plan
            chosen for C, arguments) is the same for every P, so a CUDA graph captured once
            serves any prompt length up to C.
        tree_mask: ``TreeMask`` of ``n`` (or 1, shared) trees of t nodes, on q's device.
        scale: softmax scale, default ``D ** -0.5``.
        impl: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"`` (two SDPA
            calls merged by log-sum-exp: ``sdpa_lse_cascade``), or ``"auto"``: Triton on CUDA
            tensors and under the interpreter, else torch.
        check_suffix_lens: verify ``0 <= suffix_lens[b]`` and ``suffix_lens[b] + t <= S`` (and
            ``0 <= shared_len <= C``); this reads the values on the host (a device sync on CUDA).
            Pass False inside CUDA graphs; the kernel then clamps out-of-range values so that it
            never reads outside k / v (or past C).
        config: ``CascadeConfig`` (default: both levels chosen from the shapes).

    Returns:
        ``[n, Hq, t, D]`` in q's dtype: query i of sequence b attends the P prefix keys, keys
        ``[0, suffix_lens[b])`` of its cache and the tree keys of its ancestors and itself; the
        same as ``tree_attention`` on the prefix copied in front of every sequence
        (``cascade_reference.unshared_layout``). Accumulation is in float32.

    Raises:
        ValueError: naming the argument, for bad shapes, dtypes, devices or suffix lengths.
    """
    ks, vs = _check(q, k_shared, v_shared, k, v, suffix_lens, shared_len, tree_mask, impl)
    t_len, seq_len = q.shape[2], k.shape[2]
    if check_suffix_lens and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = (int(x) for x in torch.aminmax(suffix_lens.detach().to(torch.int64)))
        if lo < 0 or hi + t_len > seq_len:
            raise ValueError(f"suffix_lens: expected 0 <= suffix_len and suffix_len + t <= S = {seq_len} "
                             f"(t = {t_len}), got values in [{lo}, {hi}]")
        if shared_len is not None and not 0 <= int(shared_len[0]) <= ks.shape[1]:
            raise ValueError(f"shared_len: expected 0 <= shared_len <= C = {ks.shape[1]} (k_shared's capacity), "
                             f"got {int(shared_len[0])}")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if impl == "auto":
        impl = "triton" if (q.is_cuda or interpreter_enabled()) else "torch"
    if impl == "torch":
        bias = suffix_bias(suffix_lens, tree_mask, seq_len, q.shape[1] // k.shape[1], q.dtype)
        return sdpa_lse_cascade(q, ks, vs, k, v, bias, scale, shared_len=shared_len)
    if not q.is_cuda and not interpreter_enabled():
        raise ValueError("impl: 'triton' needs CUDA tensors or TRITON_INTERPRET=1 set before importing treeattn")
    return _cascade_triton(q, ks, vs, k, v, suffix_lens, shared_len, tree_mask, scale, config or CascadeConfig())


@torch.library.custom_op("treeattn::cascade_tree_attention", mutates_args=())
def cascade_tree_attention_op(q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, suffix_lens: torch.Tensor, shared_len: torch.Tensor,
                              words: torch.Tensor, depth: torch.Tensor, scale: float, impl: str) -> torch.Tensor:
    """``cascade_tree_attention`` over a fixed-capacity prefix as a PyTorch custom op, for
    ``torch.compile``d callers (the fixed-shape forwards of ``specdec.graphs``).

    The compiler sees one opaque op (its output is shaped like ``q``) instead of tracing the
    validation and the Triton launch; at run time it is ``cascade_tree_attention(q, k_shared,
    v_shared, k, v, suffix_lens, TreeMask(words, depth), scale, impl, shared_len=shared_len,
    check_suffix_lens=False)`` (shapes as there; ``shared_len`` int ``[1]``: the live prefix length,
    data, so that nothing the compiler specializes on depends on it). Returns ``[n, Hq, t, D]`` laid
    out as ``[n, t, Hq, D]`` (``treeattn.ops.new_output``).
    """
    out = cascade_tree_attention(q, k_shared, v_shared, k, v, suffix_lens, TreeMask(words, depth), scale, impl,
                                 shared_len=shared_len, check_suffix_lens=False)
    return heads_inner(out)


@cascade_tree_attention_op.register_fake
def _cascade_tree_attention_fake(q, k_shared, v_shared, k, v, suffix_lens, shared_len, words, depth, scale, impl):
    return new_output(q)


class CascadePlan(NamedTuple):
    """Configs and split plans for one call (``cascade_plan``); ``suffix`` / ``suffix_plan`` are
    None in the fused kernel."""

    prefix: KernelConfig
    prefix_plan: PrefixPlan
    suffix: KernelConfig | None
    suffix_plan: SplitPlan | None


def cascade_plan(n: int, num_heads: int, num_kv_heads: int, t: int, prefix_len: int, seq_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 config: CascadeConfig | None = None) -> CascadePlan:
    """The folded-row kernel from ``pick_prefix_config`` (``n * t * group`` rows per KV head; fused:
    its last split also runs level 2, ``level2_tiles``); not fused, level 2 from
    ``tree_attention``'s ``pick_config`` over the per-sequence caches (batch n, "prompt" = suffix).
    ``prefix_len``: the prefix's keys, or the capacity C of its buffer when its live length is
    device data (``shared_len``): the plan is then fixed per C. ``config`` overrides either. Pure
    host arithmetic."""
    config = config or CascadeConfig()
    group = num_heads // num_kv_heads
    rows = n * t * group
    if config.fused:
        pcfg, _ = pick_prefix_config(rows, num_kv_heads, prefix_len, head_dim, device, dtype, config.prefix)
        candidates = [pcfg]
        if config.prefix is None:  # narrower row blocks: fewer sequences' suffixes in each last split
            candidates += [replace(pcfg, block_m=m) for m in (32, 16) if m < pcfg.block_m and rows < 256]
        best = None
        for cfg in candidates:  # the shortest critical path; ties keep the wider block
            extra = level2_tiles(cfg, group, t, seq_len - t)
            plan = prefix_splits(cfg, rows, num_kv_heads, prefix_len, device, extra)
            cost = fused_cost(cfg, plan, rows, num_kv_heads, extra, device)
            if best is None or cost < best[0]:
                best = (cost, cfg, plan)
        return CascadePlan(best[1], best[2], None, None)
    pcfg, pplan = pick_prefix_config(rows, num_kv_heads, prefix_len, head_dim, device, dtype, config.prefix)
    if config.suffix is None:
        scfg, splan = pick_config(n, num_kv_heads, group, t, seq_len, head_dim, device, dtype)
    else:
        scfg = config.suffix
        splan = _splits(scfg, n, num_kv_heads, group * t, seq_len - t, t, device)
    return CascadePlan(pcfg, pplan, scfg, splan)


def _cascade_triton(q, ks, vs, k, v, suffix_lens, shared_len, tree_mask, scale, config: CascadeConfig):
    from triton.runtime.errors import OutOfResources

    n, hq, t_len, d = q.shape
    hkv, p_len = ks.shape[0], ks.shape[1]  # P, or the capacity C with shared_len
    seq_len = k.shape[2]
    if p_len == 0:  # nothing shared (nor room for it): level 2 alone is the whole attention
        return tree_attention(q, k, v, suffix_lens, tree_mask, scale, impl="triton", check_prefix_lens=False,
                              config=config.suffix)
    plan = cascade_plan(n, hq, hkv, t_len, p_len, seq_len, d, q.device, q.dtype, config)
    while True:
        try:
            return run_plan(q, ks, vs, k, v, suffix_lens, tree_mask, scale, plan, shared_len=shared_len)
        except OutOfResources:
            # The shared-memory estimate was short for this GPU / compiler: shrink the auto configs.
            if config.prefix is not None and (config.fused or config.suffix is not None):
                raise  # explicit configs run as given
            shrunk = replace(config, prefix=config.prefix or _shrink(plan.prefix),
                             suffix=config.suffix or (None if config.fused else _shrink(plan.suffix)))
            plan = cascade_plan(n, hq, hkv, t_len, p_len, seq_len, d, q.device, q.dtype, shrunk)


def run_plan(q, ks, vs, k, v, suffix_lens, tree_mask, scale: float, plan: CascadePlan, *,
             shared_len: torch.Tensor | None = None) -> torch.Tensor:
    """Launch one call's kernels (validated inputs, ``ks, vs: [Hkv, P, D]`` with P >= 1, or
    ``[Hkv, C, D]`` with C >= 1 and the live length ``shared_len``, int ``[1]``, on the device)."""
    if plan.suffix is None:
        return launch_fused(q, ks, vs, k, v, suffix_lens, tree_mask, scale, plan.prefix, plan.prefix_plan,
                            shared_len=shared_len)
    return _launch(q, ks, vs, k, v, suffix_lens, shared_len, tree_mask, scale, plan.prefix, plan.prefix_plan,
                   plan.suffix, plan.suffix_plan)


def _prefix_len_args(ks, shared_len, dummy: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """The kernels' ``(PREFIX_LEN, prefix_cap, LEN_ON_DEVICE)``: the shape P (``dummy`` as the unread
    pointer), or the capacity C and the device length ``shared_len``."""
    if shared_len is None:
        return dummy, ks.shape[1], False
    return shared_len, ks.shape[1], True


def launch_fused(q, ks, vs, k, v, suffix_lens, tree_mask, scale: float, cfg: KernelConfig,
                 plan: PrefixPlan, *, shared_len: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel (and, with several splits, the tree kernel's merge)."""
    from treeattn.cascade_kernels import cascade_fused_kernel
    from treeattn.kernels import tree_attn_merge_kernel

    n, hq, t_len, d = q.shape
    hkv = ks.shape[0]
    seq_len = k.shape[2]
    group = hq // hkv
    block_d = max(16, _next_pow2(d))
    prefix_len_ptr, prefix_cap, len_on_device = _prefix_len_args(ks, shared_len, suffix_lens)
    words = tree_mask.words
    if words.stride(-1) != 1:
        words = words.contiguous()
    stride_wb = 0 if tree_mask.batch_size == 1 else words.stride(0)
    out = new_output(q)
    splits = plan.count
    if splits > 1:
        part_o, part_lse = _partials(q, splits, cfg.partials_in_input_dtype)
    else:
        part_o = part_lse = out  # unused by the one-split kernel
    folded = n * t_len * group
    cascade_fused_kernel[(math.ceil(folded / cfg.block_m), hkv, splits)](
        q, ks, vs, k, v, suffix_lens, prefix_len_ptr, words, out, part_o, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        stride_wb, words.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        t_len, prefix_cap, seq_len, hkv, folded, plan.chunk, plan.first, splits,
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
        LEN_ON_DEVICE=len_on_device,
        UPCAST=interpreter_enabled() and q.dtype != torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        rows = n * hq * t_len
        block_s = _next_pow2(splits)
        block_r = max(1, 2048 // (block_s * block_d))  # as tree_attention's merge: [R, S, D] <= 2048 floats
        tree_attn_merge_kernel[(math.ceil(rows / block_r),)](
            part_o, part_lse, out,
            out.stride(0), out.stride(1), out.stride(2),
            hq, t_len, rows, splits,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_S=block_s, num_warps=4,
        )
    return out


def _launch(q, ks, vs, k, v, suffix_lens, shared_len, tree_mask, scale, pcfg: KernelConfig, pplan: PrefixPlan,
            scfg: KernelConfig, splan: SplitPlan):
    prefix_states = launch_prefix(q, ks, vs, scale, pcfg, pplan, shared_len=shared_len)
    suffix_states = launch_suffix(q, k, v, suffix_lens, tree_mask, scale, scfg, splan)
    return launch_merge(q, prefix_states, suffix_states)


def _partials(q, splits: int, in_input_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty partial states of ``splits`` per output row: outputs ``[n * Hq * t * splits * D]``
    (float32 or q's dtype) and base-2 log-sum-exps ``[n * Hq * t * splits]`` float32."""
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    part_o = torch.empty(rows * splits * q.shape[3], device=q.device,
                         dtype=q.dtype if in_input_dtype else torch.float32)
    return part_o, torch.empty(rows * splits, device=q.device, dtype=torch.float32)


def launch_prefix(q, ks, vs, scale: float, cfg: KernelConfig, plan: PrefixPlan, *,
                  shared_len: torch.Tensor | None = None):
    """Level 1 alone (validated inputs; ``ks, vs: [Hkv, P, D]``, P >= 1, or ``[Hkv, C, D]`` with the
    live length ``shared_len``): returns its partial states ``(part_o, part_lse, splits)``."""
    from treeattn.cascade_kernels import cascade_prefix_kernel

    n, hq, t_len, d = q.shape
    hkv = ks.shape[0]
    group = hq // hkv
    part_o, part_lse = _partials(q, plan.count, cfg.partials_in_input_dtype)
    prefix_len_ptr, prefix_cap, len_on_device = _prefix_len_args(ks, shared_len, part_lse)
    folded = n * t_len * group
    cascade_prefix_kernel[(math.ceil(folded / cfg.block_m), hkv, plan.count)](
        q, ks, vs, prefix_len_ptr, part_o, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        ks.stride(0), ks.stride(1),
        vs.stride(0), vs.stride(1),
        t_len, prefix_cap, hkv, folded, plan.chunk, plan.first, plan.count,
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        LEN_ON_DEVICE=len_on_device,
        UPCAST=interpreter_enabled() and q.dtype != torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return part_o, part_lse, plan.count


def launch_suffix(q, k, v, suffix_lens, tree_mask, scale: float, cfg: KernelConfig, plan: SplitPlan):
    """Level 2 alone: the tree kernel over each sequence's own cache (``prefix_lens =
    suffix_lens``) in its split mode; returns its partial states ``(part_o, part_lse, splits)``."""
    from treeattn.kernels import tree_attn_fwd_kernel

    n, hq, t_len, d = q.shape
    hkv, seq_len = k.shape[1], k.shape[2]
    group = hq // hkv
    part_o, part_lse = _partials(q, plan.count, cfg.partials_in_input_dtype)
    words = tree_mask.words
    if words.stride(-1) != 1:
        words = words.contiguous()
    stride_wb = 0 if tree_mask.batch_size == 1 else words.stride(0)
    assert not cfg.gather or plan.count == 1 or plan.first % cfg.block_n == 0, (plan, cfg.block_n)
    tree_attn_fwd_kernel[(math.ceil(group * t_len / cfg.block_m), n * hkv, plan.count)](
        q, k, v, suffix_lens, words, part_o, part_o, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        stride_wb, words.stride(1),
        0, 0, 0,  # OUT is not written in the split mode
        t_len, seq_len, hkv, plan.chunk, plan.first, plan.count,
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=d, BLOCK_D=max(16, _next_pow2(d)), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_T=cfg.block_t, WINDOW_WORDS=_window_words(t_len),
        GATHER=cfg.gather, SPLIT=True,
        UPCAST=interpreter_enabled() and q.dtype != torch.float32,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WARP_SPECIALIZE=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return part_o, part_lse, plan.count


def launch_merge(q, prefix_states, suffix_states) -> torch.Tensor:
    """Combine the two levels' partial states by log-sum-exp into a new ``[n, Hq, t, D]`` tensor."""
    from treeattn.cascade_kernels import cascade_merge_kernel

    n, hq, t_len, d = q.shape
    (p1_o, p1_lse, s1), (p2_o, p2_lse, s2) = prefix_states, suffix_states
    rows = n * hq * t_len
    block_d = max(16, _next_pow2(d))
    out = new_output(q)
    bs1, bs2 = max(2, _next_pow2(s1)), max(2, _next_pow2(s2))
    block_r = max(1, _prev_pow2(4096 // ((bs1 + bs2) * block_d)))  # [R, S1 + S2, D] tile <= 4096 floats
    cascade_merge_kernel[(math.ceil(rows / block_r),)](
        p1_o, p1_lse, p2_o, p2_lse, out,
        out.stride(0), out.stride(1), out.stride(2),
        hq, t_len, rows, s1, s2,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_S1=bs1, BLOCK_S2=bs2, num_warps=4,
    )
    return out


def _prev_pow2(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


# ---- torch path: two SDPA calls merged by log-sum-exp (also the benchmark's baseline) -------------


def suffix_bias(suffix_lens: torch.Tensor, tree_mask: TreeMask, seq_len: int, group: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Additive mask of level 2 for ``sdpa_lse_cascade``: ``[n, 1, group * t, S]`` (0 where query
    row ``g * t + i`` of sequence b sees key s of its cache, ``-inf`` elsewhere), in a buffer whose
    rows are padded to a multiple of 16 keys (memory-efficient attention's alignment)."""
    n = suffix_lens.shape[0]
    t_len = tree_mask.n
    device = suffix_lens.device
    pos = torch.arange(seq_len, device=device)
    sl = suffix_lens.to(torch.int64).view(n, 1, 1)
    rel = pos.view(1, 1, seq_len) - sl  # [n, 1, S]
    in_tree = (rel >= 0) & (rel < t_len)
    relc = rel.clamp(0, t_len - 1).expand(n, t_len, seq_len)
    words = tree_mask.words.to(device).expand(n, -1, -1)
    bit = ((words.gather(2, relc // 64) >> (relc % 64)) & 1).bool()
    visible = (rel < 0) | (in_tree & bit)  # [n, t, S]
    padded = math.ceil(seq_len / 16) * 16
    bias = torch.full((n, 1, group, t_len, padded), -math.inf, dtype=dtype, device=device)
    bias[..., :seq_len].masked_fill_(visible.view(n, 1, 1, t_len, seq_len), 0.0)
    return bias.view(n, 1, group * t_len, padded)[..., :seq_len]


def prefix_bias(shared_len: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask of level 1 for ``sdpa_lse_cascade`` over a prefix buffer of ``capacity`` slots
    whose first ``shared_len`` (int ``[1]``, on the device: no host read) are live: ``[1, 1, 1, C]``,
    0 for keys ``< shared_len``, ``-inf`` after, in a buffer padded to a multiple of 16 keys (as
    ``suffix_bias``)."""
    padded = math.ceil(capacity / 16) * 16
    pos = torch.arange(padded, device=shared_len.device)
    bias = torch.zeros(padded, dtype=dtype, device=shared_len.device)
    bias.masked_fill_(pos >= shared_len.to(torch.int64), -math.inf)
    return bias.view(1, 1, 1, padded)[..., :capacity]


def _sdpa_lse(q, k, v, bias, scale):
    """(output, natural-log LSE ``[B, H, M]`` float32) of SDPA through the aten ops that return it."""
    m = q.shape[2]
    if q.is_cuda:
        if bias is None and q.dtype != torch.float32 and q.shape[-1] % 8 == 0:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
        else:
            if bias is not None:
                bias = bias.expand(q.shape[0], q.shape[1], m, k.shape[2])
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False,
                                                                              scale=scale)[:2]
    else:
        if bias is not None:
            bias = bias.expand(q.shape[0], q.shape[1], m, k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                              scale=scale)
    return out, lse[..., :m].float()


def sdpa_lse_cascade(q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, bias: torch.Tensor, scale: float | None = None, *,
                     shared_len: torch.Tensor | None = None) -> torch.Tensor:
    """Cascade attention as two SDPA calls merged by log-sum-exp (FlashInfer's cascade recipe with
    stock kernels): the shared prefix with every query of a KV head folded into one unmasked
    call (flash attention on CUDA 16-bit), each sequence's suffix + tree with the additive mask
    ``bias`` (``suffix_bias``; memory-efficient attention on CUDA), then the merge in float32.
    With ``shared_len`` (int ``[1]`` on the device) the prefix is a buffer of C slots of which the
    first ``shared_len`` are live: level 1 is masked by ``prefix_bias`` and its state emptied
    (``-inf``, 0) when nothing is live, all without a host read of the length.

    Shapes as ``cascade_tree_attention`` (``k_shared``: ``[Hkv, P or C, D]`` or ``[1, Hkv, P or C,
    D]``); returns ``[n, Hq, t, D]`` in q's dtype.
    """
    n, hq, t_len, d = q.shape
    ks = k_shared[0] if k_shared.dim() == 4 else k_shared
    vs = v_shared[0] if v_shared.dim() == 4 else v_shared
    hkv, p_len = ks.shape[0], ks.shape[1]
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    q5 = q.reshape(n, hkv, group, t_len, d)
    # Level 2: [n, Hkv, G * t, D] queries (rows g * t + i), each sequence's own cache.
    out2, lse2 = _sdpa_lse(q5.reshape(n, hkv, group * t_len, d), k, v, bias, scale)
    if p_len == 0:
        return out2.reshape(n, hq, t_len, d).to(q.dtype)
    # Level 1: [1, Hkv, n * G * t, D] queries, one call over the prefix (unmasked, or masked past shared_len).
    qf = q5.permute(1, 0, 2, 3, 4).reshape(1, hkv, n * group * t_len, d)
    bias1 = None if shared_len is None else prefix_bias(shared_len, p_len, q.dtype)
    out1, lse1 = _sdpa_lse(qf, ks.unsqueeze(0), vs.unsqueeze(0), bias1, scale)
    out1 = out1.view(hkv, n, group * t_len, d).transpose(0, 1)
    lse1 = lse1.view(hkv, n, group * t_len).transpose(0, 1)
    if shared_len is not None:  # rows that see no key at all: the empty state (SDPA may give NaN there)
        live = shared_len.view(()) > 0
        out1 = torch.where(live, out1, 0.0)
        lse1 = torch.where(live, lse1, -math.inf)
    m = torch.maximum(lse1, lse2)
    w1 = torch.exp(lse1 - m).unsqueeze(-1)
    w2 = torch.exp(lse2 - m).unsqueeze(-1)
    out = (out1.float() * w1 + out2.float() * w2) / (w1 + w2)
    return out.reshape(n, hq, t_len, d).to(q.dtype)
