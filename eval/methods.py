"""The ways to generate that an evaluation compares, and the loaded models they share.

========================  ====================================================================
method                    what runs
========================  ====================================================================
``specdec``               ``specdec.SpecDecoder(target, drafter, t)`` for each drafter and tree size t
``specdec-plain``         the same engine without a drafter (one token per step; engine overhead)
``hf``                    ``target.generate`` with the default (dynamic) cache -- the reference
``hf-static``             ``target.generate(cache_implementation="static")`` (compiled decode on CUDA)
``hf-assisted``           ``target.generate(assistant_model=draft)`` (HF assisted generation)
``hf-lookup``             ``target.generate(prompt_lookup_num_tokens=10)`` (HF prompt lookup)
========================  ====================================================================

No decoding happens here: a :class:`Session` holds the models and calls the engine and HF
``generate``, timing each call (device synchronized before and after) and the moments its tokens
become visible (``MethodOutput.emit_t`` / ``emit_n``; see ``eval.latency``). Engine decoders and
drafters are built once per (drafter, tree size) and kept for the whole run; a drafter's draft
model (``draft=``) and Medusa / EAGLE heads (``heads=DIR``) are loaded once per drafter.

With ``cfg.samples`` = n > 1 every call makes n completions of its prompt at once
(``num_return_sequences=n``: a batch of n sequences, ``MethodOutput.samples``) and records no
emission times (a batch's tokens are not one stream); ``hf-assisted`` and ``hf-lookup`` cannot
(HF assisted generation returns one sequence per call; ``Method.multi_sample``). The engine then
keeps the prompt's KV once for its n sequences (the shared layout, ``SpecDecoder``'s
``shared_prefix``; see :meth:`Session.decoder`), and each such record says so (``shared_prompt``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from eval.config import PROMPT_LOOKUP_TOKENS, TREE_SAMPLES, DrafterSpec, EvalConfig

__all__ = [
    "METHODS",
    "EmissionClock",
    "Method",
    "MethodOutput",
    "RecordingDrafter",
    "Session",
    "build_drafter",
    "tree_depth",
]


def tree_depth(parents: Sequence[int]) -> int:
    """Depth of a tree given as a parents list (``parents[0] = -1``, ``parents[i] < i``)."""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth, default=0)


# ----------------------------------------------------------------------------------------------
# drafters


class RecordingDrafter:
    """A drafter proxy that keeps a reference to each proposed tree's ``parents`` (nothing else,
    no host sync) so that the runner can report tree depths and time attention on the same trees,
    and the drafter's ``last_phase_s`` after each proposal when it has one (a profiling drafter,
    e.g. ``EagleDrafter(profile=True)``: a new dict per proposal, which its ``update`` may extend).
    Everything else is the wrapped drafter's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.parents: list[Any] = []
        self.phases: list[dict[str, float] | None] = []

    @property
    def vocab_size(self) -> int | None:
        return getattr(self.inner, "vocab_size", None)

    def reset(self, input_ids):
        self.parents = []
        self.phases = []
        return self.inner.reset(input_ids)

    def propose(self, context):
        return self._record(self.inner.propose(context))

    def propose_batch(self, contexts):
        """The wrapped drafter's trees for a step's sequences (its own ``propose_batch`` where it
        has one: ``specdec.drafting.propose_all``), each recorded as ``propose`` records it."""
        from specdec.drafting import propose_all

        return [self._record(tree) for tree in propose_all(self.inner, contexts)]

    def _record(self, tree):
        parents = getattr(tree, "parents", None)
        # A copy (asynchronous on CUDA, no host sync): a drafter may refill one buffer every step.
        self.parents.append(parents.clone() if parents is not None else None)
        self.phases.append(getattr(self.inner, "last_phase_s", None))
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
    ``target``, ``draft`` (also as ``draft_model``), ``tokenizer``, ``tree_size`` (the drafter's cap:
    the run's tree size, None for ``"auto"``), ``device``, ``dtype``, and the drafter's own options.
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
    from drafters import make_drafter

    return _call_with_accepted(make_drafter, (name,), kwargs)


def _load_heads(spec: DrafterSpec, target: Any) -> Any | None:
    """Medusa / EAGLE heads named by ``heads=DIR``, loaded once (placed like ``make_drafter`` would)."""
    path = dict(spec.options).get("heads")
    kinds = [p for p in spec.name.split("+") if p in ("medusa", "eagle")]
    if len(kinds) != 1 or not isinstance(path, (str, os.PathLike)):  # none, or ambiguous: the factory loads
        return None
    lm = target.get_output_embeddings().weight
    if kinds[0] == "medusa":
        from drafters.medusa import MedusaHeads

        return MedusaHeads.load(path, device=lm.device, dtype=lm.dtype)
    from drafters.eagle import EagleHead

    return EagleHead.load(path, target, device=lm.device, dtype=lm.dtype, name="heads")


# ----------------------------------------------------------------------------------------------
# methods


@dataclass(frozen=True)
class MethodOutput:
    """What one timed generation gives back.

    Attributes:
        token_ids: the new tokens (cut after the first eos and at ``max_new_tokens``); with
            ``samples``, the first sample's.
        wall_s: seconds of the generate call (device synchronized before and after); with
            ``samples``, of the one call that made them all.
        steps: per-step arrays (engine methods): ``nodes``, ``depth``, ``accepted``, ``emitted``,
            ``draft_s``, ``verify_s``, ``commit_s``; ``capture_s`` where the drafter captured inside a
            step (``StepStats.capture_s``); ``draft_phases`` (one ``{phase: seconds}`` dict
            per step, inside that step's ``draft_s``) when the drafter profiles its phases. With
            ``samples``, ``nodes`` / ``depth`` / ``accepted`` / ``emitted`` are sums over the
            sequences still decoding in that step, and ``active`` counts them.
        tree_samples: a few proposed trees' parents lists (engine methods with a drafter).
        prefill_s: seconds of the engine's prompt prefill inside ``wall_s`` (engine methods).
        emit_t: seconds from the call's start at which tokens became visible (one per emission).
        emit_n: tokens made visible at each ``emit_t`` (``eval.latency``).
        samples: with ``cfg.samples`` = n > 1, the n completions' new tokens (cut as ``token_ids``),
            in ``num_return_sequences`` order; None for a single completion.
        shared_prompt: engine methods with ``samples``: whether the call kept its prompt's KV once
            for the n sequences (``GenerationOutput.shared_prompt``); None otherwise.
        budget: the engine at ``tree_size`` ``"auto"``: (steps per budget with the budgets as strings,
            the last decision's line: ``GenerationOutput.budget``); None otherwise. ``steps`` then
            also has ``budget``, each step's.
    """

    token_ids: list[int]
    wall_s: float
    steps: dict[str, list] | None = None
    tree_samples: list[list[int]] | None = None
    prefill_s: float | None = None
    emit_t: list[float] | None = None
    emit_n: list[int] | None = None
    samples: list[list[int]] | None = None
    shared_prompt: bool | None = None
    budget: tuple[dict[str, int], str] | None = None

    @property
    def new_tokens(self) -> int:
        """New tokens of the call: of every sample when there are several."""
        return len(self.token_ids) if self.samples is None else sum(len(s) for s in self.samples)


@dataclass(frozen=True)
class Method:
    """A way to generate. ``run(session, prompt, tree_size)`` -> :class:`MethodOutput`; ``prompt``
    is int64 ``[1, L]`` on the target's device; ``tree_size`` is None unless ``uses_tree``. A method
    with ``needs_drafter`` runs once per drafter of the run, with ``session.drafter`` set to it. A
    method with ``multi_sample`` makes ``session.samples`` completions in one call when that is > 1
    (``MethodOutput.samples``); the others are skipped by runs with several samples."""

    name: str
    run: Callable[[Any, Any, int | None], MethodOutput]
    uses_tree: bool = False
    needs_draft: bool = False
    needs_drafter: bool = False
    engine: bool = False
    multi_sample: bool = True
    description: str = ""


def _run_specdec(session: Session, prompt, tree_size: int | None) -> MethodOutput:
    return session.speculative(prompt, tree_size)


def _run_specdec_plain(session: Session, prompt, tree_size: int | None) -> MethodOutput:
    return session.speculative(prompt, None)


def _run_hf(session: Session, prompt, tree_size: int | None) -> MethodOutput:
    return session.hf_generate(prompt)


def _run_hf_static(session: Session, prompt, tree_size: int | None) -> MethodOutput:
    # HF sizes the static cache for the batch itself: num_return_sequences x max_cache_len slots.
    return session.hf_generate(prompt, cache_implementation="static", max_cache_len=session.max_cache_len)


def _run_hf_assisted(session: Session, prompt, tree_size: int | None) -> MethodOutput:
    return session.hf_generate(prompt, assistant_model=session.draft)


def _run_hf_lookup(session: Session, prompt, tree_size: int | None) -> MethodOutput:
    return session.hf_generate(prompt, prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("specdec", _run_specdec, uses_tree=True, needs_drafter=True, engine=True,
               description="specdec.SpecDecoder(target, drafter, t): token-tree speculative decoding"),
        Method("specdec-plain", _run_specdec_plain, engine=True,
               description="the engine without a drafter: one token per step (engine overhead)"),
        Method("hf", _run_hf, description="target-only HF generate, default cache (the reference)"),
        Method("hf-static", _run_hf_static,
               description="target-only HF generate, cache_implementation='static' (compiled decode on CUDA)"),
        Method("hf-assisted", _run_hf_assisted, needs_draft=True, multi_sample=False,
               description="HF assisted generation, assistant_model = the draft model"),
        Method("hf-lookup", _run_hf_lookup, multi_sample=False,
               description=f"HF prompt lookup decoding, prompt_lookup_num_tokens={PROMPT_LOOKUP_TOKENS}"),
    )
}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# timing


