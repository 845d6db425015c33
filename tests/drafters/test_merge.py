"""Merged drafters (``drafters.merge``): the trie union of the parts' trees, their budgets, the
verdict each part sees, greedy equality, an EAGLE part's state, the factory and its errors.
(Lossless sampling with merged trees: ``tests/drafters/test_lossless.py``, the ``merge`` cases.)"""

from __future__ import annotations

import functools

import pytest
import torch

from drafters import make_drafter
from drafters.eagle import EagleDrafter, EagleHead
from drafters.lookup import LookupDrafter
from training.distill import target_hidden_states
from drafters.merge import MergedDrafter
from specdec import SpecDecoder
from specdec.drafting import BaseDrafter, DraftContext
from specdec.sampling import SamplingConfig
from specdec.tree import TokenTree
from specdec.verify import Verdict
from tests.drafters.helpers import random_eagle_head
from tests.specdec.helpers import VOCAB, hf_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _target():
    return tiny_model("qwen2")


@functools.lru_cache(maxsize=None)
def _head() -> EagleHead:
    return random_eagle_head(_target())


class _Fixed(BaseDrafter):
    """Proposes fixed random trees (cut to the budget, ancestor-closed); records budgets and verdicts."""

    def __init__(self, seed: int, nodes: int = 12, proposal: str = "topk") -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.nodes, self.proposal = nodes, proposal
        self.budgets: list[int] = []
        self.trees: list[TokenTree] = []
        self.verdicts: list[Verdict] = []

    def propose(self, context: DraftContext) -> TokenTree:
        self.budgets.append(context.tree_size)
        n = min(self.nodes, context.tree_size) + 1
        parents = [-1] + [int(torch.randint(0, i, (1,), generator=self.gen)) for i in range(1, n)]
        tokens = [int(context.tokens[-1])] + torch.randint(3, 7, (n - 1,), generator=self.gen).tolist()  # few tokens: overlaps
        # siblings with equal tokens would be one trie node: keep the first
        seen, keep = set(), [0]
        for i in range(1, n):
            key = (keep.index(parents[i]) if parents[i] in keep else None, tokens[i])
            if key[0] is None or key in seen:
                continue
            seen.add(key)
            keep.append(i)
        new = {old: k for k, old in enumerate(keep)}
        tree = TokenTree.from_any_order(torch.tensor([tokens[i] for i in keep]),
                                        torch.tensor([-1] + [new[parents[i]] for i in keep[1:]]), proposal=self.proposal)
        self.trees.append(tree)
        return tree

    def update(self, context, tree, verdict):
        self.verdicts.append(verdict)


def _paths(tree: TokenTree) -> set[tuple[int, ...]]:
    toks, par = tree.tokens.tolist(), tree.parents.tolist()
    out = set()
    for v in range(tree.n):
        path = []
        while v >= 0:
            path.append(toks[v])
            v = par[v]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_merged_tree_is_the_union_of_the_parts_trees_within_the_budget(seed):
    a, b = _Fixed(seed, nodes=9), _Fixed(100 + seed, nodes=40)
    merged = MergedDrafter([a, b], caps=[5, None])
    tokens = torch.tensor([9, 8, 7])
    for budget in (0, 1, 4, 12, 30):
        tree = merged.propose(DraftContext(tokens, budget))
        pa, pb = _paths(a.trees[-1]), _paths(b.trees[-1])
        assert _paths(tree) == pa | pb  # every part's every path, each once
        assert tree.n - 1 == len(pa | pb) - 1 <= budget
        assert a.budgets[-1] == min(5, budget)  # the first part's cap
        assert b.budgets[-1] == budget - (a.trees[-1].n - 1)  # the rest: what the first part used
        assert merged.last_part_nodes == [a.trees[-1].n - 1, b.trees[-1].n - 1]
        # the first part's children come first at the root
        first = [int(tree.tokens[c]) for c in tree.children[0]][: len(a.trees[-1].children[0])]
        assert first == [int(a.trees[-1].tokens[c]) for c in a.trees[-1].children[0]]


def _fresh_merge(seed: int):
    a, b = _Fixed(seed, nodes=6), _Fixed(seed + 1, nodes=20)
    merged = MergedDrafter([a, b])
    ctx = DraftContext(torch.tensor([9, 8, 7]), 26)
    return a, b, merged, ctx, merged.propose(ctx)


