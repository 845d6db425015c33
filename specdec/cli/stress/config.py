"""The stress run's settings (``StressConfig``) and its call plan, drawn from the seed alone."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any
from specdec.dtypes import DTYPE_NAMES

__all__ = ["DTYPES", "KINDS", "MODEL_SOURCES", "PAD", "REFERENCES", "STRESS_DRAFTERS", "CallPlan", "StressConfig",
           "make_prompt", "plan_calls"]  # fmt: skip

#: Drafters a call may use: the three of ``drafters.make_drafter`` and plain decoding ("none").
STRESS_DRAFTERS = ("model", "medusa", "lookup", "none")
#: What a call runs: the engine, or the target's HF generate with the default / static cache.
KINDS = ("spec", "hf", "hf-static")
MODEL_SOURCES = ("tiny", "pretrained")
DTYPES = DTYPE_NAMES
TINY_FAMILIES = ("qwen2", "llama")
#: Reference decoders: ``SpecDecoder(target, None)`` with the device's defaults, or eager dynamic shapes.
REFERENCES = ("default", "eager")
#: Filler of output rows after their end (engine and HF calls).
PAD = 0


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
