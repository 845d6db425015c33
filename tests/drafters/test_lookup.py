"""LookupDrafter: matches, trie merging, budgets, greedy equality."""

from __future__ import annotations

import pytest
import torch

from specdec.drafting import DraftContext
from drafters.lookup import LookupDrafter
from specdec import SpecDecoder
from tests.specdec.helpers import VOCAB, hf_greedy, tiny_model, token_paths


pytestmark = pytest.mark.usefixtures("one_thread")


def _ctx(tokens, t, seq=0):
    return DraftContext(torch.tensor(tokens, dtype=torch.int64), t, seq)


def test_matches_become_branches_with_shared_prefixes_merged():
    d = LookupDrafter(max_ngram=2, min_ngram=1, max_depth=3)
    #        0  1  2  3  4  5  6  7  8  9 10
    toks = [5, 6, 7, 8, 5, 6, 7, 9, 1, 5, 6]
    tree = d.propose(_ctx(toks, 64))
    assert int(tree.tokens[0]) == 6
    # (5, 6) matched twice: continuations [7, 9, 1] (recent) and [7, 8, 5] share the node 7;
    # (6,) alone matches the same places, adding nothing new.
    assert token_paths(tree) == {(7,), (7, 9), (7, 9, 1), (7, 8), (7, 8, 5)}
    assert tree.n - 1 == 5
    # the most recent match is the first child (the verifier tries it first)
    first = tree.children[tree.children[0][0]][0]
    assert int(tree.tokens[first]) == 9


def test_budget_is_respected_and_longer_matches_come_first():
    d = LookupDrafter(max_ngram=3, min_ngram=1, max_depth=4)
    toks = [1, 2, 3, 10, 11, 12, 13, 2, 3, 20, 21, 22, 23, 9, 2, 3]
    for t in (1, 2, 3, 4, 6):
        tree = d.propose(_ctx(toks, t))
        assert tree.n - 1 <= t
    # with budget 4 only the most recent (2, 3) continuation fits: [20, 21, 22, 23]
    assert token_paths(d.propose(_ctx(toks, 4))) == {(20,), (20, 21), (20, 21, 22), (20, 21, 22, 23)}
    assert d.propose(_ctx(toks, 0)).n == 1


def test_no_match_is_root_only_and_index_is_incremental():
    d = LookupDrafter(max_ngram=2, min_ngram=2)
    assert d.propose(_ctx([1, 2, 3, 4], 10)).n == 1
    assert token_paths(d.propose(_ctx([1, 2, 3, 4, 1, 2], 10))) >= {(3,), (3, 4)}
    # a different history for the same sequence rebuilds the index
    assert d.propose(_ctx([7, 8, 9], 10)).n == 1


@pytest.mark.parametrize("tree_size", [1, 8, 64, 256])
def test_greedy_equals_target_generate_on_repetitive_text(tree_size):
    model = tiny_model("llama")
    # a prompt that repeats itself: the target's continuation often copies it
    base = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(0))
    prompt = torch.cat([base, base, base[:5]])
    ref = hf_greedy(model, prompt, 40)
    out = SpecDecoder(model, LookupDrafter(), tree_size=tree_size, attn_impl="torch").generate(prompt, 40)
    assert out.sequences[0].tolist() == ref
    assert all(s.nodes_proposed[0] <= tree_size for s in out.steps)


def test_a_long_match_gives_the_copied_continuation():
    d = LookupDrafter(max_ngram=3, max_depth=6)
    seq = [4, 5, 6, 7, 8, 9, 10, 11, 4, 5, 6]
    tree = d.propose(_ctx(seq, 16))
    assert (7, 8, 9, 10, 11, 4) in token_paths(tree)


def test_argument_errors():
    with pytest.raises(ValueError, match=r"min_ngram: expected <= max_ngram = 2, got 3"):
        LookupDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match=r"max_depth: expected an int >= 1, got 0"):
        LookupDrafter(max_depth=0)
