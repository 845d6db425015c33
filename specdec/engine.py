"""The speculative decoder: ``SpecDecoder(target, drafter, tree_size)`` and ``wrap(model, drafter)``.

Per call: prefill the prompts (``specdec.prefill``), then per step draft -> one tree forward ->
verify -> accept and commit (``specdec.decode``) until every sequence ends. ``drafter=None`` (or
``tree_size=0``) is plain autoregressive decoding through the same path: the baseline that matches
``model.generate``; ``tree_size="auto"`` picks every step's node budget (``specdec.budget``). The decoder keeps its KV caches and fixed-shape forwards per (batch size,
capacity) (``specdec.capacity``) and builds them ahead with ``warmup`` (``specdec.warmup``). The
results are ``specdec.outputs``. docs/ENGINE.md tells the design: shapes, buckets, the chunked
prefill, the shared prompt, decode chunks and what each costs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch

from specdec import hf
from specdec.budget import AUTO, DEFAULT_MAX_TREE_SIZE, BudgetConfig, BudgetPolicy
from specdec.capacity import MIN_CACHE_BUCKET, CacheCapacity, checked_buckets, default_cache_buckets
from specdec.decode import DecodeLoop, Run
from specdec.distributed import RankSync
from specdec.drafting import Drafter, feature_layers_request, hidden_states_request
from specdec.decode_chunk import DecodeChunk
from specdec.graphs import DEFAULT_PREFILL_WIDTH, GraphedForward, replay_modes
from specdec.kv import KVCache
from specdec.outputs import GenerationOutput, StepStats, WarmupEntry, WarmupReport
from specdec.prefill import Prefill
from specdec.sampling import SamplingConfig
from specdec.timing import PhaseTimer
from specdec.warmup import Warmup

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

_log = logging.getLogger(__name__)


class SpecDecoder(Warmup, DecodeLoop, Prefill, CacheCapacity):
    """Speculative decoding of a HuggingFace causal LM with token trees.

    Args:
        target: the target causal LM (any dtype, CPU / CUDA / ``device_map="auto"``); its attention
            is routed through specdec's function (``hf.prepare_model``), which leaves its ordinary
            forward / generate unchanged.
        drafter: a ``specdec.drafting.Drafter``, or None for plain decoding.
        tree_size: node budget per step besides the root (0 = plain decoding), or ``"auto"``: each
            step picks its budget from ``budget``'s candidates (0, 4, 8, ... ``max_tree_size``: each a
            fixed-shape forward the warm-up builds and times) as the one of the most expected tokens
            per second from measured costs and the call's acceptance so far (``specdec.budget``;
            ``GenerationOutput.budget`` tells what it chose). Budget 0 is plain decoding without a
            drafter call. Needs a single-process target (no ``rank_sync``).
        max_tree_size: with ``tree_size="auto"``, the largest budget (default
            ``specdec.budget.DEFAULT_MAX_TREE_SIZE`` = 64); the caches are sized for it. None otherwise.
        budget: with ``tree_size="auto"``, a ``specdec.budget.BudgetConfig`` (candidate budgets,
            probing, the acceptance prior, fixed costs); None: the defaults. None otherwise.
        max_cache_len: one fixed KV capacity per sequence, chosen up front and reused across calls
            (a request that does not fit raises); None: ``cache_buckets`` with static shapes, else a
            cache of exactly prompt + max_new_tokens + tree_size slots per call.
        cache_buckets: the KV capacities (slots per sequence, each >= tree_size + 2) a request may
            get when ``max_cache_len`` is None: the smallest that holds it (one that fits none
            raises). Default None: ``default_cache_buckets(target's context, tree_size)`` with
            static shapes, no buckets with dynamic shapes. One cache per (batch size, bucket) used
            is kept with its forwards (``caches``, ``release``).
        static_shapes: fixed ``[B, tree_size + 1]`` tree forwards over the whole cache through
            ``specdec.graphs.GraphedForward`` (default: True when the target is on CUDA, or when
            ``cuda_graphs`` is True); False: trees padded to the batch's largest, attention over the
            filled part of the cache (cheaper on CPU).
        attn_impl: ``treeattn.tree_attention``'s ``impl`` ("auto", "triton", "torch").
        cuda_graphs: replay the target's tree forward as a CUDA graph, captured once per (batch
            size, cache) (default None: on when the target is on one CUDA device and shapes are
            static, unless the environment sets ``SPECDEC_CUDA_GRAPHS=0``; False on CPU). Needs
            static shapes.
        compile: run the fixed-shape tree forward through ``torch.compile`` before it is captured
            (needs static shapes). True or ``"layers"`` (``"layers:BACKEND"``): each decoder layer
            through one forward compiled for all layers of its kind (``hf.compile_layers``);
            ``"inductor"``: the whole forward compiled as one; ``"max-autotune"``: the whole forward,
            inductor timing GEMM templates per matmul shape; or another backend name. The first
            forward of each (batch size, cache capacity) compiles; inductor's on-disk cache
            (``specdec.graphs.configure_compile_cache``) makes later processes faster. Default False
            (a compile costs a first call far more than it saves a one-off ``generate``;
            docs/ENGINE.md). The prompt-prefill forward is compiled only with ``compile_prefill``.
        prefill_width: with static shapes, prompt tokens per chunk of the fixed-shape prompt
            prefill (default ``DEFAULT_PREFILL_WIDTH`` = 256): ``ceil(longest prompt /
            prefill_width)`` (at most one more near a full cache) chain-shaped trees through one
            ``[B, prefill_width]`` ``GraphedForward`` per (batch size, cache); caches of fewer
            slots prefill eagerly. 0 or None: always the eager prefill (one HF forward with SDPA).
            Ignored (the attribute is 0) with dynamic shapes and on a GPU without CUDA graphs.
        compile_prefill: with ``compile`` and ``prefill_width``, the prefill's chunk forwards through
            the same compile (one more compile per batch size and cache bucket, made by ``warmup``).
            Default False: the uncompiled, captured chunks cost ~4.4 ms each at the 1.5B's shapes,
            launch-bound (a tenth of APPS's EAGLE time, specdec/PERF.md v36); what compiling them
            saves is to be measured.
        rank_sync: a ``specdec.distributed.RankSync`` for a tensor-parallel target (one decoder per
            rank, all called alike): the ranks check that they got the same prompts and drafted the
            same trees, and adopt rank 0's verification decision (and, when sampling, its random
            generator state) every step. None (default): ``RankSync.for_model(target)``.
        shared_prefix: how ``generate(num_return_sequences=n)`` with n > 1 and ONE prompt (of at
            least 2 tokens) stores that prompt. True: its KV once, shared by the n sequences through
            the cascade attention; needs a target the cascade serves (``hf.shared_prefix_obstacle``:
            no soft-capped attention, no sliding window shorter than the call's context), else
            ValueError. False: each row holds its own copy of the prompt's KV. None (default): the
            shared layout where True would give it, the copy layout where True would raise. Calls
            with several prompts always use the copy layout.
        decode_chunk: plain decoding (no drafter, ``tree_size=0``, or steps at budget 0 with
            ``tree_size="auto"``; a drafter that reads hidden states gets each step's rows) with
            static shapes runs this many steps per ``specdec.decode_chunk.DecodeChunk`` (default ``DEFAULT_DECODE_CHUNK`` =
            8): one replay and one device-to-host copy per chunk instead of a host round trip per
            token, while every unfinished sequence has at least that many tokens to go. Greedy: the
            same tokens as one step at a time; sampling: draws from the same distributions with
            other random numbers. 0: one step per forward. Ignored with dynamic shapes. A
            tensor-parallel target's ranks compare one token fingerprint per chunk.
        profile: end every timed phase of a step (``StepStats``: draft, verify, forward, commit;
            ``GenerationOutput.prefill_s``) with a device synchronize, so each phase holds the
            device work it queued. Default False: the phases are host wall time and ``generate``
            never synchronizes the device for timing.

    Kept state and memory: with static shapes, ``max_cache_len`` or ``cache_buckets`` the decoder
    keeps one ``KVCache`` per (batch size, capacity) it has used (``caches``), and with static shapes
    its forwards: one tree forward per cache (``forwards``; with ``cuda_graphs`` its graph and the
    graph's private memory pool), one prompt-prefill forward (``prefill_forwards``) and, for shared
    prompts, one forward per (n, rows' capacity, tree_size + 1, prompt capacity)
    (``shared_forwards``). A cache holds ``2 * layers * B * kv_heads * S * head_dim`` elements of the
    model's dtype once written (``KVCache.nbytes``). ``release()`` drops them; ``warmup()`` builds
    them ahead of time. docs/ENGINE.md gives sizes for a real model.
    """

    def __init__(
        self,
        target,
        drafter: Drafter | None = None,
        tree_size: int | str = 64,
        *,
        max_tree_size: int | None = None,
        budget: BudgetConfig | None = None,
        max_cache_len: int | None = None,
        cache_buckets: Sequence[int] | None = None,
        static_shapes: bool | None = None,
        attn_impl: str = "auto",
        cuda_graphs: bool | None = None,
        compile: bool | str = False,
        prefill_width: int | None = DEFAULT_PREFILL_WIDTH,
        compile_prefill: bool = False,
        rank_sync: RankSync | None = None,
        shared_prefix: bool | None = None,
        decode_chunk: int = DEFAULT_DECODE_CHUNK,
        profile: bool = False,
    ) -> None:
        hf.prepare_model(target, "target")
        auto = isinstance(tree_size, str) and tree_size == AUTO
        if not auto and (not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0):
            raise ValueError(f"tree_size: expected an int >= 0 or {AUTO!r}, got {tree_size!r}")
        if not auto and max_tree_size is not None:
            raise ValueError(f"max_tree_size: expected None unless tree_size is {AUTO!r}, got {max_tree_size!r}")
        if not auto and budget is not None:
            raise ValueError(f"budget: expected None unless tree_size is {AUTO!r}, got {budget!r}")
        if budget is not None and not isinstance(budget, BudgetConfig):
            raise ValueError(f"budget: expected None or a specdec.budget.BudgetConfig, got {type(budget).__name__}")
        if auto:
            budget = budget or BudgetConfig()
            max_tree_size = DEFAULT_MAX_TREE_SIZE if max_tree_size is None else max_tree_size
            if not isinstance(max_tree_size, int) or isinstance(max_tree_size, bool) or max_tree_size < 1:
                raise ValueError(f"max_tree_size: expected None or an int >= 1, got {max_tree_size!r}")
            budgets = budget.candidates(max_tree_size)  # ValueError for a bad max_tree_size / budgets
        if attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {attn_impl!r}")
        if not isinstance(compile_prefill, bool):
            raise ValueError(f"compile_prefill: expected True or False, got {compile_prefill!r}")
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
        if not isinstance(profile, bool):
            raise ValueError(f"profile: expected True or False, got {profile!r}")
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
        #: the node budget per step, or with ``tree_size="auto"`` the largest one (0 without a drafter)
        self.tree_size: int = (max_tree_size if auto else tree_size) if drafter is not None else 0
        #: picks each step's budget (``tree_size="auto"`` with a drafter), else None: always ``tree_size``
        self.budget: BudgetPolicy | None = None
        if auto and drafter is not None:
            self.budget = BudgetPolicy(budget, budgets)
        #: the budgets steps may run at: each a fixed-shape forward ``[B, budget + 1]`` with static shapes
        self.tree_budgets: tuple[int, ...] = (self.tree_size,) if self.budget is None else self.budget.budgets
        # Drafters that read the target's hidden states (Medusa, EAGLE heads) get them in DraftContext.hidden:
        # None, HIDDEN_LAST (the one that predicted the root) or HIDDEN_ALL (every committed token's, once).
        request = hidden_states_request(drafter)
        self._hidden_mode: str | None = request if self.tree_size > 0 else None
        self._wants_hidden = self._hidden_mode is not None
        # ... the final hidden states, or the outputs of the decoder layers the drafter names (hf.layers_at)
        layers = feature_layers_request(drafter, hf.num_layers(target))
        self._feature_layers = hf.layers_at(target, layers, "drafter") if layers and self._wants_hidden else None
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
        #: the prefill's chunk forwards compiled (as the tree forwards are: ``compile``)
        self.compile_prefill = compile_prefill and bool(self.compile)
        #: the capacities requests pick from (increasing), or None (max_cache_len, or exact sizes)
        self.cache_buckets: tuple[int, ...] | None = None
        if cache_buckets is not None:
            self.cache_buckets = checked_buckets(cache_buckets, self.tree_size + 2)
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
        if self.budget is not None and self.rank_sync is not None:  # each rank would time and choose its own
            raise ValueError(f"tree_size: {AUTO!r} needs a single-process target, got a tensor-parallel one "
                             f"(rank_sync); pass an int")  # fmt: skip
        if shared_prefix is not None and not isinstance(shared_prefix, bool):
            raise ValueError(f"shared_prefix: expected None, True or False, got {shared_prefix!r}")
        obstacle = hf.shared_prefix_obstacle(target, 0)  # what rules it out whatever the context
        if shared_prefix and obstacle is not None:
            raise ValueError(f"shared_prefix: True needs a target the cascade attention serves, got one with "
                             f"{obstacle}")
        #: n > 1 sequences of one prompt keep its KV once (docs/ENGINE.md), where the call allows it.
        self.shared_prefix: bool = (obstacle is None) if shared_prefix is None else shared_prefix
        self._shared_required = shared_prefix is True  # a call the cascade cannot serve raises
        #: synchronize the device at the end of every timed phase of ``generate`` (see the argument)
        self.profile: bool = profile

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
        """Drop the kept caches and their forwards (tree and prefill forwards, plain decoding's chunks,
        their CUDA graphs):
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
        # plain decoding's chunks hold CUDA graphs of their own (with a tensor-parallel target, of NCCL
        # collectives: NCCL cannot destroy a communicator while a graph that captured it lives)
        self._chunks = {key: chunk for key, chunk in self._chunks.items() if kept(key)}

    # ------------------------------------------------------------------ the caches and forwards it makes

    def _cache_for(self, batch: int, capacity: int) -> KVCache:
        """The (emptied) cache of ``batch`` sequences and ``capacity`` slots: the kept one, if kept."""
        if self.max_cache_len is None and self.cache_buckets is None:
            return KVCache(batch, capacity, num_layers=self._num_layers)  # exact size, not kept
        cache = self._caches.get((batch, capacity))
        if cache is None:
            cache = self._caches[(batch, capacity)] = KVCache(batch, capacity, num_layers=self._num_layers)
        cache.reset()
        return cache

    def _prefill_forward(self, cache: KVCache, batch: int) -> GraphedForward | None:
        """The fixed-shape ``[batch, prefill_width]`` prompt-prefill forward over ``cache`` (made on
        first use; its first run captures with ``cuda_graphs``), or None: prefill eagerly (dynamic
        shapes, a GPU without CUDA graphs, ``prefill_width`` off, or a cache of fewer slots than
        ``prefill_width``).

        It is a plain ``GraphedForward`` (chain trees are causal attention), compiled only with
        ``compile_prefill`` (a compile per (batch size, bucket) for a forward run a few times a call).
        It keeps the logits of one node per sequence (nobody reads them) and, for drafters with
        ``needs_hidden_states``, the hidden states of all nodes (``return_hidden="all"``: the LM head
        still runs on one row, not on every prompt row).
        """
        width = self.prefill_width
        if not width or width > cache.capacity:
            return None
        key = (batch, cache.capacity)
        graphed = self._prefill_graphs.get(key)
        if graphed is None or graphed.cache is not cache:
            _log.info("specdec: new prompt-prefill forward [B=%d, n=%d] over a %d-slot cache (cuda_graphs=%s, "
                      "compile=%s); SpecDecoder.warmup() builds these before timing", batch, width, cache.capacity,
                      self.cuda_graphs, self.compile if self.compile_prefill else False)  # fmt: skip
            graphed = self._prefill_graphs[key] = GraphedForward(
                self.target, cache, batch, width, impl=self.attn_impl, capture=self.cuda_graphs,
                compile=self.compile if self.compile_prefill else False,
                return_hidden="all" if self._wants_hidden else False, logits_to_keep=1,
                feature_layers=self._feature_layers,
            )  # fmt: skip
        return graphed

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
                capture=self.cuda_graphs, compile=self.compile, shared=shared, feature_layers=self._feature_layers,
            )  # fmt: skip
        return graphed

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
        run = Run(prompts, seqs, [len(p) for p in prompts], [False] * batch, [None] * batch, cache, sampling,
                   generator, eos, max_new_tokens, on_tokens)  # fmt: skip
        if self.rank_sync is not None:  # same inputs on every rank, the source rank's random stream
            self.rank_sync.begin(prompts, generator, [max_new_tokens, repr(sampling), sorted(eos), pad_token_id,
                                                      self.tree_size], self.device)  # fmt: skip

        timer = self._phase_timer()
        if self.profile:
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
        policy = self.budget
        if policy is not None:
            policy.begin([len(p) for p in prompts], max_new_tokens)
        while not all(run.done):
            active = batch - sum(run.done)
            budget = self.tree_size if policy is None else policy.decide(batch, cache.capacity, active).budget
            chunk = self._chunk_for(run, budget)
            done = [self._step(run, budget)] if chunk is None else self._chunk_steps(run, chunk)
            if policy is not None:
                policy.observe_steps(budget, batch, cache.capacity, active, done)
            steps.extend(done)

        out = torch.full((batch, max(run.lens)), pad_token_id, dtype=torch.int64)
        for b, n in enumerate(run.lens):
            out[b, :n] = seqs[b, :n]
        return GenerationOutput(out, tuple(run.lens), tuple(len(p) for p in prompts), steps, timer.seconds["prefill"],
                                shared_prompt=shared_caps is not None,
                                budget=None if policy is None else policy.stats())  # fmt: skip


    def _phase_timer(self) -> PhaseTimer:
        """A timer for one step's phases: synchronized with the device only with ``profile``."""
        return PhaseTimer(self._sync if self.profile else None)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)



class SpeculativeModel:
    """A model whose ``generate`` is speculative; every other attribute is the wrapped model's."""

    def __init__(self, model, drafter: Drafter | None, tree_size: int | str = AUTO, **decoder_kwargs) -> None:
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


def wrap(model, drafter: Drafter | None, tree_size: int | str = AUTO, **decoder_kwargs) -> SpeculativeModel:
    """``specdec.wrap(model, drafter).generate(input_ids, max_new_tokens=...)`` decodes speculatively.

    ``tree_size``: ``"auto"`` (default: each step's budget from measured costs, see ``SpecDecoder``)
    or a fixed node budget per step. ``decoder_kwargs`` go to ``SpecDecoder`` (``max_tree_size``,
    ``budget``, ``max_cache_len``, ``cache_buckets``, ``static_shapes``,
    ``attn_impl``, ``cuda_graphs``, ``compile``, ``prefill_width``, ``rank_sync``, ``shared_prefix``,
    ``decode_chunk``, ``profile``).
    """
    return SpeculativeModel(model, drafter, tree_size, **decoder_kwargs)

