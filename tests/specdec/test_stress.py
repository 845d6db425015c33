"""``specdec.cli.stress``: the randomized stress harness and its entry point ``scripts/device/stress.py``.

CPU: the harness on tiny models with a handful of calls -- counts add up, the JSON is written, an
engine that alters one row is reported as a mismatch, an exception as a crash (and the run goes
on), a CUDA error stops the run, the time budget stops it early, the reference equals HF greedy
decoding, and the command line. CUDA only (skipped here; on a GPU: ``pytest tests/specdec/test_stress.py``):
a short stress run with CUDA graphs and HF's static-cache generate interleaved, which must end with
no crash and no mismatch.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import torch

from specdec.cli import stress
from specdec.cli.stress import CallPlan, StressConfig, StressModels, check_output, plan_calls, run_stress
from specdec.cli.stress import checks as stress_checks
from specdec.cli.stress import cli as stress_cli
from specdec.cli.stress import run as stress_run
from specdec import SpecDecoder
from specdec.engine import GenerationOutput, StepStats

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[2]
#: Small and fast on a 2-core CPU: every drafter, graphs on / off, greedy and sampling, HF calls.
SMALL = dict(batch_sizes=(1, 4), prompt_lens=(1, 120), new_tokens=(1, 12), tree_sizes=(4, 12),
             drafters=("model", "medusa", "lookup", "none"), tiny_hidden=32, tiny_vocab=128, attn_impl="torch",
             hf_share=0.25, progress=False)  # fmt: skip


@functools.lru_cache(maxsize=None)
def _models() -> StressModels:
    return stress.build_tiny_models(hidden=32, vocab=128, positions=512)


def _run(tmp_path=None, log=None, **kw):
    cfg = StressConfig(**{**SMALL, **kw, "out": str(tmp_path / "stress.json") if tmp_path else None})
    lines: list[str] = []
    result = run_stress(cfg, log=lines.append if log is None else log, models=_models())
    return result, lines


# ---------------------------------------------------------------------------- configuration and plan


@pytest.mark.parametrize("kw,match", [
    (dict(calls=0), "calls: expected an int >= 1"),
    (dict(batch_sizes=(3, 2)), "batch_sizes: expected a tuple"),
    (dict(prompt_lens=(0, 10)), "prompt_lens: expected a tuple"),
    (dict(tree_sizes=()), "tree_sizes: expected a non-empty tuple"),
    (dict(drafters=("model", "eagle")), r"drafters: expected some of .* got \['eagle'\]"),
    (dict(hf_share=1.5), r"hf_share: expected a probability in \[0, 1\]"),
    (dict(dtype="fp64"), "dtype: expected one of"),
    (dict(device="tpu"), "device: expected 'cpu', 'cuda' or 'cuda:N'"),
    (dict(budget_s=0), "budget_s: expected None or a number of seconds > 0"),
    (dict(models="pretrained"), "target: models='pretrained' needs a target"),
    (dict(models="pretrained", target="t"), "draft: the 'model' drafter"),
    (dict(tiny_family="gpt2"), "tiny_family: expected one of"),
    (dict(tiny_hidden=30), "tiny_hidden: expected a multiple of 4"),
    (dict(attn_impl="flash"), "attn_impl: expected"),
    (dict(reference="hf"), "reference: expected one of"),
])  # fmt: skip
def test_config_errors_name_the_argument(kw, match):
    with pytest.raises(ValueError, match=match):
        StressConfig(**kw)


def test_plan_is_reproducible_and_within_the_ranges():
    cfg = StressConfig(calls=300, seed=3, prompt_lens=(1, 3000), batch_sizes=(1, 8),
                       drafters=("model", "medusa", "lookup", "none"), hf_share=0.2, sampling_share=0.3,
                       eos_share=0.3)  # fmt: skip
    plans = plan_calls(cfg)
    assert plans == plan_calls(cfg) and plans != plan_calls(StressConfig(**{**_fields(cfg), "seed": 4}))
    assert [p.index for p in plans] == list(range(300))
    assert {p.kind for p in plans} == {"spec", "hf", "hf-static"}
    spec = [p for p in plans if p.kind == "spec"]
    assert {p.drafter for p in spec} == set(cfg.drafters) and {p.graphs for p in spec} == {True, False}
    assert {p.do_sample for p in spec} == {True, False} and not any(p.do_sample for p in plans if p.kind != "spec")
    assert all((p.tree_size == 0) == (p.drafter == "none") for p in spec)
    assert all(p.tree_size in cfg.tree_sizes for p in spec if p.drafter != "none")
    assert {p.batch for p in plans} == set(range(1, 9))
    lens = [n for p in plans for _, n in p.prompts]
    assert min(lens) == 1 and max(lens) > 2500 and all(1 <= n <= 3000 for n in lens)
    assert sum(n <= 16 for n in lens) > 0.1 * len(lens)  # the log-uniform half: short prompts come up
    specs = [s for p in plans for s in p.prompts]
    assert len(set(specs)) < len(specs)  # some prompts repeat
    assert all(1 <= p.max_new_tokens <= 64 for p in plans) and any(p.eos for p in plans)


def _fields(cfg: StressConfig) -> dict:
    return {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}


def test_make_prompt_is_deterministic_and_in_range():
    for seed in (2, 7):  # i.i.d., repeated chunk
        p = stress.make_prompt((seed, 300), 50)
        assert p.dtype == torch.int64 and p.shape == (300,) and int(p.min()) >= 0 and int(p.max()) < 50
        assert torch.equal(p, stress.make_prompt((seed, 300), 50))
    assert len(stress.make_prompt((5, 1), 50)) == 1


@pytest.mark.parametrize("mode", stress.REFERENCES)
def test_reference_equals_hf_greedy(mode):
    """The ground truth: the plain decoder alone equals the target's own HF greedy generate."""
    m = _models()
    ref = stress_checks._Reference(m.target, "torch", mode)
    for spec in ((11, 1), (12, 40), (13, 97)):
        p = stress.make_prompt(spec, m.vocab_size)
        hf = m.target.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=10,
                               do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
        assert ref.continuation(p, 10) == hf[0, len(p):].tolist()
        assert ref.continuation(p, 4) == hf[0, len(p) : len(p) + 4].tolist()
    assert ref.decodes == 3  # shorter requests come from the cache


