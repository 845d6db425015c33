"""Prompt prefill: every call first writes each prompt's KV but its last token (the first root).

With static shapes and a cache of at least ``prefill_width`` slots the prompts run as chunks of up
to ``prefill_width`` tokens, each chunk one chain-shaped tree (a chain tree is causal attention)
through a fixed-shape ``[B, prefill_width]`` ``GraphedForward`` per (batch size, cache), captured
as a CUDA graph like the tree forward and never compiled (``_chunked_prefill`` states the chunking
rules). Otherwise -- dynamic shapes, a GPU without CUDA graphs, ``prefill_width`` 0 / None, or a
cache smaller than ``prefill_width`` -- the prompts go through one eager forward (``hf.prefill``,
SDPA). A prompt that ``num_return_sequences`` rows share is prefilled once, into a batch-1 cache
(``_prefill_shared``). docs/ENGINE.md tells why.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec import hf
from specdec.drafting import HIDDEN_ALL, HIDDEN_LAST
from specdec.graphs import GraphedForward, prefill_chunks
from specdec.kv import KVCache
from specdec.tree import TokenTree

__all__ = ["Prefill"]


class Prefill:
    """The prompt prefill of ``SpecDecoder`` (a base class of it): reads the decoder's ``target``,
    ``attn_impl``, ``_hidden_mode`` and ``_feature_layers``, and makes its caches and prefill forwards through
    ``_cache_for`` / ``_prefill_forward``."""

    def _prefill_shared(self, prompt: torch.Tensor, batch: int,
                        capacity: int) -> tuple[KVCache, list[torch.Tensor | None]]:  # fmt: skip
        """The prompt's KV but its last token's (the first root), written once for ``batch`` sequences
        that share it into the batch-1 cache of ``capacity`` slots (``_cache_for``: kept like the
        other caches, e.g. per bucket) by ``_prefill``, as a batch-1 request's prompt (chunked through
        the fixed-shape prefill forward with static shapes, else one eager forward).

        Args:
            prompt: int64 ``[L]``, ``L >= 2``.
            batch: the sequences sharing it.
            capacity: the cache's slots, ``>= L - 1``.

        Returns:
            The shared cache (``lengths == [L - 1]``), and per sequence the first
            ``DraftContext.hidden`` as ``_prefill``'s: one tensor, the same for every sequence
            (``[L - 1, H]`` for ``"all"``, ``[1, H]`` for ``"last"``), or Nones.
        """
        shared = self._cache_for(1, capacity)
        return shared, self._prefill(shared, prompt[None], [len(prompt)]) * batch

    def _prefill(self, cache: KVCache, seqs: torch.Tensor, lens: Sequence[int]) -> list[torch.Tensor | None]:
        """Write each sequence's prompt but its last token (the first root) into ``cache``.

        Through the fixed-shape chunked prefill (``_chunked_prefill``) when this cache has a
        prefill forward (static shapes, ``prefill_width`` on and at most the capacity), else one
        eager forward (``hf.prefill``).

        Args:
            cache: the emptied cache; its lengths become ``lens[b] - 1``.
            seqs: int64 ``[B, >= max(lens)]``, the prompts, right-padded.
            lens: the prompt lengths.

        Returns:
            Per sequence, the first ``DraftContext.hidden`` for drafters with
            ``needs_hidden_states``: the target's final hidden states of prompt positions
            ``0 .. lens[b] - 2`` (``[lens[b] - 1, H]``) for ``"all"``, of position ``lens[b] - 2``
            only (``[1, H]``: the state that predicted the root) for ``"last"`` (``k * H`` wide: the
            outputs of the drafter's k feature layers, with ``feature_layers``); else Nones (also
            for one-token prompts).
        """
        batch, longest = len(lens), max(lens)
        hidden: list[torch.Tensor | None] = [None] * batch
        if longest > 1:
            graphed = self._prefill_forward(cache, batch)
            if graphed is not None:
                if graphed.compile_layers and not cache.layer_indices:
                    # a layer-wise compiled forward reads each layer's KV buffers as tensors: one eager
                    # forward of the first prompt token makes them (its KV is what the first chunk writes)
                    hf.prefill(self.target, seqs[:, :1], cache, impl=self.attn_impl)
                hidden = self._chunked_prefill(graphed, seqs, lens)
            elif self._hidden_mode == HIDDEN_ALL:  # [B, longest - 1, H]; row b valid up to lens[b] - 2
                h = hf.prefill(self.target, seqs[:, : longest - 1], cache, impl=self.attn_impl, all_hidden=True,
                               feature_layers=self._feature_layers)  # fmt: skip
                hidden = [h[b, : lens[b] - 1] if lens[b] > 1 else None for b in range(batch)]
            else:
                at = torch.tensor([max(n - 2, 0) for n in lens]) if self._hidden_mode == HIDDEN_LAST else None
                h = hf.prefill(self.target, seqs[:, : longest - 1], cache, impl=self.attn_impl, hidden_at=at,
                               feature_layers=self._feature_layers)  # fmt: skip
                if h is not None:  # [B, H]
                    hidden = [h[b, None] if lens[b] > 1 else None for b in range(batch)]
        cache.lengths = [n - 1 for n in lens]
        return hidden

    def _chunked_prefill(self, graphed: GraphedForward, seqs: torch.Tensor,
                         lens: Sequence[int]) -> list[torch.Tensor | None]:  # fmt: skip
        """Prefill positions ``[0, lens[b] - 1)`` of every sequence as chain trees of at most
        W = ``graphed.n`` tokens through the fixed-shape forward ``graphed`` (KV only; lengths are
        left to the caller).

        Chunks: ``prefill_chunks(longest - 1, W, S)`` -- ``[0, W), [W, 2W), ...``, except that no
        chunk starts past ``S - W`` (see there: every load fits the cache). In the chunk
        ``[start, stop)``, sequence b with ``end_b = lens[b] - 1 > start`` gets the chain of its
        tokens ``[start, min(stop, end_b))`` loaded at prefix ``start``: node i has position and
        slot ``start + i`` and attends to slots ``[0, start)`` (written by the earlier chunks) and to
        nodes 0..i (its chain ancestors) -- exactly causal attention over the prompt. The padding
        nodes after a short chain (the forward always writes W slots) hang off the root: no chain
        node attends to them, and they write slots ``>= min(stop, end_b)``, i.e. past the tokens
        prefilled so far: slots of later chunks (rewritten there before anything reads them: every
        layer writes its new KV before attending) or past the prompt (scratch until decoding
        writes its trees there). A sequence with nothing left (``end_b <= start``, e.g. a one-token
        prompt) gets a one-node dummy tree (token 0) loaded at its final length ``end_b``: it
        writes slots ``[end_b, end_b + W)``, all past its prompt's KV (the first decoding tree
        overwrites them), and ``end_b <= start <= S - W`` keeps it inside the cache. So no chunk
        ever overwrites a committed slot, and each committed slot holds the KV a causal forward
        over the whole prompt would (up to rounding).

        Hidden states (drafters with ``needs_hidden_states``), copied (queued on the same stream)
        before the next chunk's forward overwrites the output buffer: ``"last"``: position
        ``lens[b] - 2`` lies in exactly one chunk, where it is node ``lens[b] - 2 - start`` of
        sequence b (``[1, H]``). ``"all"``: sequence b's chain nodes ``0 .. min(stop, end_b) -
        start - 1`` of every chunk are its positions ``start .. min(stop, end_b) - 1``, copied into
        one ``[end_b, H]`` tensor per sequence (the dummy trees' nodes are never read).

        Returns:
            Per sequence, as ``_prefill`` (None for one-token prompts or without hidden states).
        """
        batch, width, capacity = graphed.batch, graphed.n, graphed.cache.capacity
        ends = [n - 1 for n in lens]
        hidden: list[torch.Tensor | None] = [None] * batch
        dummy = TokenTree(torch.zeros(1, dtype=torch.int64), torch.tensor([-1]))
        for start, stop in prefill_chunks(max(ends), width, capacity):
            trees, prefix = [], []
            for b, end in enumerate(ends):
                if end > start:
                    trees.append(TokenTree.chain(seqs[b, start : min(stop, end)]))
                    prefix.append(start)
                else:
                    trees.append(dummy)
                    prefix.append(end)
            _, h = graphed.run(trees, prefix)  # h: [B, W, H] (the fixed output buffer) or None
            if self._hidden_mode == HIDDEN_LAST:
                for b, end in enumerate(ends):
                    if start <= end - 1 < stop:
                        hidden[b] = h[b, end - 1 - start : end - start].clone()
            elif self._hidden_mode == HIDDEN_ALL:
                for b, end in enumerate(ends):
                    if end > start:
                        if hidden[b] is None:
                            hidden[b] = h.new_empty(end, h.shape[-1])
                        got = min(stop, end)
                        hidden[b][start:got].copy_(h[b, : got - start])
        return hidden
