"""``run_bench``: the sections in order (the HF static-cache rows last: they compile), their tables
on stdout and the JSON result, rewritten after every section or row."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from specdec.cli.bench import batch, plain, profile, scale, spec, verify
from specdec.cli.bench.common import guarded
from specdec.cli.bench.config import PLAIN_METHODS, TARGET_SECTIONS, BenchConfig
from specdec.cli.bench.setup import device_dtype, load_setup, reference_tokens


def _env(device, dtype) -> dict[str, Any]:
    import platform

    import torch
    import transformers

    info: dict[str, Any] = {
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
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


def _one_result(result: dict[str, Any], key: str, title: str, run: Callable[[], dict[str, Any]],
                table: Callable[[dict[str, Any]], str], log: Callable[[str], None]) -> None:  # fmt: skip
    """``result[key] = run()`` and its table printed under ``title``; on an error, the error instead."""
    try:
        result[key] = run()
        print(f"\n{title}\n" + table(result[key]), flush=True)
    except Exception as e:  # noqa: BLE001 - reported in the JSON, the other sections still run
        log(f"  error: {type(e).__name__}: {e}")
        result[key] = {"error": f"{type(e).__name__}: {e}"}


def run_bench(cfg: BenchConfig, log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the selected sections; return (and write to ``cfg.out``) the result dict."""
    import torch

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    setup = load_setup(cfg, log) if any(s in cfg.sections for s in TARGET_SECTIONS) else None
    device, dtype = (setup.device, setup.dtype) if setup is not None else device_dtype(cfg)
    result: dict[str, Any] = {
        "config": {**asdict(cfg), "tree_sizes": list(cfg.tree_sizes)},
        "env": _env(device, dtype),
    }
    if setup is not None:
        result["capacity"] = setup.capacity
        result["prompts"] = [{"id": i, "length": len(p)} for i, p in zip(setup.problem_ids, setup.prompts)]
    batch_ref: dict[str, Any] = {"name": None, "tokens": {}}
    with torch.no_grad():
        if "plain" in cfg.sections:
            log(f"(a) plain decoding, {len(setup.prompts)} prompts x {cfg.max_new_tokens} new tokens")
            rows: list[dict[str, Any]] = []
            for method in PLAIN_METHODS:
                if method in cfg.plain_methods and method != "hf-static":  # hf-static last: it compiles
                    guarded(rows, {"method": method}, lambda: plain.run_plain_method(setup, method, log), log)
            result["plain"] = rows
            setup.plain_ms.update({r["method"]: r["ms_per_token"] for r in rows if "error" not in r})
            _write(cfg.out, result)
            print("\n(a) plain decoding\n" + plain.format_plain(rows), flush=True)
        if "verify" in cfg.sections:
            log(f"(b) verify forward, tree sizes {sorted(set(cfg.tree_sizes) | {1})}")
            _one_result(result, "verify", "(b) one verify forward (inputs + forward)",
                        lambda: verify.run_verify(setup, log), verify.format_verify, log)  # fmt: skip
            _write(cfg.out, result)
        if "spec" in cfg.sections:
            log(f"(c) speculative decoding, t = {cfg.spec_tree_size}")
            rows = []
            for name in cfg.drafters:
                for mode in cfg.spec_modes:
                    guarded(rows, {"drafter": name, "mode": mode}, lambda: spec.run_spec(setup, name, mode, log), log)
                    _write(cfg.out, {**result, "spec": rows})
            result["spec"] = rows
            print("\n(c) speculative decoding per step\n" + spec.format_spec(rows), flush=True)
        if "batch" in cfg.sections:
            sizes = batch.batch_tree_sizes(cfg)
            log(f"(d) batch throughput, B = {list(cfg.batch_sizes)}, t = {list(sizes)}")
            ref_name, ref = reference_tokens(setup)
            if ref is not None:
                batch_ref = {"name": ref_name, "tokens": dict(enumerate(ref))}
            rows = result["batch"] = []
            if "medusa" in cfg.batch_drafters:
                batch.load_medusa(setup)
            # specdec-plain (t = 0) once per batch size, then each drafter at every other budget
            cells = [(batch.PLAIN, b, 0) for b in cfg.batch_sizes if 0 in sizes]
            cells += [(name, b, t) for name in cfg.batch_drafters for b in cfg.batch_sizes for t in sizes if t != 0]
            for name, size, t in cells:
                guarded(rows, {"method": name, "batch": size, "tree_size": t},
                        lambda: batch.run_batch(setup, name, size, batch_ref, log, tree_size=t), log)  # fmt: skip
                _write(cfg.out, result)
            result["batch_summary"] = batch.batch_summary(rows)
            _write(cfg.out, result)
            print("\n(d) batch throughput" + (" (HF static cache rows at the end)" if not cfg.batch_skip_hf else "")
                  + "\n" + batch.format_batch(rows), flush=True)  # fmt: skip
            if result["batch_summary"]:
                print("\n" + batch.format_batch_summary(result["batch_summary"]), flush=True)
        if "profile" in cfg.sections:
            log(f"(e) kernel profile of a verify forward, t = {cfg.profile_tree_size}, modes {list(cfg.profile_modes)}")
            _one_result(result, "profile", "(e) kernel profile of one verify forward",
                        lambda: profile.run_profile(setup, log), profile.format_profile, log)  # fmt: skip
            _write(cfg.out, result)
        if "plain" in cfg.sections and "hf-static" in cfg.plain_methods:
            log("(a) hf-static (compiles on CUDA)")
            guarded(result["plain"], {"method": "hf-static"},
                    lambda: plain.run_plain_method(setup, "hf-static", log), log)  # fmt: skip
            _write(cfg.out, result)
            print("\n(a) plain decoding, with hf-static\n" + plain.format_plain(result["plain"]), flush=True)
        if "batch" in cfg.sections and not cfg.batch_skip_hf:
            log("(d) hf-static batches (compiles on CUDA, per batch size)")
            for size in cfg.batch_sizes:
                guarded(result["batch"], {"method": "hf-static", "batch": size},
                        lambda: batch.run_batch(setup, "hf-static", size, batch_ref, log), log)  # fmt: skip
                _write(cfg.out, result)
            print("\n(d) batch throughput, with hf-static\n" + batch.format_batch(result["batch"]), flush=True)
        if "scale" in cfg.sections:
            log("(f) the engine at scale (random weights)")

            def save(partial: dict[str, Any]) -> None:
                result["scale"] = partial
                _write(cfg.out, result)

            try:
                result["scale"] = scale.run_scale(cfg, log, save)
                print("\n(f) the engine at scale\n" + scale.format_scale(result["scale"]), flush=True)
            except Exception as e:  # noqa: BLE001
                if type(e).__name__ == "OutOfMemoryError" and "scale" not in result:
                    raise  # building the model did not fit: the user's problem, one line
                log(f"  error: {type(e).__name__}: {e}")
                result["scale"] = {**result.get("scale", {}), "error": f"{type(e).__name__}: {e}"}
    _write(cfg.out, result)
    return result
