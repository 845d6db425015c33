"""``DraftContext.hidden``: the target's features a drafter with ``needs_hidden_states`` receives.

Every recorded ``hidden`` is checked against the target's own full-sequence forward over the
committed tokens (``output_hidden_states``, last layer: after the final norm, what the LM head
reads), for a batch of prompts of different lengths, with the eager prefill (dynamic and static
shapes) and with the chunked fixed-shape prefill (static shapes, ``prefill_width``; CPU: eager
replay). ``"all"``: each committed position's feature arrives exactly once, in order; ``"last"``
(True): one row, the root's predictor. With ``feature_layers`` (a 5-layer target): the outputs of
those decoder layers, against HF's ``output_hidden_states`` of those layers, also from the
fixed-shape forward traced by torch.compile; plain decoding and other drafters hook no layer.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch._dynamo.utils import counters

from drafters.trees import AcceptanceRecorder
from specdec import SpecDecoder, hf
from specdec.drafting import (HIDDEN_ALL, HIDDEN_LAST, BaseDrafter, DraftContext, feature_layers_request,
                              hidden_states_request)
from specdec.graphs import GraphedForward
from specdec.kv import KVCache
from specdec.tree import TokenTree
from tests.specdec.helpers import (OracleDrafter, greedy_reference, hf_greedy, prepared_tiny_model, random_prompt,
                                   tiny_model)

pytestmark = pytest.mark.usefixtures("one_thread")

W = 8  # chunk width of the fixed-shape prefill: the 19-token prompt spans 3 chunks
NEW = 16
TREE = 5
SHAPES = [(2 * W + 3, 0), (5, 1), (1, 2)]  # (prompt length, seed): different lengths, a one-token prompt
H = 64

# (static_shapes, prefill_width): eager prefill with dynamic / static shapes, chunked prefill
PREFILLS = [(False, 0), (True, 0), (True, W)]


class _Recorder(OracleDrafter):
    """The target's greedy continuation as drafts (long accepted paths, some rejections); records
    every (seq, committed tokens, hidden) it is shown."""

    def __init__(self, refs, mode):
        super().__init__(refs, seed=5)
        self.needs_hidden_states = mode
        self.seen: list[tuple[int, list[int], torch.Tensor | None]] = []

    def propose(self, ctx: DraftContext):
        hidden = None if ctx.hidden is None else ctx.hidden.detach().cpu().clone()
        self.seen.append((ctx.seq, ctx.tokens.tolist(), hidden))
        return super().propose(ctx)


def _features(tokens: list[int]) -> torch.Tensor:
    """``[L, H]``: the target's final hidden states (LM head input) over ``tokens``, one plain forward."""
    with torch.no_grad():
        out = prepared_tiny_model()(torch.tensor([tokens]), output_hidden_states=True)
    return out.hidden_states[-1][0]


def _decode(mode, static: bool, width: int):
    refs = [list(greedy_reference(length, seed, NEW)) for length, seed in SHAPES]
    rec = _Recorder(refs, mode)
    dec = SpecDecoder(prepared_tiny_model(), rec, tree_size=TREE, static_shapes=static, attn_impl="torch",
                      prefill_width=width, cache_buckets=(48, 96) if static else None)  # fmt: skip
    out = dec.generate([random_prompt(length, seed) for length, seed in SHAPES], NEW)
    for b, ref in enumerate(refs):
        assert out.sequences[b, : out.lengths[b]].tolist() == ref
    return dec, rec, out


