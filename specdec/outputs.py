"""What the engine returns: ``GenerationOutput`` of a ``generate`` call with one ``StepStats`` per
step, and ``WarmupReport`` / ``WarmupEntry`` of ``SpecDecoder.warmup``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.budget import BudgetStats

__all__ = ["GenerationOutput", "StepStats", "WarmupEntry", "WarmupReport"]


@dataclass(frozen=True)
class StepStats:
    """One decoding step (over the whole batch).

    Attributes:
        nodes_proposed: per sequence, draft nodes besides the root (0 for finished sequences).
        tokens_accepted: per sequence, accepted draft tokens (the bonus token not counted).
        tokens_emitted: per sequence, tokens appended this step (after eos / max_new_tokens cuts).
        draft_s: seconds in ``drafter.propose`` (+ ``update``).
        verify_s: seconds in the target's tree forward and the verification (tree inputs built on
            the host, the forward, the accept decision).
        commit_s: seconds in accepting the verdicts (appending the tokens, eos / max_new_tokens
            cuts) and the KV commit. The ``on_tokens`` callback is in no phase.
        forward_s: the part of ``verify_s`` from handing the inputs to the device to the forward's
            end: the target forward itself.
        budget: the step's node budget per sequence: the decoder's ``tree_size``, or with
            ``tree_size="auto"`` the one chosen for the step (0: plain decoding, no drafter call).
        capture_s: seconds of one-time work inside the step: the part of ``draft_s`` the drafter
            spent on first runs and CUDA-graph captures of its fixed-shape forwards (their compiles)
            by its own account (``Drafter.captured_s``; 0.0 for drafters that keep none), or a plain
            chunk's share of its capture (``DecodeChunk.capture_s``, inside ``verify_s``). The budget
            rule leaves such steps out of its cost estimates.

    Timing: by default (``SpecDecoder(profile=False)``) the phases are host wall time, with no
    device synchronize: device work still queued when a phase ends is counted in the phase where
    the host next waits for it (the verification's device-to-host copy, usually), so ``forward_s``
    is mostly the launch and ``verify_s`` holds the forward's device time. With
    ``SpecDecoder(profile=True)`` every phase ends with a device synchronize, so each phase holds
    the device work it queued (the syncs serialize host and device work a normal step overlaps:
    the profiled step is slower). On the CPU both are the same.

    The steps of a ``DecodeChunk`` (``SpecDecoder(decode_chunk=)``) are timed together: each of
    them holds an equal share of the chunk's time.
    """

    nodes_proposed: tuple[int, ...]
    tokens_accepted: tuple[int, ...]
    tokens_emitted: tuple[int, ...]
    draft_s: float
    verify_s: float
    commit_s: float
    forward_s: float = 0.0
    budget: int = 0
    capture_s: float = 0.0


@dataclass(frozen=True)
class GenerationOutput:
    """Result of ``SpecDecoder.generate``.

    Attributes:
        sequences: int64 ``[B, T]`` on CPU: each row is its prompt (without padding) followed by
            its new tokens, right-padded with ``pad_token_id`` to the longest row.
        lengths: per sequence, its length in ``sequences`` (prompt + new tokens).
        prompt_lengths: per sequence, its prompt length.
        steps: per-step statistics.
        prefill_s: seconds in the target's prompt prefill (host wall time; device synchronized
            with ``SpecDecoder(profile=True)``, see ``StepStats``).
        shared_prompt: whether the call decoded on the shared layout (``num_return_sequences`` > 1 of
            one prompt whose KV was kept once for all its sequences, see ``SpecDecoder``'s
            ``shared_prefix``); False: every sequence held its own copy of its prompt's KV.
        budget: with ``SpecDecoder(tree_size="auto")`` and a drafter, the call's budgets
            (``specdec.budget.BudgetStats``: steps per budget, and the last decision's costs and
            acceptance estimate in ``budget.reason``); None with a fixed tree size.

    Timing (``steps``' ``draft_s`` / ``verify_s`` / ``forward_s`` / ``commit_s`` and ``prefill_s``):
    host wall time without any device synchronize by default; with ``SpecDecoder(profile=True)``
    every phase ends with a device synchronize, so each holds the device work it queued (see
    ``StepStats``).
    """

    sequences: torch.Tensor
    lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0
    shared_prompt: bool = False
    budget: BudgetStats | None = None

    def new_tokens(self, seq: int = 0) -> torch.Tensor:
        """int64 ``[num_new]``: the tokens generated for sequence ``seq``."""
        return self.sequences[seq, self.prompt_lengths[seq] : self.lengths[seq]]

    @property
    def num_new_tokens(self) -> int:
        return sum(n - p for n, p in zip(self.lengths, self.prompt_lengths))

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per target forward and sequence (accepted drafts + bonus): the speedup bound."""
        emitted = [e for s in self.steps for e, n in zip(s.tokens_emitted, s.nodes_proposed) if e]
        return sum(emitted) / len(emitted) if emitted else 0.0

    def totals(self) -> dict[str, float]:
        """Summed seconds per phase and counts over all steps (``prefill_s`` once per call)."""
        return {
            "steps": len(self.steps),
            "nodes_proposed": sum(sum(s.nodes_proposed) for s in self.steps),
            "tokens_accepted": sum(sum(s.tokens_accepted) for s in self.steps),
            "new_tokens": self.num_new_tokens,
            "draft_s": sum(s.draft_s for s in self.steps),
            "verify_s": sum(s.verify_s for s in self.steps),
            "forward_s": sum(s.forward_s for s in self.steps),
            "commit_s": sum(s.commit_s for s in self.steps),
            "prefill_s": self.prefill_s,
        }


@dataclass(frozen=True)
class WarmupEntry:
    """One fixed-shape target forward made ready by ``SpecDecoder.warmup``.

    An entry of the copy layout (``prompt_capacity`` None) is one (B, S): steps 1 to 3 of ``warmup``
    over the ``[B, S]`` cache. An entry of a shared prompt (``prompt_capacity`` C, made by
    ``warmup(new_tokens=...)``) is one (B, S, C): the tree forward of B rows of S slots over a prompt
    shared through the batch-1 cache of C slots; its ``built`` / ``first_run_s`` / ``capture_s`` /
    ``capture_warmup_s`` are False / None (it has no copy-layout forward), its ``prefill_*`` describe the
    prompt's batch-1 prefill (into the C-slot cache) and its ``shared_*`` the forward over the prompt.

    Attributes:
        batch_size: B.
        capacity: the cache's slots per sequence S (with ``prompt_capacity``: the rows' cache).
        n: tree nodes per sequence (root included): ``tree_size + 1``.
        seconds: the whole entry (cache, prefill, the forward's first run and capture), device
            synchronized.
        prefill_s: the prefill of a short dummy prompt into the cache (allocates its buffers the
            first time): one chunk through the fixed-shape prefill forward (its first run and
            capture included when this warm-up made it), or the eager prefill path.
        first_run_s: the forward's first run: with ``compile``, torch.compile of this shape (long
            the first time, short with a warm on-disk cache); None if the forward had run before
            (or with dynamic shapes).
        capture_s: the CUDA-graph capture after it; None without CUDA graphs or if done before.
        built: whether this warm-up made the fixed-shape forward (False: it existed already, or
            shapes are dynamic).
        prefill_n: prompt tokens per chunk of this (B, S)'s fixed-shape prefill forward
            (``prefill_width``); None: prompts of this cache are prefilled eagerly (dynamic shapes,
            a GPU without CUDA graphs, ``prefill_width`` off, or S < ``prefill_width``).
        prefill_first_run_s: that forward's first run (one eager forward; never compiled); None if
            it had run before or there is none.
        prefill_capture_s: its CUDA-graph capture; None without CUDA graphs, if done before, or
            without that forward.
        prefill_built: whether this warm-up made that forward.
        capture_warmup_s: the part of ``capture_s`` spent in the side-stream warm-up forwards before
            the recording (``specdec.graphs.capture_warmup``); None when ``capture_s`` is.
        shared_built: whether this warm-up made the fixed-shape tree forward over a shared prompt
            (``SpecDecoder.shared_forwards``, B > 1 with ``shared_prefix``; the prompt cache of S
            slots).
        shared_first_run_s: that forward's first run (with ``compile``, its compile); None if it had
            run before or there is none.
        shared_capture_s: its CUDA-graph capture; None without CUDA graphs, if done before, or
            without that forward.
        prompt_capacity: None: an entry of the copy layout (its shared forward, if any, reads a prompt
            cache of S slots); C: an entry of a shared prompt, whose prompt cache has C slots (see
            above).
        chunk_capture_s: plain decoding (``tree_size=0``) with ``decode_chunk``: the capture of the
            ``DecodeChunk`` over this entry's forward (over the shared-prompt forward for an entry
            with ``prompt_capacity``, else the copy layout's), with ``warmup(sampling=)`` the
            greedy and the sampled chunk's together; None if they were captured before, or without
            CUDA graphs or chunks.
    """

    batch_size: int
    capacity: int
    n: int
    seconds: float
    prefill_s: float
    first_run_s: float | None
    capture_s: float | None
    built: bool
    prefill_n: int | None = None
    prefill_first_run_s: float | None = None
    prefill_capture_s: float | None = None
    prefill_built: bool = False
    capture_warmup_s: float | None = None
    shared_built: bool = False
    shared_first_run_s: float | None = None
    shared_capture_s: float | None = None
    prompt_capacity: int | None = None
    chunk_capture_s: float | None = None


@dataclass(frozen=True)
class WarmupReport:
    """What ``SpecDecoder.warmup`` did.

    Attributes:
        entries: one per (batch size, capacity), in the order they were warmed; with ``new_tokens``,
            also one per (batch size > 1, rows' capacity, prompt capacity) of a shared prompt
            (``WarmupEntry.prompt_capacity`` set), after that batch size's copy-layout entries.
        drafter_s: seconds in the drafter's own ``warmup`` (0.0 if it has none).
        total_s: seconds of the whole call.
        compile_cache: the directory of torch.compile's on-disk caches (``compile`` with inductor),
            else None.
    """

    entries: tuple[WarmupEntry, ...]
    drafter_s: float
    total_s: float
    compile_cache: str | None = None
