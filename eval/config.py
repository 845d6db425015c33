"""What an evaluation run depends on: :class:`EvalConfig`, the drafters it compares
(:class:`DrafterSpec`, parsed from ``NAME[:KEY=VALUE,...]``) and the configuration key that decides
which records of a results file a run may reuse.

A run's records share one ``config_key`` (the settings every method depends on: models, dataset,
decoding settings, dtype, ...). The drafter is *not* part of it, so that the baselines (``hf``,
``hf-static``, ``hf-assisted``, ``hf-lookup``), which do not depend on the drafter, are computed once
per problem and shared by every drafter's rows -- also when a drafter is added to an existing run
later. A speculative record names its drafter in its own ``drafter`` field (the spec's canonical
text, :attr:`DrafterSpec.key`); a record is identified by (config key, dataset, problem, method,
drafter, tree size) (``eval.records.record_key``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from eval.datasets import CHAT_DATASETS, SPECBENCH_CATEGORIES, check_dataset

__all__ = [
    "BASELINE_METHODS",
    "DEFAULT_METHODS",
    "DRAFTER_SYNTAX",
    "DTYPES",
    "PROMPT_LOOKUP_TOKENS",
    "REFERENCE",
    "TREE_SAMPLES",
    "WARMUP_TOKENS",
    "DrafterSpec",
    "EvalConfig",
    "config_key",
    "parse_drafter_spec",
    "parse_options",
]

#: The method whose greedy output every other method is compared with (target-only, default cache).
REFERENCE = "hf"
BASELINE_METHODS = ("hf", "hf-static", "hf-assisted", "hf-lookup")
DEFAULT_METHODS = ("specdec", "specdec-plain", *BASELINE_METHODS)
DTYPES = ("auto", "fp32", "bf16", "fp16")
PROMPT_LOOKUP_TOKENS = 10
#: Trees kept per (problem, drafter, tree size) record for the attention-only timing (parents arrays).
TREE_SAMPLES = 4
#: New tokens of a warm-up generation.
WARMUP_TOKENS = 16
#: The drafter option the runner handles itself: a draft model (name, HF id or directory) loaded once
#: and handed to the factory as ``draft`` / ``draft_model`` (default: the run's ``draft``).
DRAFT_OPTION = "draft"
#: The drafter option that configures the engine: ``compile=true`` runs this drafter's rows with
#: ``SpecDecoder(compile=True)`` (the run's ``--compile`` does it for every row), and a drafter whose
#: constructor takes ``compile`` (the draft-model drafter) gets it too. Rows with it are another
#: drafter (its key), so compiled and uncompiled rows share one file and its baselines.
COMPILE_OPTION = "compile"

DRAFTER_SYNTAX = """\
drafter spec: [LABEL=]NAME[:KEY=VALUE[,KEY=VALUE...]]
  NAME    a drafters.make_drafter name (model, medusa, lookup, eagle), several joined by '+' (one
          merged tree, parts in priority order; PART.KEY=VALUE goes to one part) or
          module:function (any factory)
  KEY=VALUE  constructor options; VALUE is parsed as JSON when it can be (4, true, [1,2]), else a
          string; commas inside [...], {...} or quotes do not split. draft=MODEL loads that draft
          model once for this drafter (default: --draft); heads=DIR loads Medusa / EAGLE heads once;
          compile=true runs this drafter's engine through torch.compile (as --compile does for all);
          compile=max-autotune also times Triton GEMM templates for every matmul shape (longer compile).
  LABEL   the name shown in tables and plots (default: NAME when it is unique in the run, else the
          whole spec)
  e.g. lookup  medusa:heads=/tmp/medusa  model:draft=qwen2.5-coder-0.5b,depth=4  m8=model:topk=8
       lookup+eagle:heads=/tmp/eagle,lookup.max_depth=12
       tests.eval.tiny:make_drafter"""

_LABEL = re.compile(r"^([A-Za-z0-9_.+-]+)=(.*)$", re.S)
_KEY = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*\.)?[A-Za-z_][A-Za-z0-9_]*$")


def _known_drafters() -> tuple[str, ...]:
    from drafters import DRAFTERS

    return tuple(DRAFTERS)


def _value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), sort_keys=True)


def _split_top_level(text: str, sep: str = ",") -> list[str]:
    """``text`` split at ``sep`` outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return parts


