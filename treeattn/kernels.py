"""Triton kernels for tree attention. Only ``@triton.jit`` code lives here; see ``treeattn.ops``.

Layout of the work: one program per (block of folded query rows, batch x KV head, prompt split).
The ``GROUP`` query heads that share a KV head are folded into the rows (row ``r`` is tree node
``r // GROUP`` of query head ``kv_head * GROUP + r % GROUP``), so every prompt KV tile is loaded
once per KV head for all tree queries. The prompt ``[0, prefix_len)`` is cut into chunks of
``chunk`` tokens, one per program on the split axis; the last program also attends the tree keys,
masked by the int64 ancestor words (the op sizes the chunks so that this evens out). With one
split (``SPLIT=False``) the kernel writes the output; with several it writes normalized partial
outputs and base-2 log-sum-exps that ``tree_attn_merge_kernel`` combines.
"""

import triton
import triton.language as tl


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, k, v, visible, qk_scale,
    MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of ``BLOCK_M`` query rows over one KV tile (log2 domain)."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    # m is kept in the scaled (log2) domain; the scale folds into one FMA per score.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead to avoid NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    p = tl.math.exp2(s * qk_scale - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def tree_attn_fwd_kernel(
    Q, K, V, PREFIX_LENS, WORDS, OUT, PART_O, PART_LSE,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_wb, stride_wn,
    stride_ob, stride_oh, stride_on,
    n_tree, seq_len, num_kv_heads, chunk, num_splits,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    WORD_BITS: tl.constexpr = 64
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = (pid_bh // num_kv_heads).to(tl.int64)
    kvh = (pid_bh % num_kv_heads).to(tl.int64)

    n_rows = n_tree * GROUP
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    qi = rows // GROUP
    qh = kvh * GROUP + rows % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM

    q = tl.load(
        Q + b * stride_qb + qh[:, None] * stride_qh + qi[:, None] * stride_qn + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Clamped so that bad prefix lengths can never read outside the cache.
    prefix_len = tl.load(PREFIX_LENS + b).to(tl.int32)
    prefix_len = tl.minimum(tl.maximum(prefix_len, 0), seq_len - n_tree)
    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Prompt part: every row sees every key of [lo, hi). Full tiles first, then one masked tail.
    offs_n = tl.arange(0, BLOCK_N)
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, prefix_len)
    hi_full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    for start in tl.range(lo, hi_full, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        kv = start + offs_n
        if EVEN_D:
            k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :])
            v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :])
        else:
            k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, UPCAST, DOT_PRECISION)
    if hi_full < hi:
        kv = hi_full + offs_n
        kv_ok = kv < hi
        k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, k, v, kv_ok[None, :], qk_scale, True, UPCAST, DOT_PRECISION
        )

    # Tree part (last program of the split axis): 64 tree keys per tile, visibility from one int64 word per row.
    if pid_s == num_splits - 1:
        offs_t = tl.arange(0, WORD_BITS)
        n_words = (n_tree + WORD_BITS - 1) // WORD_BITS
        w_ptrs = WORDS + b * stride_wb + qi * stride_wn
        # A node's ancestors precede it: tiles past the block's last query hold no visible key.
        last_q = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
        for w in range(0, tl.minimum(last_q // WORD_BITS + 1, n_words)):
            words = tl.load(w_ptrs + w, mask=row_ok, other=0)
            t = w * WORD_BITS + offs_t
            t_ok = t < n_tree
            kv = prefix_len + t
            k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
            visible = ((words[:, None] >> offs_t[None, :].to(tl.int64)) & 1) != 0
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, True, UPCAST, DOT_PRECISION)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # 0 only in padding rows or empty prompt chunks
    o = acc / l_safe[:, None]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part_row = ((b * num_kv_heads * GROUP + qh) * n_tree + qi) * num_splits + pid_s
        tl.store(PART_O + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(PART_LSE + part_row, lse, mask=row_ok)
    else:
        out_ptrs = OUT + b * stride_ob + qh[:, None] * stride_oh + qi[:, None] * stride_on + offs_d[None, :]
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def tree_attn_merge_kernel(
    PART_O, PART_LSE, OUT,
    stride_ob, stride_oh, stride_on,
    num_heads, n_tree, num_rows, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Combine ``num_splits`` normalized partial outputs per row by their base-2 log-sum-exps.

    All splits of ``BLOCK_R`` rows are loaded at once as one ``[BLOCK_R, BLOCK_S, BLOCK_D]`` tile.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    rs_ok = (rows < num_rows)[:, None] & (offs_s < num_splits)[None, :]
    part = rows[:, None] * num_splits + offs_s[None, :]
    lse = tl.load(PART_LSE + part, mask=rs_ok, other=float("-inf"))
    m = tl.max(lse, 1)
    wgt = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m)[:, None])
    l = tl.sum(wgt, 1)
    o_mask = rs_ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :]
    o = tl.load(PART_O + part[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=o_mask, other=0.0)
    out = tl.sum(o * wgt[:, :, None], 1) / tl.where(l == 0.0, 1.0, l)[:, None]
    b = rows // (num_heads * n_tree)
    h = (rows // n_tree) % num_heads
    i = rows % n_tree
    out_ptrs = OUT + b[:, None] * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_on + offs_d[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=(rows < num_rows)[:, None] & (offs_d < HEAD_DIM)[None, :])
