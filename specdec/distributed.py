"""Decoding with a tensor-parallel target: one ``SpecDecoder`` per rank, every rank in lockstep.

Tensor parallelism (TP) is ``specdec.tensor_parallel``'s split (Megatron's): under ``torchrun
--nproc-per-node N`` each process loads the target and keeps 1/N of every decoder layer as plain local
tensors -- q/k/v and gate/up projections split by output rows, o/down projections by input columns
with one all-reduce each, the LM head by vocabulary rows with its logits all-gathered::

    model = load_tensor_parallel(path, dtype=torch.bfloat16)  # from_pretrained, then shard_model
    decoder = SpecDecoder(model, drafter, tree_size=64)        # finds the model's TP group itself
    out = decoder.generate(prompt, 128)                        # same call, same prompt on every rank

``load_tensor_parallel`` starts the process group from torchrun's ``RANK`` / ``LOCAL_RANK`` /
``WORLD_SIZE`` when none exists: NCCL on GPUs (each process binds ``cuda:LOCAL_RANK``), gloo on CPU
-- the CPU path is what the tests run. The local shards are ordinary ``nn.Linear`` modules, so the
engine fuses each rank's q/k/v and gate/up shards into one GEMM and compiles the layers as on one GPU;
activations between layers stay plain (replicated) tensors.

What the engine sees on each rank:

- every attention layer gets only this rank's heads: query ``[B, Hq / N, m, D]``, key / value
  ``[B, Hkv / N, m, D]`` (``num_key_value_heads`` must divide by N). specdec's attention function
  takes head counts from the tensors, never from the config, and ``KVCache`` allocates each
  layer's buffers at its first write from the key's shape, so every rank keeps ``[B, Hkv / N, S, D]``
  per layer: the KV memory is split N ways along with the weights.
- the logits are whole (``[B, n, V]``, gathered by the LM head) and identical on every rank; so are
  the final hidden states that drafters reading the target's features (Medusa, EAGLE) get: the
  row-parallel projections all-reduce, so the LM head's input is replicated (and so is every decoder
  layer's output, which drafters naming ``feature_layers`` get). The embedding is replicated; drafters
  that call the target's LM head (Medusa, EAGLE) run its all-gather, a collective: every rank must
  draft the same trees in the same order, which the lockstep below gives.
- a draft model (``DraftModelDrafter``) is an ordinary replicated model on each rank.

Rank consistency (``RankSync``): the verification decision is made on one rank (``src``, the TP
group's rank 0) and broadcast each step: its accepted paths and bonus tokens, and under sampling
its random generator's state after verifying. Every rank then appends the same tokens, commits the
same KV slots and continues from the same random stream, whatever its own logits or uniforms were
(rounding of collectives may differ between ranks in principle; a near-tie or a uniform near the
acceptance threshold would then split the ranks' sequences for good). That is robust by
construction; "identical logits + identical random streams" is only likely. The trees are not
broadcast (a drafter's state belongs to the tree it proposed): given the same committed tokens,
features and random stream a drafter proposes the same tree, and ``RankSync.check_trees`` verifies
that before every target forward (whose collectives would otherwise run on mismatched inputs or
shapes): one all-gather of one fingerprint per sequence, raising the same ``RuntimeError`` on every
rank instead of hanging. At the start of ``generate`` the ranks check that they got the same
prompts and arguments, and the random generator (``generator``, or the default CPU / current CUDA
generators when None) is copied from ``src``. Per step that is one all-gather of B + 1 int64 and
one broadcast of ``B * (n + 2)`` int64 (+ the generator state, 5 KiB on CPU, when sampling).

The engine calls ``RankSync`` at three points (``SpecDecoder(rank_sync=...)``; None = found from
the target: a ``RankSync`` over its TP group when it has one, else single-process, no calls):
``begin`` once per ``generate``, ``check_trees`` after drafting, ``verdicts`` after verifying.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from specdec.tree import TokenTree
from specdec.verify import Verdict

__all__ = [
    "Collectives",
    "RankSync",
    "TorchCollectives",
    "decode_verdicts",
    "encode_verdicts",
    "end_tensor_parallel",
    "fingerprint",
    "load_tensor_parallel",
    "tensor_parallel_group",
    "tree_fingerprint",
]

_MASK63 = (1 << 63) - 1


# ---------------------------------------------------------------------------------------- pure parts


def fingerprint(*parts: Any) -> int:
    """A 63-bit hash (an int64 >= 0) of ``parts``: tensors (dtype, shape and bytes), ints, floats,
    strings, None, and sequences of these. Equal inputs give equal fingerprints in every process."""
    h = hashlib.blake2b(digest_size=8)

    def feed(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif x is None or isinstance(x, (bool, int, str)):
            h.update(f"{type(x).__name__}:{x!r};".encode())
        elif isinstance(x, float):
            h.update(b"f" + struct.pack("<d", x))
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}[".encode())
            for item in x:
                feed(item)
            h.update(b"]")
        else:
            raise ValueError(f"parts: expected tensors, numbers, strings, None or sequences of them, got "
                             f"{type(x).__name__}")  # fmt: skip

    for part in parts:
        feed(part)
    return int.from_bytes(h.digest(), "little") & _MASK63


def tree_fingerprint(tree: TokenTree) -> int:
    """The fingerprint of a tree's tokens, parents and proposal kind (not its ``draft_probs``: only
    ``src``'s verification reads them)."""
    return fingerprint(tree.tokens, tree.parents, tree.proposal)


