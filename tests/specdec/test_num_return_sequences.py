"""``generate(..., num_return_sequences=n)``: n sequences per prompt, HF's row order; greedy rows
equal the target's greedy output, sampled rows are independent samples of the target (chi-square
on the joint of two sequences' first tokens, with a drafter proposing)."""

from __future__ import annotations

import pytest
import torch

import specdec
from drafters.draft_model import DraftModelDrafter
from drafters.lookup import LookupDrafter
from specdec import SpecDecoder
from specdec.sampling import SamplingConfig, logits_to_probs
from tests.drafters.lossless import PROMPT, VOCAB, chi2_pvalue, tiny_draft, tiny_target
from tests.specdec.helpers import hf_greedy, random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def test_greedy_rows_are_n_copies_of_the_target_greedy_output_in_hf_order():
    target = tiny_model("qwen2")
    prompts = [random_prompt(7, 0), random_prompt(3, 1)]
    out = SpecDecoder(target, LookupDrafter(), tree_size=8, attn_impl="torch").generate(
        prompts, 12, num_return_sequences=3)  # fmt: skip
    assert out.sequences.shape[0] == 6
    for row in range(6):
        p = prompts[row // 3]
        assert out.sequences[row, : out.lengths[row]].tolist() == hf_greedy(target, p, 12)


def test_bad_counts_raise_and_wrap_reads_the_generation_config():
    target = tiny_model("qwen2")
    dec = SpecDecoder(target, None, attn_impl="torch")
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=rf"num_return_sequences: expected an int >= 1, got {bad!r}"):
            dec.generate(random_prompt(4, 0), 3, num_return_sequences=bad)
    model = specdec.wrap(target, LookupDrafter(), tree_size=4, attn_impl="torch")
    assert model.generate(random_prompt(4, 0)[None], max_new_tokens=3, num_return_sequences=2).shape[0] == 2
    target.generation_config.num_return_sequences = 3
    try:
        assert model.generate(random_prompt(4, 0)[None], max_new_tokens=3).shape[0] == 3
    finally:
        target.generation_config.num_return_sequences = 1


@pytest.mark.slow
def test_sampled_sequences_of_one_prompt_are_independent_samples_of_the_target():
    """Pairs (row 2i, row 2i + 1) of one call share a prompt: their first tokens' joint must be
    p x p (each a target sample, the two independent), with a draft model proposing trees."""
    target, cfg = tiny_target(), SamplingConfig(0.9)
    with torch.no_grad():
        p1 = logits_to_probs(target(torch.tensor([PROMPT])).logits[0, -1], cfg).double()
    dec = SpecDecoder(target, DraftModelDrafter(tiny_draft(), tree_size=6), tree_size=6, attn_impl="torch")
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(VOCAB, VOCAB)
    accepted = 0
    prompts = [torch.tensor(PROMPT)] * 40
    for _ in range(100):
        out = dec.generate(prompts, 2, do_sample=True, temperature=cfg.temperature, generator=gen,
                           num_return_sequences=2)  # fmt: skip
        first = [out.new_tokens(b).tolist()[0] for b in range(80)]
        for i in range(40):
            counts[first[2 * i], first[2 * i + 1]] += 1
        accepted += out.totals()["tokens_accepted"]
    assert accepted > 500  # drafts were exercised
    assert chi2_pvalue(counts, p1[:, None] * p1[None, :]) > 0.01
    # the test separates: a layout that copied sequence 2i's token into 2i + 1 would fail it
    copied = torch.diag(counts.sum(1))
    assert chi2_pvalue(copied, p1[:, None] * p1[None, :]) < 1e-6
