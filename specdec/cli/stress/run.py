"""One stress run: engines built on first use and reused, every call run and checked, the loop."""

from __future__ import annotations

import random
import statistics
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.cli.stress.checks import _cut_at_eos, _eos_set, _Reference, check_output, check_row, is_fatal_cuda_error
from specdec.cli.stress.config import PAD, CallPlan, StressConfig, make_prompt, plan_calls
from specdec.cli.stress.models import StressModels, load_models
from specdec.cli.stress.summary import StressResult, _config_dict, _write_json, format_summary, summarize

__all__ = ["run_stress"]


@dataclass
class _EngineStats:
    """What one engine key did over the run (kept when the engine is dropped and rebuilt)."""

    key: str
    builds: int = 0
    build_s: float = 0.0
    calls: int = 0
    errors: int = 0
    first_call_s: float | None = None
    first_call_tokens: int = 0
    new_shape_calls: int = 0
    new_shape_s: float = 0.0
    steady_s: list[float] = field(default_factory=list)
    steady_tokens: list[int] = field(default_factory=list)
    batch_sizes: set[int] = field(default_factory=set)

    def summary(self) -> dict[str, Any]:
        s, n = sum(self.steady_s), sum(self.steady_tokens)
        median = statistics.median(self.steady_s) if self.steady_s else None
        return {
            "engine": self.key, "builds": self.builds, "build_s": round(self.build_s, 4), "calls": self.calls,
            "errors": self.errors, "first_call_s": _r(self.first_call_s), "first_call_tokens": self.first_call_tokens,
            "new_shape_calls": self.new_shape_calls, "new_shape_s": round(self.new_shape_s, 4),
            "steady_calls": len(self.steady_s), "steady_median_s": _r(median),
            "steady_tokens_per_s": round(n / s, 2) if s > 0 else None, "batch_sizes": sorted(self.batch_sizes),
        }  # fmt: skip


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)