# ---------------------------------------------------------------------------- output checks


def _output(rows, prompts):
    """A ``GenerationOutput`` of ``rows`` (new tokens) after ``prompts``, one token per step."""
    lens = tuple(len(p) + len(r) for p, r in zip(prompts, rows))
    seqs = torch.zeros(len(rows), max(lens), dtype=torch.int64)
    for b, (p, r) in enumerate(zip(prompts, rows)):
        seqs[b, : lens[b]] = torch.tensor(p + r)
    steps = [StepStats((1,) * len(rows), (0,) * len(rows), tuple(int(i < len(r)) for r in rows), 0.0, 0.0, 0.0)
             for i in range(max(len(r) for r in rows))]  # fmt: skip
    return GenerationOutput(seqs, lens, tuple(len(p) for p in prompts), steps)


def test_check_output_finds_what_is_wrong():
    prompts = [[5, 6], [7]]
    t = lambda xs: [torch.tensor(x) for x in xs]  # noqa: E731
    assert check_output(_output([[1, 2, 3], [4, 9, 9]], prompts), t(prompts), 3, None, 10, 4) == [[], []]
    assert check_output(_output([[1, 2], [4, 9, 9]], prompts), t(prompts), 3, 2, 10, 4) == [[], []]  # eos ends row 0
    got = check_output(_output([[1, 2], [4, 9, 9]], prompts), t(prompts), 3, None, 10, 4)
    assert got[0] == ["stopped after 2 of 3 tokens without an eos"] and got[1] == []
    got = check_output(_output([[1, 12, 3], [4, 2, 9]], prompts), t(prompts), 3, 2, 10, 4)
    assert "token ids out of [0, 10): [12]" in got[0][0] and got[1] == ["tokens after an eos"]
    got = check_output(_output([[1, 2, 3], [4, 9, 9]], prompts), t([[5, 7], [7]]), 3, None, 10, 4)
    assert got[0] == ["the row does not start with its prompt"]
    out = _output([[1, 2, 3], [4, 9, 9]], prompts)
    out = GenerationOutput(out.sequences, (5, 3), out.prompt_lengths, out.steps)  # row 1 cut: a 9 after its end
    got = check_output(out, t(prompts), 3, None, 10, 4)
    assert got[1] == ["stopped after 2 of 3 tokens without an eos", "padding after the row's end is not the pad id",
                      "steps emitted 3 tokens, the row has 2"]  # fmt: skip
    bad = GenerationOutput(out.sequences, out.lengths, out.prompt_lengths,
                           [StepStats((5, 1), (0, 2), (1, 1), 0.0, 0.0, 0.0)])  # fmt: skip
    got = check_output(bad, t(prompts), 3, None, 10, 4)
    assert "step 0: proposed 5 (tree size 4), accepted 0, emitted 1" in got[0]
    assert "step 0: proposed 1 (tree size 4), accepted 2, emitted 1" in got[1]


