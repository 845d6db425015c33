"""The device loops' frontier pick against torch's stable sort, on fresh random inputs."""

import pytest
import torch

from drafters.selection import RANK_MAX, best_k, stable_ranks


@pytest.mark.parametrize("n,k", [(1, 1), (9, 3), (64, 8), (200, 64), (65, 65), (3000, 8)])  # 3000: the sort
def test_best_k_is_the_stable_descending_sort(n, k):
    gen = torch.Generator().manual_seed(n + k)
    scores = torch.randint(-4, 3, (n,), generator=gen).double()  # many ties
    scores[torch.rand(n, generator=gen) < 0.2] = -float("inf")
    assert torch.equal(best_k(scores, k), torch.sort(scores, descending=True, stable=True).indices[:k])
    fine = torch.randn(n, generator=gen, dtype=torch.float64)
    assert torch.equal(best_k(fine, k), torch.sort(fine, descending=True, stable=True).indices[:k])


@pytest.mark.parametrize("n", [1, 7, 329, RANK_MAX + 77])  # above RANK_MAX: through the sort
def test_stable_ranks_invert_the_stable_descending_sort(n):
    gen = torch.Generator().manual_seed(n)
    scores = torch.randint(-3, 2, (n,), generator=gen).double()  # many ties
    scores[torch.rand(n, generator=gen) < 0.2] = -float("inf")
    order = torch.sort(scores, descending=True, stable=True).indices
    assert torch.equal(stable_ranks(scores)[order], torch.arange(n))


@pytest.mark.parametrize("shape,k", [((3, 9), 4), ((2, 4, 64), 8), ((2, RANK_MAX + 5), 3)])  # last: the sort
def test_batched_rows_rank_each_on_its_own(shape, k):
    """A leading batch: every row ranked and picked as it would be alone."""
    gen = torch.Generator().manual_seed(sum(shape) + k)
    scores = torch.randint(-3, 2, shape, generator=gen).double()  # many ties
    scores[torch.rand(shape, generator=gen) < 0.2] = -float("inf")
    flat = scores.reshape(-1, shape[-1])
    ranks, picks = stable_ranks(scores).reshape(-1, shape[-1]), best_k(scores, k).reshape(-1, k)
    for r in range(flat.shape[0]):
        assert torch.equal(ranks[r], stable_ranks(flat[r])) and torch.equal(picks[r], best_k(flat[r], k))


def test_best_k_refuses_k_out_of_range():
    for k in (0, 6):
        with pytest.raises(ValueError, match="k: expected"):
            best_k(torch.zeros(5), k)


@pytest.mark.parametrize("rows,n,k", [(1, 37, 5), (3, 4096, 8), (2, 2048 * 2 + 301, 10), (2, 2049, 1), pytest.param(2, 3000, 64, marks=pytest.mark.slow),
                                      (3, 2500, 3)])
def test_row_topk_kernels_equal_torch_topk(rows, n, k):
    """The Triton kernels (the interpreter on a CPU) against ``torch.topk``: the same values, and the
    same columns for distinct values; a winner in the last, partial chunk."""
    from drafters.selection import row_topk

    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows * n + k))
    x[0, -1] = 10.0
    vals, cols = row_topk(x, k, impl="triton")
    ref_vals, ref_cols = torch.topk(x, k, dim=-1)
    assert torch.equal(vals, ref_vals) and torch.equal(cols, ref_cols)
    assert torch.equal(row_topk(x, k, impl="auto")[1], ref_cols)  # a CPU: torch


def test_row_topk_ties_and_infinities():
    """Equal values rank the smaller column first; -inf entries (a warped row) come before the padding
    of a partial chunk; +inf, negative zero and subnormals keep their order."""
    from drafters.selection import row_topk

    x = torch.full((3, 2500), -float("inf"))
    x[0, [7, 2400, 2100]] = 1.0
    x[1] = (torch.arange(2500) % 5).float()  # ties everywhere: columns 4, 9, 14, ... first
    x[2, :6] = torch.tensor([float("inf"), -0.0, 0.0, 1e-40, -1e-40, -3.0])
    vals, cols = row_topk(x, 8, impl="triton")
    assert torch.equal(vals, torch.topk(x, 8, dim=-1).values)
    assert cols[0, :3].tolist() == [7, 2100, 2400] and set(cols[0, 3:].tolist()) <= set(range(2500))
    assert cols[1].tolist() == [4, 9, 14, 19, 24, 29, 34, 39]
    assert cols[2, :6].tolist() == [0, 3, 1, 2, 4, 5] or cols[2, :6].tolist() == [0, 3, 2, 1, 4, 5]
    assert (cols[2, 6:] >= 6).all() and (cols[2, 6:] < 2500).all()


def test_row_topk_refuses_bad_input():
    from drafters.selection import row_topk

    with pytest.raises(ValueError, match="x: expected a float tensor of shape"):
        row_topk(torch.zeros(5), 1)
    with pytest.raises(ValueError, match=r"k: expected an int in \[1, 5\]"):
        row_topk(torch.zeros(2, 5), 6)
    with pytest.raises(ValueError, match="impl: expected one of"):
        row_topk(torch.zeros(2, 5), 1, impl="cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("rows,n,k", [(8, 32768, 8), (1, 32768, 8), (8, 151936, 16), (40, 151936, 8)])
def test_row_topk_on_cuda_equals_torch_topk_eagerly_and_in_a_cuda_graph(rows, n, k):
    from drafters.selection import row_topk

    x = torch.randn(rows, n, device="cuda", generator=torch.Generator("cuda").manual_seed(n + k))
    ref_vals, ref_cols = torch.topk(x, k, dim=-1)
    vals, cols = row_topk(x, k)  # auto: Triton on CUDA
    assert torch.equal(vals, ref_vals) and torch.equal(cols, ref_cols)
    out = row_topk(x, k)  # warm-up outside the capture, then replay over new inputs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = row_topk(x, k)
    x.copy_(torch.randn_like(x))
    graph.replay()
    ref_vals, ref_cols = torch.topk(x, k, dim=-1)
    assert torch.equal(out[0], ref_vals) and torch.equal(out[1], ref_cols)
