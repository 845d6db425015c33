"""The decoding loop: prefill, then per step draft -> one tree forward -> verify -> commit.

``SpecDecoder(target, drafter, tree_size)`` owns the loop; ``wrap(model, drafter)`` gives a
``generate`` with transformers-like arguments. ``drafter=None`` (or ``tree_size=0``) is plain
autoregressive decoding through the same path (every tree is just its root): the baseline that
matches ``model.generate``.

Shapes: with ``static_shapes=True`` (the default on CUDA) every tree forward has the same
``[B, tree_size + 1]`` input (trees padded with dummy nodes that no real node attends to, also
when every tree is just its root) and attends over the whole preallocated cache, so the
forward has fixed shapes and buffer addresses. It runs through ``specdec.graphs.GraphedForward``:
inputs copied in place into fixed buffers each step, and with ``cuda_graphs`` (the default on
CUDA) the forward recorded once per (batch size, cache) as a CUDA graph and replayed; without,
the same code runs eagerly on the same buffers. Otherwise trees are padded only to the batch's
largest tree and attention reads only the filled part of the cache (cheaper on CPU).

KV capacity: a fixed-shape forward is built for one cache (its capacity S is part of its shapes,
its buffers' addresses part of its graph), so with static shapes the decoder keeps its caches:
one ``KVCache`` per (batch size, capacity), each with its forwards. The capacity of a request
needing ``need = longest prompt + max_new_tokens + tree_size`` slots per sequence is the smallest
of ``cache_buckets`` that holds it (default ``default_cache_buckets``: powers of two from
``MIN_CACHE_BUCKET`` = 1024, then the target's context + tree_size), or ``max_cache_len`` when
given. Every request that fits a bucket used before (a shorter one too) reuses that bucket's
cache and forwards: no new capture, no recompile. ``SpecDecoder.warmup`` builds them all ahead
of time; ``SpecDecoder.release`` drops them. With dynamic shapes and neither option each call
gets a cache of exactly ``need`` slots, dropped afterwards.

Prompt prefill: every call first writes each prompt's KV but its last token (the first root) into
the cache. With static shapes and a cache of at least ``prefill_width`` slots (default
``DEFAULT_PREFILL_WIDTH`` = 256) this runs as chunks of up to ``prefill_width`` prompt tokens, each
one chain-shaped tree (a chain tree is causal attention) through a second fixed-shape
``GraphedForward`` ``[B, prefill_width]`` per (batch size, cache) -- captured as a CUDA graph like
the tree forward, never compiled -- instead of one eager HF forward whose host time (about 1.5 ms of
Python per layer) dominates the prefill of short prompts on a GPU. With dynamic shapes, on a GPU
without CUDA graphs, with ``prefill_width=0`` / None, or for a cache smaller than
``prefill_width``, the prompts go through one eager forward (``hf.prefill``, SDPA). See
``SpecDecoder._chunked_prefill`` for the chunking rules.

Shared prompt (``num_return_sequences = n > 1`` of one prompt): the prompt's KV but its last token
is written once, into a batch-1 ``KVCache`` of C slots -- the batch-1 cache of the capacity a
request of P = prompt length - 1 tokens gets (a bucket, ``max_cache_len``, or exactly P), kept like
the other caches and prefilled like a batch-1 prompt (``_prefill``: chunked through the fixed-shape
prefill forward with static shapes). The n sequences' own cache (``[n, S]``) holds only what follows
it -- its slot s is position ``P + s``: the prompt's last token (the first root), the new tokens and
the tree, so S is sized for ``1 + max_new_tokens + tree_size``, not for the prompt. Every tree
forward attends through the cascade attention (``treeattn.cascade``: the prompt's KV read once for
all n sequences): with dynamic shapes ``hf.tree_forward(shared=)`` over exactly P prompt slots; with
static shapes a ``GraphedForward(shared=)`` per (n, S, tree_size + 1, C) whose input vector carries P
as data (the cascade reads the first P of the C slots, its launch fixed by C), so one capture
serves every prompt of up to C tokens. Otherwise (several prompts, ``shared_prefix=False``, or a
target the cascade does not serve) each sequence keeps its own copy of its prompt's KV. See
``SpecDecoder``'s ``shared_prefix``.

Plain decoding (no drafter) with static shapes runs ``decode_chunk`` steps (default 8) per
``specdec.graphs.DecodeChunk``: the ``[B, 1]`` forward and the argmax (greedy) or an inverse-CDF
draw (sampling) of each step feeding the next, one CUDA-graph replay and one device-to-host copy
per chunk (``SpecDecoder._chunk_steps``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from specdec.drafting import HIDDEN_ALL, HIDDEN_LAST, DraftContext, Drafter, hidden_states_request, propose_all
from specdec import hf
from specdec.distributed import RankSync
from specdec.graphs import (DEFAULT_PREFILL_WIDTH, DecodeChunk, GraphedForward, configure_compile_cache, prefill_chunks, replay_modes,
                            uses_inductor)
from specdec.kv import KVCache
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.tree import TokenTree
from specdec.verify import Verdict, greedy_verdict, verify_stochastic_batch
from treeattn import TreeMask

__all__ = [
    "DEFAULT_DECODE_CHUNK",
    "DEFAULT_PREFILL_WIDTH",
    "MIN_CACHE_BUCKET",
    "GenerationOutput",
    "SpecDecoder",
    "SpeculativeModel",
    "StepStats",
    "WarmupEntry",
    "WarmupReport",
    "default_cache_buckets",
    "wrap",
]

#: Plain-decoding steps per ``DecodeChunk`` (``SpecDecoder(decode_chunk=)``'s default).
DEFAULT_DECODE_CHUNK = 8
#: The smallest KV capacity (slots per sequence) of the default cache buckets.
MIN_CACHE_BUCKET = 1024
_UNBOUNDED_TOP = 1 << 20  # the largest default bucket of a target that declares no context length

_log = logging.getLogger(__name__)
_ROOT_PARENTS = torch.tensor([-1])  # the parents of every root-only tree (trees never modify their tensors)

#: A target forward over one step's trees, inputs ready: returns (logits [B, n, V], hidden [B, n, H] or None).
_Forward = Callable[[], tuple[torch.Tensor, torch.Tensor | None]]


def default_cache_buckets(max_positions: int | None, tree_size: int) -> tuple[int, ...]:
    """The default KV capacities (slots per sequence) a decoder with static shapes picks from.

    Powers of two from ``MIN_CACHE_BUCKET`` below the target's context length ``max_positions``,
    then ``max_positions + tree_size`` (the most a request can need: the context plus one tree);
    for a target without a declared context, powers of two up to 2**20. E.g. a 32768-position
    target at ``tree_size=64``: 1024, 2048, 4096, 8192, 16384, 32832; a 4096-position one: 1024,
    2048, 4160. A request uses the smallest bucket it fits, so it allocates at most about twice the
    slots it needs, and a decoder meets at most ``log2(context / 1024) + 1`` capacities, each
    captured / compiled once.
    """
    if max_positions is not None and (not isinstance(max_positions, int) or max_positions < 1):
        raise ValueError(f"max_positions: expected None or an int >= 1, got {max_positions!r}")
    if not isinstance(tree_size, int) or tree_size < 0:
        raise ValueError(f"tree_size: expected an int >= 0, got {tree_size!r}")
    limit = _UNBOUNDED_TOP if max_positions is None else max_positions
    out = []
    size = MIN_CACHE_BUCKET
    while size < limit:
        out.append(size)
        size *= 2
    out.append(size if max_positions is None else max_positions + tree_size)
    return tuple(out)


@dataclass(frozen=True)
class StepStats:
    """One decoding step (over the whole batch).

    Attributes:
        nodes_proposed: per sequence, draft nodes besides the root (0 for finished sequences).
        tokens_accepted: per sequence, accepted draft tokens (the bonus token not counted).
        tokens_emitted: per sequence, tokens appended this step (after eos / max_new_tokens cuts).
        draft_s: seconds in ``drafter.propose`` (+ ``update``; device synchronized).
        verify_s: seconds in the target's tree forward and the verification (tree inputs built on
            the host, the forward, the accept decision).
        commit_s: seconds in accepting the verdicts (appending the tokens, eos / max_new_tokens
            cuts) and the KV commit (device synchronized). The ``on_tokens`` callback is in no phase.
        forward_s: the part of ``verify_s`` from handing the inputs to the device to the forward's
            end (device synchronized): the target forward itself.

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


@dataclass(frozen=True)
class GenerationOutput:
    """Result of ``SpecDecoder.generate``.

    Attributes:
        sequences: int64 ``[B, T]`` on CPU: each row is its prompt (without padding) followed by
            its new tokens, right-padded with ``pad_token_id`` to the longest row.
        lengths: per sequence, its length in ``sequences`` (prompt + new tokens).
        prompt_lengths: per sequence, its prompt length.
        steps: per-step statistics.
        prefill_s: seconds in the target's prompt prefill (device synchronized).
        shared_prompt: whether the call decoded on the shared layout (``num_return_sequences`` > 1 of
            one prompt whose KV was kept once for all its sequences, see ``SpecDecoder``'s
            ``shared_prefix``); False: every sequence held its own copy of its prompt's KV.
    """

    sequences: torch.Tensor
    lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0
    shared_prompt: bool = False

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


class _PhaseTimer:
    """Seconds per phase of one step: ``with timer("verify"): ...`` adds the block's duration.

    Each phase ends with a device sync, so the device work it queued is counted in it (not in the
    next phase). Phases may nest (``forward`` inside ``verify``); a name used twice adds up. Under
    an active ``torch.profiler`` each phase is also a ``record_function`` range ``specdec.<phase>``.
    """

    def __init__(self, sync: Callable[[], None]) -> None:
        self._sync = sync
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def __call__(self, phase: str) -> "_Phase":
        return _Phase(self, phase)


class _Phase:
    """One ``with timer(phase)`` block (a plain context manager: cheaper than a generator's)."""

    __slots__ = ("timer", "phase", "start", "range")

    def __init__(self, timer: _PhaseTimer, phase: str) -> None:
        self.timer, self.phase, self.range = timer, phase, None

    def __enter__(self) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            self.range = torch.profiler.record_function(f"specdec.{self.phase}")
            self.range.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.timer._sync()
            self.timer.seconds[self.phase] += time.perf_counter() - self.start
        if self.range is not None:
            self.range.__exit__(*exc)