def _parse_value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_options(items: Iterable[str], arg: str = "--drafter-option") -> tuple[tuple[str, Any], ...]:
    """``["KEY=VALUE", ...]`` -> ``((key, value), ...)``; VALUE parsed as JSON when it can be, else kept
    as a string. Raises ValueError naming ``arg`` for an item without ``=`` or with an empty key."""
    out = []
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{arg}: expected KEY=VALUE, got {item!r}")
        out.append((key.strip(), _parse_value(raw)))
    return tuple(out)


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter of a run: a factory name, its options and the label of its rows.

    Attributes:
        name: a ``drafters.make_drafter`` name (``"model"``, ``"medusa"``, ``"lookup"``, ``"eagle"``)
            or ``"module:function"`` (any factory; see ``eval.methods.build_drafter``).
        options: keyword arguments of the factory as (key, value) pairs; ``draft`` names a draft
            model the runner loads once for this drafter (default: the run's ``draft``).
        label: the name shown in tables and plots (None: chosen by :meth:`EvalConfig.labels`).
    """

    name: str
    options: tuple[tuple[str, Any], ...] = ()
    label: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"drafters: expected a drafter name, got {self.name!r}")
        if isinstance(self.options, dict):
            object.__setattr__(self, "options", tuple(self.options.items()))
        keys = [k for k, _ in self.options]
        bad = [k for k in keys if not isinstance(k, str) or not _KEY.match(k)]
        if bad:
            raise ValueError(f"drafters: option names must be identifiers, got {bad!r} in {self.key!r}")
        if len(set(keys)) != len(keys):
            raise ValueError(f"drafters: option given twice in {self.key!r}")
        if ":" in self.name:
            module, _, attr = self.name.partition(":")
            if module in _known_drafters():  # "model:depth": an option without "="
                raise ValueError(f"drafters: malformed option {attr!r} in {self.name!r}; expected KEY=VALUE")
            if not module or not attr or ":" in attr:
                raise ValueError(f"drafters: expected NAME or module:function, got {self.name!r}")
        elif any(part not in _known_drafters() for part in self.name.split("+")):
            raise ValueError(
                f"drafters: unknown drafter {self.name!r}; expected one of {', '.join(_known_drafters())} "
                "(or several joined by '+': a merged tree) or module:function"
            )
        self.compile  # noqa: B018 -- validates the compile= option now

    @property
    def key(self) -> str:
        """Canonical text ``NAME[:k=v,...]`` (options sorted): the ``drafter`` field of its records."""
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={_value_text(v)}" for k, v in sorted(self.options))

    @property
    def draft(self) -> str | None:
        """The ``draft=`` option (a draft model to load for this drafter), or None."""
        val = dict(self.options).get(DRAFT_OPTION)
        return None if val is None else str(val)

    @property
    def compile(self) -> bool | str:
        """The ``compile=`` option: this drafter's engine through ``torch.compile`` (true; or
        ``max-autotune``: inductor timing GEMM templates; ``specdec.graphs.compile_fixed_shapes``), and
        the drafter's own forwards where its constructor takes ``compile`` (the draft-model drafter: true
        compiles each of its forwards whole, ``layers`` each decoder layer as the engine's true does)."""
        val = dict(self.options).get(COMPILE_OPTION, False)
        if not isinstance(val, bool) and val not in ("max-autotune", "layers"):
            raise ValueError(f"drafters: expected compile=true, compile=false, compile=layers or compile=max-autotune, "
                             f"got {val!r} in {self.key!r}")  # fmt: skip
        return val

    def factory_options(self) -> dict[str, Any]:
        """The options handed to the factory (all but ``draft``, which the runner loads, and ``compile``,
        an engine option)."""
        return {k: v for k, v in self.options if k not in (DRAFT_OPTION, COMPILE_OPTION)}

    def drafter_options(self) -> dict[str, Any]:
        """``factory_options`` plus ``compile`` when the drafter's constructor takes it (the draft
        model's forwards are compiled with the engine's forward)."""
        from drafters import constructor_options

        options = self.factory_options()
        if self.compile and "compile" in constructor_options(self.name):
            options["compile"] = self.compile
        return options

    @classmethod
    def parse(cls, text: str, arg: str = "--drafters") -> DrafterSpec:
        return parse_drafter_spec(text, arg)


def _looks_like_path(value: str) -> bool:
    return value.startswith(("/", "./", "../", "~")) or os.sep in value and os.path.splitext(value)[1] != ""