@pytest.mark.parametrize("static,width", PREFILLS)
def test_all_features_arrive_once_and_equal_the_target_forward(static, width):
    dec, rec, out = _decode(HIDDEN_ALL, static, width)
    assert dec.prefill_width == width and (width == 0) == (not dec.prefill_forwards)
    for b in range(len(SHAPES)):
        ref = _features(out.sequences[b, : out.lengths[b]].tolist())
        calls = [(tokens, hidden) for seq, tokens, hidden in rec.seen if seq == b]
        assert len(calls) >= 3  # the first step and several after it
        given = 0  # positions [0, given) were handed over
        for step, (tokens, hidden) in enumerate(calls):
            length = len(tokens)
            if length == 1:  # a one-token prompt: no feature yet
                assert step == 0 and hidden is None
                given = 0
                continue
            assert hidden is not None and hidden.dim() == 2 and hidden.shape[1] == H
            m = hidden.shape[0]
            assert length - 1 - m == given, (b, step)  # exactly the positions not given before
            if step == 0:
                assert m == SHAPES[b][0] - 1  # the prompt but its last token
            torch.testing.assert_close(hidden, ref[length - 1 - m : length - 1], atol=1e-4, rtol=1e-4)
            given = length - 1
        assert any(hidden is not None and hidden.shape[0] > 1 for tokens, hidden in calls[1:])  # accepted paths


