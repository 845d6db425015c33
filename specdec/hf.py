"""HuggingFace integration: run a stock causal LM over token-tree nodes through ``AttentionInterface``.

``prepare_model(model)`` registers an attention function (and its mask function) with
transformers' registries under ``specdec_tree_sdpa`` / ``specdec_tree_eager`` and switches the
model to it. That function behaves exactly like the model's previous implementation (``sdpa`` or
the model's own ``eager``) unless the forward call carries a ``ForwardState`` in the
``specdec_state`` keyword, which transformers forwards untouched to every attention call. With a
state, the function writes the new keys / values into the state's ``KVCache`` and attends with
``treeattn.tree_attention`` (or a dense fallback for sliding-window / soft-capped layers; with a
shared prompt, ``ForwardState.shared``, ``treeattn.cascade.cascade_tree_attention``). No
modeling file is copied, no model attribute or global carries tree metadata: everything a layer
needs arrives in that call's state.

``prefill`` and ``tree_forward`` pass ``past_key_values=None, use_cache=False`` and a dummy 4-D
``attention_mask``, so transformers neither builds a cache nor a mask (a 4-D mask is "already
prepared"), and every shape depends only on (B, n, capacity) (with a shared prompt whose length
comes as data, ``ForwardState.shared_len``, also on that prompt cache's capacity): ready for
CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specdec.attention import STATE_KWARG, MaskedState, layer_index, masked_attention, on_device, tree_visibility
from specdec.fused import fuse_norms, fuse_projections
from specdec.kv import KVCache, store
from treeattn import TreeMask, tree_attention
from treeattn.cascade import cascade_tree_attention, cascade_tree_attention_op
from treeattn.ops import tree_attention_op

__all__ = [
    "STATE_KWARG",
    "ForwardState",
    "LayerState",
    "MaskedState",
    "attention_name",
    "check_causal_lm",
    "compile_layers",
    "decoder_layers",
    "layer_outputs",
    "layers_at",
    "prepare_model",
    "input_device",
    "masked_forward",
    "prefill",
    "prefill_shared",
    "run_state",
    "shared_prefix_obstacle",
    "tree_forward",
    "vocab_size",
    "max_positions",
]

_BASES = ("sdpa", "eager")
_IMPLS = ("auto", "triton", "torch")


def attention_name(base: str) -> str:
    """Registry name of specdec's attention function falling back to ``base`` (sdpa or eager)."""
    return f"specdec_tree_{base}"


def check_causal_lm(model, name: str = "model") -> None:
    """Raise ``ValueError`` (naming ``name``) unless ``model`` is a decoder-only causal LM."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"{name}: expected a transformers PreTrainedModel (causal LM), got {type(model).__name__}")
    cfg = model.config
    kind = type(model).__name__
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(f"{name}: expected a decoder-only causal LM, got an encoder-decoder model ({kind})")
    text = cfg.get_text_config()
    if not getattr(text, "is_causal", True) or getattr(text, "use_bidirectional_attention", False):
        raise ValueError(f"{name}: expected causal attention, got a model configured as bidirectional ({kind})")
    if not model.can_generate():
        raise ValueError(f"{name}: expected a causal LM that can generate (e.g. AutoModelForCausalLM), got {kind}")
    flags = [m.is_causal for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "is_causal")]
    if not flags or not all(flags):
        raise ValueError(f"{name}: expected causal self-attention layers (is_causal=True, layer_idx), got {kind}")


def vocab_size(model) -> int:
    """Rows of the model's output embedding (the logits' last dim)."""
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "weight", None) is not None:
        return int(head.weight.shape[0])
    return int(model.config.get_text_config().vocab_size)


def num_layers(model) -> int | None:
    """The model's decoder layer count (``config.num_hidden_layers``), or None if it has none."""
    n = getattr(model.config.get_text_config(), "num_hidden_layers", None)
    return n if isinstance(n, int) and n > 0 else None



