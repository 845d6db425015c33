"""Triton kernels for tree attention. Only ``@triton.jit`` code lives here; see ``treeattn.ops``.

Layout of the work: one program per (block of folded query rows, batch x KV head, prompt split).
The ``GROUP`` query heads that share a KV head are folded into the rows (row ``r`` is tree node
``r // GROUP`` of query head ``kv_head * GROUP + r % GROUP``), so every prompt KV tile is loaded
once per KV head for all tree queries. The prompt ``[0, prefix_len)`` is cut into chunks of
``chunk`` tokens, one per program on the split axis; the last program also attends the tree keys
(the op sizes the chunks so that this evens out). With one split (``SPLIT=False``) the kernel
writes the output; with several it writes normalized partial outputs and base-2 log-sum-exps that
``tree_attn_merge_kernel`` combines.

Tree part. The tree keys are cut into tiles of ``BLOCK_T`` (16, 32 or 64) keys; a row block of
consecutive depth-first nodes of a shallow tree sees keys in only a few of them. The tiles are
taken in chunks of ``CHUNK_TILES`` (<= 64) tiles. Per chunk, a first pass loads only the int64
ancestor words of the block's rows and builds an int64 bitmask of the tiles that some row sees
(and their count); a second loop then runs exactly that many times, taking the lowest set bit of
the mask each time, and loads and attends that tile with the per-key bits of the words. No branch
sits between the words and the K/V loads, so the compiler can still prefetch the next tiles.
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
def _nonempty_tiles(w_ptrs, row_ok, tile0, n_words, BLOCK_T: tl.constexpr, CHUNK_TILES: tl.constexpr):
    """(bits, count) of the tree tiles ``[tile0, tile0 + CHUNK_TILES)`` that a row block sees.

    ``w_ptrs``: ``[BLOCK_M]`` pointers to each row's first ancestor word. Bit ``j`` of the int64
    ``bits`` is set iff some valid row has an ancestor (or itself) among the ``BLOCK_T`` keys of
    tile ``tile0 + j``; ``count`` (int32) is the number of set bits.
    """
    TILES_PER_WORD: tl.constexpr = 64 // BLOCK_T
    offs_c = tl.arange(0, CHUNK_TILES)
    tile = tile0 + offs_c
    word = tile // TILES_PER_WORD
    words = tl.load(w_ptrs[:, None] + word[None, :], mask=row_ok[:, None] & (word < n_words)[None, :], other=0)
    # Move the tile's BLOCK_T bits to the top of the word, dropping every other bit.
    shift = ((tile % TILES_PER_WORD) * BLOCK_T).to(tl.int64)
    tile_bits = (words >> shift[None, :]) << (64 - BLOCK_T)
    seen = tl.max((tile_bits != 0).to(tl.int32), 0)  # [CHUNK_TILES], 0 or 1
    # The set bits are distinct powers of two, so their sum is their OR (bit 63 included).
    bits = tl.sum(seen.to(tl.int64) << offs_c.to(tl.int64), 0)
    return bits, tl.sum(seen, 0)


@triton.jit
def _pop_lowest_bit(bits):
    """(index, rest) for int64 ``bits`` != 0: the index of its lowest set bit and ``bits`` without it.

    ``bits & -bits`` isolates the bit (for bit 63 too: the negation wraps to itself); int64 ->
    float32 converts a power of two exactly, and its exponent field is the index.
    """
    low = bits & -bits
    index = ((low.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return index, bits ^ low


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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, CHUNK_TILES: tl.constexpr,
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

    # Tree part (last program of the split axis): only the tiles of BLOCK_T tree keys that some row
    # of the block sees, chunk by chunk (see the module docstring); visibility from the words.
    if pid_s == num_splits - 1:
        TILES_PER_WORD: tl.constexpr = WORD_BITS // BLOCK_T
        offs_t = tl.arange(0, BLOCK_T)
        n_words = (n_tree + WORD_BITS - 1) // WORD_BITS
        w_ptrs = WORDS + b * stride_wb + qi * stride_wn
        # A node's ancestors precede it: keys past the block's last query are never visible.
        last_q = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP
        for key0 in range(0, last_q + 1, CHUNK_TILES * BLOCK_T):
            tile0 = key0 // BLOCK_T
            bits, n_tiles = _nonempty_tiles(w_ptrs, row_ok, tile0, n_words, BLOCK_T, CHUNK_TILES)
            for _ in range(n_tiles):
                j, bits = _pop_lowest_bit(bits)
                tile = tile0 + j
                words = tl.load(w_ptrs + tile // TILES_PER_WORD, mask=row_ok, other=0)
                shift = (tile % TILES_PER_WORD) * BLOCK_T + offs_t
                visible = ((words[:, None] >> shift[None, :].to(tl.int64)) & 1) != 0
                t = tile * BLOCK_T + offs_t
                t_ok = t < n_tree
                kv = prefix_len + t
                k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
                v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
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
