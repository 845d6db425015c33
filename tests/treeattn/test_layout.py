import pytest
import torch

from treeattn import TreeMask, num_words
from treeattn.layout import pack_bits, random_tree_parents


def _ancestors_naive(parents: list[int]) -> list[set[int]]:
    out = []
    for i in range(len(parents)):
        s, j = set(), i
        while j != -1:
            s.add(j)
            j = parents[j]
        out.append(s)
    return out


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 127, 256, 1000])
def test_words_match_naive_ancestors(n):
    g = torch.Generator().manual_seed(n)
    parents = random_tree_parents(n, max_depth=max(1, n // 7), generator=g)
    tm = TreeMask.from_parents(parents)
    assert tm.words.shape == (1, n, num_words(n)) and tm.words.dtype == torch.int64
    anc = _ancestors_naive(parents.tolist())
    dense = tm.to_dense()[0]
    for i in range(n):
        assert set(torch.nonzero(dense[i]).flatten().tolist()) == anc[i]
        assert tm.depth[0, i].item() == len(anc[i]) - 1
    # The raw bits, read without to_dense: bit j of word w <=> node 64 w + j.
    i = n - 1
    for j in anc[i]:
        assert (tm.words[0, i, j // 64].item() >> (j % 64)) & 1 == 1


def test_bit_63_and_chain():
    n = 130
    tm = TreeMask.from_parents(torch.arange(-1, n - 1))  # a chain: node i's ancestors are 0..i
    dense = tm.to_dense()[0]
    assert torch.equal(dense, torch.ones(n, n, dtype=torch.bool).tril())
    assert tm.words[0, 63, 0].item() == -1  # all 64 bits set, bit 63 is the sign bit
    assert tm.words[0, 129, 2].item() == 0b11
    assert torch.equal(tm.depth[0], torch.arange(n))


def test_star_and_batch():
    star = torch.tensor([-1] + [0] * 69)
    chain = torch.arange(-1, 69)
    tm = TreeMask.from_parents(torch.stack([star, chain]))
    assert tm.batch_size == 2 and tm.n == 70
    assert torch.equal(tm.depth[0], torch.tensor([0] + [1] * 69))
    d = tm.to_dense()
    assert d[0, 50].nonzero().flatten().tolist() == [0, 50]
    assert d[1, 50].sum().item() == 51
    pos = tm.position_ids(torch.tensor([10, 3]))
    assert pos[0, 5].item() == 11 and pos[1, 5].item() == 8


def test_random_tree_is_depth_first_and_depth_bounded():
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 300):
        p = random_tree_parents(n, max_depth=4, generator=g)
        tm = TreeMask.from_parents(p)
        assert tm.depth.max().item() <= 4
        # Depth-first: every subtree is a contiguous range starting at its root.
        dense = tm.to_dense()[0]
        for j in range(n):
            desc = dense[:, j].nonzero().flatten()
            assert desc.min().item() == j and desc.max().item() - j + 1 == len(desc)


@pytest.mark.parametrize(
    "parents, match",
    [
        ([0, 0], r"parents\[0\]\[0\] = 0: node 0 must be the root"),
        ([-1, 0, 3, 1], r"parents\[0\]\[2\] = 3: expected 0 <= parent < 2"),
        ([-1, 0, 2], r"parents\[0\]\[2\] = 2: expected 0 <= parent < 2"),  # self-loop / cycle
        ([-1, 0, -1], r"parents\[0\]\[2\] = -1: .*second root"),
        ([-1, 0, -5], r"parents\[0\]\[2\] = -5: .*out of range"),
        ([-1, 7], r"parents\[0\]\[1\] = 7: .*out of range"),
    ],
)
def test_invalid_parents(parents, match):
    with pytest.raises(ValueError, match=match):
        TreeMask.from_parents(torch.tensor(parents))


def test_invalid_parents_batch_names_row():
    p = torch.tensor([[-1, 0, 1], [-1, 0, 2]])
    with pytest.raises(ValueError, match=r"parents\[1\]\[2\] = 2"):
        TreeMask.from_parents(p)


def test_invalid_parent_types():
    with pytest.raises(ValueError, match="parents: expected an integer tensor"):
        TreeMask.from_parents(torch.tensor([-1.0, 0.0]))
    with pytest.raises(ValueError, match=r"parents: expected shape \[n\] or \[B, n\]"):
        TreeMask.from_parents(torch.zeros(1, 1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one node"):
        TreeMask.from_parents(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="words: expected 2 words per query"):
        TreeMask(words=torch.zeros(1, 65, 1, dtype=torch.int64), depth=torch.zeros(1, 65, dtype=torch.int64))


@pytest.mark.parametrize("shape", [(3,), (2, 64), (5, 70), (2, 3, 130)])
def test_pack_bits_of_any_bool_matrix(shape):
    """``pack_bits``: bit j of word w is ``mask[..., 64 w + j]`` (checked bit by bit, bit 63 included),
    for masks that are no tree's; ``TreeMask.from_parents`` packs its ancestor sets the same way."""
    gen = torch.Generator().manual_seed(sum(shape))
    mask = torch.rand(shape, generator=gen) < 0.5
    words = pack_bits(mask)
    n = shape[-1]
    assert words.shape == (*shape[:-1], num_words(n)) and words.dtype == torch.int64
    flat_mask, flat_words = mask.reshape(-1, n), words.reshape(-1, num_words(n))
    for r in range(flat_mask.shape[0]):
        for j in range(n):
            assert bool((int(flat_words[r, j // 64]) >> (j % 64)) & 1) == bool(flat_mask[r, j])
    tree = TreeMask.from_parents(random_tree_parents(n, max_depth=n, generator=gen))
    assert torch.equal(pack_bits(tree.to_dense()), tree.words)
