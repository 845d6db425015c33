"""``generate(num_return_sequences=n)`` of one prompt on the shared layout.

The prompt's KV (but its last token's) is written once into a batch-1 cache, the n sequences' own
cache holds only what follows it, and every tree forward attends through the cascade attention --
with dynamic shapes (``hf.tree_forward(shared=)``) and with static shapes (``GraphedForward(shared=)``
in eager replay on CPU: the prompt's length is data in the forward's input vector, so one forward
per prompt-cache bucket serves every prompt length). Greedy rows must equal the target's own greedy
``generate``; sampled rows must equal the copy layout's for the same random seed (the same draws)
and follow the target's distribution, independent across the sequences of one call.
"""

from __future__ import annotations

import functools

import pytest
import torch

import specdec
import specdec.engine as engine
from drafters.draft_model import DraftModelDrafter
from drafters.eagle import EagleDrafter, EagleHead
from drafters.lookup import LookupDrafter
from drafters.medusa import MedusaDrafter, MedusaHeads
from specdec import SpecDecoder, TokenTree, hf
from specdec.drafting import BaseDrafter, DraftContext
from specdec.graphs import GraphedForward
from specdec.sampling import SamplingConfig, logits_to_probs
from tests.drafters import lossless
from tests.specdec.helpers import OracleDrafter, greedy_reference, perturbed_copy, prepared_tiny_model, random_prompt

pytestmark = pytest.mark.usefixtures("one_thread")

TREE = 8
NEW = 24
N_SEQS = 3


@functools.lru_cache(maxsize=None)
def _draft():
    return perturbed_copy(prepared_tiny_model("qwen2"), 0.05, seed=1)


@functools.lru_cache(maxsize=None)
def _heads(kind: str):
    """Random Medusa heads / EAGLE head for the tiny qwen2 (hidden 64): drafters reading hidden states."""
    torch.manual_seed(0)
    head = MedusaHeads(64, 3) if kind == "medusa" else EagleHead(prepared_tiny_model("qwen2"))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return head


def _drafter(kind: str, reference=None):
    target = prepared_tiny_model("qwen2")
    if kind == "lookup":
        return LookupDrafter()
    if kind == "draft_model":
        return DraftModelDrafter(_draft(), tree_size=TREE)
    if kind == "oracle":  # long accepted paths off the first-child chain: the commit moves suffix KV
        return OracleDrafter([list(reference)] * N_SEQS, seed=3)
    if kind == "medusa":
        return MedusaDrafter(target, _heads("medusa"))
    if kind == "eagle":
        return EagleDrafter(target, _heads("eagle"), depth=3, topk=3)
    raise ValueError(kind)


@pytest.fixture
def shared_calls(monkeypatch):
    """Per prefill of a shared prompt (``SpecDecoder._prefill_shared``), ``(1, P)``: the P prompt
    tokens written once for all sequences (its last token is their first root)."""
    calls: list[tuple[int, int]] = []
    real = SpecDecoder._prefill_shared

    def counting(self, prompt, batch, capacity):
        calls.append((1, len(prompt) - 1))
        return real(self, prompt, batch, capacity)

    monkeypatch.setattr(SpecDecoder, "_prefill_shared", counting)
    return calls


@pytest.fixture
def made_forwards(monkeypatch):
    """Every fixed-shape forward the engine makes (``GraphedForward``), in order."""
    made: list[GraphedForward] = []

    class Counted(GraphedForward):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(engine, "GraphedForward", Counted)
    return made


@pytest.fixture
def forwards(monkeypatch):
    """Per ``hf.tree_forward`` call, its per-sequence cache and its shared cache (or None)."""
    seen: list[tuple[specdec.KVCache, specdec.KVCache | None]] = []
    real = hf.tree_forward

    def recording(model, tokens, tree_mask, prefix_lens, cache, **kwargs):
        seen.append((cache, kwargs.get("shared")))
        return real(model, tokens, tree_mask, prefix_lens, cache, **kwargs)

    monkeypatch.setattr(hf, "tree_forward", recording)
    return seen