@pytest.mark.parametrize("seed", range(3))
def test_each_part_sees_the_accepted_path_in_its_own_tree(seed):
    tree = _fresh_merge(seed)[-1]
    leaves = [v for v in range(tree.n) if not tree.children[v]]
    cut = 0
    for leaf in leaves:  # accept every root-to-leaf path in turn (the same tree, proposed again)
        a, b, merged, ctx, again = _fresh_merge(seed)
        assert again.tokens.tolist() == tree.tokens.tolist()
        path = [leaf]
        while path[-1] != 0:
            path.append(int(tree.parents[path[-1]]))
        path = tuple(reversed(path))
        merged.update(ctx, again, Verdict(path, 5))
        emitted = tree.path_tokens(path[1:]) + [5]
        for part in (a, b):
            (got,), mine = part.verdicts, part.trees[-1]
            # the part's path spells the longest prefix of the accepted tokens inside its tree
            assert mine.path_tokens(got.path[1:]) == emitted[: got.num_accepted]
            assert got.bonus_token == emitted[got.num_accepted]
            if got.num_accepted < len(path) - 1:  # cut: the next accepted token is no child there
                cut += 1
                assert emitted[got.num_accepted] not in [int(mine.tokens[c]) for c in mine.children[got.path[-1]]]
    assert cut > 0  # some paths left a part's tree


def test_update_reuses_the_proposal_once():
    a, b = _Fixed(1), _Fixed(2)
    merged = MergedDrafter([a, b])
    ctx = DraftContext(torch.tensor([9, 8, 7]), 10)
    tree = merged.propose(ctx)
    merged.update(ctx, tree, Verdict((0,), 5))
    merged.update(ctx, tree, Verdict((0,), 5))  # nothing proposed since: ignored
    assert len(a.verdicts) == len(b.verdicts) == 1


@pytest.mark.parametrize("tree_size,static,layers", [(8, False, None), (24, True, None), (40, False, None),
                                                     (24, True, (0, 1))])
def test_greedy_equals_target_generate_with_lookup_and_eagle(tree_size, static, layers):
    """``layers``: an EAGLE part on the target's layer outputs; the merge asks the engine for them."""
    target = _target()
    prompts = [torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6]), torch.tensor([3]), torch.randint(3, VOCAB, (7,))]
    head = _head() if layers is None else random_eagle_head(target, feature_layers=layers)
    drafter = make_drafter("lookup+eagle", target=target, heads=head, tree_size=tree_size, depth=3, topk=3,
                           static_shapes=static)  # fmt: skip
    assert drafter.feature_layers == layers
    out = SpecDecoder(target, drafter, tree_size=tree_size, attn_impl="torch").generate(prompts, 25)
    for b, p in enumerate(prompts):
        assert out.sequences[b, : out.lengths[b]].tolist() == hf_greedy(target, p, 25)


class _Recorder:
    """Records an EAGLE part's proposals (context tokens, budget, tree)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []
        self.needs_hidden_states = inner.needs_hidden_states
        self.vocab_size = inner.vocab_size

    def reset(self, ids):
        self.inner.reset(ids)

    def propose(self, ctx):
        tree = self.inner.propose(ctx)
        self.calls.append((ctx.tokens.clone(), ctx.tree_size, tree))
        return tree

    def update(self, ctx, tree, verdict):
        self.inner.update(ctx, tree, verdict)


class _Oracle(BaseDrafter):
    """Proposes the next ``depth`` tokens of a known continuation as a chain (accepted in full)."""

    def __init__(self, sequence: list[int], depth: int = 4) -> None:
        self.sequence, self.depth = sequence, depth

    def propose(self, ctx):
        n = len(ctx.tokens)
        chain = self.sequence[n - 1 : n + min(self.depth, ctx.tree_size)]
        return TokenTree.chain(torch.tensor(chain))


def test_an_eagle_part_drafts_what_a_fresh_drafter_drafts_from_all_features():
    """Steps whose accepted path left the EAGLE part's tree (through another part's nodes) keep its
    state right: each of its trees equals a fresh drafter's given every target feature."""
    target = _target()
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(4))
    want = hf_greedy(target, prompt, 30)
    eagle = _Recorder(EagleDrafter(target, _head(), depth=3, topk=3))
    merged = MergedDrafter([_Oracle(want), eagle], caps=[4, None])
    out = SpecDecoder(target, merged, tree_size=12, attn_impl="torch").generate([prompt], 30)
    seq = out.sequences[0, : out.lengths[0]]
    assert seq.tolist() == want
    feats = target_hidden_states(target, seq[None], torch.ones(1, len(seq), dtype=torch.long))[0]
    fresh = EagleDrafter(target, _head(), depth=3, topk=3)
    assert len(eagle.calls) >= 5
    for tokens, budget, tree in eagle.calls:
        fresh.reset([tokens])
        ref = fresh.propose(DraftContext(tokens, budget, hidden=feats[: len(tokens) - 1]))
        assert (tree.tokens.tolist(), tree.parents.tolist()) == (ref.tokens.tolist(), ref.parents.tolist())
    # every step accepted the oracle's 4 tokens: far beyond what the random head's 3-deep tree held
    assert out.totals()["tokens_accepted"] >= 4 * (len(eagle.calls) - 1)


