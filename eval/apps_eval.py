"""Acceptance / latency evaluation on APPS and HumanEval: speculative decoding against HF baselines.

For every problem the runner builds one chat prompt (optionally padded with few-shot problems to a
long shared prompt, ``pad_prompt_to``) and generates with every requested method on that same
prompt, with the same settings:

========================  ====================================================================
method                    what runs
========================  ====================================================================
``specdec``               ``specdec.SpecDecoder(target, drafter, t)`` for each tree size t
``specdec-plain``         the same engine without a drafter (one token per step; engine overhead)
``hf``                    ``target.generate`` with the default (dynamic) cache -- the reference
``hf-static``             ``target.generate(cache_implementation="static")`` (compiled decode on CUDA)
``hf-assisted``           ``target.generate(assistant_model=draft)`` (HF assisted generation)
``hf-lookup``             ``target.generate(prompt_lookup_num_tokens=10)`` (HF prompt lookup)
========================  ====================================================================

No decoding happens here: the runner calls the engine and ``generate`` and measures them. Each
(problem, method, tree size) becomes one JSON line in ``out`` as soon as it finishes, with the
generated token ids, wall time, tokens/s and, for the engine, per-step arrays (nodes proposed,
tree depth, accepted draft tokens, emitted tokens, seconds in draft / verify / commit). A rerun with
the same settings skips what ``out`` already holds (resumable). Under greedy decoding every method's
tokens are compared with the ``hf`` reference of the same problem: in float32 any difference is a
failure (flagged in the record and on stderr, non-zero exit); in bf16/fp16, where n-token and
1-token forwards round differently, the agreement and the first divergence are reported.

Entry points: :func:`run_eval` (library), :func:`main_eval` (``specdec eval apps|humaneval``) and
:func:`main_sweep` (``specdec sweep``: several tree sizes, attention-only timings, table / CSV /
plot through :mod:`eval.report`).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from specdec.cli import args as cliargs

__all__ = [
    "BASELINE_METHODS",
    "DEFAULT_METHODS",
    "METHODS",
    "REFERENCE",
    "EvalConfig",
    "EvalResult",
    "Method",
    "MethodOutput",
    "PaddedProblem",
    "RecordingDrafter",
    "build_drafter",
    "compare_tokens",
    "config_key",
    "load_records",
    "main_eval",
    "main_sweep",
    "pad_problems",
    "run_eval",
    "tree_depth",
]

#: The method whose greedy output every other method is compared with (target-only, default cache).
REFERENCE = "hf"
BASELINE_METHODS = ("hf", "hf-static", "hf-assisted", "hf-lookup")
DEFAULT_METHODS = ("specdec", *BASELINE_METHODS)
DTYPES = ("auto", "fp32", "bf16", "fp16")
PROMPT_LOOKUP_TOKENS = 10
#: Trees kept per (problem, tree size) record for the attention-only timing (parents arrays).
TREE_SAMPLES = 4
#: New tokens of a warm-up generation.
WARMUP_TOKENS = 16


# ----------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class EvalConfig:
    """Everything one evaluation run depends on.

    Attributes:
        dataset: ``"apps"`` or ``"humaneval"``.
        target: target model (a default name such as ``qwen2.5-coder-1.5b``, a HF id, a local
            directory or a ``.gguf`` file; see ``specdec.models.load_model``).
        draft: draft model, same forms; used by ``hf-assisted`` and handed to the drafter factory.
        drafter: drafter name for ``drafters.make_drafter`` (``"model"``, ``"medusa"``, ``"lookup"``),
            or ``"module:function"`` for any factory.
        drafter_options: extra keyword arguments of the drafter factory as (name, value) pairs
            (e.g. ``(("depth", 4), ("topk", 8))`` or ``(("heads", "path/to/medusa"),)``).
        tree_sizes: node budgets of the ``specdec`` method.
        methods: which methods to run (``METHODS``); ``"hf"`` is added under greedy decoding.
        problems: how many problems (None: all).
        difficulty: APPS difficulties to keep (None: all).
        data_path: APPS / HumanEval file (None: the loaders' defaults).
        max_new_tokens: new tokens per generation (fewer when eos comes first).
        temperature: 0 = greedy; > 0 samples at this temperature (no top-k / top-p).
        seed: base seed; every (problem, method, t) derives its own from it.
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"auto"`` (bf16 on CUDA, fp32 on CPU).
        device: ``"cuda"``, ``"cpu"``, ... (None: cuda if available).
        out: JSONL file of the results (appended to; resumable).
        pad_prompt_to: prepend few-shot problems until each prompt has at least this many tokens.
        attn_impl: the engine's attention implementation (``"auto"``, ``"triton"``, ``"torch"``).
        compile: the engine's target forward through ``torch.compile`` (``SpecDecoder(compile=True)``,
            static shapes); its compile time falls in the warm-up.
        warmup: untimed generations per method (and tree size) before its first timed one.
        progress: tqdm bars.
        home: model store root (None: ``$SPECDEC_HOME``).
    """

    dataset: str = "apps"
    target: str = "qwen2.5-coder-1.5b"
    draft: str | None = "qwen2.5-coder-0.5b"
    drafter: str | None = "model"
    drafter_options: tuple[tuple[str, Any], ...] = ()
    tree_sizes: tuple[int, ...] = (64,)
    methods: tuple[str, ...] = DEFAULT_METHODS
    problems: int | None = 8
    difficulty: tuple[str, ...] | None = None
    data_path: str | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "auto"
    device: str | None = None
    out: str = "results.jsonl"
    pad_prompt_to: int | None = None
    attn_impl: str = "auto"
    compile: bool = False
    warmup: int = 1
    progress: bool = True
    home: str | None = None

    def __post_init__(self) -> None:
        if self.dataset not in ("apps", "humaneval"):
            raise ValueError(f"dataset: expected 'apps' or 'humaneval', got {self.dataset!r}")
        if not self.tree_sizes or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in self.tree_sizes):
            raise ValueError(f"tree_sizes: expected one or more ints >= 1, got {self.tree_sizes!r}")
        if not self.methods:
            raise ValueError("methods: expected at least one method, got none")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {self.temperature}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.problems is not None and self.problems < 1:
            raise ValueError(f"problems: expected None or an int >= 1, got {self.problems}")
        if self.pad_prompt_to is not None and self.pad_prompt_to < 1:
            raise ValueError(f"pad_prompt_to: expected None or an int >= 1, got {self.pad_prompt_to}")
        if self.warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {self.warmup}")
        if self.attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {self.attn_impl!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if self.resolved_device().startswith("cuda") else "fp32"


def config_key(cfg: EvalConfig) -> str:
    """A short hash of the settings that change what a (problem, method, t) record means.

    Records in ``out`` with another key are not reused on resume (and are left out of reports of
    this configuration). Problem count, tree sizes, methods, warmup and progress are not part of it.
    """
    keyed = {
        "dataset": cfg.dataset, "target": cfg.target, "draft": cfg.draft, "drafter": cfg.drafter,
        "drafter_options": [list(kv) for kv in cfg.drafter_options], "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
        "dtype": cfg.resolved_dtype(), "device": cfg.resolved_device().split(":")[0], "data_path": cfg.data_path,
        "pad_prompt_to": cfg.pad_prompt_to, "attn_impl": cfg.attn_impl,
    }  # fmt: skip
    if cfg.compile:  # only when set: keys of runs made before the option existed stay valid
        keyed["compile"] = True
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]


# ----------------------------------------------------------------------------------------------
# prompts


@dataclass(frozen=True)
class PaddedProblem:
    """A problem whose prompt starts with other problems of the same dataset (few-shot padding).

    Works with ``eval.datasets.chat_prompt`` / ``prompt_ids`` like the problem it wraps. Every
    padded problem uses the same example order, so all prompts share their leading examples.
    """

    base: Any
    examples: tuple[str, ...]

    @property
    def id(self) -> str:
        return self.base.id

    @property
    def difficulty(self) -> str:
        return self.base.difficulty

    def _preamble(self) -> str:
        if not self.examples:
            return ""
        body = "\n\n".join(self.examples)
        return f"Here are other problems, for reference only:\n\n{body}\n\n---\n\nNow the problem to solve.\n\n"

    def messages(self) -> list[dict[str, str]]:
        msgs = [dict(m) for m in self.base.messages()]
        msgs[0]["content"] = self._preamble() + msgs[0]["content"]
        return msgs

    def plain_prompt(self) -> str:
        return self._preamble() + self.base.plain_prompt()


def example_text(problem: Any, index: int) -> str:
    """One few-shot example: the statement and, where the dataset has one, a reference solution."""
    if hasattr(problem, "question"):  # APPS
        text = f"Example problem {index}:\n{problem.question.strip()}"
        if problem.starter_code.strip():
            text += f"\n```python\n{problem.starter_code.strip()}\n```"
        if problem.solutions:
            text += f"\nSolution:\n```python\n{problem.solutions[0].strip()}\n```"
        return text
    return f"Example {index}:\n```python\n{problem.prompt.rstrip()}\n{problem.canonical_solution.rstrip()}\n```"


def pad_problems(problems: Sequence[Any], pool: Sequence[Any], tokenizer: Any, pad_to: int) -> list[Any]:
    """Wrap each problem in a :class:`PaddedProblem` with the fewest leading examples of ``pool``
    (in order, skipping the problem itself) that make its prompt at least ``pad_to`` tokens.

    Raises ValueError when the pool runs out before a prompt reaches ``pad_to`` tokens.
    """
    from eval.datasets import prompt_ids

    out = []
    for problem in problems:
        examples: list[str] = []
        candidates = iter(p for p in pool if p.id != problem.id)
        padded = PaddedProblem(problem, ())
        while len(prompt_ids(padded, tokenizer)) < pad_to:
            nxt = next(candidates, None)
            if nxt is None:
                raise ValueError(
                    f"pad_prompt_to: {pad_to} tokens not reached for problem {problem.id} with all "
                    f"{len(examples)} other problems prepended ({len(prompt_ids(padded, tokenizer))} tokens)"
                )
            examples.append(example_text(nxt, len(examples) + 1))
            padded = PaddedProblem(problem, tuple(examples))
        out.append(padded)
    return out


def load_eval_problems(cfg: EvalConfig) -> tuple[list[Any], list[Any]]:
    """(problems to evaluate, pool of all problems for few-shot padding)."""
    from eval.datasets import load_apps, load_humaneval

    if cfg.dataset == "apps":
        pool = load_apps(cfg.data_path, difficulty=cfg.difficulty, unique=True)
    else:
        if cfg.difficulty:
            raise ValueError(f"difficulty: HumanEval has no difficulty levels, got {cfg.difficulty!r}")
        pool = load_humaneval(cfg.data_path)
    chosen = pool if cfg.problems is None else pool[: cfg.problems]
    if not chosen:
        raise ValueError(f"problems: no {cfg.dataset} problems left after filtering (difficulty={cfg.difficulty!r})")
    return list(chosen), list(pool)


# ----------------------------------------------------------------------------------------------
# drafters


def tree_depth(parents: Sequence[int]) -> int:
    """Depth of a tree given as a parents list (``parents[0] = -1``, ``parents[i] < i``)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth, default=0)


