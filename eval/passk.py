"""Pass@1 and pass@k of a results file: run every completion of an evaluation against its problem's
tests, write the verdicts into the records, and compare methods with a paired interval.

What :func:`check_file` does with a results JSONL (``eval.runner`` records):

* **Which records.** Timed records of one dataset that hold a ``text``; warm-up records
  (``"kind": "warmup"``) and records whose method raised (``error``) are skipped. The dataset is the
  one the records name (``dataset``), or ``dataset=`` when the file holds several.
* **Problems.** Matched by id against ``eval.datasets.load_apps`` (first occurrence of each id,
  as the runner loads them) or ``load_problems`` (HumanEval; MBPP, for tuning) on ``data``
  (default: the loaders' own files). A record whose problem id is not in the data is an error
  naming ``data``.
* **What runs.** :func:`completion_text` of the record's ``text`` (the decoded generation up to
  its first end-of-turn marker: the runner keeps special tokens, so a chat answer ends in
  ``<|im_end|>``), through ``eval.execution.check`` in its sandbox, ``workers`` at a time.
  Identical (problem, completion) pairs run once and share one verdict: under greedy decoding
  most methods produce the same text, and different methods' identical texts get one verdict.
  A record with several samples (``specdec eval|sweep --samples n``: ``sample_texts``) has each of
  its n completions run the same way (shared with identical texts of any record).
* **Resumable.** A record that already carries ``passed`` (``sample_passed``) is not run again (unless
  ``recheck``); its verdict is reused for other records with the same text. Verdicts are written
  every ``checkpoint_s`` seconds and when interrupted, so an interrupted check resumes.
* **Written.** Each record gets ``passed`` (bool) and ``check_status`` (``pass / fail / timeout /
  error``, ``eval.execution.STATUSES``), and ``check_detail`` (what went wrong first) when it did
  not pass; a record with several samples gets ``sample_passed`` / ``sample_status`` /
  ``sample_detail`` (one per sample, in order; detail None where it passed) and ``num_correct``
  (c of its ``num_samples`` n), once all its samples have verdicts; every checked record also gets
  ``check_isolation`` (``"bubblewrap"``, or ``"none"`` when run with ``unsafe=True``). The file is
  rewritten atomically (a temporary file beside it, then ``os.replace``), in place or to ``out``:
  only the lines of records given a verdict change; every other line, a truncated or malformed one
  included (reported in :attr:`CheckResult.malformed`), is kept byte for byte. The file is read again just before each write, so records appended
  meanwhile are kept -- but a process still appending to the file (a running sweep) keeps writing
  to the replaced file: check a file once its run has finished.

:func:`pass_rows` then gives one row per (method, drafter, tree size): pass@1 over the problems
with a verdict, and the difference to a reference method (default ``hf-static``, else ``hf``) with
its 95% interval, Tango's paired score interval over the problems both have
(``eval.stats.paired_diff_ci``). Identical outputs give a difference of 0 with an interval of
``±z²/(n + z²)``; only problems one method solves and the other does not move it.

**pass@k with several samples** (:func:`pass_fields`, :func:`paired_pass_diff`). A problem with c
of n samples correct gets the unbiased estimate ``pass@k = 1 - C(n - c, k) / C(n, k)`` (Chen et al.
2021, ``eval.stats.pass_at_k``; ``c / n`` for k = 1), for k in :data:`PASS_KS` up to n; a row's
pass@k is the mean over its problems. Its 95% interval is the percentile bootstrap over problems
(``eval.stats.bootstrap_mean_ci``: 10,000 resamplings of the problems, seeded, so a report is
reproducible), which covers both the spread between problems and the sampling noise of each
estimate. The difference to the reference is the mean of the paired per-problem differences of the
estimates over the problems both have, with the paired bootstrap interval (pairs resampled
together); it agrees with 0 when the interval holds 0. Rows of single-sample records keep Tango's
interval for pass@1 as above.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval import execution, sandbox
from eval.datasets import DATASETS, check_dataset
from eval.execution import Limits
from eval.stats import PairedDiff, bootstrap_mean_ci, paired_diff_ci, pass_at_k
from eval.records import is_timed, load_records, record_drafter, row_sort_key

__all__ = [
    "DEFAULT_REFERENCES",
    "END_MARKERS",
    "PASS_KS",
    "CheckResult",
    "apply_verdicts",
    "check_file",
    "completion_text",
    "default_reference",
    "format_pass_table",
    "load_check_problems",
    "paired_pass_diff",
    "pass_fields",
    "pass_rows",
    "record_counts",
    "rewrite_records",
]

#: The reference of the paired pass@1 difference when none is given: the first with verdicts.
DEFAULT_REFERENCES = ("hf-static", "hf")

#: The k of pass@k reported for records with several samples (each k up to the samples per problem).
PASS_KS = (1, 10)

#: Special tokens that end a generation: the completion is cut at the first one found (Qwen /
#: ChatML, Llama 3, Phi, Gemma, DeepSeek). ``</s>`` and ``<eos>`` are only stripped at the end,
#: since code may contain them as text.
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>",
               "<end_of_turn>", "<\uff5cend\u2581of\u2581sentence\uff5c>")  # fmt: skip
_TRAILING_MARKERS = ("</s>", "<eos>")
_DETAIL_CHARS = 300

_Key = tuple  # (problem id, completion)


def completion_text(text: str) -> str:
    """What gets checked of a record's ``text``: everything before the first :data:`END_MARKERS`
    marker, without trailing ``</s>`` / ``<eos>``."""
    cut = min((i for i in (text.find(m) for m in END_MARKERS) if i >= 0), default=len(text))
    text = text[:cut]
    while True:
        stripped = text.rstrip()
        for m in _TRAILING_MARKERS:
            if stripped.endswith(m):
                text = stripped[: -len(m)]
                break
        else:
            return text


def _record_dataset(rec: Mapping[str, Any], dataset: str) -> bool:
    return rec.get("dataset", dataset) == dataset


def _multi(rec: Mapping[str, Any]) -> bool:
    """Whether ``rec`` holds several samples (``sample_texts``: a list of texts)."""
    texts = rec.get("sample_texts")
    return isinstance(texts, list) and bool(texts) and all(isinstance(t, str) for t in texts)


def _eligible(rec: Mapping[str, Any], dataset: str, config_key: str | None) -> bool:
    """A timed record of ``dataset`` (and ``config_key``) with a completion (or samples) to check."""
    if not is_timed(rec) or rec.get("error") or not (_multi(rec) or isinstance(rec.get("text"), str)):
        return False
    return _record_dataset(rec, dataset) and (config_key is None or rec.get("config_key") == config_key)


def _keys(rec: Mapping[str, Any]) -> list[_Key]:
    """(problem id, completion) of each completion of an eligible record (one per sample)."""
    texts = rec["sample_texts"] if _multi(rec) else [rec["text"]]
    return [(str(rec.get("problem_id")), completion_text(t)) for t in texts]


def record_counts(rec: Mapping[str, Any]) -> tuple[int, int] | None:
    """``(c, n)`` of a checked record: correct completions and completions -- from ``sample_passed``
    (several samples), else ``(1, 1)`` / ``(0, 1)`` from ``passed``; None without a verdict."""
    per = rec.get("sample_passed")
    if isinstance(per, list) and per:
        return sum(bool(p) for p in per), len(per)
    passed = rec.get("passed")
    return None if passed is None else (int(bool(passed)), 1)


def _record_verdicts(rec: Mapping[str, Any]) -> list[tuple[_Key, dict[str, Any]]]:
    """(key, verdict fields) of every completion of a checked eligible record ([] without verdicts)."""
    if record_counts(rec) is None:
        return []
    keys = _keys(rec)
    if not _multi(rec):
        return [(keys[0], {k: rec[k] for k in ("passed", "check_status", "check_detail") if k in rec})]
    passed = rec["sample_passed"]
    if len(passed) != len(keys):
        return []
    statuses = rec.get("sample_status") or ["pass" if p else "fail" for p in passed]
    details = rec.get("sample_detail") or [None] * len(passed)
    out = []
    for key, ok, status, detail in zip(keys, passed, statuses, details):
        fields = {"passed": bool(ok), "check_status": status}
        if detail:
            fields["check_detail"] = detail
        out.append((key, fields))
    return out


def _resolve_dataset(records: Sequence[Mapping[str, Any]], dataset: str | None, path: Path) -> str:
    if dataset is not None:
        check_dataset(dataset)
        timed = [r for r in records if is_timed(r)]
        if timed and not any(_record_dataset(r, dataset) for r in timed):
            held = sorted({str(r.get("dataset")) for r in timed})
            raise ValueError(f"dataset: no {dataset} records in {path} (it holds {', '.join(held)})")
        return dataset
    named = sorted({str(r["dataset"]) for r in records if is_timed(r) and r.get("dataset") is not None})
    if not named:
        raise ValueError(f"dataset: the records of {path} do not name their dataset; give it ({', '.join(DATASETS)})")
    if len(named) > 1:
        raise ValueError(f"dataset: {path} holds records of {' and '.join(named)}; check one at a time")
    if named[0] not in DATASETS:
        raise ValueError(f"dataset: the records of {path} are of dataset {named[0]!r}; expected one of {', '.join(DATASETS)}")
    return named[0]


def load_check_problems(dataset: str, data: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """The problems of ``dataset`` by id: every APPS problem of ``data`` (first occurrence of an id,
    as the runner loads them; no difficulty filter) or every HumanEval / MBPP problem. Loader errors
    about the file name ``data``."""
    from eval.datasets import load_apps, load_problems

    try:
        problems = load_apps(data, unique=True) if dataset == "apps" else load_problems(dataset, data)
    except ValueError as e:
        msg = str(e)
        raise ValueError("data:" + msg[len("path:"):] if msg.startswith("path:") else f"data: {msg}") from None
    return {str(p.id): p for p in problems}


def _verdict_fields(v: Any) -> dict[str, Any]:
    passed = bool(getattr(v, "passed", v))
    fields: dict[str, Any] = {"passed": passed, "check_status": getattr(v, "status", "pass" if passed else "fail")}
    if hasattr(v, "isolation"):
        fields["check_isolation"] = v.isolation
    detail = getattr(v, "detail", "")
    if not passed and detail:
        fields["check_detail"] = str(detail)[:_DETAIL_CHARS]
    return fields


def apply_verdicts(records: Iterable[dict[str, Any]], verdicts: Mapping[_Key, Mapping[str, Any]], *, dataset: str,
                   config_key: str | None = None, overwrite: bool = False) -> int:  # fmt: skip
    """Give every eligible record of ``dataset`` (and ``config_key``) whose (problem id,
    :func:`completion_text`) is in ``verdicts`` its ``passed`` / ``check_status`` / ``check_detail``;
    a record with several samples, once every sample's pair is there, ``sample_passed`` /
    ``sample_status`` / ``sample_detail`` and ``num_correct``. Records that already have a verdict
    only when ``overwrite``. Returns the records changed."""
    changed = 0
    for rec in records:
        if not _eligible(rec, dataset, config_key) or (record_counts(rec) is not None and not overwrite):
            continue
        found = [verdicts.get(key) for key in _keys(rec)]
        if any(f is None for f in found):
            continue
        if _multi(rec):
            rec.update(sample_passed=[f["passed"] for f in found], sample_status=[f["check_status"] for f in found],
                       sample_detail=[f.get("check_detail") for f in found],
                       num_correct=sum(bool(f["passed"]) for f in found))  # fmt: skip
            isolations = sorted({f["check_isolation"] for f in found if "check_isolation" in f})
            if isolations:
                rec["check_isolation"] = "none" if "none" in isolations else isolations[0]
        else:
            rec.pop("check_detail", None)
            rec.update(found[0])
        changed += 1
    return changed


def rewrite_records(src: str | os.PathLike[str], dest: str | os.PathLike[str],
                    update: Callable[[dict[str, Any]], bool]) -> tuple[int, list[int]]:  # fmt: skip
    """Copy ``src`` to ``dest`` atomically, each JSON record passed to ``update`` (which changes it in
    place and says whether it did): changed records are written anew, every other line -- a
    truncated or malformed one included -- byte for byte. Returns (records changed, 1-based numbers
    of the lines that are not JSON objects). With ``dest == src`` and nothing changed, nothing is
    written."""
    import json

    src, dest = Path(src), Path(dest)
    lines = src.read_bytes().splitlines(keepends=True)
    out, changed, malformed = [], 0, []
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line) if line.strip() else None
        except ValueError:
            rec = None
        if not isinstance(rec, dict):
            if line.strip():
                malformed.append(i + 1)
            out.append(line)
            continue
        if update(rec):
            changed += 1
            end = b"\n" if line.endswith(b"\n") or i < len(lines) - 1 else b""
            out.append(json.dumps(rec, separators=(",", ":")).encode() + end)
        else:
            out.append(line)
    if changed or dest != src:
        _write_atomic(dest, b"".join(out))
    return changed, malformed


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@dataclass
class CheckResult:
    """What :func:`check_file` did.

    Attributes:
        path: the file written (the results file, or ``out``).
        dataset: the dataset checked.
        records: every record of the written file (all datasets, warm-ups included).
        considered: timed records of the dataset with a completion or samples (the rest were skipped).
        skipped: the other records: warm-ups, records with an error or without a text, records
            of other datasets (or configurations, with ``config_key``).
        already: considered records that already had a verdict (and kept it).
        checked: records given a verdict by this call.
        completions: the completions of those records (more than ``checked`` with several samples).
        run: programs run by this call (unique (problem, completion) pairs).
        statuses: verdict statuses of the completions checked by this call.
        verdicts: (problem id, completion) -> the fields written, for every pair run or reused.
        written: whether the file was (re)written.
        malformed: 1-based numbers of lines that are not complete JSON records (a run killed
            mid-write): left in place, not checked.
    """

    path: Path
    dataset: str
    records: list[dict[str, Any]]
    considered: int = 0
    skipped: int = 0
    already: int = 0
    checked: int = 0
    completions: int = 0
    run: int = 0
    statuses: Counter = field(default_factory=Counter)
    verdicts: dict[_Key, dict[str, Any]] = field(default_factory=dict)
    written: bool = False
    malformed: list[int] = field(default_factory=list)

    def summary(self) -> str:
        """One line: how many records were checked, programs run, and their statuses."""
        samples = f", {self.completions} completions" if self.completions != self.checked else ""
        parts = [f"{self.checked} record(s) of {self.dataset} checked{samples} ({self.run} program(s) run, "
                 f"{max(0, self.completions - self.run)} shared an identical completion)"]  # fmt: skip
        if self.already:
            parts.append(f"{self.already} already checked")
        if self.skipped:
            parts.append(f"{self.skipped} skipped (warm-up, error, no text, other dataset / configuration)")
        line = ", ".join(parts)
        if self.statuses:
            line += ": " + ", ".join(f"{s} {self.statuses[s]}" for s in execution.STATUSES if self.statuses[s])
        if self.malformed:
            shown = ", ".join(map(str, self.malformed[:5])) + (" ..." if len(self.malformed) > 5 else "")
            line += f"; line(s) {shown} not a complete record (left as they are, not checked)"
        return line


def check_file(
    path: str | os.PathLike[str],
    *,
    dataset: str | None = None,
    data: str | os.PathLike[str] | None = None,
    problems: Sequence[Any] | Mapping[str, Any] | None = None,
    out: str | os.PathLike[str] | None = None,
    limits: Limits | None = None,
    workers: int | None = None,
    progress: bool = True,
    recheck: bool = False,
    config_key: str | None = None,
    checkpoint_s: float = 60.0,
    unsafe: bool = False,
) -> CheckResult:
    """Check the completions of a results file and write the verdicts into its records.

    Args:
        path: the results JSONL (``eval.runner`` records).
        dataset: ``"apps"``, ``"humaneval"`` or ``"mbpp"`` (tuning only); default: the one the
            records name.
        data: the APPS / HumanEval / MBPP file the run used (default: the loaders' own).
        problems: the problems themselves (a list, or a mapping id -> problem) instead of
            loading them from ``data``.
        out: write the records here instead of back to ``path``.
        limits: ``eval.execution.Limits`` of every check (default ``Limits()``).
        workers: concurrent sandboxes (default: the CPU count).
        progress: show a progress bar.
        recheck: run records that already have a verdict again (and overwrite it).
        config_key: check only records of this configuration (``eval.config.config_key``).
        checkpoint_s: write the verdicts so far at least this often (seconds).
        unsafe: run the programs without kernel isolation where bubblewrap is missing
            (``eval.sandbox``); every verdict then records ``check_isolation = "none"``.

    Raises:
        eval.sandbox.IsolationUnavailable: no bubblewrap (or it cannot start here), and not
            ``unsafe``; raised before anything is run or written.
        ValueError: a missing or empty results file (``results``), a bad or ambiguous
            ``dataset``, problem ids that ``data`` does not hold (``data``), a bad ``workers``.
    """
    src = Path(path)
    if not src.is_file():
        raise ValueError(f"results: no such file: {str(src)!r}")
    records = load_records(src)
    if not records:
        raise ValueError(f"results: no records in {src}")
    dataset = _resolve_dataset(records, dataset, src)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers: expected an int >= 1, got {workers!r}")
    sandbox.isolation(unsafe)  # refuse before anything runs or is written
    dest = Path(out) if out is not None else src
    limits = limits or Limits()
    considered = [r for r in records if _eligible(r, dataset, config_key)]
    res = CheckResult(path=dest, dataset=dataset, records=records, considered=len(considered),
                      skipped=len(records) - len(considered))  # fmt: skip
    cache: dict[_Key, dict[str, Any]] = {}
    if not recheck:
        for r in considered:
            for key, fields in _record_verdicts(r):
                cache.setdefault(key, fields)
    pending = [r for r in considered if recheck or record_counts(r) is None]
    res.already = len(considered) - len(pending)
    jobs: dict[_Key, Any] = {}
    if pending:
        todo = {key for r in pending for key in _keys(r) if key not in cache}
        if todo:
            by_id = _problem_map(problems) if problems is not None else load_check_problems(dataset, data)
            missing = sorted({pid for pid, _ in todo} - set(by_id), key=_natural)
            if missing:
                shown = f"{missing[:5]}{' ...' if len(missing) > 5 else ''}"
                if problems is not None:
                    raise ValueError(f"problems: {len(missing)} problem id(s) of {src} not among the given problems "
                                     f"({len(by_id)}): {shown}")  # fmt: skip
                if data:
                    raise ValueError(f"data: {len(missing)} problem id(s) of {src} not found in {data} ({len(by_id)} "
                                     f"problems): {shown}; give the file the run used")  # fmt: skip
                raise ValueError(f"results: {len(missing)} problem id(s) of {src} are not {dataset} problems of the "
                                 f"default data ({len(by_id)} problems): {shown}; if the run used another file, give it "
                                 "with --data")  # fmt: skip
            jobs = {k: by_id[k[0]] for k in sorted(todo, key=lambda k: (_natural(k[0]), k[1]))}

    def flush() -> None:
        def update(rec: dict[str, Any]) -> bool:
            return apply_verdicts([rec], cache, dataset=dataset, config_key=config_key, overwrite=recheck) > 0

        changed, res.malformed = rewrite_records(src, dest, update)
        res.written = res.written or bool(changed) or dest != src

    new: dict[_Key, dict[str, Any]] = {}
    try:
        _run_checks(jobs, limits, workers, progress, dataset, new, cache, flush, checkpoint_s, unsafe)
    finally:
        if new or pending or dest != src:
            flush()
        res.records = load_records(dest) if res.written else records
    res.verdicts = {key: cache[key] for r in pending for key in _keys(r) if key in cache}
    res.run = len(new)
    for r in pending:
        found = [cache.get(key) for key in _keys(r)]
        if all(f is not None for f in found):
            res.checked += 1
            res.completions += len(found)
            res.statuses.update(f["check_status"] for f in found)
    return res


def _natural(pid: str) -> tuple:
    """Sort ids numerically where they are numbers (APPS), by their numeric tail otherwise."""
    head, _, tail = pid.rpartition("/")
    return (head, int(tail) if tail.isdigit() else float("inf"), tail)


def _problem_map(problems: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(problems, Mapping):
        return {str(k): v for k, v in problems.items()}
    return {str(p.id): p for p in problems}


def _run_checks(jobs: Mapping[_Key, Any], limits: Limits, workers: int | None, progress: bool, dataset: str,
                new: dict[_Key, dict[str, Any]], cache: dict[_Key, dict[str, Any]], flush: Callable[[], Any],
                checkpoint_s: float, unsafe: bool = False) -> None:  # fmt: skip
    """Run ``execution.check`` on every job, ``workers`` at a time; each verdict goes into ``new``
    and ``cache``; ``flush()`` every ``checkpoint_s`` and (by the caller) at the end / on interrupt."""
    if not jobs:
        return
    from tqdm.auto import tqdm

    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    pool = ThreadPoolExecutor(max_workers=workers)
    futures = {}
    last = time.monotonic()
    try:
        with tqdm(total=len(jobs), desc=f"checking {dataset}", unit="program", disable=not progress,
                  file=sys.stderr) as bar:  # fmt: skip
            for key, problem in jobs.items():
                futures[pool.submit(execution.check, problem, key[1], limits, unsafe=unsafe)] = key
            n_pass = 0
            for future in as_completed(futures):
                fields = _verdict_fields(future.result())
                new[futures[future]] = cache[futures[future]] = fields
                n_pass += fields["passed"]
                bar.update(1)
                bar.set_postfix(passed=n_pass, refresh=False)
                if time.monotonic() - last >= checkpoint_s:
                    flush()
                    last = time.monotonic()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)  # running checks end within their limits
        for future, key in futures.items():  # keep what finished
            if future.done() and not future.cancelled() and future.exception() is None and key not in new:
                new[key] = cache[key] = _verdict_fields(future.result())
        raise
    pool.shutdown()


# ----------------------------------------------------------------------------------------------
# pass@1 / pass@k per row


def pass_fields(by_problem: Mapping[str, Mapping[str, Any]], *, confidence: float = 0.95) -> dict[str, Any]:
    """The pass@k fields of one row from its record per problem (those without a verdict left out;
    {} when none has one): ``checked`` (problems) and ``pass_at_1`` (mean over problems of c / n,
    :func:`record_counts`); when some record holds several samples also ``samples`` (the fewest of
    a problem), ``completions``, ``correct`` and, for every k of :data:`PASS_KS` up to ``samples``,
    ``pass_at_{k}`` (mean unbiased estimate) with ``pass_at_{k}_low`` / ``_high`` (percentile
    bootstrap over problems, ``confidence``)."""
    counts = [x for x in (record_counts(r) for r in by_problem.values()) if x is not None]
    if not counts:
        return {}
    out: dict[str, Any] = {"checked": len(counts), "pass_at_1": statistics.fmean(c / n for c, n in counts)}
    if max(n for _, n in counts) == 1:
        return out
    fewest = min(n for _, n in counts)
    out.update(samples=fewest, completions=sum(n for _, n in counts), correct=sum(c for c, _ in counts))
    for k in (k for k in PASS_KS if k <= fewest):
        est = [pass_at_k(n, c, k) for c, n in counts]
        low, high = bootstrap_mean_ci(est, confidence=confidence)
        out.update({f"pass_at_{k}": statistics.fmean(est), f"pass_at_{k}_low": low, f"pass_at_{k}_high": high})
    return out


def paired_pass_diff(mine: Mapping[str, Mapping[str, Any]], ref: Mapping[str, Mapping[str, Any]], *, k: int = 1,
                     confidence: float = 0.95) -> PairedDiff | None:  # fmt: skip
    """pass@k(mine) - pass@k(ref) over the problems both have a verdict for (``problem id -> record``)
    with its interval: Tango's when every record of both holds one sample (k = 1: 0/1 outcomes), else
    the paired percentile bootstrap of the per-problem pass@k estimates (:func:`pass_fields`). None
    when they share no problem, or when one of those records has fewer than k samples."""
    common = sorted(p for p in set(mine) & set(ref)
                    if record_counts(mine[p]) is not None and record_counts(ref[p]) is not None)  # fmt: skip
    if not common:
        return None
    a = [record_counts(mine[p]) for p in common]
    b = [record_counts(ref[p]) for p in common]
    if any(n < k for _, n in a + b):
        return None
    if all(n == 1 for _, n in a + b):
        return paired_diff_ci([c == 1 for c, _ in a], [c == 1 for c, _ in b], confidence=confidence, method="tango")
    return paired_diff_ci([pass_at_k(n, c, k) for c, n in a], [pass_at_k(n, c, k) for c, n in b],
                          confidence=confidence, method="bootstrap")  # fmt: skip


def _groups(records: Iterable[Mapping[str, Any]], dataset: str | None):
    """(config key, method, drafter, t) -> {problem id: latest checked record}, drafter labels, order."""
    groups: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    labels: dict[str | None, str] = {}
    order: dict[str | None, int] = {}
    for r in records:
        if not is_timed(r) or r.get("error") or record_counts(r) is None:
            continue
        if dataset is not None and not _record_dataset(r, dataset):
            continue
        drafter = record_drafter(r)
        if drafter is not None:
            labels[drafter] = str(r.get("drafter_label") or drafter)
            order.setdefault(drafter, len(order))
        key = (r.get("config_key"), r["method"], drafter, r.get("tree_size"))
        by_problem = groups.setdefault(key, {})
        by_problem.pop(str(r["problem_id"]), None)
        by_problem[str(r["problem_id"])] = r
    return groups, labels, order


def default_reference(methods: Iterable[str]) -> str | None:
    """The first of :data:`DEFAULT_REFERENCES` among ``methods``, else None."""
    have = set(methods)
    return next((m for m in DEFAULT_REFERENCES if m in have), None)


def pass_rows(records: Iterable[Mapping[str, Any]], reference: str | None = None, *, dataset: str | None = None,
              confidence: float = 0.95) -> list[dict[str, Any]]:  # fmt: skip
    """One row per (configuration, method, drafter, tree size) with verdicts (latest record per
    problem): ``checked``, ``passed``, ``pass_at_1``, ``statuses``, and against ``reference`` (a
    method without drafter or tree size; default: :func:`default_reference`) over the problems
    both have: ``paired``, ``diff``, ``low``, ``high`` (Tango), ``better`` / ``worse`` (problems
    only this row / only the reference solved). With several samples per record: ``passed`` counts
    correct completions, ``statuses`` completions; the fields of :func:`pass_fields`
    (``samples``, ``pass_at_10``, ...); ``diff`` / ``low`` / ``high`` are pass@1's paired bootstrap
    difference and ``better`` / ``worse`` the problems whose estimate is higher / lower; and
    ``pass_at_{k}_diff`` (``_low`` / ``_high``) for the other k. ValueError naming ``reference``
    when it has no verdicts or is not one row."""

    groups, labels, order = _groups(records, dataset)
    methods = {k[1] for k in groups}
    if reference is None:
        reference = default_reference(m for (_, m, d, t) in groups if d is None and t is None)
    elif reference not in methods:
        raise ValueError(f"reference: no checked records of method {reference!r}; methods with verdicts: "
                         f"{', '.join(sorted(methods)) or 'none'}")  # fmt: skip
    elif any(k[1] == reference and (k[2] is not None or k[3] is not None) for k in groups):
        raise ValueError(f"reference: method {reference!r} has a row per drafter / tree size; choose a baseline "
                         f"({', '.join(sorted(m for (_, m, d, t) in groups if d is None and t is None)) or 'none'})")
    configs = list(dict.fromkeys(k[0] for k in groups))
    rows = []
    for key in sorted(groups, key=lambda k: (configs.index(k[0]), row_sort_key(k[1:], order))):
        cfg, method, drafter, t = key
        by_problem = groups[key]
        fields = pass_fields(by_problem, confidence=confidence)
        statuses = Counter()
        for r in by_problem.values():
            statuses.update(map(str, r["sample_status"]) if r.get("sample_status") else [str(r.get("check_status"))])
        row: dict[str, Any] = {
            "config_key": cfg, "method": method, "drafter": labels.get(drafter), "drafter_key": drafter,
            "tree_size": t, "checked": fields["checked"],
            "passed": sum(record_counts(r)[0] for r in by_problem.values()), "pass_at_1": fields["pass_at_1"],
            "statuses": dict(statuses), "reference": reference, "paired": None, "diff": None, "low": None,
            "high": None, "better": None, "worse": None,
        }  # fmt: skip
        row.update(fields)
        ref = groups.get((cfg, reference, None, None))
        if ref is not None and method != reference:
            d = paired_pass_diff(by_problem, ref, confidence=confidence)
            if d is not None:
                row.update(paired=d.n, diff=d.diff, low=d.low, high=d.high, better=d.a_better, worse=d.b_better)
            for k in (k for k in PASS_KS[1:] if f"pass_at_{k}" in fields):
                d = paired_pass_diff(by_problem, ref, k=k, confidence=confidence)
                if d is not None:
                    row.update({f"pass_at_{k}_diff": d.diff, f"pass_at_{k}_diff_low": d.low,
                                f"pass_at_{k}_diff_high": d.high})  # fmt: skip
        rows.append(row)
    return rows


def _pct(x: float | None, sign: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}%"


def _interval(low: float | None, high: float | None, sign: bool = False) -> str:
    return "-" if low is None else f"[{_pct(low, sign)}, {_pct(high, sign)}]"


def format_pass_table(rows: Sequence[Mapping[str, Any]], confidence: float = 0.95) -> str:
    """A Markdown table of :func:`pass_rows`: pass@1 and the difference to the reference in
    percentage points with its interval; a ``config`` column when there are several. With several
    samples per record also ``n`` (samples per problem), each pass@k's interval and, for k > 1,
    pass@k with its difference to the reference."""
    if not rows:
        return "no records with verdicts"
    several = len({r["config_key"] for r in rows}) > 1
    ref = next((r["reference"] for r in rows if r.get("reference")), None)
    sampled = any(r.get("samples") for r in rows)
    ks = [k for k in PASS_KS[1:] if any(r.get(f"pass_at_{k}") is not None for r in rows)]
    diff_head = [f"Δ vs {ref or 'reference'} (pp)", f"{confidence:.0%} interval (pp)"]
    head = ["method", "drafter", "t", "checked", "passed", "pass@1", *diff_head, "only this / only ref"]
    if sampled:
        head[3:6] = ["problems", "n", "correct", "pass@1", f"pass@1 {confidence:.0%} interval"]
        head[-1] = "higher / lower"
        for k in ks:
            head += [f"pass@{k}", f"pass@{k} {confidence:.0%} interval", f"Δpass@{k} (pp)",
                     f"Δpass@{k} interval (pp)"]  # fmt: skip
    if several:
        head.insert(0, "config")
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        cells = [r["method"], r["drafter"] or "-", "-" if r["tree_size"] is None else str(r["tree_size"]),
                 str(r["checked"]), str(r["passed"]), _pct(r["pass_at_1"]), _pct(r["diff"], sign=True),
                 _interval(r["low"], r["high"], sign=True),
                 "-" if r["better"] is None else f"{r['better']} / {r['worse']}"]  # fmt: skip
        if sampled:
            cells[4:4] = [str(r.get("samples") or 1)]
            cells[7:7] = [_interval(r.get("pass_at_1_low"), r.get("pass_at_1_high"))]
            for k in ks:
                cells += [_pct(r.get(f"pass_at_{k}")), _interval(r.get(f"pass_at_{k}_low"), r.get(f"pass_at_{k}_high")),
                          _pct(r.get(f"pass_at_{k}_diff"), sign=True),
                          _interval(r.get(f"pass_at_{k}_diff_low"), r.get(f"pass_at_{k}_diff_high"), sign=True)]
        if several:
            cells.insert(0, str(r["config_key"])[:10])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