def test_the_factory_routes_options_to_the_parts():
    target = _target()
    d = make_drafter("lookup+eagle", target=target, heads=_head(), tree_size=64, depth=3, **{"lookup.max_depth": 7})
    lookup, eagle = d.drafters
    assert isinstance(d, MergedDrafter) and isinstance(lookup, LookupDrafter) and isinstance(eagle, EagleDrafter)
    assert (lookup.max_depth, eagle.depth, d.caps, d.tree_size) == (7, 3, [16, None], 64)
    assert d.needs_hidden_states == "all"
    d = make_drafter("lookup+eagle", target=target, heads=_head(), caps=[3, 20], **{"eagle.topk": 2})
    assert (d.caps, d.drafters[1].topk, d.tree_size) == ([3, 20], 2, None)
    with pytest.raises(ValueError, match=r"options: no part of 'lookup\+eagle' takes 'choices'"):
        make_drafter("lookup+eagle", target=target, heads=_head(), choices=[[0]])
    with pytest.raises(ValueError, match=r"options: 'medusa.depth' names no part of 'lookup\+eagle'"):
        make_drafter("lookup+eagle", target=target, heads=_head(), **{"medusa.depth": 2})
    for bad in ("lookup+lookup", "lookup+nope"):
        with pytest.raises(ValueError, match="name: expected distinct names of"):
            make_drafter(bad, target=target)


def test_bad_arguments_raise_value_errors_naming_them():
    with pytest.raises(ValueError, match="drafters: expected a non-empty sequence"):
        MergedDrafter([])
    with pytest.raises(ValueError, match=r"drafters\[1\]: expected a drafter"):
        MergedDrafter([_Fixed(0), object()])
    with pytest.raises(ValueError, match="caps: expected 2 entries"):
        MergedDrafter([_Fixed(0), _Fixed(1)], caps=[1])
    with pytest.raises(ValueError, match=r"caps\[0\]: expected None or an int >= 0, got -1"):
        MergedDrafter([_Fixed(0), _Fixed(1)], caps=[-1, None])
    target = _target()
    with pytest.raises(ValueError, match=r"drafters: expected the parts that read the target's features to ask for "
                                         r"the same feature_layers, got \[\(0, 1\), None\]"):  # fmt: skip
        MergedDrafter([EagleDrafter(target, _head()),
                       EagleDrafter(target, random_eagle_head(target, feature_layers=(0, 1)))])
    merged = MergedDrafter([_Fixed(0), _Fixed(1, proposal="iid")])
    ctx = DraftContext(torch.tensor([9, 8, 7]), 10, sampling=SamplingConfig(0.8))
    with pytest.raises(ValueError, match=r"drafters\[1\]: merging needs deterministic children"):
        merged.propose(ctx)
    merged.propose(DraftContext(torch.tensor([9, 8, 7]), 10))  # greedy: any proposal kind merges


class _Chain(BaseDrafter):
    """A chain of ``depth`` tokens: the target's greedy continuation (``right``) or tokens it never
    takes there; records the budgets it was asked with."""

    def __init__(self, references: list[list[int]], right: bool, depth: int = 4) -> None:
        self.references, self.right, self.depth = references, right, depth
        self.budgets: list[int] = []
        self.vocab_size = VOCAB

    def propose(self, context: DraftContext) -> TokenTree:
        self.budgets.append(context.tree_size)
        at = len(context.tokens)
        truth = self.references[context.seq][at : at + min(self.depth, context.tree_size)]
        toks = truth if self.right else [(t + 1) % VOCAB for t in truth]
        return TokenTree.from_any_order(torch.tensor([int(context.tokens[-1])] + toks),
                                        torch.arange(-1, len(toks)), proposal="topk")  # fmt: skip

    def update(self, context, tree, verdict):
        pass


