"""``specdec bench-engine``: the engine's own speed on a real target, eager vs CUDA graphs, vs HF.

Six sections (``--sections``; default ``plain,verify,spec``, the last three are opt-in), each
printed as a table and written to ``--out`` (JSON, rewritten after every section -- and after
every row of the long ones -- so that a run cut off by a time limit keeps what it measured):

``plain``  (a) plain (non-speculative) greedy decoding of the same APPS chat prompts with the same
           ``--max-new-tokens``: HF ``generate`` with its default (dynamic) cache, HF ``generate``
           with ``cache_implementation="static"`` (compiled decode on CUDA; warmed up twice and run
           last of all, after the other sections, since it compiles), the engine eager
           (``SpecDecoder(target, None, cuda_graphs=False)``), the engine with its forward
           replayed as a CUDA graph, and the same forward compiled by inductor before the capture
           (``engine-compiled``, ``SpecDecoder(compile=True)``; its compile time is in
           ``warmup_s``). Tokens/s, ms/token, and how many completions are identical to
           the reference (HF default cache; in bf16 some differ by rounding, in fp32 none may).
``verify`` (b) one target verify forward (inputs to the device + forward, as a decoding step pays
           it) of a random tree (``treeattn.layout.random_tree_parents``) of n nodes over the first
           prompt's KV, for each ``--tree-sizes`` n (root included), eager and graphed: median ms
           and the multiple of the n = 1 forward (a plain decode step) in the same mode; plus the
           largest logit difference between the two modes (a sanity check of the graph).
``spec``   (c) speculative decoding at ``--spec-tree-size`` t with the draft-model drafter and with
           prompt lookup, in each of ``--spec-modes``: eager, graphed, and (opt-in) ``compiled``
           (graphs of inductor-compiled forwards); for the draft model its per-depth forwards
           follow the mode too (``DraftModelDrafter(static_shapes=, cuda_graphs=, compile=)``).
           Per step: ms drafting, verifying (of which the target forward), committing, and host overhead (the rest of the wall time, prefill excluded);
           draft tokens accepted and tokens emitted per step; tokens/s; identical completions.
``batch``  (d) batch throughput: for each ``--batch-sizes`` B, speculative decoding at
           ``--spec-tree-size`` t with each ``--batch-drafter`` (``medusa``, the default, with heads
           from ``--medusa-heads DIR``; ``lookup``: prompt lookup) in ``--batch-mode`` (default
           graph), and HF ``generate`` with the static cache on left-padded batches (compiled on
           CUDA; run at the end with the other HF static-cache rows; ``--batch-skip-hf`` leaves it
           out). The rows of a batch are the APPS prompts cycled (row i of call k is problem
           (k B + i) mod N), with as many calls as it takes to cover the N problems. Every batch
           size is warmed up first (graph captures, HF compiles; ``warmup_s``, not timed).
           Tokens/s over the batch (new tokens of all rows / wall time), per row (tokens/s / B:
           what one sequence sees), tokens emitted and draft tokens accepted per step and row
           (``tokens_per_step`` = the mean accepted length tau), ms per step, and rows identical
           to the reference (the plain section's, else the first batch row set).
``profile`` (e) kernel profile of one verify forward of the target with a random tree of
           ``--profile-tree-size`` t draft nodes (t + 1 nodes with the root) over the first
           prompt's KV, in each of ``--profile-modes`` (``graph``: the graphed forward;
           ``compiled``: the same compiled by inductor before the capture). The forward is
           timed as a CUDA-graph replay (``captured_ms``) and not captured (``uncaptured_ms``:
           the same body called eagerly, compiled or not), then ``--profile-reps`` replays run
           under ``torch.profiler`` (``specdec.cli.profile_step``): GPU kernels per forward, their
           summed time against the wall time of the profiled variant, kernels per decoder layer
           (everything over the layer count: embedding, final norm and LM head included), the
           time in GEMMs / attention (tree-attention Triton kernels) / other, and the
           ``--profile-top`` kernels by total time. ``source`` says what was profiled: ``graph
           replay`` when the profiler sees the kernels inside the replayed graph, else
           ``uncaptured forward`` (the same kernels launched one by one; ``graph_replay_kernels``
           records how many the replay showed). On CPU the profile counts operators instead
           (``source`` ``cpu ops``: the innermost ATen operators doing work). Plus the
           weight-streaming floor of the forward (weights once, and weights + the prompt's KV) at
           ``--bandwidth-gbs`` and at the copy bandwidth measured in the run.
``scale``  (f) the engine at Llama-3-8B shapes with random weights (``--scale-config llama3-8b``:
           32 layers, hidden 4096, 32 / 8 heads, vocab 128256; ``tiny``: a 2-layer model, the
           default on CPU), built on the device without HF's weight init (values: normal, std
           0.02), no model files needed. For each ``--scale-prompts`` L (random token ids;
           default 1024 16384 for llama3-8b, 64 256 for tiny): plain greedy decode of
           ``--scale-new-tokens`` tokens (ms/token with the prefill excluded) by the graphed
           engine (``engine-graph``), optionally compiled (``engine-compiled``), and HF
           ``generate`` with the static cache (``hf-static``: compiled by HF on CUDA, warmed up
           twice -- compile time in ``warmup_s`` -- then ms/token from one timed call: the time
           between the first and the last new token reaching the host over new - 1, read by a
           streamer); a verify forward (graphed, median ms of ``--reps``) of a random tree of t
           draft nodes for t = 0 and each ``--scale-tree-sizes``;
           the weight-streaming floor (streamed parameter bytes / bandwidth, at ``--bandwidth-gbs``
           and at the measured copy bandwidth; also with the prompt's KV bytes), and the issue's
           bars: plain decode ms / floor (<= 1.3) and verify(t = 64) / verify(t = 0) (<= 1.2;
           t = 64 draft nodes are 65 nodes with the root). ``--scale-parts`` picks which of
           engine-graph, engine-compiled, hf-static, verify run (default all but
           engine-compiled). Everything is freed between cells.

On CPU the "graph" rows run the same fixed-buffer code without a capture (``captured: false``).
Timing: CUDA events with a synchronize on CUDA, ``time.perf_counter`` on CPU.

Commands for the H100 (issue 3) are in docs/DEVICE_RUNS.md, "Issue 3 -- engine benchmark":

    python3 -m specdec.cli bench-engine --dtype bf16 --device cuda --problems 4 --max-new-tokens 128 \\
        --data .evaldata/apps_selected150.jsonl --out $OUT/engine.json > $OUT/engine.log 2>&1

Issue 13 (items 4-5, the batch table): one call each, after ``export SPECDEC_HOME=/tmp/specdec-home
PYTHONUNBUFFERED=1`` (``batch`` and ``profile`` need the staged and converted Qwen2.5-Coder-1.5B,
``batch`` Medusa heads trained in the machine's life; ``scale`` needs no model files). Expected on
an H100: scale 3-5 min per prompt length (two compiles of the 8B forward: engine and HF), batch
4-6 min (mostly HF compiling per batch size), profile 2-3 min (the compiled mode compiles once):

    timeout 560 python3 -m specdec.cli bench-engine --sections scale --device cuda --scale-prompts 1024 \\
        --scale-parts engine-graph,engine-compiled,hf-static,verify --out $OUT/scale-1k.json > $OUT/scale-1k.log 2>&1
    timeout 560 python3 -m specdec.cli bench-engine --sections scale --device cuda --scale-prompts 16384 \\
        --scale-parts engine-graph,engine-compiled,hf-static,verify --out $OUT/scale-16k.json > $OUT/scale-16k.log 2>&1
    bash scripts/device/spec_methods.sh train   # Medusa heads into /tmp/medusa (~4-5 min)
    timeout 560 python3 -m specdec.cli bench-engine --sections batch --dtype bf16 --device cuda --problems 4 \\
        --max-new-tokens 128 --data .evaldata/apps_selected150.jsonl --medusa-heads /tmp/medusa \\
        --batch-drafter medusa,lookup --batch-sizes 1 2 4 8 16 --no-progress --out $OUT/batch.json > $OUT/batch.log 2>&1
    timeout 560 python3 -m specdec.cli bench-engine --sections profile --dtype bf16 --device cuda --problems 1 \\
        --data .evaldata/apps_selected150.jsonl --profile-tree-size 64 --no-progress \\
        --out $OUT/profile.json > $OUT/profile.log 2>&1
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from specdec.cli import args as cliargs

SECTIONS = ("plain", "verify", "spec", "batch", "profile", "scale")
DEFAULT_SECTIONS = ("plain", "verify", "spec")  # batch, profile and scale are opt-in
_TARGET_SECTIONS = ("plain", "verify", "spec", "batch", "profile")  # the ones that load --target
PLAIN_METHODS = ("hf", "hf-static", "engine-eager", "engine-graph", "engine-compiled")
DRAFTERS = ("model", "lookup")
SPEC_MODES = ("eager", "graph", "compiled")  # compiled: the graphed forwards compiled by inductor first
BATCH_DRAFTERS = ("medusa", "lookup")
PROFILE_MODES = ("graph", "compiled")
SCALE_PARTS = ("engine-graph", "engine-compiled", "hf-static", "verify")
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"

#: ``scale`` section models (``LlamaConfig`` fields; ``max_position_embeddings`` is at least this
#: and at least the largest cache the run needs).
SCALE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=17408, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False),
}  # fmt: skip
#: ``--scale-prompts`` default per config
SCALE_PROMPTS = {"llama3-8b": (1024, 16384), "tiny": (64, 256)}
SCALE_TREE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_BANDWIDTH_GBS = 3000.0  # H100 device copy, bytes read + written (../shared/DEVICE.md)


@dataclass(frozen=True)
class BenchConfig:
    """Settings of one ``bench-engine`` run (see ``build_parser`` for each flag)."""

    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    data: str | None = None
    problems: int = 4
    max_new_tokens: int = 128
    tree_sizes: tuple[int, ...] = (1, 16, 32, 64, 128, 256)
    spec_tree_size: int = 64
    sections: tuple[str, ...] = DEFAULT_SECTIONS
    plain_methods: tuple[str, ...] = PLAIN_METHODS
    drafters: tuple[str, ...] = DRAFTERS
    spec_modes: tuple[str, ...] = ("eager", "graph")
    reps: int = 20
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    attn_impl: str = "auto"
    progress: bool = True
    out: str | None = None
    # (d) batch
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_drafters: tuple[str, ...] = ("medusa",)
    batch_mode: str = "graph"
    batch_skip_hf: bool = False
    medusa_heads: str | None = None
    # (e) profile
    profile_tree_size: int = 64
    profile_modes: tuple[str, ...] = PROFILE_MODES
    profile_reps: int = 5
    profile_top: int = 15
    # (f) scale
    scale_config: str | None = None  # None: llama3-8b on CUDA, tiny on CPU
    scale_prompts: tuple[int, ...] | None = None  # None: SCALE_PROMPTS[config]
    scale_new_tokens: int = 64
    scale_tree_sizes: tuple[int, ...] = SCALE_TREE_SIZES
    scale_parts: tuple[str, ...] = ("engine-graph", "hf-static", "verify")
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS

    def __post_init__(self) -> None:
        for name, vals, allowed in (("sections", self.sections, SECTIONS),
                                    ("plain_methods", self.plain_methods, PLAIN_METHODS),
                                    ("drafters", self.drafters, DRAFTERS),
                                    ("spec_modes", self.spec_modes, SPEC_MODES),
                                    ("batch_drafters", self.batch_drafters, BATCH_DRAFTERS),
                                    ("profile_modes", self.profile_modes, PROFILE_MODES),
                                    ("scale_parts", self.scale_parts, SCALE_PARTS)):  # fmt: skip
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise ValueError(f"{name}: expected some of {allowed}, got {bad}")
        for name in ("problems", "max_new_tokens", "reps", "profile_reps", "profile_top"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        for name, vals in (("tree_sizes", self.tree_sizes), ("batch_sizes", self.batch_sizes),
                           ("scale_tree_sizes", self.scale_tree_sizes)):  # fmt: skip
            if not vals or any(not isinstance(n, int) or n < 1 for n in vals):
                raise ValueError(f"{name}: expected {'node counts' if name == 'tree_sizes' else 'ints'} >= 1, "
                                 f"got {list(vals)}")  # fmt: skip
        for name in ("spec_tree_size", "profile_tree_size"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 0:
                raise ValueError(f"{name}: expected an int >= 0, got {val!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {self.attn_impl!r}")
        if self.batch_mode not in SPEC_MODES:
            raise ValueError(f"batch_mode: expected one of {SPEC_MODES}, got {self.batch_mode!r}")
        if "batch" in self.sections:
            if not self.batch_drafters and self.batch_skip_hf:
                raise ValueError("batch_drafters: expected at least one drafter when the HF rows are skipped, got none")
            if "medusa" in self.batch_drafters and not self.medusa_heads:
                raise ValueError("medusa_heads: the batch section's 'medusa' drafter needs trained heads (--medusa-heads "
                                 "DIR, e.g. from specdec train-medusa), got none; or use --batch-drafter lookup")  # fmt: skip
        if self.scale_config is not None and self.scale_config not in SCALE_CONFIGS:
            raise ValueError(f"scale_config: expected one of {tuple(SCALE_CONFIGS)}, got {self.scale_config!r}")
        if self.scale_prompts is not None and (not self.scale_prompts or any(
                not isinstance(n, int) or n < 2 for n in self.scale_prompts)):  # fmt: skip
            raise ValueError(f"scale_prompts: expected prompt lengths >= 2, got {list(self.scale_prompts)}")
        if not isinstance(self.scale_new_tokens, int) or self.scale_new_tokens < 2:
            raise ValueError(f"scale_new_tokens: expected an int >= 2, got {self.scale_new_tokens!r}")
        bw = self.bandwidth_gbs
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
            raise ValueError(f"bandwidth_gbs: expected a bandwidth > 0 (GB/s), got {self.bandwidth_gbs!r}")


# ----------------------------------------------------------------------------------------------
# timing


class Timer:
    """Wall time of a region: CUDA events + synchronize on CUDA, ``perf_counter`` on CPU."""

    def __init__(self, device) -> None:
        import torch

        self.cuda = device.type == "cuda"
        self.device = device
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Run ``fn()``; return (seconds, its result). The device is idle before and after."""
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
            self._start.record()
            out = fn()
            self._end.record()
            self._end.synchronize()
            return self._start.elapsed_time(self._end) / 1e3, out
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def _median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3


