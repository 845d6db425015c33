"""``specdec bench-engine``: the engine's own speed on a real target, eager vs CUDA graphs, vs HF.

Three sections (``--sections``), each printed as a table and written to ``--out`` (JSON, rewritten
after every section so that a run cut off by a time limit keeps what it measured):

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

On CPU the "graph" rows run the same fixed-buffer code without a capture (``captured: false``).
Timing: CUDA events with a synchronize on CUDA, ``time.perf_counter`` on CPU.

Commands for the H100 (issue 3) are in docs/DEVICE_RUNS.md, "Issue 3 -- engine benchmark":

    python3 -m specdec.cli bench-engine --dtype bf16 --device cuda --problems 4 --max-new-tokens 128 \\
        --data .evaldata/apps_selected150.jsonl --out $OUT/engine.json > $OUT/engine.log 2>&1
"""

from __future__ import annotations

import argparse
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

SECTIONS = ("plain", "verify", "spec")
PLAIN_METHODS = ("hf", "hf-static", "engine-eager", "engine-graph", "engine-compiled")
DRAFTERS = ("model", "lookup")
SPEC_MODES = ("eager", "graph", "compiled")  # compiled: the graphed forwards compiled by inductor first
_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
DEFAULT_TARGET, DEFAULT_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


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
    sections: tuple[str, ...] = SECTIONS
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

    def __post_init__(self) -> None:
        for name, vals, allowed in (("sections", self.sections, SECTIONS),
                                    ("plain_methods", self.plain_methods, PLAIN_METHODS),
                                    ("drafters", self.drafters, DRAFTERS),
                                    ("spec_modes", self.spec_modes, SPEC_MODES)):  # fmt: skip
            bad = [v for v in vals if v not in allowed]
            if bad:
                raise ValueError(f"{name}: expected some of {allowed}, got {bad}")
        for name in ("problems", "max_new_tokens", "reps"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if not self.tree_sizes or any(not isinstance(n, int) or n < 1 for n in self.tree_sizes):
            raise ValueError(f"tree_sizes: expected node counts >= 1, got {list(self.tree_sizes)}")
        if not isinstance(self.spec_tree_size, int) or self.spec_tree_size < 1:
            raise ValueError(f"spec_tree_size: expected an int >= 1, got {self.spec_tree_size!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype: expected one of {tuple(_DTYPES)}, got {self.dtype!r}")
        if self.attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {self.attn_impl!r}")


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


def _setup(cfg: BenchConfig, log: Callable[[str], None]) -> _Setup:
    import torch

    from eval.datasets import load_apps, prompt_ids
    from specdec import hf, models

    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, _DTYPES[cfg.dtype or ("bf16" if device.type == "cuda" else "fp32")])
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


def _time_forward(setup: _Setup, graphed, tree, prefix: int) -> tuple[list[float], Any]:
    """Seconds of ``cfg.reps`` timed ``graphed.run`` calls after two untimed ones (the first captures);
    and a float copy of the logits."""
    for _ in range(2):
        graphed.run([tree], [prefix])
    times = [setup.timer(lambda: graphed.run([tree], [prefix]))[0] for _ in range(setup.cfg.reps)]
    return times, graphed.logits.float().clone()


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
# tables


def _fmt(val, spec: str) -> str:
    if val is None or (isinstance(val, float) and math.isnan(val)):
        return "-"
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


# ----------------------------------------------------------------------------------------------
# driver


def _env(setup: _Setup) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    info: dict[str, Any] = {
        "device": str(setup.device),
        "dtype": str(setup.dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else None,
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
    setup = _setup(cfg, log)
    result: dict[str, Any] = {
        "config": {**asdict(cfg), "tree_sizes": list(cfg.tree_sizes)},
        "env": _env(setup),
        "capacity": setup.capacity,
        "prompts": [{"id": i, "length": len(p)} for i, p in zip(setup.problem_ids, setup.prompts)],
    }
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
        if "plain" in cfg.sections and "hf-static" in cfg.plain_methods:
            log("(a) hf-static (compiles on CUDA)")
            _guarded(result["plain"], {"method": "hf-static"}, lambda: run_plain_method(setup, "hf-static", log), log)
            print("\n(a) plain decoding, with hf-static\n" + format_plain(result["plain"]), flush=True)
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
        "decoding (draft model, prompt lookup). Tables on stdout, JSON with --out.",
    )
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"default model name, HF id, local dir or .gguf (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for the 'model' drafter (default {DEFAULT_DRAFT})")
    p.add_argument("--data", type=cliargs.existing_path, default=None, help="APPS .json/.jsonl file (default: $SPECDEC_APPS or the shared 150-row file)")
    p.add_argument("--problems", type=cliargs.int_at_least(1), default=4, help="APPS problems (first unique ones in file order; default 4)")
    p.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=128)
    p.add_argument("--tree-sizes", type=cliargs.int_at_least(1), nargs="+", default=[1, 16, 32, 64, 128, 256],
                   help="(b) nodes per verify forward, root included (default 1 16 32 64 128 256; 1 is always measured)")
    p.add_argument("--spec-tree-size", type=cliargs.int_at_least(0), default=64, help="(c) draft nodes per step besides the root (default 64)")
    p.add_argument("--sections", type=_csv(str, SECTIONS), default=SECTIONS, help="comma list (default plain,verify,spec)")
    p.add_argument("--plain-methods", type=_csv(str, PLAIN_METHODS), default=PLAIN_METHODS,
                   help="(a) comma list (default hf,hf-static,engine-eager,engine-graph,engine-compiled)")
    p.add_argument("--drafters", type=_csv(str, DRAFTERS), default=DRAFTERS, help="(c) comma list (default model,lookup)")
    p.add_argument("--spec-modes", type=_csv(str, SPEC_MODES), default=("eager", "graph"),
                   help="(c) comma list of eager, graph, compiled (default eager,graph)")
    p.add_argument("--reps", type=cliargs.int_at_least(1), default=20, help="(b) timed forwards per tree size and mode (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", type=cliargs.device, default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--attn-impl", choices=["auto", "triton", "torch"], default="auto",
                   help="tree attention implementation (auto: Triton on CUDA)")
    p.add_argument("--no-progress", action="store_true", help="no model fetch/convert progress bars")
    p.add_argument("--out", type=cliargs.output_file, default=None, help="write the results as JSON here (rewritten after every section)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    cfg = BenchConfig(
        target=ns.target, draft=ns.draft, data=ns.data, problems=ns.problems, max_new_tokens=ns.max_new_tokens,
        tree_sizes=tuple(ns.tree_sizes), spec_tree_size=ns.spec_tree_size, sections=tuple(ns.sections),
        plain_methods=tuple(ns.plain_methods), drafters=tuple(ns.drafters), spec_modes=tuple(ns.spec_modes),
        reps=ns.reps, seed=ns.seed,
        device=ns.device, dtype=ns.dtype, attn_impl=ns.attn_impl, progress=not ns.no_progress, out=ns.out,
    )  # fmt: skip
    run_bench(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
