"""The general training mix (``--mix general``): the built-in seed prompts, the prompt list the mix
builds (MBPP plus N self-written prompts per kind, tiny random target on the CPU), what the trained
drafter's config records, and one-line errors for bad values."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from drafters.eagle import CONFIG_NAME
from drafters.medusa import CONFIG_NAME as MEDUSA_CONFIG
from eval.datasets import load_prompt_file
from eval.workloads import SPECBENCH_CATEGORIES
from specdec import cli
from specdec.cli import train as train_cli
from tests.training.helpers import cli_argv
from training import sources
from training.eagle import EagleRun
from training.exercises import prompt_request, select_prompts
from training.medusa import MedusaRun

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_seeds_load_and_cover_every_kind_of_spec_bench():
    seeds = load_prompt_file(sources.GENERAL_SEEDS)
    per_kind = Counter(s.category for s in seeds)
    assert set(per_kind) == set(SPECBENCH_CATEGORIES)
    assert all(4 <= n <= 6 for n in per_kind.values()), per_kind
    texts = [s.last_user().strip() for s in seeds]
    assert len(set(texts)) == len(texts) and all(len(t) >= 20 for t in texts)
    assert all(s.turns[0][0] == "user" and len(s.turns) == 1 for s in seeds)
    # a passage and a question: every rag seed carries both
    assert all("?" in s.last_user() and "\n\n" in s.last_user() for s in seeds if s.category == "rag")
    for kind in per_kind:  # each kind makes a writing request
        assert "Request 1:" in prompt_request([s.last_user() for s in seeds if s.category == kind])


@pytest.fixture
def known_prompts(monkeypatch):
    """A tiny random target writes no sensible text: every answer is kept as a known prompt (the
    real selection's report is still printed), and the writing requests' seeds are recorded."""
    requests = []
    real_request = sources.prompt_request

    def record(seeds):
        requests.append(list(seeds))
        return real_request(seeds)

    def keep_known(answers, seed_texts):
        answers = list(answers)
        _, _, report = select_prompts(answers, seed_texts)
        return list(range(len(answers))), [f"Self-written request {i}?" for i in range(len(answers))], report

    monkeypatch.setattr(sources, "prompt_request", record)
    monkeypatch.setattr(sources, "select_prompts", keep_known)
    monkeypatch.setattr(sources, "SELF_PROMPT_TOKENS", 6)
    return requests


@pytest.mark.parametrize("command", ["eagle", "medusa"])
def test_the_general_mix_is_mbpp_plus_n_self_written_prompts_per_kind(tmp_path, capsys, known_prompts, command):
    argv, out = cli_argv(tmp_path, 10, 2, 5, "--mix", "general", "--mix-per-kind", "2", "--gen-batch-size", "16")
    if command == "medusa":
        at = argv.index("--unroll")
        argv = argv[:at] + argv[at + 2 :] + ["--num-heads", "2"]
    main = train_cli.main_eagle if command == "eagle" else train_cli.main_medusa
    assert main(argv) == 0
    text = capsys.readouterr().out
    kinds = list(dict.fromkeys(s.category for s in load_prompt_file(sources.GENERAL_SEEDS)))
    assert len(kinds) == 13
    # 2 writing requests per kind, the kinds taken in turn, each request showing seeds of one kind only
    by_text = {s.last_user(): s.category for s in load_prompt_file(sources.GENERAL_SEEDS)}
    assert [{by_text[t] for t in seeds} for seeds in known_prompts] == [{k} for k in kinds * 2]
    written = [json.loads(line) for line in (out / "self_prompts.jsonl").read_text().splitlines()]
    assert [w["category"] for w in written] == kinds * 2
    assert ("training prompts: 10 MBPP (10 problems x 1 styles, 2 problems held out) + 26 prompts (26 written by "
            "the target (general mix, 2 requests per kind); 0 held out)") in text  # fmt: skip
    assert "self-written prompts kept per kind: writing 2, roleplay 2," in text
    meta = json.loads((out / "selfdistill.jsonl").read_text().splitlines()[0])["meta"]
    assert meta["prompts"] == 36 and "prompts_sha" in meta
    cfg = json.loads((out / (CONFIG_NAME if command == "eagle" else MEDUSA_CONFIG)).read_text())
    assert cfg["train"]["mix"] == "general" and cfg["train"]["mix_per_kind"] == 2
    assert cfg["train"]["written_per_kind"] == {k: 2 for k in kinds}
    assert cfg["train_examples"] == 8 + 26 and cfg["heldout_examples"] == 2  # MBPP's last problems held out


def test_the_mix_reads_mbpp_and_the_seeds_and_asks_the_default_per_kind(tmp_path):
    data = tmp_path / "mbpp.jsonl"
    data.write_text("".join(json.dumps({"text": f"Task {i}.", "test_list": []}) + "\n" for i in range(10)))
    run = EagleRun(out=str(tmp_path), data=str(data), mix="general")
    got = sources.read_sources(run)
    assert len(got.rows) == 10 and len(got.seeds) == len(load_prompt_file(sources.GENERAL_SEEDS))
    assert sources.mix_per_kind(run) == sources.DEFAULT_PER_KIND and got.writes == 13 * sources.DEFAULT_PER_KIND
    assert sources.read_sources(EagleRun(out=str(tmp_path), data=str(data), mix="general", mix_per_kind=3)).writes == 39
    assert sources.mix_per_kind(EagleRun(out=str(tmp_path))) is None


def test_the_contest_seeds_state_stdin_programs_of_one_kind(tmp_path):
    seeds = load_prompt_file(sources.CONTEST_SEEDS)
    assert len(seeds) == 24 and {s.category for s in seeds} == {"contest"}
    texts = [s.last_user() for s in seeds]
    assert len(set(texts)) == len(texts)
    # each states its input and output and shows an example, and asks for a program on standard input
    assert all("Input:" in t and "Output:" in t and "Example" in t and "standard input" in t for t in texts)
    assert all(len(t) < 900 for t in texts)  # short enough to be imitated within SELF_PROMPT_TOKENS
    data = tmp_path / "mbpp.jsonl"
    data.write_text("".join(json.dumps({"text": f"Task {i}.", "test_list": []}) + "\n" for i in range(10)))
    run = EagleRun(out=str(tmp_path), data=str(data), mix="contest")
    got = sources.read_sources(run)
    assert len(got.rows) == 10 and [s.last_user() for s in got.seeds] == texts
    assert sources.mix_per_kind(run) == sources.CONTEST_PER_KIND and got.writes == sources.CONTEST_PER_KIND
    assert sources.read_sources(EagleRun(out=str(tmp_path), data=str(data), mix="contest", mix_per_kind=5)).writes == 5


def test_the_cli_parses_the_mix_into_the_run(monkeypatch, tmp_path):
    runs = []
    monkeypatch.setattr("training.eagle.run_eagle", runs.append)
    monkeypatch.setattr("training.medusa.run_medusa", runs.append)
    assert train_cli.main_eagle(["--out", str(tmp_path), "--mix", "general"]) == 0
    assert train_cli.main_medusa(["--out", str(tmp_path), "--mix", "general", "--mix-per-kind", "7"]) == 0
    assert train_cli.main_eagle(["--out", str(tmp_path)]) == 0
    assert isinstance(runs[0], EagleRun) and (runs[0].mix, runs[0].mix_per_kind) == ("general", None)
    assert isinstance(runs[1], MedusaRun) and (runs[1].mix, runs[1].mix_per_kind) == ("general", 7)
    assert (runs[2].mix, runs[2].mix_per_kind) == (None, None)


@pytest.mark.parametrize("extra, message", [
    (["--mix", "code"], "argument --mix: invalid choice: 'code'"),
    (["--mix", "general", "--mix-per-kind", "0"], "argument --mix-per-kind: expected an int >= 1, got 0"),
    (["--mix-per-kind", "3"], "--mix-per-kind: expected --mix too (requests per kind of a mix), got --mix-per-kind 3 "
                              "without --mix"),
    (["--mix", "general", "--self-prompts", "4"], "--mix: the general mix writes its prompts from its own seeds"),
    (["--mix", "general", "--seed-prompts", "SEEDS", "--self-prompts", "4"], "expected --mix or --seed-prompts FILE "
                                                                            "--self-prompts N, got --mix general with"),
])  # fmt: skip
def test_bad_mix_flags_are_one_line_errors(tmp_path, capsys, extra, message):
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text(json.dumps({"prompt": "Write a haiku."}) + "\n")
    argv = ["train-eagle", "--out", str(tmp_path / "o"), *[str(seeds) if a == "SEEDS" else a for a in extra]]
    try:  # the parser's own errors exit, the run's are returned
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec train-eagle: error: ") and message in err[0], err
    assert not (tmp_path / "o" / "selfdistill.jsonl").exists()


@pytest.mark.parametrize("fields, message", [
    ({"mix": "code"}, "mix: expected None or one of general, contest, got 'code'"),
    ({"mix": "general", "mix_per_kind": 0}, "mix_per_kind: expected None or an int >= 1, got 0"),
    ({"mix": "general", "mix_per_kind": True}, "mix_per_kind: expected None or an int >= 1, got True"),
    ({"mix_per_kind": 5}, "--mix-per-kind: expected --mix too"),
])  # fmt: skip
def test_bad_mix_fields_raise_naming_the_field(tmp_path, fields, message):
    for run in (EagleRun, MedusaRun):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            run(out=str(tmp_path), **fields)
