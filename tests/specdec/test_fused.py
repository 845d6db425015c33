"""``specdec.fused``: one GEMM per q / k / v and gate / up group, one ``F.rms_norm`` per RMSNorm, in
specdec's forwards.

CPU (CI): the state dict is unchanged by fusing (keys, shapes, values, no extra storage); specdec's
forwards run 4 GEMMs a layer instead of 7 and the model's own forward still 7; logits of both paths
equal the unfused model's in fp32 (tolerance of a different GEMM blocking) on shapes no block divides;
the engine's greedy output equals HF greedy with the fused model, eager and through ``torch.compile``;
``unfuse_projections`` restores plain ``nn.Linear`` modules and the norms' classes; what is not fused
(hooks, mixed biases, a norm whose map is not ``F.rms_norm``'s).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from specdec import KVCache, SpecDecoder, hf
from specdec import fused
from specdec.fused import (FusedNorm, FusedPart, fuse_projections, fused_groups, fused_norms, unfuse_norms,
                           unfuse_projections)
from tests.specdec.helpers import OracleDrafter, hf_greedy, random_prompt, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

_GEMMS = {"mm", "addmm"}  # projections over 2-D weights (attention runs bmm)


class _CountGemms(TorchDispatchMode):
    """Counts the aten GEMMs over a 2-D weight (``mm`` / ``addmm``) a region runs."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in _GEMMS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _fused_copy(family: str, seed: int = 0):
    ref = tiny_model(family, seed)
    model = tiny_model(family, seed)
    hf.prepare_model(model)  # fuses by default
    return ref, model


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_state_dict_unchanged_and_no_extra_storage(family):
    ref, model = _fused_copy(family)
    a, b = ref.state_dict(), model.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    layers = ref.config.num_hidden_layers
    assert len(fused_groups(model)) == 2 * layers
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedPart) and isinstance(attn.q_proj, nn.Linear)
    # The parts' parameters are views of the group's one tensor (no second copy of the weights).
    group = attn.q_proj.group
    assert attn.k_proj.weight.untyped_storage().data_ptr() == group.weight.untyped_storage().data_ptr()
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(p.numel() for p in ref.parameters())
    assert fuse_projections(model) == 0  # idempotent


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_specdec_forward_runs_one_gemm_per_group(family):
    """7 GEMMs a layer unfused (q, k, v, o, gate, up, down) + the LM head; 4 a layer in specdec's
    forwards; the model's own forward is untouched (7 a layer), and the logits agree with the
    unfused model's."""
    ref, model = _fused_copy(family, seed=3)
    layers = ref.config.num_hidden_layers
    ids = torch.randint(3, ref.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with _CountGemms() as own:
            out = model(ids).logits
        expect = ref(ids).logits
        torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-5)
        assert own.count == 7 * layers + 1
        with _CountGemms() as spec:
            logits = hf.run_state(model, ids, torch.arange(11).expand(2, 11), _dense_state(model, ids))
        assert spec.count == 4 * layers + 1
        torch.testing.assert_close(logits, expect, rtol=1e-4, atol=1e-4)
    assert not any(g.armed for g in fused_groups(model))  # disarmed after the call


