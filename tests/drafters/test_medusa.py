"""Medusa heads: initialization, drafter trees, greedy equality, training, save/load, the CLI."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from specdec.drafting import DraftContext
from drafters.medusa import MedusaDrafter, MedusaHeads
from drafters.trees import MC_SIM_7B_63, Topology
from eval.datasets import load_mbpp
from specdec import SpecDecoder
from tests.specdec.helpers import VOCAB, hf_greedy, tiny_model
from training.distill import Example, mbpp_prompt, self_distill
from training.medusa import TrainConfig, evaluate_heads, rank_rates, train_heads


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _target():
    return tiny_model("qwen2")


def _random_heads(k: int = 4, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(64, k)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.1)
    return heads


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def test_fresh_heads_predict_like_the_lm_head():
    target = _target()
    heads = MedusaHeads(64, 3)
    h = torch.randn(5, 64)
    logits = heads(h, target.get_output_embeddings())
    assert logits.shape == (5, 3, VOCAB)
    for k in range(3):
        torch.testing.assert_close(logits[:, k], target.get_output_embeddings()(h))


@pytest.mark.parametrize("t", [32, 64, 128, 256])
def test_drafter_fills_a_static_topology_of_exactly_t_nodes(t):
    target, heads = _target(), _random_heads()
    drafter = MedusaDrafter(target, heads)
    h = torch.randn(64)
    tree = drafter.propose(DraftContext(_prompt(6, 0), t, hidden=h[None]))  # [1, H]: the root's predictor
    assert tree.n - 1 == t
    topo = drafter.topology(t)
    assert topo.max_depth <= 4
    top = torch.topk(heads(h[None], target.get_output_embeddings())[0], topo.max_rank + 1, -1).indices
    for i in range(1, tree.n):
        assert int(tree.tokens[i]) == int(top[topo.depth[i] - 1, topo.rank[i]])
    assert tree.parents.tolist() == topo.parents.tolist()


def test_drafter_without_hidden_state_is_root_only_and_fixed_choices_truncate():
    target, heads = _target(), _random_heads()
    assert MedusaDrafter(target, heads).propose(DraftContext(_prompt(6, 0), 32)).n == 1
    fixed = MedusaDrafter(target, heads, choices=MC_SIM_7B_63)
    tree = fixed.propose(DraftContext(_prompt(6, 0), 63, hidden=torch.randn(1, 64)))
    assert tree.n == 64 and tree.parents.tolist() == Topology.from_choices(MC_SIM_7B_63).parents.tolist()
    assert fixed.propose(DraftContext(_prompt(6, 0), 10, hidden=torch.randn(1, 64))).n == 11
    with pytest.raises(ValueError, match=r"choices: expected depth <= num_heads = 2, got 4"):
        MedusaDrafter(target, _random_heads(2), choices=MC_SIM_7B_63)
    with pytest.raises(ValueError, match=r"heads: expected hidden_size 64 \(the target's\), got 32"):
        MedusaDrafter(target, MedusaHeads(32, 2))


def test_propose_batch_equals_propose_per_context():
    """One heads forward for a batch: the same trees as one call per sequence, across budgets, with
    contexts that get only a root (no feature, no budget) in between."""
    target, heads = _target(), _random_heads(seed=3)
    drafter = MedusaDrafter(target, heads)
    feats = torch.randn(6, 2, 64, generator=torch.Generator().manual_seed(5))
    contexts = [
        DraftContext(_prompt(6, 0), 32, seq=0, hidden=feats[0]),
        DraftContext(_prompt(3, 1), 32, seq=1, hidden=feats[1]),
        DraftContext(_prompt(5, 2), 32, seq=2),  # no feature: root only
        DraftContext(_prompt(7, 3), 64, seq=3, hidden=feats[3]),  # another budget: its own group
        DraftContext(_prompt(2, 4), 0, seq=4, hidden=feats[4]),  # no budget: root only
        DraftContext(_prompt(9, 5), 32, seq=5, hidden=feats[5]),
    ]
    got = drafter.propose_batch(contexts)
    want = [drafter.propose(c) for c in contexts]
    assert [t.n for t in got] == [33, 33, 1, 65, 1, 33]
    for g, w in zip(got, want):
        assert g.tokens.tolist() == w.tokens.tolist() and g.parents.tolist() == w.parents.tolist()


@pytest.mark.parametrize("tree_size,choices", [(1, None), (8, None), (64, None), (63, MC_SIM_7B_63)])
def test_greedy_equals_target_generate(tree_size, choices):
    target = _target()
    prompts = [_prompt(10, 0), _prompt(1, 1)]
    drafter = MedusaDrafter(target, _random_heads(), choices=choices)
    out = SpecDecoder(target, drafter, tree_size=tree_size, attn_impl="torch").generate(prompts, 25)
    for b, p in enumerate(prompts):
        assert out.sequences[b, : out.lengths[b]].tolist() == hf_greedy(target, p, 25)


@functools.lru_cache(maxsize=None)
def _distilled():
    target = _target()
    prompts = [_prompt(6, 100 + i).tolist() for i in range(24)]
    return self_distill(target, prompts, max_new_tokens=40, batch_size=8, progress=False)


def test_self_distill_batches_prompts_by_length_and_answers_in_the_given_order():
    """Prompts of different lengths, batched after sorting by length: each answer is the target's own
    greedy continuation of its prompt, returned at the prompt's index."""
    target = _target()
    prompts = [_prompt(n, 200 + i).tolist() for i, n in enumerate([9, 2, 14, 5, 2, 11, 7])]
    examples = self_distill(target, prompts, max_new_tokens=12, batch_size=3, progress=False)
    for p, e in zip(prompts, examples):
        assert e.prompt_len == len(p) and list(e.ids) == hf_greedy(target, torch.tensor(p), 12)


