"""Randomized stress test of ``SpecDecoder.generate`` in one long-lived process (issue 13, item 2).

A crash was found when, in one process, the engine (Medusa drafter, CUDA graphs) decoded batches
of different sizes interleaved with the target's own HF ``generate(cache_implementation="static")``
(torch.compile's CUDA-graph trees). Such bugs need *state carried across calls*: engines whose
caches and captured graphs are reused, recaptured for new batch sizes, dropped; other code using
the same device memory in between. ``run_stress`` builds exactly that situation at random:

- a seeded plan of ``cfg.calls`` calls (``plan_calls``), each either an engine call -- a drafter
  (``"model"``, ``"medusa"``, ``"lookup"``, or ``"none"``: plain decoding through the engine), a
  tree size, CUDA graphs on / off, ``torch.compile`` on / off, greedy or sampling (random
  temperature / top-k / top-p), sometimes an eos id -- or one of the target's own HF ``generate``
  calls with the default cache (``"hf"``) or ``cache_implementation="static"`` (``"hf-static"``);
  every call on a random batch of 1..8 random prompts of random lengths (1..3000 tokens, drawn
  half uniformly, half log-uniformly so that short and one-token prompts come up too; some prompts
  repeat earlier ones);
- engines are built lazily per (drafter, tree size, graphs, compile) and **reused** across calls
  (at most ``cfg.max_engines`` live; the least recently used one is dropped, and on CUDA its memory
  handed back with ``torch.cuda.empty_cache()``: dropped graphs and pools are part of the stress);
- every output is checked: lengths, ids in range, the prompt kept, padding, eos handling and the
  per-step statistics (every call); and in float32 under greedy decoding (engine and HF calls)
  every row must equal the same prompt decoded alone by the target's own greedy decoding -- the
  ground truth, computed by a plain decoder ``SpecDecoder(target, None)`` (the device's defaults:
  CUDA graphs on CUDA; ``cfg.reference = "eager"``: dynamic shapes without graphs, sharing the
  least with the engines under test), one prompt at a time, and cached per prompt (repeated
  prompts cost nothing). A mismatching row is diagnosed by one plain forward of the target at the
  first differing token: when the two candidate tokens' logits differ by at most ``cfg.tie_tol``
  it is a *near tie* (batched and single forwards round differently; reported, not a failure),
  else a failure. Sampled rows cannot be compared: they are checked for validity only;
- an exception is recorded with its call and the run goes on (the engine that raised is dropped
  and rebuilt on next use), unless it is a CUDA error that poisons the context (illegal address,
  launch failure, device-side assert): then the run stops and says so.

Per call the record holds the plan, wall time, new tokens, steps, the slowest step (``draft_s +
verify_s + commit_s``), rows compared and the outcome (``ok`` / ``mismatch`` / ``error`` + its
message). The summary counts calls per kind, drafter, mode and decoding, lists crashes and
mismatches, the slowest call and the slowest step (also among calls that neither built an engine
nor met a new batch size, i.e. steady state), and per engine its build time and first call apart
from its steady-state calls (``new_shape``: a call at another batch size than the engine's previous
call, or needing more cache than the engine served since that batch size came -- where an engine
with CUDA graphs reallocates its cache and captures again, and a compiled one may compile). ``cfg.budget_s`` stops the run before a call that would likely not
finish in time (so that a device time limit never cuts it mid-call); a run stopped early is a
normal result (``stopped``), not a failure.

Models (``cfg.models``): ``"tiny"`` builds a random Qwen2 or Llama target (``cfg.tiny_layers``
layers) and a 1-layer draft that shares its embeddings, first layer and LM head (so the draft model
drafter gets multi-token acceptances), vocabulary ``cfg.tiny_vocab``, room for the longest prompt
plus new tokens, and random Medusa heads (they accept almost nothing: Medusa calls exercise the
hidden-state path, the static topology and the graphs with hidden outputs, not long accepted
paths); ``"pretrained"`` loads ``cfg.target`` / ``cfg.draft`` with
``specdec.models.load_model`` (default names, HF ids or directories) and Medusa heads from
``cfg.medusa_heads`` (untrained, identity-initialized heads when None).

``compile``: ``torch.compile`` with ``cfg.compile_backend`` (default inductor). On CUDA that is the
intended use; on CPU inductor needs a C++ compiler and takes tens of seconds per compiled shape, so
keep ``compile_share`` at 0 there (``"aot_eager"`` traces without code generation, for quick
checks). HF's own static-cache generate compiles only on CUDA.

Entry points: :func:`run_stress` (library) and ``scripts/device/stress.py`` (command line).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "DTYPES",
    "KINDS",
    "MODEL_SOURCES",
    "REFERENCES",
    "STRESS_DRAFTERS",
    "CallPlan",
    "StressConfig",
    "StressModels",
    "StressResult",
    "build_tiny_models",
    "check_output",
    "check_row",
    "format_summary",
    "is_fatal_cuda_error",
    "load_models",
    "make_prompt",
    "plan_calls",
    "run_stress",
    "summarize",
]

#: Drafters a call may use: the three of ``drafters.make_drafter`` and plain decoding ("none").
STRESS_DRAFTERS = ("model", "medusa", "lookup", "none")
#: What a call runs: the engine, or the target's HF generate with the default / static cache.
KINDS = ("spec", "hf", "hf-static")
MODEL_SOURCES = ("tiny", "pretrained")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TINY_FAMILIES = ("qwen2", "llama")
#: Reference decoders: ``SpecDecoder(target, None)`` with the device's defaults, or eager dynamic shapes.
REFERENCES = ("default", "eager")
#: Filler of output rows after their end (engine and HF calls).
PAD = 0
#: Substrings of an exception's message that mean the CUDA context is poisoned: stop the run.
_FATAL_CUDA = ("CUDA error", "cudaError", "illegal memory access", "unspecified launch failure",
               "device-side assert", "CUBLAS_STATUS_EXECUTION_FAILED", "misaligned address")  # fmt: skip


# ----------------------------------------------------------------------------------------------
# configuration


def _check_range(name: str, val: Any, low: int) -> None:
    if (not isinstance(val, tuple) or len(val) != 2
            or any(not isinstance(v, int) or isinstance(v, bool) for v in val)
            or not low <= val[0] <= val[1]):  # fmt: skip
        raise ValueError(f"{name}: expected a tuple (lo, hi) of ints with {low} <= lo <= hi, got {val!r}")


@dataclass(frozen=True)
class StressConfig:
    """Everything a stress run depends on (the same config and seed give the same call plan).

    Attributes:
        calls: calls to plan (engine calls + HF generate calls).
        seed: seeds the plan, the prompts and the sampling.
        batch_sizes: ``(lo, hi)``, inclusive: each call's batch size is drawn uniformly.
        prompt_lens: ``(lo, hi)``, inclusive: each prompt's length (half of the draws uniform, half
            log-uniform).
        new_tokens: ``(lo, hi)``, inclusive: each call's ``max_new_tokens``.
        tree_sizes: tree sizes an engine call draws from (the ``"none"`` drafter uses 0).
        drafters: drafters engine calls draw from (``STRESS_DRAFTERS``).
        graphs_share: probability that an engine call uses an engine with CUDA graphs (static
            shapes; on CPU the same fixed-buffer code without a capture); else CUDA graphs off and
            the device's default shapes (static on CUDA, dynamic on CPU).
        compile_share: probability that an engine call uses an engine whose fixed-shape forwards
            (target, and the draft model's) run through ``torch.compile`` (implies static shapes).
        compile_backend: the ``torch.compile`` backend of those engines (``"inductor"``, or e.g.
            ``"aot_eager"``).
        sampling_share: probability that an engine call samples (``do_sample=True``) instead of
            decoding greedily. HF calls are always greedy (their rows are checked).
        hf_share: probability that a call is the target's own HF ``generate`` instead of the engine.
        hf_static_share: of those, the share with ``cache_implementation="static"`` (the rest use
            the default dynamic cache).
        eos_share: probability that a call passes an eos id (or two), chosen so that rows end early
            and at different steps: under greedy fp32 decoding a token of one row's reference
            continuation, else a token recently generated.
        reuse_share: probability that a prompt repeats one of an earlier call.
        dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``; rows are compared with the reference only in fp32.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        budget_s: stop (cleanly, between calls) before a call that would likely end after this many
            seconds from the start of ``run_stress`` (model loading included); None: no limit. A
            call with a fresh compile can outlast the estimate: leave room for one.
        models: ``"tiny"`` (random tiny models) or ``"pretrained"`` (``target`` / ``draft``).
        target, draft: for ``"pretrained"``: a default model name, HF id or directory
            (``specdec.models.load_model``); ``draft`` is needed when ``drafters`` has ``"model"``.
        medusa_heads: for ``"pretrained"``: a ``MedusaHeads`` directory; None: untrained heads.
        tiny_family: ``"qwen2"`` or ``"llama"``: the tiny models' architecture.
        tiny_layers: the tiny target's layers (the draft has 1).
        tiny_hidden: the tiny models' hidden size (4 query heads, 2 KV heads).
        tiny_vocab: the tiny models' vocabulary size.
        max_engines: engines kept alive at once (least recently used dropped first).
        tie_tol: a mismatching greedy row whose two candidate tokens' logits (one plain fp32 forward
            at the first difference) are this close is a near tie: reported, not a failure.
        check_hf: compare the rows of HF generate calls with the reference too (in fp32).
        reference: the reference decoder ``SpecDecoder(target, None)``: ``"default"`` (the device's
            defaults: static shapes and CUDA graphs on CUDA, dynamic shapes on CPU) or ``"eager"``
            (dynamic shapes, no graphs, on any device).
        attn_impl: the engine's attention implementation (``"auto"``, ``"triton"``, ``"torch"``).
        progress: a tqdm bar on stderr.
        out: JSON file written after every call (atomically), or None.
    """

    calls: int = 200
    seed: int = 0
    batch_sizes: tuple[int, int] = (1, 8)
    prompt_lens: tuple[int, int] = (1, 3000)
    new_tokens: tuple[int, int] = (1, 64)
    tree_sizes: tuple[int, ...] = (8, 32, 64, 128)
    drafters: tuple[str, ...] = ("model", "medusa", "lookup")
    graphs_share: float = 0.5
    compile_share: float = 0.0
    compile_backend: str = "inductor"
    sampling_share: float = 0.3
    hf_share: float = 0.15
    hf_static_share: float = 0.5
    eos_share: float = 0.3
    reuse_share: float = 0.2
    dtype: str = "fp32"
    device: str = "cpu"
    budget_s: float | None = None
    models: str = "tiny"
    target: str | None = None
    draft: str | None = None
    medusa_heads: str | None = None
    tiny_family: str = "qwen2"
    tiny_layers: int = 2
    tiny_hidden: int = 128
    tiny_vocab: int = 512
    max_engines: int = 16
    tie_tol: float = 1e-3
    check_hf: bool = True
    reference: str = "default"
    attn_impl: str = "auto"
    progress: bool = True
    out: str | None = None

    def __post_init__(self) -> None:
        for name, low in (("calls", 1), ("seed", 0), ("tiny_layers", 1), ("tiny_hidden", 8), ("tiny_vocab", 16),
                          ("max_engines", 1)):  # fmt: skip
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {val!r}")
        if self.tiny_hidden % 4:
            raise ValueError(f"tiny_hidden: expected a multiple of 4 (4 attention heads), got {self.tiny_hidden}")
        _check_range("batch_sizes", self.batch_sizes, 1)
        _check_range("prompt_lens", self.prompt_lens, 1)
        _check_range("new_tokens", self.new_tokens, 1)
        if (not isinstance(self.tree_sizes, tuple) or not self.tree_sizes
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in self.tree_sizes)):  # fmt: skip
            raise ValueError(f"tree_sizes: expected a non-empty tuple of ints >= 1, got {self.tree_sizes!r}")
        if not isinstance(self.drafters, tuple) or not self.drafters:
            raise ValueError(f"drafters: expected a non-empty tuple of {STRESS_DRAFTERS}, got {self.drafters!r}")
        bad = [d for d in self.drafters if d not in STRESS_DRAFTERS]
        if bad:
            raise ValueError(f"drafters: expected some of {STRESS_DRAFTERS}, got {bad}")
        for name in ("graphs_share", "compile_share", "sampling_share", "hf_share", "hf_static_share", "eos_share",
                     "reuse_share"):  # fmt: skip
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or isinstance(val, bool) or not 0.0 <= val <= 1.0:
                raise ValueError(f"{name}: expected a probability in [0, 1], got {val!r}")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ValueError(f"compile_backend: expected a torch.compile backend name, got {self.compile_backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.budget_s is not None and (not isinstance(self.budget_s, (int, float)) or not self.budget_s > 0):
            raise ValueError(f"budget_s: expected None or a number of seconds > 0, got {self.budget_s!r}")
        if self.models not in MODEL_SOURCES:
            raise ValueError(f"models: expected one of {MODEL_SOURCES}, got {self.models!r}")
        if self.models == "pretrained":
            if not self.target:
                raise ValueError("target: models='pretrained' needs a target model name or directory, got None")
            if "model" in self.drafters and not self.draft:
                raise ValueError("draft: the 'model' drafter with models='pretrained' needs a draft model, got None")
        if self.tiny_family not in TINY_FAMILIES:
            raise ValueError(f"tiny_family: expected one of {TINY_FAMILIES}, got {self.tiny_family!r}")
        if not isinstance(self.tie_tol, (int, float)) or not self.tie_tol >= 0:
            raise ValueError(f"tie_tol: expected a number >= 0, got {self.tie_tol!r}")
        if self.attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {self.attn_impl!r}")
        if self.reference not in REFERENCES:
            raise ValueError(f"reference: expected one of {REFERENCES}, got {self.reference!r}")

    @property
    def exact(self) -> bool:
        """Whether greedy rows are compared with the reference (float32 only)."""
        return self.dtype == "fp32"


# ----------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class CallPlan:
    """One planned call (drawn by ``plan_calls`` from the seed alone, before anything runs).

    Attributes:
        index: position in the plan.
        kind: ``"spec"`` (the engine), ``"hf"`` or ``"hf-static"`` (the target's own generate).
        prompts: per row ``(seed, length)`` of its prompt (``make_prompt``).
        max_new_tokens: new tokens per row (clipped to the target's context at run time).
        drafter, tree_size, graphs, compile: the engine (``kind == "spec"``; ``tree_size`` 0 for
            ``"none"``).
        do_sample, temperature, top_k, top_p: the decoding (engine calls only).
        eos: whether the call passes an eos id (chosen at run time from recent output).
        seed: the call's own randomness (sampling, eos choice).
    """

    index: int
    kind: str
    prompts: tuple[tuple[int, int], ...]
    max_new_tokens: int
    drafter: str | None = None
    tree_size: int = 0
    graphs: bool = False
    compile: bool = False
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos: bool = False
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def mode(self) -> str:
        """``graphs`` / ``nographs`` (+ ``+compile``) for engine calls, the kind for HF calls."""
        if self.kind != "spec":
            return self.kind
        return ("graphs" if self.graphs else "nographs") + ("+compile" if self.compile else "")

    @property
    def engine_key(self) -> str:
        return f"{self.drafter}/t{self.tree_size}/{self.mode}"


def _draw_length(rng: random.Random, lo: int, hi: int) -> int:
    if rng.random() < 0.5:
        return rng.randint(lo, hi)
    return min(hi, max(lo, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def plan_calls(cfg: StressConfig) -> list[CallPlan]:
    """The ``cfg.calls`` calls of a run, drawn from ``cfg.seed`` alone (reproducible)."""
    rng = random.Random(cfg.seed)
    pool: list[tuple[int, int]] = []  # prompts drawn so far (for reuse)
    plans = []
    for i in range(cfg.calls):
        prompts = []
        for _ in range(rng.randint(*cfg.batch_sizes)):
            if pool and rng.random() < cfg.reuse_share:
                prompts.append(rng.choice(pool))
            else:
                spec = (rng.randrange(2**31), _draw_length(rng, *cfg.prompt_lens))
                pool.append(spec)
                prompts.append(spec)
        new = _draw_length(rng, *cfg.new_tokens)
        common = dict(index=i, prompts=tuple(prompts), max_new_tokens=new, eos=rng.random() < cfg.eos_share,
                      seed=rng.randrange(2**31))  # fmt: skip
        if rng.random() < cfg.hf_share:
            plans.append(CallPlan(kind="hf-static" if rng.random() < cfg.hf_static_share else "hf", **common))
            continue
        drafter = rng.choice(cfg.drafters)
        tree = 0 if drafter == "none" else rng.choice(cfg.tree_sizes)
        sample = rng.random() < cfg.sampling_share
        plans.append(CallPlan(
            kind="spec", drafter=drafter, tree_size=tree, graphs=rng.random() < cfg.graphs_share,
            compile=rng.random() < cfg.compile_share, do_sample=sample,
            temperature=round(rng.uniform(0.6, 1.4), 2) if sample else 1.0,
            top_k=rng.choice((0, 0, 5, 50)) if sample else 0, top_p=rng.choice((1.0, 1.0, 0.9)) if sample else 1.0,
            **common,
        ))  # fmt: skip
    return plans


def make_prompt(spec: tuple[int, int], vocab: int):
    """int64 ``[length]`` (CPU) of ``spec = (seed, length)``: i.i.d. token ids in ``[0, vocab)``, or
    (for odd seeds) a random chunk of 2..64 ids repeated with a few ids changed (n-grams recur, so
    prompt lookup finds matches)."""
    import torch

    seed, length = spec
    gen = torch.Generator().manual_seed(seed)
    if seed % 2 == 0:
        return torch.randint(0, vocab, (length,), generator=gen)
    period = int(torch.randint(2, 65, (1,), generator=gen))
    chunk = torch.randint(0, vocab, (period,), generator=gen)
    out = chunk.repeat(-(-length // period))[:length].clone()
    noise = torch.rand(length, generator=gen) < 0.05
    out[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)
    return out


# ----------------------------------------------------------------------------------------------
# models


@dataclass
class StressModels:
    """The models a run uses (built once; tests share them across runs).

    Attributes:
        target: the target causal LM (on ``device``, in ``dtype``).
        draft: the draft LM (None when no call needs it).
        heads: ``drafters.medusa.MedusaHeads`` for the target (None when no call needs them).
        description: what was loaded, for the report.
    """

    target: Any
    draft: Any = None
    heads: Any = None
    description: str = ""

    @property
    def device(self):
        from specdec import hf

        return hf.input_device(self.target)

    @property
    def vocab_size(self) -> int:
        from specdec import hf

        return hf.vocab_size(self.target)


def _tiny_config(family: str, layers: int, hidden: int, vocab: int, positions: int):
    import transformers as tf

    cls = tf.Qwen2Config if family == "qwen2" else tf.LlamaConfig
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
               tie_word_embeddings=False, pad_token_id=PAD, bos_token_id=1, eos_token_id=2)  # fmt: skip


def build_tiny_models(family: str = "qwen2", layers: int = 2, hidden: int = 128, vocab: int = 512,
                      positions: int = 4096, seed: int = 0, dtype=None, device=None) -> StressModels:  # fmt: skip
    """Random tiny target + draft + Medusa heads.

    The target has ``layers`` layers with N(0, 0.2) matrices (decisive argmax: no near ties); its
    layers after the first write to the residual stream at 0.3x scale. The 1-layer draft is the
    target's embeddings, first layer, final norm and LM head: it agrees with the target often
    enough for multi-token acceptances (tau ~3 at depth 3). The 4 Medusa heads are small random
    residual blocks. ``positions`` is the models' context (>= longest prompt + new tokens).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from drafters.medusa import MedusaHeads

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_config(_tiny_config(family, layers, hidden, vocab, positions),
                                              attn_implementation="sdpa")  # fmt: skip
    draft = AutoModelForCausalLM.from_config(_tiny_config(family, 1, hidden, vocab, positions),
                                             attn_implementation="sdpa")  # fmt: skip
    heads = MedusaHeads(hidden, 4)
    with torch.no_grad():
        for p in target.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
        for layer in target.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.3)
            layer.mlp.down_proj.weight.mul_(0.3)
        draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
        draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        draft.lm_head.load_state_dict(target.lm_head.state_dict())
        for p in heads.parameters():
            p.normal_(0, 0.05)
    dtype = torch.float32 if dtype is None else dtype
    desc = f"tiny {family}: target {layers} layers, draft 1 layer, hidden {hidden}, vocab {vocab}, context {positions}"
    return StressModels(target.to(device, dtype).eval(), draft.to(device, dtype).eval(), heads.to(device, dtype).eval(),
                        desc)  # fmt: skip


def load_models(cfg: StressConfig) -> StressModels:
    """The models of ``cfg``: tiny ones built from configs, or pretrained ones loaded."""
    import torch

    dtype = getattr(torch, DTYPES[cfg.dtype])
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {cfg.device!r} requested but no CUDA device is available")
    need_draft = "model" in cfg.drafters
    need_heads = "medusa" in cfg.drafters
    if cfg.models == "tiny":
        positions = max(4096, cfg.prompt_lens[1] + cfg.new_tokens[1] + 256)
        return build_tiny_models(cfg.tiny_family, cfg.tiny_layers, cfg.tiny_hidden, cfg.tiny_vocab, positions,
                                 seed=cfg.seed, dtype=dtype, device=device)  # fmt: skip
    from specdec.models import load_model

    target = load_model(cfg.target, dtype=dtype, device=device)
    draft = load_model(cfg.draft, dtype=dtype, device=device) if need_draft else None
    heads = None
    if need_heads:
        from drafters.medusa import MedusaHeads

        if cfg.medusa_heads:
            heads = MedusaHeads.load(cfg.medusa_heads, device=device, dtype=dtype)
        else:
            hidden = target.get_output_embeddings().weight.shape[1]
            heads = MedusaHeads(hidden, 4).to(device, dtype).eval()  # identity blocks: untrained heads
    desc = f"target {cfg.target}" + (f", draft {cfg.draft}" if need_draft else "")
    if need_heads:
        desc += f", Medusa heads {cfg.medusa_heads or '(untrained)'}"
    return StressModels(target, draft, heads, desc)


# ----------------------------------------------------------------------------------------------
# output checks


def _eos_set(eos) -> set[int]:
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[: j + 1]
    return tokens


def check_row(new: list[int], max_new: int, eos: set[int], vocab: int) -> list[str]:
    """Problems of one row's new tokens (empty: valid): 1..max_new ids in ``[0, vocab)``, no eos
    before the last token, and fewer than ``max_new`` only when the last one is an eos."""
    problems = []
    if not 1 <= len(new) <= max_new:
        problems.append(f"{len(new)} new tokens, expected 1..{max_new}")
    bad = [t for t in new if not 0 <= t < vocab]
    if bad:
        problems.append(f"token ids out of [0, {vocab}): {bad[:4]}")
    if any(t in eos for t in new[:-1]):
        problems.append("tokens after an eos")
    if new and len(new) < max_new and new[-1] not in eos:
        problems.append(f"stopped after {len(new)} of {max_new} tokens without an eos")
    return problems


def check_output(out, prompts: Sequence, max_new: int, eos, vocab: int, tree_size: int) -> list[list[str]]:
    """Per row, what is wrong with a ``GenerationOutput`` (empty lists: valid).

    Checks the shape and dtype of ``sequences``, that each row starts with its prompt, its new
    tokens (``check_row``), the padding after its end, and the per-step statistics: every step
    proposes at most ``tree_size`` nodes, accepts at most what it proposed, emits at most one more
    than it accepted, and the emitted tokens add up to the row's new tokens.
    """
    import torch

    eos = _eos_set(eos)
    batch = len(prompts)
    rows: list[list[str]] = [[] for _ in range(batch)]
    seqs = out.sequences
    if not isinstance(seqs, torch.Tensor) or seqs.dtype != torch.int64 or seqs.dim() != 2 or seqs.shape[0] != batch:
        shape = tuple(seqs.shape) if isinstance(seqs, torch.Tensor) else type(seqs).__name__
        return [[f"sequences: expected int64 [{batch}, T], got {shape}"]] * batch
    if len(out.lengths) != batch or len(out.prompt_lengths) != batch or seqs.shape[1] != max(out.lengths):
        msg = f"lengths: expected {batch} rows and T = max(lengths), got {len(out.lengths)}, T = {seqs.shape[1]}"
        return [[msg]] * batch
    emitted = [0] * batch
    for s, step in enumerate(out.steps):
        for b in range(batch):
            n, a, e = step.nodes_proposed[b], step.tokens_accepted[b], step.tokens_emitted[b]
            if not (0 <= n <= tree_size and 0 <= a <= n and 0 <= e <= a + 1):
                rows[b].append(f"step {s}: proposed {n} (tree size {tree_size}), accepted {a}, emitted {e}")
            emitted[b] += e
    for b, p in enumerate(prompts):
        plen, length = out.prompt_lengths[b], out.lengths[b]
        if plen != len(p) or seqs[b, :plen].tolist() != p.tolist():
            rows[b].append("the row does not start with its prompt")
            continue
        new = seqs[b, plen:length].tolist()
        rows[b] += check_row(new, max_new, eos, vocab)
        if bool((seqs[b, length:] != PAD).any()):
            rows[b].append("padding after the row's end is not the pad id")
        if emitted[b] != len(new):
            rows[b].append(f"steps emitted {emitted[b]} tokens, the row has {len(new)}")
    return rows


# ----------------------------------------------------------------------------------------------
# the run


class _Reference:
    """The target's own greedy continuation of a prompt alone (batch 1, no eos), cached per prompt.

    A plain decoder (no drafter): ``mode="default"`` the device's defaults (CUDA graphs on CUDA),
    ``"eager"`` dynamic shapes without graphs (the path that shares the least with the engines
    under test). A cached continuation serves any shorter request.
    """

    def __init__(self, target, attn_impl: str, mode: str = "default") -> None:
        from specdec import SpecDecoder

        eager = dict(static_shapes=False, cuda_graphs=False) if mode == "eager" else {}
        self.decoder = SpecDecoder(target, None, tree_size=0, attn_impl=attn_impl, **eager)
        self.known: dict[tuple[int, str], list[int]] = {}
        self.seconds = 0.0
        self.decodes = 0

    def continuation(self, prompt, need: int) -> list[int]:
        key = (len(prompt), hashlib.sha1(prompt.numpy().tobytes()).hexdigest())
        have = self.known.get(key)
        if have is None or len(have) < need:
            t0 = time.perf_counter()
            have = self.decoder.generate([prompt], need).new_tokens(0).tolist()
            self.seconds += time.perf_counter() - t0
            self.decodes += 1
            self.known[key] = have
        return have[:need]


@dataclass
class _EngineStats:
    """What one engine key did over the run (kept when the engine is dropped and rebuilt)."""

    key: str
    builds: int = 0
    build_s: float = 0.0
    calls: int = 0
    errors: int = 0
    first_call_s: float | None = None
    first_call_tokens: int = 0
    new_shape_calls: int = 0
    new_shape_s: float = 0.0
    steady_s: list[float] = field(default_factory=list)
    steady_tokens: list[int] = field(default_factory=list)
    batch_sizes: set[int] = field(default_factory=set)

    def summary(self) -> dict[str, Any]:
        s, n = sum(self.steady_s), sum(self.steady_tokens)
        median = statistics.median(self.steady_s) if self.steady_s else None
        return {
            "engine": self.key, "builds": self.builds, "build_s": round(self.build_s, 4), "calls": self.calls,
            "errors": self.errors, "first_call_s": _r(self.first_call_s), "first_call_tokens": self.first_call_tokens,
            "new_shape_calls": self.new_shape_calls, "new_shape_s": round(self.new_shape_s, 4),
            "steady_calls": len(self.steady_s), "steady_median_s": _r(median),
            "steady_tokens_per_s": round(n / s, 2) if s > 0 else None, "batch_sizes": sorted(self.batch_sizes),
        }  # fmt: skip


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


class _Engines:
    """Engines built on first use per key and reused; at most ``cfg.max_engines`` alive (the least
    recently used dropped first). Statistics per key outlive drops."""

    def __init__(self, models: StressModels, cfg: StressConfig) -> None:
        self.models, self.cfg = models, cfg
        self.live: OrderedDict[str, Any] = OrderedDict()
        self.stats: dict[str, _EngineStats] = {}
        #: per live engine: (batch size of its last call, the most cache slots a call needed since then)
        self.shape: dict[str, tuple[int, int]] = {}
        self.dropped = 0

    def get(self, plan: CallPlan) -> tuple[Any, bool]:
        """(the decoder for ``plan``, whether it was built now)."""
        key = plan.engine_key
        st = self.stats.setdefault(key, _EngineStats(key))
        if key in self.live:
            self.live.move_to_end(key)
            return self.live[key], False
        while len(self.live) >= self.cfg.max_engines:
            self.drop(next(iter(self.live)))
        t0 = time.perf_counter()
        dec = self._build(plan)
        st.builds += 1
        st.build_s += time.perf_counter() - t0
        self.live[key] = dec
        return dec, True

    def drop(self, key: str) -> None:
        """Forget an engine (its cache, graphs, drafter state); on CUDA hand the memory back."""
        import gc

        import torch

        if self.live.pop(key, None) is None:
            return
        self.shape.pop(key, None)
        self.dropped += 1
        gc.collect()
        if self.models.device.type == "cuda":
            torch.cuda.empty_cache()

    def _build(self, plan: CallPlan):
        from drafters import make_drafter
        from specdec import SpecDecoder

        m, cfg = self.models, self.cfg
        cuda = m.device.type == "cuda"
        static = True if (plan.graphs or plan.compile) else None
        graphs = bool(plan.graphs and cuda)
        comp = cfg.compile_backend if plan.compile else False
        if comp == "inductor":
            comp = True
        drafter = None
        if plan.drafter == "model":
            drafter = make_drafter("model", draft_model=m.draft, static_shapes=static, cuda_graphs=graphs, compile=comp)
        elif plan.drafter == "medusa":
            drafter = make_drafter("medusa", target=m.target, heads=m.heads)
        elif plan.drafter == "lookup":
            drafter = make_drafter("lookup")
        return SpecDecoder(m.target, drafter, tree_size=plan.tree_size, static_shapes=static, cuda_graphs=graphs,
                           compile=comp, attn_impl=cfg.attn_impl)  # fmt: skip


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the CUDA context unusable (no later call can be trusted)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return False
    if type(exc).__name__ == "AcceleratorError":
        return True
    msg = str(exc)
    return any(s in msg for s in _FATAL_CUDA)


@dataclass
class StressResult:
    """What ``run_stress`` returns (and writes to ``cfg.out`` as JSON).

    Attributes:
        ok: no crash and no mismatch (near ties excepted) in the calls that ran.
        summary: counts and the notable calls (see ``format_summary``).
        engines: per engine key, builds, first call and steady-state statistics.
        calls: one record per call that ran.
        config: the ``StressConfig`` as a dict.
    """

    ok: bool
    summary: dict[str, Any]
    engines: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    config: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "summary": self.summary, "engines": self.engines, "calls": self.calls,
                "config": self.config}  # fmt: skip