class RecordingDrafter:
    """A drafter proxy that keeps a reference to each proposed tree's ``parents`` (nothing else,
    no host sync) so that the runner can report tree depths and time attention on the same trees.
    Everything else is the wrapped drafter's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.parents: list[Any] = []

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.inner, "vocab_size", None)

    def reset(self, input_ids):
        self.parents = []
        return self.inner.reset(input_ids)

    def propose(self, context):
        tree = self.inner.propose(context)
        parents = getattr(tree, "parents", None)
        # A copy (asynchronous on CUDA, no host sync): a drafter may refill one buffer every step.
        self.parents.append(parents.clone() if parents is not None else None)
        return tree

    def update(self, context, tree, verdict):
        return self.inner.update(context, tree, verdict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)


def _call_with_accepted(fn: Callable[..., Any], args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` keeping only the keywords ``fn`` declares (all if it takes ``**kw``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn(*args, **kwargs)
    names = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    return fn(*args, **{k: v for k, v in kwargs.items() if k in names})


def build_drafter(name: str, **kwargs: Any) -> Any:
    """A drafter by name: ``drafters.make_drafter(name, ...)``, or ``"module:function"`` for any factory.

    ``kwargs`` offered (each factory receives those its signature names, or all with ``**kwargs``):
    ``target``, ``draft`` (also as ``draft_model``), ``tokenizer``, ``tree_size``, ``device``, ``dtype``.
    """
    if "draft" in kwargs:
        kwargs.setdefault("draft_model", kwargs["draft"])
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"drafter: could not import factory {name!r} ({type(e).__name__}: {e})") from e
        return _call_with_accepted(factory, (), kwargs)
    try:
        from drafters import make_drafter  # type: ignore[attr-defined]
    except ImportError as e:
        raise ValueError(
            f"drafter: {name!r} needs drafters.make_drafter, which this checkout does not have yet; "
            "pass a factory as 'module:function' instead"
        ) from e
    return _call_with_accepted(make_drafter, (name,), kwargs)


# ----------------------------------------------------------------------------------------------
# methods


@dataclass(frozen=True)
class MethodOutput:
    """What one timed generation gives back.

    Attributes:
        token_ids: the new tokens (cut after the first eos and at ``max_new_tokens``).
        wall_s: seconds of the generate call (device synchronized before and after).
        steps: per-step arrays (engine methods): ``nodes``, ``depth``, ``accepted``, ``emitted``,
            ``draft_s``, ``verify_s``, ``commit_s``.
        tree_samples: a few proposed trees' parents lists (engine methods with a drafter).
        prefill_s: seconds of the engine's prompt prefill inside ``wall_s`` (engine methods).
    """

    token_ids: list[int]
    wall_s: float
    steps: dict[str, list] | None = None
    tree_samples: list[list[int]] | None = None
    prefill_s: float | None = None


@dataclass(frozen=True)
class Method:
    """A way to generate. ``run(session, prompt, tree_size)`` -> :class:`MethodOutput`; ``prompt``
    is int64 ``[1, L]`` on the target's device; ``tree_size`` is None unless ``uses_tree``."""

    name: str
    run: Callable[[Any, Any, int | None], MethodOutput]
    uses_tree: bool = False
    needs_draft: bool = False
    needs_drafter: bool = False
    description: str = ""


