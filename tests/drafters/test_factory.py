"""make_drafter: names, required arguments, options, Medusa / EAGLE heads from a directory."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from drafters import DRAFTERS, Drafter, make_drafter
from drafters.draft_model import DraftModelDrafter
from drafters.eagle import EagleDrafter, EagleHead
from drafters.lookup import LookupDrafter
from drafters.medusa import MedusaDrafter, MedusaHeads
from tests.specdec.helpers import perturbed_copy, tiny_model


def test_every_name_builds_a_drafter(tmp_path):
    target = tiny_model("qwen2")
    draft = perturbed_copy(target, 0.05, seed=1)
    model = make_drafter("model", draft_model=draft, depth=2, topk=3, tree_size=9)
    assert isinstance(model, DraftModelDrafter) and (model.depth, model.topk, model.tree_size) == (2, 3, 9)
    assert isinstance(make_drafter("model", draft=draft), DraftModelDrafter)  # eval passes `draft`
    MedusaHeads(64, 2).save(tmp_path)
    medusa = make_drafter("medusa", target=target, heads=str(tmp_path), tokenizer=None, device="cpu",
                          dtype=torch.float32)
    assert isinstance(medusa, MedusaDrafter) and medusa.heads.num_heads == 2
    lookup = make_drafter("lookup", max_ngram=2, max_depth=5)
    assert isinstance(lookup, LookupDrafter) and lookup.max_depth == 5
    EagleHead(target).save(tmp_path / "eagle")
    eagle = make_drafter("eagle", target=target, heads=str(tmp_path / "eagle"), tree_size=9, depth=3, device="cpu")
    assert isinstance(eagle, EagleDrafter) and (eagle.depth, eagle.tree_size) == (3, 9)
    for d in (model, medusa, lookup, eagle):
        assert isinstance(d, Drafter)
    assert DRAFTERS == ("model", "medusa", "lookup", "eagle")


def test_errors():
    with pytest.raises(ValueError, match=r"name: expected one of \('model', 'medusa', 'lookup', 'eagle'\), got 'beam'"):
        make_drafter("beam")
    with pytest.raises(ValueError, match=r"draft_model: the 'model' drafter needs a draft LM, got None"):
        make_drafter("model")
    with pytest.raises(ValueError, match=r"heads: the 'medusa' drafter needs MedusaHeads"):
        make_drafter("medusa", target=tiny_model("llama"))
    with pytest.raises(ValueError, match=r"heads: the 'eagle' drafter needs an EagleHead or its directory"):
        make_drafter("eagle", target=tiny_model("llama"))


def test_importing_drafters_is_light():
    code = "import sys, drafters; print('transformers' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "False"
