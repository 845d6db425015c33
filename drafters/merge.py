"""Several drafters' trees merged into one (SpecInfer's token-tree merge).

Drafters fail in different places: an EAGLE head guesses the next few tokens of anything, prompt
lookup guesses long spans exactly when the answer copies text it has seen (a docstring, a
signature, an example). ``MergedDrafter([lookup, eagle])`` asks each part in turn for a tree and
inserts it into one trie: a path both parts proposed is one path, differing continuations become
siblings, so the target verifies every part's guesses in the same forward.

**Budget.** The parts propose in the given order; part i gets ``min(caps[i], remaining)`` nodes,
where ``remaining`` is the step's budget minus the merged tree's nodes so far (nodes another part
already proposed cost nothing). ``caps[i] = None``: whatever remains. A part's nodes are inserted in
depth-first order, so the merged tree is ancestor-closed and keeps every part's sibling order; the
earlier part's children of a node come first.

**Split by yield** (``split="yield"``). With ``"priority"`` (the default) the caps above are fixed.
With ``"yield"`` each step's budget is split between the parts by their recent yield: the accepted
drafted tokens each part proposed (a token two parts proposed counts for both), summed over the
last ``YIELD_WINDOW`` updates. Part i's cap is ``ceil(budget * (y_i + e) / sum_j (y_j + e))`` with
``e = YIELD_EXPLORE * (1 + sum_j y_j) / parts`` (every part keeps some share), its fixed cap still
applying; a part whose share rounds below one node is not asked at all that step (its drafting
costs nothing; it catches up when next asked, a part reading the target's features getting the rows
of the steps it sat out), except every ``YIELD_PROBE_EVERY``-th step, when it gets one node's worth
so its yield is measured again. Shares depend only on earlier steps' verdicts,
so a step's tree is still a fixed set of deterministic children when it is verified.

**Sampling.** Merging is lossless under stochastic verification only for deterministic children
(``proposal="topk"``: prompt lookup, EAGLE, Medusa, the draft model with ``proposal="topk"``): the
verifier's rule for such trees holds for any fixed set of distinct children. A part that samples
its children (``"iid"`` / ``"no_replacement"``) raises ``ValueError`` when the context samples.

**State.** Each part sees its own tree in ``update``: the accepted path cut where it leaves that
part's tree, with the next committed token as its bonus (what the sequence did commit next). A
part that reads the target's features gets them as it asked (``needs_hidden_states``: the merge
asks for the most any part needs and hands the ``"last"`` parts only the last row; the parts that
read features must agree on ``feature_layers``, which the merge asks for).

Per step ``last_part_nodes`` holds each part's node count before merging (a benchmark's view of
who proposed what); ``last_phase_s`` is the first profiling part's (e.g. ``EagleDrafter(profile=True)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from drafters._build import make_tree, root_only
from specdec.drafting import (HIDDEN_ALL, HIDDEN_LAST, BaseDrafter, DraftContext, captured_seconds,
                              hidden_states_request, warm_up_drafter)
from specdec.tree import TokenTree
from specdec.verify import Verdict

__all__ = ["SPLITS", "YIELD_EXPLORE", "YIELD_PROBE_EVERY", "YIELD_WINDOW", "MergedDrafter"]

#: How a step's budget is divided between the parts: fixed caps in priority order, or by recent yield.
SPLITS = ("priority", "yield")
#: ``split="yield"``: the updates whose accepted tokens make a part's yield
YIELD_WINDOW = 16
#: ``split="yield"``: each part's share of the yields added to every part (exploration)
YIELD_EXPLORE = 0.05
#: ``split="yield"``: a part left without a node is asked again (one node) every this many steps
YIELD_PROBE_EVERY = 8


@dataclass
class _Merged:
    """The last merged tree of a sequence: per part, merged node (depth-first index) -> part node or -1
    (None for a part not asked that step)."""

    n: int
    to_part: list[list[int] | None]
    parts: list[TokenTree | None]


class MergedDrafter(BaseDrafter):
    """One tree from several drafters (see the module doc).

    Args:
        drafters: the parts, in priority order (at least one; each a ``specdec.drafting.Drafter``).
        caps: per part, the most nodes it may propose per step (None: whatever budget remains);
            default None for every part.
        tree_size: optional cap on the merged tree's nodes per step (the engine's budget applies anyway).
        split: ``"priority"`` (default: ``caps``, fixed) or ``"yield"`` (each step's budget split by
            the parts' recent yield, ``caps`` still capping; see the module doc).
    """

    def __init__(self, drafters: Sequence, caps: Sequence[int | None] | None = None,
                 tree_size: int | None = None, split: str = "priority") -> None:  # fmt: skip
        parts = list(drafters) if isinstance(drafters, Sequence) else None
        if not parts:
            raise ValueError(f"drafters: expected a non-empty sequence of drafters, got {drafters!r}")
        for i, d in enumerate(parts):
            if not callable(getattr(d, "propose", None)) or not callable(getattr(d, "update", None)):
                raise ValueError(f"drafters[{i}]: expected a drafter (propose / update), got {type(d).__name__}")
        caps = [None] * len(parts) if caps is None else list(caps)
        if len(caps) != len(parts):
            raise ValueError(f"caps: expected {len(parts)} entries (one per drafter), got {len(caps)}")
        for i, c in enumerate(caps):
            if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 0):
                raise ValueError(f"caps[{i}]: expected None or an int >= 0, got {c!r}")
        if tree_size is not None and (not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0):
            raise ValueError(f"tree_size: expected None or an int >= 0, got {tree_size!r}")
        if split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {split!r}")
        self.split = split
        #: ``split="yield"``: per recent update, each part's accepted drafted tokens
        self.yields: list[tuple[int, ...]] = []
        self._steps = 0
        vocabs = {v for v in (getattr(d, "vocab_size", None) for d in parts) if v is not None}
        if len(vocabs) > 1:
            raise ValueError(f"drafters: expected one vocabulary size, got {sorted(vocabs)}")
        self.drafters, self.caps, self.tree_size = parts, caps, tree_size
        self.vocab_size = vocabs.pop() if vocabs else None
        self._wants = [hidden_states_request(d) for d in parts]
        self.needs_hidden_states = (HIDDEN_ALL if HIDDEN_ALL in self._wants
                                    else HIDDEN_LAST if HIDDEN_LAST in self._wants else False)  # fmt: skip
        layers = {None if (f := getattr(d, "feature_layers", None)) is None else tuple(f)
                  for d, want in zip(parts, self._wants) if want is not None}  # fmt: skip
        if len(layers) > 1:
            raise ValueError(f"drafters: expected the parts that read the target's features to ask for the same "
                             f"feature_layers, got {sorted(layers, key=str)}")  # fmt: skip
        #: the target layers whose outputs the feature-reading parts get (None: the final feature)
        self.feature_layers = layers.pop() if layers else None
        self._last: dict[int, _Merged] = {}
        #: (sequence, part) -> the target's rows a feature-reading part has not seen (steps it sat out)
        self._pending: dict[tuple[int, int], torch.Tensor] = {}
        self.last_part_nodes: list[int] = []
        self.last_phase_s: dict[str, float] | None = None

    @property
    def captured_s(self) -> float:
        """The parts' captures so far, in seconds (the ``Drafter`` protocol's running total)."""
        return sum(captured_seconds(d) for d in self.drafters)

    def warmup(self, batch_sizes: Sequence[int] = (1,), max_len: int | None = None, log=None,
               tree_sizes: Sequence[int] = ()) -> None:  # fmt: skip
        """Each part's ``warmup`` where it has one (``SpecDecoder.warmup`` calls this), ``tree_sizes``
        to the parts that take it."""
        for d in self.drafters:
            warm_up_drafter(d, batch_sizes, max_len, log, tree_sizes)

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        self._last = {}
        self._pending = {}
        for d in self.drafters:
            d.reset(input_ids)

    def part_caps(self, budget: int) -> list[int | None]:
        """Each part's most nodes this step (``split="yield"``: from the recent yields, 0 = not asked;
        ``"priority"``: the fixed ``caps``). Advances the probe clock when splitting by yield."""
        if self.split == "priority":
            return list(self.caps)
        self._steps += 1
        n = len(self.drafters)
        totals = [sum(y[i] for y in self.yields) for i in range(n)]
        explore = YIELD_EXPLORE * (1 + sum(totals)) / n
        weights = [t + explore for t in totals]
        probe = self._steps % YIELD_PROBE_EVERY == 0
        caps: list[int | None] = []
        for i, w in enumerate(weights):
            share = budget * w / sum(weights)
            cap = math.ceil(share) if share >= 1 else (1 if probe and budget > 0 else 0)
            caps.append(cap if self.caps[i] is None else min(cap, self.caps[i]))
        return caps

    def _context(self, context: DraftContext, part: int, budget: int) -> DraftContext:
        want, hidden = self._wants[part], context.hidden
        if want is None:
            hidden = None
        elif want == HIDDEN_LAST and hidden is not None and hidden.dim() == 2:
            hidden = hidden[-1:]
        elif want == HIDDEN_ALL and (pending := self._pending.pop((context.seq, part), None)) is not None:
            hidden = pending if hidden is None else torch.cat([pending, hidden])  # the rows of steps it sat out
        return replace(context, tree_size=budget, hidden=hidden)

    def _sit_out(self, context: DraftContext, part: int) -> None:
        """Part ``part`` is not asked this step: keep the target's rows it would have read (every
        committed token's, ``HIDDEN_ALL``) for the step it is asked next."""
        if self._wants[part] == HIDDEN_ALL and context.hidden is not None and context.hidden.dim() == 2:
            key = (context.seq, part)
            kept = self._pending.get(key)
            self._pending[key] = context.hidden if kept is None else torch.cat([kept, context.hidden])

    def propose(self, context: DraftContext) -> TokenTree:
        root = int(context.tokens[-1])
        budget = context.tree_size if self.tree_size is None else min(self.tree_size, context.tree_size)
        tok, par = [root], [-1]
        kids: list[dict[int, int]] = [{}]  # merged node -> {token: child}
        maps: list[list[int] | None] = []  # per part: part node -> merged node (creation order); None: not asked
        trees: list[TokenTree | None] = []
        self.last_part_nodes, self.last_phase_s = [], None
        for i, (d, part_cap) in enumerate(zip(self.drafters, self.part_caps(budget))):
            room = max(budget - (len(tok) - 1), 0)
            cap = room if part_cap is None else min(part_cap, room)
            if self.split == "yield" and part_cap == 0:  # not asked: no drafting, no update; it catches up later
                self._sit_out(context, i)
                self.last_part_nodes.append(0)
                trees.append(None)
                maps.append(None)
                continue
            tree = d.propose(self._context(context, i, cap))
            if self.last_phase_s is None:
                self.last_phase_s = getattr(d, "last_phase_s", None)
            if int(tree.tokens[0]) != root:
                raise ValueError(f"drafters[{i}]: proposed a tree rooted at {int(tree.tokens[0])}, expected {root}")
            if context.sampling is not None and tree.proposal != "topk":
                raise ValueError(f"drafters[{i}]: merging needs deterministic children (proposal 'topk') when "
                                 f"sampling, got {tree.proposal!r}")
            if tree.n - 1 > cap:
                raise ValueError(f"drafters[{i}]: proposed {tree.n - 1} nodes, over its budget of {cap}")
            self.last_part_nodes.append(tree.n - 1)
            trees.append(tree)
            where = [0] * tree.n
            toks, parents = tree.tokens.tolist(), tree.parents.tolist()
            for v in range(1, tree.n):  # depth-first: a parent before its children
                p, t = where[parents[v]], toks[v]
                child = kids[p].get(t)
                if child is None:
                    child = kids[p][t] = len(tok)
                    tok.append(t)
                    par.append(p)
                    kids.append({})
                where[v] = child
            maps.append(where)
        if len(tok) == 1:
            tree = root_only(root)
            to_part = [None if where is None else [0] for where in maps]
        else:
            tree, order = make_tree(tok, par)
            new_of = {old: new for new, old in enumerate(order)}
            to_part = []
            for where in maps:
                row = None if where is None else [-1] * tree.n
                for v, m in enumerate(where or ()):
                    row[new_of[m]] = v
                to_part.append(row)
        self._last[context.seq] = _Merged(tree.n, to_part, trees)
        return tree

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        last = self._last.pop(context.seq, None)
        if last is None or last.n != tree.n:
            return
        emitted = verdict.new_tokens(tree)  # the accepted drafted tokens, then the bonus
        accepted = []
        for i, d in enumerate(self.drafters):
            row, path = last.to_part[i], [0]
            if row is None:  # not asked this step
                accepted.append(0)
                continue
            for node in verdict.path[1:]:
                if row[node] < 0:
                    break
                path.append(row[node])
            accepted.append(len(path) - 1)
            d.update(self._context(context, i, context.tree_size), last.parts[i],
                     Verdict(tuple(path), emitted[len(path) - 1]))
        if self.split == "yield":
            self.yields = [*self.yields[1 - YIELD_WINDOW :], tuple(accepted)]
