"""specdec.distributed: rank-consistent decoding of a tensor-parallel target.

Unit tests drive ``RankSync`` through scripted collectives (no processes). The end-to-end test
launches 2 ranks with ``torch.distributed.run`` (gloo, CPU): tiny Qwen2 / Llama targets split by
``specdec.tensor_parallel`` must decode exactly as the unsharded models in this process (greedy, fp32),
for plain decoding, prompt lookup, a draft model, Medusa and EAGLE heads; a sampling run must give
the same tokens on both ranks although their generators were seeded differently; a drafter whose
trees differ by rank, and prompts that differ by rank, must raise on every rank. A shorter 2-rank
run checks a run's end: decoder released, barrier, process group destroyed, exit 0, no error line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.distributed import (RankSync, TorchCollectives, decode_verdicts, encode_verdicts, fingerprint,
                                 tensor_parallel_group, tree_fingerprint)  # fmt: skip
from specdec.engine import SpecDecoder
from specdec.tree import TokenTree
from specdec.verify import Verdict
from tests.specdec import tp_worker
from tests.specdec.helpers import prepared_tiny_model, random_prompt

ROOT = Path(__file__).resolve().parents[2]


class Scripted:
    """Collectives of rank ``rank`` in a group of ``world``: the other ranks send what ``peer``
    makes of this rank's tensor (default: the same), and a broadcast from another rank delivers
    ``on_broadcast(tensor)`` (default: unchanged)."""

    def __init__(self, rank=1, world=2, peer=None, on_broadcast=None):
        self.rank, self.world_size = rank, world
        self.peer = peer or (lambda r, t: t.clone())
        self.on_broadcast = on_broadcast
        self.calls: list[str] = []

    def all_gather(self, tensor):
        self.calls.append("all_gather")
        return torch.stack([tensor.clone() if r == self.rank else self.peer(r, tensor) for r in range(self.world_size)])

    def broadcast(self, tensor, src):
        self.calls.append("broadcast")
        if src != self.rank and self.on_broadcast is not None:
            tensor.copy_(self.on_broadcast(tensor))


def _tree(tokens, parents):
    return TokenTree(torch.tensor(tokens), torch.tensor(parents))


# ---------------------------------------------------------------------------------------- pure parts


def test_fingerprint_is_stable_and_sensitive():
    a = fingerprint([torch.tensor([1, 2, 3])], 5, "x", None, 1.5)
    assert a == fingerprint([torch.tensor([1, 2, 3])], 5, "x", None, 1.5)
    assert 0 <= a < 2**63
    for other in ([torch.tensor([1, 2, 4])], 5, "x", None, 1.5), ([torch.tensor([1, 2, 3], dtype=torch.int32)], 5,
                                                                   "x", None, 1.5), ([torch.tensor([1, 2, 3])], 6):
        assert fingerprint(*other) != a
    assert fingerprint(torch.zeros(0)) != fingerprint(torch.zeros(1))
    assert fingerprint(torch.ones(2, dtype=torch.bfloat16)) == fingerprint(torch.ones(2, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="parts"):
        fingerprint(object())


def test_tree_fingerprint_ignores_draft_probs_but_not_shape():
    t1 = _tree([5, 6, 7], [-1, 0, 0])
    assert tree_fingerprint(t1) == tree_fingerprint(_tree([5, 6, 7], [-1, 0, 0]))
    assert tree_fingerprint(t1) != tree_fingerprint(_tree([5, 6, 7], [-1, 0, 1]))
    assert tree_fingerprint(t1) != tree_fingerprint(_tree([5, 7, 6], [-1, 0, 0]))
    probs = TokenTree(t1.tokens, t1.parents, torch.full((3, 8), 0.125), "iid")
    assert tree_fingerprint(probs) != tree_fingerprint(t1)  # the proposal kind counts


def test_verdicts_round_trip():
    verdicts = [Verdict((0, 2, 3), 17), None, Verdict((0,), 4)]
    payload = encode_verdicts(verdicts, 5)
    assert payload.shape == (3, 7) and payload.dtype == torch.int64
    assert decode_verdicts(payload) == verdicts
    with pytest.raises(ValueError, match=r"verdicts\[0\]"):
        encode_verdicts(verdicts, 2)
    with pytest.raises(ValueError, match="payload"):
        decode_verdicts(torch.zeros(3, dtype=torch.int64))


# ---------------------------------------------------------------------------------------- RankSync


def test_verdicts_come_from_the_source_rank():
    trees = [_tree([5, 6, 7], [-1, 0, 1]), _tree([9], [-1])]
    mine = [Verdict((0, 1, 2), 11), Verdict((0,), 3)]
    theirs = [Verdict((0, 1), 8), None]
    comm = Scripted(rank=1, on_broadcast=lambda t: encode_verdicts(theirs, 3).flatten())
    sync = RankSync(comm)
    assert (sync.rank, sync.world_size, sync.src) == (1, 2, 0)
    assert sync.verdicts(mine, trees) == theirs
    # on the source rank its own decision stands
    assert RankSync(Scripted(rank=0, on_broadcast=lambda t: t * 0)).verdicts(mine, trees) == mine


def test_sampling_copies_the_source_generator_state():
    trees = [_tree([5, 6], [-1, 0])]
    src_gen = torch.Generator().manual_seed(1)
    src_gen.manual_seed(7)
    src_state = src_gen.get_state()

    def deliver(t):  # the verdict part is ours (unchanged), the generator part the source's
        out = t.clone()
        if out.numel() > src_state.numel() // 8:
            out[-src_state.numel() // 8 :] = src_state.view(torch.int64)
        return out

    gen = torch.Generator().manual_seed(99)
    sync = RankSync(Scripted(rank=1, on_broadcast=deliver))
    sync.verdicts([Verdict((0,), 3)], trees, gen, sampling=True)
    assert torch.equal(gen.get_state(), src_state)
    # greedy: no generator traffic
    before = gen.get_state()
    sync.verdicts([Verdict((0,), 3)], trees, gen, sampling=False)
    assert torch.equal(gen.get_state(), before)


def test_begin_copies_the_generator_and_checks_inputs():
    src_state = torch.Generator().manual_seed(5).get_state()
    comm = Scripted(rank=1, on_broadcast=lambda t: src_state.view(torch.int64))
    gen = torch.Generator().manual_seed(6)
    RankSync(comm).begin([torch.tensor([1, 2, 3])], gen, [10, "greedy"])
    assert torch.equal(gen.get_state(), src_state)
    assert comm.calls == ["all_gather", "broadcast"]
    other = Scripted(rank=0, world=3, peer=lambda r, t: t + (r == 2))
    with pytest.raises(ValueError, match=r"input_ids: .*ranks \[2\] differ from rank 0"):
        RankSync(other).begin([torch.tensor([1, 2, 3])], gen, None)


def test_check_trees_raises_on_every_mismatch():
    trees = [_tree([5, 6], [-1, 0]), _tree([7, 8], [-1, 0])]
    RankSync(Scripted(rank=0)).check_trees(trees)  # identical: fine

    def differ_in_seq1(r, t):
        out = t.clone()
        out[2] += 1
        return out

    for rank in (0, 1):  # the source rank and the other one raise alike
        sync = RankSync(Scripted(rank=rank, peer=differ_in_seq1))
        with pytest.raises(RuntimeError, match=r"drafter: ranks \[\d\] proposed different trees .* step 1 "
                                               r"\(sequences \[1\]\)"):
            sync.check_trees(trees)


def test_check_tokens_raises_on_every_mismatch_and_counts_chunks():
    same = RankSync(Scripted())
    same.check_tokens([[1, 2, 3, 4]])
    same.check_tokens([[5, 6, 7, 8]])
    assert same.token_checks == 2 and same.comm.calls == ["all_gather", "all_gather"]
    other = RankSync(Scripted(rank=1, peer=lambda r, t: t + 1))
    with pytest.raises(RuntimeError, match=r"decode_chunk: ranks \[1\] decoded different tokens than rank 0 in chunk 1"):
        other.check_tokens([[1, 2, 3, 4]])


def test_rank_sync_arguments():
    with pytest.raises(ValueError, match="src"):
        RankSync(Scripted(), src=2)
    with pytest.raises(ValueError, match="group"):
        TorchCollectives()  # no process group in this process


def test_single_process_model_has_no_group():
    model = prepared_tiny_model("qwen2")
    assert tensor_parallel_group(model) is None
    assert RankSync.for_model(model) is None
    assert SpecDecoder(model, None, 0).rank_sync is None
    with pytest.raises(ValueError, match="rank_sync"):
        SpecDecoder(model, None, 0, rank_sync=object())


def test_engine_calls_rank_sync_once_per_step_and_adopts_its_verdicts():
    """As rank 1 of a scripted pair whose rank 0 always agrees, the output is the single-process one,
    with one all-gather (trees) and one broadcast (verdicts) per step, plus two at the start."""
    from drafters.lookup import LookupDrafter

    model = prepared_tiny_model("qwen2")
    prompt = torch.cat([random_prompt(12, 3)] * 2)
    want = SpecDecoder(model, LookupDrafter(), 6).generate(prompt, 16)
    comm = Scripted(rank=1)
    got = SpecDecoder(model, LookupDrafter(), 6, rank_sync=RankSync(comm)).generate(prompt, 16)
    assert got.sequences.tolist() == want.sequences.tolist()
    assert comm.calls == ["all_gather", "broadcast"] + ["all_gather", "broadcast"] * len(got.steps)

    # rank 0 decides: if it accepts nothing and emits token 3 every step, so does this rank
    def only_bonus(t):
        if t.numel() > 100:  # the generator state sent at the start: unchanged
            return t
        return encode_verdicts([Verdict((0,), 3)], (t.numel() - 2)).flatten()

    forced = SpecDecoder(model, LookupDrafter(), 6, rank_sync=RankSync(Scripted(rank=1, on_broadcast=only_bonus)))
    out = forced.generate(prompt, 5)
    assert out.new_tokens().tolist() == [3] * 5


def test_torch_collectives_in_a_one_rank_group(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable, or a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        comm = TorchCollectives()
        assert (comm.rank, comm.world_size, comm.device.type) == (0, 1, "cpu")
        t = torch.arange(4)
        assert torch.equal(comm.all_gather(t), t[None])
        comm.broadcast(t, 0)
        assert torch.equal(t, torch.arange(4))
        sync = RankSync()
        assert sync.verdicts([Verdict((0, 1), 2)], [_tree([1, 2], [-1, 0])]) == [Verdict((0, 1), 2)]
        assert tensor_parallel_group(prepared_tiny_model("qwen2")) is None  # a group, but no sharded model
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- 2 ranks


def _gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def _torchrun(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run`` on 2 local ranks running tests/specdec/tp_worker.py with ``args``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "tests.specdec.tp_worker", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


#: What no line of a clean 2-rank run may say (a traceback, an error, torch's warning of a group
#: left undestroyed, a rank killed by a signal).
_TROUBLE = re.compile(r"traceback|error|exception|not been destroyed|destroy_process_group|signal", re.I)


@pytest.mark.slow  # ~10 s on an idle 2-core machine: two interpreters importing torch and transformers
def test_a_distributed_run_ends_cleanly(tmp_path):
    """2 gloo ranks decode on a sharded target, then end as a device run does (release, barrier,
    destroy the group): both exit 0 with the group gone, the same tokens, and no error line."""
    if not _gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    from tests.drafters.helpers import save_tiny_pair

    models, out = tmp_path / "models", tmp_path / "out"
    out.mkdir()
    save_tiny_pair(models)
    proc = _torchrun([str(models), str(out), "teardown"], timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert not [line for line in log.splitlines() if _TROUBLE.search(line)], log[-6000:]
    ranks = [json.loads((out / f"teardown{r}.json").read_text()) for r in (0, 1)]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["rank_sync"] and not r["initialized"] for r in ranks)
    assert ranks[0]["tokens"] == ranks[1]["tokens"] and len(ranks[0]["tokens"]) == tp_worker.NEW_TOKENS


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """Save the tiny models, run tests/specdec/tp_worker.py on 2 gloo ranks, decode the references."""
    if not _gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    import transformers as tf

    from tests.drafters.helpers import save_tiny_pair

    root = tmp_path_factory.mktemp("tp")
    models, out = root / "models", root / "out"
    out.mkdir()
    save_tiny_pair(models)
    torch.manual_seed(5)
    cfg = tf.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    llama = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for p in llama.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    llama.save_pretrained(models / "llama_tied")
    proc = _torchrun([str(models), str(out)], timeout=240)
    log = (proc.stdout + proc.stderr)[-6000:]
    if proc.returncode != 0 or not all((out / f"rank{r}.json").exists() for r in (0, 1)):
        pytest.fail(f"the 2-rank worker failed (exit {proc.returncode}):\n{log}")
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, tp_worker.reference(models)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in tp_worker.CASES if "sample" not in c and "chunk" not in c])
def test_tp_greedy_equals_single_process(tp_run, case):
    ranks, ref = tp_run
    for res in ranks:
        got = res["cases"][case]
        assert "error" not in got, got.get("error")
        assert got["tokens"] == ref[case]["tokens"], f"rank {res['rank']}"
        if got["kv_heads"]:  # a kept cache: each rank holds half of the 2 KV heads of every layer
            assert got["kv_heads"] == [1] * len(got["kv_heads"])


@pytest.mark.slow
def test_tp_plain_decoding_runs_in_chunks_checked_once_each(tp_run):
    ranks, ref = tp_run
    for res in ranks:
        got = res["cases"]["plain-chunk"]
        assert "error" not in got, got.get("error")
        assert got["tokens"] == ref["plain-chunk"]["tokens"] == ref["plain"]["tokens"]
        assert got["token_checks"] >= 3  # 16 tokens in chunks of 4 (the first token comes from the prefill)
    sampled = [res["cases"]["plain-chunk-sample"] for res in ranks]
    assert "error" not in sampled[0] and sampled[0]["tokens"] == sampled[1]["tokens"]
    assert sampled[0]["token_checks"] >= 3


@pytest.mark.slow
@pytest.mark.parametrize("case", ["model-sample", "plain-chunk-sample"])
def test_tp_sampling_is_identical_on_both_ranks(tp_run, case):
    ranks, _ = tp_run
    got = [res["cases"][case] for res in ranks]
    for g in got:
        assert "error" not in g, g.get("error")
    assert got[0]["tokens"] == got[1]["tokens"]  # generators seeded 1234 and 1241: rank 0's stream wins
    assert all(len(t) == tp_worker.NEW_TOKENS for t in got[0]["tokens"])


@pytest.mark.slow
def test_tp_ranks_fail_together(tp_run):
    ranks, _ = tp_run
    for res in ranks:
        assert res["world"] == 2 and res["tp_group"]
        assert res["fused_groups"] == 4  # 2 layers x (q/k/v, gate/up) of each rank's shards
        assert res["mismatch"].startswith("drafter: ranks [1] proposed different trees than rank 0 at step 1")
        assert res["prompts"].startswith("input_ids: expected the same prompts")
