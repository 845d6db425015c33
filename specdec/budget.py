"""The per-step node budget of ``SpecDecoder(tree_size="auto")``: draft only as much as pays.

Every step the decoder picks one node budget n for the whole batch from a few candidates
(``budget_ladder``: 0, 4, 8, 16, ... up to the largest tree; each its own fixed-shape target forward
``[B, n + 1]``, built and timed by the warm-up) as the one with the most expected tokens per second::

    rate(n) = active sequences * tokens(n) / (draft_s(n) + step_s(n))

n = 0 is plain decoding: the drafter is not called at all, tokens(0) = 1 and ``draft_s(0)`` = 0.

**Costs** (``StepCosts``, kept by the decoder across calls). ``step_s(n)``: the target's side of a
step at batch size B (the forward, the verification and the commit): the step time seen at (B, n)
in earlier steps (an exponential average; the first step of each (B, n) is not counted: it may
capture or compile), else the warm-up's timed forward of (B, capacity, n) plus the per-step host
overhead seen so far (observed step time minus the warm-up forward of the same shape; plain steps'
and drafted steps' apart: a drafted step's verification and tree work on the host once priced plain
chunks of 16 samples at twice their cost, and the rule drafted where plain decoding was faster), else
unknown: a budget whose cost is unknown is tried (``BudgetDecision.why`` ``"measuring"``) before
any is chosen by rate, so without a warm-up each budget runs twice per batch size. ``draft_s(n)``:
the drafting seconds seen at (sequences asked, n); the nearest budget's at the same count (drafting
cost barely depends on n), else another count's scaled per sequence, from the drafting steps that
were not catching up. ``catch_up_s(k)``: the seconds a drafter needs to take in k tokens it was not
shown -- the whole prompt at a call's first drafting, the tokens of the plain steps since the last
drafting -- besides a step's own drafting: a fixed part plus a part per token, fitted robustly to the
recent catch-ups' drafting seconds beyond ``draft_s(n)`` (``catch_up_fit``; 0.0 while none was seen;
without a warm-up, which runs the drafter's own, the decoder's first one is not counted: it may capture
or compile). Not per token alone: catch-ups after a few plain steps are mostly fixed launches, and
their seconds per token times a 1,000-token prompt priced a probe at ~40x its cost (Spec-Bench, a
general EAGLE head: plain decoding in 455 of 480 calls). No step with one-time work in it
(``StepStats.capture_s``) counts: as a catch-up or as drafting where the drafter captured, as a step
where a plain chunk did. One capture read as a catch-up cost (a
compile of tens of seconds over a short prompt) would price every later catch-up out of drafting, and
plain steps never correct it. A budget's cost is only measured while it runs, so an estimate the rule
stopped choosing stays as it was; measured target-side costs are therefore read as non-decreasing in
the budget (a budget's is at most any larger one's: a forward over more nodes is never cheaper), so
that a stale estimate of plain decoding cannot exceed a drafted step's.
The warm-up also times a drafter that reads no hidden states at batch 1: a catch-up on a dummy
prompt and each positive budget's drafting (``record_catch_up``, ``record_draft``). A ``CostTable``
replaces all of this with fixed numbers (tests, or costs measured elsewhere).

**Acceptance** (``RankAcceptance``, kept by the decoder: a call starts from the previous one's
estimate, which its own steps soon replace). Sequoia's positional model: the child of sibling
rank k (1 = the drafter's first) of a node on the accepted path is accepted with a probability
``p_k`` that depends on the rank only. Every drafted tree and its verdict count, for each node of
the accepted path with c children, one trial of ranks 1..c and a hit at the rank taken (if any);
``p_k = (hits_k + w * prior_k) / (trials_k + w)`` with ``prior_k = a * (1 - a) ** (k - 1)``
(``BudgetConfig.prior_accept`` = a, ``prior_weight`` = w); each drafted step first multiplies the
counts by ``memory``, so the estimate follows the last ~``1 / (1 - memory)`` steps. The expected
tokens of a tree of n nodes is 1 (the bonus token) plus the sum of its nodes' path probabilities
(the product of ``p`` over a node's ranks from the root) over the best n-node tree -- the n largest
path products, no deeper than the deepest tree and no wider than the widest node the drafter
returned in this call (a drafter of chains is never credited with siblings it does not propose).

**Calibration**: the positional model can credit a larger tree with tokens it does not bring (an
H200, EAGLE at batch 1: 5.1 / 6.3 tokens expected at n = 32 / 64, 4.71 / 4.74 emitted; the rule stayed
at 64 where 32 was faster). So each budget's drafted steps keep the tokens they emitted and the tokens
the model expected for them (both decayed by ``memory`` at each of the budget's steps), and a budget's
expectation is the model's times its ratio ``(emitted + w) / (expected + w)`` (``calibration_weight`` =
w pseudo-tokens at a ratio of 1), or the nearest calibrated budget's ratio. A budget that never runs
keeps a stale ratio, so one drafted step in ``explore_every`` (8) runs a neighbour on the ladder (of
the two, the one of fewer recent steps) whose expected rate is within 15 % of the best's (``why``
``"explore"``): at most ~2 % of the drafted steps' rate for a calibration that stays current.

**Catching up** costs C = ``catch_up_s`` of the tokens the unfinished sequences' drafter was not
shown, once, before a drafted step: drafting from now to the end of the call (L steps left, the most
new tokens an unfinished sequence may still emit) takes about L / tokens(n) steps, so the rate of a
positive budget counts ``C * min(1, tokens(n) / L)`` more seconds per step. With few tokens left, or a
drafter far behind, plain decoding wins where drafting alone would pay.

**Coming back to drafting**: after enough plain steps in a row, one step drafts at the best positive
budget (``why`` ``"probe"``), refreshing the acceptance estimate. A call's start counts as
``probe_every`` plain steps: a new prompt is judged by its own verdicts from its first steps, not 16
steps in (simulated over mixed prompts of acceptance 0.3-0.85 at measured H200 costs: +2-3 % overall,
1.54 -> 1.71x plain on prompts of 0.75, no more loss on those of 0.3). Its expected loss against plain
decoding: its seconds, the whole catch-up C included, minus those of as many tokens decoded plainly.
Enough steps: at least ``probe_every``, and so many that this loss is at most ``probe_share`` of the
plain steps' time -- a drafter that does not pay costs about ``probe_share`` (2 %) of the time, one
that nearly pays is probed every ``probe_every`` steps. Each plain step adds its token to the
catch-up: a drafter whose catch-up costs more per token than ``probe_share`` of a plain step is not
probed again in the call, one just below that only after hundreds of plain steps.
And no probe whose loss the steps left could not repay even if every drafted node were accepted
(1 + the tree's depth tokens per step).

**The first probes**: until the decoder has seen a few drafted steps, its acceptance estimate is
mostly the prior, and a drafter whose true acceptance would pay may never be tried (a short call's
plain steps never add up to a probe). So while fewer than ``first_probes`` (3) drafted steps were
seen, a step that plain decoding wins by rate drafts (``why`` ``"probe"``) when ``first_probe_odds``
(a quarter) of the best case's saving over the steps left -- every drafted node accepted, the
catch-up paid -- exceeds the probe's expected loss: the value of finding out, against its price.
Several, because one step is a thin sample (a reply's first token is its least predictable). Their
verdicts then outweigh the prior (a weak one: ``prior_weight`` = 1 pseudo-trial per rank).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median_low
from types import MappingProxyType

from specdec.tree import TokenTree

__all__ = [
    "AUTO",
    "DEFAULT_MAX_TREE_SIZE",
    "BudgetConfig",
    "BudgetDecision",
    "BudgetPolicy",
    "BudgetStats",
    "CostTable",
    "RankAcceptance",
    "StepCosts",
    "best_budget",
    "budget_ladder",
    "catch_up_fit",
]

#: ``tree_size`` value of the per-step budget.
AUTO = "auto"
#: The largest tree of ``tree_size="auto"`` unless ``max_tree_size`` says otherwise.
DEFAULT_MAX_TREE_SIZE = 64
_SMALLEST_TREE = 4  # the smallest positive budget of the default ladder
_STEP_AVERAGE = 0.2  # weight of a new observation in the exponential averages of step / draft seconds
_CATCH_UPS = 8  # the recent catch-ups the per-token catch-up cost is estimated from
_EXPLORE_FLOOR = 0.85  # an exploring step's budget: at least this share of the best budget's expected rate


def budget_ladder(max_tree_size: int) -> tuple[int, ...]:
    """The default candidate budgets: 0, then 4, 8, 16, ... (doubling) below ``max_tree_size``, then
    ``max_tree_size``; e.g. 64 -> (0, 4, 8, 16, 32, 64), 5 -> (0, 4, 5), 2 -> (0, 2)."""
    if not isinstance(max_tree_size, int) or isinstance(max_tree_size, bool) or max_tree_size < 1:
        raise ValueError(f"max_tree_size: expected an int >= 1, got {max_tree_size!r}")
    out, n = [0], _SMALLEST_TREE
    while n < max_tree_size:
        out.append(n)
        n *= 2
    return (*out, max_tree_size)


def _seconds_map(name: str, value, budgets: Sequence[int] | None = None) -> None:
    if not isinstance(value, Mapping) or any(
            not isinstance(k, int) or isinstance(k, bool) or k < 0 or isinstance(v, bool)
            or not isinstance(v, (int, float)) or not v >= 0 for k, v in value.items()):  # fmt: skip
        raise ValueError(f"{name}: expected a mapping of budgets (ints >= 0) to seconds >= 0, got {value!r}")
    missing = [n for n in budgets or () if n not in value]
    if missing:
        raise ValueError(f"{name}: expected seconds for every budget {tuple(budgets)}, got none for {missing}")


@dataclass(frozen=True)
class CostTable:
    """Fixed step costs in place of measured ones (``BudgetConfig.costs``).

    Attributes:
        forward_s: budget -> seconds of the target's side of one step (forward, verification,
            commit) for the whole batch, whatever its size; every candidate budget needs one.
        draft_s: budget -> seconds of one step's drafting for the whole batch; every positive
            candidate budget needs one (budget 0 drafts nothing).
        catch_up_s: seconds per token the drafter catches up on (>= 0; default 0: free).
    """

    forward_s: Mapping[int, float]
    draft_s: Mapping[int, float]
    catch_up_s: float = 0.0

    def __post_init__(self) -> None:
        _seconds_map("forward_s", self.forward_s)
        _seconds_map("draft_s", self.draft_s)
        if (isinstance(self.catch_up_s, bool) or not isinstance(self.catch_up_s, (int, float))
                or not self.catch_up_s >= 0):  # fmt: skip
            raise ValueError(f"catch_up_s: expected seconds per token >= 0, got {self.catch_up_s!r}")

    def check(self, budgets: Sequence[int]) -> None:
        """ValueError unless the table has costs for every one of ``budgets``."""
        _seconds_map("forward_s", self.forward_s, budgets)
        _seconds_map("draft_s", self.draft_s, [n for n in budgets if n > 0])


@dataclass(frozen=True)
class BudgetConfig:
    """How ``SpecDecoder(tree_size="auto")`` picks each step's budget (see the module doc).

    Attributes:
        budgets: the candidate budgets, increasing, 0 first, the largest = the decoder's
            ``max_tree_size``; each is a fixed-shape forward the warm-up builds. None (default):
            ``budget_ladder(max_tree_size)``.
        probe_every: the fewest plain steps in a row before one step drafts to refresh the acceptance
            estimate (>= 1).
        probe_share: in (0, 1]: a probe waits until its expected loss against plain decoding is at
            most this share of the plain steps' time since the last drafted step.
        memory: in (0, 1]: the acceptance counts are multiplied by it before each drafted step's.
        prior_accept: in (0, 1): the prior probability that the first child is accepted (rank k:
            ``prior_accept * (1 - prior_accept) ** (k - 1)``).
        prior_weight: > 0: pseudo-trials of the prior per rank.
        first_probes: the decoder's first drafted steps (>= 0) that may run as probes, before the
            estimate rests on verdicts (see the module doc).
        first_probe_odds: in (0, 1]: such a step drafts, where plain decoding wins by rate, when
            this share of the best case's saving over the steps left exceeds its expected loss.
        calibration_weight: > 0: pseudo-tokens (at a ratio of 1) in each budget's ratio of tokens
            emitted to tokens expected (see the module doc, "Calibration").
        explore_every: one drafted step in this many (>= 1) runs a neighbouring budget on the ladder
            whose expected rate is within ``_EXPLORE_FLOOR`` of the best's, the one of fewer (decayed)
            steps, so that its calibration stays current.
        costs: fixed costs instead of measured ones; None (default): measured.
    """

    budgets: tuple[int, ...] | None = None
    probe_every: int = 16
    probe_share: float = 0.02
    memory: float = 0.9
    prior_accept: float = 0.5
    prior_weight: float = 1.0
    first_probes: int = 3
    first_probe_odds: float = 0.25
    calibration_weight: float = 8.0
    explore_every: int = 8
    costs: CostTable | None = None

    def __post_init__(self) -> None:
        b = self.budgets
        if b is not None and (not isinstance(b, tuple) or len(b) < 2 or b[0] != 0 or any(
                not isinstance(n, int) or isinstance(n, bool) for n in b) or list(b) != sorted(set(b))):  # fmt: skip
            raise ValueError(f"budgets: expected None or an increasing tuple of ints starting with 0 and at least one "
                             f"positive budget, got {b!r}")  # fmt: skip
        if not isinstance(self.probe_every, int) or isinstance(self.probe_every, bool) or self.probe_every < 1:
            raise ValueError(f"probe_every: expected an int >= 1, got {self.probe_every!r}")
        if (isinstance(self.probe_share, bool) or not isinstance(self.probe_share, (int, float))
                or not 0 < self.probe_share <= 1):  # fmt: skip
            raise ValueError(f"probe_share: expected a number in (0, 1], got {self.probe_share!r}")
        if isinstance(self.memory, bool) or not isinstance(self.memory, (int, float)) or not 0 < self.memory <= 1:
            raise ValueError(f"memory: expected a number in (0, 1], got {self.memory!r}")
        if (isinstance(self.prior_accept, bool) or not isinstance(self.prior_accept, (int, float))
                or not 0 < self.prior_accept < 1):  # fmt: skip
            raise ValueError(f"prior_accept: expected a number in (0, 1), got {self.prior_accept!r}")
        if not isinstance(self.first_probes, int) or isinstance(self.first_probes, bool) or self.first_probes < 0:
            raise ValueError(f"first_probes: expected an int >= 0, got {self.first_probes!r}")
        if (isinstance(self.first_probe_odds, bool) or not isinstance(self.first_probe_odds, (int, float))
                or not 0 < self.first_probe_odds <= 1):  # fmt: skip
            raise ValueError(f"first_probe_odds: expected a number in (0, 1], got {self.first_probe_odds!r}")
        if (isinstance(self.prior_weight, bool) or not isinstance(self.prior_weight, (int, float))
                or not self.prior_weight > 0):  # fmt: skip
            raise ValueError(f"prior_weight: expected a number > 0, got {self.prior_weight!r}")
        if (isinstance(self.calibration_weight, bool) or not isinstance(self.calibration_weight, (int, float))
                or not self.calibration_weight > 0):  # fmt: skip
            raise ValueError(f"calibration_weight: expected a number > 0, got {self.calibration_weight!r}")
        if not isinstance(self.explore_every, int) or isinstance(self.explore_every, bool) or self.explore_every < 1:
            raise ValueError(f"explore_every: expected an int >= 1, got {self.explore_every!r}")
        if self.costs is not None and not isinstance(self.costs, CostTable):
            raise ValueError(f"costs: expected None or a specdec.budget.CostTable, got {type(self.costs).__name__}")

    def candidates(self, max_tree_size: int) -> tuple[int, ...]:
        """The candidate budgets for a decoder of ``max_tree_size`` (ValueError when ``budgets`` does
        not end at it, or ``costs`` lacks one of them)."""
        out = budget_ladder(max_tree_size) if self.budgets is None else self.budgets
        if out[-1] != max_tree_size:
            raise ValueError(f"budgets: expected the largest budget to be max_tree_size = {max_tree_size}, got {out!r}")
        if self.costs is not None:
            self.costs.check(out)
        return out


class RankAcceptance:
    """Acceptance per sibling rank, estimated from one call's verdicts (see the module doc).

    Args:
        prior_accept, prior_weight, memory: ``BudgetConfig``'s.
    """

    def __init__(self, prior_accept: float, prior_weight: float, memory: float) -> None:
        self.prior_accept, self.prior_weight, self.memory = prior_accept, prior_weight, memory
        self.hits: list[float] = []  # index k - 1: decayed count of accepted rank-k children
        self.trials: list[float] = []  # index k - 1: decayed count of nodes with >= k children on accepted paths
        #: the deepest tree seen (0: none yet, then trees of any depth are assumed)
        self.depth = 0
        #: the most children of a node seen (0: none yet, then any number is assumed)
        self.width = 0
        #: drafted steps observed (not decayed)
        self.steps = 0
        #: ranks -> (the budget walked for, ``_largest_sums``), valid until the next ``observe`` (a plain
        #: step observes nothing); ranks: a budget below ``width`` or with ``width`` unknown (its nodes can
        #: have no more children than it has nodes), else 0 (every budget from ``width`` up shares one walk)
        self._walks: dict[int, tuple[int, list[float]]] = {}
        self._horizon = 0  # the largest budget asked so far

    def observe(self, drafted: Sequence[tuple[TokenTree, Sequence[int]]]) -> None:
        """One step's drafted trees with their accepted paths (node indices from the root, 0 first)."""
        self._walks.clear()
        self.steps += 1
        self.hits = [h * self.memory for h in self.hits]
        self.trials = [t * self.memory for t in self.trials]
        for tree, path in drafted:
            children = tree.children
            self.depth = max(self.depth, tree.depth)
            self.width = max(self.width, max(map(len, children)))
            for j, node in enumerate(path):
                kids = children[node]
                if not kids:
                    break
                if len(kids) > len(self.trials):
                    grow = len(kids) - len(self.trials)
                    self.trials += [0.0] * grow
                    self.hits += [0.0] * grow
                for k in range(len(kids)):
                    self.trials[k] += 1.0
                if j + 1 < len(path):
                    self.hits[kids.index(path[j + 1])] += 1.0

    def rates(self, ranks: int) -> list[float]:
        """``p_k`` for k = 1 .. ``ranks``: the estimated probability that the rank-k child is accepted."""
        a, w = self.prior_accept, self.prior_weight
        out = []
        for k in range(ranks):
            prior = a * (1 - a) ** k
            if k < len(self.trials):
                out.append((self.hits[k] + w * prior) / (self.trials[k] + w))
            else:
                out.append(prior)
        return out

    def expected_tokens(self, budget: int) -> float:
        """Expected tokens one sequence emits in a step with ``budget`` draft nodes: 1 + the n largest
        path products of the best tree (depth at most ``depth``, children at most ``width``, when known).
        One walk serves every budget of the same ranks up to the largest asked: the best n-node tree
        is the first n nodes the walk takes (a node's ancestors and better siblings come before it)."""
        if budget <= 0:
            return 1.0
        self._horizon = max(self._horizon, budget)
        ranks = 0 if 0 < self.width <= budget else budget  # a node of a smaller tree has fewer children
        walked, sums = self._walks.get(ranks, (0, []))
        if walked < budget:
            walked = budget if ranks else self._horizon
            sums = self._largest_sums(walked, ranks or self.width)
            self._walks[ranks] = (walked, sums)
        return 1.0 + sums[min(budget, len(sums) - 1)]

    def _largest_sums(self, budget: int, ranks: int) -> list[float]:
        """``out[n]``: the sum of the n largest path products of a tree whose nodes have at most
        ``ranks`` children, n = 0 .. ``budget`` (shorter where such a tree of ``depth`` runs out)."""
        q = sorted(self.rates(ranks), reverse=True)
        deepest = self.depth or budget
        out, total, count = [0.0], 0.0, 0
        # (-value, order, depth, parent's value, rank index): pop a node, push its first child and next sibling
        heap = [(-q[0], 0, 1, 1.0, 0)]
        while heap and count < budget:
            neg, _, d, parent, r = heapq.heappop(heap)
            value = -neg
            total += value
            count += 1
            out.append(total)
            if d < deepest:
                heapq.heappush(heap, (-value * q[0], 2 * count, d + 1, value, 0))
            if r + 1 < len(q):
                heapq.heappush(heap, (-parent * q[r + 1], 2 * count + 1, d, parent, r + 1))
        return out


