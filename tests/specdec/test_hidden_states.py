"""``DraftContext.hidden``: the target's features a drafter with ``needs_hidden_states`` receives.

Every recorded ``hidden`` is checked against the target's own full-sequence forward over the
committed tokens (``output_hidden_states``, last layer: after the final norm, what the LM head
reads), for a batch of prompts of different lengths, with the eager prefill (dynamic and static
shapes) and with the chunked fixed-shape prefill (static shapes, ``prefill_width``; CPU: eager
replay). ``"all"``: each committed position's feature arrives exactly once, in order; ``"last"``
(True): one row, the root's predictor.
"""

from __future__ import annotations

import pytest
import torch

from drafters.trees import AcceptanceRecorder
from specdec import SpecDecoder, hf
from specdec.drafting import HIDDEN_ALL, HIDDEN_LAST, BaseDrafter, DraftContext, hidden_states_request
from specdec.kv import KVCache
from tests.specdec.helpers import OracleDrafter, greedy_reference, prepared_tiny_model, random_prompt

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
