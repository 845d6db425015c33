"""The push all-reduce: a sum over the ranks of a group by one kernel and one write per peer
(``treeattn.allreduce_kernels``), for the small all-reduces of tensor-parallel decoding; and its
pure-torch reference.

The caller owns the slots: on each rank, ``slots[p]`` is rank p's slot as this process sees it (for
p == rank its own memory, else the peer's mapped over NVLink: symmetric memory's
``get_buffer``), an integer tensor of ``world * seg`` elements made with ``new_slot`` (every element
the sentinel) before any rank's first call. The kernel leaves every slot clean again. A slot may
serve one call site: it is reused only after the group has passed another all-reduce in between
(``specdec.tensor_parallel`` gives every projection its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["MAX_WORLD", "SENTINELS", "SLOT_DTYPES", "new_slot", "push_all_reduce", "push_all_reduce_reference", "slot_dtype"]

#: the most ranks the kernel takes (its slot pointer arguments)
MAX_WORLD = 8
#: the slot element dtype of each reduced dtype, and the sentinel bit pattern (-0.0) it starts at
SLOT_DTYPES = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
SENTINELS = {torch.int16: -(1 << 15), torch.int32: -(1 << 31)}
#: elements a program handles per chunk
_BLOCK = 1024


def slot_dtype(dtype: torch.dtype) -> torch.dtype:
    """The slot element dtype for reducing ``dtype`` (bfloat16: int16, float32: int32)."""
    if dtype not in SLOT_DTYPES:
        raise ValueError(f"dtype: expected torch.bfloat16 or torch.float32, got {dtype}")
    return SLOT_DTYPES[dtype]


def new_slot(world: int, seg: int, dtype: torch.dtype, device=None, out: torch.Tensor | None = None) -> torch.Tensor:
    """A slot for ``world`` ranks and messages of up to ``seg`` elements of ``dtype``: ``[world * seg]``
    of ``slot_dtype(dtype)`` at the sentinel; ``out``: fill that tensor instead (e.g. a view of a
    symmetric-memory buffer)."""
    sd = slot_dtype(dtype)
    if out is None:
        out = torch.empty(world * seg, dtype=sd, device=device)
    elif out.dtype != sd or out.numel() != world * seg:
        raise ValueError(f"out: expected {world * seg} elements of {sd}, got {out.numel()} of {out.dtype}")
    return out.fill_(SENTINELS[sd])


def push_all_reduce(x: torch.Tensor, slots: Sequence[torch.Tensor], rank: int, max_programs: int | None = None) -> torch.Tensor:
    """The sum of ``x`` over the ranks, every rank calling it with its own ``x`` and ``rank``.

    Args:
        x: ``[...]`` bfloat16 or float32, at most ``seg`` elements, on the slots' device.
        slots: ``world`` (1..8) tensors ``[world * seg]`` of ``slot_dtype(x.dtype)``: rank p's slot
            at index p (see the module docstring).
        rank: this process's index in ``slots``.
        max_programs: at most this many programs (default: the GPU's SMs, so all are resident; 4 on
            a CPU, the interpreter).

    Returns:
        ``[...]`` like ``x``: the float32 sum over ranks in rank order, rounded to ``x.dtype`` -- the
        same bits on every rank.
    """
    import triton

    from treeattn.allreduce_kernels import push_all_reduce_kernel

    world = len(slots)
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"slots: expected 1 to {MAX_WORLD} slots, got {world}")
    sd = slot_dtype(x.dtype)
    first = slots[0]
    if any(s.dtype != sd or s.dim() != 1 or s.numel() != first.numel() or s.device != x.device for s in slots):
        raise ValueError(f"slots: expected 1-d {sd} tensors of one size on {x.device}, got "
                         f"{[(s.dtype, tuple(s.shape), str(s.device)) for s in slots]}")  # fmt: skip
    if first.numel() % world:
        raise ValueError(f"slots: expected a size divisible by the world ({world}), got {first.numel()}")
    seg = first.numel() // world
    if x.numel() > seg:
        raise ValueError(f"x: expected at most {seg} elements (a slot's segment), got {x.numel()}")
    if not 0 <= rank < world:
        raise ValueError(f"rank: expected 0 <= rank < {world}, got {rank}")
    n = x.numel()
    bits = x.contiguous().view(sd).reshape(-1)
    out = torch.empty(n, dtype=sd, device=x.device)
    if n == 0:
        return out.view(x.dtype).view(x.shape)
    if max_programs is None:
        max_programs = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    blocks = triton.cdiv(n, _BLOCK)
    programs = min(blocks, max_programs)
    chunks = triton.cdiv(blocks, programs)
    padded = list(slots) + [first] * (MAX_WORLD - world)
    push_all_reduce_kernel[(programs,)](bits, out, *padded, n, RANK=rank, WORLD=world, SEG=seg, BLOCK=_BLOCK,
                                        CHUNKS=chunks, WIDE=sd == torch.int32)  # fmt: skip
    return out.view(x.dtype).view(x.shape)


def push_all_reduce_reference(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """What every rank's ``push_all_reduce`` returns for the ranks' inputs ``xs`` (rank order): their
    float32 sum, added in rank order, rounded to their dtype."""
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc.to(xs[0].dtype)