class StepCosts:
    """Measured seconds per step, kept by the decoder across calls (see the module doc).

    Args:
        fixed: a ``CostTable`` to use instead (nothing is measured then), or None.
    """

    def __init__(self, fixed: CostTable | None = None) -> None:
        self.fixed = fixed
        #: (batch, capacity, budget) -> the warm-up's timed target forward, seconds
        self.warm: dict[tuple[int, int, int], float] = {}
        self._steps: dict[tuple[int, int], float] = {}  # (batch, budget) -> average step seconds
        self._draft: dict[tuple[int, int], float] = {}  # (sequences asked, budget) -> average draft seconds
        self._seen: set[tuple[str, int, int]] = set()  # keys whose first observation was dropped
        #: average step seconds beyond the warm-up's forward, of plain steps (False) and drafted ones (True):
        #: apart, since a drafted step's host work (the tree, its verification) is not a plain chunk's
        self.overhead: dict[bool, float] = {}
        #: the recent catch-ups: (sequences asked, budget, drafting seconds, tokens caught up on)
        self.catch_ups: list[tuple[int, int, float, int]] = []

    def record_forward(self, batch: int, capacity: int, budget: int, seconds: float) -> None:
        """The warm-up's timing of the ``[batch, budget + 1]`` forward over a cache of ``capacity`` slots."""
        self.warm[(batch, capacity, budget)] = seconds

    def record_draft(self, budget: int, seconds: float) -> None:
        """The warm-up's timing of one sequence's drafting at ``budget`` (the calls' own average in)."""
        self._draft[(1, budget)] = seconds
        self._seen.add(("draft", 1, budget))

    def record_catch_up(self, budget: int, seconds: float, tokens: int) -> None:
        """The warm-up's timing of one sequence's drafting at ``budget`` that first caught up on ``tokens``."""
        self.catch_ups = [*self.catch_ups[1 - _CATCH_UPS :], (1, budget, seconds, tokens)]
        self._seen.add(("catch-up", 0, 0))

    def observe(self, batch: int, capacity: int, budget: int, step_s: float, asked: int, draft_s: float,
                behind: int, captured: bool = False) -> None:
        """One step at ``budget`` of ``batch`` sequences over a cache of ``capacity`` slots: ``step_s``
        seconds for the target's side, ``draft_s`` for ``asked`` sequences' drafting, which first caught
        the drafter up on ``behind`` tokens it was not shown (0: only the previous step's); ``captured``:
        the step held one-time work (``StepStats.capture_s``): at a positive budget the drafter's (its
        drafting is not counted), at budget 0 a plain chunk's capture (the step is not counted)."""
        if captured and budget == 0:
            return
        if ("step", batch, budget) in self._seen:
            self._steps[(batch, budget)] = _average(self._steps.get((batch, budget)), step_s)
            warm = self._warm(batch, capacity, budget)
            if warm is not None:
                self.overhead[budget > 0] = _average(self.overhead.get(budget > 0), step_s - warm)
        self._seen.add(("step", batch, budget))
        if budget == 0 or asked == 0 or captured:
            return
        if behind > 0:  # ("catch-up", 0, 0) in _seen: a catch-up was seen (without a warm-up, dropped)
            if self.warm or ("catch-up", 0, 0) in self._seen:
                self.catch_ups = [*self.catch_ups[1 - _CATCH_UPS :], (asked, budget, draft_s, behind)]
            self._seen.add(("catch-up", 0, 0))
            return
        if ("draft", asked, budget) in self._seen:
            self._draft[(asked, budget)] = _average(self._draft.get((asked, budget)), draft_s)
        self._seen.add(("draft", asked, budget))

    def _warm(self, batch: int, capacity: int, budget: int) -> float | None:
        """The warm-up's forward of (batch, budget) over the nearest capacity, or None."""
        near = [(abs(math.log(c / capacity)), s) for (b, c, n), s in self.warm.items() if b == batch and n == budget]
        return min(near)[1] if near else None

    def step_s(self, batch: int, capacity: int, budget: int) -> float | None:
        """Expected seconds of the target's side of a step, or None: unknown."""
        if self.fixed is not None:
            return float(self.fixed.forward_s[budget])
        seen = self._steps.get((batch, budget))
        if seen is not None:
            return seen
        warm = self._warm(batch, capacity, budget)
        if warm is None:
            return None
        # a drafted step's overhead unknown: a plain step's (a drafted step has at least its host work)
        overhead = self.overhead.get(budget > 0, self.overhead.get(False, 0.0))
        return warm + max(overhead, 0.0)

    def draft_s(self, asked: int, budget: int) -> float:
        """Expected seconds of drafting ``asked`` sequences at ``budget`` (0.0 while never measured)."""
        if budget == 0:
            return 0.0
        if self.fixed is not None:
            return float(self.fixed.draft_s[budget])
        same = [(abs(n - budget), s) for (a, n), s in self._draft.items() if a == asked]
        if same:
            return min(same)[1]
        other = [(abs(n - budget), abs(a - asked), s / a) for (a, n), s in self._draft.items()]
        return min(other)[2] * asked if other else 0.0

    def catch_up_s(self, tokens: int) -> float:
        """Expected seconds of catching the drafter up on ``tokens`` tokens it was not shown, besides a
        step's own drafting (0.0 while none was counted): ``fixed + per_token * tokens`` fitted to the
        recent catch-ups (``catch_up_fit``; without two of them 2x apart in tokens, their median seconds,
        in proportion below their median count)."""
        if self.fixed is not None:
            return float(self.fixed.catch_up_s) * tokens
        if tokens <= 0 or not self.catch_ups:
            return 0.0
        return catch_up_fit([(k, max(s - self.draft_s(a, n), 0.0)) for a, n, s, k in self.catch_ups])(tokens)


