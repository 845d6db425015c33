"""The tree-attention op: input validation, launch configuration, and the torch fallback."""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from treeattn.layout import TreeMask

__all__ = ["KernelConfig", "tree_attention", "tree_attention_op", "pick_config", "interpreter_enabled"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_IMPLS = ("auto", "triton", "torch")
_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256


def interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1``, read at kernel import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the Triton kernel.

    ``gather`` picks the last split's tree part. True (v6/v7/v10): it attends the tree keys that
    some row of its block sees (with one split also the prompt's ragged tail), compacted into
    tiles of ``block_t`` keys (16, 32, 64 or 128; a block of 16-32 depth-first nodes of a
    depth-8 tree sees <= 40 keys); narrower tiles are cheaper but overflow into a second tile more
    often; ``pick_config`` takes the smallest power of two that holds the estimated union. False
    (v3): a masked tile for the tail, then every 64-key tile of the tree up to the block's last
    node, masked by the ancestor words (``block_t`` unused).
    ``warp_specialize`` asks Triton to split the prompt loop's loads and math over warp groups
    (Triton >= 3.4; an experiment for the benchmark's sweep, off by default).
    ``num_splits`` is how many programs share one prompt (flash-decoding split; ``None``: chosen
    from the shapes). 1 runs a single stage that writes the output directly; more add a merge of
    the partial results by log-sum-exp. ``programs_per_sm``: how many programs of this config the
    default split count assumes an SM runs at once (2 for 64x64 tiles / 4 warps: 112 KB of shared
    memory and <= 255 registers per thread fit twice; one program's softmax then overlaps the
    other's matmuls).
    ``partials_in_input_dtype``: with several splits, store the normalized partial outputs in the
    input dtype instead of float32 (the log-sum-exps stay float32). A partial output is a convex
    combination of V rows, so it cannot overflow the input dtype; for 16-bit inputs this adds one
    rounding per split (bf16: relative error 2.8e-3 instead of 2.3e-3 at 4000/256, SDPA's own is
    2.3e-3) and halves the partials' traffic. Off by default: at 4000/256 (64x64, 2 splits) it
    gained 43.4 -> 41.9 us when Triton's bundled ptxas (12.8) compiled the kernel but lost 43.7 ->
    44.7 with torch's (13.0; set once torch.compile has run in the process), and at 4 splits the
    merge kernel ran 2x slower on 16-bit partials (4000/128).
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    num_splits: int | None = None
    warp_specialize: bool = False
    block_t: int = 64
    gather: bool = True
    partials_in_input_dtype: bool = False
    programs_per_sm: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            val = getattr(self, name)
            if val < 16 or val & (val - 1):
                raise ValueError(f"{name}: expected a power of two >= 16, got {val}")
        if self.block_t not in (16, 32, 64, 128):
            raise ValueError(f"block_t: expected 16, 32, 64 or 128, got {self.block_t}")
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits: expected None or >= 1, got {self.num_splits}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm: expected >= 1, got {self.programs_per_sm}")


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_config(batch: int, num_kv_heads: int, group: int, n: int, seq_len: int, head_dim: int,
                device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[KernelConfig, SplitPlan]:
    """Choose (config, split plan) for one call from the shapes (tuned on an H100 in bf16, see
    PERF.md), shrunk to fit the device's shared memory for wider dtypes and head dims.

    Tree part (measured on the H100, 2026-11-21): gathered tiles for large trees under short
    prompts (n >= 256, prompt < 8192), v3's word tiles elsewhere. Gathered tiles won at 1024/256
    (17.5-17.9 us vs 19.8-20.0 in v3 mode, same sweep) and 4000/256 (45.9-46.6 vs 47.3-47.8); the
    gather's fixed latency loses at t <= 128 and at L = 16000. Where those gathered cells have
    >= 512 rows over a prompt >= 2048 (v10): 64x64 tiles, two programs per SM (4000/256: 43.3-43.7
    us vs 45.6-46.4 for 128x128 / 8 warps, with either ptxas). Several splits are merged by a
    second kernel (an in-kernel merge by the last program of each row block was slower in every
    cell with splits > 1). PERF.md has the tables.

    Pure host arithmetic: no device sync, so it works inside CUDA-graph capture.
    """
    rows = group * n
    big = KernelConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)  # two warpgroups
    if head_dim > 128:
        cfg = KernelConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    elif seq_len >= 8192:
        cfg = big if rows >= 256 else KernelConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)
    elif seq_len >= 2048 and rows >= 512 and n >= 256:
        # The gathered regime's large cells (4000/256): 64x64 tiles, whose 112 KB of shared memory
        # let two programs share an SM, one's softmax overlapping the other's matmuls.
        cfg = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, programs_per_sm=2)
    elif seq_len >= 2048 and rows >= 512:
        cfg = big
    elif rows > 512:
        cfg = KernelConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)
    else:
        cfg = KernelConfig(block_m=64, block_n=64, num_warps=4, num_stages=3)
    esize = torch.finfo(dtype).bits // 8
    while _shared_bytes(cfg, head_dim, esize) > _shared_limit(device):
        cfg = _shrink(cfg)
    # Several programs per SM only while their shared memory fits side by side (an SM has the
    # per-block limit + 1 KB; each program reserves 1 KB): not for fp32 at d = 128.
    if cfg.programs_per_sm * (_shared_bytes(cfg, head_dim, esize) + 1024) > _shared_limit(device) + 1024:
        cfg = replace(cfg, programs_per_sm=1)
    cfg = _pick_block_t(replace(cfg, gather=n >= 256 and seq_len - n < 8192), group, n)
    return cfg, _splits(cfg, batch, num_kv_heads, rows, seq_len - n, n, device)


def _pick_block_t(cfg: KernelConfig, group: int, n: int) -> KernelConfig:
    """The smallest power of two that holds the estimated tree union of a row block
    (``block_m / group`` nodes + 8 ancestors, ``_tree_steps_estimate``), in [16, 64] and at most
    ``block_n`` (no more shared memory than the prompt loop). 128 was never the best in the v7
    sweep: a prompt tail that does not fit beside the union takes a second, narrow gathered step
    (1024/256 at 64x128: 16 + 8 keys -> 32; 4000/256 at 128x128: 32 + 8 -> 64).
    """
    union = _union_estimate(cfg, group, n)
    return replace(cfg, block_t=min(64, cfg.block_n, max(16, _next_pow2(max(union, 1)))))


def _shared_bytes(cfg: KernelConfig, head_dim: int, esize: int) -> int:
    """Estimated shared memory of one program: the Q tile plus ``num_stages`` K and V tiles of the
    wider of the prompt loop (``block_n`` keys) and the tree loop (``block_t`` keys)."""
    keys = max(cfg.block_n, cfg.block_t)
    return esize * _next_pow2(max(16, head_dim)) * (cfg.block_m + 2 * keys * cfg.num_stages)


def _shared_limit(device: torch.device) -> float:
    if device.type != "cuda":
        return math.inf  # the interpreter has no shared memory limit
    props = torch.cuda.get_device_properties(device.index or 0)
    return getattr(props, "shared_memory_per_block_optin", 101376)


def _shrink(cfg: KernelConfig) -> KernelConfig:
    """The next smaller config: fewer stages, then narrower KV tiles (prompt and tree tiles no
    wider than ``block_n``), then fewer rows."""
    if cfg.num_stages > 2:
        return replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 32:
        return replace(cfg, block_n=cfg.block_n // 2, block_t=min(cfg.block_t, cfg.block_n // 2))
    if cfg.block_m > 32:
        return replace(cfg, block_m=cfg.block_m // 2, num_warps=4, block_t=min(cfg.block_t, cfg.block_n))
    if cfg.num_stages > 1:
        return replace(cfg, num_stages=1, block_t=min(cfg.block_t, cfg.block_n))
    if cfg.block_n > 16 or cfg.block_m > 16 or cfg.block_t > 16:
        return replace(cfg, block_n=16, block_m=16, block_t=16)
    raise ValueError(f"config: no smaller kernel config than {cfg} to fit the device's shared memory")


class SplitPlan(NamedTuple):
    """How one call cuts the prompt over the split axis (``count`` programs per row block)."""

    count: int
    chunk: int  # prompt keys per split (v3 mode: every split; GATHER mode: the non-last ones)
    first: int  # GATHER mode: the last split's keys [0, first), whole tiles (0 in v3 mode)


# What one gathered tree step costs in prompt-tile steps on the last split (measured on the H100
# by per-program timestamps, 2026-11-21: 3.9 us per gathered step against 2.0 us per 128x128
# prompt tile at 4000/256, 3.0 against 1.6 at 64x128 for 1024/256): the chain from the union's
# compaction over gathered, unpipelined loads to the tile's two matmuls.
_GATHER_STEP_TILES = 2


def _splits(cfg: KernelConfig, batch: int, num_kv_heads: int, rows: int, max_prefix: int, n: int,
            device: torch.device, min_chunk: int = 256) -> SplitPlan:
    """Cut the prompt over the split axis: ``cfg.num_splits`` programs or, by default, about one
    program per SM (but chunks of at least ``min_chunk`` keys).

    ``cfg.gather`` (balanced in tile steps; a step costs about the same whatever number of its keys
    is real): the last split runs ``first`` keys of full prompt tiles from the start, then the
    gathered tree steps (``_tree_steps_estimate``, each worth ``_GATHER_STEP_TILES`` tiles); the
    other splits share the rest in chunks of whole tiles, the prompt's ragged end (``max_prefix %
    block_n`` keys) as one masked tile in the one that reaches it. With one split the program runs
    the whole prompt and gathers the ragged tail with the tree. Else v3's rule, as measured on
    ``main``: the chunks spread ``max_prefix + n`` keys evenly, the last split adding the tree.
    """
    bn = cfg.block_n
    tiles = max_prefix // bn
    ragged = int(max_prefix % bn > 0)
    one = SplitPlan(1, max(max_prefix, 1), math.ceil(max_prefix / bn) * bn if cfg.gather else 0)
    if cfg.gather:
        tree = _GATHER_STEP_TILES * _tree_steps_estimate(cfg, rows // max(n, 1), n)
        work = tiles + ragged + tree
        keys = work * bn
    else:
        keys = work = max_prefix + n
    if cfg.num_splits is not None:
        want = cfg.num_splits
    else:
        per_split = math.ceil(rows / cfg.block_m) * batch * num_kv_heads
        sms = _num_sms(device.index or 0) if device.type == "cuda" else 4
        want = min(round(sms * cfg.programs_per_sm / per_split), math.ceil(keys / min_chunk))
    if want <= 1 or max_prefix <= 0:
        return one
    if not cfg.gather:
        chunk = math.ceil(math.ceil(work / want) / bn) * bn
        return SplitPlan(math.ceil(work / chunk), chunk, 0)
    first_tiles = max(0, min(tiles, math.ceil(work / want) - tree))
    rest = tiles - first_tiles + ragged  # tile steps of the other splits, the masked one included
    if rest <= 0:
        return one
    chunk_tiles = math.ceil(rest / (want - 1))
    return SplitPlan(1 + math.ceil(rest / chunk_tiles), chunk_tiles * bn, first_tiles * bn)


def _tree_steps_estimate(cfg: KernelConfig, group: int, n: int) -> int:
    """Gathered tile steps of the last split past its prompt tiles, estimated without reading the
    tree (CUDA graphs): the tiles of ``block_t`` keys that hold the first window's tree union,
    plus one more tile for a tree longer than one window of ``_window_words`` words (the root's
    window and the block's own).

    A row block holds ``block_m / group`` consecutive depth-first nodes, whose ancestors in a tree
    of depth <= 8 add about 8 keys (measured on the benchmark's random trees of 256 nodes: <= 23
    keys for 16 nodes, <= 39 for 32). Deep or chain-like trees see more; this only balances the
    chunks (``_pick_block_t`` uses the same union estimate).
    """
    union = _union_estimate(cfg, group, n)
    windows = math.ceil(n / (64 * _window_words(n))) if n > 0 else 1
    return math.ceil(union / cfg.block_t) + min(windows - 1, 1)


def _union_estimate(cfg: KernelConfig, group: int, n: int) -> int:
    """Keys of a row block's tree union: its ``block_m / group`` nodes + ~8 ancestors (depth <= 8)."""
    return min(n, math.ceil(cfg.block_m / max(group, 1)) + 8) if n > 0 else 0


def _window_words(n: int) -> int:
    """Ancestor words per compaction window of the kernel's tree part: the whole tree up to 256
    nodes (one window, so typically one gathered tile), else windows of 256 positions."""
    return min(4, _next_pow2(max(1, math.ceil(n / 64))))


def check_tree_mask(tree_mask, n: int, batch: int, device: torch.device, symbol: str) -> None:
    """ValueError naming ``tree_mask`` unless it is a TreeMask of ``n`` nodes (``q.shape[2]``,
    called ``symbol`` in the message), batch 1 or ``batch``, on ``device``."""
    if not isinstance(tree_mask, TreeMask):
        raise ValueError(f"tree_mask: expected a treeattn.TreeMask, got {type(tree_mask).__name__}")
    if tree_mask.n != n:
        raise ValueError(f"tree_mask: expected a tree of {symbol} = {n} nodes (q.shape[2]), got {tree_mask.n}")
    if tree_mask.batch_size not in (1, batch):
        raise ValueError(f"tree_mask: expected batch size 1 or {batch}, got {tree_mask.batch_size}")
    if tree_mask.words.device != device:
        raise ValueError(f"tree_mask: expected device {device} (q's), got {tree_mask.words.device}")


def check_kv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """ValueError naming ``v`` / ``k`` / ``q`` unless ``k`` and ``v`` are ``[B, Hkv, S, D]`` for ``q``
    ``[B, Hq, n, D]`` with ``Hq % Hkv == 0`` (4-D tensors, checked before); returns ``(Hkv, S)``."""
    batch, hq, _, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[0] != batch or k.shape[3] != d:
        raise ValueError(f"k: expected shape [{batch}, Hkv, S, {d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    hkv, seq_len = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q: expected a head count divisible by k's {hkv} KV heads (GQA), got {hq}")
    return hkv, seq_len


def check_lengths(name: str, lens, batch: int) -> None:
    """ValueError naming ``name`` unless ``lens`` is an int32 / int64 tensor of shape ``[batch]``."""
    if not isinstance(lens, torch.Tensor) or lens.dtype not in (torch.int32, torch.int64):
        got = lens.dtype if isinstance(lens, torch.Tensor) else type(lens).__name__
        raise ValueError(f"{name}: expected an int32/int64 tensor of shape [{batch}], got {got}")
    if tuple(lens.shape) != (batch,):
        raise ValueError(f"{name}: expected shape [{batch}], got {tuple(lens.shape)}")


def _check(q, k, v, prefix_lens, tree_mask, impl) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: expected dtype float16, bfloat16 or float32, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (q's), got {t.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: expected a contiguous last (head) dim, got stride {t.stride(-1)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: expected q's dtype {q.dtype}, got {k.dtype} and {v.dtype}")
    batch, _, n, d = q.shape
    _, seq_len = check_kv_shapes(q, k, v)
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"q: expected head_dim in [1, {MAX_HEAD_DIM}], got {d}")
    check_tree_mask(tree_mask, n, batch, q.device, "n")
    check_lengths("prefix_lens", prefix_lens, batch)
    if n > seq_len:
        raise ValueError(f"k: expected S >= n = {n} (tree KV must be in the cache), got S = {seq_len}")
    if impl not in _IMPLS:
        raise ValueError(f"impl: expected one of {_IMPLS}, got {impl!r}")


def _check_prefix_values(prefix_lens: torch.Tensor, n: int, seq_len: int) -> None:
    lo, hi = (int(x) for x in torch.aminmax(prefix_lens.detach().to(torch.int64)))
    if lo < 0 or hi + n > seq_len:
        raise ValueError(
            f"prefix_lens: expected 0 <= prefix_len and prefix_len + n <= S = {seq_len} (n = {n}), "
            f"got values in [{lo}, {hi}]"
        )


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: TreeMask,
    scale: float | None = None,
    impl: str = "auto",
    *,
    check_prefix_lens: bool = True,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Attention of every token-tree query over the shared prompt and its own tree ancestors.

    Args:
        q: ``[B, Hq, n, D]`` float16 / bfloat16 / float32, the n tree nodes' queries.
        k, v: ``[B, Hkv, S, D]``, same dtype and device (HF's cache layout); sequence b's prompt
            KV at ``[0, prefix_lens[b])`` and its tree KV at ``[prefix_lens[b], prefix_lens[b] + n)``.
            ``Hq % Hkv == 0`` (GQA). Only the last dim must be contiguous.
        prefix_lens: int32 / int64 ``[B]`` on q's device.
        tree_mask: ``TreeMask`` of ``B`` (or 1, shared) trees of n nodes, on q's device.
        scale: softmax scale, default ``D ** -0.5``.
        impl: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"torch"`` (SDPA with a
            dense mask), or ``"auto"``: Triton on CUDA tensors and under the interpreter, else torch.
        check_prefix_lens: verify ``0 <= prefix_lens[b]`` and ``prefix_lens[b] + n <= S``; this
            reads the values on the host (a device sync on CUDA). Pass False inside CUDA graphs;
            the kernel then clamps out-of-range values so that it never reads outside k / v.
        config: kernel launch parameters (default: chosen from the shapes).

    Returns:
        ``[B, Hq, n, D]`` in q's dtype; query i attends keys ``[0, prefix_len)`` and the tree keys
        of its ancestors and itself. Accumulation is in float32. The Triton kernel writes it in
        ``[B, n, Hq, D]`` memory order (``new_output``), so ``out.transpose(1, 2)`` -- what an HF
        attention layer reshapes to ``[B, n, Hq * D]`` -- is contiguous.
    """
    _check(q, k, v, prefix_lens, tree_mask, impl)
    batch, hq, n, d = q.shape
    seq_len = k.shape[2]
    if prefix_lens.device != q.device:
        raise ValueError(f"prefix_lens: expected device {q.device} (q's), got {prefix_lens.device}")
    if check_prefix_lens and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        _check_prefix_values(prefix_lens, n, seq_len)
    scale = d**-0.5 if scale is None else float(scale)
    if impl == "auto":
        impl = "triton" if (q.is_cuda or interpreter_enabled()) else "torch"
    if impl == "torch":
        return _tree_attention_torch(q, k, v, prefix_lens, tree_mask, scale)
    if not q.is_cuda and not interpreter_enabled():
        raise ValueError("impl: 'triton' needs CUDA tensors or TRITON_INTERPRET=1 set before importing treeattn")
    return _tree_attention_triton(q, k, v, prefix_lens, tree_mask, scale, config)


@torch.library.custom_op("treeattn::tree_attention", mutates_args=())
def tree_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                      words: torch.Tensor, depth: torch.Tensor, scale: float, impl: str) -> torch.Tensor:  # fmt: skip
    """``tree_attention`` as a PyTorch custom op, for ``torch.compile``d callers.

    The compiler sees one opaque op (its output is shaped like ``q``) instead of tracing the
    validation and the Triton launch; at run time it is ``tree_attention(q, k, v, prefix_lens,
    TreeMask(words, depth), scale, impl, check_prefix_lens=False)``. Shapes as in ``tree_attention``;
    the output always in ``new_output``'s memory order (copied there from the torch path), the
    layout its fake declares to the compiler.
    """
    out = tree_attention(q, k, v, prefix_lens, TreeMask(words, depth), scale, impl, check_prefix_lens=False)
    return heads_inner(out)


@tree_attention_op.register_fake
def _tree_attention_fake(q, k, v, prefix_lens, words, depth, scale, impl):
    return new_output(q)


def new_output(q: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor shaped like q ``[B, Hq, n, D]`` and laid out as ``[B, n, Hq, D]``.

    The kernels write through its strides. An HF attention layer transposes the result to
    ``[B, n, Hq, D]`` and reshapes it to ``[B, n, Hq * D]``: in this order neither copies (a
    contiguous ``[B, Hq, n, D]`` cost two copy kernels a layer for n > 1 in the compiled forward,
    specdec/PERF.md v19).
    """
    b, h, n, d = q.shape
    return torch.empty((b, n, h, d), dtype=q.dtype, device=q.device).transpose(1, 2)


def heads_inner(out: torch.Tensor) -> torch.Tensor:
    """``out`` ``[B, Hq, n, D]`` in ``new_output``'s memory order: itself when it already is, else a copy."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


def _tree_attention_torch(q, k, v, prefix_lens, tree_mask, scale):
    batch, _, n, _ = q.shape
    seq_len = k.shape[2]
    s = torch.arange(seq_len, device=q.device)
    pl = prefix_lens.to(torch.int64).view(batch, 1, 1)
    rel = s.view(1, 1, seq_len) - pl  # key position relative to the tree start: [B, 1, S]
    in_tree = (rel >= 0) & (rel < n)
    relc = rel.clamp(0, n - 1).expand(batch, n, seq_len)
    words = tree_mask.words.expand(batch, -1, -1)
    word = words.gather(2, relc // 64)
    bit = ((word >> (relc % 64)) & 1).bool()
    mask = (rel < 0) | (in_tree & bit)  # [B, n, S]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def _tree_attention_triton(q, k, v, prefix_lens, tree_mask, scale, config):
    from triton.runtime.errors import OutOfResources

    batch, hq, n, d = q.shape
    hkv, seq_len = k.shape[1], k.shape[2]
    group = hq // hkv
    if config is None:
        cfg, plan = pick_config(batch, hkv, group, n, seq_len, d, q.device, q.dtype)
    else:
        cfg = config
        plan = _splits(cfg, batch, hkv, group * n, seq_len - n, n, q.device)
    while True:
        try:
            return _launch(q, k, v, prefix_lens, tree_mask, scale, cfg, plan)
        except OutOfResources:
            if config is not None:  # an explicit config is run as given
                raise
            cfg = _shrink(cfg)  # the shared-memory estimate was short for this GPU / compiler
            splits, chunk = _splits(cfg, batch, hkv, group * n, seq_len - n, n, q.device)


def _launch(q, k, v, prefix_lens, tree_mask, scale, cfg: KernelConfig, plan: SplitPlan):
    from treeattn.kernels import tree_attn_fwd_kernel, tree_attn_merge_kernel

    batch, hq, n, d = q.shape
    hkv, seq_len = k.shape[1], k.shape[2]
    group = hq // hkv
    block_d = max(16, _next_pow2(d))
    words = tree_mask.words
    if words.stride(-1) != 1:
        words = words.contiguous()
    # The gathered kernel reads each int64 word as two int32 halves, low half (bits 0-31) first:
    # CUDA and x86 are little-endian.
    stride_wb = 0 if tree_mask.batch_size == 1 else words.stride(0)
    out = new_output(q)
    splits = plan.count
    grid = (math.ceil(group * n / cfg.block_m), batch * hkv, splits)
    if splits > 1:
        part_dtype = q.dtype if cfg.partials_in_input_dtype else torch.float32
        part_o = torch.empty(batch * hq * n * splits * d, device=q.device, dtype=part_dtype)
        part_lse = torch.empty(batch * hq * n * splits, device=q.device, dtype=torch.float32)
    else:
        part_o = part_lse = out  # unused by the single-stage kernel
    # GATHER mode: the last split's prompt keys [0, first) are whole tiles.
    assert not cfg.gather or splits == 1 or plan.first % cfg.block_n == 0, (plan, cfg.block_n)
    upcast = interpreter_enabled() and q.dtype != torch.float32
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    tree_attn_fwd_kernel[grid](
        q, k, v, prefix_lens, words, out, part_o, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        stride_wb, words.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        n, seq_len, hkv, plan.chunk, plan.first, splits,
        scale * _LOG2E,
        GROUP=group, HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_T=cfg.block_t, WINDOW_WORDS=_window_words(n),
        GATHER=cfg.gather, SPLIT=splits > 1,
        UPCAST=upcast, DOT_PRECISION=precision, WARP_SPECIALIZE=cfg.warp_specialize,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if splits > 1:
        rows = batch * hq * n
        block_s = _next_pow2(splits)
        block_r = max(1, 2048 // (block_s * block_d))  # keep the [R, S, D] tile at <= 2048 floats
        tree_attn_merge_kernel[(math.ceil(rows / block_r),)](
            part_o, part_lse, out,
            out.stride(0), out.stride(1), out.stride(2),
            hq, n, rows, splits,
            HEAD_DIM=d, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_S=block_s, num_warps=4,
        )
    return out


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()