class EmissionClock:
    """When a call's tokens become visible: ``t`` (seconds since :meth:`start`) and ``n`` (tokens).

    Fed by the engine's ``on_tokens(seq, tokens)`` callback (:meth:`on_tokens`) or, as an HF
    streamer (:meth:`streamer`), by ``generate``'s ``put`` calls (the first ``put``, the prompt, is
    skipped).
    """

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.t: list[float] = []
        self.n: list[int] = []
        self._prompt_seen = False

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def add(self, n: int) -> None:
        self.t.append(round(time.perf_counter() - self.t0, 7))
        self.n.append(int(n))

    def on_tokens(self, seq: int, tokens: Sequence[int]) -> None:
        if seq == 0 and tokens:
            self.add(len(tokens))

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate's first put is the prompt
            self._prompt_seen = True
            return
        n = int(value.numel()) if hasattr(value, "numel") else len(value)
        if n:
            self.add(n)

    def end(self) -> None:
        pass

    def streamer(self) -> Any:
        """This clock as a ``transformers`` streamer (a ``BaseStreamer`` subclass when available)."""
        try:
            from transformers.generation.streamers import BaseStreamer
        except ImportError:  # pragma: no cover - very old transformers: duck typing
            return self
        clock = self

        class _Streamer(BaseStreamer):
            def put(self, value):
                clock.put(value)

            def end(self):
                clock.end()

        return _Streamer()


