"""Plain-PyTorch references for tree attention: a dense-mask computation and a FlexAttention mask.

These are the ground truth the Triton kernel is tested against, and the baselines the benchmark
times. They build a dense ``[B, n, S]`` mask, which the kernel never does.
"""

from __future__ import annotations

import math

import torch

from treeattn.layout import BITS_PER_WORD, TreeMask

__all__ = ["dense_tree_mask", "tree_attention_ref", "flex_tree_mask_mod"]


def dense_tree_mask(prefix_lens: torch.Tensor, tree_mask: TreeMask, seq_len: int) -> torch.Tensor:
    """bool ``[B, n, S]``: True where query ``i`` of sequence ``b`` may attend key ``s``.

    Keys ``[0, prefix_lens[b])`` are the prompt (visible to every query); key
    ``prefix_lens[b] + j`` is tree node ``j`` (visible iff ``j`` is ``i`` or an ancestor of ``i``).
    """
    batch, n = tree_mask.batch_size, tree_mask.n
    device = tree_mask.words.device
    pl = prefix_lens.to(device, torch.int64)
    s = torch.arange(seq_len, device=device)
    prompt = s.view(1, 1, seq_len) < pl.view(batch, 1, 1)
    tree = torch.zeros(batch, n, seq_len, dtype=torch.bool, device=device)
    dense = tree_mask.to_dense()
    for b in range(batch):
        p = int(pl[b])
        tree[b, :, p : p + n] = dense[b]
    return prompt | tree


def tree_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: TreeMask,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Tree attention with a dense mask, computed in ``compute_dtype``.

    Args:
        q: ``[B, Hq, n, D]``; k, v: ``[B, Hkv, S, D]`` with ``Hq % Hkv == 0``.
        prefix_lens: int ``[B]``; prompt KV of sequence b is at ``[0, prefix_lens[b])`` and its
            tree KV at ``[prefix_lens[b], prefix_lens[b] + n)``.
        tree_mask: ``TreeMask`` with ``B`` trees of ``n`` nodes.
        scale: softmax scale (default ``D ** -0.5``).
        compute_dtype: float32 (default) or float64 for tests.

    Returns:
        ``[B, Hq, n, D]`` in ``compute_dtype``.
    """
    batch, hq, n, d = q.shape
    hkv, seq_len = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    qf, kf, vf = (t.to(compute_dtype) for t in (q, k, v))
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    mask = dense_tree_mask(prefix_lens, tree_mask.to(q.device), seq_len)  # [B, n, S]
    scores = torch.einsum("bhid,bhsd->bhis", qf, kf) * scale
    scores = scores.masked_fill(~mask.unsqueeze(1), -math.inf)
    return torch.einsum("bhis,bhsd->bhid", torch.softmax(scores, dim=-1), vf)


def flex_tree_mask_mod(prefix_lens: torch.Tensor, tree_mask: TreeMask):
    """A FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for the same visibility as the kernel.

    Use with ``torch.nn.attention.flex_attention.create_block_mask(mask_mod, B, None, n, S)``.
    Reads the packed words directly (no dense mask).
    """
    words = tree_mask.words
    pl = prefix_lens.to(words.device, torch.int64)
    n = tree_mask.n
    nw = words.shape[-1]

    def mask_mod(b, h, q_idx, kv_idx):
        p = pl[b]
        j = kv_idx - p
        in_tree = (j >= 0) & (j < n)
        jc = torch.where(in_tree, j, torch.zeros_like(j))
        word = words[b, q_idx, (jc // BITS_PER_WORD).clamp(max=nw - 1)]
        bit = (word >> (jc % BITS_PER_WORD)) & 1
        return (kv_idx < p) | (in_tree & (bit == 1))

    return mask_mod
