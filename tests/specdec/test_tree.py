"""TokenTree validation and construction helpers."""

import pytest
import torch

from specdec import TokenTree


def test_valid_tree_and_children():
    tree = TokenTree(torch.tensor([5, 1, 2, 3, 4]), torch.tensor([-1, 0, 1, 0, 3]))
    assert tree.n == 5
    assert tree.children == ((1, 3), (2,), (), (4,), ())
    assert tree.path_tokens([0, 3, 4]) == [5, 3, 4]
    assert TokenTree.chain(torch.tensor([9, 8, 7])).parents.tolist() == [-1, 0, 1]
    assert tree.token_list == [5, 1, 2, 3, 4] and tree.parent_list == [-1, 0, 1, 0, 3]  # host copies
    with pytest.raises(TypeError):
        TokenTree(torch.tensor([5]), torch.tensor([-1]), token_list=[5])  # not an argument


def test_from_any_order_reorders_depth_first():
    # breadth-first: 0 -> (1, 2), 1 -> 3, 2 -> 4
    tokens = torch.tensor([0, 1, 2, 3, 4])
    parents = torch.tensor([-1, 0, 0, 1, 2])
    probs = torch.eye(5)
    tree = TokenTree.from_any_order(tokens, parents, probs, "iid")
    assert tree.tokens.tolist() == [0, 1, 3, 2, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3]
    assert tree.draft_probs.argmax(-1).tolist() == [0, 1, 3, 2, 4]  # rows moved with their nodes


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([0, 0])), r"parents\[0\] = 0: node 0 must be the root"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 1])), r"parents\[1\] = 1: expected 0 <= parent < 1"),
        (dict(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 0, -1])), r"parents\[2\] = -1"),
        (dict(tokens=torch.tensor([1, 2, 3, 4]), parents=torch.tensor([-1, 0, 0, 1])), r"parents\[3\] = 1: nodes are not in depth-first order"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1])), r"parents: expected shape \[2\]"),
        (dict(tokens=torch.tensor([], dtype=torch.long), parents=torch.tensor([], dtype=torch.long)), r"tokens: expected at least the root"),
        (dict(tokens=torch.tensor([1.0]), parents=torch.tensor([-1])), r"tokens: expected an int64 tensor of shape \[n\]"),
        (dict(tokens=[1], parents=torch.tensor([-1])), r"tokens: expected a torch.Tensor, got list"),
        (dict(tokens=torch.tensor([1, -3]), parents=torch.tensor([-1, 0])), r"tokens: expected non-negative token ids"),
        (dict(tokens=torch.tensor([1]), parents=torch.tensor([-1]), proposal="beam"), r"proposal: expected one of"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 0]), draft_probs=torch.zeros(3, 4)), r"draft_probs: expected a float tensor of shape \[2, V\]"),
        (dict(tokens=torch.tensor([1, 7]), parents=torch.tensor([-1, 0]), draft_probs=torch.zeros(2, 4)), r"tokens: expected ids < V = 4"),
    ],
)
def test_invalid_trees(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TokenTree(**kwargs)


def test_tree_is_frozen():
    tree = TokenTree(torch.tensor([1]), torch.tensor([-1]))
    with pytest.raises(Exception):
        tree.proposal = "iid"
