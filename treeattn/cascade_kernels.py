"""Triton kernels for shared-prefix ("cascade") tree attention. Only ``@triton.jit`` code lives
here; the op is ``treeattn.cascade.cascade_tree_attention``.

n sequences share one prompt whose KV is stored once (``KS, VS: [Hkv, P, D]``, or ``[Hkv, C, D]``
buffers of a fixed capacity C whose first P slots are live, P read from device memory: then
nothing about the launch depends on P, as a CUDA graph needs); sequence b's own tokens and tree
live in its own cache (``K, V: [n, Hkv, S, D]``). The attention of every tree
query is split in two levels whose partial states (normalized output + base-2 log-sum-exp) are
merged by log-sum-exp (FlashInfer's cascade attention, DeFT's global reduction):

* Level 1 (the first part of ``cascade_fused_kernel``; alone: ``cascade_prefix_kernel``): every
  query of every sequence against the shared prefix, which every query sees whole (no mask). The
  rows of one KV head are all ``n * t * GROUP`` queries that use it, folded together: row ``r``
  is head ``kv_head * GROUP + r % GROUP`` of tree node ``(r // GROUP) % t`` of sequence
  ``r // (GROUP * t)``. One program takes ``BLOCK_M`` consecutive rows (nodes of one or several
  sequences) and a key range of the prefix (the split axis, for long prefixes / few rows); every
  program of a KV head streams the same prefix tiles, so a tile comes from HBM once per KV head
  and from L2 for the other row blocks (programs of one KV head are adjacent in the launch
  order). Unmasked full tiles in a software-pipelined loop, then one masked tile for the range's
  ragged end.
* Level 2: each sequence's own suffix + tree. Fused (the default, ``cascade_fused_kernel``): the
  program that holds a row block's last prefix range continues, for each sequence of its block,
  with one pipelined loop of 64-key steps over that sequence's suffix and then its tree
  (ancestor words as the mask, rows of other sequences masked out), so one online-softmax state spans both levels and, with one split,
  the kernel writes the output. Two-level variant: tree attention with ``prefix_lens =
  suffix_lens`` over ``K, V``, ``treeattn.kernels.tree_attn_fwd_kernel`` in its split mode (it
  writes partial states), then ``cascade_merge_kernel`` combines the two levels' states.

Partial-state layout (both levels, as ``tree_attn_fwd_kernel`` writes it): row ``(b * Hq + h) *
t + i`` of ``[n * Hq * t, splits, D]`` (outputs, fp32) and ``[n * Hq * t, splits]`` (base-2
log-sum-exps, fp32; ``-inf`` for an empty key range).
"""

import triton
import triton.language as tl

from treeattn.kernels import _attend_tile


@triton.jit
def _live_prefix_len(PREFIX_LEN, prefix_cap, LEN_ON_DEVICE: tl.constexpr):
    """The prefix keys every query attends: all ``prefix_cap`` of them (the prefix's shape), or with
    ``LEN_ON_DEVICE`` the int at ``PREFIX_LEN`` (data, e.g. a captured graph's input) clamped to
    ``[0, prefix_cap]``, ``prefix_cap`` then being the buffer's capacity: no key past it is read."""
    if LEN_ON_DEVICE:
        live = tl.minimum(tl.maximum(tl.load(PREFIX_LEN).to(tl.int32), 0), prefix_cap)
    else:
        live = prefix_cap
    return live