class _Run:
    """State of one stress run: models, engines, reference, records."""

    def __init__(self, cfg: StressConfig, models: StressModels, log: Callable[[str], None]) -> None:
        from specdec import hf

        self.cfg, self.models, self.log = cfg, models, log
        self.device = models.device
        self.vocab = models.vocab_size
        self.limit = hf.max_positions(models.target)
        if self.limit is not None and cfg.prompt_lens[1] + 1 > self.limit:
            raise ValueError(f"prompt_lens: the longest prompt ({cfg.prompt_lens[1]}) leaves no room in the target's "
                             f"context of {self.limit} positions")  # fmt: skip
        if "model" in cfg.drafters and models.draft is None:
            raise ValueError("draft: the 'model' drafter needs a draft model, got None")
        if "medusa" in cfg.drafters and models.heads is None:
            raise ValueError("heads: the 'medusa' drafter needs Medusa heads, got None")
        self.engines = _Engines(models, cfg)
        self.reference = _Reference(models.target, cfg.attn_impl, cfg.reference) if cfg.exact else None
        self.records: list[dict[str, Any]] = []
        self.recent: list[int] = []  # recently generated tokens (eos candidates)
        self.hf_shapes: set[tuple[str, int]] = set()
        self.hf_cache_len = cfg.prompt_lens[1] + cfg.new_tokens[1]
        gc = getattr(models.target, "generation_config", None)
        self.model_eos = getattr(gc, "eos_token_id", None)

    # -------------------------------------------------------------- one call

    def run_call(self, plan: CallPlan) -> dict[str, Any]:
        """Run one planned call and check it; the record (never raises for the call's own failures)."""
        import torch

        prompts = [make_prompt(s, self.vocab) for s in plan.prompts]
        longest = max(len(p) for p in prompts)
        max_new = plan.max_new_tokens if self.limit is None else min(plan.max_new_tokens, self.limit - longest)
        rec: dict[str, Any] = {
            "call": plan.index, "kind": plan.kind, "drafter": plan.drafter, "tree_size": plan.tree_size,
            "mode": plan.mode, "batch": plan.batch, "prompt_lens": [len(p) for p in prompts], "max_new_tokens": max_new,
            "do_sample": plan.do_sample, "eos": None, "status": "ok", "problems": [],
        }  # fmt: skip
        if plan.do_sample:
            rec.update(temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p)
        t_all = time.perf_counter()
        stage = "reference"  # where an exception came from: the reference decoder, the call, the checks
        try:
            eos = rec["eos"] = self._pick_eos(plan, prompts, max_new)
            stage = "call"
            if plan.kind == "spec":
                rows, eos_used = self._spec(plan, prompts, max_new, eos, rec), eos
            else:
                rows, eos_used = self._hf(plan, prompts, max_new, eos, rec)
            stage = "check"
            flat = [t for r in rows for t in r]
            self.recent = (self.recent + flat[-64:])[-256:]
            self._compare(plan, prompts, rows, eos_used, max_new, rec)
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            rec["status"] = "error"
            rec["stage"] = stage
            rec["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
            rec["traceback"] = traceback.format_exc(limit=-6)[-3000:]
            rec["fatal"] = is_fatal_cuda_error(e)
            if plan.kind == "spec" and stage == "call":
                self.engines.stats[plan.engine_key].errors += 1
                if not rec["fatal"]:
                    self.engines.drop(plan.engine_key)  # rebuilt on next use: one bug, one record
            if not rec["fatal"] and self.device.type == "cuda":
                try:
                    torch.cuda.synchronize(self.device)
                except Exception as e2:  # noqa: BLE001 - the context is gone
                    rec["fatal"] = True
                    rec["error"] += f" (then synchronize: {type(e2).__name__}: {' '.join(str(e2).split())[:200]})"
        if rec["problems"] and rec["status"] == "ok":
            rec["status"] = "mismatch"
        rec["total_s"] = round(time.perf_counter() - t_all, 4)
        return rec

    def _pick_eos(self, plan: CallPlan, prompts, max_new: int) -> int | list[int] | None:
        """None, or an eos id (sometimes two) this call will likely generate, so that rows end early
        and at different steps: greedy fp32, a token of one row's reference continuation; else a
        token recently generated."""
        if not plan.eos:
            return None
        crng = random.Random(plan.seed)
        if self.reference is not None and not plan.do_sample:
            pool = self.reference.continuation(prompts[crng.randrange(len(prompts))], max_new)
        else:
            pool = self.recent or [crng.randrange(self.vocab)]
        return crng.choice(pool) if crng.random() < 0.7 else [crng.choice(pool), crng.randrange(self.vocab)]

    def _spec(self, plan: CallPlan, prompts, max_new: int, eos, rec: dict[str, Any]) -> list[list[int]]:
        import torch

        dec, built = self.engines.get(plan)
        st = self.engines.stats[plan.engine_key]
        # A new batch size or a longer request than served since: the engine (with CUDA graphs) takes
        # a new cache and captures again -- not steady state.
        need = max(len(p) for p in prompts) + max_new + plan.tree_size
        last = self.engines.shape.get(plan.engine_key)
        shape_new = last is None or last[0] != plan.batch or need > last[1]
        self.engines.shape[plan.engine_key] = (plan.batch, need if shape_new else last[1])
        gen = torch.Generator().manual_seed(plan.seed)
        _sync(self.device)
        t0 = time.perf_counter()
        out = dec.generate(list(prompts), max_new, do_sample=plan.do_sample, temperature=plan.temperature,
                           top_k=plan.top_k, top_p=plan.top_p, eos_token_id=eos, generator=gen,
                           pad_token_id=PAD)  # fmt: skip
        _sync(self.device)
        wall = time.perf_counter() - t0
        st.batch_sizes.add(plan.batch)
        new = out.num_new_tokens
        if st.first_call_s is None:
            st.first_call_s, st.first_call_tokens = wall, new
        st.calls += 1
        if shape_new:
            st.new_shape_calls += 1
            st.new_shape_s += wall
        else:
            st.steady_s.append(wall)
            st.steady_tokens.append(new)
        step_s = [s.draft_s + s.verify_s + s.commit_s for s in out.steps]
        slow = max(range(len(step_s)), key=step_s.__getitem__) if step_s else None
        rec.update(engine_new=built, new_shape=shape_new, wall_s=round(wall, 4), new_tokens=new, steps=len(out.steps),
                   mean_accepted=round(out.mean_accepted, 3), prefill_s=round(out.prefill_s, 4))  # fmt: skip
        if slow is not None:
            s = out.steps[slow]
            rec["slowest_step"] = {"step": slow, "s": round(step_s[slow], 5), "draft_s": round(s.draft_s, 5),
                                   "verify_s": round(s.verify_s, 5), "commit_s": round(s.commit_s, 5)}  # fmt: skip
        for b, probs in enumerate(check_output(out, prompts, max_new, eos, self.vocab, plan.tree_size)):
            rec["problems"] += [f"row {b}: {p}" for p in probs]
        return [out.new_tokens(b).tolist() for b in range(plan.batch)]

    def _hf(self, plan: CallPlan, prompts, max_new: int, eos, rec: dict[str, Any]):
        import torch

        eos_used = eos if eos is not None else self.model_eos
        width = max(len(p) for p in prompts)
        ids = torch.full((plan.batch, width), PAD, dtype=torch.int64)
        mask = torch.zeros(plan.batch, width, dtype=torch.int64)
        for b, p in enumerate(prompts):  # left padding, as HF expects for batched generate
            ids[b, width - len(p):] = p
            mask[b, width - len(p):] = 1
        kwargs: dict[str, Any] = dict(attention_mask=mask.to(self.device), max_new_tokens=max_new, do_sample=False,
                                      pad_token_id=PAD, eos_token_id=eos_used)  # fmt: skip
        if plan.kind == "hf-static":
            kwargs.update(cache_implementation="static", max_cache_len=self.hf_cache_len)
        shape_new = (plan.kind, plan.batch) not in self.hf_shapes
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.models.target.generate(ids.to(self.device), **kwargs)
        _sync(self.device)
        wall = time.perf_counter() - t0
        self.hf_shapes.add((plan.kind, plan.batch))
        eos_set = _eos_set(eos_used)
        rows = []
        for b in range(plan.batch):
            new = _cut_at_eos(out[b, width:].tolist(), eos_set)
            rec["problems"] += [f"row {b}: {p}" for p in check_row(new, max_new, eos_set, self.vocab)]
            rows.append(new)
        rec.update(new_shape=shape_new, wall_s=round(wall, 4), new_tokens=sum(len(r) for r in rows), eos_used=eos_used)
        return rows, eos_used

    def _compare(self, plan: CallPlan, prompts, rows: list[list[int]], eos, max_new: int, rec: dict[str, Any]) -> None:
        """Greedy fp32 rows against the reference; near ties told apart by a plain forward."""
        if self.reference is None or plan.do_sample or (plan.kind != "spec" and not self.cfg.check_hf):
            rec["rows_compared"] = 0
            return
        eos_set = _eos_set(eos)
        compared = 0
        for b, (p, got) in enumerate(zip(prompts, rows)):
            want = _cut_at_eos(self.reference.continuation(p, max_new), eos_set)
            compared += 1
            if got == want:
                continue
            j = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            info: dict[str, Any] = {"call": plan.index, "row": b, "kind": plan.kind, "mode": plan.mode,
                                    "drafter": plan.drafter, "prompt_len": len(p), "position": j,
                                    "got": got[j : j + 4], "want": want[j : j + 4]}  # fmt: skip
            if j < len(got) and j < len(want):
                info.update(self._gap(p, want[:j], got[j], want[j]))
            rec.setdefault("mismatches", []).append(info)
            tie = info.get("near_tie", False)
            rec["problems"].append(f"row {b}: differs from the prompt decoded alone at new token {j}"
                                   + (f" (near tie: logit gap {info['logit_gap']:.2e})" if tie else ""))  # fmt: skip
        rec["rows_compared"] = compared
        if rec.get("mismatches") and all(m.get("near_tie") for m in rec["mismatches"]):
            rec["near_tie"] = True

    def _gap(self, prompt, prefix: list[int], got: int, want: int) -> dict[str, Any]:
        """The target's logits (one plain forward of ``prompt + prefix``) of the two tokens."""
        import torch

        ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.int64)])[None].to(self.device)
        with torch.no_grad():
            logits = self.models.target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        gap = float(logits[want] - logits[got])
        return {"logit_gap": gap, "near_tie": abs(gap) <= self.cfg.tie_tol,
                "argmax": int(logits.argmax())}  # fmt: skip

    # -------------------------------------------------------------- the loop

    def result(self, planned: int, elapsed: float, stopped: str | None) -> StressResult:
        summary = summarize(self.records, planned, elapsed, stopped)
        summary["engines_dropped"] = self.engines.dropped
        summary["models"] = self.models.description
        summary["device"] = str(self.device)
        if self.reference is not None:
            summary["reference"] = {"decodes": self.reference.decodes, "seconds": round(self.reference.seconds, 3),
                                    "prompts": len(self.reference.known)}  # fmt: skip
        engines = [s.summary() for s in self.engines.stats.values()]
        return StressResult(summary["ok"], summary, engines, self.records, _config_dict(self.cfg))


