"""Greedy and stochastic verification on synthetic trees and distributions.

The stochastic tests simulate decoding two tokens with a small vocabulary: a tree of depth 2 is
drawn as its proposal kind says, verified, and (if only one token came out) a second tree rooted
at the first token is verified too. The empirical joint distribution of the two tokens must match
the target's ``p1(x1) p2(y | x1)`` (chi-square at significance 1e-4, fixed seeds). Each test also
checks that a deliberately wrong variant (a mislabelled proposal kind, or a verifier without the
residual update) fails the same check, so the check has the power to catch such bugs.
"""

from __future__ import annotations

import pytest
import torch

import specdec.verify as verify_mod
from specdec import TokenTree, Verdict, verify_greedy, verify_stochastic
from specdec.verify import greedy_verdict
from tests.specdec.helpers import chi2_fails
from treeattn.layout import random_tree_parents

V = 5
K1, K2 = 3, 2  # children of the root, children of each depth-1 node


def _dist(gen, *shape, sharp=1.5):
    return (torch.randn(*shape, V, generator=gen, dtype=torch.float64) * sharp).softmax(-1).float()


@pytest.fixture(scope="module")
def dists():
    gen = torch.Generator().manual_seed(1234)
    p1, p2, p3 = _dist(gen), _dist(gen, V), _dist(gen)
    q1, q2 = _dist(gen), _dist(gen, V)
    p2[0] = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0])  # a target with zeros where the draft has mass
    q1[3] = 0.0  # a draft with a zero where the target has mass
    q1 /= q1.sum()
    return p1, p2, p3, q1, q2


def _draw(q: torch.Tensor, k: int, kind: str, gen: torch.Generator) -> list[int]:
    if kind == "topk":
        return torch.topk(q, k).indices.tolist()
    return torch.multinomial(q, k, replacement=kind == "iid", generator=gen).tolist()


def _step(root_tok, p_root, q_root, p_child, q_child, p_leaf, draw_kind, label, gen):
    """Draw a depth-2 tree, verify it with proposal ``label``; return the emitted tokens."""
    tokens, parents, rows_p, rows_q = [root_tok], [-1], [p_root], [q_root]
    for x in _draw(q_root, K1, draw_kind, gen):
        me = len(tokens)
        tokens.append(x)
        parents.append(0)
        rows_p.append(p_child[x])
        rows_q.append(q_child[x])
        for y in _draw(q_child[x], K2, draw_kind, gen):
            tokens.append(y)
            parents.append(me)
            rows_p.append(p_leaf)
            rows_q.append(torch.full((V,), 1.0 / V))
    tree = TokenTree(torch.tensor(tokens), torch.tensor(parents), torch.stack(rows_q), label)
    return verify_stochastic(tree, torch.stack(rows_p), gen).new_tokens(tree)


def _joint_counts(dists, draw_kind, label, samples, seed=0):
    p1, p2, p3, q1, q2 = dists
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(samples):
        out = _step(0, p1, q1, p2, q2, p3, draw_kind, label, gen)
        if len(out) == 1:  # the next step: a fresh tree rooted at the first token
            x = out[0]
            out = out + _step(x, p2[x], q2[x], p2, q2, p3, draw_kind, label, gen)[:1]
        counts[out[0], out[1]] += 1
    return counts


def _target_joint(dists):
    p1, p2 = dists[0], dists[1]
    return p1[:, None] * p2


SAMPLES = 4000


@pytest.mark.parametrize("kind", ["iid", "no_replacement", "topk"])
def test_stochastic_lossless(dists, kind):
    counts = _joint_counts(dists, kind, kind, SAMPLES)
    assert not chi2_fails(counts, _target_joint(dists))