def encode_verdicts(verdicts: Sequence[Verdict | None], width: int) -> torch.Tensor:
    """int64 ``[B, width + 2]``: per sequence ``[len(path), bonus_token, *path, -1 ...]``; a None
    verdict (finished sequence) is ``[0, -1, -1 ...]``. ``width`` >= the longest path (the largest
    tree's node count)."""
    out = torch.full((len(verdicts), width + 2), -1, dtype=torch.int64)
    for b, v in enumerate(verdicts):
        if v is None:
            out[b, 0] = 0
            continue
        if len(v.path) > width:
            raise ValueError(f"verdicts[{b}]: expected a path of at most {width} nodes, got {len(v.path)}")
        out[b, 0] = len(v.path)
        out[b, 1] = v.bonus_token
        out[b, 2 : 2 + len(v.path)] = torch.tensor(v.path, dtype=torch.int64)
    return out


def decode_verdicts(payload: torch.Tensor) -> list[Verdict | None]:
    """The inverse of ``encode_verdicts``."""
    if payload.dim() != 2 or payload.shape[1] < 2:
        raise ValueError(f"payload: expected an int64 tensor [B, width + 2], got shape {tuple(payload.shape)}")
    out: list[Verdict | None] = []
    for row in payload.tolist():
        k = row[0]
        out.append(None if k == 0 else Verdict(tuple(row[2 : 2 + k]), row[1]))
    return out


# ---------------------------------------------------------------------------------------- collectives


class Collectives(Protocol):
    """The two collectives ``RankSync`` needs, over one group of ``world_size`` ranks.

    ``all_gather(t)``: ``[world_size, *t.shape]``, row r = rank r's ``t`` (same shape and dtype on
    every rank). ``broadcast(t, src)``: overwrite ``t`` in place with group rank ``src``'s.
    """

    rank: int
    world_size: int

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


class TorchCollectives:
    """``Collectives`` over a ``torch.distributed`` process group (default: the world).

    Tensors travel on ``device``: default the CPU for groups whose backend handles CPU tensors
    (gloo, or a ``"cpu:gloo,cuda:nccl"`` pair), else the current CUDA device (NCCL). It keeps the
    group's registered name, not the group, so a destroyed group is not kept alive by a decoder.
    """

    def __init__(self, group=None, device: torch.device | str | None = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: expected an initialized torch.distributed process group, got none "
                             "(run under torchrun, or call torch.distributed.init_process_group first)")  # fmt: skip
        group = group if group is not None else dist.group.WORLD
        self.group_name: str = group.group_name
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if device is None:
            backend = str(dist.get_backend(group)).lower()
            device = "cpu" if ("gloo" in backend or "cpu" in backend or "nccl" not in backend) else (
                torch.device("cuda", torch.cuda.current_device()))  # fmt: skip
        self.device = torch.device(device)

    @property
    def group(self):
        """The process group (looked up by name: RuntimeError once it is destroyed)."""
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(self.group_name)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = tensor.to(self.device).contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.stack(parts).to(tensor.device)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        t = tensor.to(self.device).contiguous()
        group = self.group
        dist.broadcast(t, src=dist.get_global_rank(group, src), group=group)
        if t is not tensor:
            tensor.copy_(t)


# ---------------------------------------------------------------------------------------- RankSync