def _config_dict(cfg: StressConfig) -> dict[str, Any]:
    d = asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _tally(records: Sequence[dict[str, Any]], key: Callable[[dict[str, Any]], str]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for r in records:
        t = out.setdefault(key(r), {"calls": 0, "ok": 0, "mismatch": 0, "error": 0, "tokens": 0})
        t["calls"] += 1
        t[r["status"]] += 1
        t["tokens"] += r.get("new_tokens", 0)
    return dict(sorted(out.items()))


def summarize(records: Sequence[dict[str, Any]], planned: int, elapsed: float, stopped: str | None) -> dict[str, Any]:
    """Counts and notable calls over ``records`` (see ``StressResult``)."""
    crashes = [{k: r.get(k) for k in ("call", "kind", "drafter", "tree_size", "mode", "batch", "stage", "error", "fatal")}
               for r in records if r["status"] == "error"]  # fmt: skip
    mism = [m for r in records for m in r.get("mismatches", [])]
    invalid = [{"call": r["call"], "problems": r["problems"]} for r in records
               if r["status"] == "mismatch" and not r.get("mismatches")]  # fmt: skip
    failing = [r for r in records if r["status"] == "mismatch" and not r.get("near_tie")]
    near = [r for r in records if r["status"] == "mismatch" and r.get("near_tie")]
    timed = [r for r in records if "wall_s" in r]
    slowest = max(timed, key=lambda r: r["wall_s"], default=None)
    slowest_keys = ("call", "kind", "drafter", "tree_size", "mode", "batch", "prompt_lens", "max_new_tokens", "wall_s",
                    "engine_new", "new_shape")  # fmt: skip
    stepped = [r for r in records if "slowest_step" in r]
    steady = [r for r in stepped if not r.get("engine_new") and not r.get("new_shape")]

    def step_of(r):
        return None if r is None else {"call": r["call"], "mode": r["mode"], "drafter": r["drafter"], "batch": r["batch"],
                                       **r["slowest_step"]}  # fmt: skip

    top_step = lambda rs: max(rs, key=lambda r: r["slowest_step"]["s"], default=None)  # noqa: E731
    fatal = next((r for r in records if r.get("fatal")), None)
    return {
        "ok": not crashes and not failing,
        "planned": planned,
        "ran": len(records),
        "stopped": stopped,
        "aborted": None if fatal is None else f"call {fatal['call']}: {fatal['error']}",
        "elapsed_s": round(elapsed, 2),
        "counts": {s: sum(r["status"] == s for r in records) for s in ("ok", "mismatch", "error")},
        "crashes": crashes,
        "mismatching_calls": len(failing),
        "near_tie_calls": len(near),
        "mismatches": mism,
        "invalid": invalid,
        "rows_compared": sum(r.get("rows_compared", 0) for r in records),
        "rows_checked": sum(r["batch"] for r in records if r["status"] != "error"),
        "by_kind": _tally(records, lambda r: r["kind"]),
        "by_drafter": _tally([r for r in records if r["kind"] == "spec"], lambda r: r["drafter"]),
        "by_mode": _tally(records, lambda r: r["mode"]),
        "by_decoding": _tally(records, lambda r: "sample" if r["do_sample"] else "greedy"),
        "by_group": _tally(records, lambda r: f"{r['kind']} {r['drafter'] or '-'} {r['mode']}" if r["kind"] == "spec"
                           else f"{r['kind']} - -"),  # fmt: skip
        "slowest_call": None if slowest is None else {k: slowest.get(k) for k in slowest_keys},
        "slowest_step": step_of(top_step(stepped)),
        "slowest_steady_step": step_of(top_step(steady)),
        "hf_first_calls": [{k: r.get(k) for k in ("call", "kind", "batch", "wall_s")} for r in records
                           if r["kind"] != "spec" and r.get("new_shape") and "wall_s" in r],
    }  # fmt: skip


def format_summary(result: StressResult) -> str:
    """A short table of the run for stdout."""
    s = result.summary
    c = s["counts"]
    lines = [
        f"stress: {s['ran']}/{s['planned']} calls in {s['elapsed_s']:.1f} s on {s['device']} ({s['models']})"
        + (f", stopped: {s['stopped']}" if s["stopped"] else ""),
        f"  ok {c['ok']}, mismatch {c['mismatch']} ({s['near_tie_calls']} near ties only), crashes {c['error']}; "
        f"rows compared with the prompt alone: {s['rows_compared']}, rows checked: {s['rows_checked']}",
    ]
    if s.get("aborted"):
        lines.append(f"  ABORTED (CUDA context lost) at {s['aborted']}")
    lines.append(f"  {'kind':<10} {'drafter':<8} {'mode':<16} {'calls':>5} {'ok':>4} {'mism':>4} {'err':>4} {'tokens':>7}")
    for group, t in s["by_group"].items():
        kind, drafter, mode = group.split(" ")
        lines.append(f"  {kind:<10} {drafter:<8} {mode:<16} {t['calls']:>5} {t['ok']:>4} {t['mismatch']:>4} "
                     f"{t['error']:>4} {t['tokens']:>7}")  # fmt: skip
    if s["slowest_call"]:
        sc = s["slowest_call"]
        lines.append(f"  slowest call: #{sc['call']} {sc['kind']} {sc['drafter'] or ''} {sc['mode']} batch {sc['batch']} "
                     f"new {sc['max_new_tokens']}: {sc['wall_s']:.3f} s"
                     + (" (engine built)" if sc.get("engine_new") else " (new shape)" if sc.get("new_shape") else ""))
    for label in ("slowest_step", "slowest_steady_step"):
        st = s[label]
        if st:
            lines.append(f"  {label.replace('_', ' ')}: #{st['call']} {st['drafter']} {st['mode']} batch {st['batch']} "
                         f"step {st['step']}: {st['s'] * 1e3:.1f} ms (draft {st['draft_s'] * 1e3:.1f}, verify "
                         f"{st['verify_s'] * 1e3:.1f}, commit {st['commit_s'] * 1e3:.1f})")  # fmt: skip
    firsts = [e for e in result.engines if e["first_call_s"] is not None]
    if firsts:
        worst = max(firsts, key=lambda e: e["first_call_s"] + e["build_s"])
        lines.append(f"  engines: {len(result.engines)} ({s['engines_dropped']} drops); slowest first call: "
                     f"{worst['engine']} "
                     f"build {worst['build_s']:.2f} s + first call {worst['first_call_s']:.2f} s, steady median "
                     f"{worst['steady_median_s'] if worst['steady_median_s'] is not None else '-'} s")  # fmt: skip
    for cr in s["crashes"][:5]:
        lines.append(f"  CRASH #{cr['call']} {cr['kind']} {cr['drafter'] or ''} {cr['mode']} batch {cr['batch']} "
                     f"(in the {cr['stage']}): {cr['error'][:200]}")  # fmt: skip
    for m in s["mismatches"][:5]:
        tie = f", near tie (gap {m['logit_gap']:.2e})" if m.get("near_tie") else ""
        lines.append(f"  MISMATCH #{m['call']} row {m['row']} {m['kind']} {m['drafter'] or ''} {m['mode']} at new token "
                     f"{m['position']}: got {m['got']}, want {m['want']}{tie}")  # fmt: skip
    for inv in s["invalid"][:5]:
        lines.append(f"  INVALID #{inv['call']}: {'; '.join(inv['problems'][:3])}")
    lines.append("  result: " + ("OK" if result.ok else "FAILED"))
    return "\n".join(lines)


def _write_json(path: str, result: StressResult) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=1, default=str) + "\n")
    os.replace(tmp, p)


