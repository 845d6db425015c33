"""The drafter protocol: what the engine asks of every drafter.

Per decoding step and sequence the engine calls ``propose(context)`` and verifies the returned
``specdec.TokenTree``; afterwards it calls ``update(context, tree, verdict)`` so that the drafter
can advance its own state (its KV cache, an n-gram table, ...). ``reset(input_ids)`` starts a new
``generate`` call. Drafters know nothing about verification beyond the ``Verdict`` they are shown.

A drafter that reads the target's own features sets ``needs_hidden_states``; the engine then takes
the target's final hidden states from its forwards (the LM head's input, after the final norm:
``f_p`` turns into the distribution of token p + 1) and passes them in ``DraftContext.hidden``, an
``[m, H]`` block whose last row always predicted the root. How much it gets:

- ``True`` or ``"last"`` (Medusa heads): only that row, ``m = 1``; nothing else is kept.
- ``"all"`` (EAGLE heads): every committed token's feature, each exactly once per ``generate``
  call: the rows the drafter has not been given before, i.e. at the first step the whole prompt's
  but its last token (positions ``0 .. L - 2``), afterwards the accepted path's nodes (the root and
  the accepted drafted nodes; the last one predicted the bonus token, the next root). The engine
  then also keeps the prompt's features from the prefill (``L x H`` per sequence).

No feature exists before the first token: at the first step of a one-token prompt ``hidden`` is
None. ``hidden_states_request(drafter)`` reads the attribute (ValueError for other values).

**Layer features** (EAGLE-3's low / middle / high features): a drafter with ``needs_hidden_states``
may also set ``feature_layers``, a strictly increasing tuple of decoder-layer indices
``0 <= i < num_layers``. The engine then passes, in place of the final feature, the outputs of those
layers (the residual stream after decoder layer i, before the final norm: HF's
``output_hidden_states[i + 1]``, except that HF's last entry is after the final norm) concatenated
along the last dimension: ``hidden`` is ``[m, k * H]`` for k layers, same rows as above. They are
taken by forward hooks on those layers that live only for the engine's forwards, inside its
fixed-shape (CUDA-graph, compiled) forwards too; ``feature_layers = None`` (the default) keeps the
final feature, and a drafter without ``needs_hidden_states`` pays nothing.
``feature_layers_request(drafter, num_layers)`` reads and checks the attribute.
Nothing else about the target reaches a drafter.

Contract of ``propose``:

- ``tree.tokens[0]`` must equal ``context.tokens[-1]`` (the root is the last committed token);
- at most ``context.tree_size`` nodes besides the root (a root-only tree is allowed: plain decode);
- if ``context.sampling`` is not None (stochastic decoding), the tree's ``proposal`` must say how
  the children were drawn, and ``"iid"`` / ``"no_replacement"`` trees must carry ``draft_probs``
  (usually the draft's distribution after the same temperature / top-k / top-p,
  ``specdec.sampling.logits_to_probs``); keep them on the target's logits device to avoid a copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from specdec.sampling import SamplingConfig
    from specdec.tree import TokenTree
    from specdec.verify import Verdict

__all__ = ["HIDDEN_ALL", "HIDDEN_LAST", "DraftContext", "Drafter", "BaseDrafter", "feature_layers_request",
           "captured_seconds", "hidden_states_request", "propose_all", "warm_up_drafter"]

#: ``needs_hidden_states`` value: the feature that predicted the root only (``hidden`` is ``[1, H]``).
HIDDEN_LAST = "last"
#: ``needs_hidden_states`` value: every committed token's feature, each once per ``generate`` call.
HIDDEN_ALL = "all"


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
        hidden: ``[m, H]`` (m >= 1; the target's dtype and device): the target's final hidden
            states (the LM head's input; ``[m, k * H]``: the outputs of the drafter's k
            ``feature_layers``, concatenated) at positions ``L - 1 - m .. L - 2`` (L = ``len(tokens)``),
            so row -1 is the state at ``tokens[-2]`` from which the root ``tokens[-1]`` was
            predicted. Only for drafters with ``needs_hidden_states`` (None otherwise, and at the
            first step of a one-token prompt). ``"last"`` / True: m = 1. ``"all"``: the rows not
            given before in this ``generate`` call: m = L - 1 at the first step (the prompt but its
            last token), then the accepted path of the previous step (root + accepted drafted nodes).
            A fresh tensor per step (the drafter may keep it).
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

    ``needs_hidden_states`` (optional, default False): ask the engine for the target's features in
    ``DraftContext.hidden``: True or ``"last"`` (``HIDDEN_LAST``) for the one that predicted the root
    (``[1, H]``; cheap), ``"all"`` (``HIDDEN_ALL``) for every committed token's, each given once
    (``[m, H]``; the prefill then also returns the prompt's features). See the module docstring.

    ``feature_layers`` (optional, default None): with ``needs_hidden_states``, the decoder layers whose
    outputs ``DraftContext.hidden`` carries instead of the final feature (``[m, k * H]``; see the
    module docstring).

    ``propose_batch(contexts) -> list[TokenTree]`` (optional): the trees of several sequences of one
    step at once, equal to ``[propose(c) for c in contexts]``; the engine calls it for batches of
    two or more (``propose_all``).

    ``warmup(batch_sizes, max_len, log[, tree_sizes])`` (optional): called by ``SpecDecoder.warmup``
    to make what later calls use (caches sized for ``max_len``, captures); ``tree_sizes``, where the
    method takes it, are the positive budgets its proposals will get.

    ``captured_s`` (optional, default 0.0): the running total of seconds its proposals spent on
    one-time work (first runs and CUDA-graph captures of fixed-shape forwards, with the compiles
    inside them, e.g. for a prompt length not seen before; EagleDrafter and DraftModelDrafter keep
    it). The engine reports each step's share (``StepStats.capture_s``, ``captured_seconds``) and the
    budget rule of ``tree_size="auto"`` does not take such a step's drafting time for the drafter's
    steady cost.
    """

    vocab_size: int | None

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        """A new ``generate`` call: ``input_ids[b]`` is sequence b's prompt (int64 ``[L_b]``)."""

    def propose(self, context: DraftContext) -> TokenTree:
        """A tree rooted at ``context.tokens[-1]`` with at most ``context.tree_size`` more nodes."""

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        """Sequence ``context.seq`` accepted ``verdict.path`` of ``tree`` and emitted ``verdict.bonus_token``."""


