"""The real pair (Qwen2.5-Coder 0.5B drafts for 1.5B): greedy output equals the target's own.

Skips unless both converted models are in the model store (``specdec models fetch NAME``; see
``specdec.models``). Float32 on CPU: loading takes seconds from the converted cache, the
generation about a minute on 2 cores.
"""

import pytest
import torch

from specdec import SpecDecoder

models = pytest.importorskip("specdec.models")

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
NEW = 12


@pytest.fixture(scope="module")
def pair():
    if not (models.is_converted(TARGET) and models.is_converted(DRAFT)):
        pytest.skip(f"{TARGET} / {DRAFT} are not in the model store (specdec models fetch NAME)")
    tok = models.load_tokenizer(TARGET, progress=False)
    target = models.load_model(TARGET, dtype=torch.float32, progress=False)
    draft = models.load_model(DRAFT, dtype=torch.float32, progress=False)
    return tok, target, draft


@pytest.mark.slow  # the real 1.5B / 0.5B pair: about a minute on 2 cores
def test_real_pair_greedy_equals_target(pair):
    from tests.specdec.helpers import DraftModelDrafter

    tok, target, draft = pair
    messages = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    want = target.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    dec = SpecDecoder(target, DraftModelDrafter(draft, width=2, max_depth=4), tree_size=8, attn_impl="torch")
    out = dec.generate(ids, NEW)
    assert out.sequences[0].tolist() == want[0].tolist()
    assert out.totals()["tokens_accepted"] > 0  # the real draft agrees with the target at least sometimes