@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_specdec_forward_runs_each_rms_norm_as_one_op(family, monkeypatch):
    """A layer's RMSNorms run as one ``F.rms_norm`` each in specdec's forwards, their own code in the
    model's forward; Gemma 2's norms scale by ``1 + weight`` (not ``F.rms_norm``'s map): left alone.
    The logits agree with the unfused model's either way."""
    ref, model = _fused_copy(family, seed=3)
    layers = ref.config.num_hidden_layers
    fused_per_layer = 0 if family == "gemma2" else 2
    assert len(fused_norms(model)) == fused_per_layer * layers
    calls = []
    rms_norm = fused.F.rms_norm

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return rms_norm(*args, **kwargs)

    monkeypatch.setattr(fused.F, "rms_norm", counting)
    ids = torch.randint(3, ref.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = ref(ids).logits
        torch.testing.assert_close(model(ids).logits, expect, rtol=0, atol=0)  # its own code, unchanged
        assert not calls
        logits = hf.run_state(model, ids, torch.arange(11).expand(2, 11), _dense_state(model, ids))
        assert len(calls) == fused_per_layer * layers
        torch.testing.assert_close(logits, expect, rtol=1e-4, atol=1e-4)
    assert not any(n.specdec_armed for n in fused_norms(model))  # disarmed after the call


def test_a_norm_with_another_map_is_not_fused():
    """An RMSNorm-named module whose map is not ``F.rms_norm``'s (here Gemma's ``1 + weight`` scale)
    keeps its class; the layer's stock norm next to it is fused."""

    class OffsetRMSNorm(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(hidden) * 0.1)
            self.eps = 1e-6

        def forward(self, x):
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    model = tiny_model("qwen2")
    layer = model.model.layers[0]
    layer.input_layernorm = OffsetRMSNorm(model.config.hidden_size)
    hf.prepare_model(model)
    assert type(layer.input_layernorm) is OffsetRMSNorm
    assert isinstance(layer.post_attention_layernorm, FusedNorm)
    assert unfuse_norms(model) == 2 * model.config.num_hidden_layers - 1 and not fused_norms(model)
    assert type(layer.post_attention_layernorm).__name__ == "Qwen2RMSNorm" and len(fused_groups(model)) == 4


def _dense_state(model, ids: torch.Tensor):
    """specdec's state for a causal forward of ``ids`` from an empty cache (a prefill)."""
    B, m = ids.shape
    positions = torch.arange(m).expand(B, m)
    return hf.ForwardState(cache=KVCache(B, m), slots=positions, positions=positions, impl="torch")


@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("tree_size", [0, 8])
def test_engine_greedy_with_fused_model_equals_hf(compile, tree_size):
    """The engine (static shapes: plain decoding in chunks, or tree steps of an oracle drafter mixing
    the truth with noise) over a fused model: token for token HF greedy, eager and compiled (inductor
    on CPU)."""
    model = tiny_model("qwen2", seed=5)
    prompts = [random_prompt(L, s) for L, s in ((9, 1), (4, 2))]
    refs = [hf_greedy(model, p, 13) for p in prompts]
    drafter = OracleDrafter(refs, seed=3) if tree_size else None
    dec = SpecDecoder(model, drafter, tree_size=tree_size, static_shapes=True, cuda_graphs=False,
                      attn_impl="torch", max_cache_len=64, compile=compile)  # fmt: skip
    assert len(fused_groups(model)) == 4
    out = dec.generate(prompts, 13)
    for b, ref in enumerate(refs):
        assert out.sequences[b, : len(ref)].tolist() == ref


def test_unfuse_restores_plain_linears():
    ref, model = _fused_copy("qwen2")
    assert unfuse_projections(model) == 2 * ref.config.num_hidden_layers
    assert not fused_groups(model) and not fused_norms(model)
    assert type(model.model.layers[0].input_layernorm) is type(ref.model.layers[0].input_layernorm)
    assert type(model.model.layers[1].mlp.up_proj) is nn.Linear
    a, b = ref.state_dict(), model.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(ptrs) == len(list(model.parameters())) - int(model.config.tie_word_embeddings)
    ids = torch.randint(3, 100, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


def test_not_fused_with_hooks_or_mixed_bias():
    model = tiny_model("qwen2")
    attn = model.model.layers[0].self_attn
    attn.k_proj.register_forward_hook(lambda *a: None)
    model.model.layers[1].self_attn.v_proj.bias = None
    assert fuse_projections(model) == 2  # only the two MLPs
    assert type(attn.q_proj) is nn.Linear and type(model.model.layers[1].self_attn.q_proj) is nn.Linear
    assert isinstance(model.model.layers[0].mlp.gate_proj, FusedPart)


@pytest.mark.cuda
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_captured_fused_engine_equals_hf(compile):
    """On the GPU, fp32: the fused projections inside captured CUDA graphs (eager and compiled bodies),
    plain decoding in chunks and tree steps, token for token HF greedy (the model's own, unfused,
    GEMMs)."""
    model = tiny_model("qwen2", seed=5).cuda()
    prompts = [random_prompt(L, s).cuda() for L, s in ((9, 1), (4, 2))]
    refs = []
    for p in prompts:
        out = model.generate(p[None], max_new_tokens=13, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"))
        refs.append(out[0].tolist())
    for tree_size in (0, 8):
        drafter = OracleDrafter(refs, seed=3) if tree_size else None
        dec = SpecDecoder(model, drafter, tree_size=tree_size, static_shapes=True, cuda_graphs=True,
                          max_cache_len=64, compile=compile)  # fmt: skip
        assert len(fused_groups(model)) == 4
        got = dec.generate(prompts, 13)
        for b, ref in enumerate(refs):
            assert got.sequences[b, : len(ref)].tolist() == ref, (tree_size, b)


def test_deep_copy_of_a_fused_model_fuses_its_own_groups():
    """A deep copy (e.g. a perturbed draft model) keeps the views sharing its own fused tensor, and its
    layers' hooks arm its own groups: 4 GEMMs a layer in its specdec forwards, the same logits."""
    import copy

    _, model = _fused_copy("llama", seed=2)
    twin = copy.deepcopy(model)
    attn = twin.model.layers[0].self_attn
    assert attn.v_proj.weight.untyped_storage().data_ptr() == attn.q_proj.group.weight.untyped_storage().data_ptr()
    assert attn.q_proj.group is not model.model.layers[0].self_attn.q_proj.group
    assert len(fused_norms(twin)) == 2 * twin.config.num_hidden_layers  # its norms fused too, its own weights
    with torch.no_grad():  # a perturbed copy: the in-place update reaches the copy's fused GEMMs only
        for p in twin.parameters():
            p.add_(0.01)
    ids = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), _CountGemms() as spec:
        got = hf.run_state(twin, ids, torch.arange(9)[None], _dense_state(twin, ids))
    assert spec.count == 4 * twin.config.num_hidden_layers + 1
    with torch.no_grad():
        torch.testing.assert_close(got, twin(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(got, model(ids).logits, atol=1e-3)


def test_views_survive_casting_and_in_place_updates_reach_the_fused_gemm():
    """After ``.to(float64)`` the parameters still view the group's tensor; an in-place update of a
    parameter (as training or a perturbed copy does) changes specdec's fused forward exactly as the
    model's own."""
    _, model = _fused_copy("qwen2", seed=6)
    model.to(torch.float64)
    mlp = model.model.layers[1].mlp
    assert mlp.up_proj.weight.dtype == mlp.up_proj.group.weight.dtype == torch.float64
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.group.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    ids = torch.randint(3, 100, (2, 5), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = hf.run_state(model, ids, torch.arange(5).expand(2, 5), _dense_state(model, ids))
        torch.testing.assert_close(got, model(ids).logits, rtol=1e-10, atol=1e-10)
