"""``specdec generate``: help, tiny models saved to disk (every drafter), and the real 0.5B -> 1.5B pair."""

from __future__ import annotations

import io
import os
import types

import pytest
import torch

from specdec import cli, models
from specdec.cli import generate as cli_generate
from specdec.cli.generate import encode, run_generate


pytestmark = pytest.mark.usefixtures("one_thread", "fp32_default")


@pytest.fixture
def fp32_default(monkeypatch):
    """The tests compare against float32 references: the CPU default is fp32 whatever this CPU does
    in bf16 (``test_the_cpu_default_dtype_follows_native_bf16`` checks that choice)."""
    import specdec.cli.generate as generate

    monkeypatch.setattr(generate, "cpu_bf16_native", lambda: False)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from drafters.medusa import MedusaHeads
    from tests.drafters.helpers import save_tiny_pair

    root = tmp_path_factory.mktemp("tiny")
    target, draft = save_tiny_pair(root)
    torch.manual_seed(0)
    heads = MedusaHeads(64, 3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.05)
    heads.save(root / "heads")
    return target, draft, root / "heads"


def _target_greedy(target_dir, ids: list[int], new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids) :].tolist()


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--target", "--draft", "--drafter", "--tree-size", "--max-tree-size", "--max-new-tokens", "--temperature", "--top-p",
                 "--seed", "--device", "--dtype", "--stream", "--chat", "--no-chat", "--heads", "--compile"):
        assert flag in text
    assert "lookup+eagle" in text and all(name in text for name in ("model", "medusa", "lookup", "eagle"))


@pytest.mark.parametrize("drafter", ["model", "lookup", "medusa", "lookup+medusa", "lookup+model"])
def test_generate_on_tiny_models_equals_target_greedy(tiny_dirs, drafter):
    from transformers import AutoTokenizer

    target, draft, heads = tiny_dirs
    tok = AutoTokenizer.from_pretrained(target)
    prompt = "def add(a, b):"
    buf = io.StringIO()
    res = run_generate(prompt, target=str(target), draft=str(draft), drafter=drafter, heads=str(heads),
                       tree_size=12, max_new_tokens=20, device="cpu", chat=False, attn_impl="torch",
                       progress=False, out=buf)  # fmt: skip
    want = _target_greedy(target, encode(tok, prompt, chat=False), 20)
    assert res.token_ids == want[: len(res.token_ids)]
    assert len(res.token_ids) == 20 or res.token_ids[-1] == tok.eos_token_id
    assert buf.getvalue() == res.text + "\n"
    assert res.tokens_per_s > 0 and res.mean_accepted >= 1.0
    line = res.summary()
    assert "tokens/step" in line and "speedup" not in line  # measured numbers only (no --baseline here)
    # the one-time costs apart: the load, the warm-up, and the first token counted from the process start
    # (which came before this test's own start, so after at least the whole call)
    assert res.load_s > 0 and res.warmup_s >= 0 and res.first_token_s > res.load_s + res.warmup_s
    assert f"load {res.load_s:.1f} s" in line and "after the process started" in line
    numbers = res.numbers()
    assert numbers["first_token_since_start_s"] == res.first_token_s and numbers["load_s"] == res.load_s


def test_stream_chat_sampling_and_baseline(tiny_dirs, capsys):
    target, draft, _ = tiny_dirs
    argv = ["generate", "Write a function.", "--target", str(target), "--draft", str(draft), "--tree-size", "8",
            "--max-new-tokens", "16", "--device", "cpu", "--attn-impl", "torch", "--stream", "--chat", "--baseline",
            "--no-progress"]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    assert "identical text" in captured.err and "measured speedup" in captured.err
    # streamed output equals the non-streamed one
    plain = io.StringIO()
    res = run_generate("Write a function.", target=str(target), draft=str(draft), tree_size=8, max_new_tokens=16,
                       device="cpu", chat=True, attn_impl="torch", progress=False, out=plain)  # fmt: skip
    assert captured.out == plain.getvalue()
    assert res.baseline_text is None
    # sampling: reproducible for a seed
    runs = [run_generate("Write a function.", target=str(target), draft=str(draft), tree_size=8, max_new_tokens=12,
                         temperature=1.2, top_p=0.9, seed=3, device="cpu", attn_impl="torch", progress=False,
                         out=io.StringIO()).token_ids for _ in range(2)]  # fmt: skip
    assert runs[0] == runs[1]