def eos_token_ids(model, tokenizer=None) -> list[int]:
    """End-of-sequence ids: ``model.generation_config.eos_token_id`` (an int or a list), then the
    tokenizer's ``eos_token_id``; deduplicated, in that order (empty if neither has one)."""
    ids: list[int] = []
    gc = getattr(model, "generation_config", None)
    for val in (getattr(gc, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if val is None:
            continue
        for v in [val] if isinstance(val, int) else list(val):
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids

def max_positions(model) -> int | None:
    """The model's context length (``max_position_embeddings``), or None if it declares none."""
    val = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return int(val) if val else None


def prepare_model(model, name: str = "model", fuse: bool = True) -> str:
    """Route ``model``'s attention through specdec's function (idempotent); return its registry name.

    The model keeps behaving as before for ordinary calls (``generate``, ``forward``): the function
    delegates to the previous implementation (``sdpa`` or the model's ``eager``; any other one,
    e.g. flash attention, is replaced by ``sdpa``, or ``eager`` where the model has no sdpa) when no
    ``specdec_state`` is passed.

    ``fuse``: also give each layer's q / k / v and gate / up projections one GEMM and its RMSNorms one
    op each in specdec's forwards (``specdec.fused.fuse_projections``, ``fuse_norms``: in place, no
    extra memory, the model's own calls unchanged). The first call decides; a later one on a
    prepared model changes nothing.
    """
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    check_causal_lm(model, name)
    current = model.config._attn_implementation
    if current in {attention_name(b) for b in _BASES}:
        return current
    if fuse:
        fuse_projections(model)
        fuse_norms(model)
    base = current if current in _BASES else ("sdpa" if getattr(model, "_supports_sdpa", False) else "eager")
    target = attention_name(base)
    AttentionInterface.register(target, _make_attention(base))
    AttentionMaskInterface.register(target, ALL_MASK_ATTENTION_FUNCTIONS[base])
    model.set_attn_implementation(target)
    if model.config._attn_implementation != target:
        raise ValueError(
            f"{name}: expected a model whose attention dispatches through transformers' AttentionInterface, "
            f"got {type(model).__name__}, which kept attn_implementation={model.config._attn_implementation!r}"
        )
    return target


def compile_layers(model) -> int:
    """Let ``model``'s decoder layers run a compiled forward in specdec's layer-wise compiled calls
    (idempotent); returns the number of layers.

    A decoder layer is a module with a direct child attention module that has ``layer_idx`` (every HF
    decoder-only model). Each gets a ``forward`` of its own that calls its class's forward through
    ``torch.compile`` -- one compiled function per (layer class, backend) for the whole process -- when
    the call carries a ``ForwardState`` whose ``layer_backend`` is set, handing the layer
    ``state.for_layer(i)`` instead of the state. Every other call (the model's own ``forward`` /
    ``generate``, specdec's other forwards) runs the class's forward as before. Every layer runs the same
    code, and the layer's ``LayerState`` carries its buffers as tensors, so one trace and one compile
    serve all layers of one kind (PyTorch's "regional compilation"; Gemma 3's sliding-window and full
    layers are two kinds): a fraction of a whole-model compile's time (specdec/PERF.md v19).
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"model: expected decoder layers (a child attention module with layer_idx), got none in "
                         f"{type(model).__name__}")
    for idx, module in layers.items():
        if not isinstance(module.__dict__.get("forward"), _LayerForward):
            module.forward = _LayerForward(module, idx)
    return len(layers)


def decoder_layers(model) -> dict[int, torch.nn.Module]:
    """``model``'s decoder layers by index: every module with exactly one direct child that has an int
    ``layer_idx`` (its attention module; every HF decoder-only model), keyed by that index."""
    layers = {}
    for module in model.modules():
        idx = [c.layer_idx for c in module.children() if isinstance(getattr(c, "layer_idx", None), int)]
        if len(idx) == 1:
            layers[idx[0]] = module
    return layers


class _LayerForward:
    """A decoder layer's ``forward`` under ``compile_layers`` (see there)."""

    def __init__(self, layer, layer_idx: int) -> None:
        self.layer = layer
        self.layer_idx = layer_idx

    def __call__(self, *args, **kwargs):
        layer = self.layer
        state = kwargs.get(STATE_KWARG)
        if isinstance(state, ForwardState) and state.layer_backend is not None and not torch.compiler.is_compiling():
            kwargs[STATE_KWARG] = state.for_layer(self.layer_idx)
            return _compiled_forward(type(layer), state.layer_backend)(layer, *args, **kwargs)
        return type(layer).forward(layer, *args, **kwargs)

    def __deepcopy__(self, memo):
        import copy

        return _LayerForward(copy.deepcopy(self.layer, memo), self.layer_idx)


_COMPILED_FORWARDS: dict = {}  # (layer class, backend) -> torch.compile of the class's forward

#: inductor options of the layer-wise compile: ``combo_kernels`` puts independent small kernels of a layer
#: into one launch (the query's RoPE beside the keys' RoPE and store; docs/ENGINE.md, "Compile"). Triton
#: code only: inductor's CPU code ignores it.
LAYER_INDUCTOR_OPTIONS = {"combo_kernels": True}


def _compiled_forward(cls, backend: str):
    key = (cls, backend)
    if key not in _COMPILED_FORWARDS:
        options = dict(LAYER_INDUCTOR_OPTIONS) if backend == "inductor" else None
        _COMPILED_FORWARDS[key] = torch.compile(cls.forward, backend=backend, fullgraph=False, dynamic=False,
                                                options=options)
    return _COMPILED_FORWARDS[key]


@dataclass(frozen=True, eq=False)
class LayerState:
    """One decoder layer's share of a ``ForwardState`` (``ForwardState.for_layer``): its KV buffers, and
    the shared prompt's, as tensors. ``compile_layers`` hands it to the layer in place of the state, so
    that nothing its compiled forward traces reads the layer's index (dynamo would specialize on it
    and compile every layer again)."""

    state: "ForwardState"
    k_buf: torch.Tensor
    v_buf: torch.Tensor
    shared_k: torch.Tensor | None = None
    shared_v: torch.Tensor | None = None

    def attend(self, module, query, key, value, scaling, sliding_window, softcap) -> tuple[torch.Tensor, None]:
        """``ForwardState.attend`` over this layer's buffers."""
        return self.state.attend(module, query, key, value, scaling, sliding_window, softcap, layer=self)


def _make_attention(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        state = kwargs.pop(STATE_KWARG, None)
        if state is None:
            return _fallback(base, module)(module, query, key, value, attention_mask, **kwargs)
        return state.attend(module, query, key, value, kwargs.get("scaling"), kwargs.get("sliding_window"),
                            kwargs.get("softcap"))

    attention.__name__ = f"specdec_tree_attention_{base}"
    return attention


def _fallback(base: str, module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"module: {type(module).__name__} has no eager_attention_forward to fall back to")
    return fn


@dataclass(frozen=True, eq=False)
class ForwardState:
    """Everything the attention layers need for one forward, passed as ``specdec_state=``.

    Attributes:
        cache: where keys / values are written and read.
        slots: int64 ``[B, m]``, the cache slot of each of the m input tokens.
        positions: int64 ``[B, m]``, their position ids (used by sliding-window layers).
        tree_mask: the tree of the m tokens (verification), or None for a prefill (causal over
            the m tokens, which start at slot 0).
        prefix_lens: int64 ``[B]``, committed tokens before the tree (verification only); with
            ``shared``, the committed tokens after the shared prompt (the suffix lengths).
        kv_len: attend over buffer slots ``[0, kv_len)`` of ``cache`` only (an eager-mode
            saving); None = the whole capacity (static shapes).
        impl: ``tree_attention``'s (or ``cascade_tree_attention``'s) ``impl``.
        shared: optional batch-1 ``KVCache`` holding a prompt that all B sequences share, at its
            slots ``[0, P)``, ``P = shared.lengths[0]`` (``prefill_shared`` builds it; any batch-1
            cache of capacity >= P works, e.g. one kept across calls). ``cache`` then holds only
            what follows the prompt: its slot s is position ``P + s`` (``slots`` index ``cache``,
            ``positions`` are absolute). Verification forwards only; each layer attends with
            ``treeattn.cascade.cascade_tree_attention`` over the prompt's KV once and each
            sequence's own suffix + tree. Not for sliding-window layers whose window is shorter
            than the context (``P + kv_len``; with ``shared_len``, ``shared.capacity + kv_len``)
            nor for soft-capped layers (``attend`` raises).
        shared_len: with ``shared``: None (P is the host int ``shared.lengths[0]``, attention over
            exactly ``[0, P)``: P becomes a shape), or int64 ``[1]`` on the model's device holding
            P as data: every layer attends over all ``shared.capacity`` slots of ``shared``, of
            which the kernel reads the first ``shared_len`` (``cascade_tree_attention``'s
            ``shared_len``), so nothing in the forward depends on P on the host: what a CUDA graph
            captured once for every prompt length needs (``specdec.graphs.GraphedForward(shared=)``).
            ``positions`` must then carry the offset P already.
        layer_backend: a torch.compile backend: each decoder layer runs one forward compiled for all
            layers (``compile_layers``, installed first) and gets ``for_layer(i)`` instead of this
            state; None (default): the layers run as they are (or as the caller compiled them).
    """

    cache: KVCache
    slots: torch.Tensor
    positions: torch.Tensor
    tree_mask: TreeMask | None = None
    prefix_lens: torch.Tensor | None = None
    kv_len: int | None = None
    impl: str = "auto"
    shared: KVCache | None = None
    shared_len: torch.Tensor | None = None
    layer_backend: str | None = None
    _moved: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.layer_backend is not None and not (isinstance(self.layer_backend, str) and self.layer_backend):
            raise ValueError(f"layer_backend: expected None or a torch.compile backend name, got {self.layer_backend!r}")
        if self.impl not in _IMPLS:
            raise ValueError(f"impl: expected one of {_IMPLS}, got {self.impl!r}")
        if (self.tree_mask is None) != (self.prefix_lens is None):
            raise ValueError("tree_mask, prefix_lens: expected both (verification) or neither (prefill)")
        if self.shared_len is not None and self.shared is None:
            raise ValueError("shared_len: expected None without a shared prompt (shared=None), got a tensor")
        if self.shared is not None:
            _check_shared(self.shared, self.tree_mask, self.shared_len)
            _shared_attention_outside_graph()  # built here, eagerly, before any compiled forward reads it

    def refresh(self) -> None:
        """Drop the per-device copies; call after updating the state's tensors in place."""
        self._moved.clear()

    def for_layer(self, layer_idx: int) -> "LayerState":
        """Layer ``layer_idx``'s share of this state: its KV buffers (and the shared prompt's) as tensors.
        The layer's buffers must exist (a prefill wrote them)."""
        if layer_idx not in self.cache.layer_indices:
            raise ValueError(f"cache: expected KV buffers for layer {layer_idx} (a prefill writes them) before a "
                             f"layer-wise compiled forward, got a cache without them")
        k_buf, v_buf = self.cache.buffers(layer_idx)
        shared_k, shared_v = (None, None) if self.shared is None else _shared_buffers(self.shared, layer_idx)
        return LayerState(self, k_buf, v_buf, shared_k, shared_v)

    def _on(self, device: torch.device) -> tuple:
        """The state's tensors on ``device`` (layers of a model split across devices: ``on_device``)."""
        return on_device(self._moved, device, (self.slots, self.positions, self.tree_mask, self.prefix_lens,
                                                self.shared_len))  # fmt: skip

    def attend(self, module, query, key, value, scaling, sliding_window, softcap,
               layer: "LayerState | None" = None) -> tuple[torch.Tensor, None]:  # fmt: skip
        """Write this layer's new K/V and attend. query ``[B, Hq, m, D]``, key / value ``[B, Hkv, m, D]``.

        ``layer``: the layer's buffers (``for_layer``), so that nothing here reads the module's layer
        index; None: looked up in ``cache`` (and ``shared``) by ``module.layer_idx``.

        Returns ``([B, m, Hq, D], None)`` as transformers' attention functions do.
        """
        slots, positions, tree_mask, prefix_lens, shared_len = self._on(query.device)
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        if layer is None:
            k_buf, v_buf = self.cache.write(layer_index(module), key, value, slots)
        else:
            k_buf, v_buf = store(layer.k_buf, layer.v_buf, key, value, slots)
        seq_len = self.cache.capacity if self.kv_len is None else self.kv_len
        if self.shared is not None:
            k_all, v_all = k_buf[:, :, :seq_len], v_buf[:, :, :seq_len]
            shared_kv = (_shared_buffers(self.shared, layer_index(module)) if layer is None
                         else (layer.shared_k, layer.shared_v))  # fmt: skip
            # Under torch.compile a device length goes through one opaque op; a host one stays outside the graph.
            opaque = shared_len is not None and torch.compiler.is_compiling()
            attention = _shared_attention if opaque else _shared_attention_outside_graph()
            out = attention(self.shared, shared_len, shared_kv, module, query, k_all, v_all, prefix_lens, tree_mask,
                            scale, self.impl, sliding_window, softcap)  # fmt: skip
            return out.transpose(1, 2), None
        window = sliding_window if sliding_window is not None and sliding_window < seq_len else None
        if tree_mask is None:
            if window is None and softcap is None:
                out = F.scaled_dot_product_attention(
                    query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1]
                )
            else:
                pos = positions[:, :, None] - positions[:, None, :]
                visible = (pos >= 0) & ((pos < window) if window is not None else True)
                out = masked_attention(query, key, value, visible, scale, softcap)
        else:
            k_all, v_all = k_buf[:, :, :seq_len], v_buf[:, :, :seq_len]
            if window is None and softcap is None and torch.compiler.is_compiling():
                # One opaque op for the compiler (no tracing into validation and the Triton launch).
                out = tree_attention_op(query, k_all, v_all, prefix_lens, tree_mask.words, tree_mask.depth, scale,
                                        self.impl)  # fmt: skip
            elif window is None and softcap is None:
                out = tree_attention(query, k_all, v_all, prefix_lens, tree_mask, scale=scale, impl=self.impl,
                                     check_prefix_lens=False)
            else:
                visible = tree_visibility(prefix_lens, tree_mask, slots, positions, seq_len, window)
                out = masked_attention(query, k_all, v_all, visible, scale, softcap)
        return out.transpose(1, 2), None



def _check_shared(shared, tree_mask, shared_len) -> None:
    """Raise ``ValueError`` (naming ``shared``) for a shared prefix ``ForwardState`` cannot use."""
    if not isinstance(shared, KVCache):
        raise ValueError(f"shared: expected a KVCache or None, got {type(shared).__name__}")
    if shared.batch_size != 1:
        raise ValueError(f"shared: expected a KVCache of batch size 1 (the one shared prompt), got batch size "
                         f"{shared.batch_size}")
    if tree_mask is None:
        raise ValueError("shared: expected a verification forward (tree_mask and prefix_lens set), got a prefill "
                         "(tree_mask None); prefill the shared prompt into its own cache (prefill_shared)")
    if not 0 <= shared.lengths[0] <= shared.capacity:
        raise ValueError(f"shared: expected a prompt length 0 <= lengths[0] <= capacity {shared.capacity}, got "
                         f"{shared.lengths[0]}")
    if shared_len is not None and (not isinstance(shared_len, torch.Tensor) or shared_len.dtype != torch.int64
                                   or tuple(shared_len.shape) != (1,)):  # fmt: skip
        got = (f"{shared_len.dtype} {tuple(shared_len.shape)}" if isinstance(shared_len, torch.Tensor)
               else type(shared_len).__name__)  # fmt: skip
        raise ValueError(f"shared_len: expected None or an int64 tensor of shape [1], got {got}")


def _shared_buffers(shared: KVCache, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prompt's ``[1, Hkv, C, D]`` key and value buffers of layer ``layer_idx``."""
    if layer_idx not in shared.layer_indices:
        raise ValueError(f"shared: expected the shared prompt's KV of layer {layer_idx} (prefill_shared with the "
                         f"same model), got a cache without it")
    return shared.buffers(layer_idx)


def _shared_attention(shared, shared_len, shared_kv, module, query, k_all, v_all, suffix_lens, tree_mask, scale, impl,
                      sliding_window, softcap) -> torch.Tensor:
    """``[B, Hq, n, D]``: the tree queries ``query`` ``[B, Hq, n, D]`` attending the shared prompt's KV
    ``shared_kv`` (``shared``'s buffers of this layer, slots ``[0, P)``: P = ``shared.lengths[0]``, or the
    device int64 ``[1]`` ``shared_len`` over all its slots) and each sequence's own ``k_all, v_all``
    ``[B, Hkv, S, D]`` (suffix at ``[0, suffix_lens[b])``, int64 ``[B]``, then the tree). ``module`` (the
    attention layer) only names its layer in errors."""
    # With a device length only the capacity bounds the prompt on the host.
    prompt_len = shared.lengths[0] if shared_len is None else shared.capacity
    if softcap is not None:
        raise ValueError(f"shared: expected no attention-logit soft-capping with a shared prefix, got softcap="
                         f"{softcap} in layer {layer_index(module)}")
    if sliding_window is not None and sliding_window < prompt_len + k_all.shape[2]:
        raise ValueError(f"shared: expected no sliding window shorter than the context ({prompt_len} shared + "
                         f"{k_all.shape[2]} per-sequence slots) with a shared prefix, got sliding_window="
                         f"{sliding_window} in layer {layer_index(module)}")
    k_sh, v_sh = shared_kv
    if torch.compiler.is_compiling():  # traced (only with shared_len): the custom op, no graph break
        return cascade_tree_attention_op(query, k_sh, v_sh, k_all, v_all, suffix_lens, shared_len, tree_mask.words,
                                         tree_mask.depth, scale, impl)  # fmt: skip
    return cascade_tree_attention(query, k_sh[:, :, :prompt_len], v_sh[:, :, :prompt_len], k_all, v_all, suffix_lens,
                                  tree_mask, scale=scale, impl=impl, shared_len=shared_len, check_suffix_lens=False)


_SHARED_OUTSIDE_GRAPH = None


def _shared_attention_outside_graph():
    """``_shared_attention`` behind ``torch.compiler.disable``: under torch.compile it runs eagerly, a graph
    break per layer (a host prompt length is a shape; with ``ForwardState.shared_len`` the compiled
    forward calls the opaque ``cascade_tree_attention_op`` instead). Built on first use, not at import
    (wrapping imports torch._dynamo, about 0.7 s)."""
    global _SHARED_OUTSIDE_GRAPH
    if _SHARED_OUTSIDE_GRAPH is None:
        _SHARED_OUTSIDE_GRAPH = torch.compiler.disable(_shared_attention)
    return _SHARED_OUTSIDE_GRAPH



def input_device(model) -> torch.device:
    """Where the model's input ids go (its input embedding's device)."""
    return model.get_input_embeddings().weight.device


@contextlib.contextmanager
def _head_inputs(model, enabled: bool, head_rows=None):
    """Collect the input of the model's output embedding (the final hidden states) during a call.

    ``head_rows``: None = the head runs on its whole input; else the head is handed only these rows
    of it (an int k: the last k; an int64 tensor: those positions, transformers' ``logits_to_keep``
    semantics) while the whole input is collected: features of every row, logits of a few.
    """
    got: list[torch.Tensor] = []
    if not enabled:
        yield got
        return
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"model: {type(model).__name__} has no output embedding (LM head) to take hidden states from")

    def hook(module, args):
        got.append(args[0])
        if head_rows is None:
            return None
        rows = slice(-head_rows, None) if isinstance(head_rows, int) else head_rows.to(args[0].device)
        return (args[0][:, rows],) + tuple(args[1:])

    handle = head.register_forward_pre_hook(hook)
    try:
        yield got
    finally:
        handle.remove()


def layers_at(model, indices: Sequence[int], name: str = "feature_layers") -> tuple[torch.nn.Module, ...]:
    """The decoder layers of ``model`` at ``indices`` (``decoder_layers``), in that order: what the
    forwards' ``feature_layers`` take (looked up once, not per forward). Raises ValueError naming
    ``name`` for an index that is no decoder layer."""
    found = decoder_layers(model)
    missing = [i for i in indices if i not in found]
    if missing:
        raise ValueError(f"{name}: expected decoder-layer indices of {type(model).__name__} (0 .. {len(found) - 1}), "
                         f"got {missing}")  # fmt: skip
    return tuple(found[i] for i in indices)


@contextlib.contextmanager
def layer_outputs(layers: Sequence[torch.nn.Module]):
    """Collect the outputs of the decoder-layer modules ``layers`` (``layers_at``) during a call: yields a
    list with one slot per layer (``[B, m, H]`` once it ran, else None), filled by forward hooks that
    live only for the ``with`` block."""
    got: list[torch.Tensor | None] = [None] * len(layers)

    def hook(slot: int):
        def keep(module, args, out):
            got[slot] = out[0] if isinstance(out, tuple) else out

        return keep

    handles = [layer.register_forward_hook(hook(j)) for j, layer in enumerate(layers)]
    try:
        yield got
    finally:
        for handle in handles:
            handle.remove()


def _kept_rows(x: torch.Tensor, logits_to_keep) -> torch.Tensor:
    """The rows of ``x [B, m, ...]`` whose logits ``logits_to_keep`` keeps (``run_state``'s semantics)."""
    if isinstance(logits_to_keep, int):
        return x if logits_to_keep == 0 else x[:, -logits_to_keep:]
    return x[:, logits_to_keep.to(x.device)]


def run_state(model, input_ids: torch.Tensor, positions: torch.Tensor, state, logits_to_keep=0,
              return_hidden: bool | str = False, feature_layers: Sequence[torch.nn.Module] | None = None):
    """One model forward with ``state`` handed to every attention layer; no host sync inside.

    Args:
        input_ids, positions: int64 ``[B, m]`` on the input embedding's device.
        state: the per-call metadata (a ``ForwardState`` or ``MaskedState``; its tensors are read,
            never reallocated).
        logits_to_keep: 0 = logits for all m tokens, k = only the last k; an int64 ``[k]`` tensor
            keeps those positions (transformers' semantics).
        return_hidden: also return the final hidden states: what the model's LM head reads (after
            the final norm), taken with a forward pre-hook on the output embedding that lives only
            for this call. True: of the rows whose logits are kept; ``"all"``: of all m rows (the
            LM head still runs on the kept rows only).
        feature_layers: with ``return_hidden``, return instead the outputs of these decoder-layer
            modules (``layers_at(model, indices)``: the residual stream after each, before the final
            norm), concatenated along the last dimension in this order, taken by forward hooks that
            live only for this call (None: the final hidden states).

    Returns:
        ``[B, m or k, V]`` logits, or ``(logits, hidden)`` with ``hidden`` ``[B, m or k, H]`` when
        ``return_hidden`` (``[B, m, H]`` with ``"all"``; ``H`` is ``len(feature_layers) * H`` with
        ``feature_layers``). With fixed-address inputs and ``state.kv_len=None`` this call is the
        body a CUDA graph would capture.
    """
    if return_hidden not in (False, True, "all"):
        raise ValueError(f"return_hidden: expected False, True or 'all', got {return_hidden!r}")
    every_row = return_hidden == "all"
    if return_hidden and feature_layers is not None:
        with layer_outputs(feature_layers) as got:
            out = _forward(model, input_ids, positions, state, logits_to_keep)
        if any(g is None for g in got):
            raise ValueError(f"feature_layers: expected decoder layers of the model that run in its forward, got "
                             f"{sum(g is None for g in got)} of {len(got)} that did not run")  # fmt: skip
        feats = torch.cat(got, dim=-1)
        return out.logits, feats if every_row else _kept_rows(feats, logits_to_keep)
    head_rows = None
    if every_row and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        head_rows = logits_to_keep
    with _head_inputs(model, bool(return_hidden), head_rows) as hidden:
        out = _forward(model, input_ids, positions, state, 0 if every_row else logits_to_keep)
    if not return_hidden:
        return out.logits
    if len(hidden) != 1:
        raise ValueError(f"model: expected its LM head to run once per forward, it ran {len(hidden)} times")
    return out.logits, hidden[0]


def _forward(model, input_ids: torch.Tensor, positions: torch.Tensor, state, logits_to_keep):
    """The model's call of ``run_state`` (its output object)."""
    # A 4-D mask counts as "already prepared": transformers builds none (the state carries the real one).
    dummy_mask = torch.ones(input_ids.shape[0], 1, 1, 1, dtype=torch.bool, device=input_ids.device)
    return model(
        input_ids=input_ids,
        position_ids=positions,
        attention_mask=dummy_mask,
        past_key_values=None,
        use_cache=False,
        logits_to_keep=logits_to_keep,
        **{STATE_KWARG: state},
    )


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache: KVCache, impl: str = "auto",
            hidden_at: torch.Tensor | None = None, all_hidden: bool = False,
            feature_layers: Sequence[torch.nn.Module] | None = None) -> torch.Tensor | None:  # fmt: skip
    """Write the KV of ``input_ids`` to cache slots ``[0, m)`` (causal attention, positions 0..m-1).

    Args:
        model: a causal LM after ``prepare_model``.
        input_ids: int64 ``[B, m]``; right-padded rows are fine (padding only follows real tokens).
        cache: the cache to fill; its lengths are left to the caller.
        hidden_at: optional int64 ``[B]``: return row b's final hidden state at position
            ``hidden_at[b]`` (e.g. its last real token).
        all_hidden: return the final hidden states of all m positions (row b's are valid up to its
            last real token); the LM head still runs on one position per row only (no ``[B, m, V]``
            logits). Not together with ``hidden_at``.
        feature_layers: the hidden states are the outputs of these decoder-layer modules,
            concatenated (``run_state``'s): ``H`` below is ``len(feature_layers) * H``.

    Returns:
        None, ``[B, H]`` final hidden states (the LM head's input) when ``hidden_at`` is given, or
        ``[B, m, H]`` with ``all_hidden``.
    """
    if all_hidden and hidden_at is not None:
        raise ValueError("hidden_at: expected None with all_hidden=True (which returns every position's)")
    batch, m = input_ids.shape
    device = input_device(model)
    ids = input_ids.to(device)
    positions = torch.arange(m, device=device).expand(batch, m)
    state = ForwardState(cache=cache, slots=positions, positions=positions, impl=impl)
    if all_hidden:
        return run_state(model, ids, positions, state, logits_to_keep=1, return_hidden="all",
                         feature_layers=feature_layers)[1]  # fmt: skip
    if hidden_at is None:
        run_state(model, ids, positions, state, logits_to_keep=1)
        return None
    at = hidden_at.to("cpu", torch.int64)
    keep = torch.unique(at)  # sorted; the LM head runs on these positions only
    _, hidden = run_state(model, ids, positions, state, logits_to_keep=keep.to(device), return_hidden=True,
                          feature_layers=feature_layers)  # fmt: skip
    cols = torch.searchsorted(keep, at).to(hidden.device)
    return hidden[torch.arange(batch, device=hidden.device), cols]


@torch.no_grad()
def prefill_shared(model, prompt_ids: torch.Tensor, num_layers: int | None = None, impl: str = "auto", *,
                   return_hidden: bool | str = False):
    """The KV of one prompt that several sequences share: ``ForwardState.shared`` / ``tree_forward(shared=)``.

    Args:
        model: a causal LM after ``prepare_model``.
        prompt_ids: int64 ``[1, P]`` (or ``[P]``), ``P >= 1``.
        num_layers: as ``KVCache``'s (one stacked allocation), e.g. ``num_layers(model)``.
        impl: ``prefill``'s ``impl``.
        return_hidden: also return the prompt's final hidden states (the LM head's input; the head
            runs on one position): True: of its last position, ``[1, H]`` (``prefill``'s
            ``hidden_at``); ``"all"``: of all P positions, ``[1, P, H]`` (``all_hidden``).

    Returns:
        A ``KVCache(1, P)`` whose slots ``[0, P)`` hold the prompt's KV (``prefill``), ``lengths == [P]``;
        ``(cache, hidden)`` with ``return_hidden``.
    """
    if return_hidden not in (False, True, "all"):
        raise ValueError(f"return_hidden: expected False, True or 'all', got {return_hidden!r}")
    ids = prompt_ids[None] if prompt_ids.dim() == 1 else prompt_ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1:
        raise ValueError(f"prompt_ids: expected shape [1, P] or [P] with P >= 1, got {tuple(prompt_ids.shape)}")
    length = int(ids.shape[1])
    cache = KVCache(1, length, num_layers=num_layers)
    at = torch.tensor([length - 1]) if return_hidden is True else None
    hidden = prefill(model, ids, cache, impl=impl, hidden_at=at, all_hidden=return_hidden == "all")
    cache.lengths = [length]
    return (cache, hidden) if return_hidden else cache


def shared_prefix_obstacle(model, context: int) -> str | None:
    """Why a shared prompt (``ForwardState.shared``) cannot serve ``model`` over ``context`` positions
    (shared prompt + per-sequence slots), as its config says; None if nothing stands in the way.

    The cascade attention has no soft-capping and no sliding window: a config with
    ``attn_logit_softcapping`` set, or with a ``sliding_window`` shorter than ``context`` on some
    layer (every layer unless ``layer_types`` names the ``"sliding_attention"`` ones), is refused.
    The attention function checks each layer again (``ForwardState.attend`` raises).
    """
    text = model.config.get_text_config()
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"attention-logit soft-capping (attn_logit_softcapping={softcap})"
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if isinstance(window, int) and window < context and (types is None or "sliding_attention" in types):
        return f"a sliding window of {window} positions, shorter than the context of {context}"
    return None


@torch.no_grad()
def tree_forward(
    model,
    tokens: torch.Tensor,
    tree_mask: TreeMask,
    prefix_lens: torch.Tensor,
    cache: KVCache,
    *,
    kv_len: int | None = None,
    impl: str = "auto",
    return_hidden: bool = False,
    shared: KVCache | None = None,
    shared_len: torch.Tensor | None = None,
    feature_layers: Sequence[torch.nn.Module] | None = None,
):
    """Score every node of B token trees in one forward over the committed KV.

    Args:
        model: a causal LM after ``prepare_model``.
        tokens: int64 ``[B, n]``, node tokens (node 0 = root, the last committed token).
        tree_mask: ``TreeMask`` of the B trees (n nodes each).
        prefix_lens: int64 ``[B]``, committed KV length of each sequence (``cache.lengths``); the
            caller guarantees ``prefix_lens[b] + n <= cache.capacity`` (``cache.check_room``).
        cache: the KV cache; node j's KV is written to slot ``prefix_lens[b] + j``.
        kv_len: attend over slots ``[0, kv_len)`` only (eager saving; needs
            ``kv_len >= max(prefix_lens) + n``); None = full capacity (static shapes).
        impl: ``tree_attention``'s ``impl``.
        return_hidden: also return the ``[B, n, H]`` final hidden states (see ``run_state``).
        shared: a prompt all B sequences share (``prefill_shared``; ``ForwardState.shared``), P =
            ``shared.lengths[0]`` tokens. ``cache`` and ``prefix_lens`` then describe only what
            follows the prompt: node j's KV goes to slot ``prefix_lens[b] + j`` of ``cache``, its
            position id is ``P + prefix_lens[b] + depth``.
        shared_len: with ``shared``, optional int64 ``[1]`` on the model's device: P as data
            (``ForwardState.shared_len``: attention over all of ``shared``'s capacity, of which the
            first P slots are read; the positions offset on the device), instead of the host int
            ``shared.lengths[0]``.
        feature_layers: with ``return_hidden``, the outputs of these decoder-layer modules instead
            of the final hidden states, concatenated: ``[B, n, len(feature_layers) * H]`` (``run_state``).

    Returns:
        ``[B, n, V]`` logits; row i is the target's prediction after node i's root path (and the
        hidden states when ``return_hidden``).
    """
    device = input_device(model)
    batch, n = tokens.shape
    tree_mask = tree_mask.to(device)
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    if shared_len is not None:
        shared_len = shared_len.to(device)
    if shared is None:
        offset = prefix
    else:
        offset = prefix + (shared.lengths[0] if shared_len is None else shared_len)
    positions = tree_mask.position_ids(offset)
    slots = prefix[:, None] + torch.arange(n, device=device)
    state = ForwardState(cache=cache, slots=slots, positions=positions, tree_mask=tree_mask, prefix_lens=prefix,
                         kv_len=kv_len, impl=impl, shared=shared, shared_len=shared_len)
    return run_state(model, tokens.to(device), positions, state, return_hidden=return_hidden,
                     feature_layers=feature_layers)


@torch.no_grad()
def masked_forward(
    model,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    visible: torch.Tensor,
    cache: KVCache,
    *,
    key_positions: torch.Tensor | None = None,
    logits_to_keep=0,
    return_hidden: bool = False,
):
    """Run m tokens per sequence that attend through an explicit mask (``MaskedState``).

    Args:
        model: a causal LM after ``prepare_model``.
        tokens, positions, slots: int64 ``[B, m]``: input tokens, their position ids and the cache
            slots their KV is written to.
        visible: bool ``[B, m, kv_len]``, which slots each token attends to (its own included).
        cache: the KV cache (``kv_len <= cache.capacity``).
        key_positions: int64 ``[B, kv_len]`` position id per slot, for sliding-window layers.
        logits_to_keep: as in ``run_state`` (0 = all m tokens, k = the last k).
        return_hidden: also return the final hidden states (``[B, m or k, H]``).

    Returns:
        ``[B, m or k, V]`` logits (and the hidden states when ``return_hidden``).
    """
    device = input_device(model)
    state = MaskedState(cache, slots.to(device), positions.to(device), visible.to(device),
                        None if key_positions is None else key_positions.to(device))
    return run_state(model, tokens.to(device), state.positions, state, logits_to_keep=logits_to_keep,
                     return_hidden=return_hidden)