# ---------------------------------------------------------------------------- runs (CPU)


@pytest.mark.slow
def test_counts_add_up_and_the_json_is_written(tmp_path):
    result, lines = _run(tmp_path, calls=40, seed=0)
    s = result.summary
    assert result.ok, "\n".join(lines)
    assert s["planned"] == s["ran"] == 40 and s["stopped"] is None and s["aborted"] is None
    assert s["counts"] == {"ok": 40, "mismatch": 0, "error": 0}
    for table in ("by_kind", "by_mode", "by_decoding", "by_group"):
        assert sum(t["calls"] for t in s[table].values()) == 40
    assert sum(t["calls"] for t in s["by_drafter"].values()) == s["by_kind"]["spec"]["calls"]
    assert set(s["by_kind"]) == {"spec", "hf", "hf-static"}
    assert s["rows_compared"] > 0 and s["rows_checked"] == sum(r["batch"] for r in result.calls)
    assert s["slowest_call"]["wall_s"] == max(r["wall_s"] for r in result.calls)
    assert s["slowest_step"]["s"] == max(r["slowest_step"]["s"] for r in result.calls if "slowest_step" in r)
    engines = {e["engine"]: e for e in result.engines}
    assert sum(e["calls"] for e in engines.values()) == s["by_kind"]["spec"]["calls"]
    assert all(e["first_call_s"] is not None and e["new_shape_calls"] + e["steady_calls"] == e["calls"]
               for e in engines.values())  # fmt: skip
    saved = json.loads((tmp_path / "stress.json").read_text())
    assert saved["ok"] and len(saved["calls"]) == 40 and saved["summary"]["counts"] == s["counts"]
    assert saved["config"]["calls"] == 40 and saved["config"]["tree_sizes"] == [4, 12]
    assert any(r["eos"] is not None and r["new_tokens"] < r["batch"] * r["max_new_tokens"] for r in result.calls)
    assert "result: OK" in lines[-1] and "spec       model" in lines[-1]


def test_engines_are_reused_and_dropped_beyond_the_limit():
    result, _ = _run(calls=16, seed=1, drafters=("lookup",), tree_sizes=(4,), graphs_share=0.5, hf_share=0.0,
                     max_engines=1)  # fmt: skip
    engines = {e["engine"]: e for e in result.engines}
    assert set(engines) == {"lookup/t4/graphs", "lookup/t4/nographs"}
    assert result.summary["engines_dropped"] >= 1  # two keys, one alive at a time
    # One batch size and request size: after its first call an engine is in steady state.
    result, _ = _run(calls=16, seed=1, drafters=("lookup",), tree_sizes=(4,), graphs_share=0.5, hf_share=0.0,
                     batch_sizes=(2, 2), prompt_lens=(8, 8), new_tokens=(3, 3))  # fmt: skip
    assert result.summary["engines_dropped"] == 0
    assert all(e["builds"] == 1 and e["calls"] > 1 for e in result.engines)  # built once, reused
    assert all(e["new_shape_calls"] == 1 and e["steady_calls"] == e["calls"] - 1 for e in result.engines)
    assert sum(not r["engine_new"] and not r["new_shape"] for r in result.calls) == 16 - 2
    assert result.summary["slowest_steady_step"]["call"] not in {r["call"] for r in result.calls if r["new_shape"]}