class _Engines:
    """Engines built on first use per key and reused; at most ``cfg.max_engines`` alive (the least
    recently used dropped first). Statistics per key outlive drops."""

    def __init__(self, models: StressModels, cfg: StressConfig) -> None:
        self.models, self.cfg = models, cfg
        self.live: OrderedDict[str, Any] = OrderedDict()
        self.stats: dict[str, _EngineStats] = {}
        #: per live engine: (batch size of its last call, the most cache slots a call needed since then)
        self.shape: dict[str, tuple[int, int]] = {}
        self.dropped = 0

    def get(self, plan: CallPlan) -> tuple[Any, bool]:
        """(the decoder for ``plan``, whether it was built now)."""
        key = plan.engine_key
        st = self.stats.setdefault(key, _EngineStats(key))
        if key in self.live:
            self.live.move_to_end(key)
            return self.live[key], False
        while len(self.live) >= self.cfg.max_engines:
            self.drop(next(iter(self.live)))
        t0 = time.perf_counter()
        dec = self._build(plan)
        st.builds += 1
        st.build_s += time.perf_counter() - t0
        self.live[key] = dec
        return dec, True

    def drop(self, key: str) -> None:
        """Forget an engine (its cache, graphs, drafter state); on CUDA hand the memory back."""
        import gc

        import torch

        if self.live.pop(key, None) is None:
            return
        self.shape.pop(key, None)
        self.dropped += 1
        gc.collect()
        if self.models.device.type == "cuda":
            torch.cuda.empty_cache()

    def _build(self, plan: CallPlan):
        from drafters import make_drafter
        from specdec import SpecDecoder

        m, cfg = self.models, self.cfg
        cuda = m.device.type == "cuda"
        static = True if (plan.graphs or plan.compile) else None
        graphs = bool(plan.graphs and cuda)
        comp = cfg.compile_backend if plan.compile else False
        if comp == "inductor":
            comp = True
        drafter = None
        if plan.drafter == "model":
            drafter = make_drafter("model", draft_model=m.draft, static_shapes=static, cuda_graphs=graphs, compile=comp)
        elif plan.drafter == "medusa":
            drafter = make_drafter("medusa", target=m.target, heads=m.heads)
        elif plan.drafter == "lookup":
            drafter = make_drafter("lookup")
        return SpecDecoder(m.target, drafter, tree_size=plan.tree_size, static_shapes=static, cuda_graphs=graphs,
                           compile=comp, attn_impl=cfg.attn_impl)  # fmt: skip


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Run:
    """State of one stress run: models, engines, reference, records."""

    def __init__(self, cfg: StressConfig, models: StressModels, log: Callable[[str], None]) -> None:
        from specdec import hf

        self.cfg, self.models, self.log = cfg, models, log
        self.device = models.device
        self.vocab = models.vocab_size
        self.limit = hf.max_positions(models.target)
        if self.limit is not None and cfg.prompt_lens[1] + 1 > self.limit:
            raise ValueError(f"prompt_lens: the longest prompt ({cfg.prompt_lens[1]}) leaves no room in the target's "
                             f"context of {self.limit} positions")  # fmt: skip
        if "model" in cfg.drafters and models.draft is None:
            raise ValueError("draft: the 'model' drafter needs a draft model, got None")
        if "medusa" in cfg.drafters and models.heads is None:
            raise ValueError("heads: the 'medusa' drafter needs Medusa heads, got None")
        self.engines = _Engines(models, cfg)
        self.reference = _Reference(models.target, cfg.attn_impl, cfg.reference) if cfg.exact else None
        self.records: list[dict[str, Any]] = []
        self.recent: list[int] = []  # recently generated tokens (eos candidates)
        self.hf_shapes: set[tuple[str, int]] = set()
        self.hf_cache_len = cfg.prompt_lens[1] + cfg.new_tokens[1]
        gc = getattr(models.target, "generation_config", None)
        self.model_eos = getattr(gc, "eos_token_id", None)

    # -------------------------------------------------------------- one call

    def run_call(self, plan: CallPlan) -> dict[str, Any]:
        """Run one planned call and check it; the record (never raises for the call's own failures)."""
        import torch

        prompts = [make_prompt(s, self.vocab) for s in plan.prompts]
        longest = max(len(p) for p in prompts)
        max_new = plan.max_new_tokens if self.limit is None else min(plan.max_new_tokens, self.limit - longest)
        rec: dict[str, Any] = {
            "call": plan.index, "kind": plan.kind, "drafter": plan.drafter, "tree_size": plan.tree_size,
            "mode": plan.mode, "batch": plan.batch, "prompt_lens": [len(p) for p in prompts], "max_new_tokens": max_new,
            "do_sample": plan.do_sample, "eos": None, "status": "ok", "problems": [],
        }  # fmt: skip
        if plan.do_sample:
            rec.update(temperature=plan.temperature, top_k=plan.top_k, top_p=plan.top_p)
        t_all = time.perf_counter()
        stage = "reference"  # where an exception came from: the reference decoder, the call, the checks
        try:
            eos = rec["eos"] = self._pick_eos(plan, prompts, max_new)
            stage = "call"
            if plan.kind == "spec":
                rows, eos_used = self._spec(plan, prompts, max_new, eos, rec), eos
            else:
                rows, eos_used = self._hf(plan, prompts, max_new, eos, rec)
            stage = "check"
            flat = [t for r in rows for t in r]
            self.recent = (self.recent + flat[-64:])[-256:]
            self._compare(plan, prompts, rows, eos_used, max_new, rec)
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            rec["status"] = "error"
            rec["stage"] = stage
            rec["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
            rec["traceback"] = traceback.format_exc(limit=-6)[-3000:]
            rec["fatal"] = is_fatal_cuda_error(e)
            if plan.kind == "spec" and stage == "call":
                self.engines.stats[plan.engine_key].errors += 1
                if not rec["fatal"]:
                    self.engines.drop(plan.engine_key)  # rebuilt on next use: one bug, one record
            if not rec["fatal"] and self.device.type == "cuda":
                try:
                    torch.cuda.synchronize(self.device)
                except Exception as e2:  # noqa: BLE001 - the context is gone
                    rec["fatal"] = True
                    rec["error"] += f" (then synchronize: {type(e2).__name__}: {' '.join(str(e2).split())[:200]})"
        if rec["problems"] and rec["status"] == "ok":
            rec["status"] = "mismatch"
        rec["total_s"] = round(time.perf_counter() - t_all, 4)
        return rec

    def _pick_eos(self, plan: CallPlan, prompts, max_new: int) -> int | list[int] | None:
        """None, or an eos id (sometimes two) this call will likely generate, so that rows end early
        and at different steps: greedy fp32, a token of one row's reference continuation; else a
        token recently generated."""
        if not plan.eos:
            return None
        crng = random.Random(plan.seed)
        if self.reference is not None and not plan.do_sample:
            pool = self.reference.continuation(prompts[crng.randrange(len(prompts))], max_new)
        else:
            pool = self.recent or [crng.randrange(self.vocab)]
        return crng.choice(pool) if crng.random() < 0.7 else [crng.choice(pool), crng.randrange(self.vocab)]

    def _spec(self, plan: CallPlan, prompts, max_new: int, eos, rec: dict[str, Any]) -> list[list[int]]:
        import torch

        dec, built = self.engines.get(plan)
        st = self.engines.stats[plan.engine_key]
        # A new batch size or a longer request than served since: the engine (with CUDA graphs) takes
        # a new cache and captures again -- not steady state.
        need = max(len(p) for p in prompts) + max_new + plan.tree_size
        last = self.engines.shape.get(plan.engine_key)
        shape_new = last is None or last[0] != plan.batch or need > last[1]
        self.engines.shape[plan.engine_key] = (plan.batch, need if shape_new else last[1])
        gen = torch.Generator().manual_seed(plan.seed)
        _sync(self.device)
        t0 = time.perf_counter()
        out = dec.generate(list(prompts), max_new, do_sample=plan.do_sample, temperature=plan.temperature,
                           top_k=plan.top_k, top_p=plan.top_p, eos_token_id=eos, generator=gen,
                           pad_token_id=PAD)  # fmt: skip
        _sync(self.device)
        wall = time.perf_counter() - t0
        st.batch_sizes.add(plan.batch)
        new = out.num_new_tokens
        if st.first_call_s is None:
            st.first_call_s, st.first_call_tokens = wall, new
        st.calls += 1
        if shape_new:
            st.new_shape_calls += 1
            st.new_shape_s += wall
        else:
            st.steady_s.append(wall)
            st.steady_tokens.append(new)
        step_s = [s.draft_s + s.verify_s + s.commit_s for s in out.steps]
        slow = max(range(len(step_s)), key=step_s.__getitem__) if step_s else None
        rec.update(engine_new=built, new_shape=shape_new, wall_s=round(wall, 4), new_tokens=new, steps=len(out.steps),
                   mean_accepted=round(out.mean_accepted, 3), prefill_s=round(out.prefill_s, 4))  # fmt: skip
        if slow is not None:
            s = out.steps[slow]
            rec["slowest_step"] = {"step": slow, "s": round(step_s[slow], 5), "draft_s": round(s.draft_s, 5),
                                   "verify_s": round(s.verify_s, 5), "commit_s": round(s.commit_s, 5)}  # fmt: skip
        for b, probs in enumerate(check_output(out, prompts, max_new, eos, self.vocab, plan.tree_size)):
            rec["problems"] += [f"row {b}: {p}" for p in probs]
        return [out.new_tokens(b).tolist() for b in range(plan.batch)]

    def _hf(self, plan: CallPlan, prompts, max_new: int, eos, rec: dict[str, Any]):
        import torch

        eos_used = eos if eos is not None else self.model_eos
        width = max(len(p) for p in prompts)
        ids = torch.full((plan.batch, width), PAD, dtype=torch.int64)
        mask = torch.zeros(plan.batch, width, dtype=torch.int64)
        for b, p in enumerate(prompts):  # left padding, as HF expects for batched generate
            ids[b, width - len(p):] = p
            mask[b, width - len(p):] = 1
        kwargs: dict[str, Any] = dict(attention_mask=mask.to(self.device), max_new_tokens=max_new, do_sample=False,
                                      pad_token_id=PAD, eos_token_id=eos_used)  # fmt: skip
        if plan.kind == "hf-static":
            kwargs.update(cache_implementation="static", max_cache_len=self.hf_cache_len)
        shape_new = (plan.kind, plan.batch) not in self.hf_shapes
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.models.target.generate(ids.to(self.device), **kwargs)
        _sync(self.device)
        wall = time.perf_counter() - t0
        self.hf_shapes.add((plan.kind, plan.batch))
        eos_set = _eos_set(eos_used)
        rows = []
        for b in range(plan.batch):
            new = _cut_at_eos(out[b, width:].tolist(), eos_set)
            rec["problems"] += [f"row {b}: {p}" for p in check_row(new, max_new, eos_set, self.vocab)]
            rows.append(new)
        rec.update(new_shape=shape_new, wall_s=round(wall, 4), new_tokens=sum(len(r) for r in rows), eos_used=eos_used)
        return rows, eos_used

    def _compare(self, plan: CallPlan, prompts, rows: list[list[int]], eos, max_new: int, rec: dict[str, Any]) -> None:
        """Greedy fp32 rows against the reference; near ties told apart by a plain forward."""
        if self.reference is None or plan.do_sample or (plan.kind != "spec" and not self.cfg.check_hf):
            rec["rows_compared"] = 0
            return
        eos_set = _eos_set(eos)
        compared = 0
        for b, (p, got) in enumerate(zip(prompts, rows)):
            want = _cut_at_eos(self.reference.continuation(p, max_new), eos_set)
            compared += 1
            if got == want:
                continue
            j = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
            info: dict[str, Any] = {"call": plan.index, "row": b, "kind": plan.kind, "mode": plan.mode,
                                    "drafter": plan.drafter, "prompt_len": len(p), "position": j,
                                    "got": got[j : j + 4], "want": want[j : j + 4]}  # fmt: skip
            if j < len(got) and j < len(want):
                info.update(self._gap(p, want[:j], got[j], want[j]))
            rec.setdefault("mismatches", []).append(info)
            tie = info.get("near_tie", False)
            rec["problems"].append(f"row {b}: differs from the prompt decoded alone at new token {j}"
                                   + (f" (near tie: logit gap {info['logit_gap']:.2e})" if tie else ""))  # fmt: skip
        rec["rows_compared"] = compared
        if rec.get("mismatches") and all(m.get("near_tie") for m in rec["mismatches"]):
            rec["near_tie"] = True

    def _gap(self, prompt, prefix: list[int], got: int, want: int) -> dict[str, Any]:
        """The target's logits (one plain forward of ``prompt + prefix``) of the two tokens."""
        import torch

        ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.int64)])[None].to(self.device)
        with torch.no_grad():
            logits = self.models.target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        gap = float(logits[want] - logits[got])
        return {"logit_gap": gap, "near_tie": abs(gap) <= self.cfg.tie_tol,
                "argmax": int(logits.argmax())}  # fmt: skip

    # -------------------------------------------------------------- the loop

    def result(self, planned: int, elapsed: float, stopped: str | None) -> StressResult:
        summary = summarize(self.records, planned, elapsed, stopped)
        summary["engines_dropped"] = self.engines.dropped
        summary["models"] = self.models.description
        summary["device"] = str(self.device)
        if self.reference is not None:
            summary["reference"] = {"decodes": self.reference.decodes, "seconds": round(self.reference.seconds, 3),
                                    "prompts": len(self.reference.known)}  # fmt: skip
        engines = [s.summary() for s in self.engines.stats.values()]
        return StressResult(summary["ok"], summary, engines, self.records, _config_dict(self.cfg))