def catch_up_fit(seen: Sequence[tuple[int, float]]):
    """The seconds of catching up on k tokens as a function of k, from ``seen`` ``(tokens, seconds)``
    pairs (each tokens > 0): ``a + b * k`` with robust, non-negative a and b. The slope is the lower
    median of the slopes between catch-ups at least 2x apart in tokens (Theil-Sen, noise between
    near-equal counts left out), at most the smallest seconds per token seen (a >= 0 bounds it); a is
    the lower median of the residuals. Without two catch-ups 2x apart the growth is unknown: below the
    median count, seconds in proportion to the tokens; above it, the median seconds, not extrapolated
    (a catch-up is mostly a few fixed launches: 16 tokens in 0.2 ms need not mean 12 ms for 1,000)."""
    slopes = [(sj - si) / (kj - ki) for ki, si in seen for kj, sj in seen if kj >= 2 * ki]
    if not slopes:
        k0, s0 = median_low([k for k, _ in seen]), median_low([s for _, s in seen])
        return lambda k: s0 * min(1.0, k / k0)
    b = min(max(median_low(slopes), 0.0), min(s / k for k, s in seen))
    a = max(median_low([s - b * k for k, s in seen]), 0.0)
    return lambda k: a + b * k


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - _STEP_AVERAGE) * old + _STEP_AVERAGE * new


