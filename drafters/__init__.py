"""Drafters: propose token trees for the target to verify (protocol in ``specdec.drafting``).

- ``DraftModelDrafter`` (``drafters.draft_model``): a small draft LM, EAGLE-2-style dynamic tree;
- ``MedusaDrafter`` / ``MedusaHeads`` (``drafters.medusa``): heads on the target's hidden state over
  a static topology; trained by ``python -m drafters.medusa_train`` (``specdec train-medusa``);
- ``EagleDrafter`` / ``EagleHead`` (``drafters.eagle``): an EAGLE head (fc + one decoder layer on the
  target's features) growing an EAGLE-2-style dynamic tree; trained by ``specdec train-eagle``;
- ``LookupDrafter`` (``drafters.lookup``): n-gram matches in the prompt and generated text;
- ``drafters.trees``: static topologies (Medusa "choices") built from acceptance estimates.

``make_drafter(name, ...)`` builds one by name. Submodules load lazily (importing ``drafters``
does not import transformers or the engine).
"""

from __future__ import annotations

import importlib
from typing import Any

from specdec.drafting import BaseDrafter, DraftContext, Drafter

__all__ = [
    "DRAFTERS",
    "BaseDrafter",
    "DraftContext",
    "DraftModelDrafter",
    "Drafter",
    "EagleDrafter",
    "EagleHead",
    "LookupDrafter",
    "MedusaDrafter",
    "MedusaHeads",
    "make_drafter",
]

#: Names accepted by ``make_drafter``.
DRAFTERS = ("model", "medusa", "lookup", "eagle")

_LAZY = {
    "DraftModelDrafter": "drafters.draft_model",
    "EagleDrafter": "drafters.eagle",
    "EagleHead": "drafters.eagle",
    "LookupDrafter": "drafters.lookup",
    "MedusaDrafter": "drafters.medusa",
    "MedusaHeads": "drafters.medusa",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'drafters' has no attribute {name!r}")


def make_drafter(
    name: str,
    *,
    target: Any = None,
    draft_model: Any = None,
    draft: Any = None,
    heads: Any = None,
    tree_size: int | None = None,
    tokenizer: Any = None,
    device: Any = None,
    dtype: Any = None,
    **options: Any,
) -> Drafter:
    """A drafter by name.

    Args:
        name: ``"model"`` (needs ``draft_model``), ``"medusa"`` (needs ``target`` and ``heads``: a
            ``MedusaHeads`` or the directory it was saved to), ``"eagle"`` (needs ``target`` and
            ``heads``: an ``EagleHead`` or its directory) or ``"lookup"``.
        target: the target model (Medusa's / EAGLE's LM head and hidden states).
        draft_model: the draft LM (``draft`` is accepted as an alias).
        heads: Medusa heads / an EAGLE head, or their directory.
        tree_size: optional per-drafter cap on nodes per step (the engine's budget applies anyway;
            passed to drafters that take it).
        tokenizer, device, dtype: accepted for uniform call sites; ``device`` / ``dtype`` place
            Medusa / EAGLE heads loaded from a directory (default: the target's LM head's).
        options: constructor options of the drafter (e.g. ``depth``, ``topk`` for ``"model"`` and
            ``"eagle"``, ``draft_vocab``, ``profile`` for ``"eagle"``; ``choices`` for ``"medusa"``;
            ``max_ngram``, ``max_depth`` for ``"lookup"``).
    """
    del tokenizer  # no drafter needs it yet
    if name == "model":
        from drafters.draft_model import DraftModelDrafter

        model = draft_model if draft_model is not None else draft
        if model is None:
            raise ValueError("draft_model: the 'model' drafter needs a draft LM, got None")
        return DraftModelDrafter(model, tree_size=tree_size, **options)
    if name == "medusa":
        from drafters.medusa import MedusaDrafter, MedusaHeads

        if target is None:
            raise ValueError("target: the 'medusa' drafter needs the target model, got None")
        if heads is None:
            raise ValueError("heads: the 'medusa' drafter needs MedusaHeads or their directory, got None")
        if not isinstance(heads, MedusaHeads):
            lm = target.get_output_embeddings().weight
            heads = MedusaHeads.load(heads, device=device or lm.device, dtype=dtype or lm.dtype)
        return MedusaDrafter(target, heads, **options)
    if name == "eagle":
        from drafters.eagle import EagleDrafter, EagleHead

        if target is None:
            raise ValueError("target: the 'eagle' drafter needs the target model, got None")
        if heads is None:
            raise ValueError("heads: the 'eagle' drafter needs an EagleHead or its directory, got None")
        if isinstance(heads, EagleHead):
            heads.config.check(target, "heads")
        else:
            lm = target.get_output_embeddings().weight
            heads = EagleHead.load(heads, target, device=device or lm.device, dtype=dtype or lm.dtype, name="heads")
        return EagleDrafter(target, heads, tree_size=tree_size, **options)
    if name == "lookup":
        from drafters.lookup import LookupDrafter

        return LookupDrafter(tree_size=tree_size, **options)
    raise ValueError(f"name: expected one of {DRAFTERS}, got {name!r}")
