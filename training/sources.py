"""Where the training prompts of ``train-eagle`` / ``train-medusa`` come from.

* **MBPP** (the default): ``--data`` / ``$SPECDEC_MBPP`` / ``../shared/data/mbpp/mbpp.jsonl``, each
  problem in the run's prompt styles (``training.distill.PROMPT_STYLES``).
* **A prompt file** (``--prompts FILE``): JSONL of ``{"prompt": ...}`` or ``{"messages": [...]}``
  (a chat conversation: the last user turn is answered, earlier turns are context), or a local
  ``datasets`` directory / parquet / JSON file -- read by ``eval.datasets.load_prompt_file``, the
  reader ``specdec eval prompts`` uses, so a bad row ends the run with one line naming the file,
  the line and the field, before any model loads.
* **Prompts the target writes** (``--seed-prompts FILE --self-prompts N``): N writing requests,
  each showing a few seed prompts of one category (``training.exercises.prompt_request``); the
  target's sampled answers, cached and resumable like every generation here
  (``training.distill.distill_cached``), become new prompts (``select_prompts``: empty, unfinished,
  duplicate and seed-copying ones dropped, and counted), saved to ``OUT/self_prompts.jsonl`` (a
  prompt file itself) and answered like the others.

* **The general mix** (``--mix general [--mix-per-kind N]``): MBPP plus prompts the target writes,
  as above, from the built-in seeds of ``training/data/general_seeds.jsonl`` (:data:`GENERAL_SEEDS`:
  a few prompts written for this package for each of Spec-Bench's kinds of task -- MT-bench's
  eight, translation, summarization, question answering, math word problems, a passage and a
  question -- and none taken from Spec-Bench or any other dataset): N writing requests per kind
  (:data:`DEFAULT_PER_KIND` by default), so that a drafter trained on it serves chat as well as
  code. Not combined with ``--seed-prompts``.
* **The contest mix** (``--mix contest``): MBPP plus programs reading standard input, as contest
  problems state them, written by the target from the built-in seeds of
  ``training/data/contest_seeds.jsonl`` (:data:`CONTEST_SEEDS`: 24 short problem statements with
  input and output formats and an example, written for this package, none taken from APPS or any
  other dataset); one kind, :data:`CONTEST_PER_KIND` requests by default. MBPP's tasks are one
  sentence long and its answers short functions; this serves longer statements and whole programs.

MBPP is used when ``--data`` or ``--mix`` is given or when neither ``--prompts`` nor ``--seed-prompts``
is; ``--data mbpp.jsonl --seed-prompts FILE --self-prompts N`` trains on both. Held out for the accuracy
report: the last ``--heldout`` MBPP problems when MBPP is used (as before), else the last
``--heldout`` of the file's and the self-written prompts; default 48, at most a fifth of them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.datasets import ChatProblem, load_mbpp, load_prompt_file
from training.distill import distill_cached, encode_messages, encode_prompt, prompts_digest, styled_prompts
from training.exercises import prompt_request, seed_choices, select_prompts

__all__ = ["CONTEST_PER_KIND", "CONTEST_SEEDS", "DEFAULT_HELDOUT", "DEFAULT_PER_KIND", "GENERAL_SEEDS", "MIXES",
           "SELF_PROMPT_TOKENS", "Sources", "TrainPrompts", "check_source_fields", "mix_per_kind", "read_sources",
           "source_record", "training_prompts"]  # fmt: skip

#: Held-out prompts by default (at most a fifth of those of the held-out source).
DEFAULT_HELDOUT = 48
#: New-token limit of a self-written prompt (an answer cut there is dropped as unfinished).
SELF_PROMPT_TOKENS = 256
#: The general mix's seed prompts: a prompt file, one ``category`` per kind of task.
GENERAL_SEEDS = Path(__file__).resolve().parent / "data" / "general_seeds.jsonl"
#: The contest mix's seed prompts: one ``category`` ("contest"), programs reading standard input.
CONTEST_SEEDS = Path(__file__).resolve().parent / "data" / "contest_seeds.jsonl"
#: Writing requests of the contest mix's one kind by default (as many as the general mix's 80 x 13).
CONTEST_PER_KIND = 960
#: Writing requests per kind of the general mix by default: 80 x 13 kinds = 1040 requests of <= 256
#: new tokens, then answers of ``--max-new-tokens`` to the kept ones. Measured (Qwen2.5-Coder-1.5B,
#: bf16, one H200, MBPP's answers cached): the data in 162 s, the whole run 428 s with a 270-s training
#: budget (docs/RESULTS.md, "The push all-reduce at 1.40× on 2 GPUs ...").
DEFAULT_PER_KIND = 80
#: The built-in training mixes (``--mix``): MBPP plus prompts the target writes from a seed file,
#: as (seed file, writing requests per kind by default).
MIXES = {"general": (GENERAL_SEEDS, DEFAULT_PER_KIND), "contest": (CONTEST_SEEDS, CONTEST_PER_KIND)}


def check_source_fields(run: Any) -> None:
    """ValueError naming the flag when a run's prompt sources do not fit together."""
    n = run.self_prompts
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"self_prompts: expected an int >= 0, got {n!r}")
    if run.mix is not None and run.mix not in MIXES:
        raise ValueError(f"mix: expected None or one of {', '.join(MIXES)}, got {run.mix!r}")
    k = run.mix_per_kind
    if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
        raise ValueError(f"mix_per_kind: expected None or an int >= 1, got {k!r}")
    if k is not None and run.mix is None:
        raise ValueError(f"--mix-per-kind: expected --mix too (requests per kind of a mix), got --mix-per-kind {k} "
                         "without --mix")  # fmt: skip
    if run.mix is not None and (run.seed_prompts is not None or n):
        raise ValueError(f"--mix: the {run.mix} mix writes its prompts from its own seeds ({MIXES[run.mix][0].name}; "
                         "--mix-per-kind sets how many); expected --mix or --seed-prompts FILE --self-prompts N, "
                         f"got --mix {run.mix} with --seed-prompts {run.seed_prompts!r} and --self-prompts "
                         f"{n}")  # fmt: skip
    if (run.seed_prompts is None) != (n == 0):
        raise ValueError("--self-prompts: the target writes N prompts in the style of --seed-prompts FILE: give both "
                         f"(got --seed-prompts {run.seed_prompts!r} and --self-prompts {n})")  # fmt: skip
    h = run.heldout
    if h is not None and (not isinstance(h, int) or isinstance(h, bool) or h < 0):
        raise ValueError(f"heldout: expected an int >= 0, got {h!r} (None: {DEFAULT_HELDOUT}, at most a fifth of the "
                         "prompts)")  # fmt: skip
    if not run.self_prompt_temperature > 0:
        raise ValueError(f"self_prompt_temperature: expected > 0, got {run.self_prompt_temperature!r}")


