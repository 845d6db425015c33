"""One GEMM for the sibling projections that read the same input (q / k / v, gate / up).

A decoder layer of a stock HF causal LM computes ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` (and
``gate_proj(x)``, ``up_proj(x)``) as separate GEMMs over the same ``x``. At decode sizes (a few to a
few hundred rows) the small ones are latency-bound: on the H100 the 1.5B's k and v take ~5 µs each
for 0.8 MB of weights (PERF.md v17). ``fuse_projections(model)`` concatenates each such group's
weights once, in place, into one ``[sum(out), in]`` tensor; the group's ``Linear`` modules are replaced
by ``FusedPart`` modules whose ``weight`` / ``bias`` parameters are views of it (no extra memory; the
state dict keeps its keys, shapes and values).

**Only specdec's forwards use the fused GEMM.** A forward pre-hook on each group's parent (the decoder
layer) arms the layer's groups when the call carries specdec's ``ForwardState`` keyword (the same
condition under which specdec's attention function takes over from the model's own); a forward hook
disarms them. Armed, the first part called on an input runs the group's one GEMM and keeps its output
for the other parts called on that same tensor; unarmed, every part runs its own ``F.linear`` over its
view, as the original module did. So the model's own ``forward`` / ``generate`` (the baselines) run the
same GEMMs as before fusing.

**The layers' RMSNorms as one op** (``fuse_norms``, after ``fuse_projections``). Eagerly, a stock
RMSNorm (``x.float()``, square, mean, add, rsqrt, multiply, cast, scale) launches about eight
kernels; inside a CUDA graph each costs its launch slot whatever its size, and a decoder layer runs
two norms. A layer's RMSNorm children whose map is ``F.rms_norm``'s (checked numerically when
fused, so a variant such as Gemma's ``1 + weight`` scale is left alone) run as one
``F.rms_norm(x, weight.shape, weight, eps)`` in specdec's forwards (armed with the layer's groups),
their own code otherwise. Only the rounding differs: the weight scales in float32 before the one cast
to the input's dtype (the stock code casts first, then scales in that dtype).

Not fused: groups whose modules are not plain ``nn.Linear`` (quantized layers), carry hooks (tensor
parallelism, accelerate offloading), live on the meta device or differ in input size, dtype, device or
bias presence. ``unfuse_projections(model)`` restores plain ``nn.Linear`` modules with weights of their
own (e.g. before ``save_pretrained``, whose safetensors writer refuses parameters sharing memory).
Moving, casting and deep-copying a fused model keep the parameters views of the fused tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention import STATE_KWARG

__all__ = ["GROUPS", "FusedNorm", "FusedPart", "fuse_norms", "fuse_projections", "fused_groups", "fused_norms",
           "unfuse_norms", "unfuse_projections"]

#: The sibling projections fused, by child name, in output order.
GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Group(nn.Module):
    """The concatenated weight (and bias) of one group and its armed / memo state.

    ``weight``: ``[sum(sizes), in]``, a non-persistent buffer (the parts' parameters are its views).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.sizes = sizes
        self.armed = False
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] | None = None

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Part ``index`` of ``x @ weight.T + bias``: one GEMM per input tensor, ``[..., sizes[index]]``."""
        if self._input is not x:
            self._input = x
            self._outputs = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        return self._outputs[index]

    def arm(self, armed: bool) -> None:
        self.armed = armed
        self._input = None
        self._outputs = None


class FusedPart(nn.Linear):
    """One projection of a fused group: an ``nn.Linear`` whose parameters view the group's tensor.

    ``forward(x)``: ``[..., in] -> [..., out]``, the same map as the original module; through the
    group's single GEMM while the group is armed (a specdec forward), else its own ``F.linear``.

    The views survive what would otherwise give the parameters storage of their own: moving or
    casting (``.to``, ``.half``: the part converts the group's tensor, idempotently, and views it
    again) and ``copy.deepcopy`` (the copy views the copied group's tensor), so an in-place update
    of a parameter (training, a perturbed copy) always reaches the fused GEMM.
    """

    def __init__(self, group: _Group, index: int, start: int, requires_grad: bool) -> None:
        nn.Module.__init__(self)
        self.in_features = group.weight.shape[1]
        self.out_features = group.sizes[index]
        self.index = index
        self.start = start
        object.__setattr__(self, "group", group)  # not a submodule: the group belongs to the layer
        self.weight = nn.Parameter(self._slice(group.weight), requires_grad=requires_grad)
        bias = None if group.bias is None else nn.Parameter(self._slice(group.bias), requires_grad=requires_grad)
        self.register_parameter("bias", bias)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        return t[self.start : self.start + self.out_features]

    def _view(self) -> None:
        """Point the parameters (same objects) at their rows of the group's tensor."""
        self.weight.data = self._slice(self.group.weight)
        if self.bias is not None:
            self.bias.data = self._slice(self.group.bias)

    def _apply(self, fn, recurse: bool = True):
        self.group._apply(fn)  # a conversion: the second part's call finds it done
        self._view()
        return self

    def __deepcopy__(self, memo):
        import copy

        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        state = {k: v for k, v in self.__dict__.items() if k not in ("group", "_parameters")}
        new.__dict__.update(copy.deepcopy(state, memo))
        group = copy.deepcopy(self.group, memo)
        object.__setattr__(new, "group", group)
        new._parameters = {name: None if p is None else nn.Parameter(new._slice(getattr(group, name)), p.requires_grad)
                           for name, p in self._parameters.items()}  # fmt: skip
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.armed:
            return self.group.output(x, self.index)
        return F.linear(x, self.weight, self.bias)


def _fusable(linears: list) -> bool:
    if not all(type(m) is nn.Linear for m in linears):
        return False
    first = linears[0].weight
    for m in linears:
        w = m.weight
        if m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") or type(w.data) is not torch.Tensor:
            return False
        if w.device.type == "meta" or w.device != first.device or w.dtype != first.dtype:
            return False
        if w.shape[1] != first.shape[1] or (m.bias is None) != (linears[0].bias is None):
            return False
    return True


class FusedNorm(nn.Module):
    """What ``fuse_norms`` mixes into an RMSNorm's class (``FusedNorm`` first, the norm's own class
    after it): ``forward(x)`` ``[..., H] -> [..., H]`` is one ``F.rms_norm`` while armed (a specdec
    forward), the class's own ``forward`` otherwise, and for float64 inputs (stock norms compute in
    float32 at most, ``F.rms_norm`` would in float64: references stay the model's). State-dict keys,
    parameters and ``repr`` stay the norm's; ``specdec_eps`` is its epsilon."""

    specdec_armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.specdec_armed and x.dtype != torch.float64:
            return F.rms_norm(x, self.weight.shape, self.weight, self.specdec_eps)
        return super().forward(x)


_NORM_CLASSES: dict[type, type] = {}


def _fused_norm_class(base: type) -> type:
    """``FusedNorm`` mixed into ``base`` (one class per base, so copies and isinstance checks agree)."""
    cls = _NORM_CLASSES.get(base)
    if cls is None:
        cls = _NORM_CLASSES[base] = type(base.__name__, (FusedNorm, base), {"__module__": base.__module__})
    return cls


@torch.no_grad()
def _rms_norm_eps(module: nn.Module) -> float | None:
    """The epsilon of ``module`` when it is an RMSNorm whose map is ``F.rms_norm(x, [H], weight, eps)``
    (checked on a fixed random float32 input, its own forward against ``F.rms_norm``), else None."""
    if isinstance(module, FusedNorm) or not type(module).__name__.endswith("RMSNorm"):
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or weight.device.type == "meta":
        return None
    if not isinstance(eps, float) or module._forward_hooks or module._forward_pre_hooks:
        return None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, weight.shape[0], generator=gen).to(weight.device)
    try:
        want = module(x).float()
    except (RuntimeError, TypeError, ValueError):  # a norm that takes no float32 input: not checked, not fused
        return None
    got = F.rms_norm(x, weight.shape, weight.float(), eps)
    return eps if want.shape == got.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-5) else None


