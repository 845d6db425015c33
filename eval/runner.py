"""The evaluation loop: every problem through every method, drafter and tree size; resumable.

For every problem the runner builds one prompt (``eval.prompts``) and generates with every requested
method (``eval.methods``) on that same prompt, with the same settings: the baselines once per
problem, ``specdec-plain`` once, ``specdec`` once per (drafter, tree size). Each generation becomes
one JSON line in ``cfg.out`` as soon as it finishes (``eval.records``). A rerun with the same
settings skips what ``out`` already holds -- also after an interruption, and also when it adds
drafters, tree sizes or problems: only the missing (problem, method, drafter, t) run. Under greedy
decoding every method's tokens are compared with the ``hf`` reference of the same problem: in
float32 any difference is a failure (flagged in the record and on stderr, ``failed``); in bf16/fp16,
where n-token and 1-token forwards round differently, the agreement and first divergence are kept.

With ``cfg.samples`` = n > 1 (sampling only) each record holds n completions of its prompt made by
one batched call (``num_return_sequences=n``): ``num_samples``, ``sample_token_ids``,
``sample_texts``, ``sample_new_tokens`` in place of ``token_ids`` / ``text``; ``new_tokens`` is
their total, ``wall_s`` the call's, so ``tokens_per_s`` is the batch's aggregate rate. Engine records
add ``shared_prompt``: whether the call kept the prompt's KV once for its n sequences (the shared
layout, ``eval.methods.Session.decoder``) rather than a copy per sequence. Methods that
cannot batch samples (``Method.multi_sample``: ``hf-assisted``, ``hf-lookup``) are skipped.
``eval.passk`` checks every sample (pass@k).

Before a method's (drafter's, tree size's) first timed call in a process, it is warmed up: engine
methods build their drafter and decoder and run ``SpecDecoder.warmup`` (declared warm-up: every
fixed-shape forward compiled / captured for the run's longest request), then every method makes
``cfg.warmup`` short untimed generations (``hf-static`` one more: compile, then replay). All of it
is timed and written as a ``"kind": "warmup"`` record (first-call latency, ``eval.latency``).

With ``cfg.shard = (rank, world)`` (world > 1) the run keeps only its shard of the chosen problems
(``eval.shard``, by position: every world-th problem from the rank-th) and writes
``cfg.results_path`` (the shard's file); it skips what any shard file of the run holds (a changed
problem list can move a problem to another shard than the one that ran it), so that each record is
made once, in one file. ``method_problems`` limits and each record's ``problem_index`` count in the
whole problem list, so the shards' records together are the records of one unsharded run.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from eval.config import REFERENCE, WARMUP_TOKENS, DrafterSpec, EvalConfig, config_key
from eval.methods import METHODS, Method, MethodOutput, Session, _torch_dtype
from eval.prompts import load_eval_problems, pad_problems
from eval.records import (
    CALIBRATION,
    CONTEXT,
    WARMUP,
    EvalResult,
    compare_tokens,
    finalize,
    is_context,
    is_timed,
    load_records,
    record_key,
    seed_for,
    write_record,
)

__all__ = ["run_eval", "work_items"]

#: Drafters that never use the run's draft model (so a run of only these does not load it).
_NO_DRAFT_MODEL = ("lookup", "medusa", "eagle")


def work_items(problems: Sequence[Any], methods: Sequence[Method], drafters: Sequence[DrafterSpec],
               tree_sizes: Sequence[int | str], method_problems: Mapping[str, int] | None = None,
               indices: Sequence[int] | None = None,
               ) -> list[tuple[int, Any, Method, DrafterSpec | None, int | None]]:  # fmt: skip
    """(problem index, problem, method, drafter, tree size) in run order: per problem, each method
    in turn; a method with a drafter once per drafter and (if it uses trees) per tree size; a
    method named in ``method_problems`` only on that many first problems.

    ``indices``: each problem's place in the whole problem list (a shard's problems are a subset),
    which ``method_problems`` limits count in; default ``0, 1, ...``. The returned index is the
    problem's place in ``problems``."""
    limits = dict(method_problems or {})
    places = list(range(len(problems))) if indices is None else list(indices)
    if len(places) != len(problems):
        raise ValueError(f"indices: expected one per problem ({len(problems)}), got {len(places)}")
    items = []
    for p_index, problem in enumerate(problems):
        for m in methods:
            if places[p_index] >= limits.get(m.name, float("inf")):
                continue
            for spec in drafters if m.needs_drafter else (None,):
                for t in tree_sizes if m.uses_tree else (None,):
                    items.append((p_index, problem, m, spec, t))
    return items