def _alter_row(monkeypatch, when):
    """Make engine calls (not the reference, which has no drafter) return a wrong token in row 0."""
    real = SpecDecoder.generate
    hits = []

    def faulty(self, input_ids, max_new_tokens, *args, **kw):
        out = real(self, input_ids, max_new_tokens, *args, **kw)
        if self.drafter is not None and when(len(hits), out):
            hits.append(True)
            p, n = out.prompt_lengths[0], out.lengths[0]
            out.sequences[0, n - 1] = (out.sequences[0, n - 1] + 1) % self.vocab_size
        elif self.drafter is not None:
            hits.append(False)
        return out

    monkeypatch.setattr(SpecDecoder, "generate", faulty)
    return hits


def test_an_altered_row_is_a_mismatch(monkeypatch):
    hits = _alter_row(monkeypatch, lambda i, out: i == 2)
    result, lines = _run(calls=8, seed=2, sampling_share=0.0, eos_share=0.0, hf_share=0.0, drafters=("model", "lookup"))
    s = result.summary
    bad = hits.index(True)
    assert not result.ok and "result: FAILED" in lines[-1] and "MISMATCH" in lines[-1]
    assert s["counts"]["mismatch"] == s["mismatching_calls"] == 1 and s["counts"]["error"] == 0
    (m,) = s["mismatches"]
    rec = next(r for r in result.calls if r["status"] == "mismatch")
    assert rec["call"] == [r["call"] for r in result.calls if r["kind"] == "spec"][bad]
    assert m["row"] == 0 and m["position"] == rec["max_new_tokens"] - 1 and not m["near_tie"] and m["logit_gap"] > 0
    assert any("differs from the prompt decoded alone" in p for p in rec["problems"])
    assert any("MISMATCH in call" in line for line in lines)


def test_a_near_tie_is_reported_but_not_a_failure(monkeypatch):
    _alter_row(monkeypatch, lambda i, out: i == 0)
    result, lines = _run(calls=3, seed=2, sampling_share=0.0, eos_share=0.0, hf_share=0.0, drafters=("lookup",),
                         tie_tol=1e9)  # every gap is "close"  # fmt: skip
    s = result.summary
    assert result.ok and s["counts"]["mismatch"] == 1 and s["near_tie_calls"] == 1 and s["mismatching_calls"] == 0
    assert s["mismatches"][0]["near_tie"] and "near ties only" in lines[-1]


def test_an_altered_hf_row_is_a_mismatch(monkeypatch):
    """HF generate's rows are compared too (the engine must not disturb the target's own decoding)."""
    target = _models().target
    real = target.generate

    def faulty(ids, **kw):
        out = real(ids, **kw)
        width = ids.shape[1]  # row 0's first new token
        out[0, width] = (out[0, width] + 1) % 128
        return out

    monkeypatch.setattr(target, "generate", faulty)
    result, _ = _run(calls=6, seed=0, hf_share=1.0, eos_share=0.0)
    s = result.summary
    assert not result.ok and s["counts"]["mismatch"] == 6 and {m["kind"] for m in s["mismatches"]} <= {"hf", "hf-static"}
    monkeypatch.setattr(target, "generate", real)
    result, _ = _run(calls=6, seed=0, hf_share=1.0, eos_share=0.0)
    assert result.ok and result.summary["rows_compared"] == sum(r["batch"] for r in result.calls)


@pytest.mark.slow
def test_compiled_engines(monkeypatch):
    """compile on: the engines' fixed-shape forwards through torch.compile (aot_eager here: the
    tracing inductor starts from, without its code generation)."""
    result, lines = _run(calls=3, seed=5, batch_sizes=(2, 2), compile_share=1.0, compile_backend="aot_eager",
                         drafters=("model", "lookup"), hf_share=0.0)  # fmt: skip
    assert result.ok, "\n".join(lines)
    assert all(r["mode"].endswith("+compile") for r in result.calls)


def test_an_invalid_sampled_row_is_a_mismatch(monkeypatch):
    """Sampled rows cannot be compared, but their validity is checked: an id out of range is caught."""
    real = SpecDecoder.generate

    def faulty(self, input_ids, max_new_tokens, *args, **kw):
        out = real(self, input_ids, max_new_tokens, *args, **kw)
        if self.drafter is not None:
            out.sequences[0, out.lengths[0] - 1] = self.vocab_size + 5
        return out

    monkeypatch.setattr(SpecDecoder, "generate", faulty)
    result, _ = _run(calls=2, seed=0, sampling_share=1.0, hf_share=0.0, drafters=("lookup",))
    assert not result.ok and result.summary["counts"]["mismatch"] == 2 and not result.summary["mismatches"]
    assert all("out of [0, 128)" in " ".join(inv["problems"]) for inv in result.summary["invalid"])