def _decoder(drafter, **kwargs) -> SpecDecoder:
    return SpecDecoder(prepared_tiny_model("qwen2"), drafter, tree_size=TREE, attn_impl="torch", static_shapes=False,
                       **kwargs)


# --------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("length", [1, 37, 70, 130])
@pytest.mark.parametrize("kind", ["lookup", "draft_model", "oracle", "medusa", "eagle"])
def test_greedy_rows_equal_the_target_greedy_output(kind, length, shared_calls, forwards):
    seed = 10 + length
    ref = greedy_reference(length, seed, NEW)
    streamed: dict[int, list[int]] = {b: [] for b in range(N_SEQS)}
    out = _decoder(_drafter(kind, ref)).generate(
        random_prompt(length, seed), NEW, num_return_sequences=N_SEQS,
        on_tokens=lambda b, toks: streamed[b].extend(toks))  # fmt: skip
    assert out.sequences.shape[0] == N_SEQS
    for b in range(N_SEQS):
        assert out.sequences[b, : out.lengths[b]].tolist() == list(ref)
        assert streamed[b] == list(ref[length:])
    # A one-token prompt has nothing to share (its last token is the first root): the copy layout.
    assert shared_calls == ([(1, length - 1)] if length > 1 else [])
    assert all((shared is None) == (length == 1) for _, shared in forwards)
    if kind == "oracle":
        assert out.mean_accepted > 2  # long paths were accepted and committed


def test_greedy_through_the_triton_interpreter(shared_calls):
    """The cascade kernel (fused, under ``TRITON_INTERPRET=1``) inside the engine."""
    pytest.importorskip("triton")
    from treeattn.ops import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 not set (tests/conftest.py sets it on CPU machines)")
    ref = greedy_reference(37, 5, 8)
    out = SpecDecoder(prepared_tiny_model("qwen2"), LookupDrafter(), tree_size=4, attn_impl="triton",
                      static_shapes=False).generate(random_prompt(37, 5), 8, num_return_sequences=2)  # fmt: skip
    assert [out.sequences[b].tolist() for b in range(2)] == [list(ref)] * 2
    assert shared_calls == [(1, 36)]