def best_budget(budgets: Sequence[int], tokens: Sequence[float], seconds: Sequence[float]) -> int:
    """The budget of the most tokens per second: ``argmax tokens[i] / seconds[i]``, the smaller budget
    on a tie (a cost of 0 counts as the best rate). ``budgets``, ``tokens`` and ``seconds`` are
    parallel sequences of one length."""
    if not budgets or not len(budgets) == len(tokens) == len(seconds):
        raise ValueError(f"seconds: expected one cost per budget ({len(budgets)}), got {len(tokens)} token "
                         f"estimates and {len(seconds)} costs")  # fmt: skip
    rates = [t / s if s > 0 else math.inf for t, s in zip(tokens, seconds)]
    return budgets[max(range(len(budgets)), key=lambda i: (rates[i], -budgets[i]))]


@dataclass(frozen=True)
class BudgetDecision:
    """One step's choice.

    Attributes:
        budget: the draft nodes per sequence of the step (0: plain decoding, no drafter call).
        budgets: the candidates.
        tokens: per candidate, the expected tokens of the step for the whole batch.
        seconds: per candidate, the expected seconds of the step (drafting + the target's side), or
            None where unknown; without the catch-up.
        why: ``"rate"`` (the most tokens per second, the catch-up spread over the steps left),
            ``"probe"`` (drafting after enough plain steps, see ``BudgetConfig.probe_every`` /
            ``probe_share``), ``"explore"`` (a neighbouring budget run to keep its calibration current,
            see ``BudgetConfig.explore_every``) or ``"measuring"`` (its cost was unknown).
        catch_up_s: the expected seconds of catching the drafter up before a drafted step (the
            tokens it was not shown).
        steps_left: the most new tokens an unfinished sequence may still emit.
        ratios: per candidate, the calibration ``tokens`` carries (``BudgetPolicy.ratio``); empty: none.
    """

    budget: int
    budgets: tuple[int, ...]
    tokens: tuple[float, ...]
    seconds: tuple[float | None, ...]
    why: str
    catch_up_s: float
    steps_left: int
    ratios: tuple[float, ...] = ()

    @property
    def reason(self) -> str:
        """One line: the choice, why, and each candidate's expected tokens (with its calibration where
        it is not 1), milliseconds and rate."""
        parts = []
        ratios = self.ratios or (1.0,) * len(self.budgets)
        for n, t, s, r in zip(self.budgets, self.tokens, self.seconds, ratios):
            cost = "? ms" if s is None else f"{s * 1e3:.2f} ms"
            rate = "" if not s else f" = {t / s:.0f} tok/s"
            calibrated = f" (x{r:.2f})" if abs(r - 1.0) >= 0.005 else ""
            parts.append(f"n={n}: {t:.2f} tok{calibrated} / {cost}{rate}")
        return (f"budget {self.budget} ({self.why}); " + ", ".join(parts)
                + f"; catch-up {self.catch_up_s * 1e3:.0f} ms, {self.steps_left} steps left")


