"""Where a speculative step's time goes, on the device machine: per-phase step times and a
``torch.profiler`` trace of whole ``generate`` calls (host ranges and device kernels together).

For each configuration (``--configs``, each ``LABEL=DRAFTER_SPEC``, the drafter spec as for
``specdec sweep --drafters``; ``compile=true`` compiles the target's tree forward): build the engine,
warm it up, decode ``--problems`` prompts (HumanEval or APPS chat prompts, bf16, greedy) and print
the per-step medians / means of the engine's phases (draft, verify, forward, commit), tau and tokens/s, and
the slowest steps. Then ``--trace`` more prompts run under ``torch.profiler``; the Chrome trace is
written gzipped to ``OUT/trace-LABEL.json.gz`` (phases are ``specdec.<phase>`` ranges). A JSON
summary of every configuration goes to ``OUT/step_trace.json``. The run of 2026-11-24 (records `10205a0`; H100, 12 HumanEval
problems): specdec/PERF.md v7.

    PYTHONPATH=. python3 scripts/device/step_trace.py --out $OUT --problems 12 --trace 1 \\
        --configs e=eagle:heads=/tmp/eagle,draft_vocab=32768 le=lookup+eagle:heads=/tmp/eagle,draft_vocab=32768

``--fused-catch-up N`` sets ``drafters.eagle.FUSED_CATCH_UP`` for every configuration (what the
merged drafter's slow first steps were traced with). Needs the staged and converted target
(``scripts/device/setup_models.sh``) and, for EAGLE, a trained head.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


def _prompts(dataset: str, data: str | None, count: int, tokenizer) -> list[list[int]]:
    from eval.datasets import load_problems, prompt_ids

    problems = load_problems(dataset, data)
    seen, out = set(), []
    for p in problems:
        ids = prompt_ids(p, tokenizer)
        if tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        out.append(ids)
        if len(out) == count:
            break
    return out


def _stats(values: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(values), "mean_ms": 1e3 * statistics.fmean(values),
            "max_ms": 1e3 * max(values)}  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _decode(decoder, prompts, new: int, eos) -> tuple[list, float, int]:
    steps, wall, tokens = [], 0.0, 0
    for ids in prompts:
        _sync()
        t0 = time.perf_counter()
        out = decoder.generate(torch.tensor(ids), new, eos_token_id=eos)
        _sync()
        wall += time.perf_counter() - t0
        tokens += len(out.new_tokens(0))
        steps.append([(s.draft_s, s.verify_s, s.forward_s, s.commit_s, s.tokens_emitted[0]) for s in out.steps])
    return steps, wall, tokens


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", required=True, metavar="LABEL=SPEC")
    p.add_argument("--tree-size", type=int, default=64)
    p.add_argument("--dataset", choices=["humaneval", "apps", "mbpp"], default="humaneval",
                   help="whose prompts (mbpp: for tuning; report on apps / humaneval)")
    p.add_argument("--data", default=None)
    p.add_argument("--problems", type=int, default=12)
    p.add_argument("--trace", type=int, default=1, help="prompts decoded under the profiler after the timed ones")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--fused-catch-up", type=int, default=None)
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--out", required=True)
    ns = p.parse_args(argv)

    import drafters.eagle
    from eval.config import parse_drafter_spec
    from eval.methods import build_drafter
    from specdec import SpecDecoder, hf
    from specdec.models import load_model, load_tokenizer

    if ns.fused_catch_up is not None:
        drafters.eagle.FUSED_CATCH_UP = ns.fused_catch_up
    out_dir = Path(ns.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device(ns.device)
    dtype = torch.bfloat16 if ns.dtype == "bf16" else torch.float32
    target = load_model(ns.target, dtype=dtype, device=dev, progress=False)
    tokenizer = load_tokenizer(ns.target, progress=False)
    hf.prepare_model(target, "target")
    eos = [tokenizer.eos_token_id] + ([tokenizer.convert_tokens_to_ids("<|im_end|>")] if "<|im_end|>" in tokenizer.get_vocab() else [])
    prompts = _prompts(ns.dataset, ns.data, ns.problems + ns.trace, tokenizer)
    timed, traced = prompts[: ns.problems], prompts[ns.problems :]
    max_len = max(len(x) for x in prompts) + ns.max_new_tokens
    summary = {"args": vars(ns), "configs": {}}
    drafts: dict = {}  # draft models by name (``draft=`` in a spec)
    for item in ns.configs:
        label, _, text = item.partition("=")
        spec = parse_drafter_spec(text)
        opts = spec.drafter_options()  # compile too, as the sweep
        if spec.draft is not None and spec.draft not in drafts:  # a draft model, loaded once
            drafts[spec.draft] = load_model(spec.draft, dtype=dtype, device=dev, progress=False)
        drafter = build_drafter(spec.name, target=target, draft=drafts.get(spec.draft), tokenizer=tokenizer,
                                tree_size=ns.tree_size, device=dev, dtype=dtype, **opts)  # fmt: skip
        t0 = time.perf_counter()
        decoder = SpecDecoder(target, drafter, ns.tree_size, max_cache_len=max_len + ns.tree_size,
                              compile=bool(spec.compile))  # fmt: skip
        decoder.warmup(batch_sizes=(1,), max_len=max_len, log=None)
        _decode(decoder, prompts[:1], min(16, ns.max_new_tokens), eos)  # the drafter's own first captures
        warm_s = time.perf_counter() - t0
        steps, wall, tokens = _decode(decoder, timed, ns.max_new_tokens, eos)
        flat = [s for call in steps for s in call]
        later = [s for call in steps for s in call[1:]]
        row = {
            "spec": text, "warm_s": warm_s, "steps": len(flat), "tokens": tokens, "tokens_per_s": tokens / wall,
            "tau": statistics.fmean(s[4] for s in flat),
            **{f"{name}": _stats([s[i] for s in flat]) for i, name in enumerate(("draft", "verify", "forward", "commit"))},
            "first_step_draft_ms": [round(1e3 * call[0][0], 2) for call in steps if call],
            "later_draft": _stats([s[0] for s in later]) if later else None,
            "step_total": _stats([s[0] + s[1] + s[3] for s in flat]),
        }  # fmt: skip
        print(f"== {label}: {json.dumps(row)}", flush=True)
        if traced:
            from torch.profiler import ProfilerActivity, profile

            kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with profile(activities=kinds) as prof:
                tsteps, twall, ttokens = _decode(decoder, traced, ns.max_new_tokens, eos)
            raw = out_dir / f"trace-{label}.json"
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(str(raw) + ".gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(raw)
            row["traced"] = {"tokens": ttokens, "wall_s": twall,
                             "steps": [[round(1e3 * x, 3) for x in s[:4]] + [s[4]] for call in tsteps for s in call]}  # fmt: skip
        summary["configs"][label] = row
        del decoder, drafter
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        (out_dir / "step_trace.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
