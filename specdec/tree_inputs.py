"""The flat int64 input vector of a fixed-shape ``[B, n]`` tree forward, packed on the host.

``InputLayout`` says where each input (tokens, positions, cache slots, depths, ancestor bit words,
prefix lengths, and a shared prompt's length) lives in one int64 vector; ``pack_trees`` fills a host
copy of it for one step's trees, which ``specdec.graphs.GraphedForward`` moves to the device in one
asynchronous copy.
"""

from __future__ import annotations

import array
import functools
import struct
from collections.abc import Sequence

import torch

from specdec.tree import TokenTree
from treeattn import num_words

__all__ = ["InputLayout", "pack_trees"]

_ALIGN = 8  # int64 elements (64 bytes): every input view starts on a 16-byte boundary


class InputLayout:
    """Where each input lives in the flat int64 input vector of a ``[B, n]`` forward.

    Segments, in order (each starting at a multiple of 8 elements): ``tokens``, ``positions``,
    ``slots``, ``depth`` (``[B, n]`` each), ``words`` (``[B, n, ceil(n / 64)]``), ``prefix_lens``
    (``[B]``), and with ``shared``, ``shared_len`` (``[1]``: the shared prompt's length).
    """

    def __init__(self, batch: int, n: int, shared: bool = False) -> None:
        self.batch, self.n, self.words_per_node = batch, n, num_words(n)
        shapes = {
            "tokens": (batch, n),
            "positions": (batch, n),
            "slots": (batch, n),
            "depth": (batch, n),
            "words": (batch, n, self.words_per_node),
            "prefix_lens": (batch,),
        }
        if shared:
            shapes["shared_len"] = (1,)
        self.shapes = shapes
        self.offsets: dict[str, int] = {}
        at = 0
        for name, shape in shapes.items():
            self.offsets[name] = at
            size = 1
            for s in shape:
                size *= s
            at += -(-size // _ALIGN) * _ALIGN
        self.size = at

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """The ``name`` segment of ``flat`` as a contiguous tensor of its shape (a view, no copy)."""
        shape = self.shapes[name]
        size = 1
        for s in shape:
            size *= s
        start = self.offsets[name]
        return flat[start : start + size].view(shape)


def pack_trees(trees: Sequence[TokenTree], prefix_lens: Sequence[int], layout: InputLayout,
               shared_len: int = 0) -> array.array:  # fmt: skip
    """The flat input vector (host int64s, ``layout.size`` long) for one step.

    Args:
        trees: B token trees of at most n nodes each (validated ``TokenTree``: depth-first, root first).
        prefix_lens: per sequence, its committed KV length (the tree's KV goes to slots
            ``[prefix_len, prefix_len + n)``).
        layout: the ``InputLayout`` of the ``[B, n]`` forward.
        shared_len: the length P of a prompt all sequences share ahead of their cache (a layout
            made with ``shared=True``, which stores it); 0 without one.

    Returns:
        ``array.array("q")`` in ``layout`` order. Node i of tree b: token ``tokens[i]``, position
        ``shared_len + prefix_len + depth(i)``, slot ``prefix_len + i``, ancestor-or-self bits (bit
        j of word w set iff node ``64 w + j`` is i or one of its ancestors; the same bits as
        ``TreeMask.from_parents``); padding nodes (i >= tree.n) hang off the root with token 0.
    """
    if shared_len and "shared_len" not in layout.offsets:
        raise ValueError(f"shared_len: expected 0 for a layout without a shared prompt, got {shared_len}")
    n, width = layout.n, layout.words_per_node
    out = array.array("q", [0]) * layout.size
    off = layout.offsets
    for b, (tree, prefix) in enumerate(zip(trees, prefix_lens)):
        depth, words = _shape_inputs(tuple(tree.parent_list), n, width)
        row = b * n
        out[off["tokens"] + row : off["tokens"] + row + tree.n] = array.array("q", tree.token_list)
        start = shared_len + prefix
        out[off["positions"] + row : off["positions"] + row + n] = array.array("q", [start + d for d in depth])
        out[off["slots"] + row : off["slots"] + row + n] = array.array("q", range(prefix, prefix + n))
        out[off["depth"] + row : off["depth"] + row + n] = depth
        start = off["words"] + row * width
        out[start : start + n * width] = words
        out[off["prefix_lens"] + b] = prefix
    if "shared_len" in off:
        out[off["shared_len"]] = shared_len
    return out


@functools.lru_cache(maxsize=256)
def _shape_inputs(parents: tuple[int, ...], n: int, width: int) -> tuple[array.array, array.array]:
    """Depths ``[n]`` and ancestor words ``[n * width]`` of a tree padded to n nodes (int64 arrays;
    callers copy them, never modify). Cached: plain decoding and static trees repeat their shape."""
    anc = [1] * n  # ancestor-or-self bits as Python ints (bit i = node i)
    depth = [0] * n
    m = len(parents)
    for i in range(1, n):
        p = parents[i] if i < m else 0  # parents precede children (depth-first); padding under the root
        anc[i] = anc[p] | (1 << i)
        depth[i] = depth[p] + 1
    # Little-endian bytes of each node's bits, read back as int64 words (bit 63 -> the sign bit).
    nbytes = 8 * width
    words = array.array("q", struct.unpack(f"<{n * width}q", b"".join(a.to_bytes(nbytes, "little") for a in anc)))
    return array.array("q", depth), words