@dataclass(eq=False)
class _Run:
    """The state of one ``generate`` call, updated step by step (host side).

    Attributes:
        prompts: B prompts, int64 ``[L_b]``.
        seqs: int64 ``[B, T]``: committed tokens per sequence (prompt included); the last one,
            ``seqs[b, lens[b] - 1]``, is the next tree's root.
        lens: committed tokens per sequence.
        done: per sequence, finished (eos or max_new_tokens).
        hidden: per sequence, the next ``DraftContext.hidden`` (drafters with
            ``needs_hidden_states``): ``[m, H]``, the target's final hidden states of the committed
            positions ``lens[b] - 1 - m .. lens[b] - 2`` not yet shown to the drafter (m = 1 for
            ``"last"``), or None.
        cache: the target's KV cache (holds every committed token's KV but the root's; with
            ``shared``, only those after the shared prompt: slot s is position ``P + s``).
        sampling, generator, eos, max_new_tokens, on_tokens: ``generate``'s arguments.
        shared: the batch-1 cache whose slots ``[0, P)`` hold the prompt (but its last token) that
            all sequences share, ``lengths == [P]`` (``SpecDecoder._prefill_shared``), or None:
            every sequence's prompt is in ``cache``.
    """

    prompts: list[torch.Tensor]
    seqs: torch.Tensor
    lens: list[int]
    done: list[bool]
    hidden: list[torch.Tensor | None]
    cache: KVCache
    sampling: SamplingConfig | None
    generator: torch.Generator | None
    eos: set[int]
    max_new_tokens: int
    on_tokens: Callable[[int, list[int]], None] | None
    shared: KVCache | None = None


