"""One rank of the tensor-parallel tests (tests/specdec/test_distributed.py), and the cases they share.

Run as ``python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.specdec.tp_worker
MODELS OUT``: loads ``MODELS/target`` (and ``MODELS/llama_tied``) split over the 2 ranks
(``specdec.distributed.load_tensor_parallel``, gloo), ``MODELS/draft`` replicated, decodes every case of ``CASES`` and writes
``OUT/rank{r}.json``: per case the new tokens per sequence, the KV heads this rank's cache holds, or
the error it raised. ``reference(models)`` decodes the same cases in this process without TP.
``... MODELS OUT teardown`` instead runs :func:`teardown`: one decode, then the run's clean end.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

NEW_TOKENS = 16
PROMPTS = [
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 11, 12, 5, 6, 7],
    [40, 41, 42, 43, 40, 41, 42, 44, 45, 40, 41],
]


def _medusa(target):
    from drafters.medusa import MedusaDrafter, MedusaHeads

    torch.manual_seed(0)
    heads = MedusaHeads(int(target.get_output_embeddings().weight.shape[1]), 3)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, 0.3)
    return MedusaDrafter(target, heads)


def _eagle(target):
    from drafters.eagle import EagleDrafter, EagleHead

    torch.manual_seed(0)
    head = EagleHead(target)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.3)
    return EagleDrafter(target, head, depth=3, topk=3)


class _RankDependent:
    """A broken drafter: its tree depends on the process's rank (the check must catch it)."""

    vocab_size = None

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def reset(self, input_ids) -> None:
        return None

    def propose(self, ctx):
        from specdec.tree import TokenTree

        tokens = torch.tensor([int(ctx.tokens[-1]), 3 + self.rank], dtype=torch.int64)
        return TokenTree(tokens, torch.tensor([-1, 0]))

    def update(self, ctx, tree, verdict) -> None:
        return None


def _lookup():
    from drafters.lookup import LookupDrafter

    return LookupDrafter(max_ngram=3, max_depth=6)


def _draft_model(draft, **kw):
    from drafters.draft_model import DraftModelDrafter

    return DraftModelDrafter(draft, depth=3, topk=3, **kw)


#: name -> (model key, drafter factory (target, draft) -> drafter or None, SpecDecoder kwargs, generate kwargs)
CASES = {
    "plain": ("target", lambda t, d: None, {}, {}),
    "lookup": ("target", lambda t, d: _lookup(), {"tree_size": 8}, {}),
    "lookup-static": ("target", lambda t, d: _lookup(), {"tree_size": 8, "static_shapes": True,
                                                         "max_cache_len": 96, "prefill_width": 8}, {}),
    "model": ("target", lambda t, d: _draft_model(d), {"tree_size": 8}, {}),
    "model-static": ("target", lambda t, d: _draft_model(d), {"tree_size": 8, "static_shapes": True,
                                                             "max_cache_len": 96, "prefill_width": 8}, {}),
    "medusa": ("target", lambda t, d: _medusa(t), {"tree_size": 8}, {}),
    "eagle": ("target", lambda t, d: _eagle(t), {"tree_size": 8}, {}),
    "llama-tied-lookup": ("llama_tied", lambda t, d: _lookup(), {"tree_size": 8}, {}),
    # plain decoding in device chunks of 4 steps: one token fingerprint per chunk instead of a broadcast per token
    "plain-chunk": ("target", lambda t, d: None, {"static_shapes": True, "max_cache_len": 96, "prefill_width": 8,
                                                  "decode_chunk": 4}, {}),
    "plain-chunk-sample": ("target", lambda t, d: None, {"static_shapes": True, "max_cache_len": 96, "prefill_width": 8,
                                                         "decode_chunk": 4}, {"do_sample": True, "temperature": 1.5}),
    # the generator is seeded per rank on purpose: RankSync.begin copies rank 0's
    "model-sample": ("target", lambda t, d: _draft_model(d), {"tree_size": 8}, {"do_sample": True, "temperature": 1.5}),
}