@triton.jit
def _attend_prefix_range(
    acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, lo, hi, hi_all, offs_n, offs_d, d_ok, qk_scale,
    BLOCK_N: tl.constexpr, EVEN_D: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The online-softmax state of ``BLOCK_M`` rows advanced over prefix keys ``[lo, hi_all)`` of
    one KV head (``k_base`` / ``v_base`` point at its first key): unmasked full tiles in a
    software-pipelined loop up to ``hi``, then the range's ragged end ``[hi, hi_all)`` as one
    masked tile (only the split holding the prefix's end has one)."""
    for start in tl.range(lo, hi, BLOCK_N):
        kv = start + offs_n
        if EVEN_D:
            k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :])
            v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :])
        else:
            k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, UPCAST, DOT_PRECISION)
    if hi < hi_all:
        kv = hi + offs_n
        kv_ok = kv < hi_all
        k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, kv_ok[None, :], qk_scale, True, UPCAST, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def cascade_prefix_kernel(
    Q, KS, VS, PREFIX_LEN, PART_O, PART_LSE,
    stride_qb, stride_qh, stride_qn,
    stride_kh, stride_ks,
    stride_vh, stride_vs,
    n_tree, prefix_cap, num_kv_heads, num_rows, chunk, first, num_splits,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LEN_ON_DEVICE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Level 1 alone (the two-level variant): rows ``[pid_m * BLOCK_M, ...)`` of KV head ``pid_h``
    (``num_rows = n * t * GROUP``) against their key range of the prefix: ``[0, first)`` for the
    last split, ``[first + i * chunk, first + (i + 1) * chunk)`` for split i < last, clipped to the
    live prefix (``_live_prefix_len``); a range left empty writes the empty state (``-inf``, 0)."""
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    node = rows // GROUP  # b * n_tree + i
    b = (node // n_tree).to(tl.int64)
    qi = (node % n_tree).to(tl.int64)
    qh = kvh * GROUP + (rows % GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(
        Q + b[:, None] * stride_qb + qh[:, None] * stride_qh + qi[:, None] * stride_qn + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = KS + kvh * stride_kh
    v_base = VS + kvh * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    is_last = pid_s == num_splits - 1
    prefix_len = _live_prefix_len(PREFIX_LEN, prefix_cap, LEN_ON_DEVICE)
    lo = tl.where(is_last, 0, first + pid_s * chunk)
    hi_all = tl.minimum(tl.where(is_last, first, lo + chunk), prefix_len)
    hi = lo + tl.maximum(hi_all - lo, 0) // BLOCK_N * BLOCK_N
    acc, m_i, l_i = _attend_prefix_range(acc, m_i, l_i, q, k_base, v_base, stride_ks, stride_vs, lo, hi, hi_all,
                                         offs_n, offs_d, d_ok, qk_scale, BLOCK_N, EVEN_D, UPCAST, DOT_PRECISION)  # fmt: skip

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # 0 only in padding rows or an empty key range
    o = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
    part = ((b * (num_kv_heads * GROUP) + qh) * n_tree + qi) * num_splits + pid_s
    tl.store(PART_O + part[:, None] * HEAD_DIM + offs_d[None, :], o.to(PART_O.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(PART_LSE + part, lse, mask=row_ok)


@triton.jit
def cascade_merge_kernel(
    PART1_O, PART1_LSE, PART2_O, PART2_LSE, OUT,
    stride_ob, stride_oh, stride_on,
    num_heads, n_tree, num_rows, splits1, splits2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_S1: tl.constexpr, BLOCK_S2: tl.constexpr,
):
    """Combine each row's ``splits1`` level-1 and ``splits2`` level-2 partial states (normalized
    outputs weighted by ``2 ** (lse - max lse)``) and write the output row ``(b, h, i)``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < num_rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_1 = tl.arange(0, BLOCK_S1)
    offs_2 = tl.arange(0, BLOCK_S2)
    ok1 = r_ok[:, None] & (offs_1 < splits1)[None, :]
    ok2 = r_ok[:, None] & (offs_2 < splits2)[None, :]
    p1 = rows[:, None] * splits1 + offs_1[None, :]
    p2 = rows[:, None] * splits2 + offs_2[None, :]
    lse1 = tl.load(PART1_LSE + p1, mask=ok1, other=float("-inf"))
    lse2 = tl.load(PART2_LSE + p2, mask=ok2, other=float("-inf"))
    m = tl.maximum(tl.max(lse1, 1), tl.max(lse2, 1))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.math.exp2(lse1 - m_safe[:, None])
    w2 = tl.math.exp2(lse2 - m_safe[:, None])
    l = tl.sum(w1, 1) + tl.sum(w2, 1)
    o1 = tl.load(PART1_O + p1[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                 mask=ok1[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
    o2 = tl.load(PART2_O + p2[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                 mask=ok2[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
    out = (tl.sum(o1 * w1[:, :, None], 1) + tl.sum(o2 * w2[:, :, None], 1)) / tl.where(l == 0.0, 1.0, l)[:, None]
    b = rows // (num_heads * n_tree)
    h = (rows // n_tree) % num_heads
    i = rows % n_tree
    out_ptrs = OUT + b[:, None] * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_on + offs_d[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


@triton.jit
def cascade_fused_kernel(
    Q, KS, VS, K, V, SUFFIX_LENS, PREFIX_LEN, WORDS, OUT, PART_O, PART_LSE,
    stride_qb, stride_qh, stride_qn,
    stride_ksh, stride_kss, stride_vsh, stride_vss,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_wb, stride_wn,
    stride_ob, stride_oh, stride_on,
    n_tree, prefix_cap, seq_len, num_kv_heads, num_rows, chunk, first, num_splits,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, LEN_ON_DEVICE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Both levels in one program (the default): the folded rows of ``cascade_prefix_kernel``
    attend their key range of the shared prefix; the last program of the split axis then goes on,
    sequence by sequence over the (one to a few) sequences its row block holds, with one
    pipelined loop of 64-key steps over that sequence's suffix and then its tree (rows of other
    sequences masked out), so the online softmax carries one state through both levels: no
    level-2 launch and no partial states at all with one split. Split i < last takes prefix keys ``[first + i * chunk, ...)``, the last
    split ``[0, first)`` before the suffixes (sized so that the splits even out), each clipped to
    the live prefix (``_live_prefix_len``: the shape, or a length read from ``PREFIX_LEN`` when the
    prefix is a buffer of ``prefix_cap`` slots, so that one launch serves any live length); several
    splits write partial states for ``treeattn.kernels.tree_attn_merge_kernel`` (a split whose
    range is empty, and which holds no level 2, writes the empty state: ``-inf``, 0)."""
    WORD_BITS: tl.constexpr = 64
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_m = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < num_rows
    node = rows // GROUP  # b * n_tree + i
    b_row = node // n_tree
    b = b_row.to(tl.int64)
    qi = (node % n_tree).to(tl.int64)
    qh = kvh * GROUP + (rows % GROUP)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(
        Q + b[:, None] * stride_qb + qh[:, None] * stride_qh + qi[:, None] * stride_qn + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)

    # Level 1: the split's range of the shared prefix, every row sees every key.
    is_last = pid_s == num_splits - 1
    prefix_len = _live_prefix_len(PREFIX_LEN, prefix_cap, LEN_ON_DEVICE)
    lo = tl.where(is_last, 0, first + pid_s * chunk)
    hi_all = tl.minimum(tl.where(is_last, first, lo + chunk), prefix_len)
    hi = lo + tl.maximum(hi_all - lo, 0) // BLOCK_N * BLOCK_N
    ks_base = KS + kvh * stride_ksh
    vs_base = VS + kvh * stride_vsh
    acc, m_i, l_i = _attend_prefix_range(acc, m_i, l_i, q, ks_base, vs_base, stride_kss, stride_vss, lo, hi, hi_all,
                                         offs_n, offs_d, d_ok, qk_scale, BLOCK_N, EVEN_D, UPCAST, DOT_PRECISION)  # fmt: skip

    # Level 2 (last split): each sequence of the row block, its own suffix then its tree.
    if is_last:
        seq_rows = GROUP * n_tree
        row_lo = pid_m * BLOCK_M
        row_hi = tl.minimum(row_lo + BLOCK_M, num_rows) - 1
        offs_t = tl.arange(0, WORD_BITS)
        n_words = (n_tree + WORD_BITS - 1) // WORD_BITS
        # int64 bounds: the sequence index scales the cache strides.
        seq_lo = (row_lo // seq_rows).to(tl.int64)
        seq_hi = (row_hi // seq_rows).to(tl.int64)
        for s in range(seq_lo, seq_hi + 1):
            in_seq = row_ok & (b_row == s)
            # Clamped so that bad suffix lengths can never read outside the cache.
            sl = tl.load(SUFFIX_LENS + s).to(tl.int32)
            sl = tl.minimum(tl.maximum(sl, 0), seq_len - n_tree)
            k_base = K + s * stride_kb + kvh * stride_kh
            v_base = V + s * stride_vb + kvh * stride_vh
            # Tree keys past the block's last node of this sequence are never visible (ancestors precede a node).
            last_i = tl.where(s == seq_hi, (row_hi // GROUP) % n_tree, n_tree - 1)
            w_ptrs = WORDS + s * stride_wb + qi * stride_wn
            # One software-pipelined loop of 64-key tiles (the loads depend on the step only through
            # scalars, so the next tiles are prefetched): first the suffix [0, sl) (the last of
            # these tiles masked at sl), then the tree tiles starting at sl, each masked by one
            # ancestor word per row (0 for rows of other sequences), read as two int32 halves.
            n_suf = (sl + WORD_BITS - 1) // WORD_BITS
            n_steps = n_suf + tl.minimum(last_i // WORD_BITS + 1, n_words)
            for it in tl.range(0, n_steps):
                is_tree = it >= n_suf
                w = tl.maximum(it - n_suf, 0)
                kv = tl.where(is_tree, sl + w * WORD_BITS, it * WORD_BITS) + offs_t
                kv_ok = kv < tl.where(is_tree, sl + n_tree, sl)
                k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
                v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
                words = tl.load(w_ptrs + w, mask=in_seq, other=0)
                half = tl.where((offs_t < 32)[None, :], words.to(tl.int32)[:, None], (words >> 32).to(tl.int32)[:, None])
                bits = ((half >> (offs_t % 32)[None, :]) & 1) != 0
                visible = tl.where(is_tree, bits, in_seq[:, None] & kv_ok[None, :])
                acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, True, UPCAST, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # 0 only in padding rows or an empty prefix range
    o = acc / l_safe[:, None]
    od_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part = ((b * (num_kv_heads * GROUP) + qh) * n_tree + qi) * num_splits + pid_s
        tl.store(PART_O + part[:, None] * HEAD_DIM + offs_d[None, :], o.to(PART_O.dtype.element_ty), mask=od_ok)
        tl.store(PART_LSE + part, lse, mask=row_ok)
    else:
        out_ptrs = OUT + b[:, None] * stride_ob + qh[:, None] * stride_oh + qi[:, None] * stride_on + offs_d[None, :]
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=od_ok)
