"""The push all-reduce on one process: the ranks' kernels run one after another, each finding in its
slot what the later ranks would have pushed before it (written there first), and pushing into the
slots of ranks already done through scratch views, so that every real slot must come back clean."""

from __future__ import annotations

import pytest
import torch

from treeattn.allreduce import SENTINELS, new_slot, push_all_reduce, push_all_reduce_reference, slot_dtype


def _canonical_bits(x: torch.Tensor) -> torch.Tensor:
    """x's bits as the kernel pushes them: -0.0 as +0.0."""
    sd = slot_dtype(x.dtype)
    bits = x.view(sd)
    return torch.where(bits == SENTINELS[sd], torch.zeros_like(bits), bits)


def _run_ranks(xs: list[torch.Tensor], slots: list[torch.Tensor], max_programs: int) -> list[torch.Tensor]:
    world, n = len(xs), xs[0].numel()
    seg = slots[0].numel() // world
    outs = []
    for r in range(world):
        for q in range(r + 1, world):  # what rank q pushes into rank r's slot before rank r runs
            slots[r][q * seg : q * seg + n] = _canonical_bits(xs[q]).reshape(-1)
        scratch = [new_slot(world, seg, xs[0].dtype) for _ in range(r)]  # ranks done: their slots stay clean
        view = scratch + slots[r:]
        outs.append(push_all_reduce(xs[r], view, r, max_programs=max_programs))
        for s in scratch:  # rank r pushed its own data into segment r of each
            assert torch.equal(s[r * seg : r * seg + n], _canonical_bits(xs[r]).reshape(-1))
    return outs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("world,shape,seg,max_programs", [(2, (3, 1000), 4096, 2), (3, (5,), 8, 4), (2, (1, 2500), 2500, 1)])
def test_every_rank_gets_the_rank_ordered_sum_and_the_slots_come_back_clean(dtype, world, shape, seg, max_programs):
    torch.manual_seed(world * 100 + seg)
    slots = [new_slot(world, seg, dtype) for _ in range(world)]
    for _ in range(2):  # the second call reuses the slots the first one cleaned
        xs = [torch.randn(shape).to(dtype) for _ in range(world)]
        xs[0].view(-1)[0] = -0.0  # never mistaken for the sentinel
        xs[-1].view(-1)[-1] = -0.0
        outs = _run_ranks(xs, slots, max_programs)
        want = push_all_reduce_reference(xs)
        for out in outs:
            assert out.shape == xs[0].shape and out.dtype == dtype
            assert torch.equal(out, want)  # exact: float32 adds in rank order, rounded to nearest even
        for s in slots:
            assert bool((s == SENTINELS[s.dtype]).all())


def test_the_reference_rounds_like_the_kernel_on_ties():
    """bf16 sums that fall halfway between two bf16 values round to the even one (the kernel's integer
    rounding; Triton's interpreter truncates a float cast)."""
    a = torch.tensor([-0.80078125, 1.0, 1.0], dtype=torch.bfloat16)
    b = torch.tensor([-0.3203125, 2.0 ** -8, 3 * 2.0 ** -8], dtype=torch.bfloat16)
    slots = [new_slot(2, 4, torch.bfloat16) for _ in range(2)]
    outs = _run_ranks([a, b], slots, 1)
    assert outs[0].tolist() == [-1.125, 1.0, 1.015625] == push_all_reduce_reference([a, b]).tolist()


def test_bad_arguments_name_themselves():
    slots = [new_slot(2, 4, torch.bfloat16) for _ in range(2)]
    x = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"dtype: expected torch.bfloat16 or torch.float32, got torch.float16"):
        push_all_reduce(x.half(), slots, 0)
    with pytest.raises(ValueError, match=r"x: expected at most 4 elements \(a slot's segment\), got 5"):
        push_all_reduce(torch.zeros(5, dtype=torch.bfloat16), slots, 0)
    with pytest.raises(ValueError, match=r"rank: expected 0 <= rank < 2, got 2"):
        push_all_reduce(x, slots, 2)
    with pytest.raises(ValueError, match=r"slots: expected 1-d torch.int16 tensors of one size"):
        push_all_reduce(x, [slots[0], new_slot(2, 4, torch.float32)], 0)
    with pytest.raises(ValueError, match=r"slots: expected 1 to 8 slots, got 9"):
        push_all_reduce(x, [new_slot(9, 4, torch.bfloat16)] * 9, 0)
    with pytest.raises(ValueError, match=r"out: expected 8 elements of torch.int16, got 6 of torch.int16"):
        new_slot(2, 4, torch.bfloat16, out=torch.empty(6, dtype=torch.int16))
