"""Problem sharding for a distributed evaluation: which problems a process runs, where it writes,
and how the shards' records become one result set again.

Every function here is pure (no collectives, no files written): a launcher (``torchrun
--nproc-per-node N -m specdec.cli sweep ...``) starts N processes, each reads its place from the
environment (``shard_env``), runs ``shard(problems, shard, num_shards)`` into
``shard_path(out, shard, num_shards)`` (resuming as a single process resumes from ``out``, with
the records of every shard file of the run counting as done), and afterwards
``merge(shard_paths(out, num_shards))`` gives the records a single process would have written (as
a set; in a fixed order).

Assignment is by position: problem ``i`` of the run's problem list (after the dataset's selection,
the same list in every process of the run) goes to shard ``i % world``. Shard sizes differ by at
most one (164 problems over 2 shards: 82 / 82), and neighbouring problems, often of similar cost,
spread over the shards. A problem's shard therefore depends on the list: a resumed run whose list
changed (more problems, another ``--problems`` or ``--difficulty``) may give a problem to another
shard than the one whose file holds its earlier records. So a shard resumes from every shard file
of its run (``shard_paths``): a record in any of them counts as done, and only new records go into
its own file; ``merge`` takes each key from the file that holds it (an error record yields to its
redo, which the problem's new shard made in its own file).

With a tensor-parallel target the processes of one TP group decode the same problem together: the
shard is the data-parallel index, ``rank // tp_size`` of ``world // tp_size`` shards
(``shard_env(tp_size=...)``), and only the group's first rank writes records.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "merge",
    "shard",
    "shard_env",
    "shard_path",
    "shard_paths",
]

_SHARD_RE = re.compile(r"^(?P<stem>.*)\.rank(?P<rank>\d+)-of-(?P<world>\d+)$")


def _check_place(rank, world, rank_name: str = "rank", world_name: str = "world") -> None:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"{world_name}: expected an int >= 1, got {world!r}")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world:
        raise ValueError(f"{rank_name}: expected an int in [0, {world}) ({world_name} = {world}), got {rank!r}")


def shard(problem_ids: Iterable[Any], rank: int, world: int) -> list[Any]:
    """The problems of shard ``rank`` of ``world``: those at positions ``rank, rank + world, ...``
    of ``problem_ids``, in their given order.

    Over ``rank = 0 .. world - 1`` the shards are disjoint and together hold every given problem;
    their sizes differ by at most one (``len(problem_ids) < world``: the last shards are empty).

    Raises:
        ValueError: ``world`` is not an int >= 1, ``rank`` not in ``[0, world)``, or ``problem_ids``
        is a string.
    """
    _check_place(rank, world)
    if isinstance(problem_ids, (str, bytes)):
        raise ValueError(f"problem_ids: expected an iterable of problem ids, got a {type(problem_ids).__name__}")
    return list(problem_ids)[rank::world]


def shard_path(out: str | os.PathLike[str], rank: int, world: int) -> Path:
    """The results file of shard ``rank`` of ``world``: ``out.jsonl`` -> ``out.rank{rank}-of-{world}.jsonl``
    (the suffix stays last; a name without one gets ``.rank{r}-of-{w}`` appended). ``world = 1``:
    ``out`` itself (a single process writes where it always did)."""
    _check_place(rank, world)
    path = Path(out)
    if world == 1:
        return path
    if _SHARD_RE.match(path.stem if path.suffix else path.name):
        raise ValueError(f"out: expected an unsharded results path, got the shard file {str(path)!r}")
    tag = f".rank{rank}-of-{world}"
    return path.with_name(f"{path.stem}{tag}{path.suffix}") if path.suffix else path.with_name(path.name + tag)


def shard_paths(out: str | os.PathLike[str], world: int) -> list[Path]:
    """Every shard file of ``out`` for ``world`` shards, by rank."""
    return [shard_path(out, r, world) for r in range(world)]


def shard_env(environ: Mapping[str, str] | None = None, tp_size: int = 1) -> tuple[int, int]:
    """``(shard, num_shards)`` of this process from its launcher's environment.

    ``RANK`` / ``WORLD_SIZE`` (torchrun, accelerate, deepspeed set both); else ``LOCAL_RANK`` with
    ``LOCAL_WORLD_SIZE`` or ``WORLD_SIZE`` (a single-node launcher that sets only those); else
    ``(0, 1)``: a single process. With ``tp_size`` > 1 (a tensor-parallel target: the ranks of a TP
    group, consecutive ranks as torchrun numbers them, decode the same problems) the shard is
    ``rank // tp_size`` of ``world // tp_size``.

    Raises:
        ValueError: naming the variable that is not a valid int (or a rank outside the world), or
        ``tp_size`` when it does not divide the world size.
    """
    env = os.environ if environ is None else environ

    def read(name: str) -> int | None:
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            return None
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}: expected an integer in the environment, got {raw!r}") from None

    rank, world = read("RANK"), read("WORLD_SIZE")
    rank_name, world_name = "RANK", "WORLD_SIZE"
    if rank is None:
        local = read("LOCAL_RANK")
        if local is None:
            rank, world = 0, 1
        else:
            rank, rank_name = local, "LOCAL_RANK"
            local_world = read("LOCAL_WORLD_SIZE")
            if local_world is not None:
                world, world_name = local_world, "LOCAL_WORLD_SIZE"
    if world is None:
        raise ValueError(f"{world_name}: expected it in the environment next to {rank_name}={rank}, got none")
    _check_place(rank, world, rank_name, world_name)
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1 or world % tp_size:
        raise ValueError(f"tp_size: expected an int >= 1 dividing {world_name} = {world}, got {tp_size!r}")
    return rank // tp_size, world // tp_size


def _default_key(rec: Mapping[str, Any]) -> Hashable | None:
    """``eval.records.record_key`` for timed records; None (never deduplicated) for side records
    (warm-up, calibration), which are per process by design."""
    from eval.records import is_timed, record_key

    return record_key(rec) if is_timed(rec) else None


def _canonical(key: Hashable) -> str:
    return json.dumps(key, sort_keys=True, default=str)


def merge(paths: Sequence[str | os.PathLike[str]],
          key: Callable[[Mapping[str, Any]], Hashable | None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """The records of several shard files as one result set.

    Within one file the last record of a key wins (a retried error replaced by its redo, as a
    resumed single-process run keeps its latest). Across files a key may appear in several with
    identical records (the same file given twice, a copied record), or as an error record (one
    with ``"error"``) in one file and a record without one in another, which wins: a problem whose
    record was an error moved to another shard when a resumed run's problem list changed, and that
    shard redid it into its own file. Among error records only, the first file's (by path) is kept.
    Records whose key is None (side records under the default key) are all kept. Missing files
    count as empty (a shard with no problems writes nothing).

    Args:
        paths: the shard files (``shard_paths(out, world)``), any order.
        key: record -> its identity (default: ``eval.records.record_key``; None for side records).

    Returns:
        The records: those without a key first (by file, in file order, files by path), then the
        keyed ones sorted by their key: the same list whatever order ``paths`` come in.

    Raises:
        ValueError: naming ``paths`` when two files hold different records of one key, neither an
        error (overlapping shards: e.g. files of runs with different shard counts), or a file is
        not JSON lines.
    """
    from eval.records import load_records

    if isinstance(paths, (str, bytes, os.PathLike)):
        raise ValueError(f"paths: expected a sequence of result files, got a single path {os.fspath(paths)!r}")
    key_fn = _default_key if key is None else key
    unkeyed: list[dict[str, Any]] = []
    keyed: dict[str, tuple[dict[str, Any], str]] = {}
    for path in sorted({str(Path(p)) for p in paths}):
        latest: dict[str, dict[str, Any]] = {}
        for rec in load_records(path):
            k = key_fn(rec)
            if k is None:
                unkeyed.append(rec)
            else:
                ck = _canonical(k)
                latest.pop(ck, None)
                latest[ck] = rec
        for ck, rec in latest.items():
            if ck not in keyed or (keyed[ck][0].get("error") and not rec.get("error")):
                keyed[ck] = (rec, path)
            elif keyed[ck][0] != rec and not rec.get("error"):
                raise ValueError(f"paths: {keyed[ck][1]} and {path} hold different records for the key {ck} "
                                 f"(overlapping shards: files of runs with different shard counts?)")  # fmt: skip
    return unkeyed + [keyed[ck][0] for ck in sorted(keyed)]
