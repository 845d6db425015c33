"""Tensor parallelism for decoding: every decoder layer's weights split N ways, as plain local tensors.

``shard_model(model, group)`` rewrites a loaded HF causal LM in place so that each of the N ranks of
``group`` holds 1/N of every decoder layer (Megatron's split; the one transformers' TP plan uses too)::

    q / k / v, gate / up   nn.Linear [out / N, in]   column-parallel: this rank's heads / MLP columns
    o, down                RowParallelLinear         this rank's input columns, then one all-reduce
    LM head                VocabParallelHead         this rank's V / N rows of the (whole, replicated)
                                                     weight, then one all-gather of the logits
    embeddings, norms      unchanged                 replicated

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
on the model).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["RowParallelLinear", "VocabParallelHead", "shard_model", "tensor_parallel_group"]

#: Child names of the projections split by output rows (column-parallel) and by input columns (row-parallel).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group``'s ranks (same shape; a new tensor)."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x, "sum", group.group_name))


def _all_gather_last(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """``[..., n]`` on each rank -> ``[..., world * n]``: the ranks' tensors side by side in rank order."""
    ops = torch.ops._c10d_functional
    stacked = ops.wait_tensor(ops.all_gather_into_tensor(x.contiguous(), world, group.group_name))
    return torch.cat(stacked.view(world, *x.shape).unbind(0), dim=-1)


class RowParallelLinear(nn.Linear):
    """A row-parallel projection: ``[..., in / N] -> [..., out]``, this rank's partial product summed
    over the group (one all-reduce), then the bias (kept whole, added once after the sum).

    ``weight``: ``[out, in / N]``, this rank's input columns of the unsharded weight.
    """

    def __init__(self, linear: nn.Linear, rank: int, world: int, group) -> None:
        nn.Module.__init__(self)
        cols = linear.in_features // world
        self.in_features, self.out_features = cols, linear.out_features
        self.group = group
        self.weight = nn.Parameter(linear.weight[:, rank * cols : (rank + 1) * cols].contiguous(),
                                   requires_grad=False)  # fmt: skip
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _all_reduce(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class VocabParallelHead(nn.Linear):
    """A vocabulary-parallel LM head: ``[..., H] -> [..., V]`` from this rank's ``V / N`` rows of the
    weight, the ranks' logits all-gathered in vocabulary order.

    ``weight``: ``[V, H]``, the whole weight (the same parameter as the input embedding when they are
    tied); the forward multiplies only rows ``[rank * V / N, (rank + 1) * V / N)``.
    """

    def __init__(self, head: nn.Linear, rank: int, world: int, group) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = head.weight
        self.bias = head.bias
        self.group, self.world = group, world
        rows = head.out_features // world
        self.rows = (rank * rows, (rank + 1) * rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lo, hi = self.rows
        part = F.linear(x, self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi])
        return _all_gather_last(part, self.group, self.world)


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


@torch.no_grad()
def shard_model(model: nn.Module, group=None) -> int:
    """Split ``model``'s decoder layers and LM head over ``group``'s ranks, in place (see the module
    docstring); every rank calls it on the same unsharded model. Returns the number of projections
    split. ``group``: a ``torch.distributed`` process group (default: the world).

    Raises ValueError when the model is already sharded or fused (``specdec.fused``: shard first), has
    no q / k / v / o and gate / up / down projections, or head counts that do not divide by N.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, got none "
                         "(run under torchrun, or call torch.distributed.init_process_group first)")  # fmt: skip
    group = group if group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if tensor_parallel_group(model) is not None:
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
            new = RowParallelLinear(child, rank, world, group) if split else _column_shard(child, rank, world)
            setattr(holder, name, new)
            count += 1
    if count == 0:
        raise ValueError(f"model: expected decoder layers with {', '.join(COLUMN_PARALLEL + ROW_PARALLEL)} "
                         f"projections, got none in {type(model).__name__}")  # fmt: skip
    head = model.get_output_embeddings()
    if type(head) is nn.Linear and head.out_features % world == 0:
        model.set_output_embeddings(VocabParallelHead(head, rank, world, group))
    return count


def tensor_parallel_group(model: nn.Module) -> Any | None:
    """The process group ``shard_model`` split ``model`` over, or None (unsharded)."""
    for m in model.modules():
        if isinstance(m, RowParallelLinear):
            return m.group
    return None
