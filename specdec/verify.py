"""Verification of a token tree against the target's per-node outputs.

Greedy: accept the longest root-to-node path whose every token is the target's argmax at its
parent. Stochastic (lossless: the emitted tokens are distributed exactly as sampling the target
token by token), walking down from the root; at each node the children are tried in proposal
order against the current target distribution ``p`` (fresh at every accepted node):

- ``iid`` (multi-step speculative sampling, SpecInfer): accept child x with probability
  ``min(1, p(x) / q(x))``; on rejection ``p <- norm(max(p - q, 0))``.
- ``no_replacement`` (Sequoia): as ``iid`` but after rejecting x also ``q(x) <- 0, q <- norm(q)``
  (the next child was drawn from q without x).
- ``topk`` (deterministic children, EAGLE): accept x with probability ``p(x)``; on rejection
  ``p(x) <- 0, p <- norm(p)``.

When no child is accepted (or the node is a leaf) the bonus token is sampled from ``p``.
(A residual with no mass left, reachable only through rounding, keeps the previous ``p``.)

**One device-to-host copy per call** (``verify_stochastic_batch``; ``verify_stochastic`` is its
one-tree case). The rule above only ever asks, at node v after rejecting its first j children
``c_1 .. c_j`` (tokens ``x_1 .. x_j``):

- ``a(v, j+1)``, the probability of accepting ``c_{j+1}``, and
- ``rho_v``, the residual after rejecting *all* of v's children (the bonus distribution when the
  walk stops at v; ``rho_v = p_v`` for a leaf).

Both are deterministic functions of the tree, ``p_v`` and ``q_v``: which children were rejected
before ``c_{j+1}`` is fixed (all earlier siblings, in proposal order), only *whether the walk
gets there* is random. So everything is computed up front, for every node, on the device:

- ``topk``: with ``g_c = p_v(x_c)`` and ``S_j = 1 - sum of g over the distinct tokens among x_1 .. x_j``,
  ``a(v, j+1) = g_{c_{j+1}} / S_j`` (0 for a token already rejected at v): the host computes it
  from the gathered ``g`` (n - 1 floats); ``rho_v = p_v`` with the children's tokens zeroed
  (one ``index_fill_`` over all topk rows; normalisation is left to the sampler).
- ``iid`` / ``no_replacement``: the residual recursion, batched over sibling rank: at rank j
  every node with more than j children updates its row together (``K`` = the most children of
  a node: K rounds of a few ``[m_j, V]`` ops, ``sum_j m_j = n - 1`` rows in all); the
  acceptance test of child ``c_{j+1}`` is ``u q_j(x) < p_j(x)`` with the rank-j rows gathered.
- one uniform ``U_c`` per child and one ``U'_v`` per node (float64, from ``generator``), and
  ``B_v = min{i : C_v(i) > U'_v C_v(V - 1)}``, ``C_v`` the cumulative sum of ``rho_v``, found in
  two levels on float64 sums (a block of ``CDF_BLOCK`` tokens, then a token in it: ``specdec.sampling.sample_inverse_cdf``)
  (inverse-CDF sampling: ``P(B_v = i) = rho_v(i) / sum(rho_v)`` up to float64 rounding, and
  ``rho_v(B_v) > 0`` always; a residual with no mass gives ``B_v = V``, see below).

One copy brings ``U_c``, ``g_c``, the rank-gathered ``p_j(x)``, ``q_j(x)`` and ``B_v`` to the
host (about 4 n float64 per tree), where the walk runs on Python floats: at node v, accept the
first child with ``U_c < a(v, j)``; if none, emit ``B_v``.

*Why this is still lossless.* The old walk drew a fresh uniform for each child it examined and a
fresh bonus from ``rho_v`` at the node where it stopped. The new walk reads pre-drawn variables
instead: ``U_c`` for each examined child, ``B_v`` at the stopping node. All of ``{U_c}`` and
``{B_v}`` are mutually independent, and which variable the walk reads next is a function of the
variables it has already read (the walk is adaptive but never reads a variable twice, and never
reads one whose value influenced the choice to read it). Hence, conditioned on everything read
so far, the next variable read has its unconditional law: ``U_c ~ U[0, 1)`` and
``B_v ~ rho_v``. The probability of any (path, bonus) outcome is therefore the same product
``prod(a or 1 - a over the examined children) * rho_v(bonus)`` under both walks; the variables
never read do not matter. Draws and residuals of nodes the walk does not reach are wasted work,
not bias. (Bitwise, the random stream differs from the per-node walk's.)

*Rounding.* Acceptance ratios use the target's float32 probabilities (as before); ``topk``'s
``S_j`` is accumulated in float64 on the host from ``1`` (rows sum to 1), the old walk
renormalised in float32 on the device. A ``topk`` residual whose mass is gone (children covering
the whole support, then a rejection that exact arithmetic would not allow) falls back to the
node's last child with target mass; an ``iid`` / ``no_replacement`` residual with no mass keeps
the previous row, as before. A row with no mass at all (NaN or all zeros) is a ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.sampling import sample_inverse_cdf
from specdec.transfer import to_device
from specdec.tree import TokenTree

__all__ = ["Verdict", "greedy_verdict", "verify_greedy", "verify_stochastic", "verify_stochastic_batch"]


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one tree.

    Attributes:
        path: accepted node indices from the root: ``path[0] == 0``, ``path[j]`` the child of
            ``path[j - 1]``; ``len(path) - 1`` draft tokens were accepted.
        bonus_token: the token the target emits after the path's last node.
    """

    path: tuple[int, ...]
    bonus_token: int

    @property
    def num_accepted(self) -> int:
        """Accepted draft tokens (root excluded)."""
        return len(self.path) - 1

    def new_tokens(self, tree: TokenTree) -> list[int]:
        """The tokens this step emits: the accepted draft tokens, then the bonus token."""
        return tree.path_tokens(self.path[1:]) + [self.bonus_token]