def _tqdm(**kw):
    from tqdm.auto import tqdm

    return tqdm(**kw)


def _say(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg, file=sys.stderr)


def _select_methods(cfg: EvalConfig, extra: Mapping[str, Method] | None, have_draft: bool) -> list[Method]:
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
        if cfg.samples > 1 and not m.multi_sample:
            _say(f"note: skipping {n!r}: it makes one sequence per call, not {cfg.samples} samples at once (--samples)")
            continue
        if m.needs_drafter and not cfg.drafters:
            raise ValueError(f"drafters: method {n!r} needs at least one drafter (--drafters NAME[:KEY=VALUE,...])")
        chosen.append(m)
    return chosen


def _model_shape(model: Any) -> dict[str, Any]:
    cfg = model.config.get_text_config()
    heads = int(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return {"num_heads": heads, "num_kv_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
            "head_dim": int(head_dim), "num_layers": int(cfg.num_hidden_layers)}  # fmt: skip


def _drafter_fields(cfg: EvalConfig, spec: DrafterSpec | None) -> dict[str, Any]:
    if spec is None:
        return {}
    return {"drafter": spec.key, "drafter_label": cfg.labels()[spec.key], "drafter_name": spec.name,
            "drafter_options": dict(spec.options)}  # fmt: skip


def _result_fields(res: MethodOutput, tokenizer: Any) -> dict[str, Any]:
    n = res.new_tokens
    fields: dict[str, Any] = {"new_tokens": n, "wall_s": res.wall_s,
                              "tokens_per_s": n / res.wall_s if res.wall_s > 0 else None}  # fmt: skip
    if res.samples is None:
        fields.update(token_ids=list(res.token_ids), text=tokenizer.decode(res.token_ids, skip_special_tokens=False))
    else:
        fields.update(num_samples=len(res.samples), sample_new_tokens=[len(s) for s in res.samples],
                      sample_token_ids=[list(s) for s in res.samples],
                      sample_texts=[tokenizer.decode(s, skip_special_tokens=False) for s in res.samples])  # fmt: skip
    fields["error"] = None
    if res.steps is not None:
        steps = res.steps
        num = len(steps["emitted"])
        seqs = sum(steps["active"]) if "active" in steps else num  # (step, decoding sequence) pairs
        fields.update(num_steps=num, tau=sum(steps["emitted"]) / seqs if seqs else None,
                      mean_accepted=sum(steps["accepted"]) / seqs if seqs else None, steps=steps)  # fmt: skip
    if res.tree_samples is not None:
        fields["tree_samples"] = res.tree_samples
    if res.prefill_s is not None:
        fields["prefill_s"] = res.prefill_s
    if res.shared_prompt is not None:
        fields["shared_prompt"] = res.shared_prompt
    if res.budget is not None:
        fields["budget_steps"], fields["budget_reason"] = res.budget
    if res.emit_t is not None and res.emit_n is not None:
        fields.update(emit_t=list(res.emit_t), emit_n=list(res.emit_n))
    return fields


def _item_key(common: Mapping[str, Any], problem: Any, method: Method, spec: DrafterSpec | None, t: int | None,
              cfg: EvalConfig) -> tuple:  # fmt: skip
    """The ``record_key`` of a work item's record (what a resumed run skips)."""
    return record_key({**common, "problem_id": str(problem.id), "method": method.name, "tree_size": t,
                       **_drafter_fields(cfg, spec)})  # fmt: skip


def _check_fields(checker: Callable[[Any, str], Any], problem: Any, rec: Mapping[str, Any]) -> dict[str, Any]:
    """The checker's verdict on a record's completion (``passed``, ``check_status``), or on each of its
    samples (``sample_passed``, ``sample_status``, ``num_correct``)."""
    if "sample_texts" not in rec:
        verdict = checker(problem, rec["text"])
        fields = {"passed": getattr(verdict, "passed", verdict)}
        if hasattr(verdict, "status"):
            fields["check_status"] = verdict.status
        return fields
    verdicts = [checker(problem, text) for text in rec["sample_texts"]]
    passed = [bool(getattr(v, "passed", v)) for v in verdicts]
    fields = {"sample_passed": passed, "num_correct": sum(passed)}
    if all(hasattr(v, "status") for v in verdicts):
        fields["sample_status"] = [v.status for v in verdicts]
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


class _GcClock:
    """Seconds the interpreter spent in garbage collection, and its full (generation-2) collections,
    while the clock is entered (``gc.callbacks``): a pause inside a timed call is part of its wall
    time, and a long-lived process with many objects (a compiled model, captured graphs, earlier
    records) pays tens of milliseconds per full collection."""

    def __init__(self) -> None:
        self.seconds, self.full, self._start = 0.0, 0, None

    def _callback(self, phase: str, info: Mapping[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.full += info.get("generation") == 2
            self._start = None

    def __enter__(self) -> "_GcClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def _freeze_gc(cfg: EvalConfig) -> None:
    """After a warm-up (untimed, every method alike): collect, then move every object alive now to
    the permanent generation (``gc.freeze``), so later full collections skip the models, compiled
    graphs and records made so far. ``run_eval`` unfreezes at its end (unless its caller had frozen
    objects before)."""
    if cfg.gc_freeze:
        gc.collect()
        gc.freeze()


def _warm_up(session: Session, method: Method, prompt, tree_size: int | None) -> dict[str, Any]:
    """Build and warm up one method (drafter, tree size): the declared engine warm-up, then
    ``cfg.warmup`` short generations (``hf-static``: one more); every part timed. Errors are kept
    in the returned fields (the timed call reports them in its own record)."""
    cfg = session.cfg
    fields: dict[str, Any] = {"load_s": None, "prep_s": None, "warmup_walls": [], "warmup_tokens": [], "error": None}
    runs = cfg.warmup + (cfg.warmup > 0 and method.name == "hf-static")  # compile, then replay
    session.seed = seed_for(cfg.seed, "warmup", method.name, tree_size)
    session.max_new_tokens = min(WARMUP_TOKENS, cfg.max_new_tokens)
    try:
        fields["load_s"], fields["prep_s"] = session.prepare(method, tree_size, warm=cfg.warmup > 0)
        for _ in range(runs):
            res = method.run(session, prompt, tree_size)
            fields["warmup_walls"].append(res.wall_s)
            fields["warmup_tokens"].append(res.new_tokens)
    except Exception as e:  # the timed call reports the error in its record
        fields["error"] = f"{type(e).__name__}: {e}"
    finally:
        session.max_new_tokens = cfg.max_new_tokens
    if fields["warmup_walls"]:
        fields.update(wall_s=fields["warmup_walls"][0], new_tokens=fields["warmup_tokens"][0])
    return fields


#: The baseline a calibration times again in each process (``EvalConfig.calibrate``).
CALIBRATION_METHOD = "hf-static"


def _calibrate(session: Session, problems: Sequence[Any], prompts: Sequence[Sequence[int]], common: Mapping[str, Any],
               sink: Any, result: EvalResult) -> None:  # fmt: skip
    """Time ``CALIBRATION_METHOD`` on the first ``cfg.calibrate`` problems (after its warm-up) and write
    each call as a ``"kind": "calibration"`` record of this process (``common["run_id"]``)."""
    import torch

    method = METHODS[CALIBRATION_METHOD]
    session.drafter = None
    n = min(session.cfg.calibrate, len(problems))
    first = torch.tensor([prompts[0]], dtype=torch.int64, device=session.device)
    warm = _warm_up(session, method, first, None)
    _freeze_gc(session.cfg)
    if warm["error"]:
        _say(f"note: calibration skipped: {CALIBRATION_METHOD} failed to warm up ({warm['error']})")
        return
    for problem, ids in zip(problems[:n], prompts[:n]):
        pid = str(problem.id)
        session.seed = seed_for(session.cfg.seed, pid, method.name, None)
        try:
            res = method.run(session, torch.tensor([ids], dtype=torch.int64, device=session.device), None)
        except Exception as e:  # a failing calibration must not lose the run: its rows just get no same-process ratio
            _say(f"note: calibration stopped at problem {pid}: {type(e).__name__}: {e}")
            return
        rec = dict(common, kind=CALIBRATION, problem_id=pid, method=method.name, tree_size=None, prompt_len=len(ids),
                   new_tokens=res.new_tokens, wall_s=res.wall_s)  # fmt: skip
        write_record(sink, rec)
        result.warmups.append(rec)


def _answer_earlier_turns(session: Session, problems: Sequence[Any], side: Sequence[Mapping[str, Any]],
                          out_path: Path, common: Mapping[str, Any]) -> list[Any]:  # fmt: skip
    """The problems whose prompt follows the target's own answer to an earlier turn (Spec-Bench's
    second turns, ``ChatProblem.context``) with that answer filled in: the target's greedy answer
    (``Session.answer``, at most ``max_new_tokens``, untimed), written once per earlier turn as a
    ``"kind": "context"`` side record and reused from ``side`` (this configuration's side records;
    a shard's include those of the run's other shard files) on resume, so every method and every
    rerun sees the same second-turn prompt."""
    import torch

    from eval.datasets import prompt_ids

    known = {str(r["problem_id"]): str(r["text"]) for r in side if is_context(r)}
    pending = [p for p in problems if getattr(p, "needs_answer", False)]
    todo = list(dict.fromkeys(p.context.id for p in pending if p.context.id not in known))
    contexts = {p.context.id: p.context for p in pending}
    bar = _tqdm(total=len(todo), desc="answers to earlier turns", unit="answer",
                disable=not session.cfg.progress or not todo, file=sys.stderr)  # fmt: skip
    try:
        with open(out_path, "a", encoding="utf-8") as sink:
            for cid in todo:
                ids = prompt_ids(contexts[cid], session.tokenizer)
                tokens = session.answer(torch.tensor([ids], dtype=torch.int64, device=session.device))
                text = session.tokenizer.decode(tokens, skip_special_tokens=True)
                write_record(sink, dict(common, kind=CONTEXT, problem_id=cid, prompt_len=len(ids), token_ids=tokens,
                                        text=text))  # fmt: skip
                known[cid] = text
                bar.update(1)
    finally:
        bar.close()
    return [p.with_answer(known[p.context.id]) if getattr(p, "needs_answer", False) else p for p in problems]


def run_eval(
    cfg: EvalConfig,
    *,
    models: tuple[Any, Any, Any] | None = None,
    drafter_factory: Callable[..., Any] | None = None,
    extra_methods: Mapping[str, Method] | None = None,
    problems: Sequence[Any] | None = None,
    checker: Callable[[Any, str], bool | None] | None = None,
) -> EvalResult:
    """Run (or resume) an evaluation; one JSON line per (problem, method, drafter, t) in ``cfg.out``.

    Args:
        cfg: the settings.
        models: ``(target, tokenizer, draft)`` already loaded (default: loaded from ``cfg``).
        drafter_factory: ``factory(spec, target=, draft=, tokenizer=, tree_size=, device=, dtype=,
            **options)`` (default: ``eval.methods.build_drafter`` with ``spec.name``).
        extra_methods: more methods by name (selectable in ``cfg.methods``).
        problems: the problems (default: loaded from ``cfg``; padding still applies).
        checker: ``checker(problem, text)`` run on every new generation after its timing (the
            pass@1 hook, e.g. ``eval.execution.check``): a bool or a verdict with ``passed`` (and
            ``status``), kept as the record's ``passed`` (``check_status``); with several samples
            run on each, kept as ``sample_passed`` (``sample_status``) and ``num_correct``;
            ``eval.report`` turns them into ``pass_at_1`` (and ``pass_at_10``) per row. None: not
            checked.

    Returns:
        ``EvalResult``; ``failed`` is True when a method raised, or when greedy float32 outputs
        differ from the reference.
    """
    import torch

    from eval.datasets import prompt_ids
    from specdec.models import load_model, load_tokenizer
    from specdec.timing import since_process_start

    device = cfg.resolved_device()
    dtype_name = cfg.resolved_dtype()
    key = config_key(cfg)
    out_path = Path(cfg.results_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    previous = [r for r in load_records(out_path, repair=True) if r.get("config_key") == key]
    prev_warmups = [r for r in previous if not is_timed(r)]
    previous = [r for r in previous if is_timed(r)]
    done = {record_key(r): r for r in previous if not r.get("error")}
    contexts = [r for r in prev_warmups if is_context(r)]
    if cfg.sharded:
        # What the run's other shard files hold is done too (a changed problem list can move a problem
        # to another shard than the one that ran it) but stays in those files: this shard writes only
        # what it runs (an error there is redone here, and eval.shard.merge prefers the redo), and an
        # error of its own that another shard has redone no longer counts in its result. Read once,
        # now, without repair: their ranks may be appending (an incomplete last line is dropped, the
        # file left as it is).
        from eval.shard import shard_paths

        others = [r for path in shard_paths(cfg.out, cfg.shard[1]) if path != out_path
                  for r in load_records(path) if r.get("config_key") == key]  # fmt: skip
        elsewhere = {record_key(r): r for r in others if is_timed(r) and not r.get("error")}
        previous = [r for r in previous if not (r.get("error") and record_key(r) in elsewhere)]
        done = {**elsewhere, **done}
        contexts += [r for r in others if is_context(r)]

    if problems is None:
        problems, pool = load_eval_problems(cfg)
    else:
        problems, pool = list(problems), list(problems)
    indices = list(range(len(problems)))  # places in the whole list (method_problems, problem_index)
    every = problems  # the caches are sized for all of them, so that a shard decodes as the whole run does
    if cfg.sharded:
        from eval.shard import shard

        rank, world = cfg.shard
        total = len(problems)
        indices = shard(range(total), rank, world)
        problems = [problems[i] for i in indices]
        _say(f"shard {rank}/{world}: {len(problems)} of {total} problem(s) -> {out_path}")
        if not problems:
            return finalize(EvalResult(records=list(previous), warmups=list(prev_warmups)))

    table = {**METHODS, **(extra_methods or {})}
    wanted = [table[m] for m in cfg.methods if m in table]
    if models is None:
        dtype = _torch_dtype(dtype_name)
        target = load_model(cfg.target, dtype=dtype, device=device, home=cfg.home, progress=cfg.progress)
        tokenizer = load_tokenizer(cfg.target, home=cfg.home, progress=cfg.progress)
        draft = None
        uses_draft = any(m.needs_draft for m in wanted) or (
            any(m.needs_drafter for m in wanted)
            and any(s.draft is None and s.name not in _NO_DRAFT_MODEL for s in cfg.drafters)
        )
        if cfg.draft and uses_draft:
            draft = load_model(cfg.draft, dtype=dtype, device=device, home=cfg.home, progress=cfg.progress)
    else:
        target, tokenizer, draft = models
    loaded_s = since_process_start()

    methods = _select_methods(cfg, extra_methods, draft is not None)
    if cfg.pad_prompt_to:
        problems = pad_problems(problems, pool, tokenizer, cfg.pad_prompt_to)
    session = Session(cfg, target, tokenizer, draft, drafter_factory)  # cache sizes set once the prompts are known
    run_id = f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # one per run_eval call
    common = {
        "config_key": key, "run_id": run_id, "dataset": cfg.dataset, "target": cfg.target, "draft": cfg.draft,
        "dtype": dtype_name, "device": device, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
        "seed": cfg.seed, "pad_prompt_to": cfg.pad_prompt_to, "attn_impl": cfg.attn_impl, "compile": cfg.compile,
    }  # fmt: skip
    if any(getattr(p, "needs_answer", False) for p in problems):
        problems = _answer_earlier_turns(session, problems, contexts, out_path, common)
    prompts = [prompt_ids(p, tokenizer) for p in problems]
    # Cache sizes from every problem of the run, the other shards' too: a static cache's capacity sets
    # the attention's split of the KV, so in bf16 a shard sized for its own prompts alone rounded
    # differently from the unsharded run and changed some greedy tokens. Prompts that include an
    # earlier answer (Spec-Bench's second turns) or padding are known for this shard's problems only.
    lengths = [len(p) for p in prompts]
    if cfg.sharded and not cfg.pad_prompt_to:
        mine = {str(p.id) for p in problems}
        lengths += [len(prompt_ids(p, tokenizer)) for p in every
                    if str(p.id) not in mine and not getattr(p, "needs_answer", False)]  # fmt: skip
    session.max_cache_len = max(lengths) + cfg.max_new_tokens
    session.min_len = min(lengths) + cfg.max_new_tokens
    if any(m.needs_drafter for m in methods):
        session.load_heads()  # a bad heads= directory fails here, before the first problem
    strict = cfg.greedy and dtype_name == "fp32"
    result = EvalResult(records=list(previous), warmups=list(prev_warmups), strict=strict,
                        model_shape=_model_shape(target))  # fmt: skip
    items = work_items(problems, methods, cfg.drafters, cfg.tree_sizes, dict(cfg.method_problems), indices)
    warmed: dict[tuple[str, str | None, int | None], dict[str, Any]] = {}
    references: dict[str, dict[str, Any] | None] = {}
    bar = _tqdm(total=len(items), desc=f"{cfg.dataset} generations", unit="call", disable=not cfg.progress,
                file=sys.stderr)  # fmt: skip
    was_frozen = gc.get_freeze_count() > 0
    first_s = None  # when this process started its first generation (a shard's timeline)
    try:
        with open(out_path, "a", encoding="utf-8") as sink:
            keys = [_item_key(common, p, m, s, t, cfg) for _, p, m, s, t in items]
            todo = {item[2].name: item[2] for item, k in zip(items, keys) if k not in done}  # methods left to run
            # a process that runs the baseline itself needs no calibration: its own records are the baseline
            if (cfg.calibrate and any(m.needs_drafter for m in todo.values())
                    and CALIBRATION_METHOD not in todo):  # fmt: skip
                bar.set_postfix_str(f"calibrating: {CALIBRATION_METHOD} on {cfg.calibrate} problem(s)")
                _calibrate(session, problems, prompts, common, sink, result)
            for (p_index, problem, method, spec, t), rkey in zip(items, keys):
                pid = str(problem.id)
                dfields = _drafter_fields(cfg, spec)
                if pid not in references:
                    references[pid] = done.get((key, cfg.dataset, pid, REFERENCE, None, None))
                if rkey in done:
                    result.skipped += 1
                    bar.update(1)
                    continue
                if first_s is None:
                    first_s = since_process_start()
                ids = prompts[p_index]
                prompt = torch.tensor([ids], dtype=torch.int64, device=session.device)
                session.drafter = spec
                slot = (method.name, None if spec is None else spec.key, t)
                first_call = None
                label = method.name + ("" if spec is None else f"[{dfields['drafter_label']}]")
                if slot not in warmed:
                    bar.set_postfix_str(f"warming up {label}{'' if t is None else f'@{t}'}")
                    warm = _warm_up(session, method, prompt, t)
                    warmed[slot] = warm
                    _freeze_gc(cfg)
                    if cfg.warmup > 0:
                        wrec = dict(common, kind=WARMUP, problem_id=pid, method=method.name, tree_size=t,
                                    prompt_len=len(ids), **dfields, **warm)  # fmt: skip
                        write_record(sink, wrec)
                        result.warmups.append(wrec)
                    else:
                        first_call = warm
                session.seed = seed_for(cfg.seed, pid, method.name, t)
                rec = dict(common, problem_id=pid, problem_index=indices[p_index],
                           difficulty=getattr(problem, "difficulty", None),
                           method=method.name, tree_size=t, prompt_len=len(ids), **dfields)  # fmt: skip
                if hasattr(problem, "turn"):  # Spec-Bench / prompt files: which user turn of the question
                    rec["turn"] = problem.turn
                if first_call is not None:
                    rec.update(first_call=True, load_s=first_call["load_s"], prep_s=first_call["prep_s"])
                try:
                    with _GcClock() as gc_clock:
                        res = method.run(session, prompt, t)
                    got = 1 if res.samples is None else len(res.samples)
                    if got != cfg.samples:
                        raise ValueError(f"samples: method {method.name!r} returned {got} completion(s), expected "
                                         f"{cfg.samples}")  # fmt: skip
                except Exception as e:  # record and go on: one failing method must not lose the run
                    rec["error"] = f"{type(e).__name__}: {e}"
                    _say(f"ERROR {cfg.dataset} problem {pid} method {label} t={t}: {rec['error']}")
                    if session.device.type == "cuda":
                        torch.cuda.empty_cache()
                else:
                    rec.update(_result_fields(res, tokenizer))
                    rec.update(gc_s=gc_clock.seconds, gc_full=gc_clock.full)
                    rec.update(_compare(rec, references[pid], cfg.greedy))
                    if checker is not None:  # outside the timed call
                        rec.update(_check_fields(checker, problem, rec))
                    if method.name == REFERENCE:
                        references[pid] = rec
                write_record(sink, rec)
                result.new += 1
                result.records.append(rec)
                bar.update(1)
                if rec.get("match") is False:
                    flag = "GREEDY MISMATCH (fp32: failure)" if strict else "greedy divergence"
                    _say(f"{flag}: {cfg.dataset} problem {pid} method {label} t={t}: first differing "
                         f"token at position {rec['first_divergence']} of {rec['new_tokens']}")  # fmt: skip
                if rec.get("tokens_per_s"):
                    bar.set_postfix_str(f"{label}{'' if t is None else f'@{t}'} {rec['tokens_per_s']:.1f} tok/s")
    finally:
        bar.close()
        if cfg.gc_freeze and not was_frozen:  # a caller's own frozen objects stay frozen
            gc.unfreeze()
    if cfg.sharded:  # where a shard's wall time went: what the shards pay once each, against the problems
        first = "no generation" if first_s is None else f"first generation at {first_s:.1f} s"
        _say(f"shard {cfg.shard[0]}/{cfg.shard[1]}: models loaded at {loaded_s:.1f} s, {first}, "
             f"done at {since_process_start():.1f} s after the process start")  # fmt: skip
    return finalize(result)
