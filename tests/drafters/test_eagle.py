"""EAGLE head and drafter: trees, agreement with the unrolled training forward, greedy equality,
incremental catch-up, training, save / load, errors, the CLI."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from drafters import make_drafter
from drafters.eagle import CONFIG_NAME, WEIGHTS_NAME, EagleDrafter, EagleHead, TargetParts
from drafters.eagle_train import EagleTrainConfig, evaluate_eagle, train_eagle, unrolled_features
from drafters.medusa import MedusaHeads
from drafters.medusa_train import self_distill, target_hidden_states
from specdec import SpecDecoder
from specdec.drafting import DraftContext
from specdec.sampling import SamplingConfig
from specdec.verify import Verdict
from tests.specdec.helpers import VOCAB, hf_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@functools.lru_cache(maxsize=None)
def _target(family: str = "qwen2"):
    return tiny_model(family)


@functools.lru_cache(maxsize=None)
def _random_head(family: str = "qwen2", seed: int = 0) -> EagleHead:
    """A head with large random weights (decisive, non-trivial drafts)."""
    torch.manual_seed(seed)
    head = EagleHead(_target(family))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return head.eval()


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def _features(target, tokens: torch.Tensor) -> torch.Tensor:
    """``[L, H]``: the target's final hidden states (the LM head's input) of ``tokens``."""
    return target_hidden_states(target, tokens[None], torch.ones(1, len(tokens), dtype=torch.long))[0]


def test_head_stores_only_fc_and_one_layer_and_predicts_features():
    target = _target()
    head = EagleHead(target)
    keys = set(head.state_dict())
    assert keys and all(k.startswith(("fc.", "layer.")) for k in keys)
    assert head.fc.weight.shape == (64, 128)
    assert type(head.layer) is type(target.model.layers[0])
    parts = TargetParts.of(target)
    ids, feats = _prompt(7, 0)[None], torch.randn(1, 7, 64)
    out = head(parts, ids, feats, torch.arange(7)[None])
    assert out.shape == (1, 7, 64) and parts.logits(out).shape == (1, 7, VOCAB)
    # the training features are what the engine passes: the LM head's input
    tokens = _prompt(7, 1)
    torch.testing.assert_close(parts.logits(_features(target, tokens)), target(tokens[None]).logits[0])
    # causal: a pair never sees later pairs
    out2 = head(parts, ids[:, :4], feats[:, :4], torch.arange(4)[None])
    torch.testing.assert_close(out2, out[:, :4])


@pytest.mark.parametrize("depth,topk", [(6, 8), (3, 2), (1, 4)])
def test_trees_are_valid_and_fill_budgets_1_to_40(depth, topk):
    target = _target()
    drafter = EagleDrafter(target, _random_head(), depth=depth, topk=topk)
    hidden = torch.randn(64)
    for budget in range(1, 41):
        for prompt, sampling in ((_prompt(9, budget), None), (_prompt(2, budget), SamplingConfig(0.8, top_k=20))):
            drafter.reset([prompt])
            tree = drafter.propose(DraftContext(prompt, budget, sampling=sampling, hidden=hidden))
            assert int(tree.tokens[0]) == int(prompt[-1]) and tree.proposal == "topk" and tree.draft_probs is None
            assert int(tree.tokens.max()) < VOCAB
            # the pool always holds enough nodes; under top-k warping a node's children stay top-k
            assert tree.n - 1 == budget
            depths = [0] * tree.n
            for i in range(1, tree.n):
                depths[i] = depths[int(tree.parents[i])] + 1
            assert max(depths) <= depth
            assert 1 <= drafter.last_forwards <= depth


def test_no_hidden_state_or_budget_gives_a_root_only_tree():
    drafter = EagleDrafter(_target(), _random_head())
    assert drafter.propose(DraftContext(_prompt(5, 0), 16)).n == 1
    assert drafter.propose(DraftContext(_prompt(5, 0), 0, hidden=torch.randn(64))).n == 1
    assert EagleDrafter(_target(), _random_head(), tree_size=3).propose(
        DraftContext(_prompt(5, 0), 16, hidden=torch.randn(64))).n == 4  # its own cap


def _path_to(tree, node: int) -> list[int]:
    path = [node]
    while path[-1] != 0:
        path.append(int(tree.parents[path[-1]]))
    return path[::-1]


@pytest.mark.parametrize("static_shapes", [False, True])
def test_every_expanded_node_drafts_what_the_unrolled_training_forward_predicts(static_shapes):
    """With every target feature given (full catch-up), node v's children are the top tokens of the
    unrolled training forward along v's path: drafting and training compute the same function."""
    target, head = _target(), _random_head()
    parts = TargetParts.of(target)
    tokens = _prompt(12, 5)
    n_tok = len(tokens)
    feats = _features(target, tokens)
    drafter = EagleDrafter(target, head, depth=4, topk=3, static_shapes=static_shapes)
    drafter.reset([tokens])
    tree = drafter.propose(DraftContext(tokens, 24, hidden=feats[: n_tok - 1]))
    checked = 0
    for v in range(tree.n):
        kids = tree.children[v]
        if not kids:
            continue
        path = _path_to(tree, v)
        chain = tree.tokens[path[1:]]  # the drafted tokens after the root, down to v
        ids = torch.cat([tokens, chain, torch.zeros(1, dtype=torch.int64)])[None]
        f = torch.cat([feats, torch.zeros(len(chain) + 1, 64)])[None]
        with torch.no_grad():
            y = unrolled_features(head, parts, ids, f, len(path))[-1][0, n_tok - 1]
        top = torch.topk(parts.logits(y).float(), len(kids)).indices.tolist()
        assert tree.tokens[list(kids)].tolist() == top, v
        checked += 1
    assert checked >= 4


