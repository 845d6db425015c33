"""What a stress call's output must satisfy, the reference it is compared with, and which errors end a run."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from specdec.cli.stress.config import PAD

__all__ = ["check_output", "check_row", "is_fatal_cuda_error"]

#: Substrings of an exception's message that mean the CUDA context is poisoned: stop the run.
_FATAL_CUDA = ("CUDA error", "cudaError", "illegal memory access", "unspecified launch failure",
               "device-side assert", "CUBLAS_STATUS_EXECUTION_FAILED", "misaligned address")  # fmt: skip


def _eos_set(eos) -> set[int]:
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _cut_at_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for j, t in enumerate(tokens):
        if t in eos:
            return tokens[: j + 1]
    return tokens


def check_row(new: list[int], max_new: int, eos: set[int], vocab: int) -> list[str]:
    """Problems of one row's new tokens (empty: valid): 1..max_new ids in ``[0, vocab)``, no eos
    before the last token, and fewer than ``max_new`` only when the last one is an eos."""
    problems = []
    if not 1 <= len(new) <= max_new:
        problems.append(f"{len(new)} new tokens, expected 1..{max_new}")
    bad = [t for t in new if not 0 <= t < vocab]
    if bad:
        problems.append(f"token ids out of [0, {vocab}): {bad[:4]}")
    if any(t in eos for t in new[:-1]):
        problems.append("tokens after an eos")
    if new and len(new) < max_new and new[-1] not in eos:
        problems.append(f"stopped after {len(new)} of {max_new} tokens without an eos")
    return problems


def check_output(out, prompts: Sequence, max_new: int, eos, vocab: int, tree_size: int) -> list[list[str]]:
    """Per row, what is wrong with a ``GenerationOutput`` (empty lists: valid).

    Checks the shape and dtype of ``sequences``, that each row starts with its prompt, its new
    tokens (``check_row``), the padding after its end, and the per-step statistics: every step
    proposes at most ``tree_size`` nodes, accepts at most what it proposed, emits at most one more
    than it accepted, and the emitted tokens add up to the row's new tokens.
    """
    import torch

    eos = _eos_set(eos)
    batch = len(prompts)
    rows: list[list[str]] = [[] for _ in range(batch)]
    seqs = out.sequences
    if not isinstance(seqs, torch.Tensor) or seqs.dtype != torch.int64 or seqs.dim() != 2 or seqs.shape[0] != batch:
        shape = tuple(seqs.shape) if isinstance(seqs, torch.Tensor) else type(seqs).__name__
        return [[f"sequences: expected int64 [{batch}, T], got {shape}"]] * batch
    if len(out.lengths) != batch or len(out.prompt_lengths) != batch or seqs.shape[1] != max(out.lengths):
        msg = f"lengths: expected {batch} rows and T = max(lengths), got {len(out.lengths)}, T = {seqs.shape[1]}"
        return [[msg]] * batch
    emitted = [0] * batch
    for s, step in enumerate(out.steps):
        for b in range(batch):
            n, a, e = step.nodes_proposed[b], step.tokens_accepted[b], step.tokens_emitted[b]
            if not (0 <= n <= tree_size and 0 <= a <= n and 0 <= e <= a + 1):
                rows[b].append(f"step {s}: proposed {n} (tree size {tree_size}), accepted {a}, emitted {e}")
            emitted[b] += e
    for b, p in enumerate(prompts):
        plen, length = out.prompt_lengths[b], out.lengths[b]
        if plen != len(p) or seqs[b, :plen].tolist() != p.tolist():
            rows[b].append("the row does not start with its prompt")
            continue
        new = seqs[b, plen:length].tolist()
        rows[b] += check_row(new, max_new, eos, vocab)
        if bool((seqs[b, length:] != PAD).any()):
            rows[b].append("padding after the row's end is not the pad id")
        if emitted[b] != len(new):
            rows[b].append(f"steps emitted {emitted[b]} tokens, the row has {len(new)}")
    return rows


class _Reference:
    """The target's own greedy continuation of a prompt alone (batch 1, no eos), cached per prompt.

    A plain decoder (no drafter): ``mode="default"`` the device's defaults (CUDA graphs on CUDA),
    ``"eager"`` dynamic shapes without graphs (the path that shares the least with the engines
    under test). A cached continuation serves any shorter request.
    """

    def __init__(self, target, attn_impl: str, mode: str = "default") -> None:
        from specdec import SpecDecoder

        eager = dict(static_shapes=False, cuda_graphs=False) if mode == "eager" else {}
        self.decoder = SpecDecoder(target, None, tree_size=0, attn_impl=attn_impl, **eager)
        self.known: dict[tuple[int, str], list[int]] = {}
        self.seconds = 0.0
        self.decodes = 0

    def continuation(self, prompt, need: int) -> list[int]:
        key = (len(prompt), hashlib.sha1(prompt.numpy().tobytes()).hexdigest())
        have = self.known.get(key)
        if have is None or len(have) < need:
            t0 = time.perf_counter()
            have = self.decoder.generate([prompt], need).new_tokens(0).tolist()
            self.seconds += time.perf_counter() - t0
            self.decodes += 1
            self.known[key] = have
        return have[:need]


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` leaves the CUDA context unusable (no later call can be trusted)."""
    if type(exc).__name__ == "OutOfMemoryError":
        return False
    if type(exc).__name__ == "AcceleratorError":
        return True
    msg = str(exc)
    return any(s in msg for s in _FATAL_CUDA)
