"""A preallocated, static-shape KV cache for tree verification.

One key and one value buffer per attention layer, ``[B, Hkv, capacity, D]``, allocated (zeroed)
the first time the layer writes, on that layer's device and in its dtype (so models split with
``device_map="auto"`` and models whose layers differ in head count or head size work). Sequence b
owns slots ``[0, lengths[b])`` of committed tokens; a verification forward writes the tree's KV
at ``[lengths[b], lengths[b] + n)`` and ``commit`` gathers the accepted nodes' KV to
``[lengths[b], lengths[b] + len(path))``. No buffer is ever reallocated or resized after its first
write, which keeps every tensor address fixed for a later CUDA-graph capture.

With ``num_layers`` given, the first write allocates the buffers of all layers at once as views of
one ``[2, num_layers, B, Hkv, capacity, D]`` tensor (when later layers have the same shape, dtype
and device; others get their own buffers), so that ``commit`` moves the accepted KV of every
layer with one ``index_select`` and one ``index_copy_`` per sequence instead of two per buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KVCache", "store"]


class KVCache:
    """Per-layer KV buffers plus each sequence's committed length (host ints).

    Args:
        batch_size: number of sequences B.
        capacity: slots per sequence (prompt + generated tokens + one tree must fit).
        num_layers: attention layers of the model (``layer_idx`` 0 .. num_layers - 1), to keep
            them in one stacked tensor (see the module doc); None = one allocation per layer.
    """

    def __init__(self, batch_size: int, capacity: int, num_layers: int | None = None) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected an int >= 1, got {capacity!r}")
        if num_layers is not None and (not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1):
            raise ValueError(f"num_layers: expected None or an int >= 1, got {num_layers!r}")
        self.batch_size = batch_size
        self.capacity = capacity
        self.num_layers = num_layers
        self.lengths = [0] * batch_size
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._stack: torch.Tensor | None = None  # [2, num_layers, B, Hkv, capacity, D]
        self._stacked: set[int] = set()  # layers whose buffers are views of _stack

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self._keys)

    @property
    def nbytes(self) -> int:
        """Bytes of the KV buffers allocated so far (0 before the first write): ``2 * layers * B *
        Hkv * capacity * D * element size``, the stacked tensor counted once."""
        total = 0 if self._stack is None else self._stack.numel() * self._stack.element_size()
        for layer_idx, key in self._keys.items():
            if layer_idx not in self._stacked:
                total += sum(t.numel() * t.element_size() for t in (key, self._values[layer_idx]))
        return total

    def buffers(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``[B, Hkv, capacity, D]`` key and value buffers of a layer that has written."""
        if layer_idx not in self._keys:
            raise ValueError(f"layer_idx: no KV buffers for layer {layer_idx} yet (nothing was written)")
        return self._keys[layer_idx], self._values[layer_idx]

    def reset(self) -> None:
        """Forget every sequence (lengths back to 0); the buffers are kept for reuse."""
        self.lengths = [0] * self.batch_size

    def check_room(self, n: int, what: str = "tree") -> None:
        """Raise if some sequence has no room for ``n`` more slots (never truncate)."""
        worst = max(self.lengths)
        if worst + n > self.capacity:
            raise ValueError(
                f"{what}: KV cache overflow: a sequence holds {worst} tokens and needs {n} more slots, "
                f"capacity is {self.capacity}; create the decoder with a larger max_cache_len"
            )

    def write(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys / values at per-sequence slots and return the layer's full buffers.

        Args:
            layer_idx: the attention layer.
            key, value: ``[B, Hkv, m, D]`` (after RoPE), the layer's dtype.
            slots: int64 ``[B, m]`` on key's device, slot of each new token (the caller keeps them
                below ``capacity``; out-of-range slots raise inside the store).

        Returns:
            ``(k_buf, v_buf)``, each ``[B, Hkv, capacity, D]`` (``store`` wrote into them).
        """
        if layer_idx not in self._keys:
            self._allocate(layer_idx, key, value)
        return store(self._keys[layer_idx], self._values[layer_idx], key, value, slots)

    def allocate_like(self, other: "KVCache") -> None:
        """Allocate (zeroed) buffers for every layer ``other`` has written and this cache has not, with
        ``other``'s head counts, head sizes, dtypes and devices (stacked as a first write would).

        So that a cache whose first write would happen inside a fixed-shape forward (the rows of a
        shared prompt, which prefill nothing) has its buffers before that forward is compiled or
        captured: an allocation there would change what it was traced or recorded against.
        """
        for layer_idx in other.layer_indices:
            if layer_idx not in self._keys:
                k, v = other.buffers(layer_idx)
                empty = [x.new_empty((self.batch_size, x.shape[1], 0, x.shape[3])) for x in (k, v)]
                self._allocate(layer_idx, *empty)  # [B, Hkv, 0, D]: only their shape, dtype and device count

    def _allocate(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
        batch, heads, _, dim = key.shape
        if batch != self.batch_size:
            raise ValueError(f"key: expected batch size {self.batch_size}, got {batch}")
        shape = (batch, heads, self.capacity, dim)
        same = value.shape == key.shape and value.dtype == key.dtype and value.device == key.device
        if self.num_layers is not None and 0 <= layer_idx < self.num_layers and same:
            if self._stack is None:
                # Zeroed, not empty: masked slots must hold finite values (0 * NaN would poison attention).
                self._stack = torch.zeros((2, self.num_layers, *shape), dtype=key.dtype, device=key.device)
            st = self._stack
            if tuple(st.shape[2:]) == shape and st.dtype == key.dtype and st.device == key.device:
                self._keys[layer_idx], self._values[layer_idx] = st[0, layer_idx], st[1, layer_idx]
                self._stacked.add(layer_idx)
                return
        self._keys[layer_idx] = torch.zeros(shape, dtype=key.dtype, device=key.device)
        self._values[layer_idx] = torch.zeros(shape, dtype=value.dtype, device=value.device)

    def commit(self, paths: Sequence[Sequence[int] | None]) -> None:
        """Keep each sequence's accepted tree nodes, contiguously after its committed tokens.

        Args:
            paths: per sequence, the accepted node indices (``path[0] == 0``, the root, increasing)
                of the tree written at ``[lengths[b], lengths[b] + n)``, or None / empty to commit
                nothing for that sequence. Node ``path[j]``'s KV moves from slot
                ``lengths[b] + path[j]`` to ``lengths[b] + j``; ``lengths[b] += len(path)``. The
                other nodes' slots become free. Nothing is recomputed.
        """
        if len(paths) != self.batch_size:
            raise ValueError(f"paths: expected one entry per sequence ({self.batch_size}), got {len(paths)}")
        moves: list[tuple[int, list[int], list[int]]] = []  # (sequence, source slots, destination slots)
        for b, path in enumerate(paths):
            path = list(path or [])
            if path and path[0] != 0:
                raise ValueError(f"paths[{b}]: expected the root (node 0) first, got {path[0]}")
            if any(b2 <= a for a, b2 in zip(path, path[1:])):
                raise ValueError(f"paths[{b}]: expected strictly increasing node indices, got {path}")
            base = self.lengths[b]
            if base + (path[-1] if path else 0) >= self.capacity:
                raise ValueError(f"paths[{b}]: node {path[-1]} lies past the cache capacity {self.capacity}")
            # Node path[j] moves from slot base + path[j] to base + j; nodes already in place stay
            # (a path along the depth-first order's first children moves nothing).
            pairs = [(base + i, base + j) for j, i in enumerate(path) if i != j]
            if pairs:
                moves.append((b, [p[0] for p in pairs], [p[1] for p in pairs]))
        if moves:
            if len(moves) == 1:  # one sequence: [source slots, destination slots]
                (_, src, dst), = moves
                index = torch.tensor([src, dst], dtype=torch.int64)
            else:  # several: [sequence, source slot, destination slot] of every moving node
                index = torch.tensor([[b for b, src, _ in moves for _ in src], [x for _, src, _ in moves for x in src],
                                      [x for _, _, dst in moves for x in dst]], dtype=torch.int64)  # fmt: skip
            on_device: dict[torch.device, torch.Tensor] = {}

            def move(buf: torch.Tensor) -> None:  # [..., B, Hkv, capacity, D]: every leading dim at once
                if buf.device not in on_device:
                    on_device[buf.device] = index.to(buf.device, non_blocking=True)
                idx = on_device[buf.device]
                # sources lie after their destinations, and each gather completes before its write
                if len(moves) == 1:
                    seq = buf.select(-4, moves[0][0])
                    seq.index_copy_(-2, idx[1], seq.index_select(-2, idx[0]))
                else:  # one gather and one scatter for every sequence (B launches of each before)
                    buf[..., idx[0], :, idx[2], :] = buf[..., idx[0], :, idx[1], :]

            if self._stacked:
                move(self._stack)  # every stacked layer's keys and values at once
            for layer_idx in self._keys:
                if layer_idx not in self._stacked:
                    move(self._keys[layer_idx])
                    move(self._values[layer_idx])
        for b, path in enumerate(paths):
            self.lengths[b] += len(path or [])


def store(k_buf: torch.Tensor, v_buf: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``key`` / ``value`` ``[B, Hkv, m, D]`` into ``k_buf`` / ``v_buf`` ``[B, Hkv, S, D]`` at
    the slots ``slots`` int64 ``[B, m]`` (per sequence); returns the two buffers.

    Run eagerly, the store is one ``scatter_`` per buffer. Traced by ``torch.compile`` it is an
    ``index_put_`` over (sequence, head, slot), which inductor writes in place with the producer of
    ``key`` (RoPE) fused into the store; a traced ``scatter_`` becomes a copy of the whole buffer, a
    scatter into the copy and a copy back into the cache, per buffer and layer: work in the cache's
    capacity instead of in m (specdec/PERF.md v19).
    """
    if torch.compiler.is_compiling():
        batch, heads = key.shape[:2]
        index = (torch.arange(batch, device=slots.device)[:, None, None],
                 torch.arange(heads, device=slots.device)[None, :, None], slots[:, None, :])  # -> [B, Hkv, m]
        k_buf.index_put_(index, key.to(k_buf.dtype))
        v_buf.index_put_(index, value.to(v_buf.dtype))
    else:
        index = slots[:, None, :, None].expand(key.shape)
        k_buf.scatter_(2, index, key.to(k_buf.dtype))
        v_buf.scatter_(2, index, value.to(v_buf.dtype))
    return k_buf, v_buf
