"""``SpecDecoder(tree_size="auto")``: the per-step node budget (``specdec.budget``).

The rule on synthetic costs (plain decoding when drafting cannot pay, larger budgets when acceptance
is high, the batch size's forward costs deciding, the drafter's catch-up counted against the tokens
left), the acceptance and cost estimates, then end to
end on tiny models: greedy output equal to HF's greedy output in fp32 while the budget switches
between steps (a scripted schedule over the real decisions, and the rule itself on injected cost
tables), hidden states still arriving once each when steps skip the drafter, the warm-up building
and timing every budget's forward, and the first two sampled tokens following the target
(chi-square) with the budget changing between steps.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time

import pytest
import torch

import specdec
from specdec import SpecDecoder
from specdec.budget import (
    BudgetConfig,
    BudgetPolicy,
    CostTable,
    RankAcceptance,
    StepCosts,
    best_budget,
    budget_ladder,
    catch_up_fit,
)
from specdec.drafting import HIDDEN_ALL, DraftContext
from specdec.sampling import SamplingConfig
from specdec.tree import TokenTree
from tests.drafters.lossless import PROMPT, TEMPERATURE, VOCAB as SMALL_VOCAB, chi2_pvalue, exact_joint, tiny_draft, tiny_target
from tests.specdec.helpers import (
    DraftModelDrafter,
    OracleDrafter,
    build_tree,
    greedy_reference,
    prepared_tiny_model,
    random_prompt,
)

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 40
SHAPES = [(9, 0), (4, 1), (1, 2)]  # (prompt length, seed): a batch of different lengths, a one-token prompt


def _chain(k: int, n: int = 8):
    """A chain tree of ``n`` nodes besides the root whose first ``k`` nodes are the accepted path."""
    return build_tree([(i, 3 + i) for i in range(n)], 1), tuple(range(k + 1))


# --------------------------------------------------------------------------- the rule, synthetic


def test_ladder_and_best_budget():
    assert budget_ladder(64) == (0, 4, 8, 16, 32, 64)
    assert budget_ladder(5) == (0, 4, 5) and budget_ladder(4) == (0, 4) and budget_ladder(2) == (0, 2)
    with pytest.raises(ValueError, match=r"max_tree_size: expected an int >= 1, got 0"):
        budget_ladder(0)
    # drafting costs more than the tokens it adds: plain decoding
    assert best_budget((0, 4, 16), (1.0, 1.5, 1.8), (1.0, 2.0, 2.5)) == 0
    # high acceptance at a nearly flat forward cost: the largest tree
    assert best_budget((0, 4, 16), (1.0, 3.0, 6.0), (1.0, 1.3, 1.5)) == 16
    # a tie goes to the smaller budget
    assert best_budget((0, 4), (1.0, 2.0), (1.0, 2.0)) == 0
    with pytest.raises(ValueError, match=r"seconds: expected one cost per budget \(2\), got 2 token estimates and 1 costs"):
        best_budget((0, 4), (1.0, 2.0), (1.0,))


def test_rank_acceptance_prior_observations_and_depth():
    acc = RankAcceptance(prior_accept=0.5, prior_weight=2.0, memory=1.0)
    assert acc.rates(3) == pytest.approx([0.5, 0.25, 0.125])
    assert acc.expected_tokens(0) == 1.0
    # prior, no tree seen (any depth): the best 2 nodes are the rank-1 chain 0.5 + 0.25 (ties: either)
    assert acc.expected_tokens(2) == pytest.approx(1.75)
    for _ in range(20):  # chains of 8 accepted whole: rank 1 always, depth 8
        acc.observe([_chain(8)])
    p1 = acc.rates(1)[0]
    assert p1 == pytest.approx((20 * 8 + 2 * 0.5) / (20 * 8 + 2.0))
    assert acc.depth == 8 and acc.width == 1
    # chains only: no deeper than 8, no siblings
    assert acc.expected_tokens(64) == acc.expected_tokens(8) == pytest.approx(1 + sum(p1 ** d for d in range(1, 9)))
    assert acc.expected_tokens(8) > acc.expected_tokens(4) > 4.5
    low = RankAcceptance(0.5, 2.0, 0.9)
    for _ in range(20):  # nothing accepted, with forgetting: the prior's weight stays, rank 1 falls
        low.observe([_chain(0)])
    assert low.rates(1)[0] < 0.1
    assert low.expected_tokens(64) < 1.2
    # a tree with siblings: the path takes the second child of the root
    tree = build_tree([(0, 5), (0, 6), (2, 7)], 1)  # node 1: 5, node 2: 6 (rank 2), node 3: 7 under node 2
    sib = RankAcceptance(0.5, 1e-9, 1.0)
    sib.observe([(tree, (0, 2, 3))])
    # root: rank 1 tried and passed over, rank 2 taken; node 2: its only child taken
    assert sib.rates(2) == pytest.approx([0.5, 1.0], abs=1e-6) and sib.width == 2 and sib.depth == 2


def test_expected_tokens_one_walk_serves_every_budget():
    """``expected_tokens(n)`` = 1 + the n largest path products (each node at most ``min(n, width)``
    children of the sorted rates, at most ``depth`` deep), whatever order the budgets are asked in
    (a walk per rank limit serves them all): against enumerating every path."""
    import heapq as hq

    def brute(acc: RankAcceptance, n: int) -> float:
        q = sorted(acc.rates(min(n, acc.width or n)), reverse=True)
        level, products = [1.0], []
        for _ in range(acc.depth or n):
            level = [v * r for v in level for r in q]
            products += level
        return 1.0 + sum(hq.nlargest(n, products))

    rng = random.Random(0)
    for _ in range(40):
        acc = RankAcceptance(0.5, 1.0, 0.9)
        k = rng.randint(1, 4)
        acc.hits = [rng.random() * 4 for _ in range(k)]
        acc.trials = [h + rng.random() * 4 for h in acc.hits]
        acc.depth, acc.width = rng.randint(1, 3), rng.randint(1, 4)
        budgets = rng.sample([1, 2, 3, 5, 8, 13, 20], 4)
        want = [brute(acc, n) for n in budgets]
        assert [acc.expected_tokens(n) for n in budgets] == pytest.approx(want, rel=1e-12)
        assert [acc.expected_tokens(n) for n in reversed(budgets)] == pytest.approx(want[::-1], rel=1e-12)
    tree = build_tree([(0, 5), (1, 6), (2, 7), (0, 8), (4, 9)], 1)  # depth-first: 0-1-2-3, 0-4-5
    assert tree.depth == 3 and TokenTree.chain(torch.tensor([1])).depth == 0


def test_step_costs_warm_table_overhead_and_drafting():
    costs = StepCosts()
    assert costs.step_s(1, 1024, 4) is None and costs.draft_s(1, 4) == 0.0 and costs.draft_s(1, 0) == 0.0
    costs.record_forward(1, 1024, 0, 0.010)
    costs.record_forward(1, 1024, 4, 0.012)
    costs.record_forward(1, 4096, 4, 0.020)
    assert costs.step_s(1, 2048, 4) == pytest.approx(0.012)  # the nearest capacity's
    costs.observe(1, 1024, 4, 0.050, 1, 0.007, 0)  # a first observation: dropped (captures, compiles)
    assert costs.step_s(1, 1024, 4) == pytest.approx(0.012) and not costs.overhead
    costs.observe(1, 1024, 4, 0.015, 1, 0.007, 0)
    costs.observe(1, 1024, 4, 0.015, 1, 0.009, 0)
    assert costs.step_s(1, 1024, 4) == pytest.approx(0.015)  # seen: the average of what was seen
    assert costs.overhead == {True: pytest.approx(0.003)}
    assert costs.step_s(1, 1024, 0) == pytest.approx(0.010)  # a drafted step's overhead is not a plain one's
    costs.record_forward(1, 1024, 8, 0.013)
    costs.observe(1, 1024, 0, 0.0115, 0, 0.0, 0)  # dropped: the first plain step
    costs.observe(1, 1024, 0, 0.0115, 0, 0.0, 0)
    assert costs.overhead == {True: pytest.approx(0.003), False: pytest.approx(0.0015)}
    assert costs.step_s(1, 1024, 8) == pytest.approx(0.016)  # warm-up forward + drafted steps' overhead
    plain_only = StepCosts()
    plain_only.record_forward(1, 1024, 0, 0.010)
    plain_only.record_forward(1, 1024, 4, 0.012)
    for _ in range(2):
        plain_only.observe(1, 1024, 0, 0.011, 0, 0.0, 0)
    assert plain_only.step_s(1, 1024, 4) == pytest.approx(0.013)  # no drafted step seen: the plain overhead
    assert costs.draft_s(1, 4) == pytest.approx(0.8 * 0.007 + 0.2 * 0.009)  # the first one dropped too
    assert costs.draft_s(1, 64) == costs.draft_s(1, 4)  # the nearest budget's
    assert costs.draft_s(4, 4) == pytest.approx(4 * costs.draft_s(1, 4))  # another count's, per sequence


def test_step_costs_catch_up_per_token():
    costs = StepCosts()
    assert costs.catch_up_s(100) == 0.0  # none seen: free
    costs.observe(1, 1024, 4, 0.3, 1, 9.0, 30)  # the first catch-up without a warm-up: dropped (may compile)
    assert costs.catch_up_s(100) == 0.0 and not costs.catch_ups
    costs.observe(1, 1024, 4, 0.3, 1, 1.3, 40)  # steady drafting not measured yet: all of it counts
    assert costs.catch_up_s(10) == pytest.approx(10 * 1.3 / 40)
    assert costs.draft_s(1, 4) == 0.0  # catching-up steps are not steady drafting
    for _ in range(2):  # the first steady one is dropped, as every first observation
        costs.observe(1, 1024, 4, 0.3, 1, 0.1, 0)
    assert costs.draft_s(1, 4) == pytest.approx(0.1)
    assert costs.catch_up_s(10) == pytest.approx(10 * 1.2 / 40)  # beyond the step's own drafting
    costs.observe(1, 1024, 4, 0.3, 1, 0.7, 20)
    assert costs.catch_up_s(10) == pytest.approx(10 * 0.03)  # 20 and 40 tokens: 0.03 s a token, nothing fixed
    assert costs.catch_up_s(1000) == pytest.approx(1000 * 0.03)
    for _ in range(20):
        costs.observe(1, 1024, 4, 0.3, 1, 0.1 + 0.001 * 5, 5)
    assert len(costs.catch_ups) == 8  # the old ones forgotten: only 5-token catch-ups left, how they grow unknown
    assert costs.catch_up_s(2) == pytest.approx(0.002) and costs.catch_up_s(10) == pytest.approx(0.005)
    warmed = StepCosts()
    warmed.record_forward(1, 1024, 4, 0.3)  # after a warm-up (the drafter's too) the first one counts
    warmed.observe(1, 1024, 4, 0.3, 1, 1.3, 40)
    assert warmed.catch_up_s(40) == pytest.approx(1.3)
    assert StepCosts(CostTable({0: 1.0}, {}, catch_up_s=0.5)).catch_up_s(4) == 2.0


def _policy(forward, draft, catch_up_s=0.0, **kw) -> BudgetPolicy:
    config = BudgetConfig(costs=CostTable(forward, draft, catch_up_s), **kw)
    return BudgetPolicy(config, config.candidates(max(forward)))


def _run_policy(policy: BudgetPolicy, steps: int, prompt: int = 9, max_new: int = 10**6,
                accept: bool = False) -> list[int]:  # fmt: skip
    """``steps`` decisions at batch 1 (a ``prompt``-token prompt, up to ``max_new`` new tokens), every
    drafted chain rejected at once (``accept``: accepted whole); the budgets picked."""
    policy.begin([prompt], max_new)
    picked = []
    for _ in range(steps):
        decision = policy.decide(1, 1024, 1)
        picked.append(decision.budget)
        n = decision.budget
        if n:
            policy.observe_trees([_chain(n if accept else 0, n)])
        emitted = n + 1 if accept and n else 1
        policy.observe_steps(n, 1, 1024, 1, [specdec.StepStats((n,), (emitted - 1,), (emitted,), 0.0, 1.0, 0.0)])
    return picked


def test_policy_plain_when_drafting_cannot_pay_and_probes():
    # drafting costs 3 forwards: nothing the prior or any acceptance could repay at these budgets
    forward, draft = {0: 1.0, 4: 1.1, 8: 1.2, 16: 1.3}, {4: 3.0, 8: 3.0, 16: 3.0}
    policy = _policy(forward, draft, probe_every=4, probe_share=1.0)  # probes as often as probe_every allows
    picked = _run_policy(policy, 12)
    # the first three steps are the first probes (the steps left could repay them many times over);
    # their drafts rejected, then a probe after every 4 plain steps
    assert all(picked[:3]) and picked[3:7] == [0, 0, 0, 0] and picked[7] > 0 and picked[8:12] == [0, 0, 0, 0]
    assert policy.stats().histogram[0] == 8 and sum(policy.stats().histogram.values()) == 12
    assert "budget 0 (rate)" in policy.stats().reason
    # the default share: a probe loses ~3 plain steps' time, so it waits ~150 plain steps (2 % of them)
    # once the estimate knows the drafts are rejected
    picked = _run_policy(_policy(forward, draft, probe_every=4), 400)
    probes = [i for i, n in enumerate(picked) if n]
    assert probes[:3] == [0, 1, 2] and 2 <= len(probes[3:]) <= 3 and all(b - a >= 100 for a, b in zip(probes[2:], probes[3:]))
    # the first probes' one-time ~10 forwards, then ~2 %
    assert sum(forward[n] + draft.get(n, 0) for n in picked) < 400 + 3 * (draft[4] + forward[4]) + 0.03 * 400
    # few steps left: a call's start counts as probe_every plain steps, so a 5-step call probes at
    # once (not as a first probe: a quarter of the best case's saving is less than its loss), then
    # after 4 plain steps, with one step left, not again (its loss of ~1.3 forwards is more than a
    # forward, which even every node accepted would not save); a 1-step call never
    picked = _run_policy(_policy(forward, draft, probe_every=4, probe_share=1.0), 5, max_new=5)
    assert picked == [16, 0, 0, 0, 0]
    assert _run_policy(_policy(forward, draft, probe_every=4, probe_share=1.0), 1, max_new=1) == [0]


# a 2-core CPU's step costs (seconds): the 1.5B target, chains of up to 5 tokens of a 0.5B draft model
CPU_FORWARD, CPU_DRAFT = {0: 0.33, 4: 0.37, 5: 0.38}, {4: 0.25, 5: 0.30}


def test_policy_counts_the_catch_up_of_a_probe():
    """A draft model on a CPU: catching it up costs 30 ms per token, more than the 2 % of a plain step
    a probe may cost per plain step, so once behind it is never probed; free catch-up: probed."""
    for max_new in (64, 256):
        picks = {}
        for catch_up in (0.0, 0.03):
            policy = _policy(CPU_FORWARD, CPU_DRAFT, catch_up_s=catch_up)
            for _ in range(10):  # an earlier call: its drafts rejected
                policy.observe_trees([_chain(0, 5)])
            picks[catch_up] = _run_policy(policy, max_new, prompt=40, max_new=max_new)
        assert picks[0.03] == [0] * max_new
        # free catch-up: a probe after 25 plain steps (41 counting the call's start as probe_every = 16)
        assert [i for i, n in enumerate(picks[0.0]) if n][0] == 25
        last = policy.stats().last
        assert last.why == "rate" and last.catch_up_s == pytest.approx(0.03 * (40 + max_new - 1))
        assert "catch-up" in last.reason and "1 steps left" in last.reason


def test_policy_spreads_the_catch_up_over_the_tokens_left():
    """High acceptance, cheap drafting: a tree pays per step, but catching up on a 100-token prompt at
    0.5 s per token (50 s) pays only over many tokens: 15.8 tokens per 1.9-s step, so 50 s of plain
    decoding take 50 + 6 s drafting, 100 s take 50 + 12 s."""
    forward, draft = {0: 1.0, 4: 1.2, 16: 1.5}, {4: 0.4, 16: 0.4}
    for max_new, want in ((8, 0), (50, 0), (100, 16), (1000, 16)):
        policy = _policy(forward, draft, catch_up_s=0.5, budgets=(0, 4, 16))
        for _ in range(10):
            policy.observe_trees([_chain(16, 16)])  # every drafted chain accepted whole
        policy.begin([100], max_new)
        decision = policy.decide(1, 1024, 1)
        assert decision.budget == want and decision.why == "rate" and decision.catch_up_s == pytest.approx(50.0)
    # caught up (free catch-up): the largest tree from the first step, even with 8 tokens left
    policy = _policy(forward, draft, budgets=(0, 4, 16))
    for _ in range(10):
        policy.observe_trees([_chain(16, 16)])
    policy.begin([100], 8)
    assert policy.decide(1, 1024, 1).budget == 16


def test_policy_probes_early_where_drafting_is_cheap():
    """A GPU-like machine: a tree forward and its drafting cost 20-30 % more than a plain step, catching
    up 0.1 % of one per token; the drafts are rejected, so steps are plain, with a probe every
    ``probe_every`` (16) steps or so."""
    forward, draft = {0: 1.0, 4: 1.1, 8: 1.15, 16: 1.2}, {4: 0.1, 8: 0.1, 16: 0.1}
    picked = _run_policy(_policy(forward, draft, catch_up_s=0.001), 200, prompt=200, max_new=200)
    drafted = [i for i, n in enumerate(picked) if n]
    # the prior's estimate: drafting pays from the first step, a 200-token catch-up included, until the
    # rejections are seen; then a probe after every 16 plain steps
    assert drafted == [0, 1, 2, *range(19, 200, 17)]
    assert picked == _run_policy(_policy(forward, draft), 200, prompt=200, max_new=200)  # as if it were free


# a 2-core CPU's measured costs (seconds; the warm-up's timings): the 1.5B target, chains of up to 5
# tokens of the 0.5B draft model, catching the draft model up at ~10 ms a token
CPU_CHAIN_FORWARD, CPU_CHAIN_DRAFT = {0: 0.31, 4: 0.62, 5: 0.66}, {4: 0.57, 5: 0.70}


@pytest.mark.parametrize("accept", [True, False])
def test_the_first_probe_tries_a_drafter_the_prior_alone_would_never_run(accept):
    """By the prior's acceptance plain decoding wins (2.2 tokens per 1.4-s step against 3.2 tokens a
    second), and a regular probe waits for more plain steps than 64 tokens have. So before anything
    was drafted, a call with 64 tokens to go probes at once: chains accepted whole then win by rate;
    chains rejected in the three first probes send it back to plain decoding. With 8 tokens to go
    the best case cannot repay a probe: plain decoding throughout."""
    picked = _run_policy(_policy(CPU_CHAIN_FORWARD, CPU_CHAIN_DRAFT, catch_up_s=0.01), 30, prompt=40, max_new=64,
                         accept=accept)  # fmt: skip
    if accept:
        assert all(n > 0 for n in picked)
    else:
        assert all(picked[:3]) and picked[3:] == [0] * 27  # three first probes, then the verdicts rule
    prior_only = _policy(CPU_CHAIN_FORWARD, CPU_CHAIN_DRAFT, catch_up_s=0.01)
    prior_only.begin([40], 64)
    assert prior_only.decide(1, 1024, 1).why == "probe"
    assert _run_policy(_policy(CPU_CHAIN_FORWARD, CPU_CHAIN_DRAFT, catch_up_s=0.01), 8, prompt=40, max_new=8) == [0] * 8
    # a decoder that drafted before (an earlier call) knows better than the prior: no first probe
    seen = _policy(CPU_CHAIN_FORWARD, CPU_CHAIN_DRAFT, catch_up_s=0.01)
    for _ in range(3):
        seen.observe_trees([_chain(0, 5)])
    assert _run_policy(seen, 10, prompt=40, max_new=64) == [0] * 10
    seen.forget_acceptance()  # a new workload: the prior again, and its first probes
    assert seen.acceptance.steps == 0 and _run_policy(seen, 1, prompt=40, max_new=64)[0] > 0


def test_policy_follows_acceptance():
    policy = _policy({0: 1.0, 4: 1.2, 8: 1.3, 16: 1.5}, {4: 0.4, 8: 0.4, 16: 0.4})
    policy.begin([9], 1000)
    for _ in range(10):  # every drafted chain accepted whole
        policy.observe_trees([_chain(16, 16)])
    high = policy.decide(1, 1024, 1)
    assert high.budget == 16 and high.why == "rate"
    assert high.tokens[-1] > 10 and high.seconds == pytest.approx((1.0, 1.6, 1.7, 1.9))
    policy.begin([9], 1000)  # a new call keeps the estimate, which its own steps soon replace
    assert policy.decide(1, 1024, 1).budget == 16
    for _ in range(40):
        policy.observe_trees([_chain(1, 16)])  # one token accepted, then a rejection
    low = policy.decide(1, 1024, 1)
    assert low.budget < 16
    assert "n=16:" in low.reason and "tok/s" in low.reason


def test_policy_the_batch_size_decides():
    """Measured forwards: at batch 1 a tree costs little more than a token, at batch 16 several times."""
    config = BudgetConfig()
    policy = BudgetPolicy(config, config.candidates(16))
    for n, (one, sixteen) in {0: (1.0, 2.0), 4: (1.05, 12.0), 8: (1.1, 20.0), 16: (1.2, 36.0)}.items():
        policy.costs.record_forward(1, 1024, n, one)
        policy.costs.record_forward(16, 1024, n, sixteen)
    policy.begin([9] * 16, 1000)
    for _ in range(5):
        policy.observe_trees([_chain(12, 16)] * 4)
    assert policy.decide(1, 1024, 1).budget == 16
    assert policy.decide(16, 1024, 16).budget == 0
    # unknown costs (a batch size never warmed): each budget is measured first
    first = policy.decide(4, 1024, 4)
    assert first.budget == 0 and first.why == "measuring" and first.seconds == (None,) * 4


def test_calibration_and_exploration_find_the_best_budget_the_model_overrates():
    """Sequoia's positional model can credit a larger tree with tokens it does not bring (measured on an
    H200, EAGLE at batch 1: it expected 5.1 / 6.3 tokens at n = 32 / 64, the steps emitted 4.71 / 4.74,
    and the rule stayed at 64 where 32 was faster). Each budget's steps calibrate its expectation, and
    one drafted step in ``explore_every`` tries a neighbour whose calibration is thin: the rule settles
    on the best budget and gets within 5 % of its rate."""
    ms = 1e-3
    forward = {0: 2.8 * ms, 4: 3.0 * ms, 8: 3.05 * ms, 16: 3.1 * ms, 32: 3.2 * ms, 64: 3.5 * ms}
    draft = {4: 2.3 * ms, 8: 2.3 * ms, 16: 2.3 * ms, 32: 2.3 * ms, 64: 2.4 * ms}
    model = {0: 1.0, 4: 2.6, 8: 3.3, 16: 4.1, 32: 5.1, 64: 6.3}  # what the acceptance model expects
    real = {0: 1.0, 4: 2.7, 8: 3.4, 16: 4.13, 32: 4.71, 64: 4.74}  # what the steps emit on average
    rate = {n: real[n] / (forward[n] + draft.get(n, 0.0)) for n in forward}
    best = max(rate, key=rate.get)
    assert best == 32 and max(model, key=lambda n: model[n] / (forward[n] + draft.get(n, 0.0))) == 64
    for seed in range(5):  # the steps' tokens drawn around their means (sd 1 token)
        policy = _policy(forward, draft)
        policy.acceptance.expected_tokens = model.__getitem__  # the overrating model, fixed
        policy.begin([9], 10**6)
        rng, picked, tokens, seconds = random.Random(seed), [], 0.0, 0.0
        for _ in range(400):
            decision = policy.decide(1, 1024, 1)
            n = decision.budget
            emitted = max(1, round(rng.gauss(real[n], 1.0))) if n else 1
            policy.observe_steps(n, 1, 1024, 1, [specdec.StepStats((n,), (emitted - 1,), (emitted,), 0.0, 1.0, 0.0)])
            picked.append((n, decision.why))
            tokens, seconds = tokens + emitted, seconds + forward[n] + draft.get(n, 0.0)
        assert picked[:8] == [(64, "rate")] * 7 + [(32, "explore")]  # the first exploring step tries 32
        assert tokens / seconds >= 0.95 * rate[best], seed
        assert policy.ratio(64) < 0.85 and policy.ratio(64) < policy.ratio(32) and policy.ratio(0) == 1.0
        last = policy.stats().last  # its line shows each budget's calibration
        assert f"n=64: {last.tokens[-1]:.2f} tok (x{last.ratios[-1]:.2f})" in last.reason and "n=0: 1.00 tok /" in last.reason
        assert {n for n, _ in picked} == {32, 64}  # 16's expected rate stays below the exploring floor
        assert sum(why == "explore" for _, why in picked) <= 400 // 8
    policy.forget_acceptance()
    assert not policy.calibration and policy.ratio(32) == 1.0


def test_config_and_constructor_errors():
    with pytest.raises(ValueError, match=r"budgets: expected None or an increasing tuple of ints starting with 0"):
        BudgetConfig(budgets=(4, 8))
    with pytest.raises(ValueError, match=r"probe_every: expected an int >= 1, got 0"):
        BudgetConfig(probe_every=0)
    with pytest.raises(ValueError, match=r"memory: expected a number in \(0, 1\], got 0"):
        BudgetConfig(memory=0)
    with pytest.raises(ValueError, match=r"prior_accept: expected a number in \(0, 1\), got 1"):
        BudgetConfig(prior_accept=1)
    with pytest.raises(ValueError, match=r"first_probes: expected an int >= 0, got -1"):
        BudgetConfig(first_probes=-1)
    with pytest.raises(ValueError, match=r"first_probe_odds: expected a number in \(0, 1\], got 0"):
        BudgetConfig(first_probe_odds=0)
    with pytest.raises(ValueError, match=r"calibration_weight: expected a number > 0, got 0"):
        BudgetConfig(calibration_weight=0)
    with pytest.raises(ValueError, match=r"explore_every: expected an int >= 1, got 0"):
        BudgetConfig(explore_every=0)
    with pytest.raises(ValueError, match=r"forward_s: expected a mapping of budgets"):
        CostTable({0: -1.0}, {})
    with pytest.raises(ValueError, match=r"catch_up_s: expected seconds per token >= 0, got -0.1"):
        CostTable({0: 1.0}, {}, catch_up_s=-0.1)
    model = prepared_tiny_model()
    drafter = OracleDrafter([[]])
    with pytest.raises(ValueError, match=r"max_tree_size: expected None unless tree_size is 'auto', got 16"):
        SpecDecoder(model, drafter, 8, max_tree_size=16)
    with pytest.raises(ValueError, match=r"budget: expected None unless tree_size is 'auto'"):
        SpecDecoder(model, drafter, 8, budget=BudgetConfig())
    with pytest.raises(ValueError, match=r"budget: expected None or a specdec.budget.BudgetConfig, got dict"):
        SpecDecoder(model, drafter, "auto", budget={})
    with pytest.raises(ValueError, match=r"max_tree_size: expected None or an int >= 1, got 0"):
        SpecDecoder(model, drafter, "auto", max_tree_size=0)
    with pytest.raises(ValueError, match=r"tree_size: expected an int >= 0 or 'auto', got 'big'"):
        SpecDecoder(model, drafter, "big")
    with pytest.raises(ValueError, match=r"budgets: expected the largest budget to be max_tree_size = 64"):
        SpecDecoder(model, drafter, "auto", budget=BudgetConfig(budgets=(0, 8)))
    with pytest.raises(ValueError, match=r"forward_s: expected seconds for every budget \(0, 8\), got none for \[8\]"):
        SpecDecoder(model, drafter, "auto", max_tree_size=8, budget=BudgetConfig(budgets=(0, 8),
                                                                                  costs=CostTable({0: 1.0}, {8: 1.0})))

    class _Ranks:
        def begin(self, *a): ...
        def check_trees(self, *a): ...
        def verdicts(self, *a): ...

    with pytest.raises(ValueError, match=r"tree_size: 'auto' needs a single-process target"):
        SpecDecoder(model, drafter, "auto", rank_sync=_Ranks())


def test_defaults_auto_through_wrap_and_fixed_sizes_unchanged():
    model = prepared_tiny_model()
    auto = specdec.wrap(model, OracleDrafter([[]]), attn_impl="torch").decoder
    assert auto.budget is not None and auto.tree_size == 64 and auto.tree_budgets == (0, 4, 8, 16, 32, 64)
    assert specdec.wrap(model, None).decoder.budget is None  # no drafter: plain decoding
    fixed = SpecDecoder(model, OracleDrafter([list(greedy_reference(9, 0, NEW))]), 6, attn_impl="torch")
    assert fixed.budget is None and fixed.tree_budgets == (6,)
    out = fixed.generate(random_prompt(9, 0), NEW)
    assert out.budget is None and {s.budget for s in out.steps} == {6}


# --------------------------------------------------------------------------- end to end, greedy


def _scripted(decoder: SpecDecoder, schedule) -> list[int]:
    """Make ``decoder``'s policy pick ``schedule``'s budgets in turn (its own rule still runs); returns
    the list the chosen budgets are appended to."""
    policy, cycle, chosen = decoder.budget, itertools.cycle(schedule), []
    real = policy.decide

    def decide(batch, capacity, active):
        decision = dataclasses.replace(real(batch, capacity, active), budget=next(cycle), why="scripted")
        chosen.append(decision.budget)
        return decision

    policy.decide = decide
    return chosen


class _Counting(OracleDrafter):
    """The oracle drafter counting its proposals and the budgets it was asked with."""

    def __init__(self, refs, seed=0, hidden=None):
        super().__init__(refs, seed=seed)
        self.asked: list[int] = []
        self.seen: list[tuple[int, list[int], torch.Tensor | None]] = []
        if hidden is not None:
            self.needs_hidden_states = hidden

    def propose(self, ctx: DraftContext):
        self.asked.append(ctx.tree_size)
        self.seen.append((ctx.seq, ctx.tokens.tolist(), None if ctx.hidden is None else ctx.hidden.clone()))
        return super().propose(ctx)


SCHEDULE = (0, 16, 4, 0, 0, 8, 16, 4, 0, 16)


@pytest.mark.parametrize("static,chunk", [(False, 0), (True, 0), (True, 3)])
@pytest.mark.parametrize("kind", ["oracle", "draft_model"])
def test_greedy_equals_hf_under_scripted_budget_switches(static, chunk, kind):
    refs = [list(greedy_reference(length, seed, NEW)) for length, seed in SHAPES]
    if kind == "oracle":
        drafter = _Counting(refs, seed=2)
    else:
        drafter = DraftModelDrafter(prepared_tiny_model(), width=2, max_depth=5)  # the target as draft: accepts
    dec = SpecDecoder(prepared_tiny_model(), drafter, "auto", max_tree_size=16, static_shapes=static,
                      attn_impl="torch", decode_chunk=chunk, cache_buckets=(96,) if static else None)  # fmt: skip
    chosen = _scripted(dec, SCHEDULE)
    out = dec.generate([random_prompt(length, seed) for length, seed in SHAPES], NEW)
    for b, ref in enumerate(refs):
        assert out.sequences[b, : out.lengths[b]].tolist() == ref
    assert set(chosen) == {0, 4, 8, 16}
    assert [s.budget for s in out.steps if s.budget] == [c for c in chosen if c]  # one step per drafting decision
    assert sum(out.budget.histogram.values()) == len(out.steps)
    assert out.budget.histogram == {n: sum(s.budget == n for s in out.steps) for n in (0, 4, 8, 16)}
    assert all(max(s.nodes_proposed) <= s.budget for s in out.steps)
    assert all(s.nodes_proposed == (0, 0, 0) for s in out.steps if s.budget == 0)
    if chunk:  # plain decisions ran as chunks of 3 steps
        assert out.budget.histogram[0] > chosen.count(0)
    if static:  # only the candidates' shapes were run
        assert {key[2] for key in dec.forwards} == {1, 5, 9, 17}
    if kind == "oracle":  # asked at positive budgets only, with that budget, once per unfinished sequence
        assert set(drafter.asked) == {4, 8, 16}
        assert len(drafter.asked) == sum(sum(e > 0 for e in s.tokens_emitted) for s in out.steps if s.budget)
    if not chunk:  # catch-ups: the prompts' (no warm-up: not counted), then 3 sequences' 2 plain tokens at n = 8
        assert [(a, n, k) for a, n, _, k in dec.budget.costs.catch_ups][:1] == [(3, 8, 6)]
    assert out.totals()["tokens_accepted"] > NEW


@pytest.mark.parametrize("chunk", [0, 3])
def test_features_arrive_once_when_steps_skip_the_drafter(chunk):
    """``needs_hidden_states="all"``: plain steps keep the rows they made for the next drafted step,
    one at a time or in chunks of ``decode_chunk`` steps (a chunk keeps each step's rows)."""
    refs = [list(greedy_reference(length, seed, NEW)) for length, seed in SHAPES]
    drafter = _Counting(refs, seed=4, hidden=HIDDEN_ALL)
    dec = SpecDecoder(prepared_tiny_model(), drafter, "auto", max_tree_size=16, static_shapes=True,
                      attn_impl="torch", cache_buckets=(96,), decode_chunk=chunk)  # fmt: skip
    schedule = (0, 0, 4, 0, 16, 0, 0, 0, 8)
    chosen = _scripted(dec, schedule)
    out = dec.generate([random_prompt(length, seed) for length, seed in SHAPES], NEW)
    assert all(out.sequences[b, : out.lengths[b]].tolist() == ref for b, ref in enumerate(refs))
    plain_steps = sum(s.budget == 0 for s in out.steps)
    if chunk:  # plain decisions ran as chunks of 3 steps
        assert plain_steps > chosen.count(0) and dec._chunks
    else:
        assert plain_steps == chosen.count(0) and not dec._chunks
    for b in range(len(SHAPES)):
        tokens = out.sequences[b, : out.lengths[b]].tolist()
        with torch.no_grad():
            ref = prepared_tiny_model()(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
        given = 0
        for seq, seen, hidden in drafter.seen:
            if seq != b or hidden is None:
                continue
            m = hidden.shape[0]
            assert len(seen) - 1 - m == given  # exactly the positions not given before, plain steps' included
            torch.testing.assert_close(hidden, ref[given : len(seen) - 1], atol=1e-4, rtol=1e-4)
            given = len(seen) - 1
        assert given > SHAPES[b][0]


def _costed(forward, draft, refs, static=False):
    drafter = _Counting(refs, seed=6)
    budget = BudgetConfig(budgets=(0, 4, 16), probe_every=5, probe_share=1.0, costs=CostTable(forward, draft))
    dec = SpecDecoder(prepared_tiny_model(), drafter, "auto", max_tree_size=16, budget=budget, static_shapes=static,
                      attn_impl="torch", cache_buckets=(96,) if static else None)  # fmt: skip
    return dec, drafter


class _SlowFirst(_Counting):
    """A drafter whose first proposal after its construction takes ``first_s`` longer (a capture)."""

    def __init__(self, refs, first_s):
        super().__init__(refs)
        self.first_s = first_s

    def propose(self, ctx: DraftContext):
        if not self.asked:
            time.sleep(self.first_s)
        return super().propose(ctx)


def test_warmup_times_the_catch_up_apart_from_the_first_proposals_captures():
    refs = [list(greedy_reference(9, 0, NEW))]
    dec = SpecDecoder(prepared_tiny_model(), _SlowFirst(refs, 0.5), "auto", max_tree_size=16, static_shapes=True,
                      attn_impl="torch", cache_buckets=(96,))  # fmt: skip
    dec.warmup((1,), max_len=60, log=None)
    # the capture's 0.5 s spread over 33 tokens would read as 15 ms a token: more than the whole catch-up takes
    assert dec.budget.costs.catch_up_s(33) < 0.25


class _CapturingFirst(_Counting):
    """A feature-reading drafter whose first proposal captures for ``first_s`` (and says so in
    ``captured_s``, as ``EagleDrafter`` does): the warm-up times only the target for it."""

    def __init__(self, refs, first_s):
        super().__init__(refs, hidden=HIDDEN_ALL)
        self.first_s = first_s
        self.captured_s = 0.0

    def propose(self, ctx: DraftContext):
        if not self.asked:
            time.sleep(self.first_s)
            self.captured_s += self.first_s
        return super().propose(ctx)


def test_a_capture_inside_a_step_is_no_catch_up_cost():
    """After a warm-up of the target, the first drafted step of a feature-reading drafter catches up on
    the prompt and captures: its seconds are the capture's, not the catch-up's (read as a cost of
    0.3 s / 8 tokens a token, every later catch-up would price drafting out, and plain steps never
    measure it again)."""
    refs = [list(greedy_reference(9, 0, NEW)), list(greedy_reference(9, 0, NEW))]
    dec = SpecDecoder(prepared_tiny_model(), _CapturingFirst(refs, 0.3), "auto", max_tree_size=16,
                      static_shapes=True, attn_impl="torch", cache_buckets=(96,))  # fmt: skip
    dec.warmup((1,), max_len=60, log=None)
    assert dec.budget.costs.warm and not dec.budget.costs.catch_ups  # the drafter was not timed
    out = dec.generate(random_prompt(9, 0), NEW)
    assert out.sequences[0].tolist() == refs[0]
    drafted = [s for s in out.steps if s.budget]
    assert drafted[0].capture_s == pytest.approx(0.3) and drafted[0].draft_s >= 0.3
    assert all(s.capture_s == 0.0 for s in out.steps[1:] if s is not drafted[0])
    assert all(seconds < 0.3 for _, _, seconds, _ in dec.budget.costs.catch_ups)
    assert dec.budget.costs.catch_up_s(100) < 0.1
    out = dec.generate(random_prompt(9, 0), NEW)  # the next call drafts from its first steps
    assert out.sequences[0].tolist() == refs[1] and out.steps[0].budget > 0


def test_measured_step_costs_do_not_decrease_with_the_budget():
    """A budget's measured target side is read as at most any larger budget's: an estimate of plain
    decoding left high by one slow step (and never measured again while drafting wins) cannot make
    plain decoding look dearer than a drafted step."""
    config = BudgetConfig(budgets=(0, 4, 16))
    policy = BudgetPolicy(config, config.candidates(16))
    for n, s in ((0, 0.010), (4, 0.003), (16, 0.004)):  # plain's stale, above both drafted budgets'
        policy.costs.record_forward(1, 1024, n, s)
    for n in (4, 16):
        policy.costs.record_draft(n, 0.0005)
    policy.begin([9], 100)
    decision = policy.decide(1, 1024, 1)
    assert decision.seconds == pytest.approx((0.003, 0.003 + 0.0005, 0.004 + 0.0005))
    # fixed costs are taken as given
    fixed = _policy({0: 0.010, 4: 0.003, 16: 0.004}, {4: 0.0005, 16: 0.0005}, budgets=(0, 4, 16))
    fixed.begin([9], 100)
    assert fixed.decide(1, 1024, 1).seconds == pytest.approx((0.010, 0.0035, 0.0045))


def test_step_costs_leave_out_captures_and_outlying_catch_ups():
    costs = StepCosts()
    costs.record_forward(1, 1024, 4, 0.3)  # a warm-up: the first catch-up would count
    costs.observe(1, 1024, 4, 0.3, 1, 20.0, 50, captured=True)  # a compile inside: not a cost of drafting
    assert not costs.catch_ups and costs.draft_s(1, 4) == 0.0
    for _ in range(2):  # nor of a step: a plain chunk's capture shared by its steps
        costs.observe(1, 1024, 0, 0.9, 0, 0.0, 0, captured=True)
    assert costs.step_s(1, 1024, 0) is None
    for _ in range(3):
        costs.observe(1, 1024, 4, 0.3, 1, 0.1, 0, captured=True)
    assert costs.draft_s(1, 4) == 0.0
    costs.observe(1, 1024, 4, 0.3, 1, 0.5, 50)
    costs.observe(1, 1024, 4, 0.3, 1, 9.0, 50)  # an unreported stall among the catch-ups
    assert costs.catch_up_s(10) == pytest.approx(10 * 0.5 / 50)  # the lower median, not the mean
    costs.observe(1, 1024, 4, 0.3, 1, 0.6, 50)
    assert costs.catch_up_s(10) == pytest.approx(10 * 0.6 / 50)


def test_catch_up_fit_fixed_and_per_token_parts():
    rng = random.Random(7)
    fixed, per_token = 2e-4, 4e-7  # launches, then each token (EAGLE's head on an H200)
    seen = [(k, fixed + per_token * k * rng.uniform(0.9, 1.1)) for k in (16, 17, 16, 33, 500, 18, 1200, 16)]
    fit = catch_up_fit(seen)
    for k in (1, 16, 100, 1000, 4000):
        assert fit(k) == pytest.approx(fixed + per_token * k, rel=0.15)
    # noise between near-equal counts is no slope: 16-18 tokens in 0.15-0.25 ms, then a 1,000-token prompt
    near = catch_up_fit([(16, 2.5e-4), (17, 1.5e-4), (18, 2.5e-4), (16, 1.5e-4)])
    assert near(1000) == pytest.approx(1.5e-4) and near(8) == pytest.approx(0.75e-4)
    # a drafter that re-reads every token (a draft model's prefill): proportional
    assert catch_up_fit([(10, 0.1), (40, 0.4), (20, 0.2)])(400) == pytest.approx(4.0)
    # the slope never exceeds the smallest seconds per token seen (a negative fixed part is impossible)
    steep = catch_up_fit([(10, 0.01), (20, 0.1), (40, 0.1)])
    assert steep(100) <= 100 * 0.1 / 40 + 1e-12 and steep(0) >= 0


def test_a_poor_call_does_not_lock_the_next_calls_out_of_drafting():
    """Spec-Bench with a general EAGLE head (2 x H200): the first call (a writing prompt) accepted ~0.9
    tokens a step, about the break-even of drafting; its catch-ups after plain steps took ~0.2 ms for
    16 tokens, mostly fixed launches. Read per token, the next call's 1,000-token prompt priced every
    probe at ~12 ms more, and the other 479 calls never drafted. Now the next call probes early."""
    costs = StepCosts()
    costs.record_forward(1, 2048, 0, 1.9e-3)  # a warm-up of the target
    costs.record_forward(1, 2048, 64, 2.1e-3)
    for k in (16, 17, 16, 16, 16):
        costs.observe(1, 2048, 64, 2.2e-3, 1, 1.65e-3 + 2e-4, k)
    for _ in range(3):
        costs.observe(1, 2048, 64, 2.2e-3, 1, 1.65e-3, 0)
    assert costs.catch_up_s(1000) < 1e-3
    policy = BudgetPolicy(BudgetConfig(budgets=(0, 64)), (0, 64))
    policy.costs = costs
    for k in (1, 1, 0, 1, 1, 0, 1, 1):  # the first call's acceptance: a little below break-even
        policy.observe_trees([_chain(k, 8)])
    policy.begin([1000], 128)  # the next call: a 1,000-token prompt the drafter was not shown
    picked = []
    for _ in range(40):
        n = policy.decide(1, 2048, 1).budget
        picked.append(n)
        if n:
            policy.observe_trees([_chain(0, 8)])
        stats = specdec.StepStats((n,), (0,), (1,), 1.65e-3 if n else 0.0,
                                  2.2e-3 if n else 1.9e-3, 0.0)  # fmt: skip
        policy.observe_steps(n, 1, 2048, int(n > 0), [stats])
    assert 64 in picked[:8]  # a probe once its loss is 2 % of the plain steps' time (the call's start counts 16)


def test_injected_costs_switch_between_plain_and_drafting():
    refs = [list(greedy_reference(9, 0, NEW))]
    prompt = random_prompt(9, 0)
    # drafting cannot pay: plain steps, one probe every 5 of them
    dec, drafter = _costed({0: 1.0, 4: 1.0, 16: 1.0}, {4: 10.0, 16: 10.0}, refs)
    out = dec.generate(prompt, NEW)
    assert out.sequences[0].tolist() == refs[0]
    drafted = [s for s in out.steps if s.budget]
    assert drafted and len(drafted) <= len(out.steps) // 5 + 1
    assert len(drafter.asked) == len(drafted)  # budget 0 never calls the drafter
    assert out.budget.histogram[0] >= 4 * len(drafted) - 5 and "n=0: 1.00 tok / 1000.00 ms" in out.budget.reason
    # cheap drafting with an oracle: the largest tree
    dec, drafter = _costed({0: 1.0, 4: 1.0, 16: 1.0}, {4: 0.1, 16: 0.1}, refs, static=True)
    out = dec.generate(prompt, NEW)
    assert out.sequences[0].tolist() == refs[0]
    assert out.budget.histogram.get(16, 0) >= len(out.steps) - 1 and set(drafter.asked) <= {4, 16}


def test_warmup_builds_and_times_every_budget_then_generate_builds_nothing():
    refs = [list(greedy_reference(9, 0, NEW))]
    drafter = _Counting(refs)
    dec = SpecDecoder(prepared_tiny_model(), drafter, "auto", max_tree_size=16, static_shapes=True,
                      attn_impl="torch", cache_buckets=(96,), decode_chunk=4)  # fmt: skip
    report = dec.warmup((1, 2), max_len=60, log=None)
    assert [e.n for e in report.entries] == [17, 17]
    assert set(dec.forwards) == {(b, 96, n) for b in (1, 2) for n in (1, 5, 9, 17)}
    costs = dec.budget.costs
    assert set(costs.warm) == {(b, 96, n) for b in (1, 2) for n in (0, 4, 8, 16)}
    assert all(s > 0 for s in costs.warm.values())
    # the drafter timed: a catch-up on a dummy prompt of 60 - 16 - 3 * 3 - 1 = 34 tokens (the second one: the
    # first makes the captures), then 3 steps per budget
    assert [(a, n, k) for a, n, _, k in costs.catch_ups] == [(1, 4, 33)] and costs.catch_up_s(10) > 0
    assert drafter.asked == [4] * 5 + [8] * 3 + [16] * 3 and all(costs.draft_s(1, n) > 0 for n in (4, 8, 16))
    # dynamic shapes (a CPU's default): nothing to capture, so one timed run per budget, the first
    dynamic = SpecDecoder(prepared_tiny_model(), _Counting(refs), "auto", max_tree_size=16, attn_impl="torch")
    assert not dynamic.static_shapes
    dynamic.warmup((1,), max_len=60, log=None)
    assert dynamic.drafter.asked == [4, 4, 8, 16]  # the catch-up on 60 - 16 - 3 - 1 = 40 tokens, then one a budget
    assert [(a, n, k) for a, n, _, k in dynamic.budget.costs.catch_ups] == [(1, 4, 39)]
    assert {n for (_, _, n) in dynamic.budget.costs.warm} == {0, 4, 8, 16}
    reading = SpecDecoder(prepared_tiny_model(), _Counting(refs, hidden=HIDDEN_ALL), "auto", max_tree_size=16,
                          attn_impl="torch")  # fmt: skip
    reading.warmup((1,), max_len=60, log=None)  # a drafter reading hidden states: measured by the calls
    assert not reading.budget.costs.catch_ups and reading.drafter.asked == []
    kept = dict(dec.forwards)
    out = dec.generate(random_prompt(9, 0), NEW)
    assert out.sequences[0].tolist() == refs[0]
    assert dict(dec.forwards) == kept and all(out.budget.last.seconds)  # nothing new; every cost known
    assert out.budget.last.why in ("rate", "probe")


# --------------------------------------------------------------------------- end to end, sampling


def test_sampling_stays_lossless_when_the_budget_changes_between_steps():
    """The first two sampled tokens against the target's exact joint, budgets scripted per step
    (plain steps, chunks of 2 and trees of 2 / 4 / 6 draft nodes mixed within and across calls);
    the draft's own joint is rejected by the same test (it can fail)."""
    samples, batch = 3000, 100
    cfg = SamplingConfig(TEMPERATURE)
    drafter = DraftModelDrafter(tiny_draft(), width=2, max_depth=3, proposal="no_replacement")
    dec = SpecDecoder(tiny_target(), drafter, "auto", max_tree_size=6, budget=BudgetConfig(budgets=(0, 2, 4, 6)),
                      static_shapes=True, attn_impl="torch", decode_chunk=2, cache_buckets=(16,))  # fmt: skip
    chosen = _scripted(dec, (6, 0, 2, 4, 0, 6, 6, 2, 0))
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB)
    accepted = 0
    for _ in range(math.ceil(samples / batch)):
        out = dec.generate([torch.tensor(PROMPT)] * batch, 2, do_sample=True, temperature=TEMPERATURE, generator=gen)
        for b in range(batch):
            x, y = out.new_tokens(b).tolist()
            counts[x, y] += 1
        accepted += out.totals()["tokens_accepted"]
    assert accepted > samples // 4 and set(chosen) == {0, 2, 4, 6}
    assert chi2_pvalue(counts, exact_joint(tiny_target(), PROMPT, cfg)) > 0.01
    assert chi2_pvalue(counts, exact_joint(tiny_draft(), PROMPT, cfg)) < 1e-6
