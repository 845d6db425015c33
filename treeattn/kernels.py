"""Triton kernels for tree attention. Only ``@triton.jit`` code lives here; see ``treeattn.ops``.

Layout of the work: one program per (block of folded query rows, batch x KV head, prompt split).
The ``GROUP`` query heads that share a KV head are folded into the rows (row ``r`` is tree node
``r // GROUP`` of query head ``kv_head * GROUP + r % GROUP``), so every prompt KV tile is loaded
once per KV head for all tree queries. The prompt is cut into key ranges, one per program on the
split axis, each run as a software-pipelined loop of unmasked ``BLOCK_N`` tiles; the last program
also attends the tree keys (the op sizes the ranges so that this evens out, ``ops._splits``). A
constexpr switch (v8) picks how:

* ``GATHER=True`` (v6/v7/v10): the last program takes the prompt's first ``first`` keys (whole
  tiles) and then the gathered tiles: the tree keys that some row of its block sees (below). The
  other programs split ``[first, prefix_len)`` in chunks of ``chunk`` keys, the one that reaches
  the prompt's ragged end with one masked tile for it (v10; before, the last program gathered that
  tail ahead of the tree keys, a second gathered step at 4000/256). With one split (or a short
  sequence of a batch, whose prompt ends inside ``[0, first)``) the last program's range holds the
  ragged end, and its tail ``[hi, prefix_len)`` leads the gathered slots (v7).
* ``GATHER=False`` (v3, ``main``'s tree part): split i takes ``[i * chunk, min((i + 1) * chunk,
  prefix_len))``, one masked tile for a ragged end; the last program then scans the tree in
  64-key tiles, one int64 ancestor word per row as the mask, up to its block's last node. No
  histogram / cumsum / gathers: less fixed latency where the tree is short or the prompt long.

With one split (``SPLIT=False``) the kernel writes the output. With several it writes normalized
partial outputs (fp32, or the input dtype: ``PART_O``'s dtype) and base-2 log-sum-exps (fp32),
combined by ``tree_attn_merge_kernel`` (a second launch).

Gathered tiles (v6: the tree union; v7: a prompt tail in front of it). A row block holds
consecutive depth-first nodes; the union of their ancestors is small (a depth-8 tree: <= 24 keys
for 16 nodes, <= 40 for 32, whatever n is), while scanning every 64-key word tile up to the
block's last node costs up to n / 64 tile steps. So the last program compacts the union and
attends only it, in tiles of ``BLOCK_T`` keys. Where the last program's range holds the prompt's
ragged end (``prefix_len % BLOCK_N`` keys, different per sequence: data, not shape), those keys
take no masked tile of their own: they lead the first window's slots, visible to every row, and
the union's keys follow; a tail longer than ``BLOCK_T`` takes several chunks (a separate masked
tile in the one-split kernel cost registers: a 16-byte spill at 64x128/4 warps on sm_90).

The ancestor words are read as int32 halves (32 positions each); the positions
``[0, last node]`` are taken in windows of ``2 * WINDOW_WORDS`` halves; per window:

1. union: the rows' ancestor halves of the window, OR-reduced over the block's valid rows (the
   first window's halves are loaded before the prompt loop, so their latency hides behind it);
2. compaction without scatter: ``bit[p]`` of each candidate position p and its inclusive rank
   ``incl = cumsum(bit)``; with ``lead`` tail slots first (the tail's length in the first window,
   0 in the others), tree slot j (``lead <= j < lead + count``) holds the position of the
   ``(j - lead)``-th set bit, which is ``#{p : incl[p] <= j - lead}`` (incl is non-decreasing),
   i.e. the running sum of a ``BLOCK_T``-bin histogram of ``incl - (c - lead)`` for the chunk
   starting at slot c (no scatter, no sort);
3. ``for c in range(0, lead + count, BLOCK_T)`` (usually one trip, none for an empty window; not
   software-pipelined: a pipelined loop measured 30 % slower at 4000/256): K/V rows gathered at
   ``hi + j`` for tail slots and ``prefix_len + idx[j]`` for tree slots; tail slots are visible to every row,
   and each row's visibility of tree slot j, bit ``idx[j] % 32`` of its half ``idx[j] // 32``, is
   re-read by a 2-D gather load of the (cache-resident) halves.

The only data-dependent control flow is the chunk loop's trip count, computed before it: no
branch sits between the index computation and the K/V loads (v4's lesson).
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
def _bit_or(a, b):
    return a | b


@triton.jit
def tree_attn_fwd_kernel(
    Q, K, V, PREFIX_LENS, WORDS, OUT, PART_O, PART_LSE,
    stride_qb, stride_qh, stride_qn,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_wb, stride_wn,
    stride_ob, stride_oh, stride_on,
    n_tree, seq_len, num_kv_heads, chunk, first, num_splits,
    qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, WINDOW_WORDS: tl.constexpr,
    GATHER: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
):
    """``WORDS``: int64 ancestor words ``[B or 1, n, words]`` (strides in int64 elements)."""
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
    is_last = pid_s == num_splits - 1
    # A node's ancestors precede it: tree positions past the block's last query hold no visible key.
    last_q = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, n_rows) - 1) // GROUP

    HALF: tl.constexpr = 32
    HALVES: tl.constexpr = 2 * WINDOW_WORDS
    offs_h = tl.arange(0, HALVES)
    if GATHER:
        # The tree part's first window of ancestor words as int32 halves, loaded now so that their
        # latency hides behind the prompt loop (only the last split attends the tree).
        h_ptrs = WORDS.to(tl.pointer_type(tl.int32)) + b * (2 * stride_wb) + qi * (2 * stride_wn)
        end_h = last_q // HALF + 1
        first_end_h = tl.where(is_last, end_h, 0)
        halves0 = tl.load(h_ptrs[:, None] + offs_h[None, :], mask=row_ok[:, None] & (offs_h < first_end_h)[None, :], other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Prompt part: every row sees every key of the prompt.
    offs_n = tl.arange(0, BLOCK_N)
    if GATHER:
        # The last split (it also attends the tree) takes the prompt's first ``first`` keys (whole
        # tiles); split i < last takes [first + i * chunk, first + (i + 1) * chunk), clipped to the
        # prompt, the prompt's ragged end as one masked tile. A last split whose range holds the
        # prompt's end (one split, or a short sequence of the batch) gathers its ragged tail
        # [hi, prefix_len) into the tree part's first slots instead (module docstring).
        lo = tl.where(is_last, 0, first + pid_s * chunk)
        hi_all = tl.minimum(tl.where(is_last, first, lo + chunk), prefix_len)
        hi = lo + tl.maximum(hi_all - lo, 0) // BLOCK_N * BLOCK_N
        n_tail = tl.where(is_last, hi_all - hi, 0)
        masked_end = tl.where(is_last, hi, hi_all)
    else:
        # v3: the split's keys [lo, min(lo + chunk, prefix_len)), full tiles then one masked tile.
        lo = pid_s * chunk
        hi_all = tl.minimum(lo + chunk, prefix_len)
        hi = lo + tl.maximum(hi_all - lo, 0) // BLOCK_N * BLOCK_N
        masked_end = hi_all
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        kv = start + offs_n
        if EVEN_D:
            k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :])
            v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :])
        else:
            k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=d_ok[None, :], other=0.0)
            v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, None, qk_scale, False, UPCAST, DOT_PRECISION)

    # The split's ragged end [hi, masked_end) as one masked tile (v3 mode; a non-last split in
    # GATHER mode, which only exists with several splits: no such tile in the one-split kernel).
    if (not GATHER) or SPLIT:
        if hi < masked_end:
            kv = hi + offs_n
            kv_ok = kv < masked_end
            k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
            v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=kv_ok[:, None] & d_ok[None, :], other=0.0)
            acc, m_i, l_i = _attend_tile(
                acc, m_i, l_i, q, k, v, kv_ok[None, :], qk_scale, True, UPCAST, DOT_PRECISION
            )

    if GATHER:
        # Gathered part (last program of the split axis): the prompt tail, then the tree keys that
        # some row of the block sees, in tiles of BLOCK_T keys, window by window (module docstring).
        # The ancestor words are read as int32 halves (HALF = 32 positions each): 32-bit shifts, and
        # half the registers for the per-key visibility.
        if is_last:
            offs_b = tl.arange(0, HALF)
            offs_j = tl.arange(0, BLOCK_T)
            for h0 in range(0, end_h, HALVES):
                # 1. Union of the valid rows' ancestor halves over the window, limited to the tree.
                h = h0 + offs_h
                later = tl.load(h_ptrs[:, None] + h[None, :], mask=row_ok[:, None] & (h < end_h)[None, :] & (h0 > 0), other=0)
                halves = tl.where(h0 == 0, halves0, later)
                union = tl.reduce(halves, 0, _bit_or)  # [HALVES] int32
                bits = (union[:, None] >> offs_b[None, :]) & 1  # [HALVES, HALF]
                bits = tl.where((h[:, None] * HALF + offs_b[None, :]) < n_tree, bits, 0)
                # 2. Inclusive rank of every candidate position p = h0 * HALF + offs_p (the number of
                # set bits at or before p) and the window's count.
                incl = tl.cumsum(tl.reshape(bits, [HALVES * HALF]), 0)
                count = tl.sum(tl.sum(bits, 1), 0)
                # The first window's slots start with the n_tail prompt-tail keys (seen by every row).
                lead = tl.where(h0 == 0, n_tail, 0)
                total = lead + count
                for c in tl.range(0, total, BLOCK_T, num_stages=1):
                    # 3. Slot j >= lead holds the (j - lead)-th set bit, at position
                    # #{p : incl[p] <= j - lead} (incl is non-decreasing): a histogram of
                    # incl - (c - lead) over the slots (ranks below the chunk in bin 0, ranks past it
                    # left out), summed up. Slots j < lead are the tail's prompt keys p_full + j.
                    x = incl - (c - lead)
                    hist = tl.histogram(tl.maximum(x, 0), BLOCK_T, mask=x < BLOCK_T)
                    j = c + offs_j
                    j_ok = j < total
                    is_tail = j < lead
                    in_tree = j_ok & (j >= lead)
                    t = tl.where(in_tree, h0 * HALF + tl.cumsum(hist, 0), 0)
                    kv = tl.where(is_tail, hi + j, prefix_len + t)
                    kv_mask = j_ok[:, None] & d_ok[None, :]
                    k = tl.load(k_base + kv[:, None] * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
                    v = tl.load(v_base + kv[:, None] * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
                    # Each row's bit for each gathered tree key: a gather of the (cache-resident) halves.
                    wv = tl.load(h_ptrs[:, None] + (t // HALF)[None, :], mask=row_ok[:, None] & in_tree[None, :], other=0)
                    visible = (((wv >> (t % HALF)[None, :]) & 1) != 0) | is_tail[None, :]
                    acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, k, v, visible, qk_scale, True, UPCAST, DOT_PRECISION)
    else:
        # v3: (last split) the tree in 64-key tiles, visibility from one int64 word per row.
        if is_last:
            offs_t = tl.arange(0, WORD_BITS)
            n_words = (n_tree + WORD_BITS - 1) // WORD_BITS
            w_ptrs = WORDS + b * stride_wb + qi * stride_wn
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
    od_ok = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(l_safe))
        part_base = ((b * num_kv_heads * GROUP + qh) * n_tree + qi) * num_splits
        tl.store(PART_O + (part_base + pid_s)[:, None] * HEAD_DIM + offs_d[None, :],
                 o.to(PART_O.dtype.element_ty), mask=od_ok)
        tl.store(PART_LSE + part_base + pid_s, lse, mask=row_ok)
    else:
        out_ptrs = OUT + b * stride_ob + qh[:, None] * stride_oh + qi[:, None] * stride_on + offs_d[None, :]
        tl.store(out_ptrs, o.to(OUT.dtype.element_ty), mask=od_ok)


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
    o = tl.load(PART_O + part[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=o_mask, other=0.0).to(tl.float32)
    out = tl.sum(o * wgt[:, :, None], 1) / tl.where(l == 0.0, 1.0, l)[:, None]
    b = rows // (num_heads * n_tree)
    h = (rows // n_tree) % num_heads
    i = rows % n_tree
    out_ptrs = OUT + b[:, None] * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_on + offs_d[None, :]
    tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=(rows < num_rows)[:, None] & (offs_d < HEAD_DIM)[None, :])