def _run_specdec(session: "Session", prompt, tree_size: int | None) -> MethodOutput:
    return session.speculative(prompt, tree_size)


def _run_specdec_plain(session: "Session", prompt, tree_size: int | None) -> MethodOutput:
    return session.speculative(prompt, None)


def _run_hf(session: "Session", prompt, tree_size: int | None) -> MethodOutput:
    return session.hf_generate(prompt)


def _run_hf_static(session: "Session", prompt, tree_size: int | None) -> MethodOutput:
    return session.hf_generate(prompt, cache_implementation="static", max_cache_len=session.max_cache_len)


def _run_hf_assisted(session: "Session", prompt, tree_size: int | None) -> MethodOutput:
    return session.hf_generate(prompt, assistant_model=session.draft)


def _run_hf_lookup(session: "Session", prompt, tree_size: int | None) -> MethodOutput:
    return session.hf_generate(prompt, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("specdec", _run_specdec, uses_tree=True, needs_drafter=True,
               description="specdec.SpecDecoder(target, drafter, t): token-tree speculative decoding"),
        Method("specdec-plain", _run_specdec_plain,
               description="the engine without a drafter: one token per step (engine overhead)"),
        Method("hf", _run_hf, description="target-only HF generate, default cache (the reference)"),
        Method("hf-static", _run_hf_static,
               description="target-only HF generate, cache_implementation='static' (compiled decode on CUDA)"),
        Method("hf-assisted", _run_hf_assisted, needs_draft=True,
               description="HF assisted generation, assistant_model = the draft model"),
        Method("hf-lookup", _run_hf_lookup,
               description=f"HF prompt lookup decoding, prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS}"),
    )
}  # fmt: skip


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _clean_generation_config(model: Any, eos: list[int], pad: int, bos: int | None) -> None:
    """Replace the model's generation defaults (e.g. an instruct model's repetition penalty or
    sampling settings) by plain ones, so that every method decodes the same distribution."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=eos or None, pad_token_id=pad, bos_token_id=bos)


class Session:
    """Loaded models and per-method state for one run (engine decoders and drafters per tree size)."""

    def __init__(self, cfg: EvalConfig, target: Any, tokenizer: Any, draft: Any = None,
                 drafter_factory: Callable[..., Any] | None = None, max_cache_len: int = 0) -> None:  # fmt: skip
        import torch

        self.cfg = cfg
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft
        self.drafter_factory = drafter_factory
        self.max_cache_len = max_cache_len
        self.device = torch.device(cfg.resolved_device())
        self.eos = _eos_ids(target, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = int(pad) if pad is not None else (self.eos[0] if self.eos else 0)
        bos = getattr(tokenizer, "bos_token_id", None)
        for model in (target, draft):
            if model is not None:
                _clean_generation_config(model, self.eos, self.pad, bos)
        self._decoders: dict[int | None, Any] = {}
        self._recorders: dict[int | None, RecordingDrafter] = {}
        self.seed = 0  # set per generation by the runner
        self.max_new_tokens = cfg.max_new_tokens  # lowered during warm-up
        if any(m.startswith("specdec") for m in cfg.methods):
            # Route attention through specdec's function before any generate, so every method runs the
            # same (delegating) attention code from the first call on and nothing recompiles mid-run.
            from specdec import hf

            hf.prepare_model(target, "target")

    # -- helpers

    def _sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _finish(self, ids: list[int]) -> list[int]:
        ids = ids[: self.max_new_tokens]
        for j, tok in enumerate(ids):
            if tok in self.eos:
                return ids[: j + 1]
        return ids

    def _sampling_kwargs(self) -> dict[str, Any]:
        if self.cfg.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.cfg.temperature, "top_k": 0, "top_p": 1.0}

    # -- HF generate

    def hf_generate(self, prompt, **extra: Any) -> MethodOutput:
        import torch

        torch.manual_seed(self.seed)
        kwargs = dict(
            max_new_tokens=self.max_new_tokens, eos_token_id=self.eos or None, pad_token_id=self.pad,
            attention_mask=torch.ones_like(prompt), **self._sampling_kwargs(), **extra,
        )  # fmt: skip
        self._sync()
        t0 = time.perf_counter()
        out = self.target.generate(prompt, **kwargs)
        self._sync()
        wall = time.perf_counter() - t0
        return MethodOutput(self._finish(out[0, prompt.shape[1] :].tolist()), wall)

    # -- the engine

    def _decoder(self, tree_size: int | None):
        from specdec import SpecDecoder

        if tree_size not in self._decoders:
            drafter = None
            if tree_size is not None:
                if self.drafter_factory is None:
                    raise ValueError("drafter: the 'specdec' method needs a drafter (--drafter NAME)")
                inner = self.drafter_factory(
                    target=self.target, draft=self.draft, tokenizer=self.tokenizer, tree_size=tree_size,
                    device=self.device, dtype=self.target.dtype,
                )  # fmt: skip
                drafter = self._recorders[tree_size] = RecordingDrafter(inner)
            self._decoders[tree_size] = SpecDecoder(
                self.target, drafter, tree_size or 0, max_cache_len=self.max_cache_len + (tree_size or 0),
                attn_impl=self.cfg.attn_impl, static_shapes=True if self.cfg.compile else None,
                compile=self.cfg.compile,
            )  # fmt: skip
        return self._decoders[tree_size]

    def speculative(self, prompt, tree_size: int | None) -> MethodOutput:
        import torch

        decoder = self._decoder(tree_size)
        generator = None
        if not self.cfg.greedy:
            generator = torch.Generator(device=self.device).manual_seed(self.seed)
        self._sync()
        t0 = time.perf_counter()
        out = decoder.generate(
            prompt[0], self.max_new_tokens, do_sample=not self.cfg.greedy, temperature=self.cfg.temperature or 1.0,
            eos_token_id=self.eos or None, generator=generator, pad_token_id=self.pad,
        )  # fmt: skip
        self._sync()
        wall = time.perf_counter() - t0
        steps = {
            "nodes": [s.nodes_proposed[0] for s in out.steps],
            "accepted": [s.tokens_accepted[0] for s in out.steps],
            "emitted": [s.tokens_emitted[0] for s in out.steps],
            "draft_s": [s.draft_s for s in out.steps],
            "verify_s": [s.verify_s for s in out.steps],
            "commit_s": [s.commit_s for s in out.steps],
        }
        samples = None
        rec = self._recorders.get(tree_size)
        if rec is not None:
            parents = [None if p is None else [int(x) for x in p.tolist()] for p in rec.parents]
            depths = [None if p is None else tree_depth(p) for p in parents]
            if len(depths) != len(out.steps):  # not one proposal per step: depth unknown
                depths = [None] * len(out.steps)
            steps["depth"] = depths
            real = [p for p in parents if p is not None and len(p) > 1]
            if real:
                pick = sorted({round(i * (len(real) - 1) / max(TREE_SAMPLES - 1, 1)) for i in range(TREE_SAMPLES)})
                samples = [real[i] for i in pick]
        else:
            steps["depth"] = [0] * len(out.steps)
        return MethodOutput(self._finish(out.new_tokens(0).tolist()), wall, steps, samples, out.prefill_s)


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        val = getattr(src, "eos_token_id", None) if src is not None else None
        if val is None:
            continue
        for v in [val] if isinstance(val, int) else list(val):
            if v is not None and int(v) not in ids:
                ids.append(int(v))
        if ids:
            break
    return ids


# ----------------------------------------------------------------------------------------------
# records


def compare_tokens(reference: Sequence[int], got: Sequence[int]) -> tuple[bool, int | None, float]:
    """(identical, first divergence, agreement) of two token lists.

    The first divergence is the first index where they differ (or the shorter length when one is a
    prefix of the other), None when identical; agreement is the common prefix over the longer length.
    """
    ref, got = list(reference), list(got)
    if ref == got:
        return True, None, 1.0
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return False, first, first / max(len(ref), len(got))


def _seed_for(base: int, problem_id: str, method: str, tree_size: int | None) -> int:
    return (base * 1_000_003 + zlib.crc32(f"{problem_id}|{method}|{tree_size}".encode())) % (2**31)


def _record_key(rec: Mapping[str, Any]) -> tuple:
    return (rec.get("config_key"), rec.get("dataset"), str(rec.get("problem_id")), rec.get("method"), rec.get("tree_size"))


def load_records(path: str | os.PathLike[str], repair: bool = False) -> list[dict[str, Any]]:
    """The JSON records of a results file ([] if it does not exist).

    A malformed last line (a run killed mid-write) is dropped with a warning -- and removed from
    the file when ``repair`` is set, so that appending goes on cleanly; a malformed line elsewhere
    raises ValueError naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    records: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
        except ValueError as e:
            if i == len(lines) - 1:
                print(f"warning: {path}: line {i + 1} is incomplete ({e}); dropped", file=sys.stderr)
                if repair:
                    path.write_text("".join(lines[:i]), encoding="utf-8")
                return records
            raise ValueError(f"{path}: line {i + 1}: not a JSON object ({e})") from None
        records.append(rec)
    if repair and text and not text.endswith("\n"):  # a complete last record without its newline
        with open(path, "a", encoding="utf-8") as f:
            f.write("\n")
    return records