# ----------------------------------------------------------------------------------------------
# setup


@dataclass
class _Setup:
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


def _eos_ids(model, tokenizer) -> list[int]:
    ids: list[int] = []
    gc = getattr(model, "generation_config", None)
    for val in (getattr(gc, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if val is None:
            continue
        for v in [val] if isinstance(val, int) else list(val):
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids


def _plain_generation_config(model, eos: list[int], pad: int) -> None:
    """Drop the model's own generation defaults (sampling, repetition penalty): plain greedy for every method."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=eos or None, pad_token_id=pad)


def _device_dtype(cfg: BenchConfig):
    import torch

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, getattr(torch, _DTYPES[cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")])


def _setup(cfg: BenchConfig, log: Callable[[str], None]) -> _Setup:
    import torch

    from eval.datasets import load_apps, prompt_ids
    from specdec import hf, models

    torch.manual_seed(cfg.seed)
    device, dtype = _device_dtype(cfg)
    t0 = time.perf_counter()
    tokenizer = models.load_tokenizer(cfg.target, progress=cfg.progress)
    target = models.load_model(cfg.target, dtype=dtype, device=device, progress=cfg.progress)
    draft = None
    if "spec" in cfg.sections and "model" in cfg.drafters:
        draft = models.load_model(cfg.draft, dtype=dtype, device=device, progress=cfg.progress)
    log(f"loaded models in {time.perf_counter() - t0:.1f} s ({dtype}, {device})")
    eos = _eos_ids(target, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
    for model in (target, draft):
        if model is not None:
            _plain_generation_config(model, eos, int(pad))
    # Route attention through specdec's function before any generate (HF methods then run the same,
    # delegating, attention code from their first call on; nothing recompiles between methods).
    hf.prepare_model(target, "target")
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
    return _Setup(cfg, device, dtype, tokenizer, target, draft, prompts, [p.id for p in problems], eos, int(pad),
                  capacity, Timer(device))  # fmt: skip


def _finish(tokens: list[int], eos: list[int], limit: int) -> list[int]:
    tokens = tokens[:limit]
    for j, tok in enumerate(tokens):
        if tok in eos:
            return tokens[: j + 1]
    return tokens


def _agreement(reference: list[list[int]] | None, got: list[list[int]]) -> dict[str, Any]:
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


def _reference(setup: _Setup) -> tuple[str, list[list[int]]] | tuple[None, None]:
    for name in ("hf", "engine-eager", "engine-graph"):
        if name in setup.reference:
            return name, setup.reference[name]
    return None, None


# ----------------------------------------------------------------------------------------------
# (a) plain decoding


def _hf_generate(setup: _Setup, prompt, new: int, static: bool) -> list[int]:
    import torch

    kwargs: dict[str, Any] = dict(max_new_tokens=new, do_sample=False, eos_token_id=setup.eos or None,
                                  pad_token_id=setup.pad, attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                                                    device=setup.device))  # fmt: skip
    if static:
        kwargs.update(cache_implementation="static", max_cache_len=setup.capacity)
    out = setup.target.generate(prompt[None].to(setup.device), **kwargs)
    return out[0, len(prompt) :].tolist()


def _engine(setup: _Setup, drafter, tree_size: int, graph: bool, compile: bool = False):
    """A decoder; ``graph``: CUDA graphs on CUDA, the same fixed-buffer path without capture on CPU;
    ``compile``: the fixed-shape forward through ``torch.compile`` (inductor) before the capture."""
    from specdec import SpecDecoder

    cuda = setup.device.type == "cuda"
    return SpecDecoder(setup.target, drafter, tree_size, max_cache_len=setup.capacity, attn_impl=setup.cfg.attn_impl,
                       static_shapes=True if graph else None, cuda_graphs=graph and cuda, compile=compile)  # fmt: skip


def run_plain_method(setup: _Setup, method: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Warm up, then greedy-decode every prompt with ``method``; tokens/s and agreement."""
    cfg = setup.cfg
    new = cfg.max_new_tokens
    if method.startswith("hf"):
        static = method == "hf-static"
        gen = lambda p, k: _hf_generate(setup, p, k, static)  # noqa: E731
        warm = 2 if static else 1
    else:
        dec = _engine(setup, None, 0, graph=method != "engine-eager", compile=method == "engine-compiled")
        gen = lambda p, k: dec.generate(p, k, eos_token_id=setup.eos or None,  # noqa: E731
                                        pad_token_id=setup.pad).new_tokens(0).tolist()
        warm = 1
    t0 = time.perf_counter()
    for _ in range(warm):
        gen(setup.prompts[0], min(8, new))
    warm_s = time.perf_counter() - t0
    tokens, seconds = [], []
    for prompt in setup.prompts:
        sec, out = setup.timer(lambda: gen(prompt, new))
        tokens.append(_finish(out, setup.eos, new))
        seconds.append(sec)
    total_new = sum(len(t) for t in tokens)
    total_s = sum(seconds)
    setup.reference[method] = tokens
    ref_name, ref = _reference(setup)
    row = {
        "method": method,
        "captured": method in ("engine-graph", "engine-compiled") and setup.device.type == "cuda",
        "new_tokens": total_new,
        "seconds": total_s,
        "tokens_per_s": total_new / total_s if total_s > 0 else math.nan,
        "ms_per_token": 1e3 * total_s / total_new if total_new else math.nan,
        "warmup_s": warm_s,
        "per_problem_s": seconds,
        "reference": ref_name,
        **_agreement(ref if ref_name != method else None, tokens),
    }
    log(f"  {method:<13} {row['tokens_per_s']:8.1f} tok/s  {row['ms_per_token']:7.2f} ms/token  "
        f"identical to {ref_name}: {row['identical']}/{len(tokens)}")  # fmt: skip
    return row


# ----------------------------------------------------------------------------------------------
# (b) one verify forward per tree size


def _time_graphed(timer: Timer, reps: int, graphed, tree, prefix: int) -> list[float]:
    """Seconds of ``reps`` timed ``graphed.run`` calls after two untimed ones (the first captures)."""
    for _ in range(2):
        graphed.run([tree], [prefix])
    return [timer(lambda: graphed.run([tree], [prefix]))[0] for _ in range(reps)]


def _time_forward(setup: _Setup, graphed, tree, prefix: int) -> tuple[list[float], Any]:
    """Seconds of ``cfg.reps`` timed ``graphed.run`` calls after two untimed ones (the first captures);
    and a float copy of the logits."""
    times = _time_graphed(setup.timer, setup.cfg.reps, graphed, tree, prefix)
    return times, graphed.logits.float().clone()


def _random_tree(n: int, root: int, vocab: int, gen):
    """A random ``TokenTree`` of n nodes (``random_tree_parents``; random tokens, ``root`` at node 0)."""
    import torch

    from specdec.tree import TokenTree
    from treeattn.layout import random_tree_parents

    parents = random_tree_parents(n, generator=gen)
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    tokens[0] = int(root)
    return TokenTree(tokens, parents)


def _free(device) -> None:
    """Collect garbage and hand cached device memory back (between cells of the big sections)."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_verify(setup: _Setup, log: Callable[[str], None]) -> dict[str, Any]:
    """Median ms of load + forward of an n-node random tree over the first prompt, eager vs graph."""
    import torch

    from specdec import hf
    from specdec.graphs import GraphedForward
    from specdec.kv import KVCache
    from specdec.tree import TokenTree
    from treeattn.layout import random_tree_parents

    cfg = setup.cfg
    prompt = setup.prompts[0]
    prefix = len(prompt) - 1
    cache = KVCache(1, setup.capacity)
    hf.prefill(setup.target, prompt[None, :prefix] if prefix else prompt[None], cache, impl=cfg.attn_impl)
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = hf.vocab_size(setup.target)
    sizes = sorted(set(cfg.tree_sizes) | {1})
    graph_ok = setup.device.type == "cuda"
    rows = []
    for n in sizes:
        parents = random_tree_parents(n, generator=gen)
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        tokens[0] = int(prompt[-1])
        tree = TokenTree(tokens, parents)
        row: dict[str, Any] = {"nodes": n, "prefix_len": prefix}
        logits = {}
        for mode in ("eager", "graph"):
            graphed = GraphedForward(setup.target, cache, 1, n, impl=cfg.attn_impl, capture=mode == "graph" and graph_ok)
            times, logits[mode] = _time_forward(setup, graphed, tree, prefix)
            row[f"{mode}_ms"] = _median_ms(times)
            row[f"{mode}_min_ms"] = min(times) * 1e3
        row["graph_captured"] = graph_ok
        row["max_abs_logit_diff"] = float((logits["eager"] - logits["graph"]).abs().max())
        rows.append(row)
    base = {m: rows[0][f"{m}_ms"] for m in ("eager", "graph")}
    for row in rows:
        for m in ("eager", "graph"):
            row[f"{m}_x_plain"] = row[f"{m}_ms"] / base[m] if base[m] > 0 else math.nan
    return {"prefix_len": prefix, "capacity": setup.capacity, "reps": cfg.reps, "rows": rows,
            "plain_ms_per_token": dict(setup.plain_ms)}


# ----------------------------------------------------------------------------------------------
# (c) speculative decoding breakdown


def run_spec(setup: _Setup, drafter_name: str, mode: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Speculative greedy decoding of every prompt; per-step phase times, acceptance, tokens/s.

    ``mode``: ``"eager"``, ``"graph"`` (CUDA graphs on CUDA) or ``"compiled"`` (graphs of forwards
    compiled by inductor; the compile falls in the warm-up)."""
    from drafters import make_drafter

    cfg = setup.cfg
    t = cfg.spec_tree_size
    graph, compile = mode != "eager", mode == "compiled"
    # The draft model's per-depth forwards follow the mode too (fixed shapes + CUDA graphs, or eager).
    opts = ({"static_shapes": graph, "cuda_graphs": graph and setup.device.type == "cuda", "compile": compile}
            if drafter_name == "model" else {})  # fmt: skip
    drafter = make_drafter(drafter_name, target=setup.target, draft_model=setup.draft, tree_size=t, **opts)
    dec = _engine(setup, drafter, t, graph=graph, compile=compile)
    new = cfg.max_new_tokens
    kwargs = dict(eos_token_id=setup.eos or None, pad_token_id=setup.pad)
    dec.generate(setup.prompts[0], min(16, new), **kwargs)  # warm-up: capture, kernel compiles
    tokens, walls = [], []
    totals = {k: 0.0 for k in ("steps", "draft_s", "verify_s", "forward_s", "commit_s", "prefill_s", "emitted",
                               "accepted")}  # fmt: skip
    for prompt in setup.prompts:
        wall, out = setup.timer(lambda: dec.generate(prompt, new, **kwargs))
        walls.append(wall)
        tokens.append(_finish(out.new_tokens(0).tolist(), setup.eos, new))
        tot = out.totals()
        for k in ("steps", "draft_s", "verify_s", "forward_s", "commit_s", "prefill_s"):
            totals[k] += tot[k]
        totals["emitted"] += sum(s.tokens_emitted[0] for s in out.steps)
        totals["accepted"] += tot["tokens_accepted"]
    steps = max(totals["steps"], 1)
    wall = sum(walls)
    phases = totals["draft_s"] + totals["verify_s"] + totals["commit_s"]
    new_tokens = sum(len(x) for x in tokens)
    ref_name, ref = _reference(setup)
    row = {
        "drafter": drafter_name,
        "mode": mode,
        "captured": graph and setup.device.type == "cuda",
        "tree_size": t,
        "steps": int(totals["steps"]),
        "new_tokens": new_tokens,
        "seconds": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else math.nan,
        "accepted_per_step": totals["accepted"] / steps,
        "tokens_per_step": totals["emitted"] / steps,
        "draft_ms": 1e3 * totals["draft_s"] / steps,
        "verify_ms": 1e3 * totals["verify_s"] / steps,
        "forward_ms": 1e3 * totals["forward_s"] / steps,
        "commit_ms": 1e3 * totals["commit_s"] / steps,
        "host_ms": 1e3 * (wall - totals["prefill_s"] - phases) / steps,
        "step_ms": 1e3 * (wall - totals["prefill_s"]) / steps,
        "prefill_ms": 1e3 * totals["prefill_s"] / len(setup.prompts),
        "reference": ref_name,
        **_agreement(ref, tokens),
    }
    log(f"  {drafter_name:<6} {row['mode']:<8} {row['tokens_per_s']:8.1f} tok/s  {row['tokens_per_step']:.2f} tokens/step")
    return row


# ----------------------------------------------------------------------------------------------
# (d) batch throughput


def _batch_groups(num_prompts: int, batch: int) -> list[list[int]]:
    """Prompt indices per call: rows cycle through the prompts; enough calls to cover them all."""
    calls = -(-num_prompts // batch)
    return [[(k * batch + i) % num_prompts for i in range(batch)] for k in range(calls)]


def _hf_generate_batch(setup: _Setup, prompts: list, new: int) -> list[list[int]]:
    """HF ``generate`` with the static cache on a left-padded batch; new tokens per row (cut at eos)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), setup.pad, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    out = setup.target.generate(ids.to(setup.device), attention_mask=mask.to(setup.device), max_new_tokens=new,
                                do_sample=False, eos_token_id=setup.eos or None, pad_token_id=setup.pad,
                                cache_implementation="static", max_cache_len=setup.capacity)  # fmt: skip
    return [_finish(out[b, width:].tolist(), setup.eos, new) for b in range(len(prompts))]


def run_batch(setup: _Setup, method: str, batch: int, reference: dict[str, Any],
              log: Callable[[str], None]) -> dict[str, Any]:  # fmt: skip
    """Decode every call of ``_batch_groups`` at batch size ``batch`` with ``method`` (a batch drafter
    or ``"hf-static"``), after a warm-up call at that batch size; throughput and acceptance.

    ``reference``: ``{"name": str | None, "tokens": {problem index: tokens}}``, filled by the first
    row when empty; rows identical to it are counted."""
    from drafters import make_drafter

    cfg = setup.cfg
    new = cfg.max_new_tokens
    groups = _batch_groups(len(setup.prompts), batch)
    hf_static = method == "hf-static"
    mode = None if hf_static else cfg.batch_mode
    t = 0 if hf_static else cfg.spec_tree_size
    if hf_static:
        gen = lambda idx, k: (_hf_generate_batch(setup, [setup.prompts[i] for i in idx], k), None)  # noqa: E731
        warm = 2
    else:
        drafter = (make_drafter("medusa", target=setup.target, heads=setup.medusa) if method == "medusa"
                   else make_drafter(method, tree_size=t))  # fmt: skip
        dec = _engine(setup, drafter, t, graph=mode != "eager", compile=mode == "compiled")

        def gen(idx, k):
            prompts = [setup.prompts[i] for i in idx]
            out = dec.generate(prompts, k, eos_token_id=setup.eos or None, pad_token_id=setup.pad)
            return [_finish(out.new_tokens(b).tolist(), setup.eos, k) for b in range(len(idx))], out

        warm = 1
    t0 = time.perf_counter()
    for _ in range(warm):
        gen(groups[0], min(16, new))
    warm_s = time.perf_counter() - t0
    walls, rows = [], []
    emitted = accepted = row_steps = steps = 0
    prefill_s = 0.0
    for idx in groups:
        wall, (tokens, out) = setup.timer(lambda: gen(idx, new))
        walls.append(wall)
        rows.extend(zip(idx, tokens))
        if out is not None:
            steps += len(out.steps)
            prefill_s += out.prefill_s
            for s in out.steps:
                for e, a in zip(s.tokens_emitted, s.tokens_accepted):
                    if e:
                        emitted, accepted, row_steps = emitted + e, accepted + a, row_steps + 1
    if not reference["tokens"]:
        reference["name"] = f"{method} B={batch}"
        for i, tok in rows:
            reference["tokens"].setdefault(i, tok)
    ref = reference["tokens"]
    wall = sum(walls)
    new_tokens = sum(len(tok) for _, tok in rows)
    row = {
        "method": method,
        "mode": mode,
        "batch": batch,
        "tree_size": t,
        "captured": not hf_static and mode != "eager" and setup.device.type == "cuda",
        "calls": len(groups),
        "rows": len(rows),
        "new_tokens": new_tokens,
        "seconds": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else math.nan,
        "row_tokens_per_s": new_tokens / (batch * wall) if wall > 0 else math.nan,  # = tokens_per_s / B
        "tokens_per_step": emitted / row_steps if row_steps else None,
        "accepted_per_step": accepted / row_steps if row_steps else None,
        "steps": steps if not hf_static else None,
        "step_ms": 1e3 * (wall - prefill_s) / steps if steps else None,
        "warmup_s": warm_s,
        "reference": reference["name"],
        "identical": sum(1 for i, tok in rows if ref.get(i) == tok),
    }
    log(f"  {method:<9} B={batch:<3} {row['tokens_per_s']:8.1f} tok/s  {row['row_tokens_per_s']:7.1f} per row"
        + (f"  {row['tokens_per_step']:.2f} tokens/step" if row["tokens_per_step"] else ""))  # fmt: skip
    if not hf_static:
        del dec, drafter
    _free(setup.device)
    return row


def _load_medusa(setup: _Setup) -> None:
    from drafters.medusa import MedusaHeads

    lm = setup.target.get_output_embeddings().weight
    setup.medusa = MedusaHeads.load(setup.cfg.medusa_heads, device=lm.device, dtype=lm.dtype)


# ----------------------------------------------------------------------------------------------
# floors (shared by (e) and (f))


def _bandwidth(cfg: BenchConfig, device) -> dict[str, Any]:
    from specdec.cli.profile_step import measure_copy_bandwidth

    got = measure_copy_bandwidth(device)
    return {"flag_gbs": float(cfg.bandwidth_gbs), "measured_gbs": got["gbs"], "measured_bytes": got["bytes"],
            "measured_median_ms": got["median_ms"]}  # fmt: skip


def _floors(model, prefix: int, bandwidth: dict[str, Any]) -> dict[str, Any]:
    """The weight-streaming floor of one forward of ``model`` (weights, and weights + ``prefix``
    tokens of KV) at the flag's and at the measured bandwidth."""
    from specdec.cli.profile_step import floor_ms, kv_bytes, weight_bytes

    w = weight_bytes(model)
    kv = kv_bytes(model, prefix)
    return {
        **w,
        "kv_tokens": prefix,
        "kv_bytes": kv,
        "floor_ms": floor_ms(w["streamed_bytes"], bandwidth["flag_gbs"]),
        "floor_kv_ms": floor_ms(w["streamed_bytes"] + kv, bandwidth["flag_gbs"]),
        "floor_measured_ms": floor_ms(w["streamed_bytes"], bandwidth["measured_gbs"]),
        "floor_kv_measured_ms": floor_ms(w["streamed_bytes"] + kv, bandwidth["measured_gbs"]),
    }


# ----------------------------------------------------------------------------------------------
# (e) kernel profile of one verify forward


def _median_of(timer: Timer, fn: Callable[[], Any], reps: int) -> float:
    return _median_ms([timer(fn)[0] for _ in range(reps)])


def run_profile_mode(setup: _Setup, cache, tree, prefix: int, mode: str, log: Callable[[str], None]) -> dict[str, Any]:
    """Time and profile one verify forward of ``tree`` over ``cache`` in ``mode`` (graph / compiled)."""
    import torch

    from specdec import hf
    from specdec.cli.profile_step import profile_kernels, summarize_kernels
    from specdec.graphs import GraphedForward

    cfg = setup.cfg
    cuda = setup.device.type == "cuda"
    layers = hf.num_layers(setup.target) or 1
    g = GraphedForward(setup.target, cache, 1, tree.n, impl=cfg.attn_impl, capture=cuda, compile=mode == "compiled")
    g.load([tree], [prefix])
    t0 = time.perf_counter()
    g.forward()  # captures (and compiles) on first use
    if cuda:
        torch.cuda.synchronize(setup.device)
    first_s = time.perf_counter() - t0
    for _ in range(2):
        g.forward()
    forward_ms = _median_of(setup.timer, g.forward, cfg.reps)  # a graph replay on CUDA
    # The same body called eagerly (compiled or not), outside the graph: what a profiler sees launched
    # one by one. On CPU g.forward() is that already.
    uncaptured = getattr(g, "_run", None) if cuda else g.forward
    if uncaptured is None:  # graphs.py without _run: an uncaptured instance of the same forward
        uncaptured = GraphedForward(setup.target, cache, 1, tree.n, impl=cfg.attn_impl, capture=False,
                                    compile=mode == "compiled").forward  # fmt: skip
    if cuda:
        for _ in range(2):
            uncaptured()
    uncaptured_ms = _median_of(setup.timer, uncaptured, cfg.reps) if cuda else forward_ms
    replay_kernels = None
    if cuda:
        kernels = profile_kernels(g.forward, setup.device, cfg.profile_reps)
        replay_kernels = len(kernels) / cfg.profile_reps
        source, wall = "graph replay", forward_ms
        if replay_kernels < layers:  # the profiler saw the graph launch, not the kernels inside it
            kernels = profile_kernels(uncaptured, setup.device, cfg.profile_reps)
            source, wall = "uncaptured forward", uncaptured_ms
    else:
        kernels = profile_kernels(g.forward, setup.device, cfg.profile_reps)
        source, wall = "cpu ops", forward_ms
    summary = summarize_kernels(kernels, cfg.profile_reps, cfg.profile_top)
    row = {
        "mode": mode,
        "source": source,
        "unit": "gpu kernels" if cuda else "cpu ops",
        "captured": cuda,
        "captured_ms": forward_ms if cuda else None,
        "uncaptured_ms": uncaptured_ms,
        "wall_ms": wall,
        "first_call_s": first_s,
        "graph_replay_kernels": replay_kernels,
        "kernels_per_layer": summary["kernels_per_forward"] / layers,
        "kernel_share": summary["kernel_ms"] / wall if wall > 0 else math.nan,
        **summary,
    }
    log(f"  {mode:<9} {row['kernels_per_forward']:7.1f} {row['unit']}/forward, {row['kernel_ms']:.3f} ms of them "
        f"in a {wall:.3f} ms forward ({source})")  # fmt: skip
    del g
    _free(setup.device)
    return row


def run_profile(setup: _Setup, log: Callable[[str], None]) -> dict[str, Any]:
    """(e): one random tree of ``profile_tree_size + 1`` nodes over the first prompt, per mode."""
    import torch

    from specdec import hf
    from specdec.kv import KVCache

    cfg = setup.cfg
    prompt = setup.prompts[0]
    prefix = len(prompt) - 1
    cache = KVCache(1, setup.capacity)
    hf.prefill(setup.target, prompt[None, :prefix] if prefix else prompt[None], cache, impl=cfg.attn_impl)
    gen = torch.Generator().manual_seed(cfg.seed)
    n = cfg.profile_tree_size + 1
    tree = _random_tree(n, int(prompt[-1]), hf.vocab_size(setup.target), gen)
    if setup.bandwidth is None:
        setup.bandwidth = _bandwidth(cfg, setup.device)
    res: dict[str, Any] = {"tree_size": cfg.profile_tree_size, "nodes": n, "prefix_len": prefix,
                           "layers": hf.num_layers(setup.target), "reps": cfg.profile_reps, "timing_reps": cfg.reps,
                           "bandwidth": setup.bandwidth, "floor": _floors(setup.target, prefix, setup.bandwidth),
                           "rows": []}  # fmt: skip
    for mode in cfg.profile_modes:
        _guarded(res["rows"], {"mode": mode}, lambda: run_profile_mode(setup, cache, tree, prefix, mode, log), log)
    return res


# ----------------------------------------------------------------------------------------------
# (f) the engine at Llama-3-8B shapes, random weights


def _no_init_weights():
    """transformers' context that skips weight initialisation (v5: ``transformers.initialization``)."""
    import contextlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            mod = __import__(module, fromlist=["no_init_weights"])
        except ImportError:
            continue
        fn = getattr(mod, "no_init_weights", None)
        if fn is not None:
            return fn()
    return contextlib.nullcontext()


def build_scale_model(name: str, device, dtype, max_positions: int = 0, seed: int = 0, std: float = 0.02):
    """A random-weight Llama causal LM of ``SCALE_CONFIGS[name]`` built directly on ``device``.

    HF's weight init is skipped (``no_init_weights``) and replaced by one cheap pass on the device:
    matrices normal(0, ``std``) from a seeded generator, norm weights 1, biases 0 (finite, small;
    the values do not matter for speed). On the meta device nothing is initialised (sizes only).
    ``max_position_embeddings`` is at least ``max_positions``. The generation config has no eos:
    plain decoding always runs to ``max_new_tokens``.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    if name not in SCALE_CONFIGS:
        raise ValueError(f"name: expected one of {tuple(SCALE_CONFIGS)}, got {name!r}")
    fields = dict(SCALE_CONFIGS[name])
    fields["max_position_embeddings"] = max(int(fields["max_position_embeddings"]), int(max_positions))
    config = LlamaConfig(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    device = torch.device(device)
    with torch.device(device), _no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if device.type != "meta":
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std, generator=gen)
                elif pname.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
            for bname, b in model.named_buffers():
                if b.is_floating_point() and not bool(torch.isfinite(b).all()):
                    raise RuntimeError(f"model: buffer {bname} is not finite after the build")
    model.generation_config = GenerationConfig(pad_token_id=0)
    return model.eval()


def _scale_capacity(prompt_len: int, new: int, max_tree: int) -> int:
    return -(-(prompt_len + new + max_tree + 1 + 8) // 256) * 256


def _scale_engine_decode(model, prompt, cap: int, new: int, compile: bool, cfg: BenchConfig, timer: Timer,
                         device) -> tuple[dict[str, Any], list[int]]:  # fmt: skip
    from specdec import SpecDecoder

    cuda = device.type == "cuda"
    dec = SpecDecoder(model, None, 0, max_cache_len=cap, attn_impl=cfg.attn_impl, static_shapes=True,
                      cuda_graphs=cuda, compile=compile)  # fmt: skip
    t0 = time.perf_counter()
    dec.generate(prompt, min(8, new))  # captures (and compiles)
    warm_s = time.perf_counter() - t0
    wall, out = timer(lambda: dec.generate(prompt, new))
    ms = 1e3 * (wall - out.prefill_s) / new
    row = {"method": "engine-compiled" if compile else "engine-graph", "captured": cuda, "new_tokens": new,
           "ms_per_token": ms, "tokens_per_s": 1e3 / ms if ms > 0 else math.nan, "prefill_ms": 1e3 * out.prefill_s,
           "warmup_s": warm_s}  # fmt: skip
    tokens = out.new_tokens(0).tolist()
    del dec, out
    _free(device)
    return row, tokens


def _step_clock():
    """An HF ``generate`` streamer that records when each ``put`` arrives: the prompt first, then every
    new token (HF copies each to the host, a synchronizing copy, before it puts it)."""
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return StepClock()


def _scale_hf_decode(model, prompt, cap: int, new: int, timer: Timer, device) -> tuple[dict[str, Any], list[int]]:
    import torch

    ids = prompt[None].to(device)
    mask = torch.ones_like(ids)

    def gen(k: int, streamer=None):
        return model.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False, pad_token_id=0,
                              cache_implementation="static", max_cache_len=cap, streamer=streamer)  # fmt: skip

    t0 = time.perf_counter()
    for _ in range(2):  # compiles the decode step on CUDA (and records its graphs)
        gen(min(8, new))
    warm_s = time.perf_counter() - t0
    clock = _step_clock()
    wall, out = timer(lambda: gen(new, clock))
    times = clock.times  # the prompt, then tokens 1..new (token 1 comes from the prefill)
    if len(times) != new + 1:
        raise RuntimeError(f"streamer: expected {new + 1} puts (prompt + {new} tokens), got {len(times)}")
    ms = 1e3 * (times[new] - times[1]) / (new - 1)
    row = {"method": "hf-static", "captured": device.type == "cuda", "new_tokens": new, "ms_per_token": ms,
           "tokens_per_s": 1e3 / ms if ms > 0 else math.nan, "prefill_ms": 1e3 * (times[1] - times[0]),
           "wall_s": wall, "warmup_s": warm_s}  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    del out
    _free(device)
    return row, tokens


def _scale_verify(model, prompt, cap: int, cfg: BenchConfig, timer: Timer, device, gen) -> list[dict[str, Any]]:
    from specdec import hf
    from specdec.graphs import GraphedForward
    from specdec.kv import KVCache

    cuda = device.type == "cuda"
    prefix = len(prompt) - 1
    cache = KVCache(1, cap, num_layers=hf.num_layers(model))
    hf.prefill(model, prompt[None, :prefix], cache, impl=cfg.attn_impl)
    vocab = hf.vocab_size(model)
    rows = []
    for t in sorted(set(cfg.scale_tree_sizes) | {0}):
        tree = _random_tree(t + 1, int(prompt[-1]), vocab, gen)
        graphed = GraphedForward(model, cache, 1, t + 1, impl=cfg.attn_impl, capture=cuda)
        times = _time_graphed(timer, cfg.reps, graphed, tree, prefix)
        rows.append({"prompt_len": len(prompt), "t": t, "nodes": t + 1, "ms": _median_ms(times),
                     "min_ms": min(times) * 1e3, "captured": cuda})  # fmt: skip
        del graphed
        _free(device)
    for r in rows:
        r["x_t0"] = r["ms"] / rows[0]["ms"] if rows[0]["ms"] > 0 else math.nan
    del cache
    _free(device)
    return rows


def run_scale(cfg: BenchConfig, log: Callable[[str], None], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """(f): build the random-weight model, then per prompt length decode / verify / HF static / bars.

    ``save(partial)`` is called after every cell with the section's result so far."""
    import torch

    from specdec import hf

    device, dtype = _device_dtype(cfg)
    name = cfg.scale_config or ("llama3-8b" if device.type == "cuda" else "tiny")
    lengths = list(cfg.scale_prompts or SCALE_PROMPTS[name])
    new = cfg.scale_new_tokens
    caps = {L: _scale_capacity(L, new, max(cfg.scale_tree_sizes)) for L in lengths}
    t0 = time.perf_counter()
    model = build_scale_model(name, device, dtype, max(caps.values()), seed=cfg.seed)
    hf.prepare_model(model, "target")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - t0
    timer = Timer(device)
    res: dict[str, Any] = {"config": name, "dtype": str(dtype).replace("torch.", ""), "build_s": build_s,
                           "model_config": {k: v for k, v in SCALE_CONFIGS[name].items()},
                           "max_position_embeddings": model.config.max_position_embeddings,
                           "bandwidth": _bandwidth(cfg, device), "new_tokens": new, "reps": cfg.reps,
                           "prompts": [], "decode": [], "verify": [], "bars": []}  # fmt: skip
    log(f"  built {name} in {build_s:.1f} s ({dtype}, {device}); copy bandwidth "
        f"{res['bandwidth']['measured_gbs']:.0f} GB/s measured, {cfg.bandwidth_gbs:.0f} GB/s flag")  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = hf.vocab_size(model)
    for L in lengths:
        cap = caps[L]
        prompt = torch.randint(0, vocab, (L,), generator=gen)
        floors = _floors(model, L, res["bandwidth"])
        res["prompts"].append({"prompt_len": L, "capacity": cap, **floors})
        tokens: dict[str, list[int]] = {}
        rows: list[dict[str, Any]] = []

        def cell(method: str, fn) -> None:
            def run():
                row, tokens[method] = fn()
                row = {"prompt_len": L, **row}
                for key, floor in (("x_floor", "floor_ms"), ("x_floor_measured", "floor_measured_ms"),
                                   ("x_floor_kv", "floor_kv_ms")):  # fmt: skip
                    row[key] = row["ms_per_token"] / floors[floor]
                log(f"  L={L:<6} {method:<16} {row['ms_per_token']:8.3f} ms/token  {_num(row['x_floor'])} x floor "
                    f"(warm-up {row['warmup_s']:.1f} s)")  # fmt: skip
                return row

            _guarded(rows, {"prompt_len": L, "method": method}, run, log)
            res["decode"].append(rows[-1])
            save(res)

        for method in ("engine-graph", "engine-compiled"):
            if method in cfg.scale_parts:
                cell(method, lambda: _scale_engine_decode(model, prompt, cap, new, method == "engine-compiled", cfg,
                                                          timer, device))  # fmt: skip
        verify: list[dict[str, Any]] = []
        if "verify" in cfg.scale_parts:
            try:
                verify = _scale_verify(model, prompt, cap, cfg, timer, device, gen)
                res["verify"].extend(verify)
                log(f"  L={L:<6} verify t={verify[0]['t']}..{verify[-1]['t']}: {verify[0]['ms']:.3f} .. "
                    f"{verify[-1]['ms']:.3f} ms")  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported, the other cells still run
                log(f"  error: {type(e).__name__}: {e}")
                res["verify"].append({"prompt_len": L, "error": f"{type(e).__name__}: {e}"})
            save(res)
        if "hf-static" in cfg.scale_parts:
            cell("hf-static", lambda: _scale_hf_decode(model, prompt, cap, new, timer, device))
        for r in rows:
            if "error" not in r and r["method"] != "engine-graph" and "engine-graph" in tokens:
                r["identical_to_engine_graph"] = tokens[r["method"]][:new] == tokens["engine-graph"][:new]
        by_t = {r["t"]: r for r in verify if "error" not in r}
        bar = {"prompt_len": L}
        for r in rows:
            if "error" not in r:
                bar[f"{r['method']}_x_floor"] = r["x_floor"]
                bar[f"{r['method']}_x_floor_measured"] = r["x_floor_measured"]
        bar["verify_t64_x_t0"] = by_t[64]["x_t0"] if 64 in by_t else None
        res["bars"].append(bar)
        save(res)
        _free(device)
    del model
    _free(device)
    return res


# ----------------------------------------------------------------------------------------------
# tables


def _fmt(val, spec: str) -> str:
    if val is None or (isinstance(val, float) and math.isnan(val)):
        width = "".join(itertools.takewhile(str.isdigit, spec))
        return "-".rjust(int(width or 0))
    return format(val, spec)


def format_plain(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'method':<14}{'tok/s':>9}{'ms/token':>10}{'identical':>11}  vs",
             "-" * 56]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<14} error: {r['error']}")
            continue
        ident = "-" if r["identical"] is None else f"{r['identical']}/{len(r['per_problem_s'])}"
        lines.append(f"{r['method']:<14}{_fmt(r['tokens_per_s'], '9.1f')}{_fmt(r['ms_per_token'], '10.2f')}"
                     f"{ident:>11}  {r['reference'] or '-'}")  # fmt: skip
    return "\n".join(lines)


def format_verify(res: dict[str, Any]) -> str:
    plain = ", ".join(f"{k} {v:.2f}" for k, v in res.get("plain_ms_per_token", {}).items())
    lines = [f"prefix {res['prefix_len']} tokens, cache capacity {res['capacity']}, median of {res['reps']}"
             + (f"; (a) ms/token: {plain}" if plain else ""),
             f"{'nodes':>6}{'eager ms':>10}{'x plain':>9}{'graph ms':>10}{'x plain':>9}{'eager/graph':>13}{'max |dlogit|':>14}",
             "-" * 71]  # fmt: skip
    for r in res["rows"]:
        speed = r["eager_ms"] / r["graph_ms"] if r["graph_ms"] > 0 else math.nan
        lines.append(f"{r['nodes']:>6}{_fmt(r['eager_ms'], '10.3f')}{_fmt(r['eager_x_plain'], '9.2f')}"
                     f"{_fmt(r['graph_ms'], '10.3f')}{_fmt(r['graph_x_plain'], '9.2f')}{_fmt(speed, '13.2f')}"
                     f"{_fmt(r['max_abs_logit_diff'], '14.2e')}")  # fmt: skip
    return "\n".join(lines)


def format_spec(rows: list[dict[str, Any]]) -> str:
    head = (f"{'drafter':<8}{'mode':<9}{'t':>4}{'tok/s':>8}{'acc/step':>9}{'tok/step':>9}{'draft':>8}{'verify':>8}"
            f"{'(fwd)':>8}{'commit':>8}{'host':>7}{'step':>8}{'identical':>10}")
    lines = ["per-step ms; host = wall time outside draft / verify / commit (prefill excluded)", head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['drafter']:<8}{r['mode']:<9} error: {r['error']}")
            continue
        ident = "-" if r["identical"] is None else f"{r['identical']}/{len(r['first_mismatch'])}"
        lines.append(f"{r['drafter']:<8}{r['mode']:<9}{r['tree_size']:>4}{_fmt(r['tokens_per_s'], '8.1f')}"
                     f"{_fmt(r['accepted_per_step'], '9.2f')}{_fmt(r['tokens_per_step'], '9.2f')}"
                     f"{_fmt(r['draft_ms'], '8.2f')}{_fmt(r['verify_ms'], '8.2f')}{_fmt(r['forward_ms'], '8.2f')}"
                     f"{_fmt(r['commit_ms'], '8.2f')}{_fmt(r['host_ms'], '7.2f')}{_fmt(r['step_ms'], '8.2f')}"
                     f"{ident:>10}")  # fmt: skip
    return "\n".join(lines)


def format_batch(rows: list[dict[str, Any]]) -> str:
    head = (f"{'method':<10}{'mode':<9}{'B':>4}{'tok/s':>9}{'per row':>9}{'tok/step':>9}{'acc/step':>9}"
            f"{'step ms':>9}{'warm-up s':>10}{'identical':>11}")
    lines = ["tok/s: new tokens of all rows / wall time; per row: tok/s / B (what one sequence sees)",
             head, "-" * len(head)]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"{r['method']:<10}{'':<9}{r.get('batch', '-'):>4} error: {r['error']}")
            continue
        ident = f"{r['identical']}/{r['rows']}"
        lines.append(f"{r['method']:<10}{r['mode'] or '-':<9}{r['batch']:>4}{_fmt(r['tokens_per_s'], '9.1f')}"
                     f"{_fmt(r['row_tokens_per_s'], '9.1f')}{_fmt(r['tokens_per_step'], '9.2f')}"
                     f"{_fmt(r['accepted_per_step'], '9.2f')}{_fmt(r['step_ms'], '9.2f')}{_fmt(r['warmup_s'], '10.1f')}"
                     f"{ident:>11}")  # fmt: skip
    return "\n".join(lines)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e7 else f"{nbytes / 1e3:.1f} kB"


