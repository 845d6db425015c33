"""Triton kernels of ``drafters.selection.row_topk``: the k largest entries of a few long rows.

Each entry becomes one int64 key that orders like (value, -column): the float32 value's bits made
order-preserving as a signed int32 (negative floats: all bits but the sign flipped) in the high
half, ``2^32 - 1 - column`` in the low half, so equal values rank the smaller column first and a
key decodes back to both. ``chunk_topk_kernel`` runs one program per (row, chunk of ``BLOCK``
columns) and writes the chunk's K best keys (``tl.topk``, a bitonic partial sort in registers);
``merge_topk_kernel`` runs one program per row over its chunks' keys and writes the row's k best
values and columns. Columns past the row's end read as -inf with columns >= n, so they rank below
every real entry, -inf ones included.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["chunk_topk_kernel", "merge_topk_kernel"]


@triton.jit
def chunk_topk_kernel(x_ptr, keys_ptr, n, stride_row, chunks, K: tl.constexpr, BLOCK: tl.constexpr):
    """keys[row, chunk, :K] = the K largest keys of ``x[row, chunk * BLOCK : (chunk + 1) * BLOCK]``."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + row * stride_row + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
    bits = v.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    low = tl.full([BLOCK], 0xFFFFFFFF, tl.int64) - cols.to(tl.int64)
    key = (ordered.to(tl.int64) << 32) | low
    top = tl.topk(key, K)
    tl.store(keys_ptr + (row * chunks + chunk) * K + tl.arange(0, K), top)


@triton.jit
def merge_topk_kernel(keys_ptr, vals_ptr, idx_ptr, m, k, K: tl.constexpr, BLOCK: tl.constexpr):
    """The row's k largest of its ``m`` chunk keys, decoded: values (float32) and columns (int64)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    key = tl.load(keys_ptr + row * m + offs, mask=offs < m, other=-(2**63))
    top = tl.topk(key, K)
    ordered = (top >> 32).to(tl.int32)
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    val = bits.to(tl.float32, bitcast=True)
    col = 0xFFFFFFFF - (top & 0xFFFFFFFF)
    out = tl.arange(0, K)
    tl.store(vals_ptr + row * k + out, val, mask=out < k)
    tl.store(idx_ptr + row * k + out, col, mask=out < k)