class RankSync:
    """Keeps the ranks of a tensor-parallel target in lockstep (see the module docstring).

    Args:
        group: the TP process group (default: the world), or a ``Collectives`` object (tests).
        src: the group rank whose verification decides (default 0).
        device: where the collectives' tensors travel (``TorchCollectives``' default when None).

    Attributes:
        rank, world_size: this process's rank in the group, and the group's size.
        steps: steps (or plain-decoding chunks) synchronized in the current ``generate`` call.
        token_checks: plain-decoding chunks checked in the current call (:meth:`check_tokens`).
    """

    def __init__(self, group=None, *, src: int = 0, device: torch.device | str | None = None) -> None:
        if group is not None and all(hasattr(group, a) for a in ("all_gather", "broadcast", "rank", "world_size")):
            self.comm = group
        else:
            self.comm = TorchCollectives(group, device)
        self.rank, self.world_size = int(self.comm.rank), int(self.comm.world_size)
        if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < self.world_size:
            raise ValueError(f"src: expected a group rank in [0, {self.world_size}), got {src!r}")
        self.src = src
        self.steps = 0
        self.token_checks = 0

    @classmethod
    def for_model(cls, model, **kwargs) -> RankSync | None:
        """A ``RankSync`` over ``model``'s tensor-parallel group, or None when it has none (a
        single-process model: nothing to synchronize)."""
        group = tensor_parallel_group(model)
        return None if group is None else cls(group, **kwargs)

    # -- the three calls of SpecDecoder

    def begin(self, prompts: Sequence[torch.Tensor], generator: torch.Generator | None, settings: Any = None,
              device: torch.device | None = None) -> None:  # fmt: skip
        """Start of a ``generate`` call: check that every rank got the same ``prompts`` and
        ``settings`` (ValueError naming ``input_ids`` on every rank otherwise), then copy ``src``'s
        random generator state(s) to every rank (``generator``, or when None the default CPU
        generator and, with ``device`` on CUDA, that device's default generator)."""
        self.steps = self.token_checks = 0
        mine = torch.tensor([fingerprint(list(prompts), settings)], dtype=torch.int64)
        got = self.comm.all_gather(mine)[:, 0].tolist()
        bad = [r for r, f in enumerate(got) if f != got[self.src]]
        if bad:
            raise ValueError(f"input_ids: expected the same prompts and generate() arguments on every rank of the "
                             f"tensor-parallel group, ranks {bad} differ from rank {self.src}")  # fmt: skip
        gens = _generators(generator, device)
        state = _pack_states(gens)
        self.comm.broadcast(state, self.src)
        _unpack_states(gens, state)

    def check_trees(self, trees: Sequence[TokenTree]) -> None:
        """Before the target forward: check that every rank drafted the same trees (one fingerprint
        per tree). Raises the same ``RuntimeError`` on every rank when they differ (a drafter that is
        not deterministic given the committed tokens, features and random stream)."""
        self.steps += 1
        mine = torch.tensor([len(trees)] + [tree_fingerprint(t) for t in trees], dtype=torch.int64)
        got = self.comm.all_gather(mine)
        differ = got != got[self.src]  # [world, B + 1]
        if bool(differ.any()):
            ranks = [r for r in range(self.world_size) if bool(differ[r].any())]
            seqs = sorted({b for b in range(len(trees)) if bool(differ[:, b + 1].any())})
            raise RuntimeError(
                f"drafter: ranks {ranks} proposed different trees than rank {self.src} at step {self.steps} "
                f"(sequences {seqs}); every rank of a tensor-parallel target must draft the same trees "
                f"(a drafter deterministic given the committed tokens, the target's features and the generator)"
            )

    def check_tokens(self, rows: Sequence[Sequence[int]]) -> None:
        """After a chunk of plain decoding (``SpecDecoder(decode_chunk=k)``): check that every rank
        drew the same tokens -- one fingerprint all-gathered per chunk, instead of a verdict
        broadcast per token. The ranks' logits are identical (the LM head gathers them) and so are
        their random streams (``begin``), so their argmax / draws are too; raises the same
        ``RuntimeError`` on every rank if not."""
        self.steps += 1
        self.token_checks += 1
        mine = torch.tensor([fingerprint([list(map(int, r)) for r in rows])], dtype=torch.int64)
        got = self.comm.all_gather(mine)[:, 0].tolist()
        bad = [r for r, f in enumerate(got) if f != got[self.src]]
        if bad:
            raise RuntimeError(f"decode_chunk: ranks {bad} decoded different tokens than rank {self.src} in chunk "
                               f"{self.token_checks} of this call; the tensor-parallel ranks' logits differ")  # fmt: skip

    def verdicts(self, verdicts: Sequence[Verdict | None], trees: Sequence[TokenTree],
                 generator: torch.Generator | None = None, sampling: bool = False,
                 device: torch.device | None = None) -> list[Verdict | None]:  # fmt: skip
        """After verifying: ``src``'s verdicts, on every rank. With ``sampling``, ``src``'s random
        generator state(s) after its verification are copied to every rank too (so later draws by
        the drafter and the verifier stay identical). ``trees``: this step's trees (checked equal
        across ranks by ``check_trees``; they size the message)."""
        width = max(t.n for t in trees)
        payload = encode_verdicts(verdicts, width).flatten()
        gens = _generators(generator, device) if sampling else []
        if gens:
            payload = torch.cat([payload, _pack_states(gens)])
        self.comm.broadcast(payload, self.src)
        if gens:
            _unpack_states(gens, payload[len(verdicts) * (width + 2) :])
        return decode_verdicts(payload[: len(verdicts) * (width + 2)].view(len(verdicts), width + 2))