def test_self_distill_halves_a_batch_that_runs_out_of_memory(monkeypatch, capsys):
    """A generate call that raises OutOfMemoryError is retried at half the batch (down to one
    prompt, where the error propagates); every answer is still the target's greedy one, in order."""
    target = _target()
    real, sizes = target.generate, []

    def generate(ids, **kw):
        sizes.append(ids.shape[0])
        if ids.shape[0] > 2:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real(ids, **kw)

    monkeypatch.setattr(target, "generate", generate)
    prompts = [_prompt(n, 300 + i).tolist() for i, n in enumerate([4, 9, 2, 6, 5])]
    examples = self_distill(target, prompts, max_new_tokens=6, batch_size=5, progress=True)
    assert sizes[:3] == [5, 3, 2] and max(sizes[3:]) <= 2 and sum(s for s in sizes if s <= 2) == 5
    assert "retrying at 3" in capsys.readouterr().out
    for p, e in zip(prompts, examples):
        assert list(e.ids) == hf_greedy(target, torch.tensor(p), 6)
    monkeypatch.setattr(target, "generate", lambda ids, **kw: (_ for _ in ()).throw(torch.OutOfMemoryError("oom")))
    with pytest.raises(torch.OutOfMemoryError):
        self_distill(target, prompts[:1], max_new_tokens=6, batch_size=4, progress=False)


def test_training_lowers_the_loss_and_round_trips_through_save_load(tmp_path):
    target = _target()
    examples = _distilled()
    assert all(len(e.ids) == e.prompt_len + 40 for e in examples)
    assert list(examples[0].ids) == hf_greedy(target, torch.tensor(examples[0].ids[:6]), 40)
    train, heldout = examples[:20], examples[20:]
    torch.manual_seed(0)
    heads = MedusaHeads(64, 3)
    before = evaluate_heads(target, heads, heldout)
    losses = train_heads(target, heads, train, TrainConfig(steps=60, lr=1e-2, batch_size=4, seed=0), progress=False)
    after = evaluate_heads(target, heads, heldout)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    assert sum(after) > sum(before)
    assert all(p.requires_grad is False for p in target.parameters())

    heads.save(tmp_path / "heads", target="tiny", note=1)
    loaded = MedusaHeads.load(tmp_path / "heads")
    assert loaded.meta["target"] == "tiny" and loaded.num_heads == 3
    h = torch.randn(4, 64)
    lm = target.get_output_embeddings()
    torch.testing.assert_close(loaded(h, lm), heads(h, lm))
    # the trained heads draft tokens the target accepts (its generations are what they learned)
    out = SpecDecoder(target, MedusaDrafter(target, loaded), tree_size=16, attn_impl="torch").generate(
        torch.tensor(heldout[0].ids[:6]), 30)
    assert out.sequences[0].tolist() == list(heldout[0].ids[:36])
    assert out.totals()["tokens_accepted"] > 0
    with pytest.raises(ValueError, match=r"path: expected a directory with medusa_config.json"):
        MedusaHeads.load(tmp_path)


