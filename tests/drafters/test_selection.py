"""The device loops' frontier pick against torch's stable sort, on fresh random inputs."""

import pytest
import torch

from drafters.selection import best_k


@pytest.mark.parametrize("n,k", [(1, 1), (9, 3), (64, 8), (200, 64), (65, 65)])
def test_best_k_is_the_stable_descending_sort(n, k):
    gen = torch.Generator().manual_seed(n + k)
    scores = torch.randint(-4, 3, (n,), generator=gen).double()  # many ties
    scores[torch.rand(n, generator=gen) < 0.2] = -float("inf")
    assert torch.equal(best_k(scores, k), torch.sort(scores, descending=True, stable=True).indices[:k])
    fine = torch.randn(n, generator=gen, dtype=torch.float64)
    assert torch.equal(best_k(fine, k), torch.sort(fine, descending=True, stable=True).indices[:k])


def test_best_k_refuses_k_out_of_range():
    for k in (0, 6):
        with pytest.raises(ValueError, match="k: expected"):
            best_k(torch.zeros(5), k)
