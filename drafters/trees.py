"""Static tree topologies ("choices", as in Medusa) and the acceptance estimates they are built from.

A topology is a tuple of *choices*: rank paths from the root. ``(0,)`` is the root's best child,
``(1,)`` its second best, ``(0, 2)`` the third-best child of ``(0,)``; a drafter fills node
``(r_1, ..., r_d)`` with its rank-``r_d`` proposal at depth d under that parent (Medusa: head d's
``r_d``-th token). Every proper prefix of a choice is a choice (ancestor-closed); the root is
implicit, so a topology of t choices is a tree of t nodes besides the root.

**How trees are built** (:func:`build_choices`; the greedy tree search of Medusa and, for this
positional-acceptance model, Sequoia's dynamic program reduces to the same greedy). Let
``a[d][r]`` be the probability that the rank-r child of an accepted depth-(d-1) node is accepted
(an :class:`AcceptanceTable`). Assuming acceptances along a path are independent, the node
``(r_1..r_d)`` is reached with probability ``P = prod_i a[i][r_i]`` and the expected number of
accepted tokens of a tree is ``sum_nodes P`` (+1 for the bonus token). Starting from the root,
repeatedly add the candidate node with the highest ``P``; candidates are the first child of every
added node and the next sibling of every added node. Since ``P`` never grows along a path and
(for rank-sorted tables) along siblings, every prefix of the build order is an optimal tree of
its size under this model, and the returned choices are in build order: ``choices[:t]`` is
itself the best t-node tree.

**Where the estimates come from.** :class:`AcceptanceStats` records, from ``(tree, verdict)``
pairs, for every child of every accepted node its depth, its rank among its siblings and whether
it was the accepted one; :meth:`AcceptanceStats.table` (or :func:`acceptance_table` over plain
``(depth, rank, accepted)`` records) turns the counts into ``a[d][r]`` (smoothed towards a prior).
:func:`default_acceptance` is the documented prior used when nothing was measured.

:data:`MC_SIM_7B_63` is Medusa's published 63-node tree (``medusa_choices.py``) for comparison.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MC_SIM_7B_63",
    "STATIC_SIZES",
    "AcceptanceRecorder",
    "AcceptanceStats",
    "AcceptanceTable",
    "Topology",
    "acceptance_table",
    "build_choices",
    "default_acceptance",
    "expected_accepted_length",
    "record_acceptance",
    "static_tree",
    "truncate_choices",
    "validate_choices",
]

Choices = tuple[tuple[int, ...], ...]

#: Tree sizes (nodes besides the root) with a prebuilt default topology (:func:`static_tree`).
STATIC_SIZES = (32, 64, 128, 256)

# Medusa's `mc_sim_7b_63` (FasterDecoding/Medusa, medusa/model/medusa_choices.py): 63 nodes found
# by their greedy search on Vicuna-7B head accuracies, 10 ranks, depth <= 4. Published data.
MC_SIM_7B_63: Choices = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0),
    (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0),
    (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5),
    (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9),
    (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5),
    (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)  # fmt: skip


# ----------------------------------------------------------------------------------------------
# acceptance estimates


@dataclass(frozen=True)
class AcceptanceTable:
    """``probs[d - 1][r]``: P(the rank-r child of an accepted depth-(d-1) node is accepted).

    Rows are depths 1..D, columns ranks 0..R-1; values in [0, 1]. Trees built from a table have
    depth <= D and at most R children per node.
    """

    probs: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.probs or not all(self.probs):
            raise ValueError("probs: expected at least one depth with at least one rank, got an empty table")
        ranks = len(self.probs[0])
        for d, row in enumerate(self.probs, start=1):
            if len(row) != ranks:
                raise ValueError(f"probs: expected {ranks} ranks at every depth, got {len(row)} at depth {d}")
            for r, p in enumerate(row):
                if not 0.0 <= p <= 1.0:
                    raise ValueError(f"probs: expected values in [0, 1], got {p} at depth {d}, rank {r}")

    @property
    def depth(self) -> int:
        return len(self.probs)

    @property
    def ranks(self) -> int:
        return len(self.probs[0])

    def __call__(self, depth: int, rank: int) -> float:
        """``a[depth][rank]`` (depth >= 1), 0 outside the table."""
        if 1 <= depth <= self.depth and 0 <= rank < self.ranks:
            return self.probs[depth - 1][rank]
        return 0.0


def default_acceptance(depth: int = 10, ranks: int = 16, top1: float = 0.75, decay: float = 0.05,
                       floor: float = 0.5, spread: float = 0.8, zipf: float = 1.5) -> AcceptanceTable:
    """The prior used when nothing was measured (a heuristic, not a measurement).

    Top-1 acceptance at depth d is ``max(floor, top1 - decay * (d - 1))`` (deeper guesses are
    worse, as for Medusa heads); a fraction ``spread`` of the remaining mass is spread over ranks
    1..R-1 with Zipf weights ``r ** -zipf`` (so each depth's row sums to at most 1).
    """
    if depth < 1 or ranks < 1:
        raise ValueError(f"depth, ranks: expected >= 1, got {depth}, {ranks}")
    weights = [r**-zipf for r in range(1, ranks)]
    total = sum(weights) or 1.0
    rows = []
    for d in range(1, depth + 1):
        p1 = max(floor, top1 - decay * (d - 1))
        rest = (1.0 - p1) * spread
        rows.append((p1, *(rest * w / total for w in weights)))
    return AcceptanceTable(tuple(rows))


def acceptance_table(
    records: Iterable[tuple[int, int, bool]],
    depth: int | None = None,
    ranks: int | None = None,
    prior: AcceptanceTable | None = None,
    strength: float = 4.0,
) -> AcceptanceTable:
    """Estimate ``a[d][r]`` from ``(depth, rank, accepted)`` records (one per tried child).

    ``a[d][r] = (accepted + strength * prior(d, r)) / (tried + strength)``: the empirical rate,
    pulled towards ``prior`` (default :func:`default_acceptance`) where there are few records.
    ``depth`` / ``ranks`` default to the largest seen (at least 1).
    """
    counts: dict[tuple[int, int], list[int]] = {}
    for d, r, acc in records:
        if d < 1 or r < 0:
            raise ValueError(f"records: expected depth >= 1 and rank >= 0, got ({d}, {r})")
        c = counts.setdefault((d, r), [0, 0])
        c[0] += 1
        c[1] += int(bool(acc))
    depth = depth or max([d for d, _ in counts] + [1])
    ranks = ranks or max([r + 1 for _, r in counts] + [1])
    prior = prior or default_acceptance(depth, ranks)
    rows = []
    for d in range(1, depth + 1):
        row = []
        for r in range(ranks):
            tried, acc = counts.get((d, r), (0, 0))
            row.append((acc + strength * prior(d, r)) / (tried + strength) if tried + strength > 0 else 0.0)
        rows.append(tuple(row))
    return AcceptanceTable(tuple(rows))


def record_acceptance(tree, verdict) -> list[tuple[int, int, bool]]:
    """``(depth, rank, accepted)`` for every child of every node on the accepted path.

    ``rank`` is the child's index among its siblings (proposal order: the draft's rank for top-k
    trees); ``accepted`` whether it is the path's next node. Works for any drafter's trees.
    """
    out = []
    path = verdict.path
    for j, node in enumerate(path):
        nxt = path[j + 1] if j + 1 < len(path) else None
        for r, child in enumerate(tree.children[node]):
            out.append((j + 1, r, child == nxt))
    return out


class AcceptanceStats:
    """Accumulates :func:`record_acceptance` counts over many steps (e.g. from a drafter's runs)."""

    def __init__(self) -> None:
        self.tried: dict[tuple[int, int], int] = {}
        self.accepted: dict[tuple[int, int], int] = {}

    def record(self, tree, verdict) -> None:
        for d, r, acc in record_acceptance(tree, verdict):
            self.tried[(d, r)] = self.tried.get((d, r), 0) + 1
            self.accepted[(d, r)] = self.accepted.get((d, r), 0) + int(acc)

    def records(self) -> list[tuple[int, int, bool]]:
        """The counts as ``(depth, rank, accepted)`` records (for :func:`acceptance_table`)."""
        out = []
        for key, n in self.tried.items():
            a = self.accepted.get(key, 0)
            out += [(*key, True)] * a + [(*key, False)] * (n - a)
        return out

    def table(self, depth: int | None = None, ranks: int | None = None, prior: AcceptanceTable | None = None,
              strength: float = 4.0) -> AcceptanceTable:
        return acceptance_table(self.records(), depth, ranks, prior, strength)


class AcceptanceRecorder:
    """A drafter proxy that records every verified tree into an :class:`AcceptanceStats`.

    ``SpecDecoder(target, AcceptanceRecorder(drafter), t)``; afterwards ``recorder.stats.table()``
    is the measured acceptance table (e.g. to build static topologies for Medusa heads). Every
    other attribute is the wrapped drafter's.
    """

    def __init__(self, inner, stats: AcceptanceStats | None = None) -> None:
        self.inner = inner
        self.stats = AcceptanceStats() if stats is None else stats

    @property
    def vocab_size(self):
        return getattr(self.inner, "vocab_size", None)

    @property
    def needs_hidden_states(self) -> bool | str:
        return getattr(self.inner, "needs_hidden_states", False)  # as is: "all" / "last" must pass through

    def reset(self, input_ids):
        return self.inner.reset(input_ids)

    def propose(self, context):
        return self.inner.propose(context)

    def update(self, context, tree, verdict):
        self.stats.record(tree, verdict)
        return self.inner.update(context, tree, verdict)

    def __getattr__(self, name: str):
        return getattr(self.__dict__["inner"], name)


# ----------------------------------------------------------------------------------------------
# building topologies


def build_choices(t: int, table: AcceptanceTable | None = None) -> Choices:
    """The t-node tree maximizing expected accepted length under ``table`` (greedy growth).

    Returns choices in build order (see the module docstring); exactly t of them. Raises
    ``ValueError`` if the table cannot hold t nodes (``sum_d R**d < t``).
    """
    if not isinstance(t, int) or isinstance(t, bool) or t < 0:
        raise ValueError(f"t: expected an int >= 0, got {t!r}")
    table = table or default_acceptance()
    capacity = sum(table.ranks**d for d in range(1, table.depth + 1))
    if t > capacity:
        raise ValueError(f"t: expected at most {capacity} nodes for a table of depth {table.depth} and "
                         f"{table.ranks} ranks, got {t}")  # fmt: skip
    out: list[tuple[int, ...]] = []
    # (-P, build tie-breakers: depth, path) -> deterministic order
    heap: list[tuple[float, int, tuple[int, ...]]] = [(-table(1, 0), 1, (0,))]
    probs = {(): 1.0}
    while len(out) < t:
        neg, _, path = heapq.heappop(heap)
        out.append(path)
        probs[path] = -neg
        d, r = len(path), path[-1]
        if r + 1 < table.ranks:  # next sibling
            sib = path[:-1] + (r + 1,)
            heapq.heappush(heap, (-probs[path[:-1]] * table(d, r + 1), d, sib))
        if d < table.depth:  # first child
            heapq.heappush(heap, (-probs[path] * table(d + 1, 0), d + 1, path + (0,)))
    return tuple(out)


def expected_accepted_length(choices: Sequence[Sequence[int]], table: AcceptanceTable) -> float:
    """Expected tokens per step under ``table``: 1 (bonus) + the sum of every node's path probability."""
    total = 1.0
    for path in validate_choices(choices):
        p = 1.0
        for d, r in enumerate(path, start=1):
            p *= table(d, r)
        total += p
    return total


@functools.lru_cache(maxsize=32)
def _default_tree(t: int, depth: int) -> Choices:
    return build_choices(t, default_acceptance(depth=depth))


def static_tree(t: int, table: AcceptanceTable | None = None, depth: int = 10) -> Choices:
    """A t-node topology: built from ``table``, or (cached) from ``default_acceptance(depth)``."""
    return build_choices(t, table) if table is not None else _default_tree(t, depth)


def validate_choices(choices: Sequence[Sequence[int]]) -> Choices:
    """Choices as a tuple of int tuples; ``ValueError`` unless non-empty paths, unique, ancestor-closed."""
    out = tuple(tuple(int(r) for r in c) for c in choices)
    seen = set()
    for c in out:
        if not c or any(r < 0 for r in c):
            raise ValueError(f"choices: expected non-empty paths of ranks >= 0, got {c}")
        if c in seen:
            raise ValueError(f"choices: expected unique paths, got {c} twice")
        seen.add(c)
    for c in out:
        if len(c) > 1 and c[:-1] not in seen:
            raise ValueError(f"choices: expected every prefix of a path to be a choice, {c} lacks {c[:-1]}")
    return out


def truncate_choices(choices: Sequence[Sequence[int]], t: int) -> Choices:
    """The first t choices (in the given order) whose ancestors were all kept before them."""
    kept: list[tuple[int, ...]] = []
    have = {()}
    for c in validate_choices(choices):
        if len(kept) == t:
            break
        if c[:-1] in have:
            kept.append(c)
            have.add(c)
    return tuple(kept)


@dataclass(frozen=True)
class Topology:
    """A topology laid out as a tree: nodes in depth-first order, root first.

    Attributes:
        choices: the rank paths (ancestor-closed), in the order given.
        paths: per node (root = ``()``), its rank path, depth-first (children by rank).
        parents: int64 ``[n]`` parent of each node (``-1`` at the root).
        depth: int64 ``[n]``; ``rank``: int64 ``[n]`` (the root has rank 0).
    """

    choices: Choices
    paths: tuple[tuple[int, ...], ...]
    parents: torch.Tensor
    depth: torch.Tensor
    rank: torch.Tensor

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]]) -> "Topology":
        ch = validate_choices(choices)
        paths = ((),) + tuple(sorted(ch))  # lexicographic = depth-first, children by rank
        index = {p: i for i, p in enumerate(paths)}
        parents = torch.tensor([-1] + [index[p[:-1]] for p in paths[1:]], dtype=torch.int64)
        depth = torch.tensor([len(p) for p in paths], dtype=torch.int64)
        rank = torch.tensor([p[-1] if p else 0 for p in paths], dtype=torch.int64)
        return cls(ch, paths, parents, depth, rank)

    @property
    def n(self) -> int:
        """Nodes including the root."""
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())

    @property
    def max_rank(self) -> int:
        """Largest rank used (so drafters need ``max_rank + 1`` candidates per depth)."""
        return int(self.rank.max())
