"""EAGLE training options: the time budget and the extra sampled answers (tiny random models, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafters.eagle import CONFIG_NAME, VOCAB_NAME, EagleDrafter, EagleHead
from specdec.cli import train as train_cli
from tests.specdec.helpers import VOCAB, tiny_model
from tests.training.helpers import cli_argv
from training import eagle as eagle_train
from training.distill import self_distill
from training.eagle import _BUDGET_PROBE, EagleTrainConfig, answer_token_counts, train_eagle

pytestmark = pytest.mark.usefixtures("one_thread")


def _examples(target, n: int = 6):
    prompts = [torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]
    return self_distill(target, prompts, max_new_tokens=12, batch_size=n, progress=False)


def test_time_budget_cuts_the_steps_and_rescales_the_schedule():
    target = tiny_model("qwen2")
    examples = _examples(target)
    cfg = EagleTrainConfig(steps=500, batch_size=2, unroll=2)
    torch.manual_seed(0)
    # a budget already spent at the probe: training stops right there, far short of 500 steps
    losses = train_eagle(target, EagleHead(target), examples, cfg, progress=False, time_budget=1e-6)
    assert len(losses) == 3 + _BUDGET_PROBE + 1
    torch.manual_seed(0)
    assert len(train_eagle(target, EagleHead(target), examples, EagleTrainConfig(steps=20, batch_size=2, unroll=2),
                           progress=False, time_budget=3600.0)) == 20  # fmt: skip
    with pytest.raises(ValueError, match="time_budget"):
        train_eagle(target, EagleHead(target), examples, cfg, progress=False, time_budget=0.0)


def test_sequences_longer_than_max_len_are_left_out_and_reported(capsys, monkeypatch):
    """max_len: longer training sequences never reach a batch (their padding made the unrolled attention's
    [B, heads, T, T] scores run an H100 out of memory); the run says how many it left out; none left: a
    ValueError naming max_len."""
    from training.distill import Example

    target = tiny_model("qwen2")
    examples = _examples(target, 5)
    short = max(len(e.ids) for e in examples)
    long = Example(tuple(examples[0].ids) * 3, examples[0].prompt_len)
    seen = []
    step_terms = eagle_train._step_terms

    def spy(target, head, parts, batch, *args, **kwargs):
        seen.extend(len(e.ids) for e in batch)
        return step_terms(target, head, parts, batch, *args, **kwargs)

    monkeypatch.setattr(eagle_train, "_step_terms", spy)
    cfg = EagleTrainConfig(steps=40, batch_size=3, unroll=2, max_len=short)
    losses = train_eagle(target, EagleHead(target), [*examples, long], cfg, progress=False)
    assert len(losses) == 40 and seen and max(seen) == short
    assert f"left out 1 training sequence(s) longer than max_len = {short} tokens (the longest {len(long.ids)}); 5 left" \
        in capsys.readouterr().out
    with pytest.raises(ValueError, match=rf"examples: expected sequences of at most max_len = 4 tokens, got none"):
        train_eagle(target, EagleHead(target), examples, EagleTrainConfig(steps=2, max_len=4), progress=False)
    with pytest.raises(ValueError, match=r"max_len: expected an int >= 1, got 0"):
        EagleTrainConfig(max_len=0)


@pytest.mark.parametrize("layers", [None, (0, 1)])
def test_cached_target_features_train_like_the_per_batch_forward(capsys, layers):
    """cache_features=True: the target runs once over every sequence before the first step; the
    losses equal those of running it over every batch (padding and batch do not change a causal
    target's features), and the cache is reported; CPU's default (None) does not cache. A head on
    the target's layers caches their outputs ([len, k * H], HF's hidden states of those layers; the
    last one before the final norm) beside the final features ([len, H])."""
    target = tiny_model("qwen2")
    examples = _examples(target, 7)
    runs = {}
    for cache in (True, False, None):
        torch.manual_seed(0)
        head = EagleHead(target, layers)
        cfg = EagleTrainConfig(steps=12, batch_size=3, unroll=3, cache_features=cache)
        runs[cache] = train_eagle(target, head, examples, cfg, progress=False)
    assert torch.allclose(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-5, atol=1e-6)
    assert runs[None] == runs[False]
    assert "target features cached: 7 sequences" in capsys.readouterr().out
    feats = eagle_train._feature_cache(target, head, examples, torch.device("cpu"), None, batch_size=2)
    for e, (f, g) in zip(examples, feats):
        ids = torch.tensor([e.ids])
        with torch.no_grad():
            out = target(ids, output_hidden_states=True)
            want = eagle_train.target_hidden_states(target, ids, torch.ones(1, len(e.ids)))[0]
        assert f.shape == (len(e.ids), 64) and torch.allclose(f, want, atol=1e-5)
        if layers is None:
            assert g is None
            continue
        # layer 1's output is the final norm's input: HF's last hidden state is its norm
        assert g.shape == (len(e.ids), 128) and torch.allclose(g[:, :64], out.hidden_states[1][0], atol=1e-5)
        assert torch.allclose(target.model.norm(g[:, 64:]), out.hidden_states[2][0], atol=1e-5)
    with pytest.raises(ValueError, match="cache_features: expected None, True or False, got 1"):
        EagleTrainConfig(cache_features=1)


def test_a_reduced_training_vocabulary_renormalizes_the_cross_entropy_over_its_tokens():
    """train_vocab = V trains exactly like the whole vocabulary; a small N still lowers the loss;
    the loss of one step is the CE of the distributions renormalized over the N top answer tokens."""
    target = tiny_model("qwen2")
    examples = _examples(target, 7)
    runs = {}
    for n in (None, VOCAB, 12):
        torch.manual_seed(0)
        cfg = EagleTrainConfig(steps=30, batch_size=3, unroll=2, ce_weight=1.0, reg_weight=0.0, train_vocab=n)
        runs[n] = train_eagle(target, EagleHead(target), examples, cfg, progress=False)
    assert torch.allclose(torch.tensor(runs[VOCAB]), torch.tensor(runs[None]), rtol=1e-5, atol=1e-6)
    assert sum(runs[12][-5:]) < sum(runs[12][:5]) and runs[12] != runs[None]
    # one step's loss by hand over the subset
    parts = eagle_train.TargetParts.of(target)
    counts = answer_token_counts(examples, VOCAB)
    ids = torch.sort(torch.sort(-counts, stable=True).indices[:12]).values
    pred, feat = torch.randn(5, 64), torch.randn(5, 64)
    w = parts.lm_head.weight.detach()[ids]
    want = -(torch.softmax(feat @ w.T, -1) * torch.log_softmax(pred @ w.T, -1)).sum(-1).mean()
    cfg = EagleTrainConfig(ce_weight=1.0, reg_weight=0.0, train_vocab=12)
    got = eagle_train._loss(parts, pred, feat, None, cfg, (w, None))
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="train_vocab: expected None or an int >= 1, got 0"):
        EagleTrainConfig(train_vocab=0)


def test_cli_extra_sampled_answers_grow_the_training_set_and_are_cached(tmp_path, capsys):
    argv, out = cli_argv(tmp_path, 6, 2, 10, "--answers-per-prompt", "3", "--time-budget", "600")
    assert train_cli.main_eagle(argv) == 0
    assert "training sequences: 12 (4 problems x 1 prompt styles (mbpp) x 3 answers" in capsys.readouterr().out
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["train_examples"] == 12 and cfg["heldout_examples"] == 2 and cfg["train"]["answers_per_prompt"] == 3
    extra = [out / "selfdistill.sampled1.jsonl", out / "selfdistill.sampled2.jsonl"]
    assert all(p.is_file() for p in extra)
    answers = [[json.loads(line)["ids"] for line in p.read_text().splitlines()[1:]] for p in extra]
    assert len(answers[0]) == len(answers[1]) == 4 and answers[0] != answers[1]  # other seeds, other samples
    mtimes = [p.stat().st_mtime_ns for p in extra]
    assert train_cli.main_eagle(argv) == 0  # the second run reuses every pass
    assert [p.stat().st_mtime_ns for p in extra] == mtimes
    assert "answer tokens:" in capsys.readouterr().out


def test_cli_prompt_styles_phrase_every_problem_in_each_style(tmp_path, capsys):
    """--prompt-styles: every problem once per style (held-out problems too), a cache of its own;
    rows without a function skip the styles that need its signature."""
    argv, out = cli_argv(tmp_path, 5, 1, 6, "--prompt-styles", "mbpp,stdin,function")
    assert train_cli.main_eagle(argv) == 0
    assert "training sequences: 8 (4 problems x 3 prompt styles (mbpp, stdin, function) x 1 answers" \
        in capsys.readouterr().out  # the rows have no code: no 'function' prompts
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert (cfg["train_examples"], cfg["heldout_examples"]) == (8, 2)
    assert cfg["train"]["prompt_styles"] == ["mbpp", "stdin", "function"]
    with open(out / "selfdistill.jsonl") as f:
        assert json.loads(f.readline())["meta"]["styles"] == ["mbpp", "stdin", "function"]
    with pytest.raises(SystemExit):
        train_cli.main_eagle(argv[:-1] + ["mbpp,apps"])
    assert "expected distinct styles of mbpp, function, stdin, starter" in capsys.readouterr().err


def test_cli_saves_the_answer_token_frequencies_and_a_draft_vocab_round_trips(tmp_path, capsys):
    """train-eagle ranks the vocabulary by the training answers' token counts (held-out answers and
    prompts not counted) and saves it beside the head; the loaded head drafts from that subset."""
    from drafters import make_drafter
    from training.distill import Example, load_examples
    from specdec import SpecDecoder
    from specdec.drafting import DraftContext
    from specdec.models import load_model
    # sampled answers: many distinct tokens; a head on the final feature (the random [H] feature below)
    argv, out = cli_argv(tmp_path, 5, 1, 16, "--temperature", "1.0", "--feature-layers", "final")
    target_dir = Path(argv[1])
    assert train_cli.main_eagle(argv) == 0
    assert "answer tokens:" in capsys.readouterr().out and (out / VOCAB_NAME).is_file()
    with open(out / "selfdistill.jsonl") as f:
        meta = json.loads(f.readline())["meta"]
    train = load_examples(out / "selfdistill.jsonl", meta)[:4]
    target = load_model(str(target_dir), progress=False)
    vocab = target.config.vocab_size
    counts = answer_token_counts(train, vocab)
    assert int(counts.sum()) == sum(len(e.ids) - e.prompt_len for e in train) > 0
    head = EagleHead.load(out, target)
    assert torch.equal(head.token_counts, counts[head.token_ids])
    assert sorted(head.token_ids.tolist()) == list(range(vocab))
    seen = int((counts > 0).sum())
    assert set(head.token_ids[:seen].tolist()) == set(torch.nonzero(counts).flatten().tolist())
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["token_frequencies"] == {"file": VOCAB_NAME, "seen_tokens": seen, "counted_tokens": int(counts.sum())}
    assert answer_token_counts([Example((5, 6, 6, 7), 1)], 9).tolist() == [0, 0, 0, 0, 0, 0, 2, 1, 0]
    with pytest.raises(ValueError, match=r"examples: expected token ids in \[0, 7\), got \[5, 7\]"):
        answer_token_counts([Example((5, 6, 7), 0)], 7)

    drafter = make_drafter("eagle", target=target, heads=str(out), draft_vocab=seen, depth=3, topk=4)
    prompt = torch.tensor(train[0].ids[: train[0].prompt_len + 2])
    hidden = torch.randn(target.config.hidden_size)
    drafter.reset([prompt])
    tree = drafter.propose(DraftContext(prompt, 12, hidden=hidden))
    assert tree.n > 1 and set(tree.tokens[1:].tolist()) <= set(drafter.prompt_subset([prompt]).tolist())
    dec = SpecDecoder(target, EagleDrafter(target, head, draft_vocab=seen), tree_size=8, attn_impl="torch")
    plain = SpecDecoder(target, None, attn_impl="torch")
    assert dec.generate(prompt, 12).sequences.tolist() == plain.generate(prompt, 12).sequences.tolist()


def test_a_head_on_layer_features_learns_drafts_the_engine_accepts():
    """EAGLE-3's multi-layer features end to end: a head on both layers' outputs trains (the loss falls,
    held-out-style top-1 rises at every unrolled depth), and drafting through the engine -- which now
    passes those layers' outputs -- gets its learned drafts accepted, output unchanged (greedy, fp32)."""
    from specdec import SpecDecoder

    target = tiny_model("qwen2")
    examples = _examples(target, 16)
    torch.manual_seed(0)
    head = EagleHead(target, (0, 1))
    before = eagle_train.evaluate_eagle(target, head, examples[:6])
    losses = train_eagle(target, head, examples, EagleTrainConfig(steps=150, lr=3e-3, batch_size=4, ce_weight=1.0),
                         progress=False)  # fmt: skip
    after = eagle_train.evaluate_eagle(target, head, examples[:6])
    assert sum(losses[-10:]) / 10 < 0.85 * sum(losses[:10]) / 10
    assert all(a > b + 0.1 for a, b in zip(after, before)), (before, after)
    prompts = [torch.tensor(e.ids[:6]) for e in examples[:8]]
    out = SpecDecoder(target, EagleDrafter(target, head), tree_size=16, attn_impl="torch").generate(prompts, 12)
    for b, e in enumerate(examples[:8]):
        assert out.sequences[b, : out.lengths[b]].tolist() == list(e.ids[:18])
    # 65 of the 96 answer tokens here; with the two layers' features swapped at inference only 29
    assert out.totals()["tokens_accepted"] >= 50


