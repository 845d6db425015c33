"""The evaluation runner end to end on tiny random models (CPU): records, resume, greedy checks,
prompt padding, HumanEval, sampling, drafter factories, several drafters in one sweep (baselines
once per problem), interruption and resume, stalls, and the ``specdec eval`` / ``sweep`` CLIs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from eval import config as C
from eval import methods as M
from eval import records as R
from eval import report, runner
from eval import prompts as P
from eval.config import DrafterSpec, EvalConfig
from eval.methods import Method, MethodOutput
from specdec import cli
from tests.eval import tiny

DRAFTER = "tests.eval.tiny:make_drafter"
NEW = 10


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target, draft = tiny.save_pair(root)
    data = tiny.apps_rows(root / "apps.jsonl", n=3)
    return {"target": str(target), "draft": str(draft), "data": str(data)}


@pytest.fixture(scope="module")
def loaded(pair):
    from specdec.models import load_model, load_tokenizer

    return load_model(pair["target"]), load_tokenizer(pair["target"]), load_model(pair["draft"])


def _cfg(pair, out, **over) -> EvalConfig:
    kw = dict(dataset="apps", target=pair["target"], draft=pair["draft"], drafters=(DRAFTER,), tree_sizes=(4, 8),
              problems=2, data_path=pair["data"], max_new_tokens=NEW, dtype="fp32", device="cpu", out=str(out),
              attn_impl="torch", warmup=0, progress=False)  # fmt: skip
    kw.update(over)
    return EvalConfig(**kw)


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _broken(session, prompt, tree_size):
    """The reference's tokens with the one at position 3 changed: a lossy 'method'."""
    res = session.hf_generate(prompt)
    ids = list(res.token_ids)
    ids[3] = (ids[3] + 1) % tiny.VOCAB
    return MethodOutput(ids, res.wall_s)


BROKEN = {"broken": Method("broken", _broken)}


# ------------------------------------------------------------------------------------------------
# end to end


def test_end_to_end_records_and_resume(pair, tmp_path):
    out = tmp_path / "r.jsonl"
    cfg = _cfg(pair, out, methods=("specdec", "specdec-plain", *C.BASELINE_METHODS))
    res = runner.run_eval(cfg)
    assert not res.failed and not res.mismatches and res.strict
    recs = _lines(out)
    keys = [(r["problem_id"], r["method"], r["tree_size"]) for r in recs]
    assert len(keys) == len(set(keys)) == 2 * (2 + 1 + 4)  # specdec x 2 t, plain, 4 baselines
    assert {r["problem_id"] for r in recs} == {"100", "101"}
    assert recs[0]["method"] == C.REFERENCE  # the reference runs first
    for r in recs:
        assert r["error"] is None and r["config_key"] == C.config_key(cfg)
        assert r["new_tokens"] == len(r["token_ids"]) > 0 and r["new_tokens"] <= NEW
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0 and r["prompt_len"] > 50
        assert r["match"] is True and r["first_divergence"] is None  # fp32 greedy: every method equals hf
    for r in (r for r in recs if r["method"] == "specdec"):
        s = r["steps"]
        assert {len(v) for v in s.values()} == {r["num_steps"]}
        assert sum(s["emitted"]) == r["new_tokens"]
        assert all(0 < n <= r["tree_size"] and 1 <= d <= n for n, d in zip(s["nodes"], s["depth"]))
        assert all(a <= d for a, d in zip(s["accepted"], s["depth"]))
        assert r["tau"] == pytest.approx(r["new_tokens"] / r["num_steps"])
        timed = r["prefill_s"] + sum(s["draft_s"]) + sum(s["verify_s"]) + sum(s["commit_s"])
        assert 0 < r["prefill_s"] and timed <= r["wall_s"]  # the phases lie inside the generate call
        assert 1 <= len(r["tree_samples"]) <= C.TREE_SAMPLES and r["tree_samples"][0][0] == -1
    plain = [r for r in recs if r["method"] == "specdec-plain"]
    assert all(r["tree_size"] is None and r["num_steps"] == r["new_tokens"] for r in plain)

    # Resume: nothing is redone; a new tree size adds only its own records.
    again = runner.run_eval(cfg)
    assert (again.new, again.skipped) == (0, len(recs)) and len(_lines(out)) == len(recs)
    more = runner.run_eval(_cfg(pair, out, tree_sizes=(4, 8, 16), methods=("specdec", "hf")))
    assert more.new == 2 and {r["tree_size"] for r in _lines(out)[len(recs):]} == {16}
    assert len(more.records) == len(recs) + 2

    # A run killed mid-write leaves half a line: it is dropped and the file repaired.
    with open(out, "a") as f:
        f.write('{"config_key": "x", "meth')
    n = len(recs) + 2
    assert runner.run_eval(cfg).new == 0
    assert len(_lines(out)) == n

    # Another configuration (here: more new tokens) does not reuse these records.
    other = _cfg(pair, out, max_new_tokens=NEW + 1, methods=("hf",), problems=1)
    assert C.config_key(other) != C.config_key(cfg) and runner.run_eval(other).new == 1