def _append(run: _Run, b: int, tokens: list[int]) -> list[int]:
    """Append ``tokens`` (host ints) to sequence ``b`` of ``run``, cut at its ``max_new_tokens`` and after
    the first eos; mark it done when it ends. Returns the tokens appended."""
    room = len(run.prompts[b]) + run.max_new_tokens - run.lens[b]
    new = tokens[:room]
    for j, tok in enumerate(new):
        if tok in run.eos:
            new = new[: j + 1]
            break
    run.seqs.numpy()[b, run.lens[b] : run.lens[b] + len(new)] = new  # a view: no tensor per sequence
    run.lens[b] += len(new)
    if run.lens[b] - len(run.prompts[b]) >= run.max_new_tokens or (new and new[-1] in run.eos):
        run.done[b] = True
    return new


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class SpecDecoder:
    """Speculative decoding of a HuggingFace causal LM with token trees.

    Args:
        target: the target causal LM (any dtype, CPU / CUDA / ``device_map="auto"``); its attention
            is routed through specdec's function (``hf.prepare_model``), which leaves its ordinary
            forward / generate unchanged.
        drafter: a ``specdec.drafting.Drafter``, or None for plain decoding.
        tree_size: node budget per step besides the root (0 = plain decoding).
        max_cache_len: one fixed KV capacity per sequence, chosen up front and reused across calls
            (a request that does not fit raises); None: ``cache_buckets`` with static shapes, else a
            cache of exactly prompt + max_new_tokens + tree_size slots per call.
        cache_buckets: the KV capacities (slots per sequence, each >= tree_size + 2) a request may
            get when ``max_cache_len`` is None: the smallest that holds it (one that fits none
            raises). Default None: ``default_cache_buckets(target's context, tree_size)`` with
            static shapes (powers of two from ``MIN_CACHE_BUCKET``), no buckets with dynamic
            shapes. One cache per (batch size, bucket) used is kept with its forwards (see
            ``caches``, ``release``).
        static_shapes: fixed ``[B, tree_size + 1]`` tree forwards over the whole cache through
            ``specdec.graphs.GraphedForward`` (default: True when the target is on CUDA, or when
            ``cuda_graphs`` is True).
        attn_impl: ``treeattn.tree_attention``'s ``impl`` ("auto", "triton", "torch").
        cuda_graphs: replay the target's tree forward as a CUDA graph, captured once per (batch
            size, cache) (default None: on when the target is on one CUDA device and shapes are
            static, unless the environment sets ``SPECDEC_CUDA_GRAPHS=0``; False on CPU). Needs
            static shapes.
        compile: run the fixed-shape tree forward through ``torch.compile`` before it is captured
            (needs static shapes): fuses the layers' elementwise kernels; the tree attention stays
            one custom op. True or ``"layers"`` (``"layers:BACKEND"``): each decoder layer through
            one forward compiled with inductor for all layers of its kind (``hf.compile_layers``);
            ``"inductor"``: the whole forward compiled as one (it also fuses one layer's last
            residual add with the next layer's norm); ``"max-autotune"``: the whole forward, inductor
            timing GEMM templates per matmul shape (a longer first compile); or another backend
            name. On an H100 (Qwen2.5-Coder-1.5B, PERF.md v20) the layer-wise compile brought a
            second process to its first token in ~16 s against 29.7 s for the whole forward (a
            first process: ~21 against 48.4 s), for a 65-node verify of 2.349 against 2.454 ms.
            The first forward of each (batch size, cache capacity) compiles; inductor's on-disk
            cache (``specdec.graphs.configure_compile_cache``) makes later processes faster.
            Default False, by decision (PERF.md v21): compiled, a first token costs a fresh process
            ~16-21 s on an H100 against a few seconds with CUDA graphs alone, which a one-off
            ``generate`` would pay for ~1.5x the speed afterwards; runs of many calls (the
            evaluation's ``--compile`` and drafter specs' ``compile=true``, ``bench-stalls
            --compile``) turn it on. The prompt-prefill forward is never compiled (it would add
            another compile per cache bucket for a once-per-call forward).
        prefill_width: with static shapes, prompt tokens per chunk of the fixed-shape prompt
            prefill (default ``DEFAULT_PREFILL_WIDTH`` = 256): each call prefills its prompts as
            ``ceil(longest prompt / prefill_width)`` (at most one more near a full cache)
            chain-shaped trees through one ``[B, prefill_width]`` ``GraphedForward`` per (batch
            size, cache), replayed as a CUDA graph with ``cuda_graphs`` (not compiled, even with
            ``compile``); caches of fewer slots than ``prefill_width`` prefill eagerly. 0 or None:
            always the eager prefill (one HF forward with SDPA). Ignored (eager prefill, the
            attribute ``prefill_width`` is 0) with dynamic shapes, and on a GPU without CUDA graphs
            (e.g. a model split across devices), where every chunk would be a host-bound eager
            forward; on CPU, static shapes chunk the prefill through the eager replay (what tests run).
        rank_sync: a ``specdec.distributed.RankSync`` for a tensor-parallel target (one decoder per
            rank, all called alike): the ranks check that they got the same prompts and drafted the
            same trees, and adopt rank 0's verification decision (and, when sampling, its random
            generator state) every step. None (default): ``RankSync.for_model(target)``, i.e. one
            over the target's TP group when transformers sharded it, else none (single process).
        decode_chunk: plain decoding (no drafter, or ``tree_size=0``) with static shapes runs
            this many steps per ``specdec.graphs.DecodeChunk``: the device feeds each step's argmax
            (greedy) or sampled token (an inverse-CDF draw per row and step from the warped
            distribution, its uniforms drawn from the call's generator before the replay) to the
            next, one replay of one CUDA graph (with ``cuda_graphs``) and one device-to-host copy per
            chunk instead of a host round trip per token (default ``DEFAULT_DECODE_CHUNK`` = 8). A
            call decodes in chunks while every unfinished sequence has at least that many tokens to
            go, then one step at a time; a sequence that ends (eos) inside a chunk keeps the tokens
            up to its eos (the chunk's later steps are wasted work, never output). Greedy: the same
            tokens as one step at a time; sampling: draws from the same distributions, with other
            random numbers (a sampled chunk records its sampling configuration: ``warmup(sampling=)``
            captures it ahead, else a call's first chunk does). 0: one step per forward. Ignored
            with dynamic shapes and a tensor-parallel target.
        shared_prefix: how ``generate(num_return_sequences=n)`` with n > 1 and ONE prompt (of at
            least 2 tokens; a one-token prompt has nothing to share) stores that prompt. True: its
            KV once, shared by the n sequences (see the module doc), with static or dynamic shapes;
            needs a target the cascade attention serves (``hf.shared_prefix_obstacle``: no
            soft-capped attention, no sliding window shorter than the call's context -- with static
            shapes the two caches' capacities, which the fixed-shape forward reads whole), else
            ValueError (at construction, or for a call whose context a sliding window does not
            cover). False: each of the n rows holds its own copy of the prompt's KV. None
            (default): the shared layout where True would give it, the copy layout where True would
            raise (a soft-capped target; a call longer than a sliding window). On an H100 with 16
            rows at the 1.5B's shapes a 64-step call took 18-39 % less time than with the copy
            layout for prompts of 150-4000 tokens (the prompt prefilled once, the verify forward
            7-8 % shorter), with 12x less KV (PERF.md v17). Calls with several prompts always use
            the copy layout.

    Kept state and memory: with static shapes, ``max_cache_len`` or ``cache_buckets`` the decoder
    keeps one ``KVCache`` per (batch size, capacity) it has used (``caches``) and, with static shapes, one
    ``GraphedForward`` per cache (``forwards``; with ``cuda_graphs`` its graph and the graph's
    private memory pool: the ``[B, n, V]`` logits and the forward's temporaries). A cache holds
    ``2 * layers * B * kv_heads * S * head_dim`` elements of the model's dtype once written
    (``KVCache.nbytes``): for Qwen2.5-1.5B in bf16 (28 layers, 2 KV heads of 128) 28 KiB per slot
    and sequence, 56 MiB at S = 2048, 0.9 GiB at S = 32832, 1.7 GiB for all six default buckets
    (tree_size 64) per sequence of batch size. The prompt-prefill forward of a cache
    (``prefill_forwards``) keeps logits of one position per sequence (``[B, 1, V]``), or of all
    ``prefill_width`` positions (``[B, prefill_width, V]``, 74 MiB per sequence for Qwen2.5's
    151936-token vocabulary in bf16) with a drafter that reads hidden states, plus, with CUDA graphs,
    its graph's pool of activations. A drafter with ``needs_hidden_states = "all"`` (EAGLE) is also
    handed its prompt's features, ``[L, H]`` per sequence (the eager prefill still runs the LM head
    on one position per sequence: no ``[B, L, V]`` logits); ``"last"`` / True (Medusa) gets one row.
    ``release()`` drops them. Call ``warmup()`` before timing to build them ahead of time.
    With the shared prompt, the kept caches are the n sequences' suffix caches (their capacity is
    picked for ``1 + max_new_tokens + tree_size`` slots, the same buckets / ``max_cache_len``) and
    the prompt's batch-1 cache (the batch-1 cache of the capacity picked for its P tokens, also what
    a batch-1 request of that bucket uses; made per call and dropped after it when there are no
    buckets and no ``max_cache_len``); with static shapes, one ``GraphedForward(shared=)`` per
    (n, suffix capacity, tree_size + 1, prompt capacity) (``shared_forwards``).
    """

    def __init__(
        self,
        target,
        drafter: Drafter | None = None,
        tree_size: int = 64,
        *,
        max_cache_len: int | None = None,
        cache_buckets: Sequence[int] | None = None,
        static_shapes: bool | None = None,
        attn_impl: str = "auto",
        cuda_graphs: bool | None = None,
        compile: bool | str = False,
        prefill_width: int | None = DEFAULT_PREFILL_WIDTH,
        rank_sync: RankSync | None = None,
        shared_prefix: bool | None = None,
        decode_chunk: int = DEFAULT_DECODE_CHUNK,
    ) -> None:
        hf.prepare_model(target, "target")
        if not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0:
            raise ValueError(f"tree_size: expected an int >= 0, got {tree_size!r}")
        if attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {attn_impl!r}")
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 2):
            raise ValueError(f"max_cache_len: expected None or an int >= 2, got {max_cache_len!r}")
        if cache_buckets is not None and max_cache_len is not None:
            raise ValueError(f"cache_buckets: expected None when max_cache_len is given, got {cache_buckets!r}")
        if prefill_width is not None and (not isinstance(prefill_width, int) or isinstance(prefill_width, bool)
                                          or prefill_width < 0):  # fmt: skip
            raise ValueError(
                f"prefill_width: expected None or an int >= 0 (0 or None: the eager prefill), got {prefill_width!r}"
            )
        if not isinstance(decode_chunk, int) or isinstance(decode_chunk, bool) or decode_chunk < 0:
            raise ValueError(f"decode_chunk: expected an int >= 0 (0: one step per forward), got {decode_chunk!r}")
        self.vocab_size = hf.vocab_size(target)
        if drafter is not None:
            for attr in ("propose", "reset", "update"):
                if not callable(getattr(drafter, attr, None)):
                    raise ValueError(f"drafter: expected the specdec.drafting.Drafter protocol, missing {attr}()")
            dv = getattr(drafter, "vocab_size", None)
            if dv is not None and dv != self.vocab_size:
                raise ValueError(
                    f"drafter: expected the target's vocabulary size {self.vocab_size}, got vocab_size={dv}"
                )
        self.target = target
        self.drafter = drafter
        self.tree_size = tree_size if drafter is not None else 0
        # Drafters that read the target's hidden states (Medusa, EAGLE heads) get them in DraftContext.hidden:
        # None, HIDDEN_LAST (the one that predicted the root) or HIDDEN_ALL (every committed token's, once).
        request = hidden_states_request(drafter)
        self._hidden_mode: str | None = request if self.tree_size > 0 else None
        self._wants_hidden = self._hidden_mode is not None
        self.max_cache_len = max_cache_len
        self.device = hf.input_device(target)
        self.static_shapes, self.cuda_graphs, self.compile = replay_modes(
            target, static_shapes, cuda_graphs, compile, "the target")
        self.attn_impl = attn_impl
        # Without CUDA graphs on a GPU (a model split across devices, SPECDEC_CUDA_GRAPHS=0) every chunk
        # would be a host-bound eager forward, and several cost more than the one eager prefill.
        chunked = self.static_shapes and (self.cuda_graphs or self.device.type != "cuda")
        #: prompt tokens per chunk of the fixed-shape prefill in effect; 0: the eager prefill
        self.prefill_width: int = (prefill_width or 0) if chunked else 0
        #: the capacities requests pick from (increasing), or None (max_cache_len, or exact sizes)
        self.cache_buckets: tuple[int, ...] | None = None
        if cache_buckets is not None:
            self.cache_buckets = _checked_buckets(cache_buckets, self.tree_size + 2)
        elif max_cache_len is None and self.static_shapes:
            self.cache_buckets = default_cache_buckets(hf.max_positions(target), self.tree_size)
        self._caches: dict[tuple[int, int], KVCache] = {}  # (batch, capacity) -> kept cache
        self._graphs: dict[tuple[int, int, int], GraphedForward] = {}  # (batch, capacity, n) -> forward
        self._prefill_graphs: dict[tuple[int, int], GraphedForward] = {}  # (batch, capacity) -> prefill forward
        # (batch, capacity, n, shared capacity) -> tree forward over a shared prompt
        self._shared_graphs: dict[tuple[int, int, int, int], GraphedForward] = {}
        #: steps per DecodeChunk of plain decoding (0: none); see the argument
        self.decode_chunk: int = decode_chunk
        # (batch, capacity, shared capacity or 0, sampling config or None) -> chunk
        self._chunks: dict[tuple[int, int, int, SamplingConfig | None], DecodeChunk] = {}
        self._num_layers = hf.num_layers(target)  # the KV cache keeps all layers in one tensor
        if rank_sync is not None and not all(callable(getattr(rank_sync, a, None))
                                             for a in ("begin", "check_trees", "verdicts")):  # fmt: skip
            raise ValueError(f"rank_sync: expected None or a specdec.distributed.RankSync, got {type(rank_sync).__name__}")
        #: keeps the ranks of a tensor-parallel target in lockstep (None: a single-process target)
        self.rank_sync: RankSync | None = rank_sync if rank_sync is not None else RankSync.for_model(target)
        if shared_prefix is not None and not isinstance(shared_prefix, bool):
            raise ValueError(f"shared_prefix: expected None, True or False, got {shared_prefix!r}")
        obstacle = hf.shared_prefix_obstacle(target, 0)  # what rules it out whatever the context
        if shared_prefix and obstacle is not None:
            raise ValueError(f"shared_prefix: True needs a target the cascade attention serves, got one with "
                             f"{obstacle}")
        #: n > 1 sequences of one prompt keep its KV once (the module doc), where the call allows it.
        self.shared_prefix: bool = (obstacle is None) if shared_prefix is None else shared_prefix
        self._shared_required = shared_prefix is True  # a call the cascade cannot serve raises

    # ------------------------------------------------------------------ kept state

    @property
    def caches(self) -> Mapping[tuple[int, int], KVCache]:
        """The kept KV caches by (batch size, capacity) (read-only view)."""
        return MappingProxyType(self._caches)

    @property
    def forwards(self) -> Mapping[tuple[int, int, int], GraphedForward]:
        """The kept fixed-shape tree forwards by (batch size, capacity, n) (read-only view)."""
        return MappingProxyType(self._graphs)

    @property
    def shared_forwards(self) -> Mapping[tuple[int, int, int, int], GraphedForward]:
        """The kept fixed-shape tree forwards over a shared prompt (``GraphedForward(shared=)``) by
        (batch size, the rows' cache capacity, n, the prompt cache's capacity) (read-only view)."""
        return MappingProxyType(self._shared_graphs)

    @property
    def prefill_forwards(self) -> Mapping[tuple[int, int], GraphedForward]:
        """The kept fixed-shape prompt-prefill forwards (``[B, prefill_width]``) by (batch size,
        capacity) (read-only view)."""
        return MappingProxyType(self._prefill_graphs)

    def release(self, batch_size: int | None = None) -> None:
        """Drop the kept caches and their forwards (tree and prefill forwards, their CUDA graphs):
        all, or those of ``batch_size`` (a forward over a shared prompt goes with its rows' batch
        size and with batch size 1, whose cache holds its prompt).

        Their device memory goes back to PyTorch's caching allocator (``torch.cuda.empty_cache()``
        returns it to the driver); compiled code stays in torch.compile's caches. A later request
        re-creates what it needs (a new capture; no recompile within this process).
        """
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size < 1):  # fmt: skip
            raise ValueError(f"batch_size: expected None or an int >= 1, got {batch_size!r}")
        def kept(key: tuple[int, ...]) -> bool:
            return batch_size is not None and key[0] != batch_size

        self._caches = {key: cache for key, cache in self._caches.items() if kept(key)}
        self._graphs = {key: graphed for key, graphed in self._graphs.items() if kept(key)}
        # A forward over a shared prompt reads its rows' cache and a batch-1 cache: it goes with either.
        self._shared_graphs = {key: graphed for key, graphed in self._shared_graphs.items()
                               if kept(key) and kept((1,))}
        self._prefill_graphs = {key: graphed for key, graphed in self._prefill_graphs.items() if kept(key)}

    def _capacity(self, need: int, arg: str = "max_new_tokens",
                  what: str = "prompt + max_new_tokens + tree_size") -> int:  # fmt: skip
        """The cache capacity of a request needing ``need`` slots per sequence (ValueError naming
        ``arg`` if none fits)."""
        if self.max_cache_len is not None:
            if need > self.max_cache_len:
                raise ValueError(
                    f"{arg}: {what} needs {need} cache slots per sequence, max_cache_len is {self.max_cache_len}"
                )
            return self.max_cache_len
        if self.cache_buckets is None:
            return need
        for capacity in self.cache_buckets:
            if need <= capacity:
                return capacity
        raise ValueError(
            f"{arg}: {what} needs {need} cache slots per sequence, the largest of cache_buckets is "
            f"{self.cache_buckets[-1]}"
        )

    def _cache_for(self, batch: int, capacity: int) -> KVCache:
        """The (emptied) cache of ``batch`` sequences and ``capacity`` slots: the kept one, if kept."""
        if self.max_cache_len is None and self.cache_buckets is None:
            return KVCache(batch, capacity, num_layers=self._num_layers)  # exact size, not kept
        cache = self._caches.get((batch, capacity))
        if cache is None:
            cache = self._caches[(batch, capacity)] = KVCache(batch, capacity, num_layers=self._num_layers)
        cache.reset()
        return cache

    # ------------------------------------------------------------------ inputs

    def _prompts(self, input_ids, attention_mask) -> list[torch.Tensor]:
        if isinstance(input_ids, (list, tuple)):
            if attention_mask is not None:
                raise ValueError("attention_mask: expected None when input_ids is a list of prompts")
            rows = list(input_ids)
            for b, r in enumerate(rows):
                if not isinstance(r, torch.Tensor) or r.dim() != 1:
                    raise ValueError(f"input_ids[{b}]: expected a 1-D LongTensor, got {type(r).__name__}")
        elif isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids: expected shape [L] or [B, L], got {tuple(input_ids.shape)}")
            if attention_mask is None:
                rows = list(input_ids)
            else:
                if tuple(attention_mask.shape) != tuple(input_ids.shape):
                    raise ValueError(
                        f"attention_mask: expected input_ids' shape {tuple(input_ids.shape)}, got {tuple(attention_mask.shape)}"
                    )
                rows = []
                for b in range(input_ids.shape[0]):
                    keep = attention_mask[b].bool().cpu()
                    idx = keep.nonzero().flatten()
                    if len(idx) and int(idx[-1] - idx[0]) + 1 != len(idx):
                        raise ValueError(f"attention_mask[{b}]: expected one contiguous run of 1s (left or right padding)")
                    rows.append(input_ids[b].cpu()[keep])
        else:
            raise ValueError(f"input_ids: expected a LongTensor or a list of 1-D LongTensors, got {type(input_ids).__name__}")
        out = []
        for b, r in enumerate(rows):
            if r.dtype.is_floating_point or r.dtype == torch.bool:
                raise ValueError(f"input_ids: expected integer token ids, got dtype {r.dtype}")
            if r.numel() == 0:
                raise ValueError(f"input_ids: expected a non-empty prompt, got an empty prompt for sequence {b}")
            r = r.detach().to("cpu", torch.int64)
            lo, hi = int(r.min()), int(r.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"input_ids: expected token ids in [0, {self.vocab_size}), got values in [{lo}, {hi}]")
            out.append(r)
        if not out:
            raise ValueError("input_ids: expected at least one prompt, got none")
        return out

    # ------------------------------------------------------------------ generate

    @torch.no_grad()
    def generate(
        self,
        input_ids,
        max_new_tokens: int,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_token_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        *,
        attention_mask: torch.Tensor | None = None,
        pad_token_id: int | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
        num_return_sequences: int = 1,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` per sequence; lossless w.r.t. the target.

        Args:
            input_ids: int64 ``[L]`` or ``[B, L]`` (with ``attention_mask`` ``[B, L]`` marking the
                real tokens of padded rows), or a list of B 1-D prompts. Prompts must be non-empty.
            max_new_tokens: new tokens per sequence (fewer if eos is generated).
            do_sample: False: greedy (identical to the target's greedy decoding); True: sample from
                the target warped by ``temperature``, ``top_k`` (0 = off), ``top_p`` (1 = off).
            eos_token_id: token id(s) that end a sequence (kept in the output), None = never stop.
            generator: randomness for sampling and for the drafter.
            pad_token_id: filler of ``sequences`` after a row's end (default: the first eos id, else 0).
            on_tokens: streaming callback, called after every step as ``on_tokens(seq, tokens)`` with
                the tokens (host ints) appended to sequence ``seq`` in that step (never empty); in
                plain decoding, after every chunk of ``decode_chunk`` steps.
            num_return_sequences: n sequences per prompt (HF's argument): the output's rows are
                prompt 0's n sequences, then prompt 1's, ...; each decodes on its own (independent
                samples when sampling, n equal rows when greedy). With n > 1 and one prompt (of at
                least 2 tokens) the n rows share one copy of the prompt's KV when ``shared_prefix``
                is on (the default, see ``SpecDecoder``): the prompt is prefilled once, the rows' cache holds
                only their new tokens and trees, and every tree forward attends to the prompt
                through the cascade attention (with static shapes: one fixed-shape forward per
                prompt-cache bucket, reused for any prompt length in it). Otherwise (several
                prompts, ``shared_prefix`` off, a target the cascade does not serve) each row holds
                its own copy of its prompt's KV. Both layouts give the same tokens
                (up to rounding in the attention) and draw the same random numbers.

        Returns:
            ``GenerationOutput`` with the sequences and per-step statistics.
        """
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        sampling = SamplingConfig(temperature, top_k, top_p) if do_sample else None
        eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        if pad_token_id is None:
            pad_token_id = min(eos) if eos else 0
        if not isinstance(num_return_sequences, int) or isinstance(num_return_sequences, bool) or num_return_sequences < 1:
            raise ValueError(f"num_return_sequences: expected an int >= 1, got {num_return_sequences!r}")
        distinct = self._prompts(input_ids, attention_mask)
        prompts = [p for p in distinct for _ in range(num_return_sequences)]
        batch = len(prompts)
        longest = max(len(p) for p in prompts)
        limit = hf.max_positions(self.target)
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens: prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"target's context of {limit} positions"
            )
        need = longest + max_new_tokens + self.tree_size
        shared_caps = self._shared_capacities(distinct, num_return_sequences, max_new_tokens, need)
        if shared_caps is not None:  # per sequence: the prompt's last token (the first root), the new tokens, one tree
            cache = self._cache_for(batch, shared_caps[1])
        else:
            cache = self._cache_for(batch, self._capacity(need))
        seqs = torch.zeros(batch, need + 1, dtype=torch.int64)
        for b, p in enumerate(prompts):
            seqs[b, : len(p)] = p
        run = _Run(prompts, seqs, [len(p) for p in prompts], [False] * batch, [None] * batch, cache, sampling,
                   generator, eos, max_new_tokens, on_tokens)  # fmt: skip
        if self.rank_sync is not None:  # same inputs on every rank, the source rank's random stream
            self.rank_sync.begin(prompts, generator, [max_new_tokens, repr(sampling), sorted(eos), pad_token_id,
                                                      self.tree_size], self.device)  # fmt: skip

        timer = _PhaseTimer(self._sync)
        self._sync()
        with timer("prefill"):
            if shared_caps is not None:
                run.shared, run.hidden = self._prefill_shared(distinct[0], batch, shared_caps[0])
                cache.allocate_like(run.shared)  # the rows prefill nothing: buffers before their first forward
            else:
                run.hidden = self._prefill(cache, seqs, run.lens)
        if self.drafter is not None:
            self.drafter.reset([p.clone() for p in prompts])
        steps: list[StepStats] = []
        while not all(run.done):
            chunk = self._chunk_for(run)
            steps.extend([self._step(run)] if chunk is None else self._chunk_steps(run, chunk))

        out = torch.full((batch, max(run.lens)), pad_token_id, dtype=torch.int64)
        for b, n in enumerate(run.lens):
            out[b, :n] = seqs[b, :n]
        return GenerationOutput(out, tuple(run.lens), tuple(len(p) for p in prompts), steps, timer.seconds["prefill"],
                                shared_prompt=shared_caps is not None)  # fmt: skip

    def _shared_capacities(self, prompts: list[torch.Tensor], copies: int, max_new_tokens: int,
                           need: int) -> tuple[int, int] | None:  # fmt: skip
        """``(C, S)`` when a call of ``prompts`` x ``copies`` sequences needing ``need`` positions each
        decodes on the shared prompt -- ``shared_prefix`` on, one prompt of >= 2 tokens, ``copies >
        1``, and a target the cascade serves over the call's context (``need``; with static shapes
        ``C + S``, the slots the fixed-shape forward reads) --, else None (the copy layout; with
        ``shared_prefix=True`` an unserved context raises). C: the capacity of the prompt's batch-1
        cache (for its ``len - 1`` tokens), S: of the rows' cache (``1 + max_new_tokens + tree_size``)."""
        if not self.shared_prefix or copies == 1 or len(prompts) != 1 or len(prompts[0]) == 1:
            return None
        prompt_cap = self._capacity(len(prompts[0]) - 1, "input_ids", "the shared prompt but its last token")
        rows_cap = self._capacity(1 + max_new_tokens + self.tree_size,
                                  what="1 + max_new_tokens + tree_size (a shared prompt's rows)")  # fmt: skip
        context = prompt_cap + rows_cap if self.static_shapes else need
        obstacle = hf.shared_prefix_obstacle(self.target, context)
        if obstacle is not None and self._shared_required:
            raise ValueError(f"shared_prefix: True needs a target the cascade attention serves over this call's "
                             f"{context} positions, got one with {obstacle}")
        if obstacle is not None:
            _log.info("specdec: %d sequences of one prompt keep a copy of it each: the target has %s", copies, obstacle)
            return None
        return prompt_cap, rows_cap

    def _prefill_shared(self, prompt: torch.Tensor, batch: int,
                        capacity: int) -> tuple[KVCache, list[torch.Tensor | None]]:  # fmt: skip
        """The prompt's KV but its last token's (the first root), written once for ``batch`` sequences
        that share it into the batch-1 cache of ``capacity`` slots (``_cache_for``: kept like the
        other caches, e.g. per bucket) by ``_prefill``, as a batch-1 request's prompt (chunked through
        the fixed-shape prefill forward with static shapes, else one eager forward).

        Args:
            prompt: int64 ``[L]``, ``L >= 2``.
            batch: the sequences sharing it.
            capacity: the cache's slots, ``>= L - 1``.

        Returns:
            The shared cache (``lengths == [L - 1]``), and per sequence the first
            ``DraftContext.hidden`` as ``_prefill``'s: one tensor, the same for every sequence
            (``[L - 1, H]`` for ``"all"``, ``[1, H]`` for ``"last"``), or Nones.
        """
        shared = self._cache_for(1, capacity)
        return shared, self._prefill(shared, prompt[None], [len(prompt)]) * batch

    def _prefill(self, cache: KVCache, seqs: torch.Tensor, lens: Sequence[int]) -> list[torch.Tensor | None]:
        """Write each sequence's prompt but its last token (the first root) into ``cache``.

        Through the fixed-shape chunked prefill (``_chunked_prefill``) when this cache has a
        prefill forward (static shapes, ``prefill_width`` on and at most the capacity), else one
        eager forward (``hf.prefill``).

        Args:
            cache: the emptied cache; its lengths become ``lens[b] - 1``.
            seqs: int64 ``[B, >= max(lens)]``, the prompts, right-padded.
            lens: the prompt lengths.

        Returns:
            Per sequence, the first ``DraftContext.hidden`` for drafters with
            ``needs_hidden_states``: the target's final hidden states of prompt positions
            ``0 .. lens[b] - 2`` (``[lens[b] - 1, H]``) for ``"all"``, of position ``lens[b] - 2``
            only (``[1, H]``: the state that predicted the root) for ``"last"``; else Nones (also
            for one-token prompts).
        """
        batch, longest = len(lens), max(lens)
        hidden: list[torch.Tensor | None] = [None] * batch
        if longest > 1:
            graphed = self._prefill_forward(cache, batch)
            if graphed is not None:
                hidden = self._chunked_prefill(graphed, seqs, lens)
            elif self._hidden_mode == HIDDEN_ALL:  # [B, longest - 1, H]; row b valid up to lens[b] - 2
                h = hf.prefill(self.target, seqs[:, : longest - 1], cache, impl=self.attn_impl, all_hidden=True)
                hidden = [h[b, : lens[b] - 1] if lens[b] > 1 else None for b in range(batch)]
            else:
                at = torch.tensor([max(n - 2, 0) for n in lens]) if self._hidden_mode == HIDDEN_LAST else None
                h = hf.prefill(self.target, seqs[:, : longest - 1], cache, impl=self.attn_impl, hidden_at=at)
                if h is not None:  # [B, H]
                    hidden = [h[b, None] if lens[b] > 1 else None for b in range(batch)]
        cache.lengths = [n - 1 for n in lens]
        return hidden

    def _prefill_forward(self, cache: KVCache, batch: int) -> GraphedForward | None:
        """The fixed-shape ``[batch, prefill_width]`` prompt-prefill forward over ``cache`` (made on
        first use; its first run captures with ``cuda_graphs``), or None: prefill eagerly (dynamic
        shapes, a GPU without CUDA graphs, ``prefill_width`` off, or a cache of fewer slots than
        ``prefill_width``).

        It is a plain ``GraphedForward`` (chain trees are causal attention), never compiled: a
        compile per (batch size, bucket) would cost as much as the tree forward's for a forward
        run once or a few times per call. It keeps the logits of one node per sequence (nobody reads
        them) and, for drafters with ``needs_hidden_states``, the hidden states of all nodes.
        """
        width = self.prefill_width
        if not width or width > cache.capacity:
            return None
        key = (batch, cache.capacity)
        graphed = self._prefill_graphs.get(key)
        if graphed is None or graphed.cache is not cache:
            _log.info("specdec: new prompt-prefill forward [B=%d, n=%d] over a %d-slot cache (cuda_graphs=%s, "
                      "not compiled); SpecDecoder.warmup() builds these before timing", batch, width, cache.capacity,
                      self.cuda_graphs)  # fmt: skip
            graphed = self._prefill_graphs[key] = GraphedForward(
                self.target, cache, batch, width, impl=self.attn_impl, return_hidden=self._wants_hidden,
                capture=self.cuda_graphs, compile=False, logits_to_keep=0 if self._wants_hidden else 1,
            )  # fmt: skip
        return graphed

    def _chunked_prefill(self, graphed: GraphedForward, seqs: torch.Tensor,
                         lens: Sequence[int]) -> list[torch.Tensor | None]:  # fmt: skip
        """Prefill positions ``[0, lens[b] - 1)`` of every sequence as chain trees of at most
        W = ``graphed.n`` tokens through the fixed-shape forward ``graphed`` (KV only; lengths are
        left to the caller).

        Chunks: ``prefill_chunks(longest - 1, W, S)`` -- ``[0, W), [W, 2W), ...``, except that no
        chunk starts past ``S - W`` (see there: every load fits the cache). In the chunk
        ``[start, stop)``, sequence b with ``end_b = lens[b] - 1 > start`` gets the chain of its
        tokens ``[start, min(stop, end_b))`` loaded at prefix ``start``: node i has position and
        slot ``start + i`` and attends to slots ``[0, start)`` (written by the earlier chunks) and to
        nodes 0..i (its chain ancestors) -- exactly causal attention over the prompt. The padding
        nodes after a short chain (the forward always writes W slots) hang off the root: no chain
        node attends to them, and they write slots ``>= min(stop, end_b)``, i.e. past the tokens
        prefilled so far: slots of later chunks (rewritten there before anything reads them: every
        layer writes its new KV before attending) or past the prompt (scratch until decoding
        writes its trees there). A sequence with nothing left (``end_b <= start``, e.g. a one-token
        prompt) gets a one-node dummy tree (token 0) loaded at its final length ``end_b``: it
        writes slots ``[end_b, end_b + W)``, all past its prompt's KV (the first decoding tree
        overwrites them), and ``end_b <= start <= S - W`` keeps it inside the cache. So no chunk
        ever overwrites a committed slot, and each committed slot holds the KV a causal forward
        over the whole prompt would (up to rounding).

        Hidden states (drafters with ``needs_hidden_states``), copied (queued on the same stream)
        before the next chunk's forward overwrites the output buffer: ``"last"``: position
        ``lens[b] - 2`` lies in exactly one chunk, where it is node ``lens[b] - 2 - start`` of
        sequence b (``[1, H]``). ``"all"``: sequence b's chain nodes ``0 .. min(stop, end_b) -
        start - 1`` of every chunk are its positions ``start .. min(stop, end_b) - 1``, copied into
        one ``[end_b, H]`` tensor per sequence (the dummy trees' nodes are never read).

        Returns:
            Per sequence, as ``_prefill`` (None for one-token prompts or without hidden states).
        """
        batch, width, capacity = graphed.batch, graphed.n, graphed.cache.capacity
        ends = [n - 1 for n in lens]
        hidden: list[torch.Tensor | None] = [None] * batch
        dummy = TokenTree(torch.zeros(1, dtype=torch.int64), torch.tensor([-1]))
        for start, stop in prefill_chunks(max(ends), width, capacity):
            trees, prefix = [], []
            for b, end in enumerate(ends):
                if end > start:
                    trees.append(TokenTree.chain(seqs[b, start : min(stop, end)]))
                    prefix.append(start)
                else:
                    trees.append(dummy)
                    prefix.append(end)
            _, h = graphed.run(trees, prefix)  # h: [B, W, H] (the fixed output buffer) or None
            if self._hidden_mode == HIDDEN_LAST:
                for b, end in enumerate(ends):
                    if start <= end - 1 < stop:
                        hidden[b] = h[b, end - 1 - start : end - start].clone()
            elif self._hidden_mode == HIDDEN_ALL:
                for b, end in enumerate(ends):
                    if end > start:
                        if hidden[b] is None:
                            hidden[b] = h.new_empty(end, h.shape[-1])
                        got = min(stop, end)
                        hidden[b][start:got].copy_(h[b, : got - start])
        return hidden

    # ------------------------------------------------------------------ one step

    def _step(self, run: _Run) -> StepStats:
        """One step over the batch: draft -> tree forward -> verify -> accept and commit -> drafter update."""
        timer = _PhaseTimer(self._sync)
        with timer("draft"):
            trees, contexts = self._draft(run)
        with timer("verify"):
            if self.rank_sync is not None:  # every rank drafted the same trees (else all raise)
                self.rank_sync.check_trees(trees)
            forward = self._tree_forward(run.cache, trees, run.shared)
            with timer("forward"):
                logits, node_hidden = forward()
            verdicts = self._verify(run, trees, logits)
            if self.rank_sync is not None:  # the source rank decides for all
                verdicts = self.rank_sync.verdicts(verdicts, trees, run.generator, run.sampling is not None,
                                                   self.device)  # fmt: skip
        with timer("commit"):
            new_tokens, paths = self._accept(run, trees, verdicts, node_hidden)
            run.cache.commit(paths)  # nodes already in place (a first-child chain) are not copied
        if run.on_tokens is not None:
            for b, new in enumerate(new_tokens):
                if new:
                    run.on_tokens(b, new)
        with timer("draft"):
            if self.drafter is not None:
                for b, v in enumerate(verdicts):
                    if contexts[b] is not None:
                        self.drafter.update(contexts[b], trees[b], v)
        return StepStats(
            nodes_proposed=tuple(t.n - 1 for t in trees),
            tokens_accepted=tuple(0 if v is None else v.num_accepted for v in verdicts),
            tokens_emitted=tuple(len(new) for new in new_tokens),
            draft_s=timer.seconds["draft"],
            verify_s=timer.seconds["verify"],
            commit_s=timer.seconds["commit"],
            forward_s=timer.seconds["forward"],
        )

    def _chunking(self) -> bool:
        """Whether plain decoding runs in chunks: ``decode_chunk``, static shapes, no drafting, one process."""
        return bool(self.decode_chunk) and not self.tree_size and self.static_shapes and self.rank_sync is None

    def _chunk_for(self, run: _Run) -> DecodeChunk | None:
        """The ``DecodeChunk`` for this call's next steps (made on first use), or None: a step at a
        time (see ``decode_chunk``: not plain decoding with static shapes, or an unfinished
        sequence has fewer than ``decode_chunk`` tokens to go)."""
        if not self._chunking():
            return None
        left = min(len(run.prompts[b]) + run.max_new_tokens - run.lens[b] for b in range(len(run.lens)) if not run.done[b])
        if left < self.decode_chunk:
            return None
        return self._chunk(run.cache, len(run.lens), run.shared, run.sampling)

    def _chunk(self, cache: KVCache, batch: int, shared: KVCache | None,
               sampling: SamplingConfig | None = None) -> DecodeChunk:  # fmt: skip
        """The ``DecodeChunk`` over the ``[batch, 1]`` forward of ``cache`` (and ``shared``), greedy or
        ``sampling`` (one chunk, and so one CUDA graph, per configuration), made on first use."""
        key = (batch, cache.capacity, 0 if shared is None else shared.capacity, sampling)
        chunk = self._chunks.get(key)
        forward = self._graphed(cache, batch, 1, shared)
        if chunk is None or chunk.forward is not forward:
            chunk = self._chunks[key] = DecodeChunk(forward, self.decode_chunk, sampling)
        return chunk

    def _warm_chunk(self, cache: KVCache, batch: int, shared: KVCache | None = None,
                    sampling: SamplingConfig | None = None) -> float | None:  # fmt: skip
        """Plain decoding with chunks: run (and so capture) the greedy chunk over ``cache`` --
        prefilled, with room for it -- once, and the ``sampling`` one if given; the seconds of the
        captures this run made, else None."""
        if not self._chunking() or max(cache.lengths) + self.decode_chunk > cache.capacity:
            return None  # no chunks, or a cache this small never decodes one
        made = None
        for config in (None, sampling) if sampling is not None else (None,):
            chunk = self._chunk(cache, batch, shared, config)
            first = chunk.calls == 0
            # a generator of its own: warming up leaves torch's default random state alone
            generator = torch.Generator(device=chunk.tokens.device).manual_seed(0) if config is not None else None
            chunk.run([0] * batch, cache.lengths, generator)
            if first and chunk.capture_s is not None:
                made = (made or 0.0) + chunk.capture_s
        return made

    def _chunk_steps(self, run: _Run, chunk: DecodeChunk) -> list[StepStats]:
        """Run ``chunk`` once: each unfinished sequence appends its tokens up to an eos (``_append``'s
        rule; finished ones decode and are ignored); one ``StepStats`` per step, the chunk's time
        split evenly (a step emits one token per sequence still going at it)."""
        timer = _PhaseTimer(self._sync)
        batch, k = len(run.lens), chunk.steps
        with timer("verify"):
            with timer("forward"):
                ids = run.seqs.numpy()  # a view, for reading host ints
                tokens = chunk.run([int(ids[b, n - 1]) for b, n in enumerate(run.lens)], run.cache.lengths,
                                   run.generator)  # fmt: skip
            rows = tokens.tolist()
        appended: list[list[int]] = [[] for _ in range(batch)]
        with timer("commit"):
            for b, row in enumerate(rows):
                if not run.done[b]:
                    appended[b] = _append(run, b, row)
                    if appended[b] and max(appended[b]) >= self.vocab_size:  # a sampled row without mass
                        raise ValueError(f"logits: expected target distributions with positive mass, got none (NaN or "
                                         f"all -inf logits) for sequence {b}")  # fmt: skip
                    run.cache.lengths[b] += len(appended[b])  # slots of the root and new[:-1], written by the chunk
        if run.on_tokens is not None:
            for b, new in enumerate(appended):
                if new:
                    run.on_tokens(b, new)
        share = {phase: timer.seconds[phase] / k for phase in ("verify", "commit", "forward")}
        zeros = (0,) * batch
        return [StepStats(nodes_proposed=zeros, tokens_accepted=zeros,
                          tokens_emitted=tuple(int(j < len(new)) for new in appended), draft_s=0.0, verify_s=share["verify"],
                          commit_s=share["commit"], forward_s=share["forward"]) for j in range(k)]  # fmt: skip

    def _draft(self, run: _Run) -> tuple[list[TokenTree], list[DraftContext | None]]:
        """Per sequence, the drafter's tree (root-only when finished or without a drafter) and the
        context it was asked with (None when it was not asked)."""
        trees: list[TokenTree] = []
        contexts: list[DraftContext | None] = []
        for b, n in enumerate(run.lens):
            if run.done[b] or self.drafter is None or self.tree_size == 0:
                trees.append(TokenTree(run.seqs[b, n - 1 : n].clone(), _ROOT_PARENTS))
                contexts.append(None)
            else:
                trees.append(None)  # type: ignore[arg-type] -- the drafter's, below
                contexts.append(DraftContext(run.seqs[b, :n], self.tree_size, b, run.sampling, run.generator,
                                             run.hidden[b]))  # fmt: skip
        asked = [ctx for ctx in contexts if ctx is not None]
        ids = run.seqs.numpy()  # a view, for reading host ints
        for ctx, tree in zip(asked, propose_all(self.drafter, asked)):
            trees[ctx.seq] = self._checked_tree(tree, ctx, int(ids[ctx.seq, len(ctx.tokens) - 1]))
        return trees, contexts

    def _tree_forward(self, cache: KVCache, trees: list[TokenTree], shared: KVCache | None = None) -> _Forward:
        """The target's forward over the B trees as a call, its inputs prepared on the host.

        The call returns ``(logits [B, n, V], hidden [B, n, H] or None)``; node i of tree b is row
        ``[b, i]`` (rows past a tree's size are padding). n is ``tree_size + 1`` with static shapes
        (the fixed-shape forward of this batch size and cache, made on first use), else the
        largest tree's size. Node i's KV goes to slot ``cache.lengths[b] + i``. ``shared``: the
        prompt all B sequences share, ``shared.lengths[0]`` tokens: ``cache`` then holds what follows
        it, and positions are offset by its length (static shapes: the fixed-shape forward over both
        caches, ``GraphedForward(shared=)``; dynamic: ``hf.tree_forward(shared=)``).
        """
        batch = len(trees)
        n = self.tree_size + 1 if self.static_shapes else max(t.n for t in trees)
        cache.check_room(n)
        if self.static_shapes:
            graphed = self._graphed(cache, batch, n, shared)
            return lambda: graphed.run(trees, cache.lengths)  # padding nodes hang off the root
        tokens = torch.zeros(batch, n, dtype=torch.int64)
        parents = torch.zeros(batch, n, dtype=torch.int64)  # padding nodes hang off the root
        for b, t in enumerate(trees):
            tokens[b, : t.n] = t.tokens.cpu()
            parents[b, : t.n] = t.parents.cpu()
        parents[:, 0] = -1
        mask = TreeMask.from_parents(parents)
        prefix = torch.tensor(cache.lengths, dtype=torch.int64)
        kv_len = max(cache.lengths) + n

        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            out = hf.tree_forward(self.target, tokens, mask, prefix, cache, kv_len=kv_len, impl=self.attn_impl,
                                  return_hidden=self._wants_hidden, shared=shared)  # fmt: skip
            return out if self._wants_hidden else (out, None)

        return forward

    def _verify(self, run: _Run, trees: list[TokenTree], logits: torch.Tensor) -> list[Verdict | None]:
        """Per sequence, the accepted path and bonus token (None for finished sequences).

        Greedy: one argmax over the logits of the first m rows of every sequence (m: the largest
        tree's size) and one device-to-host copy of its ``[B, m]`` tokens, then ``greedy_verdict``
        per tree on the host (the trees were checked by ``_checked_tree``, or are root-only trees of
        committed tokens). Sampling: the target distributions of the same ``[B, m]`` rows, then
        ``verify_stochastic_batch``: the residuals and draws of every node on the device, one
        device-to-host copy for the batch, the walks on the host.
        """
        m = max(t.n for t in trees)
        if run.sampling is not None:
            probs = logits_to_probs(logits[:, :m], run.sampling)
            return verify_stochastic_batch([None if run.done[b] else t for b, t in enumerate(trees)], probs,
                                           run.generator)  # fmt: skip
        best = logits[:, :m].argmax(dim=-1).tolist()
        return [None if run.done[b] else greedy_verdict(t, best[b]) for b, t in enumerate(trees)]

    def _accept(self, run: _Run, trees: list[TokenTree], verdicts: list[Verdict | None],
                node_hidden: torch.Tensor | None) -> tuple[list[list[int]], list[tuple[int, ...] | None]]:  # fmt: skip
        """Append each verdict's tokens (cut at eos and max_new_tokens) to ``run``.

        With ``node_hidden`` (``[B, n, H]``, the forward's final hidden states), sets each
        sequence's next ``run.hidden`` to copies of its committed nodes' rows (the next forward
        overwrites ``node_hidden``): ``"all"``: ``[k, H]`` of the kept path's k nodes, whose last
        row predicted the last appended token (the next root); ``"last"``: that last row only.

        Returns:
            Per sequence, the tokens appended, and the tree nodes whose KV the cache keeps: the
            root and the accepted nodes whose tokens were kept (a path cut by max_new_tokens or
            eos commits only its kept part; the cache always holds a sequence's tokens but its
            last), None for finished sequences.
        """
        appended: list[list[int]] = []
        paths: list[tuple[int, ...] | None] = []
        for b, v in enumerate(verdicts):
            if v is None:
                appended.append([])
                paths.append(None)
                continue
            new = _append(run, b, v.new_tokens(trees[b]))
            kept = v.path[: len(new)]  # node kept[i] predicted new[i]
            appended.append(new)
            paths.append(kept)
            if node_hidden is not None:  # copies: the next forward overwrites node_hidden
                last = kept[-1]
                if self._hidden_mode == HIDDEN_LAST:
                    run.hidden[b] = node_hidden[b, last : last + 1].clone()
                elif last == len(kept) - 1:  # nodes 0 .. last (a first-child chain): a slice
                    run.hidden[b] = node_hidden[b, : last + 1].clone()
                else:
                    run.hidden[b] = node_hidden[b, list(kept)]  # advanced indexing copies
        return appended, paths

    def _graphed(self, cache: KVCache, batch: int, n: int, shared: KVCache | None = None) -> GraphedForward:
        """The fixed-buffer forward of shape ``[batch, n]`` over ``cache`` (and the shared prompt's
        cache ``shared``, if any: one forward per its capacity, whatever the prompt's length), made
        on first use; its first run captures / compiles."""
        if shared is None:
            key, kept = (batch, cache.capacity, n), self._graphs
        else:
            key, kept = (batch, cache.capacity, n, shared.capacity), self._shared_graphs
        graphed = kept.get(key)
        if graphed is None or graphed.cache is not cache or graphed.shared is not shared:
            _log.info("specdec: new target forward [B=%d, n=%d] over a %d-slot cache%s (cuda_graphs=%s, compile=%s); "
                      "SpecDecoder.warmup() builds these before timing", batch, n, cache.capacity,
                      "" if shared is None else f" and a {shared.capacity}-slot shared prompt",
                      self.cuda_graphs, self.compile)  # fmt: skip
            graphed = kept[key] = GraphedForward(
                self.target, cache, batch, n, impl=self.attn_impl, return_hidden=self._wants_hidden,
                capture=self.cuda_graphs, compile=self.compile, shared=shared,
            )  # fmt: skip
        return graphed

    # ------------------------------------------------------------------ warm-up

    @torch.no_grad()
    def warmup(
        self,
        batch_sizes: Sequence[int] = (1,),
        max_len: int | None = None,
        *,
        min_len: int | None = None,
        shared: bool | str = True,
        new_tokens: int | None = None,
        sampling: SamplingConfig | None = None,
        log: Callable[[str], None] | None = _stderr,
    ) -> WarmupReport:
        """Make every target forward that later ``generate`` calls will use, before timing them.

        For each batch size B and each capacity S a request of at most ``max_len`` tokens per
        sequence can get (every bucket of ``cache_buckets`` up to the one holding ``max_len +
        tree_size``: a shorter request gets a smaller one; ``max_cache_len`` when set) -- from the
        bucket holding ``min_len + tree_size`` when ``min_len`` is given:

        1. the kept KV cache ``[B, S]`` is made and a prefill of a 2-token dummy prompt per
           sequence allocates its buffers: with static shapes and ``S >= prefill_width``, through
           the fixed-shape ``[B, prefill_width]`` prompt-prefill forward, made and run once here
           (captured with ``cuda_graphs``; never compiled); else through the eager prefill path;
        2. the fixed-shape ``[B, tree_size + 1]`` tree forward over that cache is made and run
           once on dummy trees: compiled first with ``compile`` (inductor: tens of seconds per
           shape for a real model, seconds with a warm on-disk cache, see
           ``specdec.graphs.configure_compile_cache``), then captured with ``cuda_graphs``;
        3. for B > 1 with ``shared_prefix`` on (unless ``shared=False``; and a target the cascade
           serves over 2 S positions): the same for the rows of a shared prompt -- a 2-token dummy prompt is
           prefilled into the batch-1 cache of S slots (as step 1 for B = 1) and the fixed-shape
           tree forward over the ``[B, S]`` cache and that prompt cache (``shared_forwards``, one
           per prompt-cache capacity, whatever the prompt's length) is made and run once. Without
           ``new_tokens`` only the pairs whose prompt and rows get the same bucket are warmed (e.g.
           a 600-token prompt with 512 new tokens: both 1024 by default); a call whose prompt needs
           another bucket than its rows builds its forward on first use. With ``new_tokens`` = N
           (the calls to come pass ``max_new_tokens=N``), step 3 warms exactly the pairs those calls
           use instead: for each B > 1, the rows' capacity S (the one picked for ``1 + N +
           tree_size`` slots) with every prompt capacity C picked for ``P = prompt length - 1``
           tokens, the prompts' lengths running from ``min_len - N`` (None: 2) to ``max_len - N``
           (None: the target's context - N) -- one entry per (B, S, C) (``WarmupEntry.prompt_capacity``):
           the ``[B, S]`` rows' cache, the batch-1 prompt cache of C slots with a 2-token dummy
           prompt prefilled into it (through its ``[1, prefill_width]`` prefill forward when C >=
           ``prefill_width``, as step 1 for B = 1), and the tree forward over both. Pairs whose
           context (C + S) the cascade does not serve (``hf.shared_prefix_obstacle``) are skipped:
           those calls use the copy layout.

        ``[B, tree_size + 1]`` and the prefill's ``[B, prefill_width]`` are the only forward shapes
        ``generate`` runs with static shapes (steps whose trees are all root-only, e.g. plain
        decoding at ``tree_size=0``, run the former too; prompts of any length, the latter).
        The dummy KV is never read: every ``generate`` prefills its prompts from slot 0. Then, if
        the drafter has a ``warmup`` method, ``drafter.warmup(batch_sizes=..., max_len=..., log=...)``
        is called (e.g. to capture a draft model's forwards). A later ``generate`` within these
        batch sizes and ``max_len`` makes no new forward (no capture, no compile; for a shared
        prompt, see step 3). With dynamic shapes there are no fixed-shape forwards (and no kept
        caches without ``max_cache_len`` or ``cache_buckets``): the warm-up runs the prefill and one
        tree forward per (B, S), which compiles the kernels those use first, and, for B > 1 with
        ``shared_prefix`` on, one tree forward over a 1-token shared prompt (the cascade
        attention's first use). Without ``new_tokens`` the cache buckets warmed are those of the
        copy layout; a shared prompt's rows use the bucket of ``1 + max_new_tokens + tree_size``
        slots, one of them unless ``min_len`` skipped it (then that cache -- and with static shapes
        its forward -- is made by the call). With ``new_tokens``, step 3 warms the rows' bucket and
        every prompt bucket of the calls to come, so ``generate(num_return_sequences=B)`` of any
        prompt of ``min_len - new_tokens`` to ``max_len - new_tokens`` tokens makes nothing new
        (e.g. an evaluation drawing 16 samples per prompt: ``warmup(batch_sizes=(16,),
        max_len=longest + N, min_len=shortest + N, new_tokens=N, shared="only")``).

        Memory: every warmed cache stays allocated (see the class docstring), e.g. all six default
        buckets of Qwen2.5-1.5B in bf16 take 1.7 GiB per sequence of batch size.

        Warming only what the first request needs (time to first token): ``min_len = max_len =
        prompt + max_new_tokens`` of that request builds exactly the one bucket its ``generate``
        uses (each bucket costs a compile -- or, with a warm compile cache, a trace and cache load
        -- and a capture: ~15 s per bucket for Qwen2.5-1.5B compiled on an H100, PERF.md v4). The
        trade-off: a later request that needs another bucket (a longer one, or a shorter one whose
        smaller bucket was skipped) builds it on its first call, a stall of that size; warm the
        range the workload spans (``min_len`` None) before timing a run.

        Args:
            batch_sizes: the batch sizes (sequences per call: prompts x num_return_sequences) to come.
            max_len: the most tokens per sequence the calls to come reach (longest prompt +
                max_new_tokens); None: every bucket (up to the target's context).
            min_len: the fewest tokens per sequence the calls to come reach (shortest prompt +
                max_new_tokens): the buckets of shorter requests are skipped. None (default): from
                the smallest bucket. At most ``max_len`` when both are given.
            shared: also build, for each B > 1, the forward over a shared prompt (step 3: the calls
                to come include ``num_return_sequences = B`` of one prompt); False: skip it
                (batches of distinct prompts only: one forward, one capture / compile less per
                bucket). ``"only"`` (needs ``new_tokens``): every call of B > 1 sequences is
                ``num_return_sequences = B`` of one prompt, so only step 3 runs for them: no
                copy-layout ``[B, S]`` caches and forwards (which would take the memory the shared
                layout saves). Batch size 1 is warmed as always; with ``shared_prefix`` off, B > 1
                gets the copy layout as with True (what those calls will use).
            new_tokens: the ``max_new_tokens`` of the calls to come (the same for all of them, as in
                an evaluation); given, step 3 warms the (rows' capacity, prompt capacity) pairs of
                those calls with prompts from ``min_len - new_tokens`` to ``max_len - new_tokens``
                tokens (see above) instead of the equal-bucket pairs; must be < ``max_len``. None
                (default): step 3 as without it.
            sampling: the sampling configuration of the calls to come
                (``SamplingConfig(temperature, top_k, top_p)`` of ``generate(do_sample=True, ...)``):
                plain decoding in chunks (``decode_chunk``) also runs the sampled chunk of every
                warmed forward once, beside the greedy one (a sampled chunk records its
                configuration: without this, each cache pair's first sampled call captures its
                own, a ~1-s stall on an H100 for 16 rows of the 1.5B, PERF.md v21). None (default):
                the greedy chunks only.
            log: called with progress messages (default: print to stderr); None: silent.

        Returns:
            ``WarmupReport``: per (B, S), the seconds of its prefill, compile (``first_run_s``) and
            capture, and of the prefill forward's first run and capture.
        """
        if isinstance(batch_sizes, int) or not isinstance(batch_sizes, Sequence) or not batch_sizes or any(
                not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes):  # fmt: skip
            raise ValueError(f"batch_sizes: expected a non-empty sequence of ints >= 1, got {batch_sizes!r}")
        if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 2):
            raise ValueError(f"max_len: expected None or an int >= 2 (prompt + max_new_tokens), got {max_len!r}")
        if min_len is not None and (not isinstance(min_len, int) or isinstance(min_len, bool) or min_len < 2):
            raise ValueError(f"min_len: expected None or an int >= 2 (prompt + max_new_tokens), got {min_len!r}")
        if min_len is not None and max_len is not None and min_len > max_len:
            raise ValueError(f"min_len: expected at most max_len = {max_len}, got {min_len}")
        limit = hf.max_positions(self.target)
        if max_len is not None and limit is not None and max_len > limit:
            raise ValueError(f"max_len: expected at most the target's context of {limit} positions, got {max_len}")
        if not isinstance(shared, bool) and not (isinstance(shared, str) and shared == "only"):
            raise ValueError(f"shared: expected True, False or 'only', got {shared!r}")
        if new_tokens is not None and (not isinstance(new_tokens, int) or isinstance(new_tokens, bool)
                                       or new_tokens < 1):  # fmt: skip
            raise ValueError(f"new_tokens: expected None or an int >= 1 (the calls' max_new_tokens), got {new_tokens!r}")
        if new_tokens is not None and max_len is not None and new_tokens >= max_len:
            raise ValueError(f"new_tokens: expected less than max_len = {max_len} (prompts of at least one token), "
                             f"got {new_tokens}")  # fmt: skip
        if shared == "only" and new_tokens is None:
            raise ValueError("shared: 'only' needs new_tokens (the calls' max_new_tokens, which sizes the rows' cache)")
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling: expected None or a specdec.SamplingConfig, got {type(sampling).__name__}")
        if log is not None and not callable(log):
            raise ValueError(f"log: expected a callable or None, got {type(log).__name__}")
        say = log or (lambda message: None)
        capacities = self._warm_capacities(max_len, min_len)
        batch_sizes = sorted(set(batch_sizes))
        # step 3 with new_tokens: the rows' capacity and the prompt capacities of the calls to come
        rows_cap, prompt_caps = None, []
        if new_tokens is not None and shared and self.shared_prefix and any(b > 1 for b in batch_sizes):
            rows_cap, prompt_caps = self._warm_shared_capacities(max_len, min_len, new_tokens)
        n = self.tree_size + 1
        cache_dir = None
        if uses_inductor(self.compile):
            cache_dir = configure_compile_cache()
        how = [f"torch.compile ({'layers' if self.compile is True else self.compile})"] if self.compile else []
        how += ["CUDA graphs"] if self.cuda_graphs else (["fixed shapes, eager"] if self.static_shapes else ["eager"])
        say(f"specdec warmup: target forwards [B, {n}] for B in {batch_sizes} over caches of {capacities} slots "
            f"({', '.join(how)}){f'; compile cache {cache_dir}' if cache_dir else ''}")  # fmt: skip
        width = self.prefill_width
        if width and any(c >= width for c in capacities):
            say(f"specdec warmup: prompt prefill in chunks of {width} tokens, forwards [B, {width}] "
                f"({'CUDA graphs' if self.cuda_graphs else 'fixed shapes, eager'}, not compiled) for caches of "
                f">= {width} slots")  # fmt: skip
        if prompt_caps:
            say(f"specdec warmup: shared prompts: rows of {rows_cap} slots ({new_tokens} new tokens) over prompt "
                f"caches of {prompt_caps} slots")  # fmt: skip
        start = time.perf_counter()
        entries = []
        for batch in batch_sizes:
            # shared="only": every call of B > 1 sequences shares its prompt: no copy-layout caches
            copies = batch == 1 or shared != "only" or not self.shared_prefix
            for capacity in capacities if copies else ():
                say(f"  B={batch} S={capacity} n={n} ...")
                entry = self._warm_one(batch, capacity, n, bool(shared) and new_tokens is None, sampling)
                entries.append(entry)
                parts = [f"{entry.seconds:.1f} s"]
                if entry.first_run_s is not None and self.compile:
                    parts.append(f"compile {entry.first_run_s:.1f} s")
                if entry.capture_s is not None:
                    split = ("" if entry.capture_warmup_s is None else
                             f" (warm-up forwards {entry.capture_warmup_s:.1f}, "
                             f"recording {entry.capture_s - entry.capture_warmup_s:.1f})")  # fmt: skip
                    parts.append(f"capture {entry.capture_s:.1f} s{split}")
                if entry.prefill_capture_s is not None:
                    parts.append(f"prefill capture {entry.prefill_capture_s:.1f} s")
                if entry.shared_capture_s is not None:
                    parts.append(f"shared-prompt forward capture {entry.shared_capture_s:.1f} s")
                if entry.chunk_capture_s is not None:
                    parts.append(f"decode-chunk capture {entry.chunk_capture_s:.1f} s")
                if self.static_shapes and not entry.built:
                    parts.append("already built")
                say(f"  B={batch} S={capacity} n={n}: {', '.join(parts)}")
            for prompt_cap in prompt_caps if batch > 1 else ():
                say(f"  B={batch} S={rows_cap} n={n} shared prompt C={prompt_cap} ...")
                entry = self._warm_shared(batch, rows_cap, n, prompt_cap, sampling)
                entries.append(entry)
                parts = [f"{entry.seconds:.1f} s"]
                if entry.shared_first_run_s is not None and self.compile:
                    parts.append(f"compile {entry.shared_first_run_s:.1f} s")
                if entry.shared_capture_s is not None:
                    parts.append(f"capture {entry.shared_capture_s:.1f} s")
                if entry.prefill_capture_s is not None:
                    parts.append(f"prompt prefill capture {entry.prefill_capture_s:.1f} s")
                if self.static_shapes and not entry.shared_built:
                    parts.append("already built")
                say(f"  B={batch} S={rows_cap} n={n} shared prompt C={prompt_cap}: {', '.join(parts)}")
        drafter_s = 0.0
        drafter_warmup = getattr(self.drafter, "warmup", None)
        if callable(drafter_warmup):
            say(f"specdec warmup: the drafter ({type(self.drafter).__name__})")
            t0 = time.perf_counter()
            drafter_warmup(batch_sizes=tuple(batch_sizes), max_len=max_len, log=log)
            self._sync()
            drafter_s = time.perf_counter() - t0
        total = time.perf_counter() - start
        say(f"specdec warmup: done in {total:.1f} s")
        return WarmupReport(tuple(entries), drafter_s, total, cache_dir)

    def _warm_capacities(self, max_len: int | None, min_len: int | None = None) -> list[int]:
        """The cache capacities requests of ``min_len`` (None: any) to ``max_len`` (None: any) tokens
        per sequence can get: the same rule as ``generate``'s (``_capacity`` of the tokens + tree_size)."""
        if max_len is None:
            if self.max_cache_len is not None:
                return [self.max_cache_len]
            if self.cache_buckets is None:
                return [self.tree_size + 2 if min_len is None else min_len + self.tree_size]
            caps = list(self.cache_buckets)
        else:
            top = self._capacity(max_len + self.tree_size, "max_len", "max_len + tree_size")
            if self.cache_buckets is None:
                return [top]
            caps = [c for c in self.cache_buckets if c <= top]
        if min_len is not None:
            low = self._capacity(min_len + self.tree_size, "min_len", "min_len + tree_size")
            caps = [c for c in caps if c >= low]
        return caps

    def _warm_shared_capacities(self, max_len: int | None, min_len: int | None,
                                new_tokens: int) -> tuple[int, list[int]]:  # fmt: skip
        """``(S, [C, ...])`` of calls with ``max_new_tokens = new_tokens`` over one shared prompt of
        ``min_len - new_tokens`` (None: 2) to ``max_len - new_tokens`` (None: up to the target's context)
        tokens: the rows' capacity and every prompt capacity, by ``generate``'s rule
        (``_shared_capacities``); prompt capacities whose pair the cascade does not serve are left out."""
        rows_cap = self._capacity(1 + new_tokens + self.tree_size, "new_tokens",
                                  "1 + new_tokens + tree_size (a shared prompt's rows)")  # fmt: skip
        what = "the shared prompt but its last token"
        low = 1 if min_len is None else max(min_len - new_tokens - 1, 1)  # P = prompt length - 1
        if max_len is not None:
            high = max_len - new_tokens - 1
            if high < 1:  # one-token prompts only: nothing to share
                return rows_cap, []
            top = self._capacity(high, "max_len", what)
        else:
            limit = hf.max_positions(self.target)
            high = None if limit is None else max(limit - new_tokens - 1, 1)
            top = None
        if self.max_cache_len is not None:
            caps = [self.max_cache_len]
        elif self.cache_buckets is None:  # exact sizes (nothing kept): one prompt of the longest length
            caps = [top if top is not None else (high or low)]
        else:
            least = self._capacity(low, "min_len", what)
            caps = [c for c in self.cache_buckets if c >= least and (top is None or c <= top)]
        served = [c for c in caps if hf.shared_prefix_obstacle(self.target, c + rows_cap) is None]
        if len(served) < len(caps):
            _log.info("specdec warmup: no shared-prompt forward over prompt caches of %s slots: the cascade does not "
                      "serve their context (those calls keep a copy of the prompt per sequence)",
                      sorted(set(caps) - set(served)))  # fmt: skip
        return rows_cap, served

    def _warm_shared(self, batch: int, rows_cap: int, n: int, prompt_cap: int,
                     sampling: SamplingConfig | None = None) -> WarmupEntry:  # fmt: skip
        """Step 3 of ``warmup`` for one pair: a 2-token dummy prompt prefilled into the batch-1 cache of
        ``prompt_cap`` slots (through its prefill forward, if any), then the tree forward of ``batch``
        rows of ``rows_cap`` slots over it run once (made and compiled / captured here if new)."""
        shared_key = (batch, rows_cap, n, prompt_cap)
        existing_shared = self._shared_graphs.get(shared_key)
        existing_prefill = self._prefill_graphs.get((1, prompt_cap))
        timer = _PhaseTimer(self._sync)
        self._sync()
        with timer("all"):
            rows = self._cache_for(batch, rows_cap)
            with timer("prefill"):
                prompt_cache, _ = self._prefill_shared(torch.zeros(2, dtype=torch.int64), batch, prompt_cap)
                rows.allocate_like(prompt_cache)  # as generate does: buffers before the first forward
            chain = TokenTree.chain(torch.zeros(n, dtype=torch.int64))
            self._tree_forward(rows, [chain] * batch, prompt_cache)()
            chunk_s = self._warm_chunk(rows, batch, prompt_cache, sampling)
            rows.reset()
            prompt_cache.reset()
        over_shared = self._shared_graphs.get(shared_key)  # None with dynamic shapes
        shared_first = over_shared is not None and over_shared.calls == 1
        pre = self._prefill_graphs.get((1, prompt_cap))  # None: the prompt is prefilled eagerly
        pre_first = pre is not None and pre.calls == 1
        return WarmupEntry(batch, rows_cap, n, timer.seconds["all"], timer.seconds["prefill"], None, None,
                           built=False, prefill_n=None if pre is None else pre.n,
                           prefill_first_run_s=pre.first_run_s if pre_first else None,
                           prefill_capture_s=pre.capture_s if pre_first else None,
                           prefill_built=pre is not None and pre is not existing_prefill,
                           shared_built=over_shared is not None and over_shared is not existing_shared,
                           shared_first_run_s=over_shared.first_run_s if shared_first else None,
                           shared_capture_s=over_shared.capture_s if shared_first else None,
                           prompt_capacity=prompt_cap, chunk_capture_s=chunk_s)  # fmt: skip

    def _warm_one(self, batch: int, capacity: int, n: int, shared: bool = True,
                  sampling: SamplingConfig | None = None) -> WarmupEntry:  # fmt: skip
        """Prefill a dummy prompt into the ``[batch, capacity]`` cache (through its prefill forward, if
        any) and run its tree forward once; with ``shared``, for batch > 1 and ``shared_prefix``, also
        the tree forward over a dummy prompt shared through the batch-1 cache of ``capacity`` slots."""
        key = (batch, capacity, n)
        existing = self._graphs.get(key)
        existing_prefill = self._prefill_graphs.get((batch, capacity))
        timer = _PhaseTimer(self._sync)
        self._sync()
        with timer("all"):
            cache = self._cache_for(batch, capacity)
            with timer("prefill"):
                self._prefill(cache, torch.zeros(batch, 2, dtype=torch.int64), [2] * batch)
            chain = TokenTree.chain(torch.zeros(n, dtype=torch.int64))
            self._tree_forward(cache, [chain] * batch)()
            chunk_s = self._warm_chunk(cache, batch, None, sampling)
            cache.reset()
            over_shared = None  # the shared-prompt forward's entry, if warmed here
            context = 2 * capacity if self.static_shapes else capacity + 1  # what the call's obstacle check sees
            if shared and self.shared_prefix and batch > 1 and hf.shared_prefix_obstacle(self.target, context) is None:
                over_shared = self._warm_shared(batch, capacity, n, capacity, sampling)
        graphed = self._graphs.get(key)  # None with dynamic shapes
        first = graphed is not None and graphed.calls == 1  # this was its first run: timings are ours
        pre = self._prefill_graphs.get((batch, capacity))  # None: an eager prefill
        pre_first = pre is not None and pre.calls == 1
        return WarmupEntry(batch, capacity, n, timer.seconds["all"], timer.seconds["prefill"],
                           graphed.first_run_s if first else None, graphed.capture_s if first else None,
                           built=graphed is not None and graphed is not existing,
                           prefill_n=None if pre is None else pre.n,
                           prefill_first_run_s=pre.first_run_s if pre_first else None,
                           prefill_capture_s=pre.capture_s if pre_first else None,
                           prefill_built=pre is not None and pre is not existing_prefill,
                           capture_warmup_s=graphed.capture_warmup_s if first else None,
                           shared_built=over_shared is not None and over_shared.shared_built,
                           shared_first_run_s=None if over_shared is None else over_shared.shared_first_run_s,
                           shared_capture_s=None if over_shared is None else over_shared.shared_capture_s,
                           chunk_capture_s=chunk_s)  # fmt: skip

    # ------------------------------------------------------------------ checks

    def _checked_tree(self, tree, ctx: DraftContext, last: int) -> TokenTree:
        """The drafter's tree, checked against what the forward and the verification assume (the
        tree's own structure was checked when it was made); ``last``: the last committed token."""
        if not isinstance(tree, TokenTree):
            raise ValueError(f"drafter: propose() must return a specdec.TokenTree, got {type(tree).__name__}")
        if tree.n - 1 > ctx.tree_size:
            raise ValueError(f"drafter: expected at most tree_size = {ctx.tree_size} nodes besides the root, got {tree.n - 1}")
        root = tree.token_list[0]
        if root != last:
            raise ValueError(f"drafter: expected the tree's root token to be the last committed token {last}, got {root}")
        top = max(tree.token_list)
        if top >= self.vocab_size:
            raise ValueError(f"drafter: expected token ids < V = {self.vocab_size} (the target's vocabulary), got {top}")
        if ctx.sampling is not None and tree.proposal != "topk":
            if tree.draft_probs is None:
                raise ValueError(f"drafter: a {tree.proposal!r} tree needs draft_probs for stochastic verification")
            if tree.draft_probs.shape[1] != self.vocab_size:
                raise ValueError(f"drafter: expected draft_probs over the target's vocabulary V = {self.vocab_size}, "
                                 f"got {tree.draft_probs.shape[1]}")  # fmt: skip
        return tree

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class SpeculativeModel:
    """A model whose ``generate`` is speculative; every other attribute is the wrapped model's."""

    def __init__(self, model, drafter: Drafter | None, tree_size: int = 64, **decoder_kwargs) -> None:
        self.decoder = SpecDecoder(model, drafter, tree_size, **decoder_kwargs)
        self.model = model

    def __getattr__(self, name):
        return getattr(self.__dict__["model"], name)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def warmup(self, batch_sizes: Sequence[int] = (1,), max_len: int | None = None, **kwargs) -> WarmupReport:
        """``SpecDecoder.warmup``: build every forward later ``generate`` calls use, before timing."""
        return self.decoder.warmup(batch_sizes, max_len, **kwargs)

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 20,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
        attention_mask: torch.Tensor | None = None,
        pad_token_id: int | None = None,
        return_output: bool = False,
        num_return_sequences: int | None = None,
    ):
        """Like ``model.generate``; unset sampling / eos arguments come from ``model.generation_config``.

        Returns ``sequences`` (int64 ``[B * num_return_sequences, T]``, prompts without padding,
        right-padded), or the full ``GenerationOutput`` with ``return_output=True``.
        """
        gc = getattr(self.model, "generation_config", None)

        def pick(val, attr, default):
            if val is not None:
                return val
            got = getattr(gc, attr, None) if gc is not None else None
            return default if got is None else got

        out = self.decoder.generate(
            input_ids,
            max_new_tokens,
            do_sample=bool(pick(do_sample, "do_sample", False)),
            temperature=float(pick(temperature, "temperature", 1.0)),
            top_k=int(pick(top_k, "top_k", 0)),
            top_p=float(pick(top_p, "top_p", 1.0)),
            eos_token_id=pick(eos_token_id, "eos_token_id", None),
            generator=generator,
            attention_mask=attention_mask,
            pad_token_id=pick(pad_token_id, "pad_token_id", None),
            num_return_sequences=int(pick(num_return_sequences, "num_return_sequences", 1)),
        )
        return out if return_output else out.sequences


def wrap(model, drafter: Drafter | None, tree_size: int = 64, **decoder_kwargs) -> SpeculativeModel:
    """``specdec.wrap(model, drafter).generate(input_ids, max_new_tokens=...)`` decodes speculatively.

    ``decoder_kwargs`` go to ``SpecDecoder`` (``max_cache_len``, ``cache_buckets``, ``static_shapes``,
    ``attn_impl``, ``cuda_graphs``, ``compile``, ``prefill_width``, ``rank_sync``, ``shared_prefix``).
    """
    return SpeculativeModel(model, drafter, tree_size, **decoder_kwargs)


def _checked_buckets(buckets, least: int) -> tuple[int, ...]:
    """``cache_buckets`` sorted, or ValueError unless it is a non-empty sequence of ints >= least."""
    ok = isinstance(buckets, Sequence) and not isinstance(buckets, str) and len(buckets) > 0 and all(
        isinstance(b, int) and not isinstance(b, bool) and b >= least for b in buckets)  # fmt: skip
    if not ok:
        raise ValueError(
            f"cache_buckets: expected a non-empty sequence of ints >= {least} (tree_size + 2), got {buckets!r}"
        )
    return tuple(sorted(set(buckets)))