def test_cli_trains_a_head_on_low_middle_and_high_layers(tmp_path, capsys):
    """``--feature-layers low,mid,high`` on the 2-layer target: layers 0 and 1 (names clamped), saved in
    the config; the loaded head drafts through the engine with the target's greedy output; a malformed
    spec is a one-line argument error, an index beyond the target a ValueError naming the field."""
    from drafters import make_drafter
    from specdec import SpecDecoder
    from specdec.models import load_model

    argv, out = cli_argv(tmp_path, 5, 1, 10, "--feature-layers", "low,mid,high")
    assert train_cli.main_eagle(argv) == 0
    text = capsys.readouterr().out
    assert "head features: the outputs of the target's layers [0, 1] (of 2), fused 2H -> H" in text
    assert "depth 2 (unrolled step 2): held-out top-1" in text
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["feature_layers"] == [0, 1] and cfg["train"]["feature_layers"] == "low,mid,high"
    target = load_model(argv[1], progress=False)
    drafter = make_drafter("eagle", target=target, heads=str(out), depth=3, topk=4)
    assert drafter.feature_layers == (0, 1) and drafter.head.fuse.weight.shape == (64, 128)
    prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(3))
    plain = SpecDecoder(target, None, attn_impl="torch").generate(prompt, 10).sequences.tolist()
    assert SpecDecoder(target, drafter, tree_size=8, attn_impl="torch").generate(prompt, 10).sequences.tolist() == plain
    with pytest.raises(SystemExit) as exc:
        train_cli.main_eagle(argv[:-1] + ["low,top"])
    assert exc.value.code == 2 and "--feature-layers: expected 'final' or comma-separated" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"feature_layers: expected 'final' or comma-separated layer indices in "
                                         r"\[-2, 2\) or low / mid / high, got '0,2'"):  # fmt: skip
        train_cli.main_eagle(argv[:-1] + ["0,2"])


