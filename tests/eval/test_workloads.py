"""General-text workloads: prompt files (JSONL prompts, chat conversations, datasets directories,
parquet / JSON) and Spec-Bench, their one-line errors, and ``specdec eval|sweep`` on them end to end
on tiny random models (CPU): a row per category and an overall row, no pass@1, second turns after
the target's own answer, resume, and ``check`` refusing them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import report
from eval.config import EvalConfig
from eval.datasets import SPECBENCH_CATEGORIES, chat_prompt, load_problems, load_prompt_file, load_specbench
from eval.workloads import ChatProblem, default_specbench_path
from specdec import cli
from tests.eval import tiny

DRAFTER = "tests.eval.tiny:make_drafter"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target, draft = tiny.save_pair(tmp_path_factory.mktemp("tiny"))
    return {"target": str(target), "draft": str(draft)}


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _specbench(path: Path) -> Path:
    """A small question file in Spec-Bench's format: two MT-bench questions (two turns) of two
    categories and one translation question (one turn)."""
    rows = [
        {"question_id": 81, "category": "writing", "turns": ["Write a poem about the sea.", "Now make it rhyme."]},
        {"question_id": 101, "category": "reasoning", "turns": ["Who is taller, A or B?", "And C?"],
         "reference": ["A", "C"]},
        {"question_id": 161, "category": "translation", "turns": ["Translate to German: good morning."]},
    ]  # fmt: skip
    return _jsonl(path, rows)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# ------------------------------------------------------------------------------------------------
# prompt files


def test_jsonl_prompts_and_chat_messages_answer_the_last_user_turn(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "Explain recursion."},
        "",
        {"id": "conv-7", "category": "chat", "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Name a prime."},
            {"role": "assistant", "content": "7 (a recorded answer: dropped)"}]},
    ])  # fmt: skip
    first, conv = load_prompt_file(path)
    assert (first.id, first.category, first.messages()) == ("1", "prompts", [{"role": "user", "content": "Explain recursion."}])
    assert (conv.id, conv.category, conv.difficulty) == ("conv-7", "chat", "chat")
    assert [m["role"] for m in conv.messages()] == ["system", "user", "assistant", "user"]
    assert conv.last_user() == "Name a prime."
    tok = tiny.make_tokenizer()
    assert chat_prompt(conv, tok).endswith("<|user|>Name a prime.\n<|assistant|>")
    assert chat_prompt(conv, None).endswith("User: Name a prime.\n\nAssistant:")  # no chat template
    assert [p.id for p in load_prompt_file(path, categories=["chat"])] == ["conv-7"]
    assert [p.id for p in load_problems("prompts", path, limit=1)] == ["1"]


def test_a_datasets_directory_parquet_and_json_read_through_datasets(tmp_path):
    import datasets

    rows = [{"prompt": "one", "messages": None}, {"prompt": None, "messages": [{"role": "user", "content": "two"}]}]
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "dir"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "dict"))
    ds.to_parquet(str(tmp_path / "p.parquet"))
    (tmp_path / "p.json").write_text(json.dumps([{"prompt": "one"}, {"messages": [{"role": "user", "content": "two"}]}]))
    for name in ("dir", "dict", "p.parquet", "p.json"):
        got = load_prompt_file(tmp_path / name)
        assert [(p.id, p.last_user()) for p in got] == [("0", "one"), ("1", "two")], name
    bad = datasets.Dataset.from_list([{"prompt": "ok"}, {"prompt": ""}])
    bad.save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=r"bad: row 1: field 'prompt': expected a non-empty string, got ''"):
        load_prompt_file(tmp_path / "bad")


@pytest.mark.parametrize("row, message", [
    ("{not json", r"p.jsonl:2: not valid JSON"),
    ([1, 2], r"p.jsonl:2: expected a JSON object with 'prompt' or 'messages', got list"),
    ({"text": "x"}, r"p.jsonl:2: expected exactly one of the fields 'prompt' .* got fields \['text'\]"),
    ({"prompt": "x", "messages": []}, r"p.jsonl:2: expected exactly one of the fields .* got both"),
    ({"prompt": 3}, r"p.jsonl:2: field 'prompt': expected a non-empty string, got int"),
    ({"messages": "hi"}, r"p.jsonl:2: field 'messages': expected a non-empty list"),
    ({"messages": [{"role": "bot", "content": "x"}]}, r"p.jsonl:2: field 'messages\[0\].role': expected one of "
                                                      r"system, user, assistant, got 'bot'"),
    ({"messages": [{"role": "user", "content": None}]}, r"p.jsonl:2: field 'messages\[0\].content': expected a string"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, r"p.jsonl:2: field 'messages': expected at least one "
                                                            r"turn with role 'user'"),
    ({"prompt": "x", "id": "1"}, r"p.jsonl:2: field 'id': '1' was already the id of .*p.jsonl:1"),
    ({"prompt": "x", "category": 5}, r"p.jsonl:2: field 'category': expected a non-empty string"),
])  # fmt: skip
def test_a_bad_row_names_the_file_the_line_and_the_field(tmp_path, row, message):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(ValueError, match=message) as info:
        load_prompt_file(path)
    assert "\n" not in str(info.value)


def test_missing_or_unknown_prompt_files(tmp_path):
    with pytest.raises(ValueError, match="path: .* which does not exist"):
        load_prompt_file(tmp_path / "none.jsonl")
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"path: expected a .jsonl / .json / .parquet file or a datasets directory"):
        load_prompt_file(tmp_path / "p.txt")
    with pytest.raises(ValueError, match="path: no prompts in"):
        load_prompt_file(_jsonl(tmp_path / "e.jsonl", [""]))
    with pytest.raises(ValueError, match=r"categories: \['code'\] not in"):
        load_prompt_file(_jsonl(tmp_path / "c.jsonl", [{"prompt": "x"}]), categories=["code"])
    with pytest.raises(ValueError, match="data_path: the prompts dataset needs a prompt file"):
        EvalConfig(dataset="prompts")


# ------------------------------------------------------------------------------------------------
# Spec-Bench


def test_specbench_first_turns_second_turns_and_categories(tmp_path):
    path = _specbench(tmp_path / "question.jsonl")
    assert [(p.id, p.category, p.turn) for p in load_specbench(path)] == [
        ("81", "writing", 1), ("101", "reasoning", 1), ("161", "translation", 1)]
    two = load_specbench(path, turns=2)
    assert [p.id for p in two] == ["81", "81/turn2", "101", "101/turn2", "161"]
    second = two[1]
    assert second.needs_answer and second.context is two[0] and second.turn == 2
    with pytest.raises(ValueError, match="the answer to the earlier turn is not known yet"):
        second.messages()
    assert second.with_answer("The sea is wide.").messages() == [
        {"role": "user", "content": "Write a poem about the sea."},
        {"role": "assistant", "content": "The sea is wide."}, {"role": "user", "content": "Now make it rhyme."}]
    assert [p.id for p in load_specbench(path, categories=["translation", "writing"], turns=2)] == ["81", "81/turn2", "161"]
    assert [p.id for p in load_specbench(path, turns=2, limit=1)] == ["81", "81/turn2"]
    with pytest.raises(ValueError, match="categories: expected one or more of writing, .*, got \\['poetry'\\]"):
        load_specbench(path, categories=["poetry"])
    with pytest.raises(ValueError, match="turns: expected 1 or 2, got 3"):
        load_specbench(path, turns=3)
    _jsonl(path, [{"question_id": 1, "category": "writing", "turns": ["a"]}, {"question_id": 2, "category": "x", "turns": ["b"]}])
    with pytest.raises(ValueError, match=r"question.jsonl:2: field 'category': expected one of writing"):
        load_specbench(path)
    _jsonl(path, [{"question_id": 1, "category": "writing", "turns": ["a", ""]}])
    with pytest.raises(ValueError, match=r"question.jsonl:1: field 'turns\[1\]': expected a non-empty string"):
        load_specbench(path)
    with pytest.raises(ValueError, match="turns: second turns are Spec-Bench's only"):
        EvalConfig(dataset="prompts", data_path=str(path), turns=2)
    with pytest.raises(ValueError, match="categories: only Spec-Bench and prompt files"):
        EvalConfig(dataset="humaneval", categories=("writing",))
    with pytest.raises(ValueError, match="pad_prompt_to: few-shot padding is for the code datasets"):
        EvalConfig(dataset="specbench", pad_prompt_to=100)


def test_a_few_specbench_questions_cover_the_categories_in_turn(tmp_path):
    from eval.prompts import load_eval_problems

    path = _specbench(tmp_path / "question.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"question_id": 82, "category": "writing", "turns": ["Write a toast.", "Shorter."]}) + "\n")
    cfg = EvalConfig(dataset="specbench", data_path=str(path), problems=3, turns=2)
    chosen, pool = load_eval_problems(cfg)
    assert [p.id for p in chosen] == ["81", "81/turn2", "101", "101/turn2", "161"] and len(pool) == 7
    cfg = EvalConfig(dataset="specbench", data_path=str(path), problems=4, categories=("writing", "translation"))
    assert [p.id for p in load_eval_problems(cfg)[0]] == ["81", "161", "82"]


def test_the_shared_specbench_file_has_480_questions_in_13_categories():
    path = default_specbench_path()
    if not path.is_file():
        pytest.skip(f"{path} is not here")
    problems = load_specbench(path)
    assert len(problems) == 480
    counts = {c: sum(p.category == c for p in problems) for c in SPECBENCH_CATEGORIES}
    assert counts == {**dict.fromkeys(SPECBENCH_CATEGORIES[:8], 10), **dict.fromkeys(SPECBENCH_CATEGORIES[8:], 80)}
    assert len(load_specbench(path, turns=2)) == 560


# ------------------------------------------------------------------------------------------------
# end to end


def _argv(pair, out, *extra):
    return ["--target", pair["target"], "--draft", pair["draft"], "--drafter", DRAFTER, "--tree-sizes", "4",
            "--methods", "specdec", "specdec-plain", "hf", "hf-static", "--max-new-tokens", "5", "--device", "cpu",
            "--attn-impl", "torch", "--out", str(out), "--warmup", "0", "--no-progress", *extra]  # fmt: skip


def test_cli_eval_prompts_on_a_tiny_file(pair, tmp_path, capsys):
    data = _jsonl(tmp_path / "traffic.jsonl", [
        {"prompt": "Summarize: the cat sat on the mat.", "category": "summary"},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                      {"role": "user", "content": "Count to three."}], "category": "chat"},
    ])  # fmt: skip
    out = tmp_path / "prompts.jsonl"
    assert cli.main(["eval", "prompts", "--data", str(data), "--problems", "0", *_argv(pair, out)]) == 0
    recs = _lines(out)
    assert {(r["dataset"], r["problem_id"], r["difficulty"], r["turn"]) for r in recs} == {
        ("prompts", "1", "summary", 1), ("prompts", "2", "chat", 1)}
    assert {r["method"] for r in recs} == {"specdec", "specdec-plain", "hf", "hf-static"}
    assert all(r["match"] is True and "passed" not in r for r in recs)
    text = capsys.readouterr().out
    assert "pass@1: none -- a prompt file has no tests" in text
    assert "| category | method |" in text and "vs specdec-plain" in text
    for cat in ("summary", "chat", "overall"):
        assert f"| {cat} | specdec | {DRAFTER} | 4 |" in text


def test_cli_sweep_specbench_second_turns_categories_and_resume(pair, tmp_path, capsys, monkeypatch):
    from eval.methods import Session

    data = _specbench(tmp_path / "question.jsonl")
    out = tmp_path / "sb.jsonl"
    answers = []
    real = Session.answer
    monkeypatch.setattr(Session, "answer", lambda self, prompt: answers.append(prompt.shape) or real(self, prompt))
    argv = ["sweep", "--dataset", "specbench", "--data", str(data), "--problems", "0", "--turns", "2",
            "--categories", "writing", "translation", *_argv(pair, out)]  # fmt: skip
    assert cli.main(argv) == 0
    recs = _lines(out)
    timed = [r for r in recs if "kind" not in r]
    assert {(r["problem_id"], r["difficulty"], r["turn"]) for r in timed} == {
        ("81", "writing", 1), ("81/turn2", "writing", 2), ("161", "translation", 1)}
    context = [r for r in recs if r.get("kind") == "context"]
    assert [c["problem_id"] for c in context] == ["81"] and len(answers) == 1
    # the second turn's prompt holds the first turn, the target's greedy answer to it, then the second turn
    hf = {r["problem_id"]: r for r in timed if r["method"] == "hf"}
    assert hf["81/turn2"]["prompt_len"] > hf["81"]["prompt_len"]
    assert context[0]["token_ids"] == hf["81"]["token_ids"]  # the same greedy target-only answer
    captured = capsys.readouterr().out
    assert "pass@1: none -- Spec-Bench has no tests" in captured
    for cat in ("writing", "translation", "overall"):
        assert f"| {cat} | specdec | {DRAFTER} | 4 |" in captured
    summary = json.loads((tmp_path / "sb.summary.json").read_text())
    assert {r["category"] for r in summary["categories"]} == {"writing", "translation", "overall"}
    assert summary["note"].startswith("pass@1: none")
    spec = next(r for r in summary["rows"] if r["method"] == "specdec")
    assert spec["speedup_vs_specdec_plain"] > 0 and spec["tau"] >= 1 and spec["problems"] == 3
    # a rerun resumes: no new generation, no new answer to the first turn
    assert cli.main(argv) == 0
    assert len(_lines(out)) == len(recs) and len(answers) == 1
    assert "0 new record(s)" in capsys.readouterr().out


def test_check_refuses_datasets_without_tests(pair, tmp_path, capsys):
    data = _specbench(tmp_path / "question.jsonl")
    out = tmp_path / "sb.jsonl"
    assert cli.main(["eval", "specbench", "--data", str(data), "--check", *_argv(pair, out)]) == 2
    assert "error: --check: specbench has no tests, so no pass@1" in capsys.readouterr().err
    assert not out.exists()
    _jsonl(out, [{"dataset": "specbench", "problem_id": "81", "method": "hf", "text": "x", "config_key": "k"}])
    assert cli.main(["check", str(out)]) == 2
    err = capsys.readouterr().err
    assert "specbench has no tests, so no pass@1" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["check", str(out), "--dataset", "prompts"]) == 2
    assert "error: --dataset: prompts has no tests" in capsys.readouterr().err


def test_category_rows_pool_each_category_and_overall():
    def rec(pid, cat, method, tokens, wall, t=None, drafter=None):
        r = {"config_key": "k", "dataset": "specbench", "problem_id": pid, "difficulty": cat, "method": method,
             "tree_size": t, "new_tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}  # fmt: skip
        if drafter:
            r.update(drafter=drafter, drafter_label=drafter, steps={"emitted": [2, 2], "accepted": [1, 1],
                     "nodes": [4, 4], "depth": [2, 2], "draft_s": [0, 0], "verify_s": [0, 0], "commit_s": [0, 0]})
        return r

    recs = [rec("1", "qa", "specdec-plain", 10, 1.0), rec("1", "qa", "specdec", 10, 0.5, 4, "d"),
            rec("2", "rag", "specdec-plain", 10, 1.0), rec("2", "rag", "specdec", 10, 0.25, 4, "d"),
            {"kind": "context", "config_key": "k", "problem_id": "1", "text": "x"}]  # fmt: skip
    rows = report.category_rows(recs)
    got = {(r["category"], r["method"]): r for r in rows}
    assert got[("qa", "specdec")]["speedup_vs_specdec_plain"] == pytest.approx(2.0)
    assert got[("rag", "specdec")]["speedup_vs_specdec_plain"] == pytest.approx(4.0)
    assert got[("overall", "specdec")]["speedup_vs_specdec_plain"] == pytest.approx((20 / 0.75) / (20 / 2.0))
    assert got[("overall", "specdec")]["problems"] == 2  # the context record is no row's call
    assert "| overall | specdec | d | 4 |" in report.format_category_table(rows)
    assert isinstance(ChatProblem("x", (("user", "q"),)).plain_prompt(), str)
