"""What specdec's attention function receives in a forward call, and the masked form of it.

Every specdec forward passes one state object in the ``STATE_KWARG`` (``specdec_state``) keyword of
the model call; transformers forwards it untouched to every attention call, where the function
registered by ``specdec.hf.prepare_model`` (or a drafter head's) hands the call to
``state.attend(module, query, key, value, scaling, sliding_window, softcap)``. ``specdec.hf.ForwardState``
is the tree-verification state; ``MaskedState`` here is the general one: m tokens attending through
an explicit visibility mask (a drafter's per-depth forward); ``TreeState`` is a drafter's forward
whose queries are a whole tree after a committed prefix, through treeattn's kernel. The helpers are
shared by them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.kv import KVCache
from treeattn import TreeMask
from treeattn.ops import tree_attention_op

__all__ = ["STATE_KWARG", "MaskedState", "TreeState", "layer_index", "masked_attention", "on_device", "tree_visibility"]

#: The forward keyword that carries a ``ForwardState`` / ``MaskedState`` to the attention function.
STATE_KWARG = "specdec_state"


def on_device(moved: dict, device: torch.device, items: tuple) -> tuple:
    """``items`` (tensors, ``TreeMask``s or None) on ``device``: the items themselves when all are there
    already, else copies made on first use and kept in ``moved`` (per device) until ``refresh``.

    On one device nothing is copied and ``moved`` is left alone. That matters under torch.compile:
    dynamo guards on ``moved``'s keys, so filling it during a compiled forward made the next call
    (without a ``load`` in between, e.g. a CUDA-graph capture's warm-up forwards) trace and compile
    the whole model again (specdec/PERF.md v19).
    """
    where = [None if x is None else (x.words if isinstance(x, TreeMask) else x).device for x in items]
    if all(d is None or d == device for d in where):
        return items
    if device not in moved:
        moved[device] = tuple(None if x is None else x.to(device) for x in items)
    return moved[device]


def layer_index(module) -> int:
    """The decoder layer index an attention module writes its K/V under."""
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise ValueError(f"module: {type(module).__name__} has no layer_idx; cannot address its KV cache")
    return layer_idx


def tree_visibility(prefix_lens, tree_mask, slots, positions, seq_len, window) -> torch.Tensor:
    """bool ``[B, n, S]``: the prompt and the node's tree ancestors, within the sliding window."""
    batch, n = slots.shape
    device = slots.device
    s = torch.arange(seq_len, device=device)
    visible = (s[None, None, :] < prefix_lens[:, None, None]).expand(batch, n, seq_len).clone()
    visible.scatter_(2, slots[:, None, :].expand(batch, n, n), tree_mask.to_dense().expand(batch, n, n))
    if window is not None:
        key_pos = s.expand(batch, seq_len).clone().scatter_(1, slots, positions)
        visible &= (positions[:, :, None] - key_pos[:, None, :]) < window
    return visible


def masked_attention(q, k, v, visible, scale, softcap) -> torch.Tensor:
    """Plain attention with a bool ``[B, m, S]`` mask and optional logit soft-capping (float32 math)."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None], -math.inf)
    return torch.matmul(scores.softmax(dim=-1), vf).to(q.dtype)


@dataclass(frozen=True, eq=False)
class MaskedState:
    """Metadata of a forward whose m input tokens attend through an explicit visibility mask.

    The general form of ``ForwardState`` for callers whose queries are not the whole tree written
    by the same forward, e.g. a draft model expanding one depth of its tree (the new frontier
    nodes attend to the committed prefix and to ancestors written by earlier forwards). Passed as
    ``specdec_state=`` like a ``ForwardState``; every attention layer writes the m new keys /
    values into ``cache`` at ``slots`` and attends with SDPA under ``visible``.

    Attributes:
        cache: where keys / values are written and read.
        slots: int64 ``[B, m]``, the cache slot of each input token (``< kv_len``).
        positions: int64 ``[B, m]``, their position ids.
        visible: bool ``[B, m, kv_len]``: ``visible[b, i, s]`` iff input token i attends to slot s
            (its own slot included); attention reads slots ``[0, kv_len)``.
        key_positions: int64 ``[B, kv_len]``, the position id of the token in each slot; only
            needed by sliding-window layers (None there raises).
    """

    cache: KVCache
    slots: torch.Tensor
    positions: torch.Tensor
    visible: torch.Tensor
    key_positions: torch.Tensor | None = None
    _moved: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        batch, m = self.slots.shape
        if self.visible.dtype != torch.bool or self.visible.dim() != 3 or tuple(self.visible.shape[:2]) != (batch, m):
            raise ValueError(
                f"visible: expected a bool tensor of shape [{batch}, {m}, kv_len], got {self.visible.dtype} "
                f"{tuple(self.visible.shape)}"
            )
        kv_len = self.visible.shape[2]
        if kv_len > self.cache.capacity:
            raise ValueError(f"visible: expected kv_len <= the cache capacity {self.cache.capacity}, got {kv_len}")
        if self.key_positions is not None and tuple(self.key_positions.shape) != (batch, kv_len):
            raise ValueError(f"key_positions: expected shape [{batch}, {kv_len}], got {tuple(self.key_positions.shape)}")

    def _on(self, device: torch.device) -> tuple:
        return on_device(self._moved, device, (self.slots, self.positions, self.visible, self.key_positions))

    def attend(self, module, query, key, value, scaling, sliding_window, softcap) -> tuple[torch.Tensor, None]:
        """Write this layer's new K/V at ``slots`` and attend over ``[0, kv_len)`` under ``visible``."""
        layer_idx = layer_index(module)
        slots, positions, visible, key_positions = self._on(query.device)
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        k_buf, v_buf = self.cache.write(layer_idx, key, value, slots)
        kv_len = visible.shape[2]
        k_all, v_all = k_buf[:, :, :kv_len], v_buf[:, :, :kv_len]
        if sliding_window is not None and sliding_window < kv_len:
            if key_positions is None:
                raise ValueError("key_positions: a sliding-window layer needs the position of every slot, got None")
            visible = visible & ((positions[:, :, None] - key_positions[:, None, :]) < sliding_window)
        if softcap is None:
            out = F.scaled_dot_product_attention(
                query, k_all, v_all, attn_mask=visible[:, None], scale=scale,
                enable_gqa=query.shape[1] != k_all.shape[1],
            )  # fmt: skip
        else:
            out = masked_attention(query, k_all, v_all, visible, scale, softcap)
        return out.transpose(1, 2), None


class TreeState:
    """Attention of one fixed-shape drafter forward through treeattn's tree kernel (``attention="tree"``
    of the draft model's device loop and of the EAGLE head's expansion).

    The drafter's cache is laid out as the kernel expects: the committed prefix at ``[0, prefix_lens)``
    and then ``n`` "tree" slots, each query seeing the prefix and the tree slots its mask words set.
    The prefix length is a device tensor, so the kernel reads only the committed part of the cache
    (split over many blocks) where SDPA under a dense mask (``GroupedMaskedState``) reads the whole
    capacity in two thread blocks. Two uses:

    - a level of the tree: the prefix is the committed tokens and the root (``base + 1``), the tree
      the ``n = E - 1`` expanded nodes after it, and the forward runs ALL of them as queries (each
      with its ancestors-or-self as words): rows of earlier levels recompute what they wrote before
      (same tokens, positions, ancestors and shapes: the same values), rows of later levels write
      slots their own level overwrites. A forward of E - 1 rows costs what one of K rows does
      (the draft's GEMMs stream weights at either size), and the queries need no placement;
    - the catch-up chain: ``n`` = the chain width, causal words; the chain starts at
      ``prefix_lens``, padding rows after it write the next (expanded) slots, which the levels overwrite.

    Attributes: cache; slots ``[1, n]`` (where this forward's keys / values go); prefix_lens int64
    ``[1]``; words int64 ``[1, n, ceil(n / 64)]``; depth int64 ``[1, n]`` (``TreeMask.depth``, not
    read by the kernel). All updated in place by the loop. Sliding-window and soft-capped layers
    are refused (``attention="sdpa"`` handles them).
    """

    def __init__(self, cache: KVCache, slots, prefix_lens, words, depth) -> None:
        self.cache, self.slots, self.prefix_lens, self.words, self.depth = cache, slots, prefix_lens, words, depth

    def clear(self) -> None:
        """Nothing is cached between forwards (the loop updates the tensors in place)."""

    def attend(self, module, query, key, value, scaling, sliding_window, softcap) -> tuple[torch.Tensor, None]:
        """Write this layer's keys / values at ``slots`` and attend. query ``[1, Hq, n, D]``; returns
        ``([1, n, Hq, D], None)`` as transformers' attention functions do."""
        if softcap is not None or (sliding_window is not None and sliding_window < self.cache.capacity):
            raise ValueError("attention: 'tree' has no sliding-window or soft-capped layers (the model has them); "
                             "use attention='sdpa'")  # fmt: skip
        k_buf, v_buf = self.cache.write(layer_index(module), key, value, self.slots)
        dim = query.shape[-1]
        scale = dim**-0.5 if scaling is None else float(scaling)
        out = tree_attention_op(query, k_buf, v_buf, self.prefix_lens, self.words, self.depth, scale, "auto")
        return out.transpose(1, 2), None