@dataclass
class EvalResult:
    """What :func:`run_eval` returns.

    Attributes:
        records: every result record of this configuration in ``out`` (earlier runs' included).
        new: how many records this run added.
        skipped: how many (problem, method, t) were already done.
        mismatches: greedy records whose tokens differ from the reference.
        errors: records whose method raised.
        strict: whether mismatches are failures (greedy float32).
        model_shape: the target's attention shape (for attention-only timings).
    """

    records: list[dict[str, Any]]
    new: int = 0
    skipped: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    strict: bool = False
    model_shape: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return bool(self.errors) or (self.strict and bool(self.mismatches))


def _model_shape(model: Any) -> dict[str, Any]:
    cfg = model.config.get_text_config()
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"num_heads": heads, "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
            "head_dim": int(head_dim), "num_layers": int(cfg.num_hidden_layers)}  # fmt: skip


def _work_items(problems: Sequence[Any], methods: Sequence[Method], tree_sizes: Sequence[int]):
    for p_index, problem in enumerate(problems):
        items = []
        for m in methods:
            for t in tree_sizes if m.uses_tree else (None,):
                items.append((m, t))
        yield p_index, problem, items


def _tqdm(iterable, **kw):
    from tqdm.auto import tqdm

    return tqdm(iterable, **kw)