def _check_scores(tree: TokenTree, scores: torch.Tensor, name: str) -> None:
    if not isinstance(tree, TokenTree):
        raise ValueError(f"tree: expected a specdec.TokenTree, got {type(tree).__name__}")
    if not isinstance(scores, torch.Tensor) or not scores.dtype.is_floating_point or scores.dim() != 2:
        got = f"{scores.dtype} {tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise ValueError(f"{name}: expected a float tensor of shape [n, V], got {got}")
    if scores.shape[0] != tree.n:
        raise ValueError(f"{name}: expected {tree.n} rows (one per tree node), got {scores.shape[0]}")
    vocab = scores.shape[1]
    if tree.draft_probs is not None and tree.draft_probs.shape[1] != vocab:
        raise ValueError(
            f"tree.draft_probs: expected the target's vocabulary size V = {vocab}, got {tree.draft_probs.shape[1]}"
        )
    if max(tree.token_list) >= vocab:
        raise ValueError(f"tree.tokens: expected ids < V = {vocab} (target vocabulary), got {max(tree.token_list)}")


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """Longest path of target-argmax tokens, plus the target's argmax after it.

    Args:
        tree: the proposed tree (n nodes).
        target_logits: float ``[n, V]``; row i = the target's logits after node i's path.

    Returns:
        ``Verdict``; among siblings with the same token the first is followed.
    """
    _check_scores(tree, target_logits, "target_logits")
    return greedy_verdict(tree, target_logits.argmax(dim=-1).tolist())


def greedy_verdict(tree: TokenTree, argmax: list[int]) -> Verdict:
    """``verify_greedy`` from the target's argmax tokens, on the host (no checks).

    Args:
        tree: the proposed tree (n nodes).
        argmax: host ints, at least n: ``argmax[i]`` = the target's argmax token after node i's
            path (entries past n are ignored: e.g. a padded row of a batched argmax).

    Returns:
        ``Verdict``; among siblings with the same token the first is followed.
    """
    tokens, parents = tree.token_list, tree.parent_list
    path, node, want = [0], 0, argmax[0]
    # Depth-first order: node's children come after it, in proposal order, and the subtree of the
    # child taken comes before the child's later siblings; so one pass in index order follows the path.
    for i in range(1, len(tokens)):
        if parents[i] == node and tokens[i] == want:
            path.append(i)
            node, want = i, argmax[i]
    return Verdict(tuple(path), want)


