"""Result records of an evaluation: the JSONL file, what identifies a record, token comparison.

Two kinds of JSON lines share a results file:

* a *timed* record per (problem, method, drafter, tree size): the generation's tokens, wall time,
  emission times, per-step arrays of the engine, the greedy comparison with the reference;
* a *warm-up* record (``"kind": "warmup"``) per (method, drafter, tree size) and process: the
  seconds of the engine's declared warm-up (``prep_s``), of building its drafter / decoder
  (``load_s``) and of each untimed warm-up generation (``warmup_walls``; ``wall_s`` is the first):
  the first-call latency of ``eval.latency``. Warm-up records are never reused on resume;
* a *calibration* record (``"kind": "calibration"``) per calibration problem and process
  (``EvalConfig.calibrate``): HF static timed again in that process, so that a drafter's rows can be
  compared with the baseline at that process's speed (``eval.report``, ``same_run_speedup``).

* a *context* record (``"kind": "context"``) per earlier turn whose answer a later prompt includes
  (Spec-Bench's second turns): the target's greedy answer (``token_ids``, ``text``), made once and
  reused on resume so that every method and rerun sees the same second-turn prompt.

Warm-up, calibration and context records are *side records*: no table row counts them as a timed call.
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "METHOD_ORDER",
    "CALIBRATION",
    "CONTEXT",
    "WARMUP",
    "EvalResult",
    "compare_tokens",
    "finalize",
    "is_calibration",
    "is_context",
    "is_timed",
    "is_warmup",
    "load_records",
    "record_drafter",
    "record_key",
    "result_from_file",
    "result_from_records",
    "row_sort_key",
    "seed_for",
    "write_record",
]

#: ``kind`` of a warm-up record.
WARMUP = "warmup"


#: ``kind`` of a calibration record.
CALIBRATION = "calibration"


#: ``kind`` of a context record (the target's answer to an earlier turn of a conversation).
CONTEXT = "context"


def is_context(rec: Mapping[str, Any]) -> bool:
    return rec.get("kind") == CONTEXT


def is_warmup(rec: Mapping[str, Any]) -> bool:
    return rec.get("kind") == WARMUP


def is_calibration(rec: Mapping[str, Any]) -> bool:
    return rec.get("kind") == CALIBRATION


def is_timed(rec: Mapping[str, Any]) -> bool:
    """A timed record of a table row: not a side record (warm-up, calibration)."""
    return rec.get("kind") is None


def record_drafter(rec: Mapping[str, Any]) -> str | None:
    """The drafter a record belongs to (its ``drafter`` key), None for methods without one.

    Records written before multi-drafter runs carry the run's drafter on every method; there it
    only counts where the record has a tree size (the ``specdec`` method)."""
    if rec.get("tree_size") is None and "drafter_label" not in rec:
        return None
    val = rec.get("drafter")
    return None if val is None else str(val)


def record_key(rec: Mapping[str, Any]) -> tuple:
    """(config key, dataset, problem, method, drafter, tree size): what a resumed run skips."""
    return (rec.get("config_key"), rec.get("dataset"), str(rec.get("problem_id")), rec.get("method"),
            record_drafter(rec), rec.get("tree_size"))  # fmt: skip


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


def seed_for(base: int, problem_id: str, method: str, tree_size: int | None) -> int:
    """The seed of one generation; every drafter at a tree size gets the same one (the target's
    sampling draws the same random numbers for all drafters of a problem)."""
    return (base * 1_000_003 + zlib.crc32(f"{problem_id}|{method}|{tree_size}".encode())) % (2**31)


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


def write_record(sink, rec: Mapping[str, Any]) -> None:
    sink.write(json.dumps(rec, separators=(",", ":")) + "\n")
    sink.flush()


@dataclass
class EvalResult:
    """What ``eval.runner.run_eval`` returns.

    Attributes:
        records: every timed record of this configuration in ``out`` (earlier runs' included).
        warmups: every side record (warm-up, calibration) of this configuration in ``out``.
        new: how many timed records this run added.
        skipped: how many (problem, method, drafter, t) were already done.
        calls: how many timed generations this run made (``new``, errors included).
        mismatches: greedy records whose tokens differ from the reference.
        errors: records whose method raised.
        strict: whether mismatches are failures (greedy float32).
        model_shape: the target's attention shape (for attention-only timings).
    """

    records: list[dict[str, Any]]
    warmups: list[dict[str, Any]] = field(default_factory=list)
    new: int = 0
    skipped: int = 0
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    strict: bool = False
    model_shape: dict[str, Any] | None = None

    @property
    def failed(self) -> bool:
        return bool(self.errors) or (self.strict and bool(self.mismatches))

    @property
    def all_records(self) -> list[dict[str, Any]]:
        """Side and timed records (what the report reads)."""
        return [*self.warmups, *self.records]


def finalize(result: EvalResult) -> EvalResult:
    """Keep the latest record per (problem, method, drafter, t) (a retried error is replaced by its
    redo) and collect the mismatches and errors that remain."""
    latest: dict[tuple, dict[str, Any]] = {}
    for rec in result.records:
        latest.pop(record_key(rec), None)
        latest[record_key(rec)] = rec
    result.records = list(latest.values())
    result.mismatches = [r for r in result.records if r.get("match") is False]
    result.errors = [r for r in result.records if r.get("error")]
    return result


def result_from_file(path: str | os.PathLike[str], configs: str = "last") -> EvalResult:
    """The records of the last configuration written to ``path`` (by its ``config_key``), or of every
    configuration in it (``configs="all"``: see ``result_from_records``)."""
    return result_from_records(load_records(path), path, configs=configs)


#: What records of several configurations must agree on to share one table (``configs="all"``): the
#: settings that change what every method's completion and timing mean. Draft model, attention
#: implementation, compile and GC freeze may differ: ``hf-assisted`` and drafter records name their own.
SHARED_FIELDS = ("dataset", "target", "max_new_tokens", "temperature", "seed", "dtype", "device", "pad_prompt_to",
                 "num_samples")  # fmt: skip


def _check_shared(records: Sequence[Mapping[str, Any]], path) -> None:
    """``configs="all"``: the timed records agree on ``SHARED_FIELDS`` and no row's problem was
    timed under two configurations (it would count twice)."""
    timed = [r for r in records if is_timed(r)]
    for name in SHARED_FIELDS:
        values = sorted({json.dumps(r.get(name)) for r in timed})
        if len(values) > 1:
            raise ValueError(f"configs: 'all' needs the configurations in {path} to agree on {name!r}, "
                             f"got {', '.join(values)}")  # fmt: skip
    seen: dict[tuple, Any] = {}
    for r in timed:
        key, *row = record_key(r)
        other = seen.setdefault(tuple(row), key)
        if other != key:
            raise ValueError(f"configs: 'all' found {tuple(row)} timed under configurations {other} and {key} "
                             f"in {path}; one table holds each (problem, method, drafter, t) once")  # fmt: skip


def result_from_records(records: Sequence[Mapping[str, Any]], path: str | os.PathLike[str],
                        key: str | None = None, configs: str = "last") -> EvalResult:  # fmt: skip
    """The records of configuration ``key`` (default: the last record's) among ``records``, read from
    ``path`` (named in messages; e.g. the merged shard files of a distributed run).

    ``configs="all"``: every configuration's records as one result, e.g. HF baselines run with the
    draft model next to drafter rows run without one. They must agree on ``SHARED_FIELDS``.

    Raises:
        ValueError: no records, no timed record, ``configs`` not "last" / "all", or (``"all"``) the
            configurations disagree on a shared field or time one row's problem twice.
    """
    if configs not in ("last", "all"):
        raise ValueError(f"configs: expected 'last' or 'all', got {configs!r}")
    records = [dict(r) for r in records]
    if not records:
        raise ValueError(f"out: no records in {path}")
    if configs == "all":
        _check_shared(records, path)
        key = ", ".join(sorted({str(r.get("config_key")) for r in records}))
    else:
        key = records[-1].get("config_key") if key is None else key
        others = sorted({str(r.get("config_key")) for r in records} - {str(key)})
        if others:
            print(f"note: {path} also holds configurations {', '.join(others)}; reporting the last one ({key}); "
                  "--configs all reports them together", file=sys.stderr)  # fmt: skip
        records = [r for r in records if r.get("config_key") == key]
    timed = [r for r in records if is_timed(r)]
    if not timed:
        raise ValueError(f"out: no timed records of configuration {key} in {path}")
    last = timed[-1]
    strict = last.get("temperature") == 0 and last.get("dtype") == "fp32"
    return finalize(EvalResult(records=timed, warmups=[r for r in records if not is_timed(r)], strict=strict))


#: The order of the baseline methods in tables and reports.
METHOD_ORDER = ("hf", "hf-static", "hf-assisted", "hf-lookup", "specdec-plain")


def row_sort_key(key: tuple, drafter_order: Mapping[str | None, int] | None = None) -> tuple:
    """Order of report rows keyed ``(method, drafter, tree size)``: baselines first (``METHOD_ORDER``),
    then speculative rows by drafter (``drafter_order``) and tree size."""
    method, drafter, t = key
    rank = METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)
    d = -1 if drafter is None else (drafter_order or {}).get(drafter, 0)
    size = (-1, 0) if t is None else (1, 0) if isinstance(t, str) else (0, t)  # "auto" after the fixed sizes
    return (method.startswith("specdec") and method != "specdec-plain", rank, method, d, size)