def test_argument_errors(tiny_dirs):
    target, draft, _ = tiny_dirs
    with pytest.raises(ValueError, match=r"heads: --drafter medusa needs --heads DIR"):
        run_generate("x", target=str(target), drafter="medusa", progress=False)
    with pytest.raises(ValueError, match=r"dtype: expected one of"):
        run_generate("x", target=str(target), dtype="int8", progress=False)
    with pytest.raises(ValueError, match=r"heads: --drafter lookup\+eagle needs --heads DIR \(trained with specdec train-eagle"):
        run_generate("x", target=str(target), drafter="lookup+eagle", progress=False)
    with pytest.raises(ValueError, match=r"max_tree_size: expected None unless tree_size is 'auto', got 8"):
        run_generate("x", target=str(target), tree_size=4, max_tree_size=8, progress=False)
    with pytest.raises(SystemExit):
        cli.main(["generate", "x", "--tree-size", "big"])
    for bad in ("lookup+lookup", "lookup+nope", "nope"):
        with pytest.raises(ValueError, match=r"drafter: expected one of .* joined by '\+'"):
            run_generate("x", target=str(target), drafter=bad, progress=False)
    with pytest.raises(SystemExit):
        cli.main(["generate", "x", "--drafter", "lookup+nope"])


class _Recorded(Exception):
    """Raised by the spied ``SpecDecoder`` at the second decoder (the target alone of ``baseline``)."""


@pytest.fixture
def recorded(monkeypatch):
    """Spies for ``run_generate`` with the models on the CPU: ``make_drafter``'s calls (name, options) and
    the ``SpecDecoder``s built (drafter, options) are recorded instead of run; the second decoder raises
    ``_Recorded``. With ``static_shapes`` set true the decoders have it, and their ``warmup`` records its
    options and raises ``_Recorded``."""
    import drafters
    import specdec.engine as engine

    load = models.load_model
    monkeypatch.setattr(models, "load_model", lambda name, dtype=None, device=None, progress=True: load(name, progress=False))
    calls = types.SimpleNamespace(drafters=[], decoders=[], warmups=[], made=object(), static_shapes=False)
    monkeypatch.setattr(drafters, "make_drafter", lambda name, **kw: calls.drafters.append((name, kw)) or calls.made)

    def warmup(*args, **kwargs):
        calls.warmups.append(kwargs)
        raise _Recorded

    def record(target, drafter, **kw):
        calls.decoders.append((drafter, kw))
        if len(calls.decoders) == 2:
            raise _Recorded
        return types.SimpleNamespace(static_shapes=calls.static_shapes, warmup=warmup)

    monkeypatch.setattr(engine, "SpecDecoder", record)
    return calls


@pytest.mark.parametrize("drafter,want", [("model", {"compile": "layers"}),
                                           ("lookup+eagle", {"eagle.compile_head": True}),
                                           ("model+eagle", {"model.compile": "layers", "eagle.compile_head": True})])
def test_compile_reaches_the_target_the_baseline_and_the_drafters(tiny_dirs, recorded, drafter, want):
    """``compile=True`` (``--compile``): both decoders get ``compile=True``, the draft model its layer-wise
    loop compile, EAGLE its compiled expansion; on a CPU a ValueError naming compile. The models load on
    the CPU here (a spy), and the decoders are recorded instead of run."""
    target, draft, _ = tiny_dirs
    with pytest.raises(ValueError, match=r"compile: needs a CUDA device .* got cpu"):
        run_generate("x", target=str(target), compile=True, device="cpu", progress=False)
    with pytest.raises(_Recorded):
        run_generate("x", target=str(target), draft=str(draft), drafter=drafter, heads="h", compile=True, device="cuda",
                     baseline=True, progress=False)  # fmt: skip
    ((_, kw),) = recorded.drafters
    assert {k: v for k, v in kw.items() if "compile" in k} == want
    assert [d[1]["compile"] for d in recorded.decoders] == [True, True]
    assert recorded.decoders[0][0] is recorded.made and recorded.decoders[1][0] is None  # speculative, then alone