def run_stress(cfg: StressConfig, log: Callable[[str], None] = print, *, models: StressModels | None = None
               ) -> StressResult:  # fmt: skip
    """Run the stress plan of ``cfg``; return (and write to ``cfg.out``) the result.

    Args:
        cfg: the run's settings.
        log: receives crash / mismatch lines as they happen and the summary table at the end.
        models: models to use instead of loading ``cfg``'s (tests build tiny ones once); they must
            be on ``cfg.device`` in ``cfg.dtype``.

    Stops early (``summary["stopped"]``) when ``cfg.budget_s`` would be exceeded by the next call
    (estimated by the median time of the calls so far), on a CUDA error that poisons the context
    (``"cuda-error"``; also ``summary["aborted"]``) or on KeyboardInterrupt (``"interrupted"``).
    """
    import torch

    start = time.perf_counter()
    if not isinstance(cfg, StressConfig):
        raise ValueError(f"cfg: expected a StressConfig, got {type(cfg).__name__}")
    if models is None:
        models = load_models(cfg)
    elif not isinstance(models, StressModels):
        raise ValueError(f"models: expected a StressModels or None, got {type(models).__name__}")
    from tqdm.auto import tqdm
    from transformers.utils import logging as hf_logging

    run = _Run(cfg, models, log)
    plans = plan_calls(cfg)
    bar = tqdm(total=len(plans), desc="stress", unit="call", disable=not cfg.progress, file=sys.stderr)
    stopped = None
    durations: list[float] = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # HF's per-call notes (generation flags, caches) would drown the report
    try:
        for plan in plans:
            elapsed = time.perf_counter() - start
            estimate = statistics.median(durations) if durations else 0.0
            if cfg.budget_s is not None and elapsed + estimate > cfg.budget_s:
                stopped = "budget"
                log(f"stress: budget of {cfg.budget_s:g} s reached after {len(run.records)} calls ({elapsed:.1f} s)")
                break
            with torch.no_grad():
                rec = run.run_call(plan)
            run.records.append(rec)
            durations.append(rec["total_s"])
            if rec["status"] == "error":
                log(f"stress: CRASH in call {plan.index} ({plan.kind} {plan.drafter or ''} {plan.mode} batch "
                    f"{plan.batch}): {rec['error'][:300]}")  # fmt: skip
            elif rec["status"] == "mismatch":
                log(f"stress: {'near tie' if rec.get('near_tie') else 'MISMATCH'} in call {plan.index} ({plan.kind} "
                    f"{plan.drafter or ''} {plan.mode} batch {plan.batch}): {'; '.join(rec['problems'][:3])}")  # fmt: skip
            counts = {s: sum(r["status"] == s for r in run.records) for s in ("mismatch", "error")}
            bar.set_postfix(mism=counts["mismatch"], err=counts["error"], refresh=False)
            bar.update(1)
            if cfg.out:
                _write_json(cfg.out, run.result(len(plans), time.perf_counter() - start, None))
            if rec.get("fatal"):
                stopped = "cuda-error"
                log("stress: the CUDA context is lost; stopping")
                break
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        bar.close()
        hf_logging.set_verbosity(verbosity)
    result = run.result(len(plans), time.perf_counter() - start, stopped)
    if cfg.out:
        _write_json(cfg.out, result)
    log(format_summary(result))
    return result