@pytest.mark.parametrize("kw,match", [
    (dict(heldout=-1), "heldout: expected an int >= 0, got -1"),
    (dict(unroll=0), "unroll: expected an int >= 1, got 0"),
    (dict(num_prompts=0), "num_prompts: expected None or an int >= 1, got 0"),
    (dict(dtype="f32"), "dtype: expected None or one of"),
    (dict(prompt_styles=("mbpp", "apps")), "prompt_styles: expected a tuple of distinct styles"),
    (dict(prompt_styles=("mbpp", "mbpp")), "prompt_styles: expected a tuple of distinct styles"),
    (dict(feature_layers="low;high"), "feature_layers: expected 'final' or comma-separated layer indices"),
    (dict(feature_layers=(2, 3)), "feature_layers: expected 'final' or comma-separated layer indices"),
])  # fmt: skip
def test_run_settings_name_the_field_out_of_range(kw, match):
    from training.eagle import EagleRun
    from training.medusa import MedusaRun

    with pytest.raises(ValueError, match=match):
        EagleRun(out="x", **kw)
    assert EagleRun(out="x").prompt_styles == ("mbpp",)
    if not {"unroll", "prompt_styles", "feature_layers"} & set(kw):  # fields the Medusa run has too
        with pytest.raises(ValueError, match=match):
            MedusaRun(out="x", **kw)
    with pytest.raises(ValueError, match="table_ranks: expected an int >= 1, got 0"):
        MedusaRun(out="x", table_ranks=0)


def test_auto_steps_are_about_ten_passes_within_bounds():
    """``EagleTrainConfig.steps`` None: ``AUTO_PASSES`` passes at the batch size, clamped; the default."""
    from training.eagle import AUTO_MAX_STEPS, AUTO_MIN_STEPS, AUTO_PASSES, auto_steps

    assert EagleTrainConfig().steps is None and EagleTrainConfig().unroll == 4
    assert auto_steps(3686, 8) == -(-AUTO_PASSES * 3686 // 8) == 4608  # the MBPP data: ~the measured 4,574
    assert auto_steps(952, 8) == AUTO_MIN_STEPS  # a 1,000-prompt file: 1,190 steps would be 10 passes
    assert auto_steps(100_000, 8) == AUTO_MAX_STEPS
    with pytest.raises(ValueError, match="sequences, batch_size"):
        auto_steps(0, 8)
    with pytest.raises(ValueError, match=r"steps: expected an int >= 1 or None \(auto\), got 0"):
        EagleTrainConfig(steps=0)