@pytest.mark.parametrize("device,drafter,compiled", [("cuda", "lookup", True), ("cpu", "model", False)])
def test_defaults_by_device(tiny_dirs, recorded, device, drafter, compiled):
    """Without ``drafter`` / ``compile``: prompt lookup and the compiled target on a GPU, the draft model
    uncompiled on a CPU (``device_defaults``); given ones win (``--drafter model --no-compile`` on a GPU)."""
    from specdec.cli.generate import device_defaults

    assert device_defaults(device) == (drafter, compiled)
    target, draft, _ = tiny_dirs
    with pytest.raises(_Recorded):
        run_generate("x", target=str(target), draft=str(draft), device=device, baseline=True, progress=False)
    assert recorded.drafters[-1][0] == drafter
    assert [d[1]["compile"] for d in recorded.decoders] == [compiled, compiled]
    if device == "cuda":
        recorded.decoders.clear()
        with pytest.raises(_Recorded):
            run_generate("x", target=str(target), draft=str(draft), drafter="model", compile=False, device=device,
                         baseline=True, progress=False)  # fmt: skip
        assert recorded.drafters[-1][0] == "model" and "compile" not in recorded.drafters[-1][1]
        assert [d[1]["compile"] for d in recorded.decoders] == [False, False]
    ns = cli_generate.build_parser().parse_args(["x", "--no-compile"])
    assert ns.compile is False and ns.drafter is None
    assert cli_generate.build_parser().parse_args(["x"]).compile is None


def test_a_warm_up_says_what_it_does_unless_quiet(tiny_dirs, recorded, capsys):
    """With static shapes (a GPU) the warm-up before the timed call gets one line on stderr (a first
    compile is a minute of silence otherwise); ``progress=False`` (``--no-progress``) keeps it quiet."""
    target, _, _ = tiny_dirs
    recorded.static_shapes = True
    for progress in (True, False):
        recorded.decoders.clear()  # each call's speculative decoder is its first
        with pytest.raises(_Recorded):
            run_generate("x", target=str(target), drafter="lookup", device="cpu", progress=progress)
        err = capsys.readouterr().err
        assert ("specdec generate: warming up (capturing every node budget's forward" in err) == progress
    assert len(recorded.warmups) == 2


TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


@pytest.mark.slow  # the real 1.5B / 0.5B pair
def test_real_pair_generate_equals_target_greedy():
    """The issue's bar: CPU, fp32, the real 0.5B -> 1.5B pair gives the target-only greedy text.

    The target-only run is ``--baseline``: the same loaded target decoding alone (the engine's
    plain path, itself checked token for token against HF ``generate`` in test_engine.py and
    test_real_pair.py), which saves loading the 1.5B model twice.
    """
    if not (models.is_converted(TARGET) and models.is_converted(DRAFT)):
        pytest.skip(f"{TARGET} / {DRAFT} are not in the model store (specdec models fetch NAME)")
    torch.set_num_threads(os.cpu_count() or 1)  # real models: use every core (restored afterwards)
    prompt = "Write a Python function that returns the n-th Fibonacci number."
    buf = io.StringIO()
    res = run_generate(prompt, tree_size=8, max_new_tokens=12, device="cpu", dtype="fp32", attn_impl="torch",
                       progress=False, baseline=True, out=buf)  # fmt: skip
    assert res.baseline_text is not None and res.text == res.baseline_text
    assert len(res.token_ids) == 12 and res.text.strip()
    assert res.output.totals()["tokens_accepted"] > 0  # the real draft agrees with the target at least sometimes
    assert "identical text" in res.summary()


def test_cpu_default_is_the_measured_chain_under_the_auto_budget(tiny_dirs):
    from specdec.cli.generate import CPU_CHAIN

    target, draft, _ = tiny_dirs
    res = run_generate("def add(a, b):", target=str(target), draft=str(draft), max_new_tokens=12, device="cpu",
                       chat=False, attn_impl="torch", progress=False, out=io.StringIO())  # fmt: skip
    # tree_size "auto": chains of up to CPU_CHAIN drafted nodes a step (depth CPU_CHAIN, top-1), or plain steps
    budget = res.output.budget
    assert budget is not None and set(budget.histogram) <= {0, 4, CPU_CHAIN} and budget.last.budgets == (0, 4, CPU_CHAIN)
    assert all(s.budget in (0, 4, CPU_CHAIN) and max(s.nodes_proposed) <= s.budget for s in res.output.steps)
    # no warm-up on a CPU (nothing to capture): the call's first steps measured every budget
    assert res.warmup_s < 0.5 and [s.budget for s in res.output.steps[:2]] == [0, 0]
    assert all(seconds is not None for seconds in budget.last.seconds)
    assert "budgets " in res.summary() and res.numbers()["budget_reason"].startswith("budget ")
    # an explicit tree size keeps the tree defaults
    res = run_generate("def add(a, b):", target=str(target), draft=str(draft), tree_size=12, max_new_tokens=12,
                       device="cpu", chat=False, attn_impl="torch", progress=False, out=io.StringIO())  # fmt: skip
    assert max(n for s in res.output.steps for n in s.nodes_proposed) > CPU_CHAIN