def _torch_dtype(name: str):
    from specdec.dtypes import parse_dtype

    return parse_dtype(name)


def _clean_generation_config(model: Any, eos: list[int], pad: int, bos: int | None) -> None:
    """Replace the model's generation defaults (e.g. an instruct model's repetition penalty or
    sampling settings) by plain ones, so that every method decodes the same distribution."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=eos or None, pad_token_id=pad, bos_token_id=bos)


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
# the session


class Session:
    """Loaded models and per-method state for one run: engine decoders and drafters per (drafter,
    tree size), draft models and heads per drafter.

    Args:
        cfg: the run's settings.
        target, tokenizer: the target model and its tokenizer.
        draft: the run's draft model (``hf-assisted``, and drafters without ``draft=``), or None.
        drafter_factory: ``factory(spec, target=, draft=, tokenizer=, tree_size=, device=, dtype=,
            **options)`` -> drafter (default: :func:`build_drafter` with ``spec.name``).
        max_cache_len: longest prompt + ``max_new_tokens`` (the caches' capacity; the runner sets it
            once the prompts are known, after any earlier turns are answered).
        min_len: shortest prompt + ``max_new_tokens`` (where the warm-up of a run with several samples
            starts); None: unknown (the warm-up covers every prompt length up to ``max_cache_len``).
        load_model: ``load_model(name)`` -> model, for drafters that name a draft model of their own
            (default: ``specdec.models.load_model`` with the run's dtype / device / home).

    The runner sets ``seed`` and ``drafter`` (the :class:`DrafterSpec` of the next ``specdec`` call)
    before each call, and lowers ``max_new_tokens`` during warm-up. Every call makes ``samples``
    (``cfg.samples``) completions of its prompt.
    """

    def __init__(self, cfg: EvalConfig, target: Any, tokenizer: Any, draft: Any = None,
                 drafter_factory: Callable[..., Any] | None = None, max_cache_len: int = 0,
                 load_model: Callable[[str], Any] | None = None, min_len: int | None = None) -> None:  # fmt: skip
        import torch

        self.cfg = cfg
        self.target = target
        self.tokenizer = tokenizer
        self.draft = draft
        self.drafter_factory = drafter_factory
        self.max_cache_len = max_cache_len
        self.min_len = min_len
        self.device = torch.device(cfg.resolved_device())
        self.eos = _eos_ids(target, tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = int(pad) if pad is not None else (self.eos[0] if self.eos else 0)
        self._bos = getattr(tokenizer, "bos_token_id", None)
        for model in (target, draft):
            if model is not None:
                _clean_generation_config(model, self.eos, self.pad, self._bos)
        self._load_model = load_model
        self._draft_models: dict[str, Any] = {}
        self._heads: dict[str, Any] = {}
        self._decoders: dict[tuple[str | None, int | None], Any] = {}
        self._recorders: dict[tuple[str | None, int | None], RecordingDrafter] = {}
        self.drafter: DrafterSpec | None = None  # set per call by the runner
        self.seed = 0  # set per generation by the runner
        self.max_new_tokens = cfg.max_new_tokens  # lowered during warm-up
        self.samples = cfg.samples
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
        """``target.generate(prompt, **extra)`` with the run's decoding settings, timed: one completion
        streamed into an :class:`EmissionClock`, or ``samples`` of them (``num_return_sequences``)."""
        import torch

        torch.manual_seed(self.seed)
        clock = EmissionClock()
        kwargs = dict(
            max_new_tokens=self.max_new_tokens, eos_token_id=self.eos or None, pad_token_id=self.pad,
            attention_mask=torch.ones_like(prompt), **self._sampling_kwargs(), **extra,
        )  # fmt: skip
        if self.samples > 1:
            kwargs["num_return_sequences"] = self.samples
        else:
            kwargs["streamer"] = clock.streamer()
        self._sync()
        t0 = time.perf_counter()
        clock.start()
        out = self.target.generate(prompt, **kwargs)
        self._sync()
        wall = time.perf_counter() - t0
        rows = [self._finish(row.tolist()) for row in out[:, prompt.shape[1] :]]  # [samples, T] -> lists
        if self.samples > 1:
            return MethodOutput(rows[0], wall, samples=rows)
        return MethodOutput(rows[0], wall, emit_t=clock.t, emit_n=clock.n)

    def answer(self, prompt) -> list[int]:
        """The target's greedy answer to ``prompt`` (int64 ``[1, L]``): target-only HF ``generate``
        (default cache), at most ``cfg.max_new_tokens`` tokens, cut after the first eos; untimed.
        The earlier turn a later prompt quotes (Spec-Bench's second turns, ``eval.runner``)."""
        import torch

        out = self.target.generate(prompt, max_new_tokens=self.cfg.max_new_tokens, do_sample=False,
                                   eos_token_id=self.eos or None, pad_token_id=self.pad,
                                   attention_mask=torch.ones_like(prompt))  # fmt: skip
        ids = out[0, prompt.shape[1] :].tolist()[: self.cfg.max_new_tokens]
        for j, tok in enumerate(ids):
            if tok in self.eos:
                return ids[: j + 1]
        return ids

    # -- drafters and the engine

    def _draft_for(self, spec: DrafterSpec) -> Any:
        name = spec.draft
        if name is None or name == self.cfg.draft:
            return self.draft
        if name not in self._draft_models:
            if self._load_model is None:
                from specdec.models import load_model

                dtype = _torch_dtype(self.cfg.resolved_dtype())
                model = load_model(name, dtype=dtype, device=str(self.device), home=self.cfg.home,
                                   progress=self.cfg.progress)  # fmt: skip
            else:
                model = self._load_model(name)
            _clean_generation_config(model, self.eos, self.pad, self._bos)
            self._draft_models[name] = model
        return self._draft_models[name]

    def load_heads(self) -> None:
        """Load every drafter's ``heads=DIR`` now (each once; the drafters built later reuse them),
        so that a missing or mismatched directory fails the run before its first problem with the
        loader's ``ValueError``, not once per problem and tree size."""
        for spec in self.cfg.drafters:
            self._heads_of(spec)

    def _heads_of(self, spec: DrafterSpec) -> Any | None:
        """``spec``'s loaded ``heads=`` (None: it names none), loaded on first use."""
        if spec.key not in self._heads:
            try:
                self._heads[spec.key] = _load_heads(spec, self.target)
            except ValueError as e:
                raise ValueError(f"drafters: the heads of {spec.key!r} could not be loaded: {e}") from e
        return self._heads[spec.key]

    def _make_drafter(self, spec: DrafterSpec, tree_size: int | str) -> Any:
        options = spec.drafter_options()
        heads = self._heads_of(spec)
        if heads is not None:
            options["heads"] = heads
        cap = None if tree_size == "auto" else tree_size  # auto: the engine's budget of each step is the cap
        kw = dict(target=self.target, draft=self._draft_for(spec), tokenizer=self.tokenizer, tree_size=cap,
                  device=self.device, dtype=self.target.dtype)  # fmt: skip
        if self.drafter_factory is not None:
            return self.drafter_factory(spec, **kw, **options)
        return build_drafter(spec.name, **kw, **options)

    def _slot(self, tree_size: int | str | None) -> tuple[str | None, int | str | None]:
        if tree_size is None:
            return (None, None)
        if self.drafter is None:
            raise ValueError("drafters: the 'specdec' method needs a drafter (--drafters NAME ...)")
        return (self.drafter.key, tree_size)

    def _cache_options(self, tree: int) -> dict[str, Any]:
        """``SpecDecoder``'s KV-cache options for an engine of ``tree`` nodes per step besides the root.

        One sample per call: ``max_cache_len`` = longest prompt + ``max_new_tokens`` + tree, one
        capacity for every call. ``samples`` = n > 1: the shared layout -- the prompt's KV once in a
        batch-1 cache, the n rows' cache holding only ``1 + max_new_tokens + tree`` slots -- so the
        engine gets two cache buckets instead: that row size, and ``max_cache_len + tree`` (every
        prompt, and every call of the copy layout, fits it; a prompt of at most the row size gets the
        row bucket). ``shared_prefix=True`` where the target's attention allows it
        (``hf.shared_prefix_obstacle`` over both buckets), so that a call the cascade cannot serve
        raises instead of silently copying; else False (each row a copy of the prompt's KV, as before). ``cfg.shared_prompt`` False: the
        copy layout on purpose (one ``max_cache_len`` bucket of n rows, ``shared_prefix=False``).
        """
        top = self.max_cache_len + tree
        if self.samples == 1:
            return {"max_cache_len": top}
        if not self.cfg.shared_prompt:  # the copy layout: every row holds its prompt's KV
            return {"max_cache_len": top, "shared_prefix": False}
        from specdec import hf

        rows = 1 + self.cfg.max_new_tokens + tree  # not self.max_new_tokens: lowered while warming up
        top = max(top, rows)
        obstacle = hf.shared_prefix_obstacle(self.target, top + rows)
        return {"cache_buckets": (rows, top), "shared_prefix": obstacle is None}

    def decoder(self, tree_size: int | str | None):
        """The engine for the current drafter at ``tree_size`` (None: no drafter; ``"auto"``: the
        per-step budget up to ``DEFAULT_MAX_TREE_SIZE`` nodes), built on first use.

        Its caches: see :meth:`_cache_options` (with ``samples`` > 1, the shared prompt's small row
        cache and ``shared_prefix=True``, also with static shapes on CUDA)."""
        from specdec import SpecDecoder
        from specdec.budget import DEFAULT_MAX_TREE_SIZE

        slot = self._slot(tree_size)
        if slot not in self._decoders:
            drafter = None
            if tree_size is not None:
                drafter = self._recorders[slot] = RecordingDrafter(self._make_drafter(self.drafter, tree_size))
            comp = self.cfg.compile or (tree_size is not None and self.drafter.compile)
            nodes = DEFAULT_MAX_TREE_SIZE if tree_size == "auto" else tree_size or 0  # the largest tree of a step
            self._decoders[slot] = SpecDecoder(  # profile: the records' per-step draft / verify / commit times are
                self.target, drafter, tree_size or 0, attn_impl=self.cfg.attn_impl,  # device time, as before
                static_shapes=True if comp else None, compile=comp,
                compile_prefill=bool(comp) and self.cfg.compile_prefill, profile=True, **self._cache_options(nodes),
            )  # fmt: skip
        return self._decoders[slot]

    def prepare(self, method: Method, tree_size: int | None, warm: bool) -> tuple[float, float]:
        """Build what ``method`` needs at ``tree_size`` (engine methods: drafter and decoder) and, with
        ``warm``, run the engine's declared warm-up (``SpecDecoder.warmup``: every forward the run's
        prompts will use, compiled / captured; with ``samples`` > 1, ``new_tokens=max_new_tokens`` and
        ``shared="only"``: every (rows' cache, prompt cache) pair of the shared prompts from
        ``min_len`` to ``max_cache_len``, and no copy-layout caches of n rows; when sampling, the
        sampled plain-decoding chunks beside the greedy ones). Returns (seconds building, seconds
        warming up)."""
        if not method.engine:
            return 0.0, 0.0
        t0 = time.perf_counter()
        decoder = self.decoder(tree_size if method.uses_tree else None)
        load_s = time.perf_counter() - t0
        prep_s = 0.0
        warmup = getattr(decoder, "warmup", None)
        if warm and callable(warmup):
            self._sync()
            t0 = time.perf_counter()
            max_len = max(self.max_cache_len, 2)
            # the sampled plain-decoding chunks of speculative()'s calls too (SpecDecoder.warmup's sampling)
            from specdec import SamplingConfig

            sampling = None if self.cfg.greedy else SamplingConfig(self.cfg.temperature or 1.0)
            if self.samples > 1 and self.cfg.shared_prompt and max_len > self.cfg.max_new_tokens:
                min_len = None if self.min_len is None else min(max(self.min_len, 2), max_len)
                warmup(batch_sizes=(self.samples,), max_len=max_len, min_len=min_len,
                       new_tokens=self.cfg.max_new_tokens, shared="only", sampling=sampling, log=None)  # fmt: skip
            else:
                warmup(batch_sizes=(self.samples,), max_len=max_len, sampling=sampling, log=None)
            self._sync()
            prep_s = time.perf_counter() - t0
        return load_s, prep_s

    def speculative(self, prompt, tree_size: int | None) -> MethodOutput:
        """The engine for the current drafter at ``tree_size`` (None: no drafter) on ``prompt``, timed:
        one completion (its emissions clocked) or ``samples`` of them in one batched call."""
        import torch

        decoder = self.decoder(tree_size)
        generator = None
        if not self.cfg.greedy:
            generator = torch.Generator(device=self.device).manual_seed(self.seed)
        clock = EmissionClock()
        self._sync()
        t0 = time.perf_counter()
        clock.start()
        out = decoder.generate(
            prompt[0], self.max_new_tokens, do_sample=not self.cfg.greedy, temperature=self.cfg.temperature or 1.0,
            eos_token_id=self.eos or None, generator=generator, pad_token_id=self.pad,
            on_tokens=clock.on_tokens if self.samples == 1 else None, num_return_sequences=self.samples,
        )  # fmt: skip
        self._sync()
        wall = time.perf_counter() - t0
        # Per step, summed over the batch's sequences (one sequence unless samples > 1). A sequence
        # still decoding emits >= 1 token per step; finished ones emit and propose nothing.
        active = [sum(e > 0 for e in s.tokens_emitted) for s in out.steps]
        steps = {
            "nodes": [sum(s.nodes_proposed) for s in out.steps],
            "accepted": [sum(s.tokens_accepted) for s in out.steps],
            "emitted": [sum(s.tokens_emitted) for s in out.steps],
            "draft_s": [s.draft_s for s in out.steps],
            "verify_s": [s.verify_s for s in out.steps],
            "commit_s": [s.commit_s for s in out.steps],
        }
        if any(s.capture_s for s in out.steps):  # the drafter's captures inside draft_s (stalls, first calls)
            steps["capture_s"] = [s.capture_s for s in out.steps]
        if self.samples > 1:
            steps["active"] = active
        budget = None
        if out.budget is not None:  # tree_size "auto": each step's budget, the call's histogram and last decision
            steps["budget"] = [s.budget for s in out.steps]
            budget = ({str(n): k for n, k in out.budget.histogram.items()}, out.budget.reason)
        trees = None
        rec = self._recorders.get(self._slot(tree_size))
        if rec is not None:
            parents = [None if p is None else [int(x) for x in p.tolist()] for p in rec.parents]
            depths: list[int | None] = [None] * len(out.steps)
            if len(parents) == sum(active):  # one proposal per decoding sequence and step, in batch order
                start = 0
                for i, n in enumerate(active):
                    mine = parents[start : start + n]
                    start += n
                    if all(p is not None for p in mine):
                        depths[i] = sum(tree_depth(p) for p in mine)
            steps["depth"] = depths
            if len(rec.phases) == len(out.steps) and any(p is not None for p in rec.phases):
                steps["draft_phases"] = [None if p is None else {k: float(v) for k, v in p.items()} for p in rec.phases]
            real = [p for p in parents if p is not None and len(p) > 1]
            if real:
                pick = sorted({round(i * (len(real) - 1) / max(TREE_SAMPLES - 1, 1)) for i in range(TREE_SAMPLES)})
                trees = [real[i] for i in pick]
        else:
            steps["depth"] = [0] * len(out.steps)
        rows = [self._finish(out.new_tokens(b).tolist()) for b in range(self.samples)]
        if self.samples > 1:
            return MethodOutput(rows[0], wall, steps, trees, out.prefill_s, samples=rows,
                                shared_prompt=bool(getattr(out, "shared_prompt", False)), budget=budget)  # fmt: skip
        return MethodOutput(rows[0], wall, steps, trees, out.prefill_s, emit_t=clock.t, emit_n=clock.n, budget=budget)
