"""Static topologies: sizes, validity, greedy optimality, estimates from recorded acceptance."""

from __future__ import annotations

import itertools

import pytest
import torch

from drafters.trees import (
    MC_SIM_7B_63,
    AcceptanceRecorder,
    STATIC_SIZES,
    AcceptanceStats,
    AcceptanceTable,
    Topology,
    acceptance_table,
    build_choices,
    default_acceptance,
    expected_accepted_length,
    record_acceptance,
    static_tree,
    truncate_choices,
    validate_choices,
)
from specdec import TokenTree, Verdict


@pytest.mark.parametrize("t", STATIC_SIZES + (1, 5, 512))
def test_static_trees_have_exactly_t_nodes_and_are_valid(t):
    ch = static_tree(t)
    assert len(ch) == t
    assert validate_choices(ch) == ch
    topo = Topology.from_choices(ch)
    assert topo.n == t + 1
    TokenTree(torch.zeros(topo.n, dtype=torch.int64), topo.parents)  # depth-first and rooted
    for i, path in enumerate(topo.paths):
        assert int(topo.depth[i]) == len(path)
        if i:
            assert topo.paths[int(topo.parents[i])] == path[:-1]


def test_build_order_prefixes_are_trees_and_grow_the_expected_length():
    ch = static_tree(256)
    table = default_acceptance()
    for t in (1, 7, 32, 100):
        assert truncate_choices(ch, t) == ch[:t]  # every prefix of the build order is ancestor-closed
    lengths = [expected_accepted_length(ch[:t], table) for t in (32, 64, 128, 256)]
    assert lengths == sorted(lengths)


def test_greedy_is_optimal_for_small_trees():
    """Against brute force over all ancestor-closed trees of a small table."""
    table = AcceptanceTable(((0.6, 0.25, 0.1), (0.5, 0.2, 0.05), (0.45, 0.3, 0.1)))
    universe = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
    for t in (1, 2, 3, 4):
        best = 0.0
        for subset in itertools.combinations(universe, t):
            s = set(subset)
            if all(len(p) == 1 or p[:-1] in s for p in subset):
                best = max(best, expected_accepted_length(subset, table))
        assert expected_accepted_length(build_choices(t, table), table) == pytest.approx(best)


def test_mc_sim_7b_63_is_the_published_medusa_tree():
    assert len(MC_SIM_7B_63) == 63
    validate_choices(MC_SIM_7B_63)
    topo = Topology.from_choices(MC_SIM_7B_63)
    assert topo.max_depth == 4 and topo.max_rank == 9
    assert MC_SIM_7B_63[:5] == ((0,), (0, 0), (1,), (0, 1), (2,))


def test_estimates_from_recorded_acceptance():
    # tree: root -> a (rank 0) -> c (rank 0); root -> b (rank 1)
    tree = TokenTree(torch.tensor([9, 1, 3, 2]), torch.tensor([-1, 0, 1, 0]))
    v = Verdict((0, 1, 2), 5)
    assert sorted(record_acceptance(tree, v)) == [(1, 0, True), (1, 1, False), (2, 0, True)]
    stats = AcceptanceStats()
    for _ in range(30):
        stats.record(tree, v)  # rank 0 always accepted at depth 1 and 2
        stats.record(tree, Verdict((0, 3), 5))  # rank 1 accepted at depth 1
        stats.record(tree, Verdict((0,), 5))  # nothing accepted
    table = stats.table(depth=2, ranks=2, strength=0.0)
    assert table(1, 0) == pytest.approx(1 / 3) and table(1, 1) == pytest.approx(1 / 3)
    assert table(2, 0) == pytest.approx(1.0)
    # smoothing pulls unseen cells to the prior
    prior = default_acceptance(2, 2)
    assert acceptance_table([], 2, 2, prior)(2, 1) == pytest.approx(prior(2, 1))
    # a measured table builds trees like any other
    assert len(build_choices(3, table)) == 3


def test_errors():
    with pytest.raises(ValueError, match=r"choices: expected every prefix of a path to be a choice, \(0, 1\) lacks \(0,\)"):
        validate_choices([(1,), (0, 1)])
    with pytest.raises(ValueError, match=r"choices: expected unique paths"):
        validate_choices([(0,), (0,)])
    with pytest.raises(ValueError, match=r"probs: expected values in \[0, 1\]"):
        AcceptanceTable(((1.5,),))
    with pytest.raises(ValueError, match=r"t: expected at most 6 nodes"):
        build_choices(7, AcceptanceTable(((0.5, 0.2), (0.5, 0.2))))


def test_recorder_measures_a_drafter_and_the_table_builds_trees():
    from drafters.draft_model import DraftModelDrafter
    from specdec import SpecDecoder
    from tests.specdec.helpers import VOCAB, perturbed_copy, tiny_model

    target = tiny_model("qwen2")
    rec = AcceptanceRecorder(DraftModelDrafter(perturbed_copy(target, 0.05, seed=1), depth=3, topk=4))
    prompt = torch.randint(3, VOCAB, (8,), generator=torch.Generator().manual_seed(0))
    out = SpecDecoder(target, rec, tree_size=16, attn_impl="torch").generate(prompt, 30)
    tried_d1 = sum(n for (d, _), n in rec.stats.tried.items() if d == 1)
    assert tried_d1 >= len(out.steps)  # every step's root had children
    assert sum(rec.stats.accepted.values()) == out.totals()["tokens_accepted"]
    table = rec.stats.table(depth=3, ranks=4)
    assert table(1, 0) > table(1, 3)  # the draft's top guess is accepted most often
    assert len(static_tree(20, table)) == 20
    assert rec.depth == 3  # attributes of the wrapped drafter