def run_stress(cfg: StressConfig, log: Callable[[str], None] = print, *, models: StressModels | None = None
               ) -> StressResult:  # fmt: skip
    """Run the stress plan of ``cfg``; return (and write to ``cfg.out``) the result.

    Args:
        cfg: the run's settings.
        log: receives crash / mismatch lines as they happen and the summary table at the end.
        models: models to use instead of loading ``cfg``'s (tests build tiny ones once); they must
            be on ``cfg.device`` in ``cfg.dtype``.

    Stops early (``summary["stopped"]``) when ``cfg.budget_s`` would be exceeded by the next call
    (estimated by the median time of the calls so far), on a CUDA error that poisons the context
    (``"cuda-error"``; also ``summary["aborted"]``) or on KeyboardInterrupt (``"interrupted"``).
    """
    import torch

    start = time.perf_counter()
    if not isinstance(cfg, StressConfig):
        raise ValueError(f"cfg: expected a StressConfig, got {type(cfg).__name__}")
    if models is None:
        models = load_models(cfg)
    elif not isinstance(models, StressModels):
        raise ValueError(f"models: expected a StressModels or None, got {type(models).__name__}")
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    run = _Run(cfg, models, log)
    plans = plan_calls(cfg)
    bar = tqdm(total=len(plans), desc="stress", unit="call", disable=not cfg.progress, file=sys.stderr)
    stopped = None
    durations: list[float] = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # HF's per-call notes (generation flags, caches) would drown the report
    try:
        for plan in plans:
            elapsed = time.perf_counter() - start
            estimate = statistics.median(durations) if durations else 0.0
            if cfg.budget_s is not None and elapsed + estimate > cfg.budget_s:
                stopped = "budget"
                log(f"stress: budget of {cfg.budget_s:g} s reached after {len(run.records)} calls ({elapsed:.1f} s)")
                break
            with torch.no_grad():
                rec = run.run_call(plan)
            run.records.append(rec)
            durations.append(rec["total_s"])
            if rec["status"] == "error":
                log(f"stress: CRASH in call {plan.index} ({plan.kind} {plan.drafter or ''} {plan.mode} batch "
                    f"{plan.batch}): {rec['error'][:300]}")  # fmt: skip
            elif rec["status"] == "mismatch":
                log(f"stress: {'near tie' if rec.get('near_tie') else 'MISMATCH'} in call {plan.index} ({plan.kind} "
                    f"{plan.drafter or ''} {plan.mode} batch {plan.batch}): {'; '.join(rec['problems'][:3])}")  # fmt: skip
            counts = {s: sum(r["status"] == s for r in run.records) for s in ("mismatch", "error")}
            bar.set_postfix(mism=counts["mismatch"], err=counts["error"], refresh=False)
            bar.update(1)
            if cfg.out:
                _write_json(cfg.out, run.result(len(plans), time.perf_counter() - start, None))
            if rec.get("fatal"):
                stopped = "cuda-error"
                log("stress: the CUDA context is lost; stopping")
                break
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        bar.close()
        hf_logging.set_verbosity(verbosity)
    result = run.result(len(plans), time.perf_counter() - start, stopped)
    if cfg.out:
        _write_json(cfg.out, result)
    log(format_summary(result))
    return result
