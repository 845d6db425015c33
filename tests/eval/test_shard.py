"""eval.shard: disjoint, complete, balanced problem shards by position; shard file names; merging shard files."""

from __future__ import annotations

import json

import pytest

from eval.records import record_key
from eval.shard import merge, shard, shard_env, shard_path, shard_paths


def _ids(n: int, kind: str) -> list:
    if kind == "int":
        return list(range(n))
    if kind == "apps":
        return [f"{4000 + 7 * i:04d}" for i in range(n)]
    return [f"HumanEval/{i}" for i in range(n)]


@pytest.mark.parametrize("kind", ["int", "apps", "humaneval"])
@pytest.mark.parametrize("n", [0, 1, 2, 7, 150, 1000])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 13])
def test_shards_are_disjoint_complete_and_ordered(n, world, kind):
    ids = _ids(n, kind)
    parts = [shard(ids, r, world) for r in range(world)]
    flat = [p for part in parts for p in part]
    assert sorted(flat, key=str) == sorted(ids, key=str)  # complete, nothing twice
    assert len(set(map(str, flat))) == len(flat)  # disjoint
    for r, part in enumerate(parts):  # each keeps the given order: positions r, r + world, ...
        assert part == [p for p in ids if p in set(part)]
        assert part == [ids[i] for i in range(r, n, world)]
    if world == 1:
        assert parts[0] == ids


@pytest.mark.parametrize("world", range(1, 14))
def test_shard_sizes_differ_by_at_most_one(world):
    for n in [*range(0, 3 * world + 2), 164, 1000]:
        sizes = [len(shard(range(n), r, world)) for r in range(world)]
        assert sum(sizes) == n and max(sizes) - min(sizes) <= 1, (n, sizes)
        assert sizes == sorted(sizes, reverse=True)  # the first n % world shards hold the one more
        if n < world:  # one problem each on the first n shards, none on the rest
            assert sizes == [1] * n + [0] * (world - n)


def test_humaneval_splits_evenly_and_neighbours_spread():
    ids = _ids(164, "humaneval")
    assert [len(shard(ids, r, 2)) for r in range(2)] == [82, 82]
    assert shard(ids, 1, 8)[:3] == ["HumanEval/1", "HumanEval/9", "HumanEval/17"]
    assert [len(shard(ids, r, 8)) for r in range(8)] == [21] * 4 + [20] * 4


def test_any_iterable_of_problems():
    assert shard(iter("abcde"), 1, 2) == ["b", "d"]
    assert shard((p for p in range(5)), 0, 3) == [0, 3]
    assert shard(range(10), 2, 4) == [2, 6]


@pytest.mark.parametrize("rank, world, match", [(0, 0, "world"), (2, 2, "rank"), (-1, 2, "rank"), (0, 1.5, "world"),
                                                (True, 2, "rank")])
def test_bad_place_raises(rank, world, match):
    with pytest.raises(ValueError, match=match):
        shard([1, 2], rank, world)
    with pytest.raises(ValueError, match=match):
        shard_path("out.jsonl", rank, world)


def test_problem_ids_must_not_be_a_string():
    with pytest.raises(ValueError, match="problem_ids"):
        shard("1234", 0, 2)


def test_shard_path_naming(tmp_path):
    assert shard_path("res/out.jsonl", 1, 4).as_posix() == "res/out.rank1-of-4.jsonl"
    assert shard_path("res/out.jsonl", 0, 1).as_posix() == "res/out.jsonl"
    assert shard_path("res/out", 2, 3).as_posix() == "res/out.rank2-of-3"
    assert shard_path("res/a.b.jsonl", 0, 2).as_posix() == "res/a.b.rank0-of-2.jsonl"
    assert [p.name for p in shard_paths(tmp_path / "x.jsonl", 3)] == [
        "x.rank0-of-3.jsonl", "x.rank1-of-3.jsonl", "x.rank2-of-3.jsonl"]
    with pytest.raises(ValueError, match="out"):
        shard_path("out.rank0-of-2.jsonl", 1, 2)


@pytest.mark.parametrize("env, tp, want", [
    ({}, 1, (0, 1)),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}, 1, (3, 4)),
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 1, (1, 2)),
    ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, 1, (1, 2)),
    ({"RANK": "5", "WORLD_SIZE": "8"}, 2, (2, 4)),
    ({"RANK": "1", "WORLD_SIZE": "2"}, 2, (0, 1)),
])
def test_shard_env(env, tp, want):
    assert shard_env(env, tp_size=tp) == want


