"""``bench-engine`` settings: the section / method / mode names, the ``scale`` model shapes and
``BenchConfig`` (one run's settings, validated on construction)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from specdec.dtypes import DTYPE_NAMES

SECTIONS = ("plain", "verify", "spec", "batch", "profile", "scale")
DEFAULT_SECTIONS = ("plain", "verify", "spec")  # batch, profile and scale are opt-in
TARGET_SECTIONS = ("plain", "verify", "spec", "batch", "profile")  # the ones that load --target
#: ``-step``: the engine with ``decode_chunk=0`` (a host round trip per token), for comparison with the default chunks
PLAIN_METHODS = ("hf", "hf-static", "engine-eager", "engine-graph", "engine-compiled", "engine-graph-step",
                 "engine-compiled-step")
DEFAULT_PLAIN_METHODS = PLAIN_METHODS[:5]
DRAFTERS = ("model", "lookup")
SPEC_MODES = ("eager", "graph", "compiled")  # compiled: the graphed forwards compiled by inductor first
BATCH_DRAFTERS = ("medusa", "lookup", "eagle")
PROFILE_MODES = ("graph", "compiled")
SCALE_PARTS = ("engine-graph", "engine-compiled", "engine-inductor", "engine-compiled-step", "hf-static", "verify")
DTYPES = DTYPE_NAMES
DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"

#: ``scale`` section models: config fields of transformers' ``model_type`` (default ``"llama"``);
#: ``max_position_embeddings`` is at least this and at least the largest cache the run needs. The
#: Qwen2.5 rows are the default draft / target's shapes as loaded here (the GGUF load unties the
#: embedding), for timing without staging the weights.
SCALE_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=17408, rope_theta=500000.0,
                      rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False),
}  # fmt: skip
#: ``--scale-prompts`` default per config
SCALE_PROMPTS = {"llama3-8b": (1024, 16384), "qwen2.5-0.5b": (512,), "qwen2.5-1.5b": (512,), "tiny": (64, 256)}
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
    plain_methods: tuple[str, ...] = DEFAULT_PLAIN_METHODS
    drafters: tuple[str, ...] = DRAFTERS
    spec_modes: tuple[str, ...] = ("eager", "graph")
    reps: int = 20
    seed: int = 0
    device: str | None = None
    dtype: str | None = None
    attn_impl: str = "auto"
    #: one GEMM per q / k / v and gate / up group in specdec's forwards (``hf.prepare_model(fuse=)``)
    fuse: bool = True
    progress: bool = True
    out: str | None = None
    # (d) batch
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_drafters: tuple[str, ...] = ("medusa",)
    batch_mode: str = "graph"
    batch_skip_hf: bool = False
    #: the batch rows' node budgets per drafter and batch size: ints (0: ``specdec-plain``, the engine
    #: without a drafter, once per batch size) or ``"auto"`` (every step's budget); () = (spec_tree_size,)
    batch_tree_sizes: tuple[int | str, ...] = ()
    medusa_heads: str | None = None
    eagle_heads: str | None = None
    #: more ``EagleDrafter`` options of the batch section's ``eagle`` rows, (key, value) pairs
    eagle_options: tuple[tuple[str, Any], ...] = ()
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
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {self.attn_impl!r}")
        if self.batch_mode not in SPEC_MODES:
            raise ValueError(f"batch_mode: expected one of {SPEC_MODES}, got {self.batch_mode!r}")
        if "batch" in self.sections:
            if not self.batch_drafters and self.batch_skip_hf:
                raise ValueError("batch_drafters: expected at least one drafter when the HF rows are skipped, got none")
            bad = [t for t in self.batch_tree_sizes
                   if t != "auto" and (not isinstance(t, int) or isinstance(t, bool) or t < 0)]  # fmt: skip
            if bad:
                raise ValueError(f"batch_tree_sizes: expected 'auto' or ints >= 0 (0: specdec-plain), got {bad}")
            if "eagle" in self.batch_drafters and not self.eagle_heads:
                raise ValueError("eagle_heads: the batch section's 'eagle' drafter needs a trained head (--eagle-heads "
                                 "DIR, e.g. from specdec train-eagle), got none")  # fmt: skip
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