def propose_all(drafter, contexts: Sequence[DraftContext]) -> list[TokenTree]:
    """The trees of one step's sequences, in ``contexts``' order: ``drafter.propose_batch(contexts)``
    where the drafter has one (an optional method: one call for all sequences, e.g. one head forward
    and one device-to-host copy for B rows), else ``propose`` per context. Raises ValueError naming
    ``drafter`` when ``propose_batch`` returns another number of trees than it was given contexts."""
    batch = getattr(drafter, "propose_batch", None)
    if batch is None or len(contexts) < 2:
        return [drafter.propose(c) for c in contexts]
    trees = list(batch(contexts))
    if len(trees) != len(contexts):
        raise ValueError(f"drafter: expected propose_batch to return {len(contexts)} trees (one per context), "
                         f"got {len(trees)}")
    return trees


def captured_seconds(drafter) -> float:
    """``drafter.captured_s`` (the running total of its proposals' one-time work, see ``Drafter``),
    or 0.0 for a drafter that keeps none (or for None)."""
    got = getattr(drafter, "captured_s", 0.0) if drafter is not None else 0.0
    return float(got) if isinstance(got, (int, float)) and not isinstance(got, bool) else 0.0


def warm_up_drafter(drafter, batch_sizes: Sequence[int], max_len: int | None, log,
                    tree_sizes: Sequence[int] = (), sampling=None) -> None:  # fmt: skip
    """Call ``drafter.warmup(batch_sizes=..., max_len=..., log=...)`` where the drafter has one (an
    optional method), with ``tree_sizes=`` and ``sampling=`` (the calls' ``SamplingConfig``, if
    given) where that method takes the keyword."""
    warmup = getattr(drafter, "warmup", None)
    if not callable(warmup):
        return
    try:
        params = inspect.signature(warmup).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin)
        params = {}
    extra = {"tree_sizes": tuple(tree_sizes)} if "tree_sizes" in params else {}
    if sampling is not None and "sampling" in params:
        extra["sampling"] = sampling
    warmup(batch_sizes=tuple(batch_sizes), max_len=max_len, log=log, **extra)


class BaseDrafter:
    """Convenience base: no-op ``reset`` / ``update``, an unknown vocabulary, no hidden states (and,
    when a subclass asks for them, the final feature: ``feature_layers = None``)."""

    vocab_size: int | None = None
    needs_hidden_states: bool | str = False
    feature_layers: tuple[int, ...] | None = None

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        return None

    def propose(self, context: DraftContext) -> TokenTree:
        raise NotImplementedError

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        return None


def hidden_states_request(drafter) -> str | None:
    """What ``drafter`` asks of ``DraftContext.hidden``: None (nothing), ``HIDDEN_LAST`` or ``HIDDEN_ALL``.

    Reads ``drafter.needs_hidden_states`` (absent / false: nothing; true or ``"last"``: the feature
    that predicted the root; ``"all"``: every committed token's). ``drafter`` may be None. Raises
    ValueError naming ``drafter`` for any other string.
    """
    want = getattr(drafter, "needs_hidden_states", False)
    if isinstance(want, str):
        if want not in (HIDDEN_LAST, HIDDEN_ALL):
            raise ValueError(f"drafter: expected needs_hidden_states to be a bool, {HIDDEN_LAST!r} or "
                             f"{HIDDEN_ALL!r}, got {want!r}")
        return want
    return HIDDEN_LAST if want else None


def feature_layers_request(drafter, num_layers: int | None) -> tuple[int, ...] | None:
    """The decoder layers whose outputs ``drafter`` asks for in ``DraftContext.hidden``, or None (the
    final feature; also for a drafter that asks for no hidden states and sets none).

    Reads ``drafter.feature_layers`` (absent or None: None). ``num_layers``: the target's decoder
    layers (``specdec.hf.num_layers``). Raises ValueError naming ``drafter`` unless it is a non-empty,
    strictly increasing sequence of ints in ``[0, num_layers)``, or when it is set by a drafter
    without ``needs_hidden_states``.
    """
    layers = getattr(drafter, "feature_layers", None)
    if layers is None:
        return None
    if hidden_states_request(drafter) is None:
        raise ValueError(f"drafter: expected feature_layers only with needs_hidden_states, got feature_layers="
                         f"{layers!r} and no hidden states asked for")  # fmt: skip
    ok = (isinstance(layers, (tuple, list)) and len(layers) > 0
          and all(isinstance(i, int) and not isinstance(i, bool) for i in layers))  # fmt: skip
    if ok and num_layers is None:
        raise ValueError(f"drafter: expected feature_layers only for a target with decoder layers "
                         f"(config.num_hidden_layers), got feature_layers={layers!r} for a target without")  # fmt: skip
    if not ok or any(not 0 <= i < num_layers for i in layers) or any(a >= b for a, b in zip(layers, layers[1:])):
        raise ValueError(f"drafter: expected feature_layers to be None or strictly increasing layer indices in "
                         f"[0, {num_layers}), got {layers!r}")  # fmt: skip
    return tuple(layers)
