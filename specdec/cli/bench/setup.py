"""What the target sections share: the loaded target (and draft) with the APPS prompts and one cache
capacity (``Setup``, ``load_setup``), the engine built the same way for every section, and the
token bookkeeping (cut at eos, agreement with a reference)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.cli.bench.common import Timer
from specdec.cli.bench.config import BenchConfig
from specdec.dtypes import parse_dtype


@dataclass
class Setup:
    """A run's loaded target (and draft), its prompts, and what the sections pass on to each other."""

    cfg: BenchConfig
    device: Any
    dtype: Any
    tokenizer: Any
    target: Any
    draft: Any
    prompts: list  # int64 [L] CPU tensors
    problem_ids: list[str]
    eos: list[int]
    pad: int
    capacity: int
    timer: Timer
    reference: dict[str, list[list[int]]] = field(default_factory=dict)  # method -> tokens per prompt
    plain_ms: dict[str, float] = field(default_factory=dict)  # method -> ms per token of (a)
    medusa: Any = None  # MedusaHeads for (d), loaded once
    bandwidth: dict[str, Any] | None = None  # measure_copy_bandwidth's result, measured once per run


def _plain_generation_config(model, eos: list[int], pad: int) -> None:
    """Drop the model's own generation defaults (sampling, repetition penalty): plain greedy for every method."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=eos or None, pad_token_id=pad)


def device_dtype(cfg: BenchConfig):
    """The run's torch device and dtype: ``cfg``'s, else cuda if available and bf16 there, fp32 on CPU."""
    import torch

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, parse_dtype(cfg.dtype, device)


def load_setup(cfg: BenchConfig, log: Callable[[str], None]) -> Setup:
    """Load the target (and the draft when (c) uses it), the APPS prompts, and pick the cache capacity."""
    import torch

    from eval.datasets import load_apps, prompt_ids
    from specdec import hf, models

    torch.manual_seed(cfg.seed)
    device, dtype = device_dtype(cfg)
    t0 = time.perf_counter()
    tokenizer = models.load_tokenizer(cfg.target, progress=cfg.progress)
    target = models.load_model(cfg.target, dtype=dtype, device=device, progress=cfg.progress)
    draft = None
    if "spec" in cfg.sections and "model" in cfg.drafters:
        draft = models.load_model(cfg.draft, dtype=dtype, device=device, progress=cfg.progress)
    log(f"loaded models in {time.perf_counter() - t0:.1f} s ({dtype}, {device})")
    eos = hf.eos_token_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    for model in (target, draft):
        if model is not None:
            _plain_generation_config(model, eos, int(pad))
    # Route attention through specdec's function before any generate (HF methods then run the same,
    # delegating, attention code from their first call on; nothing recompiles between methods).
    hf.prepare_model(target, "target", fuse=cfg.fuse)
    problems = load_apps(cfg.data, limit=cfg.problems, unique=True)
    if not problems:
        raise ValueError("problems: the APPS source gave no problems")
    prompts = [torch.tensor(prompt_ids(p, tokenizer), dtype=torch.int64) for p in problems]
    longest = max(len(p) for p in prompts)
    tree = max(max(cfg.tree_sizes), cfg.spec_tree_size + 1)
    if "profile" in cfg.sections:
        tree = max(tree, cfg.profile_tree_size + 1)
    # One cache capacity for every engine decoder and forward: the graphs and the kernel's launch
    # configuration (which depends on the capacity) are the same throughout.
    capacity = -(-(longest + cfg.max_new_tokens + tree + 8) // 256) * 256
    return Setup(cfg, device, dtype, tokenizer, target, draft, prompts, [p.id for p in problems], eos, int(pad),
                 capacity, Timer(device))  # fmt: skip


def prefill_first_prompt(setup: Setup):
    """The first prompt, its prefix length (all tokens but the last, the root of a tree over it) and a
    ``KVCache`` of ``setup.capacity`` slots holding the prefix's KV (the (b) and (e) forwards)."""
    from specdec import hf
    from specdec.kv import KVCache

    prompt = setup.prompts[0]
    prefix = len(prompt) - 1
    cache = KVCache(1, setup.capacity)
    hf.prefill(setup.target, prompt[None, :prefix] if prefix else prompt[None], cache, impl=setup.cfg.attn_impl)
    return prompt, prefix, cache


def make_engine(setup: Setup, drafter, tree_size: int, graph: bool, compile: bool = False, decode_chunk: int | None = None):
    """A decoder; ``graph``: CUDA graphs on CUDA, the same fixed-buffer path without capture on CPU;
    ``compile``: the fixed-shape forward through ``torch.compile`` (inductor) before the capture;
    ``decode_chunk``: ``SpecDecoder``'s (None: its default)."""
    from specdec import SpecDecoder
    from specdec.engine import DEFAULT_DECODE_CHUNK

    cuda = setup.device.type == "cuda"
    return SpecDecoder(setup.target, drafter, tree_size, max_cache_len=setup.capacity, attn_impl=setup.cfg.attn_impl,
                       static_shapes=True if graph else None, cuda_graphs=graph and cuda, compile=compile,
                       decode_chunk=DEFAULT_DECODE_CHUNK if decode_chunk is None else decode_chunk)  # fmt: skip


def cut_at_eos(tokens: list[int], eos: list[int], limit: int) -> list[int]:
    """The first ``limit`` tokens, up to and including the first eos."""
    tokens = tokens[:limit]
    for j, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: j + 1]
    return tokens


def agreement(reference: list[list[int]] | None, got: list[list[int]]) -> dict[str, Any]:
    """How many completions equal the reference's, and where each first differs (``None``: nowhere)."""
    if reference is None:
        return {"identical": None, "first_mismatch": None}
    same = [r == g for r, g in zip(reference, got)]
    first = []
    for r, g in zip(reference, got):
        k = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), None)
        if k is None and len(r) != len(g):
            k = min(len(r), len(g))
        first.append(k)
    return {"identical": sum(same), "first_mismatch": first}


def reference_tokens(setup: Setup) -> tuple[str, list[list[int]]] | tuple[None, None]:
    """The first of hf, engine-eager, engine-graph that (a) decoded: its name and tokens per prompt."""
    for name in ("hf", "engine-eager", "engine-graph"):
        if name in setup.reference:
            return name, setup.reference[name]
    return None, None