def check_drafter_paths(specs: Iterable[DrafterSpec], arg: str = "drafters") -> None:
    """Before a run loads or downloads anything: every ``heads=DIR`` (also ``PART.heads=``) must be
    an existing folder, and a ``draft=`` that is a path an existing file or folder (a default model
    name or a hub id is left to the loader). Raises ValueError naming ``arg``. Not part of
    :class:`DrafterSpec` itself: a report of an old run names heads that may be gone."""
    for spec in specs:
        for key, value in spec.options:
            name = key.rsplit(".", 1)[-1]
            if name == "heads":
                if not isinstance(value, str) or not os.path.isdir(os.path.expanduser(value)):
                    raise ValueError(f"{arg}: heads={value!r} in {spec.key!r} is not an existing folder (train one "
                                     "with specdec train-eagle / train-medusa --out DIR)")  # fmt: skip
            elif name == DRAFT_OPTION and isinstance(value, str) and _looks_like_path(value):
                if not os.path.exists(os.path.expanduser(value)):
                    raise ValueError(f"{arg}: draft={value!r} in {spec.key!r}: no such file or folder")


def parse_drafter_spec(text: str, arg: str = "--drafters") -> DrafterSpec:
    """A :class:`DrafterSpec` from ``[LABEL=]NAME[:KEY=VALUE[,KEY=VALUE...]]`` (``DRAFTER_SYNTAX``).

    ``NAME`` may itself be ``module:function``: the ``:``-separated parts before the first one that
    holds a ``=`` form the name, the rest the options. Raises ValueError naming ``arg`` on malformed
    text or an unknown drafter name.
    """
    if isinstance(text, DrafterSpec):
        return text
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{arg}: expected a drafter spec NAME[:KEY=VALUE,...], got {text!r}")
    text = text.strip()
    label = None
    m = _LABEL.match(text)
    if m and ":" not in m.group(1):
        label, text = m.group(1), m.group(2)
        if not text:
            raise ValueError(f"{arg}: expected LABEL=NAME[:KEY=VALUE,...], got {label + '='!r}")
    parts = text.split(":")
    first_opt = next((i for i, p in enumerate(parts) if "=" in p), len(parts))
    name = ":".join(parts[:first_opt])
    opts_text = ":".join(parts[first_opt:])
    if not name:
        raise ValueError(f"{arg}: expected NAME[:KEY=VALUE,...] with a drafter name first, got {text!r}")
    options: tuple[tuple[str, Any], ...] = ()
    if opts_text:
        items = _split_top_level(opts_text)
        for item in items:
            key, sep, _ = item.partition("=")
            if not sep or not _KEY.match(key.strip()):
                raise ValueError(f"{arg}: malformed option {item!r} in {text!r}; expected KEY=VALUE with KEY an "
                                 "identifier or PART.KEY")  # fmt: skip
        options = parse_options(items, arg)
    try:
        return DrafterSpec(name, options, label)
    except ValueError as e:
        raise ValueError(str(e).replace("drafters:", f"{arg}:", 1)) from None


def _as_specs(drafters: Any) -> tuple[DrafterSpec, ...]:
    if drafters is None:
        return ()
    if isinstance(drafters, (str, DrafterSpec)):
        drafters = (drafters,)
    return tuple(parse_drafter_spec(d, "drafters") for d in drafters)