@pytest.mark.parametrize("mode", [True, HIDDEN_LAST])
@pytest.mark.parametrize("static,width", [PREFILLS[0], PREFILLS[2]])
def test_last_feature_is_one_row_the_roots_predictor(mode, static, width, monkeypatch):
    """``"last"`` / True (Medusa): ``[1, H]``; the eager prefill asks for one position per row only."""
    kwargs = []
    real = hf.prefill
    monkeypatch.setattr(hf, "prefill", lambda *a, **k: kwargs.append(k) or real(*a, **k))
    dec, rec, out = _decode(mode, static, width)
    assert all(not k.get("all_hidden") and k["hidden_at"] is not None for k in kwargs)
    assert len(kwargs) == (width == 0)
    refs = [_features(out.sequences[b, : out.lengths[b]].tolist()) for b in range(len(SHAPES))]
    for seq, tokens, hidden in rec.seen:
        if len(tokens) == 1:
            assert hidden is None
            continue
        assert hidden.shape == (1, H)
        torch.testing.assert_close(hidden[0], refs[seq][len(tokens) - 2], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_features_equal_eager_prefill():
    """Prefill alone: per sequence, the ``[L - 1, H]`` prompt features (None for one token)."""
    lens = [2 * W + 3, 1, W, W + 1, 2, 3 * W]  # ends at chunk boundaries, inside chunks, and 1-token
    seqs = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for b, n in enumerate(lens):
        seqs[b, :n] = random_prompt(n, 20 + b)
    got = []
    for width in (W, 0):
        dec = SpecDecoder(prepared_tiny_model(), _Recorder([], HIDDEN_ALL), tree_size=TREE, static_shapes=True,
                          attn_impl="torch", prefill_width=width, cache_buckets=(48,))  # fmt: skip
        got.append(dec._prefill(dec._cache_for(len(lens), 48), seqs, lens))
    for b, n in enumerate(lens):
        if n == 1:
            assert got[0][b] is None and got[1][b] is None
            continue
        want = _features(seqs[b, :n].tolist())[: n - 1]
        for g in got:
            assert g[b].shape == (n - 1, H)
            torch.testing.assert_close(g[b], want, atol=1e-4, rtol=1e-4)


def test_hf_prefill_all_hidden_keeps_one_logits_row():
    model = prepared_tiny_model()
    prompts = [random_prompt(9, 30), random_prompt(4, 31)]
    ids = torch.zeros(2, 9, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    heads = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, a, out: heads.append(out.shape))
    try:
        h = hf.prefill(model, ids, KVCache(2, 16), impl="torch", all_hidden=True)
    finally:
        hook.remove()
    assert h.shape == (2, 9, H) and heads == [(2, 1, model.config.vocab_size)]
    for b, p in enumerate(prompts):
        torch.testing.assert_close(h[b, : len(p)], _features(p.tolist()), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"hidden_at: expected None with all_hidden=True"):
        hf.prefill(model, ids, KVCache(2, 16), all_hidden=True, hidden_at=torch.tensor([3, 2]))
    with pytest.raises(ValueError, match=r"return_hidden: expected False, True or 'all', got 'some'"):
        hf.run_state(model, ids, ids, None, return_hidden="some")


def test_needs_hidden_states_values():
    class Asks(BaseDrafter):
        def __init__(self, want):
            self.needs_hidden_states = want

    assert hidden_states_request(None) is None
    assert hidden_states_request(BaseDrafter()) is None
    assert [hidden_states_request(Asks(w)) for w in (False, True, "last", "all")] == [None, "last", "last", "all"]
    assert hidden_states_request(AcceptanceRecorder(Asks("all"))) == "all"  # proxies pass it through
    with pytest.raises(ValueError, match=r"drafter: expected needs_hidden_states to be a bool, 'last' or 'all', "
                                         r"got 'every'"):  # fmt: skip
        SpecDecoder(prepared_tiny_model(), Asks("every"), tree_size=2)


# ----------------------------------------------------------------------------------------------
# feature_layers: the outputs of given decoder layers instead of the final feature (EAGLE-3)

DEEP = 5  # decoder layers of the target below: low, middle, high and the last one differ
LAYERS = (0, 2, 4)  # the last layer's output is the final norm's input (HF's last hidden state is after it)


@functools.lru_cache(maxsize=None)
def _deep_model():
    """A 5-layer ``tiny_model("qwen2")`` after ``hf.prepare_model``."""
    model = tiny_model("qwen2", layers=DEEP)
    hf.prepare_model(model)
    return model


def _layer_features(model, tokens: list[int], layers) -> torch.Tensor:
    """``[L, k * H]``: the outputs of ``layers`` over ``tokens`` in one plain forward of the model: HF's
    ``output_hidden_states[i + 1]``, and for the last layer the final norm's input."""
    last = model.config.num_hidden_layers - 1
    seen = []
    hook = model.model.norm.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            out = model(torch.tensor([tokens], device=model.device), output_hidden_states=True)
    finally:
        hook.remove()
    return torch.cat([seen[0][0] if i == last else out.hidden_states[i + 1][0] for i in layers], dim=-1)


def _deep_decode(mode, static: bool, width: int, layers=LAYERS):
    model = _deep_model()
    prompts = [random_prompt(length, seed) for length, seed in SHAPES]
    refs = [hf_greedy(model, p, NEW) for p in prompts]
    rec = _Recorder(refs, mode)
    rec.feature_layers = layers
    dec = SpecDecoder(model, rec, tree_size=TREE, static_shapes=static, attn_impl="torch", prefill_width=width,
                      cache_buckets=(48, 96) if static else None)  # fmt: skip
    out = dec.generate(prompts, NEW)
    for b, ref in enumerate(refs):
        assert out.sequences[b, : out.lengths[b]].tolist() == ref
    return dec, rec, out


def test_the_layer_features_reference_is_not_the_final_feature():
    """The reference really reads the layers (the last one before the final norm): a test of the tests."""
    model, tokens = _deep_model(), random_prompt(6, 3).tolist()
    got = _layer_features(model, tokens, (DEEP - 1,))
    with torch.no_grad():
        final = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    assert got.shape == final.shape and not torch.allclose(got, final, atol=1e-2)
    torch.testing.assert_close(model.model.norm(got), final)


@pytest.mark.parametrize("static,width", PREFILLS)
def test_layer_features_arrive_once_and_equal_the_hf_hidden_states(static, width):
    """``"all"`` with ``feature_layers``: ``[m, k * H]`` rows, each committed position once, equal to the
    HF forward's hidden states of those layers (the eager prefill, the chunked one, the tree forwards)."""
    dec, rec, out = _deep_decode(HIDDEN_ALL, static, width)
    assert [id(m) for m in dec._feature_layers] == [id(_deep_model().model.layers[i]) for i in LAYERS]
    for b in range(len(SHAPES)):
        ref = _layer_features(_deep_model(), out.sequences[b, : out.lengths[b]].tolist(), LAYERS)
        given = 0
        calls = [(tokens, hidden) for seq, tokens, hidden in rec.seen if seq == b]
        for step, (tokens, hidden) in enumerate(calls):
            length = len(tokens)
            if length == 1:
                assert step == 0 and hidden is None
                continue
            assert hidden.shape == (length - 1 - given, len(LAYERS) * H), (b, step)
            torch.testing.assert_close(hidden, ref[given : length - 1], atol=1e-4, rtol=1e-4)
            given = length - 1
        assert given > SHAPES[b][0]  # accepted paths after the prompt


@pytest.mark.parametrize("static,width", [PREFILLS[0], PREFILLS[2]])
def test_last_layer_features_are_one_row_the_roots_predictor(static, width):
    dec, rec, out = _deep_decode(HIDDEN_LAST, static, width, layers=(1, 3))
    refs = [_layer_features(_deep_model(), out.sequences[b, : out.lengths[b]].tolist(), (1, 3))
            for b in range(len(SHAPES))]  # fmt: skip
    for seq, tokens, hidden in rec.seen:
        if len(tokens) > 1:
            assert hidden.shape == (1, 2 * H)
            torch.testing.assert_close(hidden[0], refs[seq][len(tokens) - 2], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("compile", [False, "aot_eager", "layers:aot_eager"])
def test_fixed_shape_forward_takes_the_layer_features_inside_its_body(compile):
    """``GraphedForward(feature_layers=)`` (eager replay of the body a CUDA graph records; traced by
    torch.compile, whole or layer by layer): chain trees over a prefilled cache give the HF hidden states
    of those layers at the chain's positions, for shapes that divide no block size; the forward's output
    buffer is the same tensor every step. (The traced model is a fresh copy: transformers' own
    ``output_hidden_states``, run for the reference, leaves hooks on the layers that dynamo breaks on.)"""
    model = tiny_model("qwen2", layers=DEEP)
    hf.prepare_model(model)
    seq = random_prompt(29, 7).tolist()
    ref = _layer_features(_deep_model(), seq, LAYERS)
    taps = hf.layers_at(model, LAYERS)
    cache = KVCache(1, 40)
    hf.prefill(model, torch.tensor([seq[:11]]), cache, impl="torch")
    gf = GraphedForward(model, cache, 1, 7, impl="torch", return_hidden=True, compile=compile, feature_layers=taps)
    graphs_before = counters["stats"]["unique_graphs"]
    first = None
    for start, size in ((11, 7), (18, 3), (21, 7)):
        _, hidden = gf.run([TokenTree.chain(torch.tensor(seq[start : start + size]))], [start])
        first = hidden if first is None else first
        assert hidden is first and hidden.shape == (1, 7, len(LAYERS) * H)
        torch.testing.assert_close(hidden[0, :size], ref[start : start + size], atol=1e-4, rtol=1e-4)
    # one trace for all steps (whole body, or the one kind of layer), as with the final feature
    assert counters["stats"]["unique_graphs"] - graphs_before == (1 if compile else 0)


def test_plain_decoding_and_final_feature_drafters_take_no_layer_features(monkeypatch):
    """Only a drafter naming ``feature_layers`` makes the engine hook layers: plain decoding, a drafter
    without hidden states and one reading the final feature never enter ``hf.layer_outputs``."""
    entered = []
    real = hf.layer_outputs
    monkeypatch.setattr(hf, "layer_outputs", lambda layers: entered.append(len(layers)) or real(layers))
    model, prompt = _deep_model(), random_prompt(9, 4)
    refs = [hf_greedy(model, prompt, 6)]
    for drafter in (None, OracleDrafter(refs), _Recorder(refs, HIDDEN_ALL)):
        for static in (False, True):
            dec = SpecDecoder(model, drafter, tree_size=TREE, static_shapes=static, attn_impl="torch",
                              prefill_width=W if static else 0, cache_buckets=(48,) if static else None)  # fmt: skip
            assert dec._feature_layers is None
            assert dec.generate(prompt, 6).sequences[0].tolist() == refs[0]
    assert entered == []
    _deep_decode(HIDDEN_ALL, True, W)
    assert entered and set(entered) == {len(LAYERS)}


def test_feature_layers_values():
    class Asks(BaseDrafter):
        def __init__(self, want, layers):
            self.needs_hidden_states = want
            self.feature_layers = layers

    assert feature_layers_request(None, 4) is None and feature_layers_request(BaseDrafter(), 4) is None
    assert feature_layers_request(Asks("all", [0, 3]), 4) == (0, 3)
    assert feature_layers_request(Asks(True, (2,)), 4) == (2,)
    assert feature_layers_request(AcceptanceRecorder(Asks("all", (1, 2))), 4) == (1, 2)  # proxies pass it through
    for layers in ((), (0, 4), (2, 1), (1, 1), (-1,), ("1",), 2, (True,)):
        with pytest.raises(ValueError, match=r"drafter: expected feature_layers to be None or strictly increasing "
                                             r"layer indices in \[0, 4\), got"):  # fmt: skip
            feature_layers_request(Asks("all", layers), 4)
    with pytest.raises(ValueError, match=r"drafter: expected feature_layers only with needs_hidden_states, got "
                                         r"feature_layers=\(0,\)"):  # fmt: skip
        SpecDecoder(_deep_model(), Asks(False, (0,)), tree_size=2)
    with pytest.raises(ValueError, match=r"drafter: expected feature_layers to be None or strictly increasing layer "
                                         r"indices in \[0, 5\), got \(0, 5\)"):  # fmt: skip
        SpecDecoder(_deep_model(), Asks("all", (0, 5)), tree_size=2)
    with pytest.raises(ValueError, match=r"feature_layers: expected decoder-layer indices of Qwen2ForCausalLM "
                                         r"\(0 .. 4\), got \[7\]"):  # fmt: skip
        hf.layers_at(_deep_model(), (1, 7))


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graphs_take_the_layer_features(compile):
    """On CUDA with the engine's defaults (CUDA graphs, chunked prefill; ``compile=True``: the layer-wise
    inductor compile): every committed position's layer features once, equal to the HF forward's."""
    model = tiny_model("qwen2", layers=DEEP).to("cuda")
    hf.prepare_model(model)
    prompts = [random_prompt(length, seed) for length, seed in SHAPES]
    refs = []
    for p in prompts:
        ids = p[None].to("cuda")
        refs.append(model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0,
                                   attention_mask=torch.ones_like(ids))[0].tolist())  # fmt: skip
    rec = _Recorder(refs, HIDDEN_ALL)
    rec.feature_layers = LAYERS
    dec = SpecDecoder(model, rec, tree_size=TREE, prefill_width=W, compile=compile)
    assert dec.cuda_graphs
    out = dec.generate(prompts, NEW)
    assert all(gf.captured for gf in dec.forwards.values())
    for b, ref in enumerate(refs):
        assert out.sequences[b, : out.lengths[b]].tolist() == ref
        want = _layer_features(model, ref, LAYERS).cpu()
        given = 0
        for seq, tokens, hidden in rec.seen:
            if seq == b and len(tokens) > 1:
                assert hidden.shape == (len(tokens) - 1 - given, len(LAYERS) * H)
                torch.testing.assert_close(hidden, want[given : len(tokens) - 1], atol=1e-3, rtol=1e-3)
                given = len(tokens) - 1
        assert given > SHAPES[b][0]  # accepted paths after the prompt
