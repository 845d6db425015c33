"""A preallocated, static-shape KV cache for tree verification.

One key and one value buffer per attention layer, ``[B, Hkv, capacity, D]``, allocated (zeroed)
the first time the layer writes, on that layer's device and in its dtype (so models split with
``device_map="auto"`` and models whose layers differ in head count or head size work). Sequence b
owns slots ``[0, lengths[b])`` of committed tokens; a verification forward writes the tree's KV
at ``[lengths[b], lengths[b] + n)`` and ``commit`` gathers the accepted nodes' KV to
``[lengths[b], lengths[b] + len(path))``. No buffer is ever reallocated or resized after its first
write, which keeps every tensor address fixed for a later CUDA-graph capture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KVCache"]


class KVCache:
    """Per-layer KV buffers plus each sequence's committed length (host ints).

    Args:
        batch_size: number of sequences B.
        capacity: slots per sequence (prompt + generated tokens + one tree must fit).
    """

    def __init__(self, batch_size: int, capacity: int) -> None:
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size: expected an int >= 1, got {batch_size!r}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected an int >= 1, got {capacity!r}")
        self.batch_size = batch_size
        self.capacity = capacity
        self.lengths = [0] * batch_size
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self._keys)

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
                below ``capacity``; out-of-range slots raise inside ``scatter_``).

        Returns:
            ``(k_buf, v_buf)``, each ``[B, Hkv, capacity, D]``.
        """
        if layer_idx not in self._keys:
            batch, heads, _, dim = key.shape
            if batch != self.batch_size:
                raise ValueError(f"key: expected batch size {self.batch_size}, got {batch}")
            shape = (batch, heads, self.capacity, dim)
            # Zeroed, not empty: masked slots must hold finite values (0 * NaN would poison attention).
            self._keys[layer_idx] = torch.zeros(shape, dtype=key.dtype, device=key.device)
            self._values[layer_idx] = torch.zeros(shape, dtype=value.dtype, device=value.device)
        k_buf, v_buf = self._keys[layer_idx], self._values[layer_idx]
        index = slots[:, None, :, None].expand(key.shape)
        k_buf.scatter_(2, index, key.to(k_buf.dtype))
        v_buf.scatter_(2, index, value.to(v_buf.dtype))
        return k_buf, v_buf

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
        width = max((len(p) for p in paths if p), default=0)
        if width == 0:
            return
        src, dst = [], []
        for b, path in enumerate(paths):
            path = list(path or [])
            if path and path[0] != 0:
                raise ValueError(f"paths[{b}]: expected the root (node 0) first, got {path[0]}")
            if any(b2 <= a for a, b2 in zip(path, path[1:])):
                raise ValueError(f"paths[{b}]: expected strictly increasing node indices, got {path}")
            base = self.lengths[b]
            if base + (path[-1] if path else 0) >= self.capacity:
                raise ValueError(f"paths[{b}]: node {path[-1]} lies past the cache capacity {self.capacity}")
            s = [base + i for i in path]
            d = [base + j for j in range(len(path))]
            if not path:  # slot 0 copied onto itself: a no-op entry (duplicate writes carry equal values)
                s, d = [0], [0]
            s += [s[-1]] * (width - len(s))
            d += [d[-1]] * (width - len(d))
            src.append(s)
            dst.append(d)
        src_t = torch.tensor(src, dtype=torch.int64)
        dst_t = torch.tensor(dst, dtype=torch.int64)
        on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for layer_idx in self._keys:
            for buf in (self._keys[layer_idx], self._values[layer_idx]):
                if buf.device not in on_device:
                    on_device[buf.device] = (src_t.to(buf.device), dst_t.to(buf.device))
                s_dev, d_dev = on_device[buf.device]
                shape = (buf.shape[0], buf.shape[1], width, buf.shape[3])
                moved = buf.gather(2, s_dev[:, None, :, None].expand(shape))
                buf.scatter_(2, d_dev[:, None, :, None].expand(shape), moved)
        for b, path in enumerate(paths):
            self.lengths[b] += len(path or [])