@pytest.mark.parametrize("env, tp, match", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, 1, "RANK"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, 1, "RANK"),
    ({"RANK": "0"}, 1, "WORLD_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, 1, "WORLD_SIZE"),
    ({"LOCAL_RANK": "1"}, 1, "WORLD_SIZE"),
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"}, 1, "LOCAL_RANK"),
    ({"RANK": "0", "WORLD_SIZE": "3"}, 2, "tp_size"),
])
def test_shard_env_errors(env, tp, match):
    with pytest.raises(ValueError, match=match):
        shard_env(env, tp_size=tp)


def test_shard_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert shard_env() == (1, 3)


# ---------------------------------------------------------------------------------------- merge


def _record(pid, method="specdec", tree_size=64, **extra):
    return {"config_key": "c1", "dataset": "apps", "problem_id": pid, "method": method, "drafter": "lookup",
            "drafter_label": "lookup", "tree_size": tree_size, "tokens": [int(pid) % 7, 3], **extra}


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))


def _single_process_records(ids):
    recs = [{"kind": "warmup", "config_key": "c1", "method": "specdec", "tree_size": 64, "prep_s": 1.0}]
    for pid in ids:
        recs.append(_record(pid, "hf", None))
        recs.append(_record(pid))
    return recs


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_merge_of_shards_equals_the_single_process_records(tmp_path, world):
    ids = [f"{i:04d}" for i in range(40)]
    single = _single_process_records(ids)
    paths = shard_paths(tmp_path / "out.jsonl", world)
    for r, path in enumerate(paths):
        mine = shard(ids, r, world)
        recs = [dict(single[0], prep_s=float(r))]  # every process writes its own warm-up record
        # an error that was retried: the redo (later in the file) wins
        if mine:
            recs.append(_record(mine[0], error="boom"))
        recs += [rec for rec in single[1:] if rec["problem_id"] in mine]
        _write(path, recs)
    merged = merge(paths)
    timed = [r for r in merged if r.get("kind") != "warmup"]
    assert sorted(map(json.dumps, timed)) == sorted(map(json.dumps, single[1:]))
    assert len({record_key(r) for r in timed}) == len(timed)
    assert [r["prep_s"] for r in merged if r.get("kind") == "warmup"] == [float(r) for r in range(world)]
    # deterministic: the same list whatever order the files come in, and twice the same file is fine
    assert merge(list(reversed(paths))) == merged
    assert merge(paths + paths[:1]) == merged


def test_merge_conflict_raises_naming_paths(tmp_path):
    a, b = tmp_path / "out.rank0-of-2.jsonl", tmp_path / "out.rank1-of-2.jsonl"
    _write(a, [_record("0001", tokens=[1, 2])])
    _write(b, [_record("0001", tokens=[1, 3])])
    with pytest.raises(ValueError, match=r"paths: .*rank0-of-2.*rank1-of-2.*0001"):
        merge([a, b])


def test_merge_prefers_a_redo_in_another_file_to_an_error(tmp_path):
    """A problem whose record was an error moved to another shard (the problem list changed) and was
    redone there into that shard's file: the redo wins, whichever file comes first."""
    a, b, c = (tmp_path / f"out.rank{r}-of-3.jsonl" for r in range(3))
    _write(a, [_record("0001", tokens=None, error="RuntimeError: boom"), _record("0002")])
    _write(b, [_record("0001", tokens=[5, 6]), _record("0003", tokens=None, error="RuntimeError: again")])
    _write(c, [_record("0003", tokens=None, error="RuntimeError: first")])
    for paths in ([a, b, c], [c, b, a]):
        got = {r["problem_id"]: r for r in merge(paths)}
        assert sorted(got) == ["0001", "0002", "0003"]
        assert got["0001"]["tokens"] == [5, 6] and "error" not in got["0001"]
        assert got["0003"]["error"] == "RuntimeError: again"  # errors only: the first file's (by path)
    _write(c, [_record("0001", tokens=[5, 7])])  # two different records without an error still conflict
    with pytest.raises(ValueError, match=r"paths: .*rank1-of-3.*rank2-of-3.*0001"):
        merge([a, b, c])


def test_merge_identical_duplicates_and_missing_files(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _write(a, [_record("0001"), _record("0002")])
    _write(b, [_record("0002"), _record("0003")])
    got = merge([a, b, tmp_path / "missing.jsonl"])
    assert [r["problem_id"] for r in got] == ["0001", "0002", "0003"]


def test_merge_custom_key_and_bad_paths(tmp_path):
    a = tmp_path / "a.jsonl"
    _write(a, [{"id": 2, "v": 1}, {"id": 1, "v": 2}, {"id": 2, "v": 3}])
    assert merge([a], key=lambda r: r["id"]) == [{"id": 1, "v": 2}, {"id": 2, "v": 3}]
    with pytest.raises(ValueError, match="paths"):
        merge(str(a))