def test_broken_method_is_a_greedy_mismatch(pair, loaded, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    res = runner.run_eval(_cfg(pair, out, methods=("hf", "broken")), models=loaded, extra_methods=BROKEN)
    assert res.strict and res.failed
    bad = [r for r in _lines(out) if r["method"] == "broken"]
    assert len(bad) == 2 and all(r["match"] is False and r["first_divergence"] == 3 for r in bad)
    assert all(0 < r["agreement"] < 1 for r in bad)
    assert {r["problem_id"] for r in res.mismatches} == {"100", "101"}
    assert "GREEDY MISMATCH (fp32: failure)" in capsys.readouterr().err

    # In bf16 the same difference is reported, not a failure.
    res16 = runner.run_eval(_cfg(pair, tmp_path / "b.jsonl", methods=("broken",), dtype="bf16", problems=1),
                       extra_methods=BROKEN)  # fmt: skip
    assert not res16.strict and not res16.failed and len(res16.mismatches) == 1
    from eval.report import agreement_summary

    text = agreement_summary(res16.records)
    assert "broken: 0/1 identical; first divergence 100@3" in text and "GREEDY MISMATCH" not in text


def test_cli_exit_code_on_mismatch(pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(M.METHODS, "broken", BROKEN["broken"])
    argv = ["eval", "apps", "--problems", "1", "--data", pair["data"], "--target", pair["target"], "--draft", "",
            "--methods", "hf", "broken", "--max-new-tokens", "6", "--dtype", "fp32", "--device", "cpu",
            "--out", str(tmp_path / "r.jsonl"), "--warmup", "0", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert "GREEDY MISMATCH problem 100 method broken" in captured.err
    assert "| broken |" in captured.out and "<-- GREEDY MISMATCH" in captured.out


def test_method_errors_are_recorded_and_retried(pair, loaded, tmp_path):
    calls = []

    def flaky(session, prompt, tree_size):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated)")
        return session.hf_generate(prompt)

    extra = {"flaky": Method("flaky", flaky)}
    cfg = _cfg(pair, tmp_path / "r.jsonl", methods=("hf", "flaky"), problems=1)
    res = runner.run_eval(cfg, models=loaded, extra_methods=extra)
    assert res.failed and res.errors[0]["error"] == "RuntimeError: out of memory (simulated)"
    res2 = runner.run_eval(cfg, models=loaded, extra_methods=extra)  # only the failed one runs again
    assert res2.new == 1 and not res2.failed and res2.records[-1]["match"] is True
    assert len(res2.records) == 2


def test_sampling_runs_without_comparison(pair, loaded, tmp_path):
    cfg = _cfg(pair, tmp_path / "r.jsonl", temperature=0.8, tree_sizes=(4,), problems=1,
               methods=("specdec", "hf", "hf-lookup"))  # fmt: skip
    res = runner.run_eval(cfg, models=loaded)
    assert not res.failed and not res.strict and len(res.records) == 3
    assert all(r["match"] is None and r["new_tokens"] > 0 for r in res.records)
    again = runner.run_eval(cfg, models=loaded)
    assert again.new == 0


def test_humaneval_through_the_same_path(pair, tmp_path, capsys):
    out = tmp_path / "he.jsonl"
    argv = ["eval", "humaneval", "--problems", "1", "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", DRAFTER, "--tree-sizes", "4", "--methods", "specdec", "hf", "--max-new-tokens", "4",
            "--device", "cpu", "--attn-impl", "torch", "--out", str(out), "--warmup", "0", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    recs = _lines(out)
    assert {(r["dataset"], r["problem_id"], r["method"]) for r in recs} == {
        ("humaneval", "HumanEval/0", "hf"), ("humaneval", "HumanEval/0", "specdec")}
    assert all(r["match"] is True and r["dtype"] == "fp32" for r in recs)
    assert f"| specdec | {DRAFTER} | 4 |" in capsys.readouterr().out


def test_mbpp_through_the_same_path(pair, tmp_path, capsys):
    """MBPP (the tuning set) runs as HumanEval does: HumanEval-shaped prompts, then pass@1 checks."""
    from eval import passk

    row = {"task_id": 2, "text": "Add one.", "code": "def inc(n):\n  return n + 1", "test_setup_code": "",
           "test_list": ["assert inc(1) == 2"], "challenge_test_list": []}  # fmt: skip
    data = tmp_path / "mbpp.jsonl"
    data.write_text(json.dumps(row) + "\n")
    out = tmp_path / "mbpp_out.jsonl"
    argv = ["eval", "mbpp", "--data", str(data), "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", DRAFTER, "--tree-sizes", "4", "--methods", "specdec", "hf", "--max-new-tokens", "4",
            "--device", "cpu", "--attn-impl", "torch", "--out", str(out), "--warmup", "0", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    recs = _lines(out)
    assert {(r["dataset"], r["problem_id"], r["difficulty"], r["method"]) for r in recs} == {
        ("mbpp", "MBPP/2", "mbpp", "hf"), ("mbpp", "MBPP/2", "mbpp", "specdec")}
    assert all(r["match"] is True for r in recs)
    res = passk.check_file(out, data=data, progress=False, workers=1)
    assert (res.dataset, res.checked) == ("mbpp", 2)
    assert all("check_status" in r for r in _lines(out))


def test_sweep_cli_and_report_only(pair, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    base = ["sweep", "--problems", "1", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", DRAFTER, "--tree-sizes", "4", "8", "--methods", "specdec", "hf", "hf-static",
            "--max-new-tokens", "6", "--device", "cpu", "--attn-impl", "torch", "--out", str(out), "--warmup", "0",
            "--no-progress"]  # fmt: skip
    assert cli.main(base) == 0
    captured = capsys.readouterr()
    assert "attention timing: skipped (needs a CUDA device" in captured.err
    assert f"| specdec | {DRAFTER} | 8 |" in captured.out
    assert (tmp_path / "s.csv").read_text().splitlines()[0].startswith("method,drafter,tree_size,drafter_key,problems")
    summary = json.loads((tmp_path / "s.summary.json").read_text())
    assert {(r["method"], r["drafter"], r["tree_size"]) for r in summary["rows"]} == {
        ("hf", None, None), ("hf-static", None, None), ("specdec", DRAFTER, 4), ("specdec", DRAFTER, 8)}
    assert summary["config"]["drafters"] == [{"key": DRAFTER, "label": DRAFTER, "name": DRAFTER, "options": {}}]
    assert "stall" in summary["definitions"] and "itl" in summary["definitions"]
    (tmp_path / "s.csv").unlink()
    assert cli.main([*base, "--report-only"]) == 0
    assert (tmp_path / "s.csv").exists()
    assert len(_lines(out)) == 4  # report-only ran nothing


def test_sweep_with_the_auto_tree_size_records_its_budgets(pair, tmp_path, capsys):
    out = tmp_path / "a.jsonl"
    argv = ["sweep", "--problems", "1", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", DRAFTER, "--tree-sizes", "4", "auto", "--methods", "specdec", "hf", "--max-new-tokens", "8",
            "--device", "cpu", "--attn-impl", "torch", "--out", str(out), "--warmup", "1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert f"| specdec | {DRAFTER} | auto |" in captured.out and f"| specdec | {DRAFTER} | 4 |" in captured.out
    recs = [r for r in _lines(out) if r.get("kind") is None and r["method"] == "specdec"]
    auto = next(r for r in recs if r["tree_size"] == "auto")
    fixed = next(r for r in recs if r["tree_size"] == 4)
    assert auto["match"] is True and fixed["match"] is True  # fp32 greedy equals hf under the chosen budgets
    assert sum(auto["budget_steps"].values()) == auto["num_steps"] == len(auto["steps"]["budget"])
    assert set(auto["budget_steps"]) <= {"0", "4", "8", "16", "32", "64"}
    assert auto["budget_reason"].startswith("budget ") and "n=64:" in auto["budget_reason"]
    assert "budget_steps" not in fixed and "budget" not in fixed["steps"]
    summary = json.loads((tmp_path / "a.summary.json").read_text())
    assert [r["tree_size"] for r in summary["rows"] if r["method"] == "specdec"] == [4, "auto"]
    with pytest.raises(SystemExit):
        cli.main([*argv[:-3], "--tree-sizes", "big"])


def test_baselines_and_speculative_methods_in_two_runs_share_one_report(pair, loaded, tmp_path, capsys):
    """The device plan of the APPS sweep: baselines first (the Medusa heads need not exist yet), the
    speculative method later into the same file with the same settings; one report pairs them."""
    from drafters.medusa import MedusaHeads

    out, heads = tmp_path / "split.jsonl", tmp_path / "heads"
    base = ["sweep", "--problems", "2", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", "medusa", "--drafter-option", f"heads={heads}", "--tree-sizes", "4", "--max-new-tokens", "6",
            "--device", "cpu", "--attn-impl", "torch", "--out", str(out), "--warmup", "0", "--no-progress"]  # fmt: skip
    assert cli.main([*base, "--methods", "hf", "hf-static"]) == 0
    assert not heads.exists() and len(_lines(out)) == 4
    # Without its heads the speculative run stops before its first problem (no error records).
    assert cli.main([*base, "--methods", "specdec"]) == 2
    assert "--drafters: heads=" in capsys.readouterr().err  # checked before the target loads
    assert len(_lines(out)) == 4
    hidden = loaded[0].get_output_embeddings().weight.shape[1]
    MedusaHeads(hidden, 2).save(heads)
    assert cli.main([*base, "--methods", "specdec"]) == 0
    assert len({r["config_key"] for r in _lines(out)}) == 1 and len(_lines(out)) == 6
    summary = json.loads((tmp_path / "split.summary.json").read_text())
    rows = {(r["method"], r["drafter"], r["tree_size"]): r for r in summary["rows"]}
    assert set(rows) == {("hf", None, None), ("hf-static", None, None), ("specdec", "medusa", 4)}
    row = rows[("specdec", "medusa", 4)]
    assert row["problems"] == 2 and row["speedup_vs_hf_static"] is not None
    assert row["drafter_key"] == f"medusa:heads={heads}"
    assert "| specdec | medusa | 4 |" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# pieces


def test_pad_prompt_to(pair, loaded):
    from eval.datasets import load_apps, prompt_ids

    tok = loaded[1]
    pool = load_apps(pair["data"])
    short = [len(prompt_ids(p, tok)) for p in pool[:2]]
    padded = P.pad_problems(pool[:2], pool, tok, 400)
    lens = [len(prompt_ids(p, tok)) for p in padded]
    assert all(n >= 400 for n in lens) and all(n > s for n, s in zip(lens, short))
    text = padded[0].messages()[0]["content"]
    assert pool[1].question in text and pool[2].question in text and text.count(pool[0].question) == 1
    assert text.endswith(pool[0].messages()[0]["content"])  # the problem itself comes last
    assert padded[0].id == pool[0].id and padded[0].difficulty == pool[0].difficulty
    with pytest.raises(ValueError, match="pad_prompt_to: 5000 tokens not reached for problem 100"):
        P.pad_problems(pool[:1], pool, tok, 5000)


def test_pad_prompt_in_run(pair, loaded, tmp_path):
    res = runner.run_eval(_cfg(pair, tmp_path / "r.jsonl", methods=("hf",), pad_prompt_to=300), models=loaded)
    assert all(r["prompt_len"] >= 300 and r["pad_prompt_to"] == 300 for r in res.records)


def test_compare_tokens_and_tree_depth():
    assert R.compare_tokens([1, 2, 3], [1, 2, 3]) == (True, None, 1.0)
    assert R.compare_tokens([1, 2, 3, 4], [1, 2, 9, 4]) == (False, 2, 0.5)
    assert R.compare_tokens([1, 2], [1, 2, 3, 4]) == (False, 2, 0.5)  # one a prefix of the other
    assert M.tree_depth([-1]) == 0
    assert M.tree_depth([-1, 0, 1, 1, 0, 4]) == 2


def test_build_drafter(loaded):
    target, tok, draft = loaded
    d = M.build_drafter(DRAFTER, target=target, draft=draft, tokenizer=tok, tree_size=3, device="cpu")
    assert d.max_depth == 3 and d.model is draft  # only the keywords the factory declares were passed
    with pytest.raises(ValueError, match="drafter: could not import factory 'tests.eval.nope:f'"):
        M.build_drafter("tests.eval.nope:f")
    real = M.build_drafter("model", target=target, draft=draft, tokenizer=tok, tree_size=8, device="cpu",
                           dtype=target.dtype, depth=2, topk=3)  # fmt: skip
    assert (type(real).__name__, real.depth, real.topk, real.model) == ("DraftModelDrafter", 2, 3, draft)


@pytest.mark.parametrize("drafter, options", [("model", (("depth", 2), ("topk", 2))), ("lookup", ())])
def test_real_drafters_by_name(pair, loaded, tmp_path, drafter, options):
    spec = DrafterSpec(drafter, options)
    cfg = _cfg(pair, tmp_path / "r.jsonl", drafters=(spec,), tree_sizes=(8,), problems=1,
               methods=("specdec", "hf"))  # fmt: skip
    res = runner.run_eval(cfg, models=loaded)
    assert not res.failed and [r["match"] for r in res.records] == [True, True]
    rec = res.records[1]
    assert (rec["drafter"], rec["drafter_name"], rec["drafter_label"]) == (spec.key, drafter, drafter)
    assert rec["drafter_options"] == dict(options) and "drafter" not in res.records[0]  # hf: no drafter


def test_drafter_option_parsing():
    assert C.parse_options(["depth=4", "heads=/x/y", "flag=true", "s=a=b"]) == (
        ("depth", 4), ("heads", "/x/y"), ("flag", True), ("s", "a=b"))
    with pytest.raises(ValueError, match="--drafter-option: expected KEY=VALUE, got 'depth'"):
        C.parse_options(["depth"])


def test_recording_drafter_delegates(loaded):
    import torch

    from specdec.drafting import DraftContext

    inner = tiny.make_drafter(loaded[2], 4)
    rec = M.RecordingDrafter(inner)
    assert rec.vocab_size == tiny.VOCAB and rec.width == 2
    rec.reset([torch.tensor([5, 6])])
    tree = rec.propose(DraftContext(torch.tensor([5, 6]), 4))
    assert len(rec.parents) == 1 and torch.equal(rec.parents[0], tree.parents)
    assert rec.parents[0] is not tree.parents  # a copy: drafters may reuse one buffer
    # A step's sequences at once: the inner drafter's propose_batch where it has one, every tree recorded.
    contexts = [DraftContext(torch.tensor([5, 6]), 4, seq=0), DraftContext(torch.tensor([7, 8, 9]), 4, seq=1)]
    calls = []
    inner.propose_batch = lambda cs: calls.append(len(cs)) or [inner.propose(c) for c in cs]
    trees = rec.propose_batch(contexts)
    assert calls == [2] and len(trees) == 2 and len(rec.parents) == 3
    assert all(torch.equal(p, t.parents) for p, t in zip(rec.parents[1:], trees))


def test_load_records_errors(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(ValueError, match=r"r.jsonl: line 2: not a JSON object"):
        R.load_records(p)
    assert R.load_records(tmp_path / "missing.jsonl") == []
    p.write_text('{"a": 1}\n{"b": 2}')  # complete last record without its newline
    assert R.load_records(p, repair=True) == [{"a": 1}, {"b": 2}]
    assert p.read_text().endswith("}\n")


def test_config_validation(pair, tmp_path):
    with pytest.raises(ValueError, match="tree_sizes: expected one or more ints >= 1"):
        _cfg(pair, tmp_path / "r.jsonl", tree_sizes=(0,))
    with pytest.raises(ValueError, match="dtype: expected one of auto, fp32, bf16, fp16, got 'f8'"):
        _cfg(pair, tmp_path / "r.jsonl", dtype="f8")
    with pytest.raises(ValueError, match=r"methods: unknown \['nope'\]"):
        runner.run_eval(_cfg(pair, tmp_path / "r.jsonl", methods=("nope",)), models=(None, None, None))
    with pytest.raises(ValueError, match="drafters: method 'specdec' needs at least one drafter"):
        runner.run_eval(_cfg(pair, tmp_path / "r.jsonl", drafters=(), methods=("specdec",)), models=(None, None, None))


@pytest.mark.parametrize("command", [["eval", "--help"], ["sweep", "--help"]])
def test_cli_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(command)
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--tree-sizes" in out and "--pad-prompt-to" in out and "--out" in out and "--seed" in out
    if command[0] == "sweep":
        assert "--report-only" in out


def test_compile_changes_the_config_key(pair, tmp_path):
    from dataclasses import replace

    cfg = _cfg(pair, tmp_path / "c.jsonl")
    assert not cfg.compile and C.config_key(replace(cfg, compile=True)) != C.config_key(cfg)


# ------------------------------------------------------------------------------------------------
# several drafters in one sweep, interruption and resume, stalls


def _hf_kind(kwargs) -> str:
    if "cache_implementation" in kwargs:
        return "hf-static"
    if "assistant_model" in kwargs:
        return "hf-assisted"
    if "prompt_lookup_num_tokens" in kwargs:
        return "hf-lookup"
    return "hf"


@pytest.fixture
def counted(monkeypatch):
    """Counts of HF generate calls per method, engine calls and drafter builds."""
    from collections import Counter

    counts = Counter()
    hf_generate, speculative, build = M.Session.hf_generate, M.Session.speculative, M.build_drafter

    def hf(self, prompt, **kw):
        counts[_hf_kind(kw)] += 1
        return hf_generate(self, prompt, **kw)

    def spec(self, prompt, tree_size):
        counts["specdec" if tree_size else "specdec-plain"] += 1
        return speculative(self, prompt, tree_size)

    def builder(name, **kw):
        counts[f"build {name} t={kw.get('tree_size')}"] += 1
        return build(name, **kw)

    monkeypatch.setattr(M.Session, "hf_generate", hf)
    monkeypatch.setattr(M.Session, "speculative", spec)
    monkeypatch.setattr(M, "build_drafter", builder)
    return counts


def test_sweep_two_drafters_two_tree_sizes_shares_the_baselines(pair, tmp_path, capsys, counted):
    out = tmp_path / "multi.jsonl"
    argv = ["sweep", "--problems", "2", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafters", DRAFTER, "lookup:max_ngram=2", "--tree-sizes", "4", "8", "--methods", "specdec",
            *C.BASELINE_METHODS, "--max-new-tokens", "6", "--device", "cpu", "--attn-impl", "torch", "--out", str(out),
            "--warmup", "1", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    lines = _lines(out)
    timed = [r for r in lines if r.get("kind") != "warmup"]
    warm = [r for r in lines if r.get("kind") == "warmup"]
    # every baseline once per problem, every (drafter, t) once per problem
    keys = [(r["problem_id"], r["method"], r.get("drafter"), r["tree_size"]) for r in timed]
    assert len(keys) == len(set(keys)) == 2 * (4 + 2 * 2)
    for base in C.BASELINE_METHODS:
        assert sorted(r["problem_id"] for r in timed if r["method"] == base) == ["100", "101"]
        assert "drafter" not in next(r for r in timed if r["method"] == base)
    assert {(r["drafter"], r["tree_size"]) for r in timed if r["method"] == "specdec"} == {
        (DRAFTER, 4), (DRAFTER, 8), ("lookup:max_ngram=2", 4), ("lookup:max_ngram=2", 8)}
    # the calls made: 2 timed per baseline + its warm-up (HF static: compile, then replay)
    assert {k: counted[k] for k in C.BASELINE_METHODS} == {"hf": 3, "hf-static": 4, "hf-assisted": 3, "hf-lookup": 3}
    assert counted["specdec"] == 2 * 4 + 4  # timed + one warm-up per (drafter, t)
    # each drafter built once per tree size, not per problem
    assert {k: v for k, v in counted.items() if k.startswith("build")} == {
        f"build {DRAFTER} t=4": 1, f"build {DRAFTER} t=8": 1, "build lookup t=4": 1, "build lookup t=8": 1}
    assert len(warm) == 4 + 4 and all(w["warmup_walls"] and w["error"] is None for w in warm)
    assert all(w["prep_s"] is not None for w in warm if w["method"] == "specdec")
    # every record has emission times; HF's streamer saw every kept token
    for r in timed:
        assert len(r["emit_t"]) == len(r["emit_n"]) > 0 and sum(r["emit_n"]) >= r["new_tokens"]
        assert r["emit_t"] == sorted(r["emit_t"]) and r["emit_t"][-1] <= r["wall_s"]
    # one table, one CSV, one summary with a row per (method, drafter, t)
    printed = capsys.readouterr().out
    assert printed.count("| method | drafter | t |") == 1
    assert f"| specdec | {DRAFTER} | 8 |" in printed and "| specdec | lookup | 4 |" in printed
    summary = json.loads((tmp_path / "multi.summary.json").read_text())
    rows = {(r["method"], r["drafter"], r["tree_size"]): r for r in summary["rows"]}
    assert len(rows) == 4 + 4 and ("specdec", "lookup", 8) in rows
    for row in rows.values():
        assert row["first_call_s"] > 0 and row["stalls"] is not None and row["itl_p50_ms"] is not None
        assert row["steady_tokens_per_s"] > 0 and row["ttft_p50_ms"] > 0
    assert rows[("specdec", "lookup", 4)]["speedup_vs_hf_static"] is not None
    assert len((tmp_path / "multi.csv").read_text().splitlines()) == 1 + 8


def test_resume_after_an_interruption_and_with_an_added_drafter(pair, loaded, tmp_path, monkeypatch, counted):
    out = tmp_path / "r.jsonl"
    cfg = _cfg(pair, out, methods=("specdec", "hf", "hf-static"))
    speculative = M.Session.speculative  # the counting one
    calls = []

    def interrupted(self, prompt, tree_size):
        calls.append(tree_size)
        if len(calls) == 3:  # problem 101, t = 4
            raise KeyboardInterrupt
        return speculative(self, prompt, tree_size)

    monkeypatch.setattr(M.Session, "speculative", interrupted)
    with pytest.raises(KeyboardInterrupt):
        runner.run_eval(cfg, models=loaded)
    # method order: the reference first, then as given: hf, specdec t = 4, 8, hf-static
    assert [(r["problem_id"], r["method"]) for r in _lines(out)] == [
        ("100", "hf"), ("100", "specdec"), ("100", "specdec"), ("100", "hf-static"), ("101", "hf")]
    monkeypatch.setattr(M.Session, "speculative", speculative)
    counted.clear()
    res = runner.run_eval(cfg, models=loaded)
    calls = {k: v for k, v in counted.items() if not k.startswith("build")}
    assert (res.new, res.skipped, calls) == (3, 5, {"specdec": 2, "hf-static": 1})  # nothing recomputed
    assert len(res.records) == 8 and not res.failed

    # killed mid-write: the last three records lost, half a line left
    text = out.read_text().splitlines(keepends=True)
    out.write_text("".join(text[:-3]) + text[-3][:20])
    counted.clear()
    res = runner.run_eval(cfg, models=loaded)
    assert (res.new, res.skipped) == (3, 5) and counted["specdec"] + counted["hf-static"] + counted["hf"] == 3

    # a drafter added to the run: only its records are computed, the baselines are reused
    counted.clear()
    more = _cfg(pair, out, methods=("specdec", "hf", "hf-static"), drafters=(DRAFTER, "lookup"))
    assert C.config_key(more) == C.config_key(cfg)
    res = runner.run_eval(more, models=loaded)
    assert (res.new, dict(counted)) == (4, {"specdec": 4, "build lookup t=4": 1, "build lookup t=8": 1})  # no baseline
    recs = [r for r in _lines(out) if r.get("kind") != "warmup"]
    keys = [R.record_key(r) for r in recs]
    assert len(keys) == len(set(keys)) == 2 * (2 + 2 * 2)
    assert all(r["match"] is True for r in res.records)


def test_stall_detector_flags_an_injected_sleep(pair, loaded, tmp_path, monkeypatch):
    import time

    from eval import report

    target = loaded[0]
    generate = target.generate
    calls = []

    def sleepy(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # 1: warm-up, 2: problem 100, 3: problem 101
            time.sleep(1.5)
        return generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", sleepy)
    data = tiny.apps_rows(tmp_path / "apps5.jsonl", n=5)  # five calls: a median robust to a busy machine
    cfg = _cfg(pair, tmp_path / "s.jsonl", methods=("hf",), problems=5, warmup=1, data_path=str(data))
    res = runner.run_eval(cfg, models=loaded)
    assert len(calls) == 6 and len(res.warmups) == 1 and len(res.records) == 5
    (row,) = report.summarize(res.all_records)
    assert row["stalls"] >= 1 and "101" in row["stall_problems"] and row["stall_s"] >= 1.5
    assert row["steady_tokens_per_s"] > row["tokens_per_s"] and row["first_call_s"] > 0
    assert "| stalls | stall s |" in report.format_table([row]).splitlines()[0]

    # without warm-up the first timed call is flagged and kept out of the steady state
    res0 = runner.run_eval(_cfg(pair, tmp_path / "f.jsonl", methods=("hf",), problems=2, warmup=0), models=loaded)
    assert [r.get("first_call", False) for r in res0.records] == [True, False] and not res0.warmups
    (row0,) = report.summarize(res0.all_records)
    assert row0["first_calls"] == 1 and row0["steady_calls"] == 1 and row0["first_call_s"] == res0.records[0]["wall_s"]


@pytest.mark.parametrize("extra, message", [
    (["--drafters", "nope"], "specdec sweep: error: --drafters: unknown drafter 'nope'"),
    (["--drafters", "model:depth"], "specdec sweep: error: --drafters: malformed option 'depth'"),
    (["--drafters", "lookup", "--drafter", "model"], "specdec sweep: error: --drafters: give the drafters either"),
    (["--drafter-option", "depth=2"], "specdec sweep: error: --drafter-option: needs --drafter NAME"),
    (["--drafter", "nope"], "specdec sweep: error: --drafter: unknown drafter 'nope'"),
])  # fmt: skip
def test_cli_rejects_bad_drafters(pair, tmp_path, capsys, extra, message):
    argv = ["sweep", "--target", pair["target"], "--out", str(tmp_path / "x.jsonl"), "--no-progress", *extra]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)
    assert not (tmp_path / "x.jsonl").exists()


def test_a_drafter_with_its_own_draft_model_loads_it_once(pair, loaded, tmp_path, monkeypatch):
    import specdec.models

    loads = []
    load_model = specdec.models.load_model

    def counting(name, **kw):
        loads.append(name)
        return load_model(name, **kw)

    monkeypatch.setattr(specdec.models, "load_model", counting)
    spec = f"own=model:draft={pair['draft']},depth=2,topk=2"
    cfg = _cfg(pair, tmp_path / "d.jsonl", draft=None, drafters=(spec,), methods=("specdec", "hf"), warmup=1)
    res = runner.run_eval(cfg, models=(loaded[0], loaded[1], None))
    assert loads == [pair["draft"]]  # once, for two tree sizes and two problems
    assert not res.failed and len(res.records) == 2 * (1 + 2) and all(r["match"] is True for r in res.records)
    assert {r["drafter_label"] for r in res.records if r["method"] == "specdec"} == {"own"}


def test_checker_hook_gives_pass_at_1(pair, loaded, tmp_path):
    from types import SimpleNamespace

    from eval import report

    seen = []

    def checker(problem, text):
        seen.append((problem.id, text))
        return SimpleNamespace(passed=problem.id == "100", status="pass" if problem.id == "100" else "wrong_answer")

    res = runner.run_eval(_cfg(pair, tmp_path / "p.jsonl", methods=("hf",)), models=loaded, checker=checker)
    assert [(r["passed"], r["check_status"]) for r in res.records] == [(True, "pass"), (False, "wrong_answer")]
    assert [t for _, t in seen] == [r["text"] for r in res.records]
    (row,) = report.summarize(res.all_records)
    assert (row["checked"], row["pass_at_1"]) == (2, 0.5) and "| pass@1 |" in report.format_table([row]).splitlines()[0]


def test_eagle_sweep_records_draft_phases_only_when_profiled(pair, loaded, tmp_path, capsys):
    """``eagle:heads=DIR,profile=true``: every step's record holds the drafter's phase seconds (inside
    its ``draft_s``) and the summary their mean ms per step; without ``profile`` neither appears."""
    import torch

    from drafters.eagle import DRAFT_PHASES
    from tests.drafters.helpers import random_eagle_head

    target = loaded[0]
    head = random_eagle_head(target)
    head.set_token_counts(torch.arange(tiny.VOCAB) % 7)  # for draft_vocab
    head.save(tmp_path / "eagle")
    out = tmp_path / "e.jsonl"
    plain = f"eagle:heads={tmp_path / 'eagle'}"
    profiled = f"{plain},profile=true,draft_vocab=200"
    argv = ["sweep", "--problems", "2", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafters", f"p={profiled}", f"e={plain}", "--tree-sizes", "8", "--methods", "specdec", "hf",
            "--max-new-tokens", "12", "--device", "cpu", "--dtype", "fp32", "--attn-impl", "torch", "--out", str(out),
            "--warmup", "0", "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    timed = [r for r in _lines(out) if r["method"] == "specdec"]
    assert len(timed) == 4 and all(r["match"] is True for r in timed)  # greedy fp32: the target's tokens
    for r in timed:
        steps = r["steps"]
        if r["drafter_label"] == "e":
            assert "draft_phases" not in steps
            continue
        phases = steps["draft_phases"]
        assert len(phases) == len(steps["draft_s"]) == r["num_steps"] > 0
        for p, draft_s in zip(phases, steps["draft_s"]):
            assert list(p) == [*DRAFT_PHASES, "update"] and min(p.values()) >= 0
            assert sum(p.values()) <= draft_s + 1e-4
    rows = {r["drafter"]: r for r in json.loads((tmp_path / "e.summary.json").read_text())["rows"]
            if r["method"] == "specdec"}  # fmt: skip
    ms = rows["p"]["draft_phase_ms"]
    assert list(ms) == [*DRAFT_PHASES, "update"] and 0 < sum(ms.values()) <= rows["p"]["draft_ms"] + 0.1
    assert "draft_phase_ms" not in rows["e"] and rows["e"]["draft_ms"] > 0


def test_a_compile_option_builds_that_drafters_engine_compiled(pair, loaded, tmp_path, monkeypatch):
    """``compile=true`` in a drafter spec: that drafter's engine gets ``SpecDecoder(compile=True)`` (static
    shapes), the others' do not; the factory never sees the option."""
    import specdec

    from eval.config import parse_drafter_spec
    from eval.methods import Session

    made, seen = [], []
    monkeypatch.setattr(specdec, "SpecDecoder", lambda *a, **kw: made.append(kw) or object())
    target, tok, draft = loaded
    cfg = _cfg(pair, tmp_path / "r.jsonl", drafters=(f"{DRAFTER}:compile=true", DRAFTER))
    session = Session(cfg, target, tok, draft, drafter_factory=lambda spec, **kw: seen.append(kw) or object())
    for spec in cfg.drafters:
        session.drafter = spec
        session.decoder(4)
    assert [(kw["compile"], kw["static_shapes"]) for kw in made] == [(True, True), (False, None)]
    assert all("compile" not in kw for kw in seen)
    assert parse_drafter_spec(f"{DRAFTER}:compile=true").key != parse_drafter_spec(DRAFTER).key
    # a drafter whose constructor takes compile (the draft model's forwards) gets it too; others do not
    seen.clear()
    for text in ("model:compile=true", "lookup:compile=true", "model"):
        session.drafter = parse_drafter_spec(text)
        session.decoder(4)
    assert [kw.get("compile") for kw in seen] == [True, None, None]


# ------------------------------------------------------------------------------------------------
# several samples per problem (--samples n): one batched call per method, pass@k


def test_sweep_with_samples_batches_each_method_and_resumes(pair, tmp_path, capsys, monkeypatch):
    from collections import Counter

    import transformers

    shapes = Counter()  # (method, returned rows) of every HF generate call
    generate = transformers.GenerationMixin.generate

    def counting(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        shapes[(_hf_kind(kwargs), kwargs.get("num_return_sequences", 1), out.shape[0])] += 1
        return out

    monkeypatch.setattr(transformers.GenerationMixin, "generate", counting)
    out = tmp_path / "k.jsonl"
    argv = ["sweep", "--problems", "2", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", DRAFTER, "--tree-sizes", "4", "--methods", "specdec", "hf", "hf-static", "hf-assisted",
            "--samples", "4", "--temperature", "0.8", "--max-new-tokens", "6", "--device", "cpu", "--attn-impl",
            "torch", "--out", str(out), "--warmup", "1", "--no-progress", "--no-attn"]  # fmt: skip
    assert cli.main([*argv, "--check", "--check-workers", "2", "--check-timeout", "2"]) == 0
    captured = capsys.readouterr()
    assert "skipping 'hf-assisted': it makes one sequence per call, not 4 samples at once (--samples)" in captured.err
    lines = _lines(out)
    timed = [r for r in lines if r.get("kind") != "warmup"]
    assert sorted((r["problem_id"], r["method"]) for r in timed) == [
        ("100", "hf"), ("100", "hf-static"), ("100", "specdec"), ("101", "hf"), ("101", "hf-static"), ("101", "specdec")]
    for r in timed:
        assert r["num_samples"] == 4 and len(r["sample_token_ids"]) == len(r["sample_texts"]) == 4
        assert r["sample_new_tokens"] == [len(s) for s in r["sample_token_ids"]] and max(r["sample_new_tokens"]) <= 6
        assert r["new_tokens"] == sum(r["sample_new_tokens"]) and r["tokens_per_s"] == r["new_tokens"] / r["wall_s"]
        assert "token_ids" not in r and "text" not in r and "emit_t" not in r and r["match"] is None
        assert len(r["sample_passed"]) == 4 and r["num_correct"] == 0  # --check: every sample (random models fail)
    assert len({tuple(s) for r in timed for s in r["sample_token_ids"]}) > 4  # samples differ
    spec = [r for r in timed if r["method"] == "specdec"]
    for r in spec:  # per step: sums over the sequences still decoding ('active')
        s = r["steps"]
        assert s["active"][0] == 4 and all(1 <= a <= 4 for a in s["active"]) and sum(s["emitted"]) == r["new_tokens"]
        assert r["tau"] == pytest.approx(r["new_tokens"] / sum(s["active"]))
    # HF: one call per problem returning 4 rows (+ warm-ups: hf 1, hf-static 2); hf-static's cache sized by HF
    assert shapes == {("hf", 4, 4): 3, ("hf-static", 4, 4): 4}
    assert all(w["warmup_tokens"][0] >= 4 for w in lines if w.get("kind") == "warmup")  # every sample's tokens
    summary = json.loads((tmp_path / "k.summary.json").read_text())
    rows = {r["method"]: r for r in summary["rows"]}
    assert {r["samples"] for r in rows.values()} == {4} and summary["config"]["samples"] == 4
    assert {(r["pass_at_1"], r["pass_at_10"]) for r in rows.values()} == {(0.0, None)}  # 4 samples: no pass@10
    new, wall = sum(r["new_tokens"] for r in spec), sum(r["wall_s"] for r in spec)
    assert rows["specdec"]["tokens_per_s"] == pytest.approx(new / wall)
    pairs = sum(sum(r["steps"]["active"]) for r in spec)  # tau: tokens per (step, decoding sequence)
    assert rows["specdec"]["tau"] == pytest.approx(new / pairs) and rows["specdec"]["steps"] < pairs
    assert "| n |" in captured.out.splitlines()[0]
    # resume: nothing is generated again; the single-sample run of the same settings is another configuration
    shapes.clear()
    assert cli.main(argv) == 0 and not shapes and len(_lines(out)) == len(lines)
    at = argv.index("--samples")
    assert cli.main([*argv[:at], *argv[at + 2 :], "--methods", "hf", "--problems", "1"]) == 0
    assert "token_ids" in _lines(out)[-1] and "num_samples" not in _lines(out)[-1]


def _recording_decoders(monkeypatch, made: list, **force):
    """Record every ``SpecDecoder`` the session builds (its keyword arguments, then ``force`` applied)."""
    import specdec

    real = specdec.SpecDecoder

    def recording(*args, **kwargs):
        kwargs.update(force)
        dec = real(*args, **kwargs)
        made.append((kwargs, dec))
        return dec

    monkeypatch.setattr(specdec, "SpecDecoder", recording)


def test_samples_run_on_the_shared_layout_and_match_the_copy_layout(pair, loaded, tmp_path, monkeypatch):
    """``--samples 3``: the engine keeps each prompt's KV once (``shared_prefix=True``; its rows' cache
    has the small bucket of 1 + NEW + t slots), its warm-up builds every cache the timed calls use, and
    its samples are, per problem, the tokens of the copy layout under the same seeds; each record says
    which layout it used. The copy layout is ``shared_prompt=False`` (``--no-shared-prompt``): each row
    holds its prompt's KV (one ``max_cache_len`` bucket of n rows, ``shared_prefix=False``), under a
    configuration key of its own (no record of the shared run reused)."""
    t = 4
    shared_made: list = []
    _recording_decoders(monkeypatch, shared_made)
    cfg = _cfg(pair, tmp_path / "s.jsonl", methods=("specdec",), tree_sizes=(t,), temperature=0.8, samples=3,
               problems=2, warmup=1)  # fmt: skip
    shared = runner.run_eval(cfg, models=loaded)
    assert not shared.failed
    (kwargs, dec), = shared_made
    prompt_lens = sorted({r["prompt_len"] for r in shared.records})
    top = max(prompt_lens) + NEW + t
    assert kwargs["shared_prefix"] is True and kwargs["cache_buckets"] == (1 + NEW + t, top)
    assert "max_cache_len" not in kwargs and dec.shared_prefix
    assert sorted(dec.caches) == [(1, top), (3, 1 + NEW + t)]  # the prompt once; the rows: 15 slots, not `top`
    assert all(r["shared_prompt"] is True and r["num_samples"] == 3 for r in shared.records)
    copy_made: list = []
    _recording_decoders(monkeypatch, copy_made)
    copy_cfg = dataclasses.replace(cfg, shared_prompt=False)  # the same file
    copy = runner.run_eval(copy_cfg, models=loaded)
    (copy_kwargs, copy_dec), = copy_made
    assert not copy.failed and copy.new == 2 and copy.skipped == 0 and (3, top) in copy_dec.caches
    assert C.config_key(copy_cfg) != C.config_key(cfg)
    assert copy_kwargs["shared_prefix"] is False and copy_kwargs["max_cache_len"] == top
    assert "cache_buckets" not in copy_kwargs and not copy_dec.shared_prefix
    by_problem = {r["problem_id"]: r for r in copy.records}
    assert len(by_problem) == 2
    for r in shared.records:
        other = by_problem[r["problem_id"]]
        assert other["shared_prompt"] is False
        assert r["sample_token_ids"] == other["sample_token_ids"] and r["sample_new_tokens"] == other["sample_new_tokens"]
    assert len({tuple(s) for r in shared.records for s in r["sample_token_ids"]}) > 3  # samples differ
    with pytest.raises(ValueError, match=r"shared_prompt: False \(the copy layout\) only with samples > 1"):
        dataclasses.replace(cfg, samples=1, temperature=0.0, shared_prompt=False)


def test_shared_layout_greedy_rows_equal_the_single_sample_engine(pair, loaded, tmp_path, monkeypatch):
    """Greedy (a session set to 3 samples directly: the configuration refuses greedy samples): the shared
    layout's three rows are the single-sample engine's greedy tokens; a single-sample session keeps
    ``max_cache_len`` (unchanged) and records no ``shared_prompt``."""
    import torch

    from eval.methods import Session

    made: list = []
    _recording_decoders(monkeypatch, made)
    target, tok, draft = loaded
    cfg = _cfg(pair, tmp_path / "g.jsonl", tree_sizes=(4,))
    one = Session(cfg, target, tok, draft, drafter_factory=lambda spec, **kw: tiny.make_drafter(kw["draft"], 4),
                  max_cache_len=40 + NEW, min_len=20 + NEW)  # fmt: skip
    many = Session(cfg, target, tok, draft, drafter_factory=lambda spec, **kw: tiny.make_drafter(kw["draft"], 4),
                   max_cache_len=40 + NEW, min_len=20 + NEW)  # fmt: skip
    many.samples = 3
    for session in (one, many):
        session.drafter = cfg.drafters[0]
        session.prepare(M.METHODS["specdec"], 4, warm=True)
    assert made[0][0]["max_cache_len"] == 40 + NEW + 4 and "shared_prefix" not in made[0][0]
    assert made[1][0]["cache_buckets"] == (1 + NEW + 4, 40 + NEW + 4) and made[1][0]["shared_prefix"] is True
    warmed = (dict(made[1][1].shared_forwards), dict(made[1][1].caches))
    gen = torch.Generator().manual_seed(0)
    for length in (20, 33, 40):
        prompt = torch.randint(5, tiny.VOCAB, (1, length), generator=gen)
        single = one.speculative(prompt, 4)
        res = many.speculative(prompt, 4)
        assert single.samples is None and single.shared_prompt is None
        assert res.shared_prompt is True and res.samples == [single.token_ids] * 3
    assert (dict(made[1][1].shared_forwards), dict(made[1][1].caches)) == warmed  # nothing new after the warm-up


def test_checker_hook_checks_every_sample(pair, loaded, tmp_path):
    from eval import report

    def checker(problem, text):  # passes the samples whose text has an even length
        return len(text) % 2 == 0

    cfg = _cfg(pair, tmp_path / "c.jsonl", methods=("hf",), temperature=0.8, samples=3)
    res = runner.run_eval(cfg, models=loaded, checker=checker)
    for r in res.records:
        assert r["sample_passed"] == [len(t) % 2 == 0 for t in r["sample_texts"]]
        assert r["num_correct"] == sum(r["sample_passed"]) and "passed" not in r
    (row,) = report.summarize(res.all_records)
    want = sum(r["num_correct"] / 3 for r in res.records) / len(res.records)
    assert (row["samples"], row["checked"], row["pass_at_1"]) == (3, 2, pytest.approx(want))
    assert row["pass_at_10"] is None  # 3 samples: no pass@10


def test_a_method_returning_the_wrong_number_of_samples_is_an_error(pair, loaded, tmp_path):
    single = {"single": Method("single", lambda session, prompt, t: MethodOutput([1, 2], 0.1))}
    cfg = _cfg(pair, tmp_path / "w.jsonl", methods=("single",), temperature=0.8, samples=2, problems=1)
    res = runner.run_eval(cfg, models=loaded, extra_methods=single)
    assert res.failed and res.errors[0]["error"] == "ValueError: samples: method 'single' returned 1 completion(s), expected 2"


@pytest.mark.parametrize("extra, message", [
    (["--samples", "0"], "specdec sweep: error: argument --samples: expected an int >= 1, got 0"),
    (["--samples", "4"], "specdec sweep: error: --samples: 4 samples per problem need temperature > 0"),
    (["--samples", "4", "--temperature", "0"], "specdec sweep: error: --samples: 4 samples per problem need"),
])  # fmt: skip
def test_cli_rejects_bad_samples(pair, tmp_path, capsys, extra, message):
    argv = ["sweep", "--target", pair["target"], "--out", str(tmp_path / "x.jsonl"), "--no-progress", *extra]
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors exit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(message)
    assert not (tmp_path / "x.jsonl").exists()


def test_calibration_times_hf_static_in_each_process_with_drafter_rows(pair, loaded, tmp_path, counted):
    out = tmp_path / "cal.jsonl"
    first = _cfg(pair, out, methods=("specdec", "hf-static"), tree_sizes=(4,), calibrate=1, warmup=1)
    res = runner.run_eval(first, models=loaded)
    assert not any(R.is_calibration(r) for r in _lines(out))  # this process ran HF static itself
    assert counted["hf-static"] == 2 + 2  # compile, replay, 2 problems

    counted.clear()
    more = _cfg(pair, out, methods=("specdec", "hf-static"), tree_sizes=(4,), drafters=(DRAFTER, "lookup"),
                calibrate=1, warmup=1)  # fmt: skip
    res = runner.run_eval(more, models=loaded)
    cal = [r for r in _lines(out) if R.is_calibration(r)]
    assert [(r["problem_id"], r["method"]) for r in cal] == [("100", "hf-static")]
    assert cal[0]["run_id"] != res.records[0]["run_id"] and cal[0]["wall_s"] > 0 and cal[0]["new_tokens"] > 0
    assert counted["hf-static"] == 2 + 1  # warm-up (compile, replay) + one calibration problem
    assert res.new == 2 and len(res.records) == 2 * (2 + 2)  # hf, hf-static, two drafters: no calibration record

    rows = {(r["method"], r["drafter"], r["tree_size"]): r for r in report.summarize(res.all_records)}
    assert rows[("hf-static", None, None)]["problems"] == 2
    for key in (("specdec", DRAFTER, 4), ("specdec", "lookup", 4)):
        assert rows[key]["same_run_speedup_vs_hf_static"] > 0
    # HF static's own process: scale 1, the same ratio as against the baseline
    own = rows[("specdec", DRAFTER, 4)]
    assert own["same_run_speedup_vs_hf_static"] == pytest.approx(own["speedup_vs_hf_static"])

    counted.clear()  # nothing left to run: no calibration either
    assert runner.run_eval(more, models=loaded).new == 0 and counted["hf-static"] == 0
    assert len([r for r in _lines(out) if R.is_calibration(r)]) == 1


def test_calibrate_must_not_be_negative(pair, tmp_path):
    with pytest.raises(ValueError, match="calibrate: expected an int >= 0, got -1"):
        _cfg(pair, tmp_path / "x.jsonl", calibrate=-1)


@pytest.mark.parametrize("freeze", [True, False])
def test_records_keep_their_gc_time_and_warm_ups_freeze_the_heap(pair, loaded, tmp_path, freeze):
    import gc

    seen = []

    def collecting(session, prompt, tree_size):
        seen.append(gc.get_freeze_count())
        gc.collect()  # a full collection inside the timed call
        return session.hf_generate(prompt)

    methods = {"collecting": Method("collecting", collecting)}
    cfg = _cfg(pair, tmp_path / "gc.jsonl", methods=("collecting",), gc_freeze=freeze, warmup=1)
    assert gc.get_freeze_count() == 0
    res = runner.run_eval(cfg, models=loaded, extra_methods=methods)
    assert gc.get_freeze_count() == 0  # undone when the run ends
    mine = [r for r in res.records if r["method"] == "collecting"]
    assert len(mine) == 2 and all(r["gc_s"] > 0 and r["gc_full"] >= 1 for r in mine)
    # the timed calls (the last two) run on a frozen heap (the warm-ups before them froze it), or never
    assert all(n > 0 for n in seen[-2:]) if freeze else all(n == 0 for n in seen)
    row = next(r for r in report.summarize(res.all_records) if r["method"] == "collecting")
    assert row["gc_ms"] > 0 and row["gc_full"] >= 1
    assert (C.config_key(cfg) == C.config_key(dataclasses.replace(cfg, gc_freeze=True))) is freeze


def test_a_failing_calibration_ends_with_a_note_and_the_rows_still_run(pair, loaded, tmp_path, monkeypatch, capsys):
    out = tmp_path / "calfail.jsonl"
    runner.run_eval(_cfg(pair, out, methods=("hf-static",), warmup=1), models=loaded)  # the baseline, first
    hf_generate, calls = M.Session.hf_generate, []

    def failing(self, prompt, **kw):
        if "cache_implementation" in kw:
            calls.append(1)
            if len(calls) > 2:  # after the warm-up's two calls (compile, replay)
                raise RuntimeError("out of memory")
        return hf_generate(self, prompt, **kw)

    monkeypatch.setattr(M.Session, "hf_generate", failing)
    res = runner.run_eval(_cfg(pair, out, methods=("specdec", "hf-static"), tree_sizes=(4,), calibrate=2, warmup=1),
                          models=loaded)  # fmt: skip
    assert "note: calibration stopped at problem 100: RuntimeError: out of memory" in capsys.readouterr().err
    assert not any(R.is_calibration(r) for r in _lines(out))
    assert res.new == 2 and not res.failed  # the drafter's rows
    row = next(r for r in report.summarize(res.all_records) if r["method"] == "specdec")
    assert row["same_run_speedup_vs_hf_static"] is None and row["speedup_vs_hf_static"] is not None
