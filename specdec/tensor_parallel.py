"""Tensor parallelism for decoding: every decoder layer's weights split N ways, as plain local tensors.

``shard_model(model, group)`` rewrites a loaded HF causal LM in place so that each of the N ranks of
``group`` holds 1/N of every decoder layer (Megatron's split; the one transformers' TP plan uses too)::

    q / k / v, gate / up   nn.Linear [out / N, in]   column-parallel: this rank's heads / MLP columns
    o, down                RowParallelLinear         this rank's input columns, then one all-reduce
    LM head                VocabParallelHead         this rank's V / N rows of the (whole, replicated)
                                                     weight, then one all-gather of the logits
    embeddings, norms      unchanged                 replicated

Small all-reduces (up to ``ONE_SHOT_MAX_BYTES``: decoding and verify forwards) run as one-shot kernels
over symmetric memory on the current stream where the GPUs can map each other's memory
(:func:`one_shot_slots`; probed at load time, NCCL otherwise); prefill-sized ones through NCCL. With
``one_shot="push"`` they run as push all-reduces instead (:func:`push_slots`,
``treeattn.allreduce``: each rank writes its partial product into every peer's slot and sums what
arrived, no barrier round trip).

The column-parallel projections stay plain ``nn.Linear`` modules holding plain tensors (not DTensors,
no hooks), so ``specdec.fused`` fuses each rank's q / k / v and gate / up shards into one GEMM as on
one GPU, and the layer-wise compile sees ordinary modules. A layer then costs two all-reduces
(torch's functional collectives: traced by ``torch.compile``, captured in CUDA graphs with NCCL).
The LM head keeps the whole weight as its parameter -- drafters that read its rows (EAGLE's draft
vocabulary) or its shape (``specdec.hf.vocab_size``) see the model as unsharded -- and multiplies
only this rank's rows, so each rank streams V / N of it per forward.

Attention gets this rank's heads (query ``[B, Hq / N, m, D]``, key / value ``[B, Hkv / N, m, D]``):
HF's attention modules take head counts from the projections' outputs (``view(..., -1, head_dim)``),
and specdec's KV cache allocates each layer's buffers from the first key it stores. Requires
``num_attention_heads`` and ``num_key_value_heads`` (and the MLP width) divisible by N.

``tensor_parallel_group(model)`` finds the group again from the sharded modules (no attribute is set
on the model). The modules keep the group's registered name, not the group object: once the run
destroys the process group (``torch.distributed.destroy_process_group``), nothing the model holds
keeps it alive to be torn down at interpreter exit (where gloo's threads were seen to abort a rank).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from treeattn.allreduce import SLOT_DTYPES

__all__ = ["ONE_SHOT_MAX_BYTES", "RowParallelLinear", "VocabParallelHead", "one_shot_all_reduce", "one_shot_slots",
           "push_all_reduce", "push_slots", "shard_model", "tensor_parallel_group"]  # fmt: skip

#: Child names of the projections split by output rows (column-parallel) and by input columns (row-parallel).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the ranks of the group registered as ``group_name`` (same shape; a new tensor)."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x, "sum", group_name))


def _one_shot(staging: torch.Tensor, x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group by one kernel on the current stream: ``x`` is copied into this
    rank's ``staging`` (symmetric memory, ``x``'s shape and dtype), then every rank reads every peer's."""
    return torch.ops.symm_mem.one_shot_all_reduce_copy(staging, x, "sum", group_name)


@torch.library.custom_op("specdec::one_shot_all_reduce", mutates_args=())
def one_shot_all_reduce(x: torch.Tensor, slot: torch.Tensor, group_name: str) -> torch.Tensor:
    """``[...]`` -> ``[...]``: the sum of ``x`` over group ``group_name`` through ``slot``, a uint8
    symmetric-memory scratch area of at least ``x.numel() * x.element_size()`` bytes (its contents
    are not part of the result). An opaque op to ``torch.compile``: the slot reaches the kernel as
    the very tensor that was rendezvoused, never a copy of it."""
    staging = slot[: x.numel() * x.element_size()].view(x.dtype).view(x.shape)
    return _one_shot(staging, x.contiguous(), group_name)


