"""``specdec bench-stalls``: does any ``generate`` call stall after warm-up, and how fast does a process start?

Two modes, one JSON (``--out``) each:

``full`` (default)  Load the target, build ``SpecDecoder`` (``--drafter``, ``--tree-size``,
                    ``--compile``), call ``SpecDecoder.warmup`` for every KV bucket the APPS
                    prompts will need (its per-bucket compile / capture seconds are recorded), then
                    run ``generate`` on ``--problems`` APPS chat prompts (greedy, ``--max-new-tokens``)
                    and time every call. With ``--hf-static`` the target's own
                    ``generate(cache_implementation="static")`` runs on the same prompts after its
                    own warm-up call, timed the same way.
``first-token``     What a second process pays before it can stream: load the target, warm up
                    only the one KV bucket its first request uses (``SpecDecoder.warmup`` with
                    ``min_len = max_len`` = the first prompt + 1 token: the bucket holding prompt +
                    1 + tree_size, exactly the one ``generate`` picks), generate one token of the
                    first prompt. Times are given from the process's start
                    (``/proc/self/stat``), with the load (model, tokenizer) and the warm-up (trace /
                    compile-cache load, capture warm-up forwards, recording, prefill forward) apart,
                    so run it twice (the first run fills torch.compile's on-disk cache -- and writes
                    the bf16 copy of the weights, ``specdec.models.ensure_dtype_copy`` -- the second
                    reads both).

Stall accounting per method: a call's *steady-state time* is its new tokens x the median
per-token time of all calls of that method; its ratio is wall / steady-state time (the stall bar:
no call over 2x after warm-up). Also the slowest single engine step against the median
step. Each method's first timed call is reported apart (``first_call_s``) and also counted.

    python3 -m specdec.cli bench-stalls --device cuda --dtype bf16 --compile --problems 50 --hf-static \\
        --data .evaldata/apps_selected150.jsonl --out $OUT/stalls.json
    python3 -m specdec.cli bench-stalls --mode first-token --device cuda --dtype bf16 --compile --out $OUT/ttft.json
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specdec.cli import args as cliargs
from specdec.dtypes import DTYPE_NAMES, parse_dtype

STALL_RATIO = 2.0


def stall_summary(calls: Sequence[dict[str, Any]], ratio: float = STALL_RATIO) -> dict[str, Any]:
    """Steady state and stalls of one method's timed calls.

    Args:
        calls: dicts with ``wall_s`` and ``new_tokens`` (>= 1), in call order; optionally
            ``max_step_s`` (the call's slowest step) and ``median_step_s``.
        ratio: a call whose wall time is over ``ratio`` x its steady-state time is a stall.

    Returns:
        ``median_ms_per_token``, ``tokens_per_s`` (all tokens / all wall time), per call
        ``ratio`` (wall / (new tokens x median per-token time)), the worst ratio and its call,
        ``stalls`` (indices over ``ratio``), the slowest call, the slowest step and its multiple of
        the median step (when steps are given).
    """
    if not calls:
        raise ValueError("calls: expected at least one timed call, got none")
    per_token = [c["wall_s"] / max(c["new_tokens"], 1) for c in calls]
    med = statistics.median(per_token)
    ratios = [c["wall_s"] / (max(c["new_tokens"], 1) * med) for c in calls]
    worst = max(range(len(calls)), key=lambda i: ratios[i])
    out: dict[str, Any] = {
        "num_calls": len(calls),
        "median_ms_per_token": 1e3 * med,
        "tokens_per_s": sum(c["new_tokens"] for c in calls) / sum(c["wall_s"] for c in calls),
        "ratios": ratios,
        "worst_ratio": ratios[worst],
        "worst_call": worst,
        "stalls": [i for i, r in enumerate(ratios) if r > ratio],
        "slowest_call_s": max(c["wall_s"] for c in calls),
    }
    steps = [c for c in calls if c.get("max_step_s") is not None]
    if steps:
        med_step = statistics.median(c["median_step_s"] for c in steps)
        slow = max(c["max_step_s"] for c in steps)
        out.update(slowest_step_ms=1e3 * slow, median_step_ms=1e3 * med_step, slowest_step_ratio=slow / med_step)
    return out


def _step_times(out) -> tuple[float | None, float | None]:
    times = [s.draft_s + s.verify_s + s.commit_s for s in out.steps]
    return (max(times), statistics.median(times)) if times else (None, None)


def _load(ns, log: Callable[[str], None], times: dict[str, float] | None = None):
    import torch

    from specdec import models

    dtype = parse_dtype(ns.dtype, ns.device, "--dtype")
    t0 = time.perf_counter()
    # the parts of a load apart (the first token's breakdown): the device's context, then the model's code,
    # which transformers imports lazily inside from_pretrained (with a default model's one-time fetch and
    # conversion, if it has none yet), then the weights
    if torch.device(ns.device).type == "cuda":
        torch.empty(0, device=ns.device)
        torch.cuda.synchronize(ns.device)
    device_init_s = time.perf_counter() - t0
    path = Path(models.resolve_model(ns.target, progress=not ns.no_progress))
    if path.is_dir():
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(path))]  # imports the class's module
    code_s = time.perf_counter() - t0 - device_init_s
    copy = None
    if ns.target in models.DEFAULT_MODELS and dtype in (torch.bfloat16, torch.float16):
        copy = models.dtype_copy_path(ns.target, dtype)
        log(f"loading {ns.target} ({'its' if copy.is_file() else 'writing its'} {copy.name}) ...")
    else:
        log(f"loading {ns.target} ...")
    target = models.load_model(ns.target, dtype=dtype, device=ns.device, progress=not ns.no_progress)
    model_s = time.perf_counter() - t0
    tok = models.load_tokenizer(ns.target, progress=False)
    load_s = time.perf_counter() - t0
    weights_s = model_s - device_init_s - code_s
    log(f"loaded {ns.target} in {load_s:.1f} s (model {model_s:.1f} s: device context {device_init_s:.1f}, model "
        f"code {code_s:.1f}, weights {weights_s:.1f}; tokenizer {load_s - model_s:.1f} s)")
    if times is not None:
        times.update(model_s=model_s, device_init_s=device_init_s, model_code_s=code_s, weights_s=weights_s,
                     tokenizer_s=load_s - model_s)
    return target, tok, load_s


def _prompts(ns, tok, limit: int | None = None) -> list[list[int]]:
    from eval.datasets import load_apps, prompt_ids

    rows = load_apps(ns.data, limit=ns.problems if limit is None else limit, unique=True)
    return [prompt_ids(p, tok) for p in rows]


def _decoder(ns, target, tok):
    from drafters import make_drafter
    from specdec import SpecDecoder

    drafter = None
    if ns.drafter != "none":
        extra = {"target": target, "heads": ns.medusa_heads} if ns.drafter == "medusa" else {}
        drafter = make_drafter(ns.drafter, tree_size=ns.tree_size, **extra)
    return SpecDecoder(target, drafter, ns.tree_size if drafter is not None else 0, compile=ns.compile,
                       prefill_width=ns.prefill_width)


def run_full(ns, log: Callable[[str], None]) -> dict[str, Any]:
    import torch

    target, tok, load_s = _load(ns, log)
    prompts = _prompts(ns, tok)
    from specdec import hf

    eos = hf.eos_token_ids(target, tok)
    dec = _decoder(ns, target, tok)
    longest = max(len(p) for p in prompts)
    t0 = time.perf_counter()
    report = dec.warmup(batch_sizes=(1,), max_len=longest + ns.max_new_tokens, log=log)
    warm_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "mode": "full", "load_s": load_s, "warmup_s": warm_s, "problems": len(prompts),
        "prompt_tokens": {"min": min(map(len, prompts)), "max": longest},
        "warmup": [dataclasses.asdict(e) for e in report.entries],
        "compile_cache": report.compile_cache, "methods": {},
    }  # fmt: skip
    calls = []
    for i, ids in enumerate(prompts):
        t = time.perf_counter()
        out = dec.generate(torch.tensor(ids), ns.max_new_tokens, eos_token_id=eos)
        wall = time.perf_counter() - t
        mx, md = _step_times(out)
        calls.append({"problem": i, "prompt_tokens": len(ids), "new_tokens": out.num_new_tokens, "wall_s": wall,
                      "steps": len(out.steps), "max_step_s": mx, "median_step_s": md, "prefill_s": out.prefill_s})
        log(f"specdec {i + 1}/{len(prompts)}: {len(ids)} prompt tokens, {out.num_new_tokens} new, {wall:.3f} s")
    result["methods"]["specdec"] = {"first_call_s": calls[0]["wall_s"], "calls": calls, **stall_summary(calls)}
    if ns.hf_static:
        calls = []
        kwargs = dict(do_sample=False, max_new_tokens=ns.max_new_tokens, cache_implementation="static",
                      eos_token_id=eos, pad_token_id=eos[0] if eos else 0)  # fmt: skip
        first = torch.tensor([prompts[0]], device=dec.device)
        t = time.perf_counter()
        for _ in range(2):  # compile, then replay
            target.generate(first, attention_mask=torch.ones_like(first), **kwargs)
        hf_warm = time.perf_counter() - t
        for i, ids in enumerate(prompts):
            x = torch.tensor([ids], device=dec.device)
            dec._sync()
            t = time.perf_counter()
            y = target.generate(x, attention_mask=torch.ones_like(x), **kwargs)
            dec._sync()
            wall = time.perf_counter() - t
            calls.append({"problem": i, "prompt_tokens": len(ids), "new_tokens": int(y.shape[1] - x.shape[1]),
                          "wall_s": wall})
            log(f"hf-static {i + 1}/{len(prompts)}: {len(ids)} prompt tokens, {wall:.3f} s")
        result["methods"]["hf-static"] = {"warmup_s": hf_warm, "first_call_s": calls[0]["wall_s"], "calls": calls,
                                          **stall_summary(calls)}
    return result


def run_first_token(ns, log: Callable[[str], None]) -> dict[str, Any]:
    import torch

    from specdec.timing import since_process_start

    at_start = since_process_start()
    log(f"imports done {at_start:.1f} s after process start")
    times: dict[str, float] = {}
    target, tok, load_s = _load(ns, log, times)
    ids = _prompts(ns, tok, limit=1)[0]
    dec = _decoder(ns, target, tok)
    need = len(ids) + 1  # prompt + max_new_tokens of the call below
    t0 = time.perf_counter()
    # only the bucket this request uses (the one holding need + tree_size): what generate would build itself,
    # timed per part; a later request that needs another bucket builds it then (see SpecDecoder.warmup)
    report = dec.warmup(batch_sizes=(1,), max_len=need, min_len=need, log=log)
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dec.generate(torch.tensor(ids), 1)
    gen_s = time.perf_counter() - t0
    return {
        "mode": "first-token", "imports_s": at_start, "load_s": load_s, **times, "warmup_s": warm_s,
        "generate_s": gen_s, "first_token_since_start_s": since_process_start(), "compile": ns.compile,
        "prompt_tokens": len(ids), "buckets": [e.capacity for e in report.entries],
        "warmup": [dataclasses.asdict(e) for e in report.entries], "compile_cache": report.compile_cache,
        "forwards_built": len(dec.forwards) + len(dec.prefill_forwards),
    }  # fmt: skip


def build_parser():
    p = cliargs.ArgumentParser(prog="specdec bench-stalls", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=["full", "first-token"], default="full")
    p.add_argument("--target", default="qwen2.5-coder-1.5b", help="default model name, HF id or local dir")
    p.add_argument("--drafter", choices=["lookup", "medusa", "none"], default="lookup")
    p.add_argument("--medusa-heads", type=cliargs.existing_path, default=None, help="heads dir for --drafter medusa")
    p.add_argument("--tree-size", type=cliargs.int_at_least(1), default=64)
    p.add_argument("--compile", nargs="?", const=True, default=False, choices=["layers", "inductor"],
                   help="SpecDecoder(compile=True): each decoder layer through one forward compiled for all of "
                        "them; '--compile inductor': the whole forward compiled as one (a longer compile)")
    p.add_argument("--prefill-width", type=cliargs.int_at_least(0), default=256,
                   help="SpecDecoder(prefill_width=): prompt chunk of the graphed prefill (0: the eager prefill)")
    p.add_argument("--hf-static", action="store_true", help="also time HF generate(cache_implementation='static')")
    p.add_argument("--data", type=cliargs.existing_path, default=None, help="APPS file (default: the shared subset)")
    p.add_argument("--problems", type=cliargs.int_at_least(1), default=50)
    p.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=128)
    p.add_argument("--device", type=cliargs.device, default="cuda")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=cliargs.output_file, default=None, help="write the result as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if ns.drafter == "medusa" and ns.medusa_heads is None:
        raise ValueError("--medusa-heads: expected a heads directory for --drafter medusa, got none")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    res = run_full(ns, log) if ns.mode == "full" else run_first_token(ns, log)
    text = json.dumps(res, indent=1, default=str)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
    for name, m in res.get("methods", {}).items():
        print(f"{name:10} {m['tokens_per_s']:8.1f} tok/s  median {m['median_ms_per_token']:.2f} ms/token  "
              f"worst call {m['worst_ratio']:.2f}x  stalls(>{STALL_RATIO}x) {len(m['stalls'])}  "
              f"first call {m['first_call_s']:.2f} s")  # fmt: skip
    if res["mode"] == "first-token":
        print(f"first token {res['first_token_since_start_s']:.1f} s after process start "
              f"(imports {res['imports_s']:.1f}, load {res['load_s']:.1f}, warm-up {res['warmup_s']:.1f} for "
              f"bucket(s) {res['buckets']}, generate {res['generate_s']:.2f})")
    return 0