@pytest.mark.parametrize(
    "draw_kind,label",
    [("no_replacement", "iid"), ("iid", "no_replacement"), ("topk", "iid"), ("topk", "no_replacement")],
)
def test_mislabelled_proposal_is_detected(dists, draw_kind, label):
    counts = _joint_counts(dists, draw_kind, label, SAMPLES // 3)
    assert chi2_fails(counts, _target_joint(dists))


@pytest.mark.parametrize("kind", ["iid", "topk"])
def test_missing_residual_update_is_detected(dists, kind, monkeypatch):
    # every residual update of the one-copy verifier disabled: p stays the target's row at each node
    monkeypatch.setattr(verify_mod, "_sampled_residual", lambda p, q: p)
    monkeypatch.setattr(verify_mod, "_zero_children", lambda rows, flat: None)
    monkeypatch.setattr(verify_mod, "_topk_remaining", lambda remaining, g: remaining)
    counts = _joint_counts(dists, kind, kind, SAMPLES // 3)
    assert chi2_fails(counts, _target_joint(dists))


@pytest.mark.parametrize("kind", ["iid", "no_replacement", "topk"])
def test_one_hot_target_is_exact(kind):
    gen = torch.Generator().manual_seed(0)
    q = _dist(gen, 7)
    target = torch.zeros(7, V)
    want = [3, 1, 4, 1, 0, 2, 2]
    target[torch.arange(7), torch.tensor(want)] = 1.0
    parents = torch.tensor([-1, 0, 1, 1, 0, 4, 0])
    for trial in range(50):
        tokens = torch.randint(V, (7,), generator=gen)
        tree = TokenTree(tokens, parents, q, kind)
        verdict = verify_stochastic(tree, target, gen)
        greedy = verify_greedy(tree, target)
        assert verdict == greedy, trial


def test_sample_from_residual_when_no_children(dists):
    p1 = dists[0]
    gen = torch.Generator().manual_seed(5)
    tree = TokenTree(torch.tensor([0]), torch.tensor([-1]), None, "iid")
    counts = torch.zeros(V)
    for _ in range(3000):
        v = verify_stochastic(tree, p1[None], gen)
        assert v.path == (0,)
        counts[v.bonus_token] += 1
    assert not chi2_fails(counts, p1)


def test_greedy_follows_argmax_path():
    #        0
    #      / | \
    #     1  3  5          tokens: node1=7, node3=8, node5=8 (duplicate of node 3)
    #     |  |
    #     2  4             node2=1, node4=9
    tokens = torch.tensor([0, 7, 1, 8, 9, 8])
    parents = torch.tensor([-1, 0, 1, 0, 3, 0])
    tree = TokenTree(tokens, parents)
    logits = torch.zeros(6, 10)
    logits[0, 8] = 1  # root -> 8: nodes 3 and 5 match, the first (3) is followed
    logits[3, 9] = 1  # node 3 -> 9: node 4
    logits[4, 6] = 1  # bonus after node 4
    assert verify_greedy(tree, logits) == Verdict((0, 3, 4), 6)
    assert verify_greedy(tree, logits).new_tokens(tree) == [8, 9, 6]
    logits[3, 9], logits[3, 2] = 0, 1  # node 3 -> 2: no child matches, bonus 2
    assert verify_greedy(tree, logits) == Verdict((0, 3), 2)
    logits[0, 8], logits[0, 5] = 0, 1
    assert verify_greedy(tree, logits) == Verdict((0,), 5)


def _greedy_by_children(tree: TokenTree, best: list[int]) -> Verdict:
    """The greedy walk as specified: from the root, the first child (proposal order) holding the argmax."""
    path = [0]
    while True:
        want = best[path[-1]]
        nxt = next((c for c in tree.children[path[-1]] if tree.token_list[c] == want), None)
        if nxt is None:
            return Verdict(tuple(path), want)
        path.append(nxt)


@pytest.mark.parametrize("n", [1, 2, 7, 33, 65, 130])
def test_greedy_verdict_equals_the_walk_over_children(n):
    """One pass in index order finds the walk's path on random depth-first trees with a tiny vocabulary
    (many duplicate siblings, long accepted paths); padded argmax rows are ignored."""
    gen = torch.Generator().manual_seed(n)
    for trial in range(40):
        par = random_tree_parents(n, max_depth=1 + trial % 9, generator=gen)
        tree = TokenTree.from_any_order(torch.randint(3, (n,), generator=gen), par)
        best = torch.randint(3, (n + 5,), generator=gen).tolist()
        want = _greedy_by_children(tree, best)
        assert greedy_verdict(tree, best) == want, trial
        logits = torch.randn(n, 3, generator=gen)
        assert verify_greedy(tree, logits) == _greedy_by_children(tree, logits.argmax(-1).tolist())


def test_verify_errors():
    tree = TokenTree(torch.tensor([0, 3]), torch.tensor([-1, 0]), None, "iid")
    with pytest.raises(ValueError, match=r"target_logits: expected 2 rows"):
        verify_greedy(tree, torch.zeros(3, V))
    with pytest.raises(ValueError, match=r"target_probs: expected a float tensor of shape \[n, V\]"):
        verify_stochastic(tree, torch.zeros(2, V, dtype=torch.long))
    with pytest.raises(ValueError, match=r"tree.draft_probs: expected \[n, V\] proposal probabilities"):
        verify_stochastic(tree, torch.full((2, V), 1.0 / V))
    with pytest.raises(ValueError, match=r"tree.tokens: expected ids < V = 3"):
        verify_greedy(tree, torch.zeros(2, 3))
    wrong_vocab = TokenTree(torch.tensor([0, 3]), torch.tensor([-1, 0]), torch.full((2, 8), 0.125), "iid")
    with pytest.raises(ValueError, match=r"tree.draft_probs: expected the target's vocabulary size V = 5, got 8"):
        verify_stochastic(wrong_vocab, torch.full((2, V), 1.0 / V))
    with pytest.raises(ValueError, match=r"tree: expected a specdec.TokenTree"):
        verify_greedy("not a tree", torch.zeros(2, V))