@one_shot_all_reduce.register_fake
def _(x: torch.Tensor, slot: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("specdec::push_all_reduce", mutates_args=())
def push_all_reduce(x: torch.Tensor, slots: list[torch.Tensor], rank: int) -> torch.Tensor:
    """``[...]`` -> ``[...]``: the sum of ``x`` (bfloat16 or float32) over the ranks by
    ``treeattn.allreduce.push_all_reduce``: ``slots[p]`` is rank p's slot of one projection as this
    rank maps it (:func:`push_slots`), ``rank`` this rank's index. Opaque to ``torch.compile``: the
    slots reach the kernel as the very tensors that map the peers' memory (they come back clean)."""
    from treeattn.allreduce import push_all_reduce as push

    return push(x, slots, rank)


@push_all_reduce.register_fake
def _(x: torch.Tensor, slots: list[torch.Tensor], rank: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _all_gather_last(x: torch.Tensor, group_name: str, world: int) -> torch.Tensor:
    """``[..., n]`` on each rank -> ``[..., world * n]``: the ranks' tensors side by side in rank order."""
    ops = torch.ops._c10d_functional
    stacked = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), world, group_name))
    return torch.cat(stacked.view(world, *x.shape).unbind(0), dim=-1)


class RowParallelLinear(nn.Linear):
    """A row-parallel projection: ``[..., in / N] -> [..., out]``, this rank's partial product summed
    over the group (one all-reduce), then the bias (kept whole, added once after the sum).

    ``weight``: ``[out, in / N]``, this rank's input columns of the unsharded weight.
    ``slot``: None, or this projection's own uint8 slice of a symmetric-memory buffer
    (:func:`one_shot_slots`): a partial product of at most ``slot.numel()`` bytes is then summed by
    a one-shot kernel on the current stream instead of an NCCL all-reduce (which runs on NCCL's own
    stream: inside a CUDA graph each one adds two cross-stream dependencies).
    ``push``: None, or this projection's slot on every rank (:func:`push_slots`): a partial product
    of its dtype that fits is then summed by a push all-reduce (before ``slot`` is considered).
    """

    def __init__(self, linear: nn.Linear, rank: int, world: int, group_name: str) -> None:
        nn.Module.__init__(self)
        cols = linear.in_features // world
        self.in_features, self.out_features = cols, linear.out_features
        self.group_name = group_name
        self.rank, self.world = rank, world
        self.slot: torch.Tensor | None = None
        self.push: list[torch.Tensor] | None = None
        self.weight = nn.Parameter(linear.weight[:, rank * cols : (rank + 1) * cols].contiguous(),
                                   requires_grad=False)  # fmt: skip
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        part = F.linear(x, self.weight)
        nbytes = part.numel() * part.element_size()
        push = self.push
        if (push is not None and SLOT_DTYPES.get(part.dtype) == push[0].dtype
                and part.numel() * self.world <= push[0].numel()):  # fmt: skip
            out = push_all_reduce(part, push, self.rank)
        elif self.slot is not None and nbytes <= self.slot.numel():
            out = one_shot_all_reduce(part, self.slot, self.group_name)
        else:
            out = _all_reduce(part, self.group_name)
        return out if self.bias is None else out + self.bias


class VocabParallelHead(nn.Linear):
    """A vocabulary-parallel LM head: ``[..., H] -> [..., V]`` from this rank's ``V / N`` rows of the
    weight, the ranks' logits all-gathered in vocabulary order.

    ``weight``: ``[V, H]``, the whole weight (the same parameter as the input embedding when they are
    tied); the forward multiplies only rows ``[rank * V / N, (rank + 1) * V / N)``.
    """

    def __init__(self, head: nn.Linear, rank: int, world: int, group_name: str) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.bias = head.bias
        self.group_name, self.world = group_name, world
        rows = head.out_features // world
        self.rows = (rank * rows, (rank + 1) * rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self.rows
        part = F.linear(x, self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi])
        return _all_gather_last(part, self.group_name, self.world)


def _column_shard(linear: nn.Linear, rank: int, world: int) -> nn.Linear:
    rows = linear.out_features // world
    out = nn.Linear(linear.in_features, rows, bias=linear.bias is not None, device="meta")
    out.weight = nn.Parameter(linear.weight[rank * rows : (rank + 1) * rows].detach().clone(), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(linear.bias[rank * rows : (rank + 1) * rows].detach().clone(), requires_grad=False)
    return out


def _check_divisible(model, world: int) -> None:
    text = model.config.get_text_config()
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    inter = getattr(text, "intermediate_size", None)
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv), ("intermediate_size", inter)):
        if isinstance(value, int) and value % world:
            raise ValueError(f"model: expected config.{name} divisible by the tensor-parallel world size {world}, "
                             f"got {value}")  # fmt: skip


#: The largest partial product (bytes) a one-shot all-reduce takes; larger ones go through NCCL.
#: 1 MiB holds 64 bf16 rows of a 4096-wide model (a 64-node verify forward at batch size 1).
ONE_SHOT_MAX_BYTES = 1 << 20