def _num(val, width: int = 0) -> str:
    """Two decimals, or three significant digits for large / tiny values (ratios against a tiny floor)."""
    if val is None or (isinstance(val, float) and math.isnan(val)):
        return "-".rjust(width)
    text = f"{val:.2f}" if 0.01 <= abs(val) < 1e4 or val == 0 else f"{val:.3g}"
    return text.rjust(width)


def format_profile(res: dict[str, Any]) -> str:
    fl, bw = res["floor"], res["bandwidth"]
    lines = [f"verify forward of t = {res['tree_size']} draft nodes ({res['nodes']} with the root) over a "
             f"{res['prefix_len']}-token prefix, {res['layers']} layers; profiled {res['reps']} forwards, timed "
             f"{res['timing_reps']} (median)",
             f"floor: weights {_gb(fl['streamed_bytes'])} -> {_num(fl['floor_ms'])} ms at {bw['flag_gbs']:.0f} GB/s, "
             f"{_num(fl['floor_measured_ms'])} ms at {bw['measured_gbs']:.0f} GB/s measured; with the prefix KV "
             f"({_gb(fl['kv_bytes'])}) {_num(fl['floor_kv_ms'])} / {_num(fl['floor_kv_measured_ms'])} ms"]  # fmt: skip
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"\n[{r['mode']}] error: {r['error']}")
            continue
        replay = "" if r["graph_replay_kernels"] is None else f"; the graph replay showed {r['graph_replay_kernels']:.0f}"
        lines.append(
            f"\n[{r['mode']}] profiled: {r['source']}{replay}; forward wall: "
            + (f"captured {r['captured_ms']:.3f} ms, " if r["captured_ms"] is not None else "no capture on CPU, ")
            + f"uncaptured {r['uncaptured_ms']:.3f} ms; first call (capture / compile) {r['first_call_s']:.1f} s\n"
            f"{r['kernels_per_forward']:.1f} {r['unit']} per forward ({r['kernels_per_layer']:.1f} per layer), "
            f"{r['kernel_ms']:.3f} ms of them = {_fmt(100 * r['kernel_share'], '.0f')} % of the {r['wall_ms']:.3f} ms "
            f"wall; {_num(r['wall_ms'] / fl['floor_ms'])} x the weights floor (flag bandwidth), "
            f"{_num(r['wall_ms'] / fl['floor_measured_ms'])} x (measured)"
        )  # fmt: skip
        lines.append(f"{'category':<12}{'count':>8}{'ms':>9}{'share':>7}")
        for name, c in r["categories"].items():
            lines.append(f"{name:<12}{c['kernels']:>8.1f}{c['ms']:>9.3f}{100 * c['share']:>6.0f}%")
        head = f"{'kernel':<72}{'cat':>6}{'count':>7}{'us each':>9}{'ms/fwd':>8}{'share':>7}"
        lines += [head, "-" * len(head)]
        for k in r["top"]:
            lines.append(f"{k['name']:<72}{k['category'][:5]:>6}{k['count']:>7.1f}{k['us_each']:>9.1f}"
                         f"{k['ms']:>8.3f}{100 * k['share']:>6.0f}%")  # fmt: skip
    return "\n".join(lines)