def _layer_groups(layer: nn.Module) -> list[_Group]:
    return [m for m in layer.modules() if isinstance(m, _Group)]


def _layer_norms(layer: nn.Module) -> list[FusedNorm]:
    return [m for m in layer.children() if isinstance(m, FusedNorm)]


def _arm(layer, args, kwargs):
    """Forward pre-hook of a layer holding fused groups: arm them (and its fused norms) for a specdec
    forward only."""
    on = kwargs.get(STATE_KWARG) is not None
    for g in _layer_groups(layer):
        g.arm(on)
    for norm in _layer_norms(layer):
        norm.specdec_armed = on


def _disarm(layer, args, *rest):
    for g in _layer_groups(layer):
        g.arm(False)
    for norm in _layer_norms(layer):
        norm.specdec_armed = False


# The hooks are module-level functions that find the groups from the layer they are called on (no
# closure over this model's groups), so a deep copy of a fused model arms its own groups.
def _hooked(layer: nn.Module) -> bool:
    return any(fn is _arm for fn in layer._forward_pre_hooks.values())


def _unhook(layer: nn.Module) -> None:
    for key, fn in list(layer._forward_pre_hooks.items()):
        if fn is _arm:
            del layer._forward_pre_hooks[key]
            layer._forward_pre_hooks_with_kwargs.pop(key, None)
    for key, fn in list(layer._forward_hooks.items()):
        if fn is _disarm:
            del layer._forward_hooks[key]
            layer._forward_hooks_always_called.pop(key, None)


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Fuse every q / k / v and gate / up group of ``model`` in place (idempotent).

    Returns the number of groups fused by this call (0 when none is left to fuse). See the module
    docstring for what is fused, when the fused GEMM runs, and what is skipped.
    """
    names = dict(model.named_modules())
    by_layer: dict[str, list[_Group]] = {}
    for name, holder in names.items():
        if not name:
            continue
        parent = name.rpartition(".")[0]
        for group_names in GROUPS:
            linears = [getattr(holder, n, None) for n in group_names]
            if any(m is None for m in linears) or not _fusable(linears):
                continue
            sizes = tuple(m.out_features for m in linears)
            weight = torch.cat([m.weight for m in linears])
            bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
            group = _Group(weight, bias, sizes)
            start = 0
            for i, (n, m) in enumerate(zip(group_names, linears)):
                setattr(holder, n, FusedPart(group, i, start, m.weight.requires_grad))
                start += sizes[i]
            holder.register_module(f"specdec_fused_{group_names[0]}", group)
            by_layer.setdefault(parent, []).append(group)
    for parent in by_layer:
        layer = names[parent] if parent else model
        if not _hooked(layer):
            layer.register_forward_pre_hook(_arm, with_kwargs=True)
            layer.register_forward_hook(_disarm, always_call=True)
    return sum(len(g) for g in by_layer.values())


@torch.no_grad()
def fuse_norms(model: nn.Module) -> int:
    """Run the RMSNorms of every layer that ``fuse_projections`` fused (its direct children) as one
    ``F.rms_norm`` in specdec's forwards (idempotent; see the module docstring).

    Returns the number of norms fused by this call.
    """
    count = 0
    for layer in model.modules():
        if not _hooked(layer):
            continue
        for child in layer.children():
            eps = _rms_norm_eps(child)
            if eps is not None:
                child.__class__ = _fused_norm_class(type(child))
                child.specdec_eps = eps
                count += 1
    return count


def unfuse_norms(model: nn.Module) -> int:
    """Undo ``fuse_norms``: every fused norm back to its own class (its own code in every forward).
    Returns the number of norms restored."""
    norms = fused_norms(model)
    for norm in norms:
        norm.__class__ = type(norm).__bases__[1]
        del norm.specdec_eps
        norm.__dict__.pop("specdec_armed", None)
    return len(norms)


def fused_groups(model: nn.Module) -> list[_Group]:
    """The fused groups inside ``model`` (in module order)."""
    return [m for m in model.modules() if isinstance(m, _Group)]


def fused_norms(model: nn.Module) -> list[FusedNorm]:
    """The fused norms inside ``model`` (in module order)."""
    return [m for m in model.modules() if isinstance(m, FusedNorm)]


@torch.no_grad()
def unfuse_projections(model: nn.Module) -> int:
    """Undo ``fuse_projections`` and ``fuse_norms``: plain ``nn.Linear`` modules with weights of their
    own, the norms' own classes, hooks removed.

    Returns the number of groups restored.
    """
    count = 0
    unfuse_norms(model)
    for module in list(model.modules()):
        _unhook(module)
        for key, child in list(module.named_children()):
            if isinstance(child, FusedPart):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                  device="meta")
                plain.weight = nn.Parameter(child.weight.detach().clone(), requires_grad=child.weight.requires_grad)
                if child.bias is not None:
                    plain.bias = nn.Parameter(child.bias.detach().clone(), requires_grad=child.bias.requires_grad)
                setattr(module, key, plain)
            elif isinstance(child, _Group):
                delattr(module, key)
                count += 1
    return count
