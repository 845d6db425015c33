"""The target-distribution transform equals transformers' temperature -> top-k -> top-p warpers."""

import math

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec import SamplingConfig, logits_to_probs, warp_logits


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8), (0.5, 10, 0.9), (2.0, 1, 1.0), (1.0, 0, 0.01), (1.0, 300, 1.0)],
)
def test_matches_transformers_warpers(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 200, generator=gen) * 3
    ids = torch.zeros(4, 1, dtype=torch.long)
    want = logits.clone()
    if temperature != 1.0:
        want = TemperatureLogitsWarper(temperature)(ids, want)
    if top_k:
        want = TopKLogitsWarper(top_k)(ids, want)
    if top_p < 1.0:
        want = TopPLogitsWarper(top_p)(ids, want)
    got = warp_logits(logits, SamplingConfig(temperature, top_k, top_p))
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite])
    probs = logits_to_probs(logits, SamplingConfig(temperature, top_k, top_p))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    torch.testing.assert_close(probs, want.softmax(-1))


def test_top_k_one_is_greedy():
    logits = torch.randn(3, 50)
    probs = logits_to_probs(logits, SamplingConfig(top_k=1))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.max(-1).values, torch.ones(3))


def test_top_p_keeps_smallest_nucleus():
    logits = torch.tensor([math.log(0.5), math.log(0.3), math.log(0.15), math.log(0.05)])
    probs = logits_to_probs(logits, SamplingConfig(top_p=0.75))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=0.0), r"temperature: expected a finite float > 0, got 0.0"),
        (dict(temperature=float("nan")), r"temperature: expected a finite float > 0"),
        (dict(top_k=-1), r"top_k: expected an int >= 0"),
        (dict(top_k=2.5), r"top_k: expected an int >= 0"),
        (dict(top_p=0.0), r"top_p: expected a float in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), r"top_p: expected a float in \(0, 1\]"),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)