def test_incremental_catch_up_equals_drafting_from_scratch():
    """Given the target's features of the newly committed tokens each step ([m, H] hidden), the
    drafter that reuses its KV proposes exactly the trees a fresh drafter proposes from all features."""
    target, head = _target(), _random_head()
    prompt = _prompt(8, 3)
    sequence = torch.tensor(hf_greedy(target, prompt, 30))
    feats = _features(target, sequence)
    drafter = EagleDrafter(target, head, depth=4, topk=3)
    fresh = EagleDrafter(target, head, depth=4, topk=3)
    drafter.reset([prompt])
    n_tok, seen = len(prompt), 0
    while n_tok < len(sequence) - 6:
        tokens = sequence[:n_tok]
        ctx = DraftContext(tokens, 12, hidden=feats[seen : n_tok - 1])
        tree = drafter.propose(ctx)
        fresh.reset([tokens])
        ref = fresh.propose(DraftContext(tokens, 12, hidden=feats[: n_tok - 1]))
        assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()
        path = [0]  # greedy acceptance against the target's own continuation
        while True:
            nxt = [c for c in tree.children[path[-1]] if int(tree.tokens[c]) == int(sequence[n_tok + len(path) - 1])]
            if not nxt:
                break
            path.append(nxt[0])
        drafter.update(ctx, tree, Verdict(tuple(path), int(sequence[n_tok + len(path) - 1])))
        seen = n_tok - 1
        n_tok += len(path)


def test_another_history_without_reset_drafts_like_a_fresh_drafter():
    target, head = _target(), _random_head()
    drafter = EagleDrafter(target, head, depth=3, topk=3)
    first = _prompt(9, 7)
    ctx = DraftContext(first, 10, hidden=torch.randn(64))
    tree = drafter.propose(ctx)
    drafter.update(ctx, tree, Verdict((0, tree.children[0][0]), 5))
    other, hidden = _prompt(11, 8), torch.randn(64)
    assert int(other[0]) != int(first[0])
    got = drafter.propose(DraftContext(other, 10, hidden=hidden))
    want = EagleDrafter(target, head, depth=3, topk=3).propose(DraftContext(other, 10, hidden=hidden))
    assert (got.tokens.tolist(), got.parents.tolist()) == (want.tokens.tolist(), want.parents.tolist())


@pytest.mark.parametrize("family,tree_size,static", [("qwen2", 1, False), ("qwen2", 8, True), ("qwen2", 40, False),
                                                     ("llama", 16, False), ("llama", 40, True), ("mistral", 16, True),
                                                     ("gemma3", 24, False)])
