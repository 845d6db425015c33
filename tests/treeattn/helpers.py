"""Shared inputs of the cascade tree-attention tests: the device they run on (CUDA when present, else
the CPU through Triton's interpreter), fresh random inputs and the relative error against a reference."""

import torch

from treeattn import TreeMask
from treeattn.layout import random_tree_parents

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _parents(kind: str, t: int, g: torch.Generator) -> torch.Tensor:
    if kind == "chain":
        return torch.arange(-1, t - 1)
    if kind == "star":
        return torch.tensor([-1] + [0] * (t - 1))
    return random_tree_parents(t, max_depth=8, generator=g)


def cascade_inputs(n, hq, hkv, t, d, prefix, suffix, dtype=torch.float32, kind="random", seed=0, extra=3,
                   shared_tree=False):
    """Fresh random inputs: shared prefix of ``prefix`` keys, per-sequence caches of S = max(suffix)
    + t + extra slots (the unused tail filled with noise too)."""
    g = torch.Generator().manual_seed(seed)
    suffix_lens = torch.tensor(suffix, dtype=torch.int32)
    assert len(suffix) == n
    seq_len = int(suffix_lens.max()) + t + extra
    q = torch.randn(n, hq, t, d, generator=g)
    ks = torch.randn(hkv, prefix, d, generator=g)
    vs = torch.randn(hkv, prefix, d, generator=g)
    k = torch.randn(n, hkv, seq_len, d, generator=g)
    v = torch.randn(n, hkv, seq_len, d, generator=g)
    parents = (_parents(kind, t, g).unsqueeze(0) if shared_tree
               else torch.stack([_parents(kind, t, g) for _ in range(n)]))
    mask = TreeMask.from_parents(parents)
    to = lambda x: x.to(DEV, dtype)  # noqa: E731
    return to(q), to(ks), to(vs), to(k), to(v), suffix_lens.to(DEV), mask.to(DEV)


def rel_error(x, ref) -> float:
    """Relative error of ``x`` against the float64 reference ``ref`` (Frobenius norms)."""
    return ((x.double() - ref).norm() / ref.norm()).item()