def test_several_prompts_keep_the_copy_layout(shared_calls, forwards):
    prompts = [random_prompt(37, 1), random_prompt(20, 2)]
    out = _decoder(LookupDrafter()).generate(prompts, 12, num_return_sequences=2)
    for row in range(4):
        length = len(prompts[row // 2])
        assert out.sequences[row, : out.lengths[row]].tolist() == list(greedy_reference(length, row // 2 + 1, 12))
    assert shared_calls == []
    assert all(shared is None for _, shared in forwards)


# --------------------------------------------------------------------------- caches


def test_suffix_caches_hold_no_prompt_slots(shared_calls, forwards):
    length, new = 130, 20
    prompt = random_prompt(length, 140)
    _decoder(LookupDrafter()).generate(prompt, new, num_return_sequences=4)
    assert shared_calls == [(1, length - 1)]  # the prompt prefilled once for the 4 sequences
    caches = {id(c) for c, _ in forwards}
    shared = {id(s) for _, s in forwards}
    assert len(caches) == 1 and len(shared) == 1  # one suffix cache and one shared cache per call
    cache, prefix = forwards[0]
    assert (cache.batch_size, cache.capacity) == (4, 1 + new + TREE)  # root + new tokens + one tree
    assert (prefix.batch_size, prefix.capacity, prefix.lengths) == (1, length - 1, [length - 1])
    assert max(cache.lengths) <= new  # every committed suffix token fits without the prompt
    # The bytes: the prompt once, each sequence only its suffix (float32 K and V of every layer).
    cfg = prepared_tiny_model("qwen2").config
    per_slot = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert prefix.nbytes == per_slot * (length - 1)
    assert cache.nbytes == per_slot * 4 * (1 + new + TREE)


def test_kept_caches_use_the_suffix_bucket_and_release_drops_them(shared_calls):
    """With ``cache_buckets`` the rows of a shared prompt get the bucket of their suffix and the
    prompt the batch-1 cache of its own bucket, both reused by later calls; the copy layout gets the
    bucket of prompt + suffix."""
    prompt = random_prompt(130, 140)  # suffix: 1 + 20 + 8 = 29 slots -> 64; copy: 130 + 20 + 8 = 158 -> 256
    dec = _decoder(LookupDrafter(), cache_buckets=(16, 64, 256))
    first = dec.generate(prompt, 20, num_return_sequences=4)
    assert set(dec.caches) == {(4, 64), (1, 256)}  # the prompt's 129 tokens: the 256 bucket
    kept, kept_prompt = dec.caches[(4, 64)], dec.caches[(1, 256)]
    again = dec.generate(prompt, 20, num_return_sequences=4)
    assert dec.caches[(4, 64)] is kept and dec.caches[(1, 256)] is kept_prompt
    assert torch.equal(again.sequences, first.sequences)
    assert len(shared_calls) == 2  # the shared prompt is prefilled per call into the kept cache
    copy = _decoder(LookupDrafter(), cache_buckets=(16, 64, 256), shared_prefix=False)
    assert torch.equal(copy.generate(prompt, 20, num_return_sequences=4).sequences, first.sequences)
    assert set(copy.caches) == {(4, 256)}
    assert kept.nbytes * 4 == copy.caches[(4, 256)].nbytes
    dec.release()
    assert dict(dec.caches) == {}
    assert torch.equal(dec.generate(prompt, 20, num_return_sequences=4).sequences, first.sequences)


def test_warmup_runs_the_shared_forward_for_batches_of_several(shared_calls):
    dec = _decoder(LookupDrafter())
    report = dec.warmup(batch_sizes=(1, 3), max_len=60, log=None)
    assert [e.batch_size for e in report.entries] == [1, 3]
    assert shared_calls == [(1, 1)]  # B = 3 only: a 2-token dummy prompt, its first token shared
    ref = greedy_reference(37, 47, 20)
    out = dec.generate(random_prompt(37, 47), 20, num_return_sequences=3)
    assert [out.sequences[b].tolist() for b in range(3)] == [list(ref)] * 3


# --------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("kind", ["lookup", "draft_model", "eagle"])
def test_sampling_draws_the_same_tokens_as_the_copy_layout(kind, shared_calls):
    prompt = random_prompt(70, 9)
    outs = []
    for shared_prefix in (True, False):
        gen = torch.Generator().manual_seed(5)
        outs.append(_decoder(_drafter(kind), shared_prefix=shared_prefix).generate(
            prompt, 30, do_sample=True, temperature=0.8, generator=gen, num_return_sequences=4,
            eos_token_id=[7, 9]))  # fmt: skip
    assert shared_calls == [(1, 69)]  # the first call only
    shared, copy = outs
    assert torch.equal(shared.sequences, copy.sequences)
    assert shared.lengths == copy.lengths
    assert len({tuple(r.tolist()) for r in shared.sequences}) > 1  # independent rows, not copies
    if kind == "draft_model":
        assert shared.totals()["tokens_accepted"] > 20  # drafts were exercised


@pytest.mark.slow
def test_shared_samples_follow_the_target_and_are_independent(shared_calls):
    """Each of the n sequences of one call on the shared layout: the joint of its first two tokens
    is the target's (chi-square, as ``tests/drafters/test_lossless.py``, in its setting ``tests/drafters/lossless.py``); pairs of sequences of one
    call: the joint of their first tokens is p x p (independence)."""
    target, cfg = lossless.tiny_target(), SamplingConfig(lossless.TEMPERATURE)
    vocab = lossless.VOCAB
    dec = SpecDecoder(target, DraftModelDrafter(lossless.tiny_draft(), tree_size=6), tree_size=6, attn_impl="torch",
                      static_shapes=False)  # fmt: skip
    gen = torch.Generator().manual_seed(lossless.SEED)
    joint, pairs = torch.zeros(vocab, vocab), torch.zeros(vocab, vocab)
    accepted, calls, n = 0, 40, 100
    for _ in range(calls):
        out = dec.generate(torch.tensor(lossless.PROMPT), 2, do_sample=True, temperature=cfg.temperature,
                           generator=gen, num_return_sequences=n)  # fmt: skip
        toks = [out.new_tokens(b).tolist() for b in range(n)]
        for x, y in toks:
            joint[x, y] += 1
        for i in range(0, n, 2):
            pairs[toks[i][0], toks[i + 1][0]] += 1
        accepted += out.totals()["tokens_accepted"]
    assert len(shared_calls) == calls
    assert accepted > 500  # drafts were exercised
    with torch.no_grad():
        p1 = logits_to_probs(target(torch.tensor([lossless.PROMPT])).logits[0, -1], cfg).double()
    assert lossless.chi2_pvalue(joint, lossless.exact_joint(target, lossless.PROMPT, cfg)) > lossless.ALPHA
    assert lossless.chi2_pvalue(pairs, p1[:, None] * p1[None, :]) > lossless.ALPHA
    # the test separates: sequence 2i's token copied into 2i + 1 would fail it
    assert lossless.chi2_pvalue(torch.diag(pairs.sum(1)), p1[:, None] * p1[None, :]) < 1e-6


# --------------------------------------------------------------------------- static shapes


def _static(drafter, **kwargs) -> SpecDecoder:
    """Fixed-shape forwards in eager replay (CPU: no CUDA graphs), not compiled unless asked; the tiny
    target's one default cache bucket: 256 positions + TREE = 264 slots."""
    kwargs.setdefault("compile", False)
    return SpecDecoder(prepared_tiny_model("qwen2"), drafter, tree_size=TREE, attn_impl="torch", static_shapes=True,
                       cuda_graphs=False, **kwargs)  # fmt: skip


@pytest.mark.parametrize("length", [1, 37, 70, 130])
@pytest.mark.parametrize("kind", ["lookup", "draft_model"])
def test_static_greedy_rows_equal_the_target_greedy_output(kind, length, shared_calls):
    seed = 10 + length
    ref = greedy_reference(length, seed, NEW)
    dec = _static(_drafter(kind, ref))
    assert dec.static_shapes and dec.shared_prefix
    out = dec.generate(random_prompt(length, seed), NEW, num_return_sequences=N_SEQS)
    for b in range(N_SEQS):
        assert out.sequences[b, : out.lengths[b]].tolist() == list(ref)
    if length == 1:  # nothing to share: the copy layout's forward
        assert shared_calls == [] and dict(dec.shared_forwards) == {}
        return
    assert shared_calls == [(1, length - 1)]
    (key, graphed), = dec.shared_forwards.items()
    assert key == (N_SEQS, 264, TREE + 1, 264) and graphed.shared is dec.caches[(1, 264)]
    assert graphed.calls == len(out.steps)  # every tree forward ran over the shared prompt
    assert set(dec.forwards) == set()  # no copy-layout tree forward
    assert set(dec.prefill_forwards) == {(1, 264)}  # the prompt prefilled once, batch 1, in fixed-shape chunks


def test_static_calls_of_other_prompt_lengths_reuse_the_forward(shared_calls, made_forwards):
    """The prompt's length is data in the forward's input vector: a second call with another length
    in the same bucket makes no forward (no capture on a GPU) and is right too."""
    dec = _static(DraftModelDrafter(_draft(), tree_size=TREE))
    first = dec.generate(random_prompt(70, 80), NEW, num_return_sequences=N_SEQS)
    (graphed,) = dec.shared_forwards.values()
    made, calls = len(made_forwards), graphed.calls
    second = dec.generate(random_prompt(37, 47), NEW, num_return_sequences=N_SEQS)
    assert len(made_forwards) == made  # nothing new: the same tree and prefill forwards
    assert list(dec.shared_forwards.values()) == [graphed] and graphed.calls > calls
    assert shared_calls == [(1, 69), (1, 36)]
    for out, (length, seed) in ((first, (70, 80)), (second, (37, 47))):
        ref = greedy_reference(length, seed, NEW)
        assert [out.sequences[b, : out.lengths[b]].tolist() for b in range(N_SEQS)] == [list(ref)] * N_SEQS


def test_static_compiled_forward_serves_every_prompt_length(shared_calls, made_forwards):
    """``compile`` (aot_eager: dynamo's tracing without code generation): the forward over the shared
    prompt is traced once, in one graph (the cascade is one opaque op), for calls of two prompt
    lengths; the rows' cache has its buffers before that first trace (``KVCache.allocate_like``)."""
    from torch._dynamo.utils import counters

    dec = _static(LookupDrafter(), compile="aot_eager")
    graphs_before = counters["stats"]["unique_graphs"]
    for length, seed in ((70, 80), (37, 47)):
        ref = greedy_reference(length, seed, NEW)
        out = dec.generate(random_prompt(length, seed), NEW, num_return_sequences=N_SEQS)
        assert [out.sequences[b, : out.lengths[b]].tolist() for b in range(N_SEQS)] == [list(ref)] * N_SEQS
    assert counters["stats"]["unique_graphs"] - graphs_before == 1
    # made: the prompt's prefill forward (batch 1, never compiled), then the tree forward over the shared prompt
    assert [(g.batch, g.shared is not None) for g in made_forwards] == [(1, False), (N_SEQS, True)]


@pytest.mark.parametrize("kind", ["lookup", "draft_model", "eagle"])
def test_static_sampling_draws_the_same_tokens_as_the_copy_layout(kind, shared_calls):
    prompt = random_prompt(70, 9)
    outs = []
    for shared_prefix in (True, False):
        gen = torch.Generator().manual_seed(5)
        dec = _static(_drafter(kind), shared_prefix=shared_prefix)
        outs.append(dec.generate(prompt, 30, do_sample=True, temperature=0.8, generator=gen, num_return_sequences=4,
                                 eos_token_id=[7, 9]))  # fmt: skip
        assert bool(dec.shared_forwards) == shared_prefix
    assert shared_calls == [(1, 69)]  # the first call only
    shared, copy = outs
    assert torch.equal(shared.sequences, copy.sequences)
    assert shared.lengths == copy.lengths
    assert len({tuple(r.tolist()) for r in shared.sequences}) > 1  # independent rows, not copies


def test_static_warmup_builds_the_shared_forward(shared_calls, made_forwards):
    dec = _static(LookupDrafter())
    report = dec.warmup(batch_sizes=(1, 3), max_len=60, log=None)
    assert [(e.batch_size, e.shared_built) for e in report.entries] == [(1, False), (3, True)]
    assert set(dec.shared_forwards) == {(3, 264, TREE + 1, 264)}
    made = len(made_forwards)
    ref = greedy_reference(37, 47, 20)
    out = dec.generate(random_prompt(37, 47), 20, num_return_sequences=3)
    assert [out.sequences[b].tolist() for b in range(3)] == [list(ref)] * 3
    assert len(made_forwards) == made  # the warm-up made every forward the call used
    assert shared_calls == [(1, 1), (1, 36)]  # the warm-up's dummy prompt, then the call's
    dec.release(1)  # the prompt's cache goes, and with it the forward over it
    assert dict(dec.shared_forwards) == {} and set(dec.caches) == {(3, 264)}
    distinct = _static(LookupDrafter())  # batches of distinct prompts only: no forward over a shared prompt
    report = distinct.warmup(batch_sizes=(3,), max_len=60, shared=False, log=None)
    assert [e.shared_built for e in report.entries] == [False] and dict(distinct.shared_forwards) == {}
    with pytest.raises(ValueError, match=r"shared: expected True, False or 'only', got 1"):
        distinct.warmup(shared=1, log=None)


def test_static_shared_forward_through_the_triton_interpreter(shared_calls):
    """The cascade kernel with its prompt length read from the forward's input vector, two calls of
    different prompt lengths through one fixed-shape forward."""
    pytest.importorskip("triton")
    from treeattn.ops import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("TRITON_INTERPRET=1 not set (tests/conftest.py sets it on CPU machines)")
    dec = SpecDecoder(prepared_tiny_model("qwen2"), LookupDrafter(), tree_size=4, attn_impl="triton",
                      static_shapes=True, max_cache_len=64, prefill_width=32)  # fmt: skip
    for length, seed in ((37, 5), (20, 6)):
        ref = greedy_reference(length, seed, 8)
        out = dec.generate(random_prompt(length, seed), 8, num_return_sequences=2)
        assert [out.sequences[b].tolist() for b in range(2)] == [list(ref)] * 2
    assert shared_calls == [(1, 36), (1, 19)]
    assert set(dec.shared_forwards) == {(2, 64, 5, 64)}


def test_static_sliding_window_counts_both_capacities(shared_calls):
    """The fixed-shape forward reads both caches whole: the window must cover C + S."""
    target = prepared_tiny_model("gemma3")  # a 6-position window on its sliding layers
    strict = SpecDecoder(target, LookupDrafter(), tree_size=4, attn_impl="torch", static_shapes=True,
                         max_cache_len=64, shared_prefix=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"shared_prefix: True needs a target the cascade attention serves over "
                                         r"this call's 128 positions, got one with a sliding window of 6 positions"):
        strict.generate(random_prompt(3, 8), 2, num_return_sequences=2)
    assert shared_calls == []


# --------------------------------------------------------------------------- hidden states


class _HiddenRecorder(BaseDrafter):
    """Records what each sequence's first ``DraftContext.hidden`` was; proposes root-only trees."""

    def __init__(self, mode: str) -> None:
        self.needs_hidden_states = mode
        self.first: dict[int, torch.Tensor | None] = {}

    def reset(self, input_ids):
        self.first = {}

    def propose(self, ctx: DraftContext) -> TokenTree:
        self.first.setdefault(ctx.seq, ctx.hidden)
        return TokenTree(ctx.tokens[-1:].clone(), torch.tensor([-1]))


@pytest.mark.parametrize("mode, rows", [("last", 1), ("all", 36)])
def test_first_hidden_states_are_the_prompts_for_every_row(mode, rows, shared_calls):
    prompt = random_prompt(37, 3)
    got = {}
    for shared_prefix in (True, False):
        drafter = _HiddenRecorder(mode)
        _decoder(drafter, shared_prefix=shared_prefix).generate(prompt, 3, num_return_sequences=N_SEQS)
        got[shared_prefix] = drafter.first
    assert shared_calls == [(1, 36)]
    for b in range(N_SEQS):
        assert got[True][b].shape == (rows, 64)
        torch.testing.assert_close(got[True][b], got[True][0], atol=0, rtol=0)  # the same prompt features
        torch.testing.assert_close(got[True][b], got[False][b], atol=2e-5, rtol=1e-5)  # as the copy layout's


# --------------------------------------------------------------------------- options and errors


def test_defaults_and_the_option_through_wrap(shared_calls):
    assert _decoder(None).shared_prefix is True
    assert _decoder(None, shared_prefix=False).shared_prefix is False
    model = specdec.wrap(prepared_tiny_model("qwen2"), LookupDrafter(), tree_size=4, attn_impl="torch",
                         static_shapes=False, shared_prefix=False)  # fmt: skip
    assert model.generate(random_prompt(9, 0)[None], max_new_tokens=3, num_return_sequences=2).shape[0] == 2
    assert shared_calls == []
    out = _decoder(None).generate(random_prompt(9, 0), 3, num_return_sequences=1)  # one sequence: nothing to share
    assert out.sequences.shape[0] == 1 and shared_calls == []


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_bad_shared_prefix_values_raise(bad):
    with pytest.raises(ValueError, match=rf"shared_prefix: expected None, True or False, got {bad!r}"):
        _decoder(None, shared_prefix=bad)


def test_soft_capped_target_copies_the_prompt_or_raises(shared_calls):
    target = prepared_tiny_model("gemma2")
    with pytest.raises(ValueError, match=r"shared_prefix: True needs a target the cascade attention serves, got one "
                                         r"with attention-logit soft-capping \(attn_logit_softcapping=20.0\)"):
        SpecDecoder(target, None, attn_impl="torch", static_shapes=False, shared_prefix=True)
    dec = SpecDecoder(target, LookupDrafter(), tree_size=4, attn_impl="torch", static_shapes=False)
    assert dec.shared_prefix is False
    ref = greedy_reference(20, 8, 10, "gemma2")
    out = dec.generate(random_prompt(20, 8), 10, num_return_sequences=2)
    assert [out.sequences[b].tolist() for b in range(2)] == [list(ref)] * 2
    assert shared_calls == []


def test_short_sliding_window_copies_the_prompt_or_raises(shared_calls):
    target = prepared_tiny_model("gemma3")  # a 6-position window on its sliding layers
    dec = SpecDecoder(target, LookupDrafter(), tree_size=4, attn_impl="torch", static_shapes=False)
    assert dec.shared_prefix is True  # decided per call: the window is shorter than any call's context
    ref = greedy_reference(20, 8, 10, "gemma3")
    out = dec.generate(random_prompt(20, 8), 10, num_return_sequences=2)
    assert [out.sequences[b].tolist() for b in range(2)] == [list(ref)] * 2
    assert shared_calls == []
    strict = SpecDecoder(target, LookupDrafter(), tree_size=4, attn_impl="torch", static_shapes=False,
                         shared_prefix=True)  # fmt: skip
    with pytest.raises(ValueError, match=r"shared_prefix: True needs a target the cascade attention serves over "
                                         r"this call's 34 positions, got one with a sliding window of 6 positions"):
        strict.generate(random_prompt(20, 8), 10, num_return_sequences=2)


def test_shared_prefix_obstacle_reads_the_config():
    assert hf.shared_prefix_obstacle(prepared_tiny_model("qwen2"), 10_000) is None
    assert hf.shared_prefix_obstacle(prepared_tiny_model("gemma3"), 6) is None
    assert "sliding window of 6" in hf.shared_prefix_obstacle(prepared_tiny_model("gemma3"), 7)
    assert "soft-capping" in hf.shared_prefix_obstacle(prepared_tiny_model("gemma2"), 1)


def test_prefill_shared_returns_the_prompt_hidden_states():
    model = prepared_tiny_model("qwen2")
    prompt = random_prompt(20, 4)
    cache, last = hf.prefill_shared(model, prompt, return_hidden=True)
    _, every = hf.prefill_shared(model, prompt, return_hidden="all")
    assert cache.lengths == [20] and last.shape == (1, 64) and every.shape == (1, 20, 64)
    torch.testing.assert_close(last, every[:, -1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"return_hidden: expected False, True or 'all', got 'last'"):
        hf.prefill_shared(model, prompt, return_hidden="last")
