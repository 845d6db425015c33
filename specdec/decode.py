"""The decode loop: per step draft -> tree forward -> verify -> accept -> commit.

``DecodeLoop._step`` is one step over the batch: the drafter proposes a ``TokenTree`` per sequence
(``_draft``), the target scores every node of every tree in one forward (``_tree_forward``: the
fixed-shape ``GraphedForward`` with static shapes, else ``hf.tree_forward``), the verification
picks each sequence's accepted path and bonus token (``_verify``), the tokens are appended (cut at
eos and ``max_new_tokens``) and the accepted nodes' KV is committed (``_accept``,
``KVCache.commit``), and the drafter hears what was accepted. Plain decoding with static shapes
runs ``decode_chunk`` steps per ``DecodeChunk`` replay instead (``_chunk_steps``). ``Run`` is the
host-side state of one ``generate`` call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec import hf
from specdec.decode_chunk import DecodeChunk
from specdec.drafting import HIDDEN_LAST, DraftContext, captured_seconds, propose_all
from specdec.kv import KVCache
from specdec.outputs import StepStats
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.tree import TokenTree
from specdec.verify import Verdict, greedy_verdict, verify_stochastic_batch
from treeattn import TreeMask

__all__ = ["DecodeLoop", "Run", "append_tokens"]

_ROOT_PARENTS = torch.tensor([-1])  # the parents of every root-only tree (trees never modify their tensors)

#: A target forward over one step's trees, inputs ready: returns (logits [B, n, V], hidden [B, n, H] or None;
#: [B, n, k * H] with the drafter's k feature layers).
_Forward = Callable[[], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass(eq=False)
class Run:
    """The state of one ``generate`` call, updated step by step (host side).

    Attributes:
        prompts: B prompts, int64 ``[L_b]``.
        seqs: int64 ``[B, T]``: committed tokens per sequence (prompt included); the last one,
            ``seqs[b, lens[b] - 1]``, is the next tree's root.
        lens: committed tokens per sequence.
        done: per sequence, finished (eos or max_new_tokens).
        hidden: per sequence, the next ``DraftContext.hidden`` (drafters with
            ``needs_hidden_states``): ``[m, H]``, the target's final hidden states of the committed
            positions ``lens[b] - 1 - m .. lens[b] - 2`` not yet shown to the drafter (m = 1 for
            ``"last"``), or None; for ``"all"`` after plain steps, a list of such row blocks in order,
            concatenated when the drafter is next asked (``_draft``): a call that stays plain copies
            no history.
        cache: the target's KV cache (holds every committed token's KV but the root's; with
            ``shared``, only those after the shared prompt: slot s is position ``P + s``).
        sampling, generator, eos, max_new_tokens, on_tokens: ``generate``'s arguments.
        shared: the batch-1 cache whose slots ``[0, P)`` hold the prompt (but its last token) that
            all sequences share, ``lengths == [P]`` (``SpecDecoder._prefill_shared``), or None:
            every sequence's prompt is in ``cache``.
    """

    prompts: list[torch.Tensor]
    seqs: torch.Tensor
    lens: list[int]
    done: list[bool]
    hidden: list[torch.Tensor | list[torch.Tensor] | None]
    cache: KVCache
    sampling: SamplingConfig | None
    generator: torch.Generator | None
    eos: set[int]
    max_new_tokens: int
    on_tokens: Callable[[int, list[int]], None] | None
    shared: KVCache | None = None


def append_tokens(run: Run, b: int, tokens: list[int]) -> list[int]:
    """Append ``tokens`` (host ints) to sequence ``b`` of ``run``, cut at its ``max_new_tokens`` and after
    the first eos; mark it done when it ends. Returns the tokens appended."""
    room = len(run.prompts[b]) + run.max_new_tokens - run.lens[b]
    new = tokens[:room]
    for j, tok in enumerate(new):
        if tok in run.eos:
            new = new[: j + 1]
            break
    run.seqs.numpy()[b, run.lens[b] : run.lens[b] + len(new)] = new  # a view: no tensor per sequence
    run.lens[b] += len(new)
    if run.lens[b] - len(run.prompts[b]) >= run.max_new_tokens or (new and new[-1] in run.eos):
        run.done[b] = True
    return new


def _stream(run: Run, appended: list[list[int]]) -> None:
    """The ``on_tokens`` callback (if any) for every sequence that appended tokens."""
    if run.on_tokens is not None:
        for b, new in enumerate(appended):
            if new:
                run.on_tokens(b, new)


class DecodeLoop:
    """The decode loop of ``SpecDecoder`` (a base class of it): reads the decoder's ``drafter``,
    ``target``, ``vocab_size``, ``static_shapes``, ``attn_impl``, ``decode_chunk``, ``rank_sync``,
    ``budget`` (the budget policy, or None) and hidden-state mode (and feature layers), and gets its
    forwards through ``_graphed`` / ``_chunk``. Every step runs at a node budget the caller passes: the
    decoder's ``tree_size``, or the policy's choice."""

    def _step(self, run: Run, budget: int) -> StepStats:
        """One step over the batch at ``budget`` draft nodes per sequence (0: no drafter call):
        draft -> tree forward -> verify -> accept and commit -> drafter update."""
        timer = self._phase_timer()
        captured = captured_seconds(self.drafter)
        with timer("draft"):
            trees, contexts = self._draft(run, budget)
        captured = captured_seconds(self.drafter) - captured
        with timer("verify"):
            if self.rank_sync is not None:  # every rank drafted the same trees (else all raise)
                self.rank_sync.check_trees(trees)
            forward = self._tree_forward(run.cache, trees, budget, run.shared)
            with timer("forward"):
                logits, node_hidden = forward()
            verdicts = self._verify(run, trees, logits)
            if self.rank_sync is not None:  # the source rank decides for all
                verdicts = self.rank_sync.verdicts(verdicts, trees, run.generator, run.sampling is not None,
                                                   self.device)  # fmt: skip
        with timer("commit"):
            new_tokens, paths = self._accept(run, trees, verdicts, node_hidden, contexts)
            run.cache.commit(paths)  # nodes already in place (a first-child chain) are not copied
        _stream(run, new_tokens)
        with timer("draft"):
            self._update_drafter(contexts, trees, verdicts)
        if self.budget is not None and budget:
            self.budget.observe_trees([(trees[b], v.path) for b, v in enumerate(verdicts)
                                       if v is not None and contexts[b] is not None])  # fmt: skip
        return StepStats(
            nodes_proposed=tuple(t.n - 1 for t in trees),
            tokens_accepted=tuple(0 if v is None else v.num_accepted for v in verdicts),
            tokens_emitted=tuple(len(new) for new in new_tokens),
            draft_s=timer.seconds["draft"],
            verify_s=timer.seconds["verify"],
            commit_s=timer.seconds["commit"],
            forward_s=timer.seconds["forward"],
            budget=budget,
            capture_s=captured,
        )

    def _draft(self, run: Run, budget: int) -> tuple[list[TokenTree], list[DraftContext | None]]:
        """Per sequence, the drafter's tree of at most ``budget`` nodes besides the root (root-only
        when finished, without a drafter or at budget 0) and the context it was asked with (None
        when it was not asked)."""
        trees: list[TokenTree] = []
        contexts: list[DraftContext | None] = []
        for b, n in enumerate(run.lens):
            if run.done[b] or self.drafter is None or budget == 0:
                trees.append(TokenTree(run.seqs[b, n - 1 : n].clone(), _ROOT_PARENTS))
                contexts.append(None)
            else:
                trees.append(None)  # type: ignore[arg-type] -- the drafter's, below
                if isinstance(run.hidden[b], list):  # the rows of plain steps since the last drafting
                    run.hidden[b] = torch.cat(run.hidden[b])
                contexts.append(DraftContext(run.seqs[b, :n], budget, b, run.sampling, run.generator,
                                             run.hidden[b]))  # fmt: skip
        asked = [ctx for ctx in contexts if ctx is not None]
        ids = run.seqs.numpy()  # a view, for reading host ints
        for ctx, tree in zip(asked, propose_all(self.drafter, asked)):
            trees[ctx.seq] = self._checked_tree(tree, ctx, int(ids[ctx.seq, len(ctx.tokens) - 1]))
        return trees, contexts

    def _checked_tree(self, tree, ctx: DraftContext, last: int) -> TokenTree:
        """The drafter's tree, checked against what the forward and the verification assume (the
        tree's own structure was checked when it was made); ``last``: the last committed token."""
        if not isinstance(tree, TokenTree):
            raise ValueError(f"drafter: propose() must return a specdec.TokenTree, got {type(tree).__name__}")
        if tree.n - 1 > ctx.tree_size:
            raise ValueError(f"drafter: expected at most tree_size = {ctx.tree_size} nodes besides the root, got {tree.n - 1}")
        root = tree.token_list[0]
        if root != last:
            raise ValueError(f"drafter: expected the tree's root token to be the last committed token {last}, got {root}")
        top = max(tree.token_list)
        if top >= self.vocab_size:
            raise ValueError(f"drafter: expected token ids < V = {self.vocab_size} (the target's vocabulary), got {top}")
        if ctx.sampling is not None and tree.proposal != "topk":
            if tree.draft_probs is None:
                raise ValueError(f"drafter: a {tree.proposal!r} tree needs draft_probs for stochastic verification")
            if tree.draft_probs.shape[1] != self.vocab_size:
                raise ValueError(f"drafter: expected draft_probs over the target's vocabulary V = {self.vocab_size}, "
                                 f"got {tree.draft_probs.shape[1]}")  # fmt: skip
        return tree

    def _tree_forward(self, cache: KVCache, trees: list[TokenTree], budget: int,
                      shared: KVCache | None = None) -> _Forward:  # fmt: skip
        """The target's forward over the B trees (each of at most ``budget`` nodes besides the root)
        as a call, its inputs prepared on the host.

        The call returns ``(logits [B, n, V], hidden [B, n, H] or None)``; node i of tree b is row
        ``[b, i]`` (rows past a tree's size are padding). n is ``budget + 1`` with static shapes
        (the fixed-shape forward of this batch size, cache and budget, made on first use), else
        the largest tree's size. Node i's KV goes to slot ``cache.lengths[b] + i``. ``shared``: the
        prompt all B sequences share, ``shared.lengths[0]`` tokens: ``cache`` then holds what follows
        it, and positions are offset by its length (static shapes: the fixed-shape forward over both
        caches, ``GraphedForward(shared=)``; dynamic: ``hf.tree_forward(shared=)``).
        """
        batch = len(trees)
        n = budget + 1 if self.static_shapes else max(t.n for t in trees)
        cache.check_room(n)
        if self.static_shapes:
            graphed = self._graphed(cache, batch, n, shared)
            return lambda: graphed.run(trees, cache.lengths)  # padding nodes hang off the root
        tokens = torch.zeros(batch, n, dtype=torch.int64)
        parents = torch.zeros(batch, n, dtype=torch.int64)  # padding nodes hang off the root
        for b, t in enumerate(trees):
            tokens[b, : t.n] = t.tokens.cpu()
            parents[b, : t.n] = t.parents.cpu()
        parents[:, 0] = -1
        mask = TreeMask.from_parents(parents)
        prefix = torch.tensor(cache.lengths, dtype=torch.int64)
        kv_len = max(cache.lengths) + n

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            out = hf.tree_forward(self.target, tokens, mask, prefix, cache, kv_len=kv_len, impl=self.attn_impl,
                                  return_hidden=self._wants_hidden, shared=shared,
                                  feature_layers=self._feature_layers)  # fmt: skip
            return out if self._wants_hidden else (out, None)

        return forward

    def _verify(self, run: Run, trees: list[TokenTree], logits: torch.Tensor) -> list[Verdict | None]:
        """Per sequence, the accepted path and bonus token (None for finished sequences).

        Greedy: one argmax over the logits of the first m rows of every sequence (m: the largest
        tree's size) and one device-to-host copy of its ``[B, m]`` tokens, then ``greedy_verdict``
        per tree on the host (the trees were checked by ``_checked_tree``, or are root-only trees of
        committed tokens). Sampling: the target distributions of the same ``[B, m]`` rows, then
        ``verify_stochastic_batch``: the residuals and draws of every node on the device, one
        device-to-host copy for the batch, the walks on the host.
        """
        m = max(t.n for t in trees)
        if run.sampling is not None:
            probs = logits_to_probs(logits[:, :m], run.sampling)
            return verify_stochastic_batch([None if run.done[b] else t for b, t in enumerate(trees)], probs,
                                           run.generator)  # fmt: skip
        best = logits[:, :m].argmax(dim=-1).tolist()
        return [None if run.done[b] else greedy_verdict(t, best[b]) for b, t in enumerate(trees)]

    def _accept(self, run: Run, trees: list[TokenTree], verdicts: list[Verdict | None],
                node_hidden: torch.Tensor | None,
                contexts: list[DraftContext | None]) -> tuple[list[list[int]], list[tuple[int, ...] | None]]:  # fmt: skip
        """Append each verdict's tokens (cut at eos and max_new_tokens) to ``run``.

        With ``node_hidden`` (``[B, n, H]``, the forward's final hidden states), sets each
        sequence's next ``run.hidden`` to copies of its committed nodes' rows (the next forward
        overwrites ``node_hidden``): ``"all"``: ``[k, H]`` of the kept path's k nodes, whose last
        row predicted the last appended token (the next root), after the rows the drafter was not
        shown yet (a step at budget 0 asks no drafter: ``contexts[b]`` None); ``"last"``: that last
        row only.

        Returns:
            Per sequence, the tokens appended, and the tree nodes whose KV the cache keeps: the
            root and the accepted nodes whose tokens were kept (a path cut by max_new_tokens or
            eos commits only its kept part; the cache always holds a sequence's tokens but its
            last), None for finished sequences.
        """
        appended: list[list[int]] = []
        paths: list[tuple[int, ...] | None] = []
        for b, v in enumerate(verdicts):
            if v is None:
                appended.append([])
                paths.append(None)
                continue
            new = append_tokens(run, b, v.new_tokens(trees[b]))
            kept = v.path[: len(new)]  # node kept[i] predicted new[i]
            appended.append(new)
            paths.append(kept)
            if node_hidden is not None:
                last = kept[-1]
                if self._hidden_mode == HIDDEN_LAST:
                    rows = node_hidden[b, last : last + 1]
                elif last == len(kept) - 1:  # nodes 0 .. last (a first-child chain): a slice
                    rows = node_hidden[b, : last + 1]
                else:
                    rows = node_hidden[b, list(kept)]  # advanced indexing copies
                self._keep_hidden(run, b, rows, append=contexts[b] is None)
        return appended, paths

    def _keep_hidden(self, run: Run, b: int, rows: torch.Tensor, append: bool, owned: bool = False) -> None:
        """Keep sequence ``b``'s hidden rows ``[m, D]`` of this step's kept tokens (row j: the state that
        predicted its j-th token) as ``run.hidden[b]`` for the drafter's next step, copied where
        ``rows`` views a forward's output (the next forward overwrites it) unless ``owned`` (a view of
        a copy already made): ``"last"``: the last row; ``"all"``: the rows, after those not shown yet
        when ``append`` (no drafter call since; kept as a list of blocks until the drafter is asked,
        see ``Run.hidden``)."""
        if self._hidden_mode == HIDDEN_LAST:
            rows = rows[-1:]
        rows = rows.clone() if rows._base is not None and not owned else rows
        before = run.hidden[b]
        if self._hidden_mode != HIDDEN_LAST and append and before is not None:
            run.hidden[b] = [*before, rows] if isinstance(before, list) else [before, rows]
        else:
            run.hidden[b] = rows

    def _update_drafter(self, contexts: list[DraftContext | None], trees: list[TokenTree],
                        verdicts: list[Verdict | None]) -> None:  # fmt: skip
        """Tell the drafter what was accepted of each tree it proposed."""
        if self.drafter is not None:
            for b, v in enumerate(verdicts):
                if contexts[b] is not None:
                    self.drafter.update(contexts[b], trees[b], v)

    def _chunking(self, budget: int) -> bool:
        """Whether steps at ``budget`` run in chunks: ``decode_chunk``, static shapes, no drafting
        (budget 0). A drafter reading hidden states gets the chunk's rows for its next step (as from
        plain steps); a tensor-parallel target's ranks check one token fingerprint per chunk."""
        return bool(self.decode_chunk) and not budget and self.static_shapes

    def _chunk_for(self, run: Run, budget: int) -> DecodeChunk | None:
        """The ``DecodeChunk`` for this call's next steps at ``budget`` (made on first use), or None:
        a step at a time (see ``decode_chunk``: not plain decoding with static shapes, or an
        unfinished sequence has fewer than ``decode_chunk`` tokens to go)."""
        if not self._chunking(budget):
            return None
        left = min(len(run.prompts[b]) + run.max_new_tokens - run.lens[b] for b in range(len(run.lens)) if not run.done[b])
        if left < self.decode_chunk:
            return None
        return self._chunk(run.cache, len(run.lens), run.shared, run.sampling)

    def _chunk_steps(self, run: Run, chunk: DecodeChunk) -> list[StepStats]:
        """Run ``chunk`` once: each unfinished sequence appends its tokens up to an eos (``append_tokens``'s
        rule; finished ones decode and are ignored); one ``StepStats`` per step, the chunk's time
        split evenly (a step emits one token per sequence still going at it)."""
        timer = self._phase_timer()
        batch, k = len(run.lens), chunk.steps
        new_graph = chunk.graph is None and chunk.forward.capture  # captured by this run (one-time work)
        with timer("verify"):
            with timer("forward"):
                ids = run.seqs.numpy()  # a view, for reading host ints
                tokens = chunk.run([int(ids[b, n - 1]) for b, n in enumerate(run.lens)], run.cache.lengths,
                                   run.generator)  # fmt: skip
            rows = tokens.tolist()
            if self.rank_sync is not None:  # every rank drew the same tokens (else all raise)
                self.rank_sync.check_tokens(rows)
        appended: list[list[int]] = [[] for _ in range(batch)]
        kept = None if chunk.hidden is None else chunk.hidden.clone()  # one copy for the batch: the chunk rewrites its rows
        with timer("commit"):
            for b, row in enumerate(rows):
                if not run.done[b]:
                    appended[b] = append_tokens(run, b, row)
                    if appended[b] and max(appended[b]) >= self.vocab_size:  # a sampled row without mass
                        raise ValueError(f"logits: expected target distributions with positive mass, got none (NaN or "
                                         f"all -inf logits) for sequence {b}")  # fmt: skip
                    run.cache.lengths[b] += len(appended[b])  # slots of the root and new[:-1], written by the chunk
                    if kept is not None and appended[b]:
                        self._keep_hidden(run, b, kept[b, : len(appended[b])], append=True, owned=True)
        _stream(run, appended)
        share = {phase: timer.seconds[phase] / k for phase in ("verify", "commit", "forward")}
        zeros = (0,) * batch
        capture = (chunk.capture_s or 0.0) / k if new_graph else 0.0
        return [StepStats(nodes_proposed=zeros, tokens_accepted=zeros,
                          tokens_emitted=tuple(int(j < len(new)) for new in appended), draft_s=0.0, verify_s=share["verify"],
                          commit_s=share["commit"], forward_s=share["forward"], budget=0, capture_s=capture)
                for j in range(k)]  # fmt: skip