def format_scale(res: dict[str, Any]) -> str:
    bw = res["bandwidth"]
    lines = [f"{res['config']} ({res['dtype']}), random weights, built in {res['build_s']:.1f} s; copy bandwidth "
             f"{bw['measured_gbs']:.0f} GB/s measured, {bw['flag_gbs']:.0f} GB/s flag; {res['new_tokens']} new tokens "
             f"(prefill excluded), verify median of {res['reps']}"]  # fmt: skip
    for p in res["prompts"]:
        lines.append(f"L = {p['prompt_len']}: weights {_gb(p['streamed_bytes'])} streamed -> floor {_num(p['floor_ms'])} "
                     f"ms (flag) / {_num(p['floor_measured_ms'])} ms (measured); + KV {_gb(p['kv_bytes'])}: "
                     f"{_num(p['floor_kv_ms'])} / {_num(p['floor_kv_measured_ms'])} ms")  # fmt: skip
    head = f"{'L':>6}  {'method':<16}{'ms/token':>9}{'tok/s':>8}{'x floor':>9}{'x meas.':>9}{'x +KV':>9}{'warm-up s':>10}"
    lines += ["", "plain decode", head, "-" * len(head)]
    for r in res["decode"]:
        if "error" in r:
            lines.append(f"{r['prompt_len']:>6}  {r['method']:<16} error: {r['error']}")
            continue
        lines.append(f"{r['prompt_len']:>6}  {r['method']:<16}{r['ms_per_token']:>9.3f}{_fmt(r['tokens_per_s'], '8.1f')}"
                     f"{_num(r['x_floor'], 9)}{_num(r['x_floor_measured'], 9)}{_num(r['x_floor_kv'], 9)}"
                     f"{r['warmup_s']:>10.1f}")  # fmt: skip
    if res["verify"]:
        head = f"{'L':>6}{'t':>5}{'nodes':>7}{'ms':>9}{'min ms':>9}{'x t=0':>7}"
        lines += ["", "verify forward (graphed; t draft nodes + the root)", head, "-" * len(head)]
        for r in res["verify"]:
            if "error" in r:
                lines.append(f"{r['prompt_len']:>6} error: {r['error']}")
                continue
            lines.append(f"{r['prompt_len']:>6}{r['t']:>5}{r['nodes']:>7}{r['ms']:>9.3f}{r['min_ms']:>9.3f}"
                         f"{r['x_t0']:>7.2f}")  # fmt: skip
    lines += ["", "bars: plain decode ms / weights floor <= 1.3 (flag bandwidth; measured); "
              "verify(t=64) / verify(t=0) <= 1.2"]
    for b in res["bars"]:
        parts = [f"{k[: -len('_x_floor')]} {_num(b[k])} ({_num(b[k + '_measured'])})" for k in b if k.endswith("_x_floor")]
        parts.append(f"verify t=64/t=0 {_fmt(b['verify_t64_x_t0'], '.2f')}")
        lines.append(f"L = {b['prompt_len']}: " + ", ".join(parts))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# driver