@pytest.mark.parametrize("tree_size", [12, "auto"])
def test_static_shapes_warm_every_cache_before_the_call(tiny_dirs, monkeypatch, tree_size):
    """With static shapes (a GPU's default) ``generate`` warms the decoder for the whole call, a fixed tree
    size too: the draft model's cache then never grows inside the timed call (a growth drops its captured
    loop, which was recaptured there: a 0.7-s stall on an H200)."""
    import specdec.engine as engine
    from drafters.draft_model import DraftModelDrafter

    class Static(engine.SpecDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, static_shapes=True, **kwargs)

    made = []
    init = DraftModelDrafter.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(engine, "SpecDecoder", Static)  # generate imports it when it runs
    monkeypatch.setattr(DraftModelDrafter, "__init__", recording)
    target, draft, _ = tiny_dirs
    prompt = "def add(a, b):"
    res = run_generate(prompt, target=str(target), draft=str(draft), tree_size=tree_size, max_new_tokens=300,
                       device="cpu", chat=False, attn_impl="torch", progress=False, baseline=True,
                       out=io.StringIO())  # fmt: skip
    assert res.baseline_text == res.text  # the target alone (warmed after the speculative call) agrees
    # the warm-up sized the draft cache for the prompt and all 300 tokens, so no step grows it
    (drafter,) = made
    ids = encode(models.load_tokenizer(str(target), progress=False), prompt, False)
    assert min(st.cache.capacity for st in drafter._states.values()) >= len(ids) + 300


@pytest.mark.parametrize("native", [True, False])
def test_the_cpu_default_dtype_follows_native_bf16(tiny_dirs, monkeypatch, native):
    """On a CPU that multiplies bf16 natively the default dtype is bf16 (about twice as fast as fp32
    there), elsewhere fp32; an explicit --dtype wins."""
    import specdec.cli.generate as generate

    target, draft, _ = tiny_dirs
    seen = []
    real = models.load_model
    monkeypatch.setattr(generate, "cpu_bf16_native", lambda: native)
    monkeypatch.setattr(models, "load_model", lambda *a, dtype, **kw: seen.append(dtype) or real(*a, dtype=dtype, **kw))
    for dtype in (None, "fp32"):
        seen.clear()
        res = run_generate("def add(a, b):", target=str(target), draft=str(draft), tree_size=4, max_new_tokens=4,
                           device="cpu", dtype=dtype, chat=False, attn_impl="torch", progress=False, out=io.StringIO())
        want = torch.bfloat16 if native and dtype is None else torch.float32
        assert seen == [want, want] and len(res.token_ids) == 4


def test_cpu_bf16_native_matches_the_cpu_flags(monkeypatch):
    """oneDNN's answer agrees with the CPU's own flags (Linux), and a torch without oneDNN's query says no."""
    from pathlib import Path

    import specdec.dtypes as dtypes

    cpuinfo = Path("/proc/cpuinfo")
    limited = any(os.environ.get(v) for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"))  # oneDNN told to use less
    if cpuinfo.exists() and not limited:
        flags = set(cpuinfo.read_text().split())
        assert dtypes.cpu_bf16_native() == bool(flags & {"avx512_bf16", "amx_bf16"})

    class NoQuery:
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(torch.ops, "mkldnn", NoQuery())
    assert dtypes.cpu_bf16_native() is False


def test_split_by_yield_for_a_merged_drafter(tiny_dirs):
    """``--split yield`` reaches a merged drafter; greedy output is the target's; with one drafter it is
    a one-line error naming split."""
    target, draft, _ = tiny_dirs
    ids = encode(models.load_tokenizer(str(target), progress=False), "def add(a, b):", False)
    res = run_generate("def add(a, b):", target=str(target), draft=str(draft), drafter="lookup+model", split="yield",
                       tree_size=8, max_new_tokens=20, device="cpu", chat=False, attn_impl="torch", progress=False,
                       out=io.StringIO())  # fmt: skip
    assert res.token_ids == _target_greedy(target, ids, 20)[: len(res.token_ids)]
    with pytest.raises(ValueError, match="split: divides a merged drafter's budget"):
        run_generate("x", target=str(target), draft=str(draft), drafter="model", split="yield", device="cpu",
                     progress=False, out=io.StringIO())  # fmt: skip