def test_greedy_equals_target_generate(family, tree_size, static):
    target = _target(family)
    prompts = [_prompt(10, 0), _prompt(1, 1), _prompt(5, 2)]
    drafter = EagleDrafter(target, _random_head(family), depth=4, topk=4, static_shapes=static)
    out = SpecDecoder(target, drafter, tree_size=tree_size, attn_impl="torch").generate(prompts, 25)
    for b, p in enumerate(prompts):
        assert out.sequences[b, : out.lengths[b]].tolist() == hf_greedy(target, p, 25)


@functools.lru_cache(maxsize=None)
def _distilled():
    prompts = [_prompt(6, 100 + i).tolist() for i in range(24)]
    return self_distill(_target(), prompts, max_new_tokens=40, batch_size=8, progress=False)


def test_training_lowers_the_loss_and_round_trips_through_save_load(tmp_path):
    target = _target()
    examples = _distilled()
    train = examples[:20]
    torch.manual_seed(0)
    head = EagleHead(target)
    before = evaluate_eagle(target, head, train[:6])
    losses = train_eagle(target, head, train, EagleTrainConfig(steps=150, lr=3e-3, batch_size=4, ce_weight=1.0),
                         progress=False)  # fmt: skip
    after = evaluate_eagle(target, head, train[:6])
    assert len(before) == len(after) == 3
    assert sum(losses[-10:]) / 10 < 0.85 * sum(losses[:10]) / 10
    assert all(a > b + 0.1 for a, b in zip(after, before)), (before, after)  # it fits what it saw
    assert all(p.requires_grad is False for p in target.parameters())

    # trained: greedy output still the target's, and drafts it learned get accepted
    prompt = torch.tensor(train[0].ids[:6])
    out = SpecDecoder(target, EagleDrafter(target, head), tree_size=16, attn_impl="torch").generate(prompt, 30)
    assert out.sequences[0].tolist() == list(train[0].ids[:36])
    assert out.totals()["tokens_accepted"] >= 5

    head.save(tmp_path / "h", target="tiny", note=1)
    assert {p.name for p in (tmp_path / "h").iterdir()} == {CONFIG_NAME, WEIGHTS_NAME}
    loaded = EagleHead.load(tmp_path / "h", target)
    assert loaded.meta["target"] == "tiny" and loaded.meta["hidden_size"] == 64
    assert loaded.meta["architecture"] == "Qwen2ForCausalLM" and loaded.meta["num_target_layers"] == 2
    for hidden in (torch.randn(64), _features(target, prompt)[:5]):
        trees = []
        for h in (head, loaded):
            d = EagleDrafter(target, h)
            d.reset([prompt])
            trees.append(d.propose(DraftContext(prompt, 30, hidden=hidden)))
        assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
        assert trees[0].parents.tolist() == trees[1].parents.tolist()
    via_factory = make_drafter("eagle", target=target, heads=str(tmp_path / "h"), depth=2)
    assert via_factory.depth == 2 and via_factory.head.fc.weight.dtype == torch.float32


