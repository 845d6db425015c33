"""The evaluation runner end to end on tiny random models (CPU): records, resume, greedy checks,
prompt padding, HumanEval, sampling, drafter factories and the ``specdec eval`` / ``sweep`` CLIs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval import apps_eval as E
from eval.apps_eval import EvalConfig, Method, MethodOutput
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
    kw = dict(dataset="apps", target=pair["target"], draft=pair["draft"], drafter=DRAFTER, tree_sizes=(4, 8),
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
    cfg = _cfg(pair, out, methods=("specdec", "specdec-plain", *E.BASELINE_METHODS))
    res = E.run_eval(cfg)
    assert not res.failed and not res.mismatches and res.strict
    recs = _lines(out)
    keys = [(r["problem_id"], r["method"], r["tree_size"]) for r in recs]
    assert len(keys) == len(set(keys)) == 2 * (2 + 1 + 4)  # specdec x 2 t, plain, 4 baselines
    assert {r["problem_id"] for r in recs} == {"100", "101"}
    assert recs[0]["method"] == E.REFERENCE  # the reference runs first
    for r in recs:
        assert r["error"] is None and r["config_key"] == E.config_key(cfg)
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
        assert 1 <= len(r["tree_samples"]) <= E.TREE_SAMPLES and r["tree_samples"][0][0] == -1
    plain = [r for r in recs if r["method"] == "specdec-plain"]
    assert all(r["tree_size"] is None and r["num_steps"] == r["new_tokens"] for r in plain)

    # Resume: nothing is redone; a new tree size adds only its own records.
    again = E.run_eval(cfg)
    assert (again.new, again.skipped) == (0, len(recs)) and len(_lines(out)) == len(recs)
    more = E.run_eval(_cfg(pair, out, tree_sizes=(4, 8, 16), methods=("specdec", "hf")))
    assert more.new == 2 and {r["tree_size"] for r in _lines(out)[len(recs):]} == {16}
    assert len(more.records) == len(recs) + 2

    # A run killed mid-write leaves half a line: it is dropped and the file repaired.
    with open(out, "a") as f:
        f.write('{"config_key": "x", "meth')
    n = len(recs) + 2
    assert E.run_eval(cfg).new == 0
    assert len(_lines(out)) == n

    # Another configuration (here: more new tokens) does not reuse these records.
    other = _cfg(pair, out, max_new_tokens=NEW + 1, methods=("hf",), problems=1)
    assert E.config_key(other) != E.config_key(cfg) and E.run_eval(other).new == 1


def test_broken_method_is_a_greedy_mismatch(pair, loaded, tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    res = E.run_eval(_cfg(pair, out, methods=("hf", "broken")), models=loaded, extra_methods=BROKEN)
    assert res.strict and res.failed
    bad = [r for r in _lines(out) if r["method"] == "broken"]
    assert len(bad) == 2 and all(r["match"] is False and r["first_divergence"] == 3 for r in bad)
    assert all(0 < r["agreement"] < 1 for r in bad)
    assert {r["problem_id"] for r in res.mismatches} == {"100", "101"}
    assert "GREEDY MISMATCH (fp32: failure)" in capsys.readouterr().err

    # In bf16 the same difference is reported, not a failure.
    res16 = E.run_eval(_cfg(pair, tmp_path / "b.jsonl", methods=("broken",), dtype="bf16", problems=1),
                       extra_methods=BROKEN)  # fmt: skip
    assert not res16.strict and not res16.failed and len(res16.mismatches) == 1
    from eval.report import agreement_summary

    text = agreement_summary(res16.records)
    assert "broken: 0/1 identical; first divergence 100@3" in text and "GREEDY MISMATCH" not in text


def test_cli_exit_code_on_mismatch(pair, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(E.METHODS, "broken", BROKEN["broken"])
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
    res = E.run_eval(cfg, models=loaded, extra_methods=extra)
    assert res.failed and res.errors[0]["error"] == "RuntimeError: out of memory (simulated)"
    res2 = E.run_eval(cfg, models=loaded, extra_methods=extra)  # only the failed one runs again
    assert res2.new == 1 and not res2.failed and res2.records[-1]["match"] is True
    assert len(res2.records) == 2


def test_sampling_runs_without_comparison(pair, loaded, tmp_path):
    cfg = _cfg(pair, tmp_path / "r.jsonl", temperature=0.8, tree_sizes=(4,), problems=1,
               methods=("specdec", "hf", "hf-lookup"))  # fmt: skip
    res = E.run_eval(cfg, models=loaded)
    assert not res.failed and not res.strict and len(res.records) == 3
    assert all(r["match"] is None and r["new_tokens"] > 0 for r in res.records)
    again = E.run_eval(cfg, models=loaded)
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
    assert "| specdec | 4 |" in capsys.readouterr().out


def test_sweep_cli_and_report_only(pair, tmp_path, capsys):
    out = tmp_path / "s.jsonl"
    base = ["sweep", "--problems", "1", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", DRAFTER, "--tree-sizes", "4", "8", "--methods", "specdec", "hf", "hf-static",
            "--max-new-tokens", "6", "--device", "cpu", "--attn-impl", "torch", "--out", str(out), "--warmup", "0",
            "--no-progress"]  # fmt: skip
    assert cli.main(base) == 0
    captured = capsys.readouterr()
    assert "attention timing: skipped (needs a CUDA device" in captured.err
    assert "| specdec | 8 |" in captured.out
    assert (tmp_path / "s.csv").read_text().splitlines()[0].startswith("method,tree_size,problems")
    summary = json.loads((tmp_path / "s.summary.json").read_text())
    assert {(r["method"], r["tree_size"]) for r in summary["rows"]} == {("hf", None), ("hf-static", None),
                                                                       ("specdec", 4), ("specdec", 8)}
    (tmp_path / "s.csv").unlink()
    assert cli.main([*base, "--report-only"]) == 0
    assert (tmp_path / "s.csv").exists()
    assert len(_lines(out)) == 4  # report-only ran nothing


def test_baselines_and_speculative_methods_in_two_runs_share_one_report(pair, loaded, tmp_path, capsys):
    """The device plan for issue 6: baselines first (the Medusa heads need not exist yet), the
    speculative method later into the same file with the same settings; one report pairs them."""
    from drafters.medusa import MedusaHeads

    out, heads = tmp_path / "split.jsonl", tmp_path / "heads"
    base = ["sweep", "--problems", "2", "--data", pair["data"], "--target", pair["target"], "--draft", pair["draft"],
            "--drafter", "medusa", "--drafter-option", f"heads={heads}", "--tree-sizes", "4", "--max-new-tokens", "6",
            "--device", "cpu", "--attn-impl", "torch", "--out", str(out), "--warmup", "0", "--no-progress"]  # fmt: skip
    assert cli.main([*base, "--methods", "hf", "hf-static"]) == 0
    assert not heads.exists() and len(_lines(out)) == 4
    hidden = loaded[0].get_output_embeddings().weight.shape[1]
    MedusaHeads(hidden, 2).save(heads)
    assert cli.main([*base, "--methods", "specdec"]) == 0
    assert len({r["config_key"] for r in _lines(out)}) == 1 and len(_lines(out)) == 6
    summary = json.loads((tmp_path / "split.summary.json").read_text())
    rows = {(r["method"], r["tree_size"]): r for r in summary["rows"]}
    assert set(rows) == {("hf", None), ("hf-static", None), ("specdec", 4)}
    assert rows[("specdec", 4)]["problems"] == 2 and rows[("specdec", 4)]["speedup_vs_hf_static"] is not None
    assert "| specdec | 4 |" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# pieces


def test_pad_prompt_to(pair, loaded):
    from eval.datasets import load_apps, prompt_ids

    tok = loaded[1]
    pool = load_apps(pair["data"])
    short = [len(prompt_ids(p, tok)) for p in pool[:2]]
    padded = E.pad_problems(pool[:2], pool, tok, 400)
    lens = [len(prompt_ids(p, tok)) for p in padded]
    assert all(n >= 400 for n in lens) and all(n > s for n, s in zip(lens, short))
    text = padded[0].messages()[0]["content"]
    assert pool[1].question in text and pool[2].question in text and text.count(pool[0].question) == 1
    assert text.endswith(pool[0].messages()[0]["content"])  # the problem itself comes last
    assert padded[0].id == pool[0].id and padded[0].difficulty == pool[0].difficulty
    with pytest.raises(ValueError, match="pad_prompt_to: 5000 tokens not reached for problem 100"):
        E.pad_problems(pool[:1], pool, tok, 5000)


def test_pad_prompt_in_run(pair, loaded, tmp_path):
    res = E.run_eval(_cfg(pair, tmp_path / "r.jsonl", methods=("hf",), pad_prompt_to=300), models=loaded)
    assert all(r["prompt_len"] >= 300 and r["pad_prompt_to"] == 300 for r in res.records)


def test_compare_tokens_and_tree_depth():
    assert E.compare_tokens([1, 2, 3], [1, 2, 3]) == (True, None, 1.0)
    assert E.compare_tokens([1, 2, 3, 4], [1, 2, 9, 4]) == (False, 2, 0.5)
    assert E.compare_tokens([1, 2], [1, 2, 3, 4]) == (False, 2, 0.5)  # one a prefix of the other
    assert E.tree_depth([-1]) == 0
    assert E.tree_depth([-1, 0, 1, 1, 0, 4]) == 2


def test_build_drafter(loaded):
    target, tok, draft = loaded
    d = E.build_drafter(DRAFTER, target=target, draft=draft, tokenizer=tok, tree_size=3, device="cpu")
    assert d.max_depth == 3 and d.model is draft  # only the keywords the factory declares were passed
    with pytest.raises(ValueError, match="drafter: could not import factory 'tests.eval.nope:f'"):
        E.build_drafter("tests.eval.nope:f")
    try:
        from drafters import make_drafter  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs drafters.make_drafter"):
            E.build_drafter("model", draft=draft)
        return
    real = E.build_drafter("model", target=target, draft=draft, tokenizer=tok, tree_size=8, device="cpu",
                           dtype=target.dtype, depth=2, topk=3)  # fmt: skip
    assert (type(real).__name__, real.depth, real.topk, real.model) == ("DraftModelDrafter", 2, 3, draft)


@pytest.mark.parametrize("drafter, options", [("model", (("depth", 2), ("topk", 2))), ("lookup", ())])
def test_real_drafters_by_name(pair, loaded, tmp_path, drafter, options):
    pytest.importorskip("drafters", reason="drafters.make_drafter").__dict__.get("make_drafter") or pytest.skip(
        "drafters.make_drafter is not in this checkout")
    cfg = _cfg(pair, tmp_path / "r.jsonl", drafter=drafter, drafter_options=options, tree_sizes=(8,), problems=1,
               methods=("specdec", "hf"))  # fmt: skip
    res = E.run_eval(cfg, models=loaded)
    assert not res.failed and [r["match"] for r in res.records] == [True, True]
    assert res.records[1]["drafter"] == drafter and res.records[1]["drafter_options"] == dict(options)


def test_drafter_option_parsing():
    assert E._parse_options(["depth=4", "heads=/x/y", "flag=true", "s=a=b"]) == (
        ("depth", 4), ("heads", "/x/y"), ("flag", True), ("s", "a=b"))
    with pytest.raises(ValueError, match="--drafter-option: expected KEY=VALUE, got 'depth'"):
        E._parse_options(["depth"])


def test_recording_drafter_delegates(loaded):
    import torch

    from specdec.drafting import DraftContext

    inner = tiny.make_drafter(loaded[2], 4)
    rec = E.RecordingDrafter(inner)
    assert rec.vocab_size == tiny.VOCAB and rec.width == 2
    rec.reset([torch.tensor([5, 6])])
    tree = rec.propose(DraftContext(torch.tensor([5, 6]), 4))
    assert len(rec.parents) == 1 and torch.equal(rec.parents[0], tree.parents)
    assert rec.parents[0] is not tree.parents  # a copy: drafters may reuse one buffer


def test_load_records_errors(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text('{"a": 1}\nnot json\n{"b": 2}\n')
    with pytest.raises(ValueError, match=r"r.jsonl: line 2: not a JSON object"):
        E.load_records(p)
    assert E.load_records(tmp_path / "missing.jsonl") == []
    p.write_text('{"a": 1}\n{"b": 2}')  # complete last record without its newline
    assert E.load_records(p, repair=True) == [{"a": 1}, {"b": 2}]
    assert p.read_text().endswith("}\n")


def test_config_validation(pair, tmp_path):
    with pytest.raises(ValueError, match="tree_sizes: expected one or more ints >= 1"):
        _cfg(pair, tmp_path / "r.jsonl", tree_sizes=(0,))
    with pytest.raises(ValueError, match="dtype: expected one of auto, fp32, bf16, fp16, got 'f8'"):
        _cfg(pair, tmp_path / "r.jsonl", dtype="f8")
    with pytest.raises(ValueError, match=r"methods: unknown \['nope'\]"):
        E.run_eval(_cfg(pair, tmp_path / "r.jsonl", methods=("nope",)), models=(None, None, None))
    with pytest.raises(ValueError, match="drafter: method 'specdec' needs a drafter"):
        E.run_eval(_cfg(pair, tmp_path / "r.jsonl", drafter=None, methods=("specdec",)), models=(None, None, None))


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
    assert not cfg.compile and E.config_key(replace(cfg, compile=True)) != E.config_key(cfg)