def _generators(generator: torch.Generator | None, device: torch.device | None) -> list[torch.Generator]:
    if generator is not None:
        return [generator]
    gens = [torch.default_generator]
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        index = torch.device(device).index
        gens.append(torch.cuda.default_generators[torch.cuda.current_device() if index is None else index])
    return gens


def _pack_states(gens: Sequence[torch.Generator]) -> torch.Tensor:
    """The generators' states as one int64 tensor (each state's bytes padded to a multiple of 8)."""
    parts = []
    for g in gens:
        s = g.get_state().to(torch.uint8)
        pad = (-s.numel()) % 8
        parts.append(torch.cat([s, s.new_zeros(pad)]).view(torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _unpack_states(gens: Sequence[torch.Generator], packed: torch.Tensor) -> None:
    raw = packed.contiguous().view(torch.uint8)
    at = 0
    for g in gens:
        n = g.get_state().numel()
        g.set_state(raw[at : at + n].clone())
        at += n + (-n) % 8


# ---------------------------------------------------------------------------------------- models


def tensor_parallel_group(model):
    """The process group ``model`` is split over (``specdec.tensor_parallel.shard_model``), or None.

    Raises ValueError when that group has been destroyed, and for a model whose parameters are
    DTensors (transformers' own TP plan, ``from_pretrained(tp_plan=...)``): its unfused, hooked
    projections are not what the engine runs; load it with :func:`load_tensor_parallel` instead.
    """
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from specdec.tensor_parallel import tensor_parallel_group as shard_group

    group = shard_group(model)  # (a ValueError when the model's group was destroyed)
    if group is not None or not dist.is_initialized():
        return group
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed tensors
        return None
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("model: expected a model split by specdec.distributed.load_tensor_parallel (or "
                         "specdec.tensor_parallel.shard_model), got DTensor parameters (transformers' tp_plan)")  # fmt: skip
    return None


def load_tensor_parallel(path: str | os.PathLike[str], dtype: torch.dtype | None = None, group=None,
                         one_shot: bool | str = "auto", **kwargs: Any):  # fmt: skip
    """Load ``AutoModelForCausalLM.from_pretrained(path, ...)`` on this rank and split it over ``group``
    (default: the world) with ``specdec.tensor_parallel.shard_model``; in eval mode.

    Call it on every rank, under ``torchrun``. It starts the process group from torchrun's environment
    when none exists (NCCL with each process bound to ``cuda:LOCAL_RANK`` on GPUs, gloo on a CPU). On
    a GPU the whole checkpoint is read straight onto the rank's device (``device_map``, through
    accelerate), then split: the other ranks' shards are freed. In a world of one process the model
    comes back whole, on ``cuda:LOCAL_RANK`` when CUDA is there. ``one_shot``: ``shard_model``'s
    (one-shot all-reduces over symmetric memory where they work). ``kwargs`` go to ``from_pretrained``.
    """
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from specdec.tensor_parallel import shard_model

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and dist.is_available() and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    placement = {"device_map": {"": device}} if cuda else {}
    model = AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=dtype or torch.float32, **placement, **kwargs)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        shard_model(model, group, one_shot=one_shot)
        if cuda:
            torch.cuda.empty_cache()  # the other ranks' shards, read whole above
    return model.eval()


def end_tensor_parallel(*decoders: Any) -> None:
    """End a distributed run on this rank (every rank calls it): each decoder's caches and forwards
    released (``SpecDecoder.release``: NCCL cannot destroy a communicator while a CUDA graph that
    captured it lives), garbage collected while the interpreter is whole, a barrier (on this rank's
    GPU with NCCL), the process group destroyed, collected again. Without the collections a gloo rank
    was seen to abort now and then at interpreter exit ("terminate called without an active
    exception"). Drop your own references to the models first. Nothing happens without a process group.
    """
    import gc

    import torch.distributed as dist

    for dec in decoders:
        dec.release()
    if not dist.is_available() or not dist.is_initialized():
        return
    gc.collect()
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()).lower():
        device = torch.cuda.current_device()
        torch.cuda.synchronize(device)
        dist.barrier(device_ids=[device])
    else:
        dist.barrier()
    dist.destroy_process_group()
    gc.collect()
