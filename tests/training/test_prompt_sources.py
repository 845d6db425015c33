"""Training on a user's own prompts (tiny random models, CPU): ``--prompts`` JSONL prompts and chat
conversations, a ``datasets`` directory, one-line errors for bad rows, an interrupted data generation
that resumes, and prompts the target writes in the style of seed prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from drafters.eagle import CONFIG_NAME
from specdec import cli
from specdec.cli import train as train_cli
from tests.drafters.helpers import save_tiny_pair
from training import distill, sources
from training.exercises import parse_prompt, prompt_request, seed_choices, select_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

ROWS = [
    {"prompt": "Write a haiku about autumn."},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Capital of France?"}]},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                  {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5 (dropped)"}]},
    {"prompt": "Summarize: the meeting moved to Tuesday."},
    {"prompt": "Translate to French: thank you."},
    {"prompt": "List three prime numbers."},
]  # fmt: skip


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture
def target(tmp_path, monkeypatch):
    """A tiny saved target; MBPP pointed at a missing file (a run that reads it fails)."""
    monkeypatch.setenv("SPECDEC_MBPP", str(tmp_path / "no-mbpp.jsonl"))
    return str(save_tiny_pair(tmp_path)[0])


def _argv(target, out, *extra, command="eagle"):
    argv = ["--target", target, "--out", str(out), "--steps", "2", "--batch-size", "2", "--max-new-tokens", "6",
            "--gen-batch-size", "2", "--device", "cpu", "--no-progress", *extra]  # fmt: skip
    return argv + (["--unroll", "2"] if command == "eagle" else ["--num-heads", "2"])


def _cache(path: Path) -> tuple[dict, list[dict]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0]["meta"], lines[1:]


def test_train_eagle_on_jsonl_prompts_and_chat_conversations(target, tmp_path, capsys):
    data = _jsonl(tmp_path / "mine.jsonl", ROWS)
    out = tmp_path / "eagle"
    assert train_cli.main_eagle(_argv(target, out, "--prompts", str(data), "--heldout", "1")) == 0
    text = capsys.readouterr().out
    assert f"training prompts: 6 prompts (6 from {data}; 1 held out)" in text
    assert "training sequences: 5 (5 prompts x 1 answers" in text
    meta, rows = _cache(out / "selfdistill.jsonl")
    assert meta["prompts"] == 6 and len(meta["prompts_sha"]) == 16 and "styles" not in meta
    from specdec.models import load_tokenizer

    tok = load_tokenizer(target, progress=False)
    # the conversation's last user turn is answered, earlier turns are context, the recorded answer dropped
    want = tok.apply_chat_template(ROWS[2]["messages"][:3], add_generation_prompt=True, tokenize=False)
    assert tok.decode(rows[2]["ids"][: rows[2]["prompt_len"]]) == want
    assert want.endswith("<s>user\nAdd 2 and 3.</s>\n<s>assistant\n") and "dropped" not in want
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert (cfg["train_examples"], cfg["heldout_examples"]) == (5, 1) and cfg["train"]["prompts"] == str(data)
    assert not (out / "selfdistill.jsonl.partial").exists()
    # another file with as many prompts is another cache key: answered again, not reused
    other = _jsonl(tmp_path / "other.jsonl", [{"prompt": f"Question {i}?"} for i in range(6)])
    assert train_cli.main_eagle(_argv(target, out, "--prompts", str(other), "--heldout", "1")) == 0
    assert "cached answers" not in capsys.readouterr().out
    assert _cache(out / "selfdistill.jsonl")[0]["prompts_sha"] != meta["prompts_sha"]


def test_train_medusa_on_a_datasets_directory(target, tmp_path, capsys):
    import datasets

    datasets.Dataset.from_list([{"prompt": f"Tell me about the number {i}."} for i in range(10)]).save_to_disk(
        str(tmp_path / "ds"))
    out = tmp_path / "medusa"
    assert train_cli.main_medusa(_argv(target, out, "--prompts", str(tmp_path / "ds"), command="medusa")) == 0
    text = capsys.readouterr().out
    assert f"training prompts: 10 prompts (10 from {tmp_path / 'ds'}; 2 held out)" in text  # default: a fifth
    assert (out / "medusa_heads.safetensors").is_file()
    assert train_cli.main_medusa(_argv(target, out, "--prompts", str(tmp_path / "ds"), command="medusa")) == 0
    assert "self-distill: 10 cached answers" in capsys.readouterr().out


@pytest.mark.parametrize("row, message", [
    ({"promt": "typo"}, "bad.jsonl:3: expected exactly one of the fields 'prompt' (a string) and 'messages'"),
    ({"messages": [{"role": "user", "content": ""}]}, "bad.jsonl:3: field 'messages[0].content': expected a "
                                                      "non-empty string, got ''"),
    ({"messages": [{"role": "human", "content": "x"}]}, "bad.jsonl:3: field 'messages[0].role': expected one of "
                                                        "system, user, assistant, got 'human'"),
])  # fmt: skip
def test_a_bad_row_ends_the_run_with_one_line(target, tmp_path, capsys, row, message):
    data = _jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[1], row])
    out = tmp_path / "eagle"
    assert cli.main(["train-eagle", *_argv(target, out, "--prompts", str(data))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec train-eagle: error: ") and message in err[0]
    assert not (out / "selfdistill.jsonl").exists() and not (out / "selfdistill.jsonl.partial").exists()


def test_bad_source_flags_are_one_line_errors(target, tmp_path, capsys):
    data = _jsonl(tmp_path / "mine.jsonl", ROWS)
    for extra, message in ((["--self-prompts", "4"], "--self-prompts: the target writes N prompts in the style of "
                                                      "--seed-prompts FILE: give both"),
                           (["--seed-prompts", str(data)], "give both"),
                           (["--prompts", str(data), "--heldout", "6"], "--heldout: expected 0 <= heldout < the 6 "
                                                                        "prompts used, got 6"),
                           (["--prompts", str(data), "--exercises", "2"], "--exercises: exercises are written from "
                                                                          "MBPP problems")):  # fmt: skip
        assert cli.main(["train-eagle", *_argv(target, tmp_path / "o", *extra)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_an_interrupted_data_generation_resumes_from_what_it_wrote(target, tmp_path, capsys, monkeypatch):
    """Three batches of two prompts; the generation is interrupted in the third: the two finished
    batches are in CACHE.partial; the rerun generates only the third batch (a torn last line left
    by the interruption is ignored) and ends with the cache an uninterrupted run writes."""
    data = _jsonl(tmp_path / "mine.jsonl", ROWS)
    whole = tmp_path / "whole"
    assert train_cli.main_eagle(_argv(target, whole, "--prompts", str(data), "--heldout", "1", "--steps", "1")) == 0

    real, calls = distill._generate, []

    def interrupted(model, ids, mask, config):
        calls.append(ids.shape[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(model, ids, mask, config)

    monkeypatch.setattr(distill, "_generate", interrupted)
    out = tmp_path / "eagle"
    argv = _argv(target, out, "--prompts", str(data), "--heldout", "1", "--steps", "1")
    assert cli.main(["train-eagle", *argv]) == 130  # the command line's answer to an interruption
    partial = out / "selfdistill.jsonl.partial"
    assert not (out / "selfdistill.jsonl").exists()
    meta, done = _cache(partial)
    assert len({r["i"] for r in done}) == 4 and {r["i"] for r in done} < set(range(6))
    with open(partial, "a") as f:
        f.write('{"i": 5, "ids": [1, 2')  # a line torn mid-write
    calls.clear()
    monkeypatch.setattr(distill, "_generate", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    assert train_cli.main_eagle(argv) == 0
    assert calls == [2]  # only the unfinished batch
    assert "resuming with 4 of 6 answers already in" in capsys.readouterr().out
    assert not partial.exists()
    assert _cache(out / "selfdistill.jsonl") == _cache(whole / "selfdistill.jsonl")  # greedy: the same answers


def test_a_greedy_cache_for_another_prompt_list_lends_the_shared_answers(target, tmp_path, capsys, monkeypatch):
    """A greedy cache made for prompts A serves a run on A plus two new prompts (as MBPP's answers serve
    MBPP with ``--mix general``): only the new ones are generated, the shared ones are A's answers, and
    the cache is rewritten for the new list; a sampled run reuses nothing."""
    out = tmp_path / "eagle"
    first = _jsonl(tmp_path / "a.jsonl", ROWS[:4])
    assert train_cli.main_eagle(_argv(target, out, "--prompts", str(first), "--heldout", "1", "--steps", "1")) == 0
    _, before = _cache(out / "selfdistill.jsonl")
    real, calls = distill._generate, []
    monkeypatch.setattr(distill, "_generate", lambda *a: calls.append(a[1].shape[0]) or real(*a))
    more = _jsonl(tmp_path / "b.jsonl", ROWS[:6])
    assert train_cli.main_eagle(_argv(target, out, "--prompts", str(more), "--heldout", "1", "--steps", "1")) == 0
    assert calls == [2]  # the two new prompts, one batch
    assert "4 of 6 answers from" in capsys.readouterr().out
    meta, after = _cache(out / "selfdistill.jsonl")
    assert meta["prompts"] == 6 and after[:4] == before
    calls.clear()
    assert train_cli.main_eagle(_argv(target, out, "--prompts", str(more), "--heldout", "1", "--steps", "1",
                                      "--temperature", "0.7")) == 0  # fmt: skip
    assert sum(calls) == 6  # sampled answers are drawn anew


def test_seed_prompts_the_target_writes_more_prompts_in_their_style(target, tmp_path, capsys, monkeypatch):
    """--seed-prompts FILE --self-prompts N: N writing requests, each with seeds of one category;
    the kept prompts are saved as a prompt file and answered. A tiny random target writes no
    sensible text, so the selection is wrapped to keep a known prompt per answer."""
    seeds = _jsonl(tmp_path / "seeds.jsonl", [
        {"prompt": "Write a limerick about a cat.", "category": "writing"},
        {"prompt": "Write a sonnet about rain.", "category": "writing"},
        {"prompt": "What is 17 * 3?", "category": "math"},
    ])  # fmt: skip
    seen = []

    def keep_known(answers, seed_texts):
        answers = list(answers)
        seen.append((len(answers), list(seed_texts)))
        _, _, report = select_prompts(answers, seed_texts)
        return list(range(len(answers))), [f"Self-written question {i}?" for i in range(len(answers))], report

    monkeypatch.setattr(sources, "select_prompts", keep_known)
    monkeypatch.setattr(sources, "SELF_PROMPT_TOKENS", 8)
    out = tmp_path / "eagle"
    argv = _argv(target, out, "--seed-prompts", str(seeds), "--self-prompts", "5", "--heldout", "1")
    assert train_cli.main_eagle(argv) == 0
    text = capsys.readouterr().out
    assert seen[0][0] == 5 and seen[0][1][2] == "What is 17 * 3?"
    assert "self-written prompts: 0 kept of 5 written" in text  # (the real selection's count)
    assert "training prompts: 5 prompts (5 written by the target; 1 held out)" in text
    written = [json.loads(line) for line in (out / "self_prompts.jsonl").read_text().splitlines()]
    assert [w["category"] for w in written] == ["writing", "math", "writing", "math", "writing"]
    assert written[0] == {"id": "self-0", "category": "writing", "prompt": "Self-written question 0?"}
    meta, rows = _cache(out / "selfdistill.selfprompts.jsonl")
    assert meta["writing"] is True and meta["temperature"] == 0.8 and len(rows) == 5
    assert _cache(out / "selfdistill.jsonl")[0]["prompts"] == 5
    mtime = (out / "selfdistill.selfprompts.jsonl").stat().st_mtime_ns
    assert train_cli.main_eagle(argv) == 0  # both generations reused
    assert "self-written prompts: 5 cached answers" in capsys.readouterr().out
    assert (out / "selfdistill.selfprompts.jsonl").stat().st_mtime_ns == mtime


def test_writing_requests_parsing_and_selection():
    request = prompt_request(["Write a limerick.", "Write a sonnet."])
    assert "Request 1:\nWrite a limerick.\n\nRequest 2:\nWrite a sonnet." in request
    with pytest.raises(ValueError, match="seeds: expected one or more non-empty seed prompts"):
        prompt_request([" "])
    plan = seed_choices(["a", "a", "b", "a"], 4, seed=0)
    assert [c for c, _ in plan] == ["a", "b", "a", "b"]
    assert all(len(p) == 3 and set(p) <= {0, 1, 3} for c, p in plan if c == "a") and plan[1][1] == [2]
    assert plan == seed_choices(["a", "a", "b", "a"], 4, seed=0) != seed_choices(["a", "a", "b", "a"], 4, seed=1)
    assert parse_prompt('  **New request:** "Plan a trip to Rome."  ') == "Plan a trip to Rome."
    assert parse_prompt("Request 4: Explain tides.") == "Explain tides." and parse_prompt('""') is None
    kept_at, kept, report = select_prompts([("Explain tides.", True), ("explain  TIDES.", True), ("", True),
                                            ("Write a limerick.", True), ("Cut off mid", False),
                                            ("Plan a trip.", True)], ["Write a limerick."])  # fmt: skip
    assert (kept_at, kept) == ([0, 5], ["Explain tides.", "Plan a trip."])
    assert (report.written, report.kept, report.empty, report.unfinished, report.duplicate, report.copied) == (6, 2, 1, 1,
                                                                                                             1, 1)
    assert "2 kept of 6 written" in report.line()