def _env(device, dtype) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    info: dict[str, Any] = {
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def _write(path: str | None, result: dict[str, Any]) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def _guarded(rows: list, fallback: dict[str, Any], fn: Callable[[], dict[str, Any]], log) -> None:
    """Append ``fn()``, or ``fallback`` plus the error when it raises (the run goes on)."""
    try:
        rows.append(fn())
    except Exception as e:  # noqa: BLE001 - reported in the table and the JSON, the other rows still run
        log(f"  error: {type(e).__name__}: {e}")
        rows.append({**fallback, "error": f"{type(e).__name__}: {e}"})


def run_bench(cfg: BenchConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the selected sections; return (and write to ``cfg.out``) the result dict."""
    import torch

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    setup = _setup(cfg, log) if any(s in cfg.sections for s in _TARGET_SECTIONS) else None
    device, dtype = (setup.device, setup.dtype) if setup is not None else _device_dtype(cfg)
    result: dict[str, Any] = {
        "config": {**asdict(cfg), "tree_sizes": list(cfg.tree_sizes)},
        "env": _env(device, dtype),
    }
    if setup is not None:
        result["capacity"] = setup.capacity
        result["prompts"] = [{"id": i, "length": len(p)} for i, p in zip(setup.problem_ids, setup.prompts)]
    batch_ref: dict[str, Any] = {"name": None, "tokens": {}}
    with torch.no_grad():
        if "plain" in cfg.sections:
            log(f"(a) plain decoding, {len(setup.prompts)} prompts x {cfg.max_new_tokens} new tokens")
            rows: list[dict[str, Any]] = []
            for method in ("hf", "engine-eager", "engine-graph", "engine-compiled"):  # hf-static last: it compiles
                if method in cfg.plain_methods:
                    _guarded(rows, {"method": method}, lambda: run_plain_method(setup, method, log), log)
            result["plain"] = rows
            setup.plain_ms.update({r["method"]: r["ms_per_token"] for r in rows if "error" not in r})
            _write(cfg.out, result)
            print("\n(a) plain decoding\n" + format_plain(rows), flush=True)
        if "verify" in cfg.sections:
            log(f"(b) verify forward, tree sizes {sorted(set(cfg.tree_sizes) | {1})}")
            try:
                result["verify"] = run_verify(setup, log)
                print("\n(b) one verify forward (inputs + forward)\n" + format_verify(result["verify"]), flush=True)
            except Exception as e:  # noqa: BLE001
                log(f"  error: {type(e).__name__}: {e}")
                result["verify"] = {"error": f"{type(e).__name__}: {e}"}
            _write(cfg.out, result)
        if "spec" in cfg.sections:
            log(f"(c) speculative decoding, t = {cfg.spec_tree_size}")
            rows = []
            for name in cfg.drafters:
                for mode in cfg.spec_modes:
                    _guarded(rows, {"drafter": name, "mode": mode}, lambda: run_spec(setup, name, mode, log), log)
                    _write(cfg.out, {**result, "spec": rows})
            result["spec"] = rows
            print("\n(c) speculative decoding per step\n" + format_spec(rows), flush=True)
        if "batch" in cfg.sections:
            log(f"(d) batch throughput, B = {list(cfg.batch_sizes)}, t = {cfg.spec_tree_size}")
            ref_name, ref = _reference(setup)
            if ref is not None:
                batch_ref = {"name": ref_name, "tokens": dict(enumerate(ref))}
            rows = result["batch"] = []
            if "medusa" in cfg.batch_drafters:
                _load_medusa(setup)
            for name in cfg.batch_drafters:
                for batch in cfg.batch_sizes:
                    _guarded(rows, {"method": name, "batch": batch},
                             lambda: run_batch(setup, name, batch, batch_ref, log), log)  # fmt: skip
                    _write(cfg.out, result)
            print("\n(d) batch throughput" + (" (HF static cache rows at the end)" if not cfg.batch_skip_hf else "")
                  + "\n" + format_batch(rows), flush=True)  # fmt: skip
        if "profile" in cfg.sections:
            log(f"(e) kernel profile of a verify forward, t = {cfg.profile_tree_size}, modes {list(cfg.profile_modes)}")
            try:
                result["profile"] = run_profile(setup, log)
                print("\n(e) kernel profile of one verify forward\n" + format_profile(result["profile"]), flush=True)
            except Exception as e:  # noqa: BLE001
                log(f"  error: {type(e).__name__}: {e}")
                result["profile"] = {"error": f"{type(e).__name__}: {e}"}
            _write(cfg.out, result)
        if "plain" in cfg.sections and "hf-static" in cfg.plain_methods:
            log("(a) hf-static (compiles on CUDA)")
            _guarded(result["plain"], {"method": "hf-static"}, lambda: run_plain_method(setup, "hf-static", log), log)
            _write(cfg.out, result)
            print("\n(a) plain decoding, with hf-static\n" + format_plain(result["plain"]), flush=True)
        if "batch" in cfg.sections and not cfg.batch_skip_hf:
            log("(d) hf-static batches (compiles on CUDA, per batch size)")
            for batch in cfg.batch_sizes:
                _guarded(result["batch"], {"method": "hf-static", "batch": batch},
                         lambda: run_batch(setup, "hf-static", batch, batch_ref, log), log)  # fmt: skip
                _write(cfg.out, result)
            print("\n(d) batch throughput, with hf-static\n" + format_batch(result["batch"]), flush=True)
        if "scale" in cfg.sections:
            log("(f) the engine at scale (random weights)")

            def save(partial: dict[str, Any]) -> None:
                result["scale"] = partial
                _write(cfg.out, result)

            try:
                result["scale"] = run_scale(cfg, log, save)
                print("\n(f) the engine at scale\n" + format_scale(result["scale"]), flush=True)
            except Exception as e:  # noqa: BLE001
                if type(e).__name__ == "OutOfMemoryError" and "scale" not in result:
                    raise  # building the model did not fit: the user's problem, one line
                log(f"  error: {type(e).__name__}: {e}")
                result["scale"] = {**result.get("scale", {}), "error": f"{type(e).__name__}: {e}"}
    _write(cfg.out, result)
    return result


def _csv(kind: Callable[[str], Any], allowed: Sequence[str] | None = None):
    def parse(text: str):
        vals = tuple(kind(x) for x in text.split(",") if x.strip())
        if allowed is not None:
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise argparse.ArgumentTypeError(f"expected some of {', '.join(allowed)}, got {', '.join(bad)}")
        return vals

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(
        prog="specdec bench-engine",
        description="The engine's own speed: (a) plain decode tokens/s (engine eager / CUDA graph vs HF default "
        "and static cache), (b) one verify forward per tree size, (c) per-step breakdown of speculative "
        "decoding (draft model, prompt lookup); opt-in: (d) batch throughput vs HF static cache, (e) kernel "
        "profile of one verify forward, (f) the engine at Llama-3-8B shapes with random weights vs the "
        "weight-streaming floor. Tables on stdout, JSON with --out.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"default model name, HF id, local dir or .gguf (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for the 'model' drafter (default {DEFAULT_DRAFT})")
    p.add_argument("--data", type=cliargs.existing_path, default=None, help="APPS .json/.jsonl file (default: $SPECDEC_APPS or the shared 150-row file)")
    p.add_argument("--problems", type=cliargs.int_at_least(1), default=4, help="APPS problems (first unique ones in file order; default 4)")
    p.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=128)
    p.add_argument("--tree-sizes", type=cliargs.int_at_least(1), nargs="+", default=[1, 16, 32, 64, 128, 256],
                   help="(b) nodes per verify forward, root included (default 1 16 32 64 128 256; 1 is always measured)")
    p.add_argument("--spec-tree-size", type=cliargs.int_at_least(0), default=64,
                   help="(c), (d) draft nodes per step besides the root (default 64)")
    p.add_argument("--sections", type=_csv(str, SECTIONS), default=DEFAULT_SECTIONS,
                   help="comma list of plain, verify, spec, batch, profile, scale (default plain,verify,spec)")
    p.add_argument("--plain-methods", type=_csv(str, PLAIN_METHODS), default=PLAIN_METHODS,
                   help="(a) comma list (default hf,hf-static,engine-eager,engine-graph,engine-compiled)")
    p.add_argument("--drafters", type=_csv(str, DRAFTERS), default=DRAFTERS, help="(c) comma list (default model,lookup)")
    p.add_argument("--spec-modes", type=_csv(str, SPEC_MODES), default=("eager", "graph"),
                   help="(c) comma list of eager, graph, compiled (default eager,graph)")
    p.add_argument("--reps", type=cliargs.int_at_least(1), default=20, help="(b), (e), (f) timed forwards per tree size and mode (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=cliargs.device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--attn-impl", choices=["auto", "triton", "torch"], default="auto",
                   help="tree attention implementation (auto: Triton on CUDA)")
    p.add_argument("--no-progress", action="store_true", help="no model fetch/convert progress bars")
    p.add_argument("--out", type=cliargs.output_file, default=None, help="write the results as JSON here (rewritten after every section)")
    g = p.add_argument_group("(d) batch throughput (--sections batch)")
    g.add_argument("--batch-sizes", type=cliargs.int_at_least(1), nargs="+", default=[1, 2, 4, 8, 16],
                   help="batch sizes (default 1 2 4 8 16); rows cycle through the --problems prompts")
    g.add_argument("--batch-drafter", type=_csv(str, BATCH_DRAFTERS), default=("medusa",),
                   help="comma list of medusa, lookup (default medusa: needs --medusa-heads)")
    g.add_argument("--medusa-heads", type=_medusa_dir, default=None, help="Medusa heads directory (specdec train-medusa --out)")
    g.add_argument("--batch-mode", choices=SPEC_MODES, default="graph", help="engine mode of the batch rows (default graph)")
    g.add_argument("--batch-skip-hf", action="store_true", help="leave out the HF static-cache rows (they compile per batch size)")
    g = p.add_argument_group("(e) kernel profile (--sections profile)")
    g.add_argument("--profile-tree-size", type=cliargs.int_at_least(0), default=64,
                   help="draft nodes of the profiled verify forward besides the root (default 64)")
    g.add_argument("--profile-modes", type=_csv(str, PROFILE_MODES), default=PROFILE_MODES,
                   help="comma list of graph, compiled (default both)")
    g.add_argument("--profile-reps", type=cliargs.int_at_least(1), default=5, help="forwards under the profiler (default 5)")
    g.add_argument("--profile-top", type=cliargs.int_at_least(1), default=15, help="kernels listed by total time (default 15)")
    g = p.add_argument_group("(f) the engine at scale, random weights (--sections scale; no --target needed)")
    g.add_argument("--scale-config", choices=sorted(SCALE_CONFIGS), default=None,
                   help="model shape (default: llama3-8b on CUDA, tiny on CPU)")
    g.add_argument("--scale-prompts", type=cliargs.int_at_least(2), nargs="+", default=None,
                   help="prompt lengths, random token ids (default 1024 16384 for llama3-8b, 64 256 for tiny)")
    g.add_argument("--scale-new-tokens", type=cliargs.int_at_least(2), default=64, help="plain decode tokens timed (default 64)")
    g.add_argument("--scale-tree-sizes", type=cliargs.int_at_least(1), nargs="+", default=list(SCALE_TREE_SIZES),
                   help="verify forwards of t draft nodes + the root (t = 0 always; default 1 2 4 ... 256)")
    g.add_argument("--scale-parts", type=_csv(str, SCALE_PARTS), default=("engine-graph", "hf-static", "verify"),
                   help="comma list of engine-graph, engine-compiled, hf-static, verify (default all but engine-compiled)")
    p.add_argument("--bandwidth-gbs", type=cliargs.float_in(0.0, low_open=True), default=DEFAULT_BANDWIDTH_GBS,
                   help="(e), (f) memory bandwidth of the floor, GB/s (default 3000: the H100's copy bandwidth; the run "
                   "also measures one and reports both)")
    return p


def _medusa_dir(text: str) -> str:
    """argparse type: a directory holding saved Medusa heads."""
    from pathlib import Path

    from drafters.medusa import CONFIG_NAME, WEIGHTS_NAME

    path = Path(cliargs.existing_path(text))
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if not (path / n).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"expected a Medusa heads directory with {' and '.join(missing)}, got {text!r}")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = BenchConfig(
        target=ns.target, draft=ns.draft, data=ns.data, problems=ns.problems, max_new_tokens=ns.max_new_tokens,
        tree_sizes=tuple(ns.tree_sizes), spec_tree_size=ns.spec_tree_size, sections=tuple(ns.sections),
        plain_methods=tuple(ns.plain_methods), drafters=tuple(ns.drafters), spec_modes=tuple(ns.spec_modes),
        reps=ns.reps, seed=ns.seed,
        device=ns.device, dtype=ns.dtype, attn_impl=ns.attn_impl, progress=not ns.no_progress, out=ns.out,
        batch_sizes=tuple(ns.batch_sizes), batch_drafters=tuple(ns.batch_drafter), batch_mode=ns.batch_mode,
        batch_skip_hf=ns.batch_skip_hf, medusa_heads=ns.medusa_heads, profile_tree_size=ns.profile_tree_size,
        profile_modes=tuple(ns.profile_modes), profile_reps=ns.profile_reps, profile_top=ns.profile_top,
        scale_config=ns.scale_config, scale_prompts=None if ns.scale_prompts is None else tuple(ns.scale_prompts),
        scale_new_tokens=ns.scale_new_tokens, scale_tree_sizes=tuple(ns.scale_tree_sizes),
        scale_parts=tuple(ns.scale_parts), bandwidth_gbs=ns.bandwidth_gbs,
    )  # fmt: skip
    run_bench(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