def verify_stochastic(
    tree: TokenTree, target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> Verdict:
    """Lossless stochastic verification for the tree's proposal kind (see the module docstring).

    The one-tree case of ``verify_stochastic_batch``: one device-to-host copy.

    Args:
        tree: the proposed tree; ``"iid"`` and ``"no_replacement"`` trees need ``draft_probs``
            ``[n, V]`` (rows of nodes with children are gathered and moved to ``target_probs``'
            device if elsewhere).
        target_probs: float ``[n, V]``; row i = the target distribution after node i's path, after
            temperature / top-k / top-p (``specdec.sampling.logits_to_probs``). Rows sum to 1.
        generator: source of randomness (``None``: torch's default CPU generator); the uniforms
            are drawn on its device (and moved to ``target_probs``' device).

    Returns:
        ``Verdict`` with the accepted path and the bonus token sampled from the final residual.
    """
    _check_scores(tree, target_probs, "target_probs")
    return verify_stochastic_batch([tree], target_probs[None], generator)[0]


def verify_stochastic_batch(
    trees: Sequence[TokenTree | None], target_probs: torch.Tensor, generator: torch.Generator | None = None
) -> list[Verdict | None]:
    """``verify_stochastic`` for a batch of trees with one device-to-host copy in all.

    Device work (no host synchronisation): one asynchronous host-to-device copy of the plan's
    int64 indices (pinned on CUDA), the uniforms, a gather of the rows of every tree node, the
    residuals (module docstring), the inverse-CDF bonus draw of every node; then one ``tolist``
    of a float64 vector of about ``4 * sum(n)`` entries, and the walks on the host.

    Args:
        trees: B trees; None skips a sequence (its verdict is None). Proposal kinds may differ.
        target_probs: float ``[B, m, V]`` with ``m >=`` every tree's n; row ``[b, i]`` = the
            target distribution after node i of ``trees[b]`` (rows past its n are ignored).
        generator: as in ``verify_stochastic``; draws ``sum(2 n - 1)`` float64 uniforms.

    Returns:
        Per tree, its ``Verdict`` (None where the tree is None).
    """
    if (not isinstance(target_probs, torch.Tensor) or not target_probs.dtype.is_floating_point
            or target_probs.dim() != 3):  # fmt: skip
        got = (f"{target_probs.dtype} {tuple(target_probs.shape)}" if isinstance(target_probs, torch.Tensor)
               else type(target_probs).__name__)  # fmt: skip
        raise ValueError(f"target_probs: expected a float tensor of shape [B, m, V], got {got}")
    if target_probs.shape[0] != len(trees):
        raise ValueError(f"target_probs: expected {len(trees)} sequences (one per tree), got {target_probs.shape[0]}")
    width, vocab = target_probs.shape[1], target_probs.shape[2]
    for b, t in enumerate(trees):
        if t is None:
            continue
        if isinstance(t, TokenTree) and t.n > width:
            raise ValueError(f"target_probs: expected at least {t.n} rows for trees[{b}] (its nodes), got {width}")
        _check_scores(t, target_probs[b, : t.n], "target_probs")
        if t.proposal != "topk" and t.n > 1 and t.draft_probs is None:
            raise ValueError(
                f"tree.draft_probs: expected [n, V] proposal probabilities for a {t.proposal!r} tree, got None"
            )
    live = [(b, t) for b, t in enumerate(trees) if t is not None]
    if not live:
        return [None] * len(trees)
    plan = _Plan(live, vocab)
    host = _device_pass(plan, target_probs, generator)  # the one device-to-host copy
    verdicts: list[Verdict | None] = [None] * len(trees)
    for k, (b, t) in enumerate(live):
        verdicts[b] = _walk(plan, host, k, t)
    return verdicts


class _Plan:
    """Host-side layout of one batched verification (no tensors are read).

    Rows of the gathered ``[R, V]`` matrix (R = every node of every tree), in this order: the
    ``topk`` trees' nodes with children, then the ``iid`` ones and the ``no_replacement`` ones,
    each of these two sorted by child count, most first (so the nodes with more than j children
    are a prefix: rank j updates ``rows[start : start + m_j]`` in place), then every leaf.
    Children (C = sum(n - 1)) are numbered tree by tree, node index - 1 within a tree.
    """

    def __init__(self, live: list[tuple[int, TokenTree]], vocab: int) -> None:
        self.vocab = vocab
        topk: list[tuple[int, int]] = []  # (k, node)
        sampled: dict[str, list[tuple[int, int, int]]] = {"iid": [], "no_replacement": []}  # (-kids, k, node)
        leaves: list[tuple[int, int]] = []
        self.child_base: list[int] = []  # per tree: index of its node 1 among the children
        c = 0
        for k, (_, t) in enumerate(live):
            self.child_base.append(c)
            c += t.n - 1
            for i, kids in enumerate(t.children):
                if not kids:
                    leaves.append((k, i))
                elif t.proposal == "topk":
                    topk.append((k, i))
                else:
                    sampled[t.proposal].append((-len(kids), k, i))
        self.num_children = c
        order: list[tuple[int, int]] = list(topk)
        self.loops: list[tuple[str, int, list[tuple[int, int]]]] = []  # (kind, first row, [(k, node)] sorted)
        for kind in ("iid", "no_replacement"):
            rows = [(k, i) for _, k, i in sorted(sampled[kind])]  # stable for equal counts: tree, node order
            if rows:
                self.loops.append((kind, len(order), rows))
                order.extend(rows)
        order.extend(leaves)
        self.num_rows = len(order)
        self.row_of: list[list[int]] = [[0] * t.n for _, t in live]  # per tree, per node: its row
        for r, (k, i) in enumerate(order):
            self.row_of[k][i] = r
        self.kinds = [t.proposal for _, t in live]
        self.drafts = [t.draft_probs for _, t in live]
        self.seqs = [b for b, _ in live]

        # The int64 index plan, one host-to-device copy: segments appended to `meta`.
        meta: list[int] = []

        def put(values: list[int]) -> tuple[int, int]:
            meta.extend(values)
            return len(meta) - len(values), len(values)

        self.rows_b = put([live[k][0] for k, _ in order])
        self.rows_i = put([i for _, i in order])
        seqs, pars, toks = [], [], []
        for b, t in live:
            seqs += [b] * (t.n - 1)
            pars += t.parent_list[1:]
            toks += t.token_list[1:]
        self.g_b, self.g_i, self.g_tok = put(seqs), put(pars), put(toks)
        fill = []
        for r, (k, i) in enumerate(topk):
            t = live[k][1]
            fill += [r * vocab + t.token_list[c] for c in t.children[i]]
        self.fill = put(fill)
        # Per sampled loop: the tokens [K, M] by rank, the rank sizes m_j, the draft rows to gather.
        self.loop_meta = []
        self.loop_pos: list[dict[int, int]] = [{} for _ in live]  # per tree: child node -> its num/den index
        pos = 0
        for kind, start, rows in self.loops:
            counts_per_row = [len(live[k][1].children[i]) for k, i in rows]
            most, m = counts_per_row[0], len(rows)
            tokmat = [0] * (most * m)
            ranks = []
            for j in range(most):
                m_j = sum(1 for n_kids in counts_per_row if n_kids > j)
                ranks.append(m_j)
                for r in range(m_j):
                    k, i = rows[r]
                    child = live[k][1].children[i][j]
                    tokmat[j * m + r] = live[k][1].token_list[child]
                    self.loop_pos[k][child] = pos
                    pos += 1
            # Draft rows: gathered tree by tree (node order), then permuted into the sorted row order.
            by_tree: dict[int, list[tuple[int, int]]] = {}
            for r, (k, i) in enumerate(rows):
                by_tree.setdefault(k, []).append((r, i))
            gathers = []
            cat_order = []
            for k, pairs in by_tree.items():
                local = [i for _, i in pairs]
                gathers.append((k, local, put(local)))
                cat_order += [r for r, _ in pairs]
            inverse = [0] * m
            for j, r in enumerate(cat_order):
                inverse[r] = j
            perm = None if inverse == list(range(m)) else put(inverse)
            self.loop_meta.append((kind, start, m, ranks, put(tokmat), gathers, perm))
        self.num_loop = pos
        self.meta = meta


def _device_pass(plan: _Plan, target_probs: torch.Tensor, generator: torch.Generator | None) -> list[float]:
    """All of the verification's tensor work; returns the one host copy (a float64 list)."""
    dev = target_probs.device
    meta = to_device(torch.tensor(plan.meta, dtype=torch.int64), dev)

    def seg(where: tuple[int, int]) -> torch.Tensor:
        return meta[where[0] : where[0] + where[1]]

    C, R = plan.num_children, plan.num_rows
    gen_device = generator.device if generator is not None else torch.device("cpu")
    u = to_device(torch.rand(C + R, dtype=torch.float64, generator=generator, device=gen_device), dev)
    rows = target_probs[seg(plan.rows_b), seg(plan.rows_i)].float()  # [R, V]: a fresh tensor (advanced indexing)
    g = target_probs[seg(plan.g_b), seg(plan.g_i), seg(plan.g_tok)].double()  # [C]: p_parent(token)
    if plan.fill[1]:
        _zero_children(rows, seg(plan.fill))
    num: list[torch.Tensor] = []
    den: list[torch.Tensor] = []
    for kind, start, m, ranks, tok, gathers, perm in plan.loop_meta:
        parts = []
        for k, local, where in gathers:
            q = plan.drafts[k]
            # draft rows on another device (a CPU drafter for a GPU target): indexed there, then moved
            idx = seg(where) if q.device == dev else torch.tensor(local, device=q.device)
            parts.append(to_device(q.index_select(0, idx), dev).float())  # fresh rows: updated in place below
        q_rows = torch.cat(parts) if len(parts) > 1 else parts[0]
        if perm is not None:
            q_rows = q_rows.index_select(0, seg(perm))
        _sampled_residuals(rows[start : start + m], q_rows, seg(tok).view(len(ranks), m), ranks,
                           kind == "no_replacement", num, den)  # fmt: skip
    bonus = sample_inverse_cdf(rows, u[C:])
    parts = [u[:C], g]
    if num:
        parts += [torch.cat(num).flatten().double(), torch.cat(den).flatten().double()]
    parts.append(bonus.double())
    return torch.cat(parts).tolist()


def _zero_children(rows: torch.Tensor, flat: torch.Tensor) -> None:
    """``topk`` residuals: zero each node's children's tokens in its row (``flat = row * V + token``)."""
    rows.view(-1).index_fill_(0, flat, 0.0)


def _sampled_residuals(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor, ranks: list[int],
                       no_replacement: bool, num: list[torch.Tensor], den: list[torch.Tensor]) -> None:  # fmt: skip
    """The ``iid`` / ``no_replacement`` recursion by sibling rank, in place.

    Args:
        p, q: float32 ``[M, V]``: target and draft rows of M nodes sorted by child count (most
            first); updated in place to the residuals after all their children.
        tokens: int64 ``[K, M]``: ``tokens[j, r]`` = the token of row r's child of rank j.
        ranks: ``m_j``, the number of rows with more than j children (non-increasing).
        no_replacement: also remove each rejected token from q.
        num, den: receive ``p_j(x)`` and ``q_j(x)`` ``[m_j, 1]`` of the rank-j children.
    """
    for j, m in enumerate(ranks):
        pj, qj, t = p[:m], q[:m], tokens[j, :m, None]
        num.append(pj.gather(1, t))
        den.append(qj.gather(1, t))
        pj.copy_(_sampled_residual(pj, qj))
        if no_replacement:
            qj.copy_(_without(qj, t))


def _sampled_residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Row-wise ``norm(max(p - q, 0))``; a row with no mass left keeps ``p``."""
    x = (p - q).clamp_(min=0.0)
    s = x.sum(-1, keepdim=True)
    return torch.where(s > 0, x / s, p)


def _without(q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Row-wise ``q`` with ``tokens [m, 1]`` zeroed, renormalised; a row with no mass left keeps ``q``."""
    x = q.scatter(1, tokens, 0.0)
    s = x.sum(-1, keepdim=True)
    return torch.where(s > 0, x / s, q)


def _topk_remaining(remaining: float, g: float) -> float:
    """``topk``: the mass left at a node after rejecting a child of target probability ``g``."""
    return remaining - g


def _walk(plan: _Plan, host: list[float], k: int, tree: TokenTree) -> Verdict:
    """The verification walk of tree k on host floats (``_device_pass``'s copy)."""
    C, L = plan.num_children, plan.num_loop
    base = plan.child_base[k]
    # offsets into the one copy (the list is shared by every tree of the batch: indexed, not sliced)
    u_at, g_at, num_at, den_at, bonus_at = base - 1, C + base - 1, 2 * C, 2 * C + L, 2 * C + 2 * L
    tokens, children = tree.token_list, tree.children
    topk = plan.kinds[k] == "topk"
    loop_pos = plan.loop_pos[k]
    path, node = [0], 0
    while True:
        accepted = None
        if topk:
            remaining, seen = 1.0, set()
            for c in children[node]:
                x = tokens[c]
                gx = 0.0 if x in seen else host[g_at + c]
                if gx > 0.0 and host[u_at + c] * remaining < gx:  # u < g / remaining
                    accepted = c
                    break
                seen.add(x)
                remaining = _topk_remaining(remaining, gx)
        else:
            for c in children[node]:
                at = loop_pos[c]
                if host[u_at + c] * host[den_at + at] < host[num_at + at]:  # u < p(x) / q(x), also for q(x) = 0
                    accepted = c
                    break
        if accepted is None:
            token = int(host[bonus_at + plan.row_of[k][node]])
            if token >= plan.vocab:  # the residual had no mass
                token = _fallback_bonus(tree, node, host, g_at, plan.seqs[k])
            return Verdict(tuple(path), token)
        path.append(accepted)
        node = accepted


def _fallback_bonus(tree: TokenTree, node: int, host: list[float], g_at: int, b: int) -> int:
    """The bonus when a node's residual has no mass left: its last child with target mass
    (``host[g_at + c]``; the target's mass was all on the children's tokens, so only rounding gets
    here); a ValueError if the node's target row itself has no mass."""
    for c in reversed(tree.children[node]):
        if host[g_at + c] > 0.0:
            return tree.token_list[c]
    raise ValueError(
        f"target_probs: expected rows with positive mass, got none (NaN or all zeros) at node {node} of trees[{b}]"
    )