def test_rank_rates_partition_every_position_and_build_the_drafters_trees(tmp_path):
    target = _target()
    examples = _distilled()[20:]
    torch.manual_seed(1)
    heads = MedusaHeads(64, 3)
    train_heads(target, heads, _distilled()[:20], TrainConfig(steps=10, lr=1e-2, batch_size=4, seed=0), progress=False)
    full = rank_rates(target, heads, examples, ranks=VOCAB)  # every label has some rank among all tokens
    assert len(full) == 3 and all(abs(sum(row) - 1.0) < 1e-9 for row in full)
    top = rank_rates(target, heads, examples, ranks=4)
    assert [r[:4] for r in full] == top
    assert [r[0] for r in top] == evaluate_heads(target, heads, examples)
    with pytest.raises(ValueError, match=r"ranks: expected >= 1, got 0"):
        rank_rates(target, heads, examples, ranks=0)

    heads.save(tmp_path / "h", heldout_rank_rates=top)
    loaded = MedusaHeads.load(tmp_path / "h")
    drafter = MedusaDrafter(target, loaded)
    assert drafter.table.probs == tuple(tuple(r) for r in top)
    assert drafter.topology(40).n == 41 and drafter.topology(40).depth.max() <= 3
    assert MedusaDrafter(target, loaded, table="prior").table is None
    assert MedusaDrafter(target, heads).table is None  # trained here, never saved: no rates
    with pytest.raises(ValueError, match=r"table: expected an AcceptanceTable, None or 'prior', got 'measured'"):
        MedusaDrafter(target, loaded, table="measured")
    loaded.meta["heldout_rank_rates"] = top[:2]
    with pytest.raises(ValueError, match=r"heads: expected heldout_rank_rates of 3 rows"):
        MedusaDrafter(target, loaded)


def test_mbpp_rows_and_prompts(tmp_path):
    path = tmp_path / "mbpp.jsonl"
    path.write_text(json.dumps({"text": "Add two numbers.", "test_list": ["assert add(1, 2) == 3"]}) + "\n\n")
    rows = load_mbpp(path)
    assert mbpp_prompt(rows[0]) == "Add two numbers.\nYour code should pass these tests:\n\nassert add(1, 2) == 3\n"
    with pytest.raises(ValueError, match=r"path: expected the MBPP jsonl file"):
        load_mbpp(tmp_path / "missing.jsonl")


def test_train_medusa_cli_on_a_tiny_model(tmp_path, capsys):
    from specdec.cli import train as train_cli
    from tests.drafters.helpers import save_tiny_pair

    target_dir, _ = save_tiny_pair(tmp_path)
    data = tmp_path / "mbpp.jsonl"
    rows = [{"text": f"Write a function number {i}.", "test_list": [f"assert f({i}) == {i}"]} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "heads"
    argv = ["--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "3", "--batch-size", "2",
            "--heldout", "2", "--max-new-tokens", "12", "--num-heads", "2", "--device", "cpu", "--no-progress"]
    assert train_cli.main_medusa(argv) == 0
    text = capsys.readouterr().out
    assert "head 1 (token +1 beyond the next): held-out top-1" in text
    cfg = json.loads((out / "medusa_config.json").read_text())
    assert cfg["num_heads"] == 2 and cfg["train_examples"] == 4 and len(cfg["heldout_top1"]) == 2
    rates = cfg["heldout_rank_rates"]  # 2 heads x 16 ranks; column 0 is the top-1 accuracy
    assert len(rates) == 2 and all(len(r) == 16 for r in rates)
    assert [r[0] for r in rates] == cfg["heldout_top1"]
    assert (out / "selfdistill.jsonl").is_file()
    # a second run reuses the cached self-distillation answers
    assert train_cli.main_medusa(argv) == 0
    assert "cached answers" in capsys.readouterr().out
    assert MedusaHeads.load(out).num_heads == 2
    assert Example((1, 2), 1).prompt_len == 1
