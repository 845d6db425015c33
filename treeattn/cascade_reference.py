"""Plain-PyTorch reference for shared-prefix ("cascade") tree attention, and the equivalent
unshared layout (the prefix copied into every sequence's cache) that ``tree_attention`` takes.

The reference is the ground truth the cascade kernel is tested against: one softmax over the
concatenated prefix and suffix scores of each sequence, with a dense mask.
"""

from __future__ import annotations

import math

import torch

from treeattn.layout import TreeMask

__all__ = ["cascade_tree_attention_ref", "unshared_layout"]


def _shared_3d(t: torch.Tensor) -> torch.Tensor:
    return t[0] if t.dim() == 4 else t


def cascade_tree_attention_ref(
    q: torch.Tensor,
    k_shared: torch.Tensor,
    v_shared: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    suffix_lens: torch.Tensor,
    tree_mask: TreeMask,
    scale: float | None = None,
    compute_dtype: torch.dtype = torch.float64,
    shared_len: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Cascade tree attention computed in ``compute_dtype`` (float64 by default), one sequence at a
    time (memory ``O(Hq * t * (P + S))``).

    Args:
        q: ``[n, Hq, t, D]``.
        k_shared, v_shared: ``[Hkv, P, D]`` or ``[1, Hkv, P, D]``, the prompt every sequence shares
            (with ``shared_len``: ``[Hkv, C, D]`` buffers whose first P slots hold it).
        k, v: ``[n, Hkv, S, D]``; sequence b's own tokens at ``[0, suffix_lens[b])``, its tree at
            ``[suffix_lens[b], suffix_lens[b] + t)``.
        suffix_lens: int ``[n]``.
        tree_mask: ``TreeMask`` of 1 (shared) or ``n`` trees of ``t`` nodes.
        scale: softmax scale (default ``D ** -0.5``).
        shared_len: None (P = the shape), or P as an int or a one-element tensor (read on the host).

    Returns:
        ``[n, Hq, t, D]`` in ``compute_dtype``: query i of sequence b attends the whole prefix, keys
        ``[0, suffix_lens[b])`` of its cache and the tree keys of its ancestors and itself.
    """
    n, hq, t, d = q.shape
    ks, vs = _shared_3d(k_shared), _shared_3d(v_shared)
    if shared_len is not None:
        live = int(shared_len)
        ks, vs = ks[:, :live], vs[:, :live]
    hkv, p_len = ks.shape[0], ks.shape[1]
    seq_len = k.shape[2]
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    kp = ks.to(compute_dtype).repeat_interleave(group, dim=0)  # [Hq, P, D]
    vp = vs.to(compute_dtype).repeat_interleave(group, dim=0)
    dense = tree_mask.to_dense().to(q.device)  # [1 or n, t, t]
    pos = torch.arange(seq_len, device=q.device)
    out = torch.empty(n, hq, t, d, dtype=compute_dtype, device=q.device)
    for b in range(n):
        sl = int(suffix_lens[b])
        visible = (pos < sl).expand(t, seq_len).clone()  # [t, S]
        visible[:, sl : sl + t] = dense[b if dense.shape[0] > 1 else 0]
        qb = q[b].to(compute_dtype)  # [Hq, t, D]
        kb = k[b].to(compute_dtype).repeat_interleave(group, dim=0)  # [Hq, S, D]
        vb = v[b].to(compute_dtype).repeat_interleave(group, dim=0)
        s_pre = qb @ kp.transpose(1, 2) * scale  # [Hq, t, P]
        s_suf = (qb @ kb.transpose(1, 2) * scale).masked_fill(~visible, -math.inf)  # [Hq, t, S]
        w = torch.softmax(torch.cat([s_pre, s_suf], dim=-1), dim=-1)
        out[b] = w[..., :p_len] @ vp + w[..., p_len:] @ vb
    return out


def unshared_layout(
    k_shared: torch.Tensor, v_shared: torch.Tensor, k: torch.Tensor, v: torch.Tensor, suffix_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same attention in ``tree_attention``'s layout: the prefix copied in front of every
    sequence's cache.

    Returns:
        ``(k_full, v_full, prefix_lens)``: ``[n, Hkv, P + S, D]`` twice and int ``[n]`` =
        ``P + suffix_lens`` (the prompt of ``tree_attention`` is prefix + own tokens).
    """
    ks, vs = _shared_3d(k_shared), _shared_3d(v_shared)
    n = k.shape[0]
    k_full = torch.cat([ks.unsqueeze(0).expand(n, -1, -1, -1), k], dim=2)
    v_full = torch.cat([vs.unsqueeze(0).expand(n, -1, -1, -1), v], dim=2)
    return k_full, v_full, suffix_lens + ks.shape[1]