@torch.no_grad()
def shard_model(model: nn.Module, group=None, one_shot: bool | str = "auto") -> int:
    """Split ``model``'s decoder layers and LM head over ``group``'s ranks, in place (see the module
    docstring); every rank calls it on the same unsharded model. Returns the number of projections
    split. ``group``: a ``torch.distributed`` process group (default: the world). ``one_shot``: give
    the row-parallel projections symmetric-memory slots for one-shot all-reduces
    (:func:`one_shot_slots`): ``"auto"`` where the model is on CUDA and a probe passes on every rank,
    True (raise if it cannot), False (NCCL only); ``"push"``: slots for push all-reduces instead
    (:func:`push_slots`; raise if they cannot be made).

    Raises ValueError when the model is already sharded or fused (``specdec.fused``: shard first), has
    no q / k / v / o and gate / up / down projections, or head counts that do not divide by N.
    """
    import torch.distributed as dist

    if one_shot not in (True, False, "auto", "push"):
        raise ValueError(f"one_shot: expected True, False, 'auto' or 'push', got {one_shot!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, got none "
                         "(run under torchrun, or call torch.distributed.init_process_group first)")  # fmt: skip
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if _group_name(model) is not None:
        raise ValueError("model: expected an unsharded model, got one already split by shard_model")
    _check_divisible(model, world)
    count = 0
    for holder in list(model.modules()):
        names = [n for n in COLUMN_PARALLEL + ROW_PARALLEL if isinstance(getattr(holder, n, None), nn.Module)]
        for name in names:
            child = getattr(holder, name)
            if type(child) is not nn.Linear:
                raise ValueError(f"model: expected {name} to be a plain nn.Linear to shard, got "
                                 f"{type(child).__name__} (shard before specdec.fused.fuse_projections)")  # fmt: skip
            split = ROW_PARALLEL if name in ROW_PARALLEL else ()
            dim = child.in_features if split else child.out_features
            if dim % world:
                raise ValueError(f"model: expected {name}'s {'input' if split else 'output'} size divisible by "
                                 f"{world}, got {dim}")  # fmt: skip
            new = RowParallelLinear(child, rank, world, group.group_name) if split else _column_shard(child, rank, world)
            setattr(holder, name, new)
            count += 1
    if count == 0:
        raise ValueError(f"model: expected decoder layers with {', '.join(COLUMN_PARALLEL + ROW_PARALLEL)} "
                         f"projections, got none in {type(model).__name__}")  # fmt: skip
    head = model.get_output_embeddings()
    if type(head) is nn.Linear and head.out_features % world == 0:
        model.set_output_embeddings(VocabParallelHead(head, rank, world, group.group_name))
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    if one_shot == "push":
        for m, slots in zip(rows, push_slots(group, rows[0].weight.device, len(rows), rows[0].weight.dtype)):
            m.push = slots
    elif one_shot:
        slots = one_shot_slots(group, rows[0].weight.device, len(rows), required=one_shot is True)
        for m, slot in zip(rows, slots or ()):
            m.slot = slot
    return count


def one_shot_slots(group, device: torch.device, count: int, nbytes: int = ONE_SHOT_MAX_BYTES,
                   required: bool = False) -> list[torch.Tensor] | None:  # fmt: skip
    """``count`` disjoint uint8 slots of ``nbytes`` each in one symmetric-memory buffer of ``group``
    (``torch.distributed._symmetric_memory``: every rank maps its peers' buffers over NVLink / P2P),
    or None where that is unavailable: not CUDA, a torch without symmetric memory, or a probe that
    fails on any rank (a one-shot all-reduce, eager and replayed from a CUDA graph, against NCCL's
    sum). A collective: every rank of ``group`` calls it with the same arguments.

    A projection's slot is reused only by its own next call, after the group has passed every other
    projection's all-reduce in between; so the ranks never overwrite a slot a peer still reads.
    NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` unless set): a one-shot
    all-reduce needs only peer loads.

    Raises ValueError with ``required`` when the slots cannot be made.
    """
    import os

    import torch.distributed as dist

    def unavailable(why: str) -> None:
        if required:
            raise ValueError(f"one_shot: expected symmetric memory for one-shot all-reduces, got {why}")
        return None

    if torch.device(device).type != "cuda":
        return unavailable(f"a model on {torch.device(device).type}")
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy"):
        return unavailable(f"torch {torch.__version__} without symm_mem.one_shot_all_reduce_copy")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    ok, buf, why = True, None, ""
    try:
        import warnings

        from torch.distributed import _symmetric_memory as symm_mem

        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed before a rendezvous by older torch; a deprecated no-op-like call in newer
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(group.group_name)
        buf = symm_mem.empty(count * nbytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buf, group)
        ok, why = _probe(buf[:nbytes], group, device)
    except Exception as e:  # noqa: BLE001 - any failure means NCCL all-reduces instead
        ok, why = False, f"{type(e).__name__}: {e}"
    agreed = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not int(agreed.item()):
        return unavailable(why or "a failed probe on another rank")
    return [buf[i * nbytes : (i + 1) * nbytes] for i in range(count)]


