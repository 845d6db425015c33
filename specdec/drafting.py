"""The drafter protocol: what the engine asks of every drafter.

Per decoding step and sequence the engine calls ``propose(context)`` and verifies the returned
``specdec.TokenTree``; afterwards it calls ``update(context, tree, verdict)`` so that the drafter
can advance its own state (its KV cache, an n-gram table, ...). ``reset(input_ids)`` starts a new
``generate`` call. Drafters know nothing about verification beyond the ``Verdict`` they are shown.

A drafter that reads the target's own features (Medusa heads) sets ``needs_hidden_states = True``;
the engine then takes the target's final hidden states from its forwards (the LM head's input)
and passes the one that predicted the root in ``DraftContext.hidden``. Nothing else about the
target reaches a drafter.

Contract of ``propose``:

- ``tree.tokens[0]`` must equal ``context.tokens[-1]`` (the root is the last committed token);
- at most ``context.tree_size`` nodes besides the root (a root-only tree is allowed: plain decode);
- if ``context.sampling`` is not None (stochastic decoding), the tree's ``proposal`` must say how
  the children were drawn, and ``"iid"`` / ``"no_replacement"`` trees must carry ``draft_probs``
  (usually the draft's distribution after the same temperature / top-k / top-p,
  ``specdec.sampling.logits_to_probs``); keep them on the target's logits device to avoid a copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from specdec.sampling import SamplingConfig
    from specdec.tree import TokenTree
    from specdec.verify import Verdict

__all__ = ["DraftContext", "Drafter", "BaseDrafter"]


@dataclass(frozen=True)
class DraftContext:
    """What a drafter sees when asked for a tree.

    Attributes:
        tokens: int64 ``[L]``, sequence ``seq``'s committed tokens (prompt + generated so far);
            ``tokens[-1]`` is the root of the tree to propose.
        tree_size: node budget: at most this many nodes besides the root.
        seq: index of the sequence in the batch (drafters keeping per-sequence state key on it).
        sampling: None for greedy decoding, else the target's sampling transform.
        generator: the random generator of this ``generate`` call (None = torch's default).
        hidden: ``[H]`` (the target's dtype and device), the target's final hidden state at
            ``tokens[-2]``, the state from which the root ``tokens[-1]`` was predicted; only for
            drafters with ``needs_hidden_states`` (None otherwise, or when the prompt is 1 token).
    """

    tokens: torch.Tensor
    tree_size: int
    seq: int = 0
    sampling: SamplingConfig | None = None
    generator: torch.Generator | None = None
    hidden: torch.Tensor | None = None


@runtime_checkable
class Drafter(Protocol):
    """Proposes token trees. ``vocab_size`` (or None if unknown) is checked against the target's.

    ``needs_hidden_states`` (optional, default False): ask the engine for ``DraftContext.hidden``.
    """

    vocab_size: int | None

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        """A new ``generate`` call: ``input_ids[b]`` is sequence b's prompt (int64 ``[L_b]``)."""

    def propose(self, context: DraftContext) -> TokenTree:
        """A tree rooted at ``context.tokens[-1]`` with at most ``context.tree_size`` more nodes."""

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        """Sequence ``context.seq`` accepted ``verdict.path`` of ``tree`` and emitted ``verdict.bonus_token``."""


class BaseDrafter:
    """Convenience base: no-op ``reset`` / ``update``, an unknown vocabulary, no hidden states."""

    vocab_size: int | None = None
    needs_hidden_states: bool = False

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        return None

    def propose(self, context: DraftContext) -> TokenTree:
        raise NotImplementedError

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        return None