def mix_per_kind(run: Any) -> int | None:
    """Writing requests per kind of the run's mix (None without ``--mix``)."""
    if run.mix is None:
        return None
    return MIXES[run.mix][1] if run.mix_per_kind is None else run.mix_per_kind


def uses_mbpp(run: Any) -> bool:
    """MBPP is used when ``--data`` names it, with ``--mix``, or when no other source is given."""
    return run.data is not None or run.mix is not None or (run.prompts is None and run.seed_prompts is None)


@dataclass(frozen=True)
class Sources:
    """The prompt sources of a run, read and checked before any model loads.

    Attributes:
        rows: the MBPP rows used ([] without MBPP).
        problems: the prompt file's conversations ([] without ``--prompts``).
        seeds: the seed prompts' conversations (``--seed-prompts``, or the mix's; [] without either).
        writes: how many prompts the target writes from ``seeds`` (``--self-prompts``, or the
            mix's per kind times its kinds).
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    problems: list[ChatProblem] = field(default_factory=list)
    seeds: list[ChatProblem] = field(default_factory=list)
    writes: int = 0


def read_sources(run: Any) -> Sources:
    """Read MBPP, ``--prompts`` and ``--seed-prompts`` or the mix's seeds (``num_prompts``: the
    first N of MBPP and of the prompt file). ValueError naming the file, line and field on a bad row."""
    rows = load_mbpp(run.data)[: run.num_prompts] if uses_mbpp(run) else []
    problems = load_prompt_file(run.prompts, limit=run.num_prompts) if run.prompts is not None else []
    if run.mix is not None:
        seeds = load_prompt_file(MIXES[run.mix][0])
        writes = mix_per_kind(run) * len({s.category for s in seeds})
    else:
        seeds = load_prompt_file(run.seed_prompts) if run.seed_prompts is not None else []
        writes = run.self_prompts
    if rows:
        _heldout(run, len(rows), "problems")
    elif problems and not seeds:
        _heldout(run, len(problems), "prompts")
    if getattr(run, "exercises", 0) and not rows:
        raise ValueError("--exercises: exercises are written from MBPP problems; give the MBPP file (--data) too")
    return Sources(rows, problems, seeds, writes)


def _heldout(run: Any, n: int, what: str) -> int:
    h = min(DEFAULT_HELDOUT, n // 5) if run.heldout is None else run.heldout
    if not 0 <= h < n:
        raise ValueError(f"--heldout: expected 0 <= heldout < the {n} {what} used, got {h}")
    return h


@dataclass(frozen=True)
class TrainPrompts:
    """The training prompts of a run (:func:`training_prompts`).

    Attributes:
        ids: token ids of every prompt, in order: MBPP (problems in every style), the prompt file's,
            the self-written ones.
        held: per prompt, whether it is held out (the accuracy report).
        key: what the self-distillation cache's meta adds (``{}`` for MBPP alone, so that caches
            made before other sources existed stay valid; else a hash of every prompt).
        rows: the MBPP rows used; ``split``: how many of them train (exercises are written from those).
        line: what the prompts are, for the log.
        mbpp_prompts: how many of ``ids`` are MBPP's (the first ones).
        written_per_kind: the self-written prompts kept, per seed category ({} without seeds).
    """

    ids: list[list[int]]
    held: list[bool]
    key: dict[str, Any]
    rows: list[dict[str, Any]]
    split: int
    line: str
    mbpp_prompts: int = 0
    written_per_kind: dict[str, int] = field(default_factory=dict)


def _self_written(sources: Sources, run: Any, loaded: Any, meta: dict[str, Any], cache: Path,
                  out: Path) -> list[ChatProblem]:  # fmt: skip
    """The prompts the target writes in the style of the seeds (cached, resumable), saved to
    ``OUT/self_prompts.jsonl``."""
    tok = loaded.tokenizer
    texts = [s.last_user() for s in sources.seeds]
    plan = seed_choices([s.category for s in sources.seeds], sources.writes, run.seed)
    requests = [encode_messages(tok, [{"role": "user", "content": prompt_request([texts[i] for i in pick])}], run.chat)
                for _, pick in plan]  # fmt: skip
    wmeta = {**meta, "prompts": len(requests), "temperature": run.self_prompt_temperature,
             "max_new_tokens": SELF_PROMPT_TOKENS, "prompts_sha": prompts_digest(requests), "writing": True}  # fmt: skip
    written = distill_cached(loaded.model, requests, cache.with_name(f"{cache.stem}.selfprompts{cache.suffix}"), wmeta,
                             max_new_tokens=SELF_PROMPT_TOKENS, batch_size=run.gen_batch_size, eos_token_id=loaded.eos,
                             pad_token_id=loaded.pad, temperature=run.self_prompt_temperature, seed=run.seed + 2000,
                             progress=run.progress, desc="self-written prompts")  # fmt: skip
    eos = {loaded.eos} if isinstance(loaded.eos, int) else set(loaded.eos or ())
    answers = [(tok.decode(e.ids[e.prompt_len :], skip_special_tokens=True),
                len(e.ids) > e.prompt_len and e.ids[-1] in eos) for e in written]  # fmt: skip
    kept_at, kept, report = select_prompts(answers, texts)
    print(report.line())
    problems = [ChatProblem(f"self-{i}", (("user", text),), plan[i][0]) for i, text in zip(kept_at, kept)]
    path = out / "self_prompts.jsonl"
    with open(path, "w") as f:
        for p in problems:
            f.write(json.dumps({"id": p.id, "category": p.category, "prompt": p.last_user()}) + "\n")
    print(f"self-written prompts saved to {path} (a prompt file: --prompts reads it)")
    return problems


def training_prompts(sources: Sources, run: Any, loaded: Any, meta: dict[str, Any], cache: Path, out: Path,
                     styles: Sequence[str] = ("mbpp",)) -> TrainPrompts:  # fmt: skip
    """Every source's prompts as token ids, with the held-out flags (see the module docstring).
    ``meta``: the cache's base settings (the self-written prompts' cache extends it)."""
    tok = loaded.tokenizer
    ids: list[list[int]] = []
    held: list[bool] = []
    parts = []
    split = 0
    if sources.rows:
        h = _heldout(run, len(sources.rows), "problems")
        split = len(sources.rows) - h
        styled = styled_prompts(sources.rows, styles)
        ids += [encode_prompt(tok, text, chat=run.chat) for _, text in styled]
        held += [i >= split for i, _ in styled]
        parts.append(f"{len(styled)} MBPP ({len(sources.rows)} problems x {len(styles)} styles, {h} problems held out)")
    general = list(sources.problems)
    kinds: dict[str, int] = {}
    if sources.seeds:
        written = _self_written(sources, run, loaded, meta, cache, out)
        if not written and not general and not sources.rows:
            raise ValueError(f"--self-prompts: none of the {sources.writes} prompts the target wrote was kept (see "
                             "the line above); write more, or give --prompts / --data too")  # fmt: skip
        general += written
        kinds = {c: sum(p.category == c for p in written) for c in dict.fromkeys(s.category for s in sources.seeds)}
    if general:
        ids += [encode_messages(tok, p.messages(), chat=run.chat) for p in general]
        h = 0 if sources.rows else _heldout(run, len(general), "prompts")
        held += [i >= len(general) - h for i in range(len(general))]
        what = [f"{len(sources.problems)} from {run.prompts}"] if sources.problems else []
        if sources.seeds:
            mix = f" ({run.mix} mix, {mix_per_kind(run)} requests per kind)" if run.mix is not None else ""
            what.append(f"{len(general) - len(sources.problems)} written by the target{mix}")
        parts.append(f"{len(general)} prompts ({', '.join(what)}; {h} held out)")
    if kinds:
        print("self-written prompts kept per kind: " + ", ".join(f"{c} {n}" for c, n in kinds.items()))
    key = {} if not (sources.problems or sources.seeds) else {"prompts_sha": prompts_digest(ids)}
    return TrainPrompts(ids, held, key, list(sources.rows), split, "training prompts: " + " + ".join(parts),
                        mbpp_prompts=len(ids) - len(general), written_per_kind=kinds)


def source_record(run: Any, data: TrainPrompts) -> dict[str, Any]:
    """What a trained drafter's config records of its prompt sources: the prompt file, the seed
    prompts and how many prompts were asked of the target, the mix and its requests per kind, and
    the self-written prompts kept per kind."""
    return {"prompts": run.prompts, "seed_prompts": run.seed_prompts, "self_prompts": run.self_prompts,
            "mix": run.mix, "mix_per_kind": mix_per_kind(run), "written_per_kind": data.written_per_kind}