def decode(name: str, models: dict, rank: int = 0) -> dict:
    """One case: per sequence its new tokens, and the KV heads per layer of this rank's cache."""
    from specdec.engine import SpecDecoder

    key, factory, dec_kw, gen_kw = CASES[name]
    target = models[key]
    drafter = factory(target, models["draft"])
    dec = SpecDecoder(target, drafter, **dec_kw)
    gen = torch.Generator().manual_seed(1234 + 7 * rank) if gen_kw.get("do_sample") else None
    seen: list[int] = []
    prompts = [torch.tensor(p) for p in PROMPTS]
    out = dec.generate(prompts, NEW_TOKENS, generator=gen, **gen_kw)
    cache = next(iter(dec.caches.values()), None)
    if cache is not None:
        seen = [int(cache.buffers(i)[0].shape[1]) for i in cache.layer_indices]
    return {"tokens": [out.new_tokens(b).tolist() for b in range(len(PROMPTS))], "kv_heads": seen,
            "steps": len(out.steps), "token_checks": getattr(dec.rank_sync, "token_checks", 0)}


def load(models_dir: Path, tp: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from specdec.distributed import load_tensor_parallel

    out = {}
    for key in ("target", "llama_tied"):
        path = models_dir / key
        out[key] = load_tensor_parallel(path) if tp else AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32).eval()  # fmt: skip
    out["draft"] = AutoModelForCausalLM.from_pretrained(models_dir / "draft", dtype=torch.float32).eval()
    return out


def reference(models_dir: Path) -> dict:
    """Every case decoded in this process with unsharded models."""
    models = load(models_dir, tp=False)
    return {name: decode(name, models) for name in CASES}


def main(models_dir: str, out_dir: str) -> None:
    import torch.distributed as dist

    from specdec.distributed import end_tensor_parallel, tensor_parallel_group
    from specdec.engine import SpecDecoder

    models = load(Path(models_dir), tp=True)
    rank = dist.get_rank()
    res: dict = {"rank": rank, "world": dist.get_world_size(),
                 "tp_group": tensor_parallel_group(models["target"]) is not None, "cases": {}}  # fmt: skip
    for name in CASES:
        try:
            res["cases"][name] = decode(name, models, rank)
        except Exception:  # noqa: BLE001 - reported to the test
            res["cases"][name] = {"error": traceback.format_exc()}
    from specdec.fused import fused_groups

    res["fused_groups"] = len(fused_groups(models["target"]))  # the local q/k/v and gate/up shards, fused
    # a drafter whose trees differ between ranks: every rank must raise (no hang, no garbage)
    try:
        SpecDecoder(models["target"], _RankDependent(rank), tree_size=2).generate(torch.tensor(PROMPTS[0]), 4)
        res["mismatch"] = "no error"
    except RuntimeError as e:
        res["mismatch"] = str(e)
    # different prompts on the ranks: every rank must raise a ValueError naming input_ids
    try:
        SpecDecoder(models["target"], None, 0).generate(torch.tensor(PROMPTS[0][: 5 + rank]), 2)
        res["prompts"] = "no error"
    except ValueError as e:
        res["prompts"] = str(e)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    del models
    end_tensor_parallel()


def teardown(models_dir: str, out_dir: str) -> None:
    """A distributed run's end as scripts/device/multigpu.py ends one: decode on the sharded target,
    then ``specdec.distributed.end_tensor_parallel`` (release, collect, barrier, destroy); then write
    ``OUT/teardown{r}.json`` (the new tokens, and whether a process group is still initialized)."""
    import torch.distributed as dist

    from specdec.distributed import end_tensor_parallel, load_tensor_parallel
    from specdec.engine import SpecDecoder

    target = load_tensor_parallel(Path(models_dir) / "target")
    rank = dist.get_rank()
    dec = SpecDecoder(target, _lookup(), tree_size=8, attn_impl="torch")  # (not Triton's CPU interpreter: seconds)
    tokens = dec.generate(torch.tensor(PROMPTS[0]), NEW_TOKENS).new_tokens().tolist()
    synced = dec.rank_sync is not None
    del target
    end_tensor_parallel(dec)
    res = {"rank": rank, "tokens": tokens, "rank_sync": synced, "initialized": dist.is_initialized()}
    Path(out_dir, f"teardown{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    (teardown if sys.argv[3:] == ["teardown"] else main)(sys.argv[1], sys.argv[2])