def _say(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)


def _select_methods(cfg: EvalConfig, extra: Mapping[str, Method] | None, have_draft: bool,
                    have_drafter: bool) -> list[Method]:  # fmt: skip
    table = dict(METHODS)
    table.update(extra or {})
    names = list(dict.fromkeys(cfg.methods))
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"methods: unknown {unknown}; expected some of {', '.join(table)}")
    if cfg.greedy and REFERENCE not in names:
        _say(f"note: adding the reference method {REFERENCE!r} (greedy outputs are compared with it)")
        names.insert(0, REFERENCE)
    names.sort(key=lambda n: n != REFERENCE)  # the reference first: later methods compare with it
    chosen = []
    for n in names:
        m = table[n]
        if m.needs_draft and not have_draft:
            _say(f"note: skipping {n!r}: it needs a draft model (--draft)")
            continue
        if m.needs_drafter and not have_drafter:
            raise ValueError(f"drafter: method {n!r} needs a drafter (--drafter NAME or module:function)")
        chosen.append(m)
    return chosen


def run_eval(
    cfg: EvalConfig,
    *,
    models: tuple[Any, Any, Any] | None = None,
    drafter_factory: Callable[..., Any] | None = None,
    extra_methods: Mapping[str, Method] | None = None,
    problems: Sequence[Any] | None = None,
) -> EvalResult:
    """Run (or resume) an evaluation and append one JSON line per (problem, method, t) to ``cfg.out``.

    Args:
        cfg: the settings.
        models: ``(target, tokenizer, draft)`` already loaded (default: loaded from ``cfg``).
        drafter_factory: ``factory(target=, draft=, tokenizer=, tree_size=, device=, dtype=)``
            (default: :func:`build_drafter` with ``cfg.drafter``).
        extra_methods: more methods by name (selectable in ``cfg.methods``).
        problems: the problems (default: loaded from ``cfg``; padding still applies).

    Returns:
        :class:`EvalResult`; ``failed`` is True when a method raised, or when greedy float32 outputs
        differ from the reference.
    """
    import torch

    from eval.datasets import prompt_ids
    from specdec.models import load_model, load_tokenizer

    device = cfg.resolved_device()
    dtype_name = cfg.resolved_dtype()
    key = config_key(cfg)
    out_path = Path(cfg.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    previous = [r for r in load_records(out_path, repair=True) if r.get("config_key") == key]
    done = {_record_key(r): r for r in previous if not r.get("error")}

    if problems is None:
        problems, pool = load_eval_problems(cfg)
    else:
        problems, pool = list(problems), list(problems)

    if models is None:
        dtype = _torch_dtype(dtype_name)
        target = load_model(cfg.target, dtype=dtype, device=device, home=cfg.home, progress=cfg.progress)
        tokenizer = load_tokenizer(cfg.target, home=cfg.home, progress=cfg.progress)
        draft = None
        table = {**METHODS, **(extra_methods or {})}
        if cfg.draft and any(table[m].needs_draft or table[m].needs_drafter for m in cfg.methods if m in table):
            draft = load_model(cfg.draft, dtype=dtype, device=device, home=cfg.home, progress=cfg.progress)
    else:
        target, tokenizer, draft = models
    if drafter_factory is None and cfg.drafter:
        name, options = cfg.drafter, dict(cfg.drafter_options)

        def drafter_factory(**kw):
            return build_drafter(name, **kw, **options)

    methods = _select_methods(cfg, extra_methods, draft is not None, drafter_factory is not None)
    if cfg.pad_prompt_to:
        problems = pad_problems(problems, pool, tokenizer, cfg.pad_prompt_to)
    prompts = [prompt_ids(p, tokenizer) for p in problems]
    max_cache_len = max(len(p) for p in prompts) + cfg.max_new_tokens
    session = Session(cfg, target, tokenizer, draft, drafter_factory, max_cache_len=max_cache_len)
    strict = cfg.greedy and dtype_name == "fp32"
    result = EvalResult(records=list(previous), strict=strict, model_shape=_model_shape(target))
    common = {
        "config_key": key, "dataset": cfg.dataset, "target": cfg.target, "draft": cfg.draft,
        "drafter": cfg.drafter, "drafter_options": dict(cfg.drafter_options), "dtype": dtype_name, "device": device, "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature, "seed": cfg.seed, "pad_prompt_to": cfg.pad_prompt_to,
        "attn_impl": cfg.attn_impl, "compile": cfg.compile,
    }  # fmt: skip
    warmed: set[tuple[str, int | None]] = set()
    bar = _tqdm(list(_work_items(problems, methods, cfg.tree_sizes)), desc=f"{cfg.dataset} problems",
                unit="problem", disable=not cfg.progress, file=sys.stderr)  # fmt: skip
    with open(out_path, "a", encoding="utf-8") as sink:
        for p_index, problem, items in bar:
            ids = prompts[p_index]
            prompt = torch.tensor([ids], dtype=torch.int64, device=session.device)
            reference = done.get((key, cfg.dataset, str(problem.id), REFERENCE, None))
            for method, t in items:
                rkey = (key, cfg.dataset, str(problem.id), method.name, t)
                if rkey in done:
                    result.skipped += 1
                    continue
                if (method.name, t) not in warmed:
                    _warm_up(session, method, prompt, t)
                    warmed.add((method.name, t))
                session.seed = _seed_for(cfg.seed, str(problem.id), method.name, t)
                rec = dict(common, problem_id=str(problem.id), problem_index=p_index,
                           difficulty=getattr(problem, "difficulty", None), method=method.name, tree_size=t,
                           prompt_len=len(ids))  # fmt: skip
                try:
                    res = method.run(session, prompt, t)
                except Exception as e:  # record and go on: one failing method must not lose the run
                    rec["error"] = f"{type(e).__name__}: {e}"
                    _say(f"ERROR {cfg.dataset} problem {problem.id} method {method.name} t={t}: {rec['error']}")
                    if session.device.type == "cuda":
                        torch.cuda.empty_cache()
                else:
                    rec.update(_result_fields(res, tokenizer))
                    rec.update(_compare(rec, reference, cfg.greedy))
                    if method.name == REFERENCE:
                        reference = rec
                _write(sink, rec)
                result.new += 1
                result.records.append(rec)
                if rec.get("match") is False:
                    flag = "GREEDY MISMATCH (fp32: failure)" if strict else "greedy divergence"
                    _say(f"{flag}: {cfg.dataset} problem {problem.id} method {method.name} t={t}: first differing "
                         f"token at position {rec['first_divergence']} of {rec['new_tokens']}")
                if "tokens_per_s" in rec and hasattr(bar, "set_postfix"):
                    bar.set_postfix_str(f"{method.name}{'' if t is None else f'@{t}'} {rec['tokens_per_s']:.1f} tok/s")
    return _finalize(result)


def _finalize(result: EvalResult) -> EvalResult:
    """Keep the latest record per (problem, method, t) (a retried error is replaced by its redo) and
    collect the mismatches and errors that remain."""
    latest: dict[tuple, dict[str, Any]] = {}
    for rec in result.records:
        latest.pop(_record_key(rec), None)
        latest[_record_key(rec)] = rec
    result.records = list(latest.values())
    result.mismatches = [r for r in result.records if r.get("match") is False]
    result.errors = [r for r in result.records if r.get("error")]
    return result


def _warm_up(session: Session, method: Method, prompt, tree_size: int | None) -> None:
    """Untimed short generations (compilation, autotuning, allocation) before a method's first timed one."""
    runs = session.cfg.warmup + (session.cfg.warmup > 0 and method.name == "hf-static")  # compile, then replay
    session.seed = _seed_for(session.cfg.seed, "warmup", method.name, tree_size)
    session.max_new_tokens = min(WARMUP_TOKENS, session.cfg.max_new_tokens)
    try:
        for _ in range(runs):
            method.run(session, prompt, tree_size)
    except Exception:
        pass  # the timed call reports the error in its record
    finally:
        session.max_new_tokens = session.cfg.max_new_tokens


def _result_fields(res: MethodOutput, tokenizer: Any) -> dict[str, Any]:
    n = len(res.token_ids)
    fields: dict[str, Any] = {
        "new_tokens": n, "wall_s": res.wall_s, "tokens_per_s": n / res.wall_s if res.wall_s > 0 else None,
        "token_ids": list(res.token_ids), "text": tokenizer.decode(res.token_ids, skip_special_tokens=False),
        "error": None,
    }  # fmt: skip
    if res.steps is not None:
        steps = res.steps
        num = len(steps["emitted"])
        fields.update(num_steps=num, tau=sum(steps["emitted"]) / num if num else None,
                      mean_accepted=sum(steps["accepted"]) / num if num else None, steps=steps)  # fmt: skip
    if res.tree_samples is not None:
        fields["tree_samples"] = res.tree_samples
    if res.prefill_s is not None:
        fields["prefill_s"] = res.prefill_s
    return fields


def _compare(rec: dict[str, Any], reference: Mapping[str, Any] | None, greedy: bool) -> dict[str, Any]:
    if not greedy:
        return {"reference": None, "match": None, "first_divergence": None, "agreement": None}
    if rec["method"] == REFERENCE:
        return {"reference": REFERENCE, "match": True, "first_divergence": None, "agreement": 1.0}
    if reference is None or reference.get("error") or "token_ids" not in reference:
        return {"reference": REFERENCE, "match": None, "first_divergence": None, "agreement": None}
    same, first, agree = compare_tokens(reference["token_ids"], rec["token_ids"])
    return {"reference": REFERENCE, "match": same, "first_divergence": first, "agreement": agree}


def _write(sink, rec: Mapping[str, Any]) -> None:
    sink.write(json.dumps(rec, separators=(",", ":")) + "\n")
    sink.flush()


# ----------------------------------------------------------------------------------------------
# CLI


def _parser(prog: str, sweep: bool) -> argparse.ArgumentParser:
    p = cliargs.ArgumentParser(
        prog=prog,
        description=(
            "Sweep tree sizes: run the evaluation, time attention alone on the proposed trees (CUDA), "
            "and write the comparison table (CSV), a summary JSON and a plot."
            if sweep
            else "Evaluate speculative decoding against HF baselines on the same prompts; one JSON line "
            "per (problem, method, tree size) in --out; reruns resume."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    if not sweep:
        p.add_argument("dataset", choices=["apps", "humaneval"], help="which problems")
    else:
        p.add_argument("--dataset", choices=["apps", "humaneval"], default="apps", help="which problems")
    p.add_argument("--problems", type=cliargs.int_at_least(0), default=8, help="number of problems (0 = all)")
    p.add_argument("--difficulty", nargs="+", choices=["introductory", "interview", "competition"],
                   help="APPS difficulties to keep")
    p.add_argument("--data", dest="data_path", type=cliargs.existing_path, default=None, help="APPS / HumanEval file (default: the loaders' own)")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="target model: default name, HF id, directory or .gguf")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="draft model for hf-assisted and the drafter ('' = none)")
    p.add_argument("--drafter", default="model",
                   help="drafter: a drafters.make_drafter name (model, medusa, lookup), or module:function "
                   "returning a drafter")
    p.add_argument("--drafter-option", dest="drafter_options", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument of the drafter factory, repeatable (VALUE parsed as JSON if it can "
                   "be, else a string), e.g. --drafter-option depth=4 or --drafter-option heads=DIR")
    p.add_argument("--tree-sizes", type=cliargs.int_at_least(1), nargs="+", default=[32, 64, 128, 256] if sweep else [64],
                   help="node budgets t of the specdec method")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS),
                   help=f"methods to run: {', '.join(METHODS)}")
    p.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=128)
    p.add_argument("--temperature", type=cliargs.float_in(0.0), default=0.0, help="0 = greedy (outputs compared with target-only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", type=cliargs.device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", type=cliargs.output_file, default="results/sweep.jsonl" if sweep else None,
                   help="results JSONL (appended; reruns skip what it holds). Default results/<dataset>.jsonl")
    p.add_argument("--pad-prompt-to", type=cliargs.int_at_least(1), default=None,
                   help="prepend few-shot problems until every prompt has at least N tokens (e.g. 4000)")
    p.add_argument("--attn-impl", choices=["auto", "triton", "torch"], default="auto", help="the engine's attention")
    p.add_argument("--compile", action="store_true",
                   help="the engine's target forward through torch.compile (inductor) before its CUDA graph")
    p.add_argument("--warmup", type=cliargs.int_at_least(0), default=1, help="untimed generations per method before timing")
    p.add_argument("--home", default=None, help="model store root (default $SPECDEC_HOME)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    if sweep:
        p.add_argument("--report-only", action="store_true", help="only rebuild table / CSV / plot from --out")
        p.add_argument("--no-attn", action="store_true", help="skip the attention-only timings")
        p.add_argument("--attn-trees", type=cliargs.int_at_least(1), default=8, help="trees per tree size for the attention timings")
    return p


def _parse_options(items: Sequence[str]) -> tuple[tuple[str, Any], ...]:
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--drafter-option: expected KEY=VALUE, got {item!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out.append((key.strip(), value))
    return tuple(out)


def _config_from(ns: argparse.Namespace, dataset: str) -> EvalConfig:
    out = ns.out or f"results/{dataset}.jsonl"
    return EvalConfig(
        dataset=dataset, target=ns.target, draft=ns.draft or None, drafter=ns.drafter or None,
        drafter_options=_parse_options(ns.drafter_options),
        tree_sizes=tuple(ns.tree_sizes), methods=tuple(ns.methods), problems=ns.problems or None,
        difficulty=tuple(ns.difficulty) if ns.difficulty else None, data_path=ns.data_path,
        max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, seed=ns.seed, dtype=ns.dtype,
        device=ns.device, out=out, pad_prompt_to=ns.pad_prompt_to, attn_impl=ns.attn_impl, compile=ns.compile, warmup=ns.warmup,
        progress=not ns.no_progress, home=ns.home,
    )  # fmt: skip


def _verdict(result: EvalResult) -> int:
    """Print the greedy-agreement summary; 1 on errors or float32 mismatches, else 0."""
    from eval import report

    print(report.agreement_summary(result.records, strict=result.strict))
    if result.errors:
        print(f"FAILED: {len(result.errors)} generation(s) raised (see 'error' in the records)", file=sys.stderr)
    if result.strict and result.mismatches:
        print(f"FAILED: {len(result.mismatches)} greedy fp32 output(s) differ from target-only generate:",
              file=sys.stderr)  # fmt: skip
        for r in result.mismatches:
            print(f"  GREEDY MISMATCH problem {r['problem_id']} method {r['method']} t={r['tree_size']} "
                  f"first divergence at token {r['first_divergence']}", file=sys.stderr)  # fmt: skip
    return 1 if result.failed else 0


def _result_from_file(path: str) -> EvalResult:
    """The records of the last configuration written to ``path`` (by its ``config_key``)."""
    records = load_records(path)
    if not records:
        raise ValueError(f"out: no records in {path}")
    key = records[-1].get("config_key")
    others = sorted({str(r.get("config_key")) for r in records} - {str(key)})
    if others:
        print(f"note: {path} also holds configurations {', '.join(others)}; reporting the last one ({key})",
              file=sys.stderr)  # fmt: skip
    records = [r for r in records if r.get("config_key") == key]
    last = records[-1]
    return _finalize(EvalResult(records=records, strict=last.get("temperature") == 0 and last.get("dtype") == "fp32"))


def main_eval(argv: Sequence[str] | None = None) -> int:
    """``specdec eval apps|humaneval [...]``."""
    from eval import report

    ns = _parser("specdec eval", sweep=False).parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = _config_from(ns, ns.dataset)
    result = run_eval(cfg)
    rows = report.summarize(result.records)
    print(report.format_table(rows))
    print(f"{result.new} new record(s), {result.skipped} already in {cfg.out}")
    return _verdict(result)


def main_sweep(argv: Sequence[str] | None = None) -> int:
    """``specdec sweep [...]``: evaluation over several tree sizes + attention timings + table/CSV/plot."""
    from eval import attn_timing, report

    ns = _parser("specdec sweep", sweep=True).parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = _config_from(ns, ns.dataset)
    result = _result_from_file(cfg.out) if ns.report_only else run_eval(cfg)
    stem = Path(cfg.out).with_suffix("")
    attn_rows = None
    attn_path = Path(f"{stem}.attn.jsonl")
    if not ns.no_attn and not ns.report_only:
        attn_rows = attn_timing.sweep_attention(result.records, result.model_shape, cfg.resolved_dtype(),
                                                cfg.resolved_device(), max_trees=ns.attn_trees)  # fmt: skip
        if attn_rows is not None:
            attn_timing.write_rows(attn_rows, attn_path)
    elif attn_path.exists():
        attn_rows = load_records(attn_path)
    rows = report.summarize(result.records, attn_rows)
    print(report.format_table(rows))
    report.write_csv(rows, f"{stem}.csv")
    report.write_summary(rows, f"{stem}.summary.json", config=asdict(cfg))
    png = report.plot(rows, f"{stem}.png")
    wrote = [f"{stem}.csv", f"{stem}.summary.json", *([str(png)] if png else []), *([str(attn_path)] if attn_rows else [])]
    print("wrote " + ", ".join(wrote))
    return _verdict(result)