def test_an_exception_is_a_crash_and_the_run_goes_on(monkeypatch):
    real = SpecDecoder.generate
    calls = []

    def flaky(self, *args, **kw):
        if self.drafter is not None:
            calls.append(self)
            if len(calls) == 2:
                raise RuntimeError("injected failure")
        return real(self, *args, **kw)

    monkeypatch.setattr(SpecDecoder, "generate", flaky)
    result, lines = _run(calls=10, seed=4, hf_share=0.0, drafters=("lookup",), tree_sizes=(4,), graphs_share=1.0)
    s = result.summary
    assert not result.ok and s["ran"] == 10 and s["stopped"] is None
    assert s["counts"]["error"] == 1 and s["counts"]["ok"] == 9
    (crash,) = s["crashes"]
    assert crash["error"] == "RuntimeError: injected failure" and crash["stage"] == "call" and not crash["fatal"]
    rec = result.calls[crash["call"]]
    assert rec["status"] == "error" and "injected failure" in rec["traceback"]
    (engine,) = result.engines
    assert engine["errors"] == 1 and engine["builds"] == 2  # dropped after the error, rebuilt on next use
    assert calls[0] is calls[1] and calls[2] is not calls[1]
    assert any("CRASH in call" in line for line in lines) and "CRASH #" in lines[-1]


def test_a_cuda_error_stops_the_run(monkeypatch, tmp_path):
    real = SpecDecoder.generate
    calls = []

    def poisoned(self, *args, **kw):
        if self.drafter is not None:
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, *args, **kw)

    monkeypatch.setattr(SpecDecoder, "generate", poisoned)
    result, lines = _run(tmp_path, calls=10, seed=4, hf_share=0.0, drafters=("lookup",))
    s = result.summary
    assert not result.ok and s["stopped"] == "cuda-error" and s["ran"] == 3 and s["planned"] == 10
    assert s["aborted"].startswith("call 2: RuntimeError: CUDA error") and s["crashes"][0]["fatal"]
    assert json.loads((tmp_path / "stress.json").read_text())["summary"]["stopped"] == "cuda-error"
    assert "ABORTED" in lines[-1]


def test_the_budget_stops_the_run_early(monkeypatch, tmp_path):
    real = SpecDecoder.generate

    def slow(self, *args, **kw):
        if self.drafter is not None:
            time.sleep(0.3)
        return real(self, *args, **kw)

    monkeypatch.setattr(SpecDecoder, "generate", slow)
    t0 = time.perf_counter()
    result, lines = _run(tmp_path, calls=20, seed=0, hf_share=0.0, drafters=("lookup",), budget_s=1.2)
    s = result.summary
    assert result.ok and s["stopped"] == "budget" and 1 <= s["ran"] < 20
    assert time.perf_counter() - t0 < 1.2 + 1.0  # stopped before a call that would overrun
    assert json.loads((tmp_path / "stress.json").read_text())["summary"]["stopped"] == "budget"
    assert any("budget of 1.2 s reached" in line for line in lines) and "stopped: budget" in lines[-1]


def test_models_must_match_the_drafters():
    cfg = StressConfig(**{**SMALL, "calls": 1})
    with pytest.raises(ValueError, match="draft: the 'model' drafter needs a draft model"):
        run_stress(cfg, log=lambda m: None, models=StressModels(_models().target, None, _models().heads))
    cfg = StressConfig(**{**SMALL, "calls": 1, "prompt_lens": (1, 600)})
    with pytest.raises(ValueError, match="prompt_lens: the longest prompt"):
        run_stress(cfg, log=lambda m: None, models=_models())


# ---------------------------------------------------------------------------- command line