@dataclass(frozen=True)
class BudgetStats:
    """The budgets of one ``generate`` call (``GenerationOutput.budget``).

    Attributes:
        histogram: budget -> steps run at it (a plain-decoding chunk counts its steps).
        last: the call's last decision (its costs and acceptance estimate), or None.
    """

    histogram: Mapping[int, int] = field(default_factory=dict)
    last: BudgetDecision | None = None

    @property
    def reason(self) -> str:
        """The last decision's line (empty without one)."""
        return "" if self.last is None else self.last.reason


class BudgetPolicy:
    """Picks each step's budget (``SpecDecoder(tree_size="auto")`` keeps one; see the module doc).

    Args:
        config: the ``BudgetConfig``.
        budgets: the candidate budgets (``config.candidates(max_tree_size)``).
    """

    def __init__(self, config: BudgetConfig, budgets: tuple[int, ...]) -> None:
        self.config = config
        self.budgets = budgets
        #: the step costs, kept across calls
        self.costs = StepCosts(config.costs)
        #: the acceptance estimate, kept across calls
        self.acceptance: RankAcceptance
        self.forget_acceptance()
        self._histogram: dict[int, int] = {}
        self._last: BudgetDecision | None = None
        self._plain = 0  # plain steps in a row
        self._since_explore = 0  # drafted steps since the last exploring one
        self._behind: list[int] = []  # per sequence: tokens its drafter was not shown (besides the last step's)
        self._left: list[int] = []  # per sequence: new tokens it may still emit (0: finished)

    def begin(self, prompt_lens: Sequence[int], max_new_tokens: int) -> None:
        """A new ``generate`` call over prompts of ``prompt_lens`` tokens, each to get up to
        ``max_new_tokens`` new ones: fresh stats (the costs and the acceptance estimate stay). A new
        prompt counts as ``probe_every`` plain steps: its first step may probe (within
        ``probe_share``), since the last call's acceptance need not be this prompt's."""
        self._histogram, self._last, self._plain = {}, None, self.config.probe_every
        self._behind, self._left = list(prompt_lens), [max_new_tokens] * len(prompt_lens)

    def forget_acceptance(self) -> None:
        """Start the acceptance estimate afresh from the prior (the first probes included), keeping the
        measured costs: for a new workload, or after calls that only warmed the decoder."""
        self.acceptance = RankAcceptance(self.config.prior_accept, self.config.prior_weight, self.config.memory)
        #: budget -> [tokens emitted, tokens expected, steps] of its drafted steps (each decayed by ``memory``
        #: at the budget's every step)
        self.calibration: dict[int, list[float]] = {}

    def decide(self, batch: int, capacity: int, active: int) -> BudgetDecision:
        """The next step's budget for ``batch`` sequences (``active`` of them unfinished) over a cache
        of ``capacity`` slots per sequence."""
        ratios = tuple(self.ratio(n) for n in self.budgets)
        per_seq = [self.acceptance.expected_tokens(n) * r for n, r in zip(self.budgets, ratios)]
        tokens = tuple(active * e for e in per_seq)
        steps = [self.costs.step_s(batch, capacity, n) for n in self.budgets]
        if self.costs.fixed is None:  # measured: no budget's target side costs more than a larger budget's
            low = None
            for i in reversed(range(len(steps))):
                if steps[i] is not None:
                    low = steps[i] = steps[i] if low is None else min(low, steps[i])
        seconds = [None if step is None else step + self.costs.draft_s(active, n) for n, step in zip(self.budgets, steps)]
        catch_up = self.costs.catch_up_s(sum(k for k, left in zip(self._behind, self._left) if left > 0))
        left = max(self._left, default=0)
        unknown = [n for n, s in zip(self.budgets, seconds) if s is None]
        if unknown:
            budget, why = unknown[0], "measuring"
        else:
            # the catch-up, paid once, spread over the drafted steps that would finish the call
            spread = [s + (catch_up * min(1.0, e / left) if n and left else 0.0)
                      for n, s, e in zip(self.budgets, seconds, per_seq)]  # fmt: skip
            budget, why = best_budget(self.budgets, tokens, spread), "rate"
            if budget:
                budget, why = self._explore(budget, tokens, spread)
            if budget == 0:
                i = self.budgets.index(best_budget(self.budgets[1:], tokens[1:], spread[1:]))
                if self._probe_pays(tokens, seconds, i, catch_up, left):
                    budget, why = self.budgets[i], "probe"
        self._last = BudgetDecision(budget, self.budgets, tokens, tuple(seconds), why, catch_up, left, ratios)
        return self._last

    def ratio(self, budget: int) -> float:
        """Tokens emitted per token expected at ``budget`` (1.0 for plain decoding and before any
        drafted step): its own drafted steps' (with ``calibration_weight`` pseudo-tokens at 1), else
        the nearest calibrated budget's."""
        if budget == 0 or not self.calibration:
            return 1.0
        near = min(self.calibration, key=lambda n: (abs(math.log2(n / budget)), n))
        emitted, expected, _ = self.calibration[near]
        w = self.config.calibration_weight
        return (emitted + w) / (expected + w)

    def _explore(self, budget: int, tokens: Sequence[float], seconds: Sequence[float]) -> tuple[int, str]:
        """``(budget, "rate")``, or every ``explore_every`` drafted steps a neighbouring positive budget
        on the ladder whose expected rate is at least ``_EXPLORE_FLOOR`` of the best's (of the two, the
        one of fewer decayed steps): ``(it, "explore")``."""
        self._since_explore += 1
        if self._since_explore < self.config.explore_every:
            return budget, "rate"
        i = self.budgets.index(budget)
        best = tokens[i] / seconds[i] if seconds[i] > 0 else math.inf
        near = [j for j in (i - 1, i + 1) if 0 < j < len(self.budgets) and seconds[j] > 0
                and tokens[j] / seconds[j] >= _EXPLORE_FLOOR * best]  # fmt: skip
        if not near:
            return budget, "rate"
        self._since_explore = 0
        j = min(near, key=lambda j: (self.calibration.get(self.budgets[j], (0.0, 0.0, 0.0))[2], j))
        return self.budgets[j], "explore"

    def _probe_pays(self, tokens: Sequence[float], seconds: Sequence[float], i: int, catch_up: float,
                    left: int) -> bool:
        """Whether to probe at candidate ``i`` (index 0: plain decoding) now: among the decoder's first
        ``first_probes`` drafted steps, when ``first_probe_odds`` of the best case's saving repays its
        expected loss; else after ``probe_every`` plain steps and more while its expected loss,
        ``catch_up`` included, exceeds ``probe_share`` of their time, and unless the ``left`` steps
        could not repay the loss even if every drafted node were accepted."""
        first = self.acceptance.steps < self.config.first_probes
        if not first and self._plain < self.config.probe_every:
            return False
        if seconds[0] <= 0:
            return True
        loss = seconds[i] + catch_up - tokens[i] / tokens[0] * seconds[0]  # vs as many tokens decoded plainly
        most = 1 + min(self.budgets[i], self.acceptance.depth or self.budgets[i])  # every node accepted
        best_gain = left * (seconds[0] - seconds[i] / most)  # over the steps left, vs plain decoding
        if first and loss <= self.config.first_probe_odds * (best_gain - catch_up):
            return True
        return (self._plain >= self.config.probe_every and loss <= self.config.probe_share * seconds[0] * self._plain
                and loss <= best_gain)  # fmt: skip

    def observe_trees(self, drafted: Sequence[tuple[TokenTree, Sequence[int]]]) -> None:
        """One drafted step's trees and accepted paths (``RankAcceptance.observe``)."""
        self.acceptance.observe(drafted)

    def observe_steps(self, budget: int, batch: int, capacity: int, asked: int, steps: Sequence) -> None:
        """The ``StepStats`` of what ran at ``budget`` (one drafted step, or plain steps), ``asked``
        sequences drafted per step: counts them and feeds their seconds to the costs."""
        self._histogram[budget] = self._histogram.get(budget, 0) + len(steps)
        self._plain = self._plain + len(steps) if budget == 0 else 0
        last = self._last
        if budget and last is not None and last.budget == budget and len(steps) == 1:  # what the decision expected
            got = self.calibration.setdefault(budget, [0.0, 0.0, 0.0])
            m = self.config.memory
            got[0] = m * got[0] + sum(steps[0].tokens_emitted)
            i = self.budgets.index(budget)
            got[1] = m * got[1] + last.tokens[i] / last.ratios[i]  # what the acceptance model alone expected
            got[2] = m * got[2] + 1
        for s in steps:
            behind = 0
            for b, emitted in enumerate(s.tokens_emitted):
                if budget and self._left[b] > 0:  # the drafter was shown sequence b: caught up
                    behind += self._behind[b]
                    self._behind[b] = 0
                self._behind[b] += emitted if budget == 0 else 0
                self._left[b] = 0 if emitted == 0 else self._left[b] - emitted
            self.costs.observe(batch, capacity, budget, s.verify_s + s.commit_s, asked, s.draft_s, behind,
                               captured=s.capture_s > 0)

    def stats(self) -> BudgetStats:
        """This call's budgets so far."""
        return BudgetStats(MappingProxyType(dict(sorted(self._histogram.items()))), self._last)
