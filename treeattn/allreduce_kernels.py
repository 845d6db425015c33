"""Triton kernel of ``treeattn.allreduce.push_all_reduce``: a sum over GPUs with one write per peer.

Every rank holds a slot of ``WORLD`` segments of ``SEG`` elements in memory its peers can write
(symmetric memory), all elements at the *sentinel*: the bit pattern of -0.0 (``0x8000`` for 16-bit,
``0x80000000`` for 32-bit elements). A rank's kernel:

1. **pushes** its input into segment ``RANK`` of every rank's slot (its own included), -0.0 written
   as +0.0 so that no real value looks like the sentinel;
2. **gathers**: for each segment in rank order, spins on volatile loads of its own slot until none
   of its elements is the sentinel (each element is one store: it arrives whole), adds it in float32,
   and puts the sentinel back (the slot is clean for the next call);
3. writes the sum (16-bit: rounded to nearest even by integer arithmetic, which the interpreter and
   the GPU compute alike).

No barrier round trip: the data carries its own arrival flag (the Lamport scheme of TensorRT-LLM's
low-latency all-reduce). A slot is reused only after every rank has passed some other all-reduce
in between (a peer's next push into it then follows the reset causally). Programs loop over
``CHUNKS`` chunks of ``BLOCK`` elements; the wrapper keeps the grid within the GPU's SMs, so every
program of every rank is resident and none waits on a program that cannot start.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["push_all_reduce_kernel"]


@triton.jit
def _slot(p: tl.constexpr, s0, s1, s2, s3, s4, s5, s6, s7):
    """Rank ``p``'s slot among the eight pointer arguments (``p`` known at compile time)."""
    if p == 0:
        return s0
    elif p == 1:
        return s1
    elif p == 2:
        return s2
    elif p == 3:
        return s3
    elif p == 4:
        return s4
    elif p == 5:
        return s5
    elif p == 6:
        return s6
    else:
        return s7


@triton.jit
def push_all_reduce_kernel(x_ptr, out_ptr, s0, s1, s2, s3, s4, s5, s6, s7, n, RANK: tl.constexpr,
                           WORLD: tl.constexpr, SEG: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr,
                           WIDE: tl.constexpr):  # fmt: skip
    """out[:n] = the sum over ranks of x[:n]; x, out and the slots as integer bits (WIDE: int32 of
    float32 values, else int16 of bfloat16 ones)."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if WIDE:
        sentinel = -2147483648
    else:
        sentinel = -32768
    for c in tl.static_range(CHUNKS):
        offs = (pid + c * programs) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        bits = tl.load(x_ptr + offs, mask=mask, other=0)
        bits = tl.where(bits == sentinel, 0, bits)
        for p in tl.static_range(WORLD):
            tl.store(_slot(p, s0, s1, s2, s3, s4, s5, s6, s7) + RANK * SEG + offs, bits, mask=mask)
    own = _slot(RANK, s0, s1, s2, s3, s4, s5, s6, s7)
    for c in tl.static_range(CHUNKS):
        offs = (pid + c * programs) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for q in tl.static_range(WORLD):
            v = tl.load(own + q * SEG + offs, mask=mask, other=0, volatile=True)
            while tl.sum(((v == sentinel) & mask).to(tl.int32)) > 0:
                v = tl.load(own + q * SEG + offs, mask=mask, other=0, volatile=True)
            if WIDE:
                acc += v.to(tl.float32, bitcast=True)
            else:
                acc += v.to(tl.bfloat16, bitcast=True).to(tl.float32)
            tl.store(own + q * SEG + offs, tl.full([BLOCK], sentinel, v.dtype), mask=mask)
        b = acc.to(tl.int32, bitcast=True)
        if WIDE:
            tl.store(out_ptr + offs, b, mask=mask)
        else:
            rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # round to nearest even (not NaN-safe: sums are finite)
            tl.store(out_ptr + offs, rounded.to(tl.int16), mask=mask)