@dataclass(frozen=True)
class EvalConfig:
    """Everything one evaluation run depends on.

    Attributes:
        dataset: ``"apps"``, ``"humaneval"``, ``"mbpp"``, ``"specbench"`` or ``"prompts"``
            (``eval.datasets.DATASETS``); MBPP is for tuning (methods, tree sizes) only: report on
            APPS / HumanEval (code) and Spec-Bench (general text). ``"prompts"``: a user's own prompt
            file (``data_path``; ``eval.workloads``). Spec-Bench and prompt files have no tests: speed
            and tau only.
        target: target model (a default name such as ``qwen2.5-coder-1.5b``, a HF id, a local
            directory or a ``.gguf`` file; see ``specdec.models.load_model``).
        draft: draft model, same forms; used by ``hf-assisted`` and handed to the drafter factories
            (unless a drafter names its own with ``draft=``).
        drafters: the drafters of the ``specdec`` method, each run at every tree size: a
            :class:`DrafterSpec` or its text ``[LABEL=]NAME[:KEY=VALUE,...]`` (``DRAFTER_SYNTAX``),
            e.g. ``("lookup", "medusa:heads=DIR", "model:draft=qwen2.5-coder-0.5b")``; strings are
            parsed on construction. ``()``: none (then ``specdec`` cannot run).
        tree_sizes: node budgets of the ``specdec`` method: ints >= 1, or ``"auto"`` (every step's
            budget chosen from measured costs up to ``specdec.budget.DEFAULT_MAX_TREE_SIZE``:
            ``SpecDecoder(tree_size="auto")``; its records carry ``budget_steps`` and ``budget_reason``).
        methods: which methods to run (``eval.methods.METHODS``); ``"hf"`` is added under greedy decoding.
        problems: how many problems (None: all); Spec-Bench: how many questions (their second turns
            come along), the categories' first questions taken in turn.
        difficulty: APPS difficulties to keep (None: all).
        data_path: APPS / HumanEval / MBPP / Spec-Bench file (None: the loaders' defaults), or the
            prompt file of ``"prompts"`` (required there).
        categories: Spec-Bench categories (``eval.datasets.SPECBENCH_CATEGORIES``) or prompt-file
            categories to keep (None: all).
        turns: Spec-Bench: 1 = every question's first turn; 2 = also the second turn of the
            two-turn (MT-bench) questions, asked after the target's own greedy answer to the first
            (``eval.runner``; records ``"<id>/turn2"``).
        max_new_tokens: new tokens per generation (fewer when eos comes first).
        temperature: 0 = greedy; > 0 samples at this temperature (no top-k / top-p).
        samples: completions per (problem, method, drafter, tree size), made in ONE batched call
            (``num_return_sequences=samples``: the engine's and HF ``generate``'s), for pass@k
            (``eval.passk``) and the aggregate tokens/s of a batch. 1: one completion per record
            (the records of single-sample runs). > 1 needs ``temperature`` > 0 (greedy decoding gives
            ``samples`` identical completions); HF assisted generation and prompt lookup
            (``hf-assisted``, ``hf-lookup``) return one sequence per call and are skipped.
        shared_prompt: with ``samples`` > 1, the engine keeps each prompt's KV once for the rows
            (where the target's attention allows; each record says ``shared_prompt``). False: every
            row its own copy (the copy layout), to measure what sharing gains. Needs ``samples`` > 1.
        seed: base seed; every (problem, method, drafter, t) derives its own from it.
        dtype: ``"fp32"``, ``"bf16"``, ``"fp16"`` or ``"auto"`` (bf16 on CUDA, fp32 on CPU).
        device: ``"cuda"``, ``"cpu"``, ... (None: cuda if available).
        out: JSONL file of the results (appended to; resumable).
        pad_prompt_to: prepend few-shot problems until each prompt has at least this many tokens.
        attn_impl: the engine's attention implementation (``"auto"``, ``"triton"``, ``"torch"``).
        compile: the engine's target forward through ``torch.compile`` (``SpecDecoder(compile=True)``,
            static shapes); its compile time falls in the warm-up (reported as first-call latency).
        compile_prefill: the compiled rows' prompt prefill compiled too (``SpecDecoder(compile_prefill=
            True)``; rows without a compile are unchanged).
        warmup: untimed generations per method (and drafter, tree size) before its first timed one;
            engine methods also get ``SpecDecoder.warmup`` (every forward built ahead). Both are
            timed and written as ``"kind": "warmup"`` records (first-call latency). 0: none; then
            each method's first timed call is flagged ``first_call`` and left out of its steady state.
        calibrate: time HF static again on the first n problems in every process that has a drafter's
            rows to run, before them (``"kind": "calibration"`` records): machine lives and processes
            of one kind differ by up to ~10-20 % in speed, and these records let the report compare
            each row with the baseline at its own process's speed (``same_run_speedup``). 0: none.
        gc_freeze: after each warm-up, ``gc.collect()`` then ``gc.freeze()`` (untimed, every method
            alike; undone when the run ends): later full garbage collections skip everything alive by
            then, which in a process holding compiled models took tens of ms each, inside timed calls.
            Each record says how long the call spent in collections (``gc_s``, ``gc_full``).
        progress: tqdm bars.
        home: model store root (None: ``$SPECDEC_HOME``).
        method_problems: ``{method: n}`` as pairs: that method runs on the first n problems only
            (e.g. ``(("hf", 50), ("hf-assisted", 50))`` when device time is short: the slow
            references on a stated subset, every other method on all problems). Default: all.
            With ``shard`` the first n problems are those of the whole (unsharded) problem list.
        shard: ``(rank, world)``: run only shard ``rank`` of ``world`` of the chosen problems
            (``eval.shard.shard``, by position: every ``world``-th problem from the ``rank``-th, after
            ``problems`` / ``difficulty`` pick them) and write to ``eval.shard.shard_path(out, rank,
            world)`` (:attr:`results_path`), skipping what any shard file of the run holds. None or
            world 1: every problem, into ``out``. Not part of the configuration key: the shard files
            of a run merge (``eval.shard.merge``) into what one process writes.
    """

    dataset: str = "apps"
    target: str = "qwen2.5-coder-1.5b"
    draft: str | None = "qwen2.5-coder-0.5b"
    drafters: tuple[DrafterSpec, ...] = field(default=("model",))  # type: ignore[assignment]
    tree_sizes: tuple[int | str, ...] = (64,)
    methods: tuple[str, ...] = DEFAULT_METHODS
    problems: int | None = 8
    difficulty: tuple[str, ...] | None = None
    data_path: str | None = None
    categories: tuple[str, ...] | None = None
    turns: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.0
    samples: int = 1
    shared_prompt: bool = True
    seed: int = 0
    dtype: str = "auto"
    device: str | None = None
    out: str = "results.jsonl"
    pad_prompt_to: int | None = None
    attn_impl: str = "auto"
    compile: bool = False
    compile_prefill: bool = False
    warmup: int = 1
    calibrate: int = 0
    gc_freeze: bool = True
    progress: bool = True
    home: str | None = None
    method_problems: tuple[tuple[str, int], ...] = ()
    shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        check_dataset(self.dataset)
        self._check_workload()
        specs = _as_specs(self.drafters)
        object.__setattr__(self, "drafters", specs)
        keys = [s.key for s in specs]
        dup = sorted({k for k in keys if keys.count(k) > 1})
        if dup:
            raise ValueError(f"drafters: the same drafter given twice: {', '.join(dup)}")
        labels = list(self.labels().values())
        dup = sorted({x for x in labels if labels.count(x) > 1})
        if dup:
            raise ValueError(f"drafters: two drafters labelled {', '.join(map(repr, dup))}; give distinct LABEL=...")
        if not self.tree_sizes or any(t != "auto" and (not isinstance(t, int) or isinstance(t, bool) or t < 1)
                                      for t in self.tree_sizes):  # fmt: skip
            raise ValueError(f"tree_sizes: expected one or more ints >= 1 or 'auto', got {self.tree_sizes!r}")
        if not self.methods:
            raise ValueError("methods: expected at least one method, got none")
        limits = tuple((str(m), n) for m, n in dict(self.method_problems).items())
        for m, n in limits:
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"method_problems: expected METHOD=N with an int N >= 0, got {m}={n!r}")
        object.__setattr__(self, "method_problems", limits)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.samples, int) or isinstance(self.samples, bool) or self.samples < 1:
            raise ValueError(f"samples: expected an int >= 1, got {self.samples!r}")
        if self.samples > 1 and self.temperature == 0:
            raise ValueError(f"samples: {self.samples} samples per problem need temperature > 0 (greedy decoding "
                             "gives identical completions), got temperature 0")  # fmt: skip
        if not isinstance(self.shared_prompt, bool):
            raise ValueError(f"shared_prompt: expected a bool, got {self.shared_prompt!r}")
        if not self.shared_prompt and self.samples == 1:
            raise ValueError("shared_prompt: False (the copy layout) only with samples > 1, got samples 1")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.problems is not None and self.problems < 1:
            raise ValueError(f"problems: expected None or an int >= 1, got {self.problems}")
        if self.pad_prompt_to is not None and self.pad_prompt_to < 1:
            raise ValueError(f"pad_prompt_to: expected None or an int >= 1, got {self.pad_prompt_to}")
        if self.warmup < 0:
            raise ValueError(f"warmup: expected an int >= 0, got {self.warmup}")
        if self.calibrate < 0:
            raise ValueError(f"calibrate: expected an int >= 0, got {self.calibrate}")
        if self.attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {self.attn_impl!r}")
        if self.shard is not None:
            s = self.shard
            ok = isinstance(s, (tuple, list)) and len(s) == 2
            ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in s) and 0 <= s[0] < s[1]
            if not ok:
                raise ValueError(f"shard: expected (rank, world) with ints 0 <= rank < world, got {s!r}")
            object.__setattr__(self, "shard", (s[0], s[1]))
            self.results_path  # noqa: B018 - raises ValueError naming out for a shard file given as out

    def _check_workload(self) -> None:
        """``categories``, ``turns``, ``data_path`` and ``pad_prompt_to`` fit the dataset."""
        chat = self.dataset in CHAT_DATASETS
        if self.categories is not None:
            cats = (self.categories,) if isinstance(self.categories, str) else tuple(self.categories)
            if not chat:
                raise ValueError(f"categories: only Spec-Bench and prompt files have categories, got {cats!r} for "
                                 f"{self.dataset}")  # fmt: skip
            known = SPECBENCH_CATEGORIES if self.dataset == "specbench" else None
            bad = [c for c in cats if not isinstance(c, str) or (known is not None and c not in known)]
            if not cats or bad:
                raise ValueError(f"categories: expected one or more of {', '.join(SPECBENCH_CATEGORIES)}, got "
                                 f"{list(bad) or 'none'}")  # fmt: skip
            object.__setattr__(self, "categories", cats)
        if self.turns not in (1, 2) or isinstance(self.turns, bool):
            raise ValueError(f"turns: expected 1 or 2, got {self.turns!r}")
        if self.turns == 2 and self.dataset != "specbench":
            raise ValueError(f"turns: second turns are Spec-Bench's only, got turns=2 for {self.dataset}")
        if self.dataset == "prompts" and self.data_path is None:
            raise ValueError("data_path: the prompts dataset needs a prompt file (--data FILE)")
        if chat and self.pad_prompt_to is not None:
            raise ValueError(f"pad_prompt_to: few-shot padding is for the code datasets, got {self.dataset}")

    @property
    def sharded(self) -> bool:
        """Whether this run evaluates one shard of several (``shard`` with world > 1)."""
        return self.shard is not None and self.shard[1] > 1

    @property
    def results_path(self) -> str:
        """The file this run writes and resumes from: ``out``, or its shard file when :attr:`sharded`."""
        if not self.sharded:
            return self.out
        from eval.shard import shard_path

        return str(shard_path(self.out, *self.shard))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def labels(self) -> dict[str, str]:
        """Drafter key -> label: the spec's own label, else its name when no other drafter of the
        run has that name, else its whole key."""
        names = [s.name for s in self.drafters]
        return {s.key: s.label or (s.name if names.count(s.name) == 1 else s.key) for s in self.drafters}

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bf16" if self.resolved_device().startswith("cuda") else "fp32"

    def describe(self) -> dict[str, Any]:
        """The settings as JSON-ready values (the summary's ``config``)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["drafters"] = [{"key": s.key, "label": self.labels()[s.key], "name": s.name, "options": dict(s.options)}
                           for s in self.drafters]  # fmt: skip
        return out


def config_key(cfg: EvalConfig) -> str:
    """A short hash of the settings that change what a (problem, method) record means.

    Records in ``out`` with another key are not reused on resume (and are left out of reports of
    this configuration). Problem count, tree sizes, methods, drafters (named by each speculative
    record itself), warmup, calibrate and progress are not part of it: a run may add problems, tree sizes or
    drafters to a file and reuse the baselines already there.
    """
    keyed = {
        "dataset": cfg.dataset, "target": cfg.target, "draft": cfg.draft, "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature, "seed": cfg.seed, "dtype": cfg.resolved_dtype(),
        "device": cfg.resolved_device().split(":")[0], "data_path": cfg.data_path, "pad_prompt_to": cfg.pad_prompt_to,
        "attn_impl": cfg.attn_impl,
    }  # fmt: skip
    if cfg.compile:  # only when set: keys of runs made before the option existed stay valid
        keyed["compile"] = True
    if cfg.compile_prefill:  # likewise
        keyed["compile_prefill"] = True
    if not cfg.gc_freeze:  # only when off: runs with and without it can share no record
        keyed["gc_freeze"] = False
    if cfg.samples != 1:  # likewise: single-sample keys are those of runs made before the option
        keyed["samples"] = cfg.samples
    if not cfg.shared_prompt:  # likewise: only the copy layout changes the key
        keyed["shared_prompt"] = False
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:12]

