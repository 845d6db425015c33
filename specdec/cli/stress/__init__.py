"""Randomized stress test of ``SpecDecoder.generate`` in one long-lived process .

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

Modules: ``config`` (``StressConfig``, the call plan, prompts), ``models`` (tiny or pretrained
models), ``checks`` (output checks, the reference decoder), ``run`` (engines, one call,
``run_stress``), ``summary`` (the result, its summary and table), ``cli`` (the flags;
``scripts/device/stress.py`` runs it).
"""

from specdec.cli.stress.checks import check_output, check_row, is_fatal_cuda_error
from specdec.cli.stress.config import (
    DTYPES,
    KINDS,
    MODEL_SOURCES,
    REFERENCES,
    STRESS_DRAFTERS,
    CallPlan,
    StressConfig,
    make_prompt,
    plan_calls,
)
from specdec.cli.stress.models import StressModels, build_tiny_models, load_models
from specdec.cli.stress.run import run_stress
from specdec.cli.stress.summary import StressResult, format_summary, summarize

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