def test_split_by_yield_gives_the_budget_to_the_part_that_is_accepted():
    """``split="yield"``: a part that is never accepted drops to no node (not asked) but for a one-node
    probe every YIELD_PROBE_EVERY steps, the accepted part gets the budget; greedy output is HF's."""
    from drafters.merge import YIELD_PROBE_EVERY

    target = _target()
    prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(2))
    new = 90
    ref = hf_greedy(target, prompt, new)
    wrong, right = _Chain([ref], right=False), _Chain([ref], right=True)
    merged = MergedDrafter([wrong, right], split="yield")
    dec = SpecDecoder(target, merged, tree_size=8, static_shapes=False, attn_impl="torch")
    out = dec.generate(prompt, new)
    assert out.sequences[0, : len(ref)].tolist() == ref
    steps = len(out.steps)
    assert steps > 2 * YIELD_PROBE_EVERY and len(right.budgets) == steps
    assert wrong.budgets[0] == right.budgets[0] == 4  # no yield yet: an even split of 8
    # then the rejected part only on the probe steps, one node each; the accepted part all the rest
    assert wrong.budgets[1:] == [1] * (steps // YIELD_PROBE_EVERY)
    assert min(right.budgets[1:]) == 7 and right.budgets.count(8) == steps - 1 - steps // YIELD_PROBE_EVERY


def test_split_by_yield_caps_from_synthetic_yields():
    def make():
        return MergedDrafter([_Fixed(0), _Fixed(1), _Fixed(2)], split="yield", caps=[None, 2, None])

    assert make().part_caps(12) == [4, 2, 4]  # no yields: even shares; the fixed cap still applies
    merged = make()
    merged.yields = [(6, 0, 2)] * 4  # totals 24 / 0 / 8: the second part's share is under a node
    caps = [merged.part_caps(16) for _ in range(8)]
    assert all(c[0] == 12 and c[2] == 5 for c in caps)
    assert [c[1] for c in caps] == [0] * 7 + [1]  # a one-node probe every eighth step
    assert merged.part_caps(0) == [0, 0, 0]
    assert MergedDrafter([_Fixed(0), _Fixed(1)], caps=[3, None]).part_caps(16) == [3, None]  # "priority"


def test_split_errors_and_the_factory():
    with pytest.raises(ValueError, match="split: expected one of"):
        MergedDrafter([_Fixed(0)], split="even")
    drafter = make_drafter("lookup+eagle", target=_target(), heads=_head(), tree_size=16, split="yield")
    assert drafter.split == "yield" and drafter.caps == [None, None]  # no default caps when splitting by yield
    assert make_drafter("lookup+eagle", target=_target(), heads=_head(), tree_size=16).caps == [4, None]


class _Reading(_Chain):
    """A wrong chain that reads every committed token's target feature (``needs_hidden_states="all"``):
    records, per ask, how many tokens the context holds and how many feature rows came with it."""

    needs_hidden_states = "all"

    def __init__(self, references: list[list[int]]) -> None:
        super().__init__(references, right=False)
        self.asks: list[tuple[int, int]] = []

    def propose(self, context: DraftContext) -> TokenTree:
        self.asks.append((len(context.tokens), 0 if context.hidden is None else context.hidden.shape[0]))
        return super().propose(context)


def test_a_feature_reading_part_that_sat_out_gets_the_rows_it_missed():
    """Skipped steps (``split="yield"``) do not lose the target's features for a part that reads them:
    on each ask it gets one row per token committed since its previous ask (positions L-1-m .. L-2)."""
    target = _target()
    prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(4))
    ref = hf_greedy(target, prompt, 100)
    reading = _Reading([ref])
    dec = SpecDecoder(target, MergedDrafter([reading, _Chain([ref], right=True)], split="yield"), tree_size=8,
                      static_shapes=False, attn_impl="torch")  # fmt: skip
    out = dec.generate(prompt, 100)
    assert out.sequences[0, : len(ref)].tolist() == ref
    assert len(reading.asks) >= 3  # the first step and the probes
    assert reading.asks[0][1] == reading.asks[0][0] - 1  # the prompt's rows but the root's
    for (before, _), (now, rows) in zip(reading.asks, reading.asks[1:]):
        assert rows == now - before  # every token since its last ask, none twice


def test_lookup_and_eagle_split_by_yield_equal_hf_greedy():
    """The real parts under ``split="yield"`` (EAGLE's catch-up reading the rows of steps it sat out):
    token for token the target's greedy output."""
    target = _target()
    prompts = [torch.randint(3, VOCAB, (L,), generator=torch.Generator().manual_seed(s)) for L, s in ((9, 5), (5, 6))]
    refs = [hf_greedy(target, p, 70) for p in prompts]
    drafter = make_drafter("lookup+eagle", target=target, heads=_head(), split="yield", **{"lookup.max_depth": 4})
    dec = SpecDecoder(target, drafter, tree_size=12, static_shapes=False, attn_impl="torch")
    out = dec.generate(prompts, 70)
    for b, ref in enumerate(refs):
        assert out.sequences[b, : len(ref)].tolist() == ref
    assert len(drafter.yields) == 16  # the split ran: a full window of per-part yields
