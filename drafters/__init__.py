"""Drafters: propose token trees for the target to verify (protocol in ``specdec.drafting``).

- ``DraftModelDrafter`` (``drafters.draft_model``): a small draft LM, EAGLE-2-style dynamic tree;
- ``MedusaDrafter`` / ``MedusaHeads`` (``drafters.medusa``): heads on the target's hidden state over
  a static topology; trained by ``training.medusa`` (``specdec train-medusa``);
- ``EagleDrafter`` / ``EagleHead`` (``drafters.eagle``): an EAGLE head (fc + one decoder layer on the
  target's features) growing an EAGLE-2-style dynamic tree; trained by ``specdec train-eagle``;
- ``LookupDrafter`` (``drafters.lookup``): n-gram matches in the prompt and generated text;
- ``MergedDrafter`` (``drafters.merge``): several drafters' trees merged into one trie (SpecInfer's
  merge), e.g. ``make_drafter("lookup+eagle", ...)``;
- ``drafters.trees``: static topologies (Medusa "choices") built from acceptance estimates.

``make_drafter(name, ...)`` builds one by name. Submodules load lazily (importing ``drafters``
does not import transformers or the engine).
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from specdec.drafting import BaseDrafter, DraftContext, Drafter

__all__ = [
    "DRAFTERS",
    "constructor_options",
    "BaseDrafter",
    "DraftContext",
    "DraftModelDrafter",
    "Drafter",
    "EagleDrafter",
    "EagleHead",
    "LookupDrafter",
    "MedusaDrafter",
    "MedusaHeads",
    "MergedDrafter",
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
    "MergedDrafter": "drafters.merge",
}

#: The class behind each ``make_drafter`` name (module, class): its constructor's options route a
#: merged drafter's unprefixed options.
_CLASSES = {"model": ("drafters.draft_model", "DraftModelDrafter"), "medusa": ("drafters.medusa", "MedusaDrafter"),
            "lookup": ("drafters.lookup", "LookupDrafter"), "eagle": ("drafters.eagle", "EagleDrafter")}


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

    Merged drafters (``drafters.merge.MergedDrafter``): ``name`` joins names with ``+`` (e.g.
    ``"lookup+eagle"``), the parts in priority order. The keyword arguments above go to every part
    (``tree_size`` is the merged tree's cap). An option ``PART.KEY`` goes to that part only; an
    unprefixed ``KEY`` to every part whose constructor takes it (ValueError if none does);
    ``caps=[...]`` (one entry per part, None = what remains) bounds each part's nodes per step,
    default ``max(1, tree_size // 4)`` for every part but the last when ``tree_size`` is given
    (None without it).
    """
    if isinstance(name, str) and "+" in name:
        return _make_merged(name, dict(target=target, draft_model=draft_model, draft=draft, heads=heads,
                                       tokenizer=tokenizer, device=device, dtype=dtype), tree_size, options)
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


def _constructor_options(name: str) -> set[str]:
    module, cls = _CLASSES[name]
    params = inspect.signature(getattr(importlib.import_module(module), cls).__init__).parameters
    return {p for p in params if p != "self"}


def constructor_options(name: str) -> set[str]:
    """The options the drafter ``name`` (a ``make_drafter`` name, parts joined by ``+`` too) takes:
    its constructor's parameters, for a merged drafter those of any part; empty for other names."""
    parts = name.split("+")
    if not all(p in _CLASSES for p in parts):
        return set()
    return set().union(*(_constructor_options(p) for p in parts))


def _make_merged(name: str, common: dict[str, Any], tree_size: int | None, options: dict[str, Any]) -> Drafter:
    from drafters.merge import MergedDrafter

    parts = name.split("+")
    bad = [p for p in parts if p not in DRAFTERS]
    if bad or len(set(parts)) != len(parts):
        raise ValueError(f"name: expected distinct names of {DRAFTERS} joined by '+', got {name!r}")
    caps = options.pop("caps", None)
    split = options.pop("split", "priority")
    per: dict[str, dict[str, Any]] = {p: {} for p in parts}
    for key, val in options.items():
        part, dot, sub = key.partition(".")
        if dot:
            if part not in per:
                raise ValueError(f"options: {key!r} names no part of {name!r}")
            per[part][sub] = val
            continue
        takers = [p for p in parts if key in _constructor_options(p)]
        if not takers:
            raise ValueError(f"options: no part of {name!r} takes {key!r}")
        for p in takers:
            per[p][key] = val
    if caps is None and tree_size is not None and split == "priority":
        caps = [max(1, tree_size // 4)] * (len(parts) - 1) + [None]
    drafters = [make_drafter(p, **{**common, "tree_size": None, **per[p]}) for p in parts]
    return MergedDrafter(drafters, caps=caps, tree_size=tree_size, split=split)
