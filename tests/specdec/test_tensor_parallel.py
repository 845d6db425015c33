"""specdec.tensor_parallel: the split of a model's layers over a process group.

In one process (a one-rank gloo group) a split model must compute what it did before (every shard is
the whole weight); the errors name what is wrong. The 2-rank runs in test_distributed.py check the
real split (half the heads per rank) against unsharded decoding.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec.distributed import tensor_parallel_group
from specdec.fused import fuse_projections, fused_groups
from specdec.tensor_parallel import RowParallelLinear, VocabParallelHead, shard_model
from tests.specdec.helpers import random_prompt, tiny_model


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable, or a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_a_one_rank_split_computes_the_same_logits(one_rank_group, family):
    model = tiny_model(family)
    ids = random_prompt(11, 4)[None]
    with torch.no_grad():
        want = model(ids).logits
    vocab = model.get_output_embeddings().weight.shape
    count = shard_model(model)
    assert count == 7 * model.config.num_hidden_layers  # q k v o gate up down in every layer
    assert tensor_parallel_group(model) is one_rank_group
    assert isinstance(model.get_output_embeddings(), VocabParallelHead)
    assert model.get_output_embeddings().weight.shape == vocab  # drafters still see the whole head
    assert sum(isinstance(m, RowParallelLinear) for m in model.modules()) == 2 * model.config.num_hidden_layers
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers  # the local shards still fuse
    assert len(fused_groups(model)) == 2 * model.config.num_hidden_layers


def test_a_sharded_model_and_decoder_hold_no_process_group(tmp_path):
    """The shards and the rank lockstep keep the group's name, not the group: after
    ``destroy_process_group`` nothing keeps it alive to be torn down at interpreter exit (where a
    2-rank gloo run aborted now and then with "terminate called without an active exception"), and
    asking the model for its group then says it is gone."""
    import gc
    import weakref

    import torch.distributed as dist

    from specdec.distributed import TorchCollectives

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable, or a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = tiny_model("qwen2")
        shard_model(model)
        comm = TorchCollectives()
        assert comm.all_gather(torch.tensor([3])).tolist() == [[3]]
        held = [v for m in model.modules() for v in vars(m).values() if isinstance(v, dist.ProcessGroup)]
        assert held == [] and not any(isinstance(v, dist.ProcessGroup) for v in vars(comm).values())
        gone = weakref.ref(dist.group.WORLD)
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert gone() is None  # nothing here keeps the destroyed group alive
    with pytest.raises(ValueError, match="process group it is split over .* destroyed"):
        tensor_parallel_group(model)


def test_end_tensor_parallel_releases_then_destroys_the_group(tmp_path):
    import torch.distributed as dist

    from specdec.distributed import end_tensor_parallel

    class Decoder:
        released = 0

        def release(self):
            self.released += 1

    dec = Decoder()
    end_tensor_parallel(dec)  # no process group: the decoders are released, nothing else
    assert dec.released == 1
    if not dist.is_available() or dist.is_initialized():
        pytest.skip("torch.distributed unavailable, or a process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    model = tiny_model("qwen2")
    shard_model(model)
    end_tensor_parallel(dec)
    assert dec.released == 2 and not dist.is_initialized()
    with pytest.raises(ValueError, match="destroyed"):
        tensor_parallel_group(model)


def test_split_errors(one_rank_group, monkeypatch):
    model = tiny_model("qwen2")
    shard_model(model)
    with pytest.raises(ValueError, match="already split"):
        shard_model(model)
    fused = tiny_model("qwen2")
    fuse_projections(fused)
    with pytest.raises(ValueError, match="q_proj to be a plain nn.Linear"):
        shard_model(fused)
    plain = nn.Sequential(nn.Linear(4, 4))
    plain.config = tiny_model("qwen2").config
    with pytest.raises(ValueError, match="expected decoder layers"):
        shard_model(plain)


def test_divisibility_is_checked_against_the_world_size(one_rank_group, monkeypatch):
    import torch.distributed as dist

    model = tiny_model("qwen2")
    heads = model.config.num_key_value_heads
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: heads + 1)
    with pytest.raises(ValueError, match=rf"num_attention_heads divisible by the tensor-parallel world size {heads + 1}|"
                                         rf"num_key_value_heads divisible"):  # fmt: skip
        shard_model(model)


def test_split_needs_a_process_group():
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(ValueError, match="group: expected an initialized torch.distributed process group"):
        shard_model(tiny_model("qwen2"))


def _split_without_slots():
    """A tiny model split over the one-rank group with NCCL-style all-reduces only: (model, a 5-token
    prompt ``[1, 5]``, its logits before the split, the row-parallel projections, the hidden size)."""
    model = tiny_model("qwen2")
    ids = random_prompt(5, 3)[None]
    with torch.no_grad():
        want = model(ids).logits
    shard_model(model, one_shot=False)
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    assert all(m.slot is None and m.push is None for m in rows)
    return model, ids, want, rows, model.config.hidden_size


def test_small_partial_products_take_the_one_shot_slot(one_rank_group, monkeypatch):
    """With slots (symmetric memory on a GPU; plain tensors here), a partial product that fits its
    projection's slot goes through the one-shot op, with the slot as its scratch; a larger one
    through the functional all-reduce. In a one-rank group both are the identity."""
    import specdec.tensor_parallel as tp

    model, ids, want, rows, hidden = _split_without_slots()
    for m in rows:
        m.slot = torch.zeros(5 * hidden * 4, dtype=torch.uint8)  # 5 fp32 rows
    seen = []

    def fake(staging, x, group_name):
        assert staging.shape == x.shape and staging.dtype == x.dtype
        assert group_name == one_rank_group.group_name
        seen.append((staging.untyped_storage().data_ptr(), x.shape[-2]))
        return x.clone()

    monkeypatch.setattr(tp, "_one_shot", fake)
    with torch.no_grad():
        got = model(ids).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert len(seen) == len(rows)
        assert len({ptr for ptr, _ in seen}) == len(rows)  # each projection its own slot
        model(random_prompt(6, 4)[None])  # 6 rows > 5: the functional all-reduce
    assert len(seen) == len(rows)


def test_one_shot_slots_need_cuda(one_rank_group):
    from specdec.tensor_parallel import one_shot_slots

    assert one_shot_slots(one_rank_group, torch.device("cpu"), 4) is None
    with pytest.raises(ValueError, match="one_shot: expected symmetric memory for one-shot all-reduces, got a model on cpu"):
        one_shot_slots(one_rank_group, torch.device("cpu"), 4, required=True)
    with pytest.raises(ValueError, match="one_shot: expected True, False, 'auto' or 'push'"):
        shard_model(tiny_model("qwen2"), one_shot="yes")
    with pytest.raises(ValueError, match="device: push all-reduces need CUDA, got cpu"):
        shard_model(tiny_model("qwen2"), one_shot="push")


def test_small_partial_products_take_the_push_all_reduce(one_rank_group, monkeypatch):
    """With push slots (symmetric memory on GPUs; plain tensors of a one-rank world here), a partial
    product that fits goes through the push all-reduce kernel (Triton's interpreter on a CPU), which
    leaves its slot clean; a larger one through the functional all-reduce. One rank: the identity."""
    import specdec.tensor_parallel as tp
    from treeattn.allreduce import SENTINELS, new_slot

    model, ids, want, rows, hidden = _split_without_slots()
    for m in rows:
        m.push = [new_slot(1, 5 * hidden, torch.float32)]  # 5 fp32 rows
    calls = []
    real = tp.push_all_reduce
    monkeypatch.setattr(tp, "push_all_reduce", lambda x, slots, rank: calls.append(x.shape[-2]) or real(x, slots, rank))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        assert calls == [5] * len(rows)
        model(random_prompt(6, 4)[None])  # 6 rows > 5: the functional all-reduce
    assert len(calls) == len(rows)
    assert all(bool((m.push[0] == SENTINELS[torch.int32]).all()) for m in rows)