@functools.lru_cache(maxsize=None)
def _script():
    spec = importlib.util.spec_from_file_location("stress_script", ROOT / "scripts" / "device" / "stress.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_runs_and_exits_0(tmp_path, capsys):
    out = tmp_path / "s.json"
    code = _script().main(["--calls", "3", "--seed", "1", "--device", "cpu", "--prompt-lens", "1", "40",
                           "--new-tokens", "1", "6", "--batch-sizes", "1", "3", "--tree-sizes", "4",
                           "--tiny-hidden", "32", "--tiny-vocab", "64", "--attn-impl", "torch", "--no-progress",
                           "--out", str(out)])  # fmt: skip
    assert code == 0
    assert "result: OK" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["ok"] and saved["summary"]["ran"] == 3 and saved["config"]["tiny_vocab"] == 64


def test_script_defaults():
    mod = stress_cli
    cfg = mod.config_from_args(mod.build_parser().parse_args(["--device", "cpu"]))
    assert cfg == StressConfig(device="cpu")  # the library's defaults; no compile on CPU
    cfg = mod.config_from_args(mod.build_parser().parse_args(["--device", "cpu", "--models", "qwen",
                                                              "--drafters", "lookup", "lookup"]))  # fmt: skip
    assert (cfg.models, cfg.target, cfg.draft, cfg.drafters) == ("pretrained", mod.QWEN_TARGET, mod.QWEN_DRAFT, ("lookup",))


@pytest.mark.parametrize("argv,match", [
    (["--batch-sizes", "0", "2"], "argument --batch-sizes: expected an int >= 1"),
    (["--hf-share", "2"], r"argument --hf-share: expected a number in \[0, 1\]"),
    (["--prompt-lens", "9", "3"], "prompt_lens: expected a tuple"),
    (["--target", "x"], "--target / --draft / --medusa-heads: expected --models qwen"),
    (["--medusa-heads", "/no/such/dir"], "no such file or directory"),
])  # fmt: skip
def test_script_argument_errors_are_one_line(argv, match, capsys):
    assert _script().main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stress: error: ") and "\n" not in err
    assert re.search(match, err)


def test_script_exits_1_on_a_failure(monkeypatch, capsys):
    monkeypatch.setattr(stress_run, "run_stress", lambda cfg, log: type("R", (), {"ok": False})())
    assert _script().main(["--device", "cpu", "--calls", "1"]) == 1


# ---------------------------------------------------------------------------- CUDA


CUDA_SHORT = dict(calls=20, seed=0, batch_sizes=(1, 6), prompt_lens=(1, 1500), new_tokens=(1, 32), tree_sizes=(16, 64),
                  drafters=("model", "medusa", "lookup"), graphs_share=1.0, hf_share=0.3, hf_static_share=1.0,
                  sampling_share=0.25, dtype="fp32", progress=False)  # fmt: skip


def test_the_cuda_plan_has_issue_13s_pattern():
    """The short CUDA run's plan (checked here, device-independent): every drafter, HF static-cache
    generate between calls of one engine at different batch sizes."""
    plans = plan_calls(StressConfig(**CUDA_SHORT, device="cpu"))
    assert {p.drafter for p in plans if p.kind == "spec"} == {"model", "medusa", "lookup"}
    assert all(p.graphs for p in plans if p.kind == "spec")
    statics = [p.index for p in plans if p.kind == "hf-static"]
    assert len({plans[i].batch for i in statics}) >= 2

    def reused_across_static(p: CallPlan) -> bool:
        before = [q for q in plans[: p.index] if q.kind == "spec" and q.engine_key == p.engine_key]
        return any(q.batch != p.batch and any(q.index < i < p.index for i in statics) for q in before)

    assert any(p.kind == "spec" and reused_across_static(p) for p in plans)


@pytest.mark.cuda
def test_short_stress_on_cuda(tmp_path):
    """~20 calls on tiny models with CUDA graphs, HF static-cache generate interleaved: no crash and
    every greedy row equal to its prompt decoded alone."""
    cfg = StressConfig(**CUDA_SHORT, device="cuda", out=str(tmp_path / "stress.json"))
    lines: list[str] = []
    result = run_stress(cfg, log=lines.append)
    s = result.summary
    assert s["ran"] == 20 and s["counts"]["error"] == 0 and s["mismatching_calls"] == 0, "\n".join(lines)
    assert s["by_kind"]["hf-static"]["calls"] >= 2 and s["rows_compared"] > 20
    assert result.ok