def test_bad_heads_and_inputs_raise_value_errors(tmp_path):
    target = _target()
    with pytest.raises(ValueError, match=r"path: expected a directory with eagle_config.json and eagle_head.safetensors"):
        EagleHead.load(tmp_path, target)
    with pytest.raises(ValueError, match=r"heads: expected a directory with eagle_config.json"):
        make_drafter("eagle", target=target, heads=str(tmp_path / "missing"))
    EagleHead(target).save(tmp_path / "h")
    (tmp_path / "h" / WEIGHTS_NAME).unlink()
    with pytest.raises(ValueError, match=r"heads: expected a directory with eagle_config.json and eagle_head"):
        make_drafter("eagle", target=target, heads=str(tmp_path / "h"))

    # heads made for another model: hidden size, vocabulary, architecture, depth
    from transformers import AutoModelForCausalLM

    from tests.specdec.helpers import tiny_config

    def variant(family="qwen2", **changes):
        cfg = tiny_config(family)
        for k, v in changes.items():
            setattr(cfg, k, v)
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        return AutoModelForCausalLM.from_config(cfg).eval()

    cases = [(variant(hidden_size=32, intermediate_size=64), r"hidden_size = 64, got 32"),
             (variant(vocab_size=VOCAB + 1), rf"vocab_size = {VOCAB}, got {VOCAB + 1}"),
             (variant("llama"), r"architecture = 'Qwen2ForCausalLM', got 'LlamaForCausalLM'"),
             (variant(num_hidden_layers=3), r"num_target_layers = 2, got 3")]
    for i, (other, msg) in enumerate(cases):
        EagleHead(other).save(tmp_path / f"other{i}")
        with pytest.raises(ValueError, match=r"heads: expected a head for the target's " + msg):
            make_drafter("eagle", target=target, heads=str(tmp_path / f"other{i}"))
        with pytest.raises(ValueError, match=r"heads: expected a head for the target's " + msg):
            make_drafter("eagle", target=target, heads=EagleHead(other))
        with pytest.raises(ValueError, match=r"head: expected a head for the target's " + msg):
            EagleDrafter(target, EagleHead(other))
    EagleHead(variant(intermediate_size=96)).save(tmp_path / "mlp")  # same config entries, other layer shapes
    with pytest.raises(ValueError, match=r"heads: .*eagle_head.safetensors does not fit the target's decoder layer"):
        make_drafter("eagle", target=target, heads=str(tmp_path / "mlp"))
    cfg = json.loads((tmp_path / "other0" / CONFIG_NAME).read_text())
    del cfg["vocab_size"]
    (tmp_path / "other0" / CONFIG_NAME).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"path: .* lacks the entry 'vocab_size'"):
        EagleHead.load(tmp_path / "other0", target)

    with pytest.raises(ValueError, match=r"head: expected a drafters.eagle.EagleHead, got MedusaHeads"):
        EagleDrafter(target, MedusaHeads(64, 2))
    with pytest.raises(ValueError, match=r"depth: expected an int >= 1, got 0"):
        EagleDrafter(target, _random_head(), depth=0)
    with pytest.raises(ValueError, match=r"hidden: expected \[64\] or \[m, 64\] with 1 <= m <= 4, got \(32,\)"):
        EagleDrafter(target, _random_head()).propose(DraftContext(_prompt(5, 0), 8, hidden=torch.randn(32)))
    with pytest.raises(ValueError, match=r"unroll: expected an int >= 1, got 0"):
        EagleTrainConfig(unroll=0)


def test_train_eagle_cli_on_a_tiny_model(tmp_path, capsys):
    from drafters import eagle_train
    from specdec import cli
    from tests.drafters.helpers import save_tiny_pair

    target_dir, _ = save_tiny_pair(tmp_path)
    data = tmp_path / "mbpp.jsonl"
    rows = [{"text": f"Write a function number {i}.", "test_list": [f"assert f({i}) == {i}"]} for i in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eagle"
    argv = ["--target", str(target_dir), "--data", str(data), "--out", str(out), "--steps", "3", "--batch-size", "2",
            "--heldout", "2", "--max-new-tokens", "12", "--unroll", "2", "--device", "cpu", "--no-progress"]
    assert eagle_train.main(argv) == 0
    text = capsys.readouterr().out
    assert "depth 1 (unrolled step 1): held-out top-1" in text and "depth 2 (unrolled step 2)" in text
    cfg = json.loads((out / CONFIG_NAME).read_text())
    assert cfg["train_examples"] == 4 and len(cfg["heldout_top1"]) == 2 and cfg["train"]["unroll"] == 2
    assert cfg["model_type"] == "qwen2" and cfg["layer_class"] == "Qwen2DecoderLayer"
    assert (out / "selfdistill.jsonl").is_file()
    # a second run reuses the cached answers, also from another directory through --cache
    assert eagle_train.main(argv[:5] + [str(tmp_path / "second"), "--cache", str(out / "selfdistill.jsonl")]
                            + argv[6:]) == 0  # fmt: skip
    assert "cached answers" in capsys.readouterr().out
    assert (tmp_path / "second" / WEIGHTS_NAME).is_file()
    # the subcommand is registered; argument errors are one line
    assert "train-eagle" in cli.SUBCOMMANDS
    with pytest.raises(SystemExit) as exc:
        cli.main(["train-eagle", "--out", str(out), "--unroll", "0"])
    assert exc.value.code == 2 and "--unroll" in capsys.readouterr().err