def push_slots(group, device: torch.device, count: int, dtype: torch.dtype,
               nbytes: int = ONE_SHOT_MAX_BYTES) -> list[list[torch.Tensor]]:  # fmt: skip
    """``count`` push all-reduce slots for partial products of up to ``nbytes`` bytes of ``dtype``
    (bfloat16 or float32), in one symmetric-memory buffer of ``group``: for each projection the list
    of every rank's slot as this rank maps it (``treeattn.allreduce``; ``world * nbytes`` bytes a
    slot on each rank, filled with the sentinel before any rank's first push). A collective: every
    rank calls it with the same arguments. A probe (a push all-reduce, eager and replayed from a CUDA
    graph, against NCCL's sum) must pass on every rank.

    Raises ValueError where they cannot be made: not CUDA, another dtype, a torch without symmetric
    memory, or a failed probe on any rank.
    """
    import os

    import torch.distributed as dist

    from treeattn.allreduce import SENTINELS, slot_dtype

    if torch.device(device).type != "cuda":
        raise ValueError(f"device: push all-reduces need CUDA, got {torch.device(device).type}")
    sd = slot_dtype(dtype)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from torch.distributed import _symmetric_memory as symm_mem

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    per = world * (nbytes // sd.itemsize)  # elements of one projection's slot
    ok, why, views = True, "", []
    try:
        buf = symm_mem.empty(count * per, dtype=sd, device=device)
        handle = symm_mem.rendezvous(buf, group)
        buf.fill_(SENTINELS[sd])
        views = [buf if p == rank else handle.get_buffer(p, (count * per,), sd) for p in range(world)]
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every slot at the sentinel before any rank pushes
        ok, why = _probe_push([v[:per] for v in views], rank, group, device, dtype)
    except Exception as e:  # noqa: BLE001 - reported through the ValueError below
        ok, why = False, f"{type(e).__name__}: {e}"
    agreed = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if not int(agreed.item()):
        raise ValueError(f"one_shot: expected push all-reduce slots, got {why or 'a failed probe on another rank'}")
    return [[v[i * per : (i + 1) * per] for v in views] for i in range(count)]


def _probe_push(slots: list[torch.Tensor], rank: int, group, device, dtype: torch.dtype) -> tuple[bool, str]:
    """A push all-reduce of small integers (exact in bf16), eager and from a CUDA graph, against NCCL's
    all-reduce of the same values: (all equal, what differed). The slots come back clean."""
    import torch.distributed as dist

    x = (torch.arange(96, device=device) % 7 + rank).to(dtype).view(1, 2, 48)
    want = x.clone()
    dist.all_reduce(want, group=group)
    eager = push_all_reduce(x, slots, rank)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = push_all_reduce(x, slots, rank)
    graph.replay()
    torch.cuda.synchronize(device)
    del graph
    if not torch.equal(eager, want) or not torch.equal(captured, want):
        return False, "a push all-reduce that disagreed with NCCL's"
    return True, ""


def _probe(slot: torch.Tensor, group, device) -> tuple[bool, str]:
    """A one-shot all-reduce of small integers (exact in bf16), eager and from a CUDA graph, against
    NCCL's all-reduce of the same values: (all equal, what differed)."""
    import torch.distributed as dist

    rank = dist.get_rank(group)
    x = (torch.arange(96, device=device, dtype=torch.bfloat16) % 7 + rank).view(1, 2, 48)
    want = x.clone()
    dist.all_reduce(want, group=group)
    eager = one_shot_all_reduce(x, slot, group.group_name)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = one_shot_all_reduce(x, slot, group.group_name)
    graph.replay()
    torch.cuda.synchronize(device)
    del graph  # a graph of a collective must not outlive the probe
    if not torch.equal(eager, want) or not torch.equal(captured, want):
        return False, "a one-shot all-reduce that disagreed with NCCL's"
    return True, ""


def _group_name(model: nn.Module) -> str | None:
    """The registered name of the process group ``shard_model`` split ``model`` over, or None (unsharded)."""
    return next((m.group_name for m in model.modules() if isinstance(m, RowParallelLinear)), None)


def tensor_parallel_group(model: nn.Module) -> Any | None:
    """The process group ``shard_model`` split ``model`` over, or None (unsharded).

    Raises ValueError when that group has been destroyed since (the sharded model cannot run again).
    """
    name = _group_name(model)
    if name is None:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        return _resolve_process_group(name)
    except RuntimeError as e:
        raise ValueError(f"model: expected the process group it is split over ({name!r}) to be alive, got a "
                         f"destroyed one (destroy_process_group ends the sharded model's use)") from e
