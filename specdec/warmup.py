"""Warm-up: build every cache and fixed-shape forward later ``generate`` calls use, before timing.

``Warmup.warmup`` (``SpecDecoder.warmup``) makes, per batch size and cache capacity, the kept KV cache,
the prompt-prefill forward, the tree forward (compiled and / or captured) and, for shared prompts,
the forwards over a batch-1 prompt cache; then the drafter's own ``warmup``. It reports what each
took (``WarmupReport``), device synchronized. With ``tree_size="auto"`` it makes the tree forward of
every candidate budget and times each (``BUDGET_TIMING_RUNS`` runs, the median; one run where
forwards have dynamic shapes, as on a CPU: nothing is captured or compiled, so more runs only add
seconds -- the calls' own steps refine the costs) for the decoder's cost model
(``specdec.budget.StepCosts.record_forward``), and, after the drafter's ``warmup``, a
drafter that reads no hidden states: catching up on a dummy prompt of up to ``DRAFT_TIMING_PROMPT``
tokens, then a step's drafting at every positive budget (``StepCosts.record_draft``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence

import torch

from specdec import hf
from specdec.drafting import DraftContext, hidden_states_request, warm_up_drafter
from specdec.graphs import configure_compile_cache, uses_inductor
from specdec.kv import KVCache
from specdec.outputs import WarmupEntry, WarmupReport
from specdec.sampling import SamplingConfig
from specdec.timing import PhaseTimer
from specdec.tree import TokenTree

__all__ = ["BUDGET_TIMING_RUNS", "DRAFT_TIMING_PROMPT", "Warmup"]

#: ``tree_size="auto"``: timed runs of each budget's forward per warmed cache (after its first run), and
#: of the drafter's drafting per budget, with static shapes (see ``Warmup._timing_runs``)
BUDGET_TIMING_RUNS = 3
#: ``tree_size="auto"``: the most tokens of the dummy prompt the drafter's catch-up is timed on
DRAFT_TIMING_PROMPT = 64


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _copy_entry_line(entry: WarmupEntry, compiled: bool, static: bool) -> str:
    """The progress line of a copy-layout ``WarmupEntry``: its seconds and what they went to."""
    parts = [f"{entry.seconds:.1f} s"]
    if entry.first_run_s is not None and compiled:
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
    if static and not entry.built:
        parts.append("already built")
    return ", ".join(parts)


def _shared_entry_line(entry: WarmupEntry, compiled: bool, static: bool) -> str:
    """The progress line of a shared-prompt ``WarmupEntry`` (``prompt_capacity`` set)."""
    parts = [f"{entry.seconds:.1f} s"]
    if entry.shared_first_run_s is not None and compiled:
        parts.append(f"compile {entry.shared_first_run_s:.1f} s")
    if entry.shared_capture_s is not None:
        parts.append(f"capture {entry.shared_capture_s:.1f} s")
    if entry.prefill_capture_s is not None:
        parts.append(f"prompt prefill capture {entry.prefill_capture_s:.1f} s")
    if static and not entry.shared_built:
        parts.append("already built")
    return ", ".join(parts)


def _check_warmup_args(batch_sizes, max_len, min_len, shared, new_tokens, sampling, log, limit: int | None) -> None:
    """``ValueError`` naming the first bad argument of ``warmup`` (``limit``: the target's context)."""
    if isinstance(batch_sizes, int) or not isinstance(batch_sizes, Sequence) or not batch_sizes or any(
            not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batch_sizes):  # fmt: skip
        raise ValueError(f"batch_sizes: expected a non-empty sequence of ints >= 1, got {batch_sizes!r}")
    if max_len is not None and (not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 2):
        raise ValueError(f"max_len: expected None or an int >= 2 (prompt + max_new_tokens), got {max_len!r}")
    if min_len is not None and (not isinstance(min_len, int) or isinstance(min_len, bool) or min_len < 2):
        raise ValueError(f"min_len: expected None or an int >= 2 (prompt + max_new_tokens), got {min_len!r}")
    if min_len is not None and max_len is not None and min_len > max_len:
        raise ValueError(f"min_len: expected at most max_len = {max_len}, got {min_len}")
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


class Warmup:
    """The warm-up of ``SpecDecoder`` (a base class of it): builds through the decoder's
    ``_cache_for``, ``_prefill``, ``_tree_forward`` and ``_chunk``, and reads its kept forwards."""

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

        With ``tree_size="auto"`` step 2 (and 3) also makes the forward ``[B, n + 1]`` of every other
        candidate budget n over the same caches, and runs each ``BUDGET_TIMING_RUNS`` more times,
        device synchronized: the median is the cost of a step at n that the decoder's budget rule
        starts from (``specdec.budget``); plain decoding's chunks are warmed as at ``tree_size=0``
        (unless the drafter reads hidden states: its plain steps run one at a time). The entries
        report the largest budget's forward.

        ``[B, tree_size + 1]`` (with ``tree_size="auto"``, one per candidate budget) and the prefill's
        ``[B, prefill_width]`` are the only forward shapes ``generate`` runs with static shapes (steps whose trees are all root-only, e.g. plain
        decoding at ``tree_size=0``, run the former too; prompts of any length, the latter).
        The dummy KV is never read: every ``generate`` prefills its prompts from slot 0. Then, if
        the drafter has a ``warmup`` method, ``drafter.warmup(batch_sizes=..., max_len=..., log=...)``
        is called, with ``tree_sizes=`` (the positive budgets its proposals will get) where it takes
        that keyword (e.g. to capture a draft model's forwards for every sequence slot); with ``tree_size="auto"``, a drafter
        that reads no hidden states is then timed at batch 1 (``_time_drafter``). A later ``generate`` within these
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

        Memory: every warmed cache stays allocated (see ``SpecDecoder``). Warming only what the
        first request needs (``min_len = max_len = prompt + max_new_tokens``) builds exactly the one
        bucket its ``generate`` uses; a later request that needs another bucket builds it on its
        first call, a stall (docs/ENGINE.md, "Warm-up", gives sizes and costs).

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
                own, a stall). None (default): the greedy chunks only.
            log: called with progress messages (default: print to stderr); None: silent.

        Returns:
            ``WarmupReport``: per (B, S), the seconds of its prefill, compile (``first_run_s``) and
            capture, and of the prefill forward's first run and capture.
        """
        _check_warmup_args(batch_sizes, max_len, min_len, shared, new_tokens, sampling, log,
                           hf.max_positions(self.target))  # fmt: skip
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
        shapes = ", ".join(f"[B, {b + 1}]" for b in self.tree_budgets)
        say(f"specdec warmup: target forwards {shapes} for B in {batch_sizes} over caches of {capacities} slots "
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
                say(f"  B={batch} S={capacity} n={n}: {_copy_entry_line(entry, bool(self.compile), self.static_shapes)}")
            for prompt_cap in prompt_caps if batch > 1 else ():
                say(f"  B={batch} S={rows_cap} n={n} shared prompt C={prompt_cap} ...")
                entry = self._warm_shared(batch, rows_cap, n, prompt_cap, sampling)
                entries.append(entry)
                say(f"  B={batch} S={rows_cap} n={n} shared prompt C={prompt_cap}: "
                    f"{_shared_entry_line(entry, bool(self.compile), self.static_shapes)}")
        drafter_s = 0.0
        if callable(getattr(self.drafter, "warmup", None)):
            say(f"specdec warmup: the drafter ({type(self.drafter).__name__})")
            t0 = time.perf_counter()
            warm_up_drafter(self.drafter, batch_sizes, max_len, log, [n for n in self.tree_budgets if n > 0], sampling)
            self._sync()
            drafter_s = time.perf_counter() - t0
        self._time_drafter(max(capacities) if max_len is None else max_len, say)
        total = time.perf_counter() - start
        say(f"specdec warmup: done in {total:.1f} s")
        return WarmupReport(tuple(entries), drafter_s, total, cache_dir)

    @property
    def _timing_runs(self) -> int:
        """Timed runs per budget: ``BUDGET_TIMING_RUNS`` with static shapes (the first run, which captures
        or compiles, not timed); with dynamic shapes (a CPU's eager forwards: nothing to make) one, and
        it is the first."""
        return BUDGET_TIMING_RUNS if self.static_shapes else 1

    def _time_drafter(self, max_len: int, say: Callable[[str], None]) -> None:
        """``tree_size="auto"``: the drafter's costs for the budget rule, before any call measures them --
        a reset on a dummy prompt of P = min(``DRAFT_TIMING_PROMPT``, ``max_len`` - the largest budget
        - ``BUDGET_TIMING_RUNS`` * budgets - 1) tokens and a first proposal at the smallest positive
        budget (catching up on P - 1 tokens), then ``_timing_runs`` proposals per positive
        budget, each after one more committed token (the median), device synchronized. With static
        shapes the timed catch-up is a second one, after a reset: the first proposal of a sequence
        captures the draft's forwards (seconds, once), which the budget rule would otherwise read as
        a per-token catch-up cost and never draft after a plain step (an H200 once: 75 ms a token). Skipped for a
        drafter that reads the target's hidden states (the calls measure it) and when P < 2. The
        next ``generate`` resets the drafter."""
        positive = [n for n in self.tree_budgets if n > 0]
        if self.budget is None or self.drafter is None or hidden_states_request(self.drafter) is not None:
            return
        runs_each = self._timing_runs
        prompt = min(DRAFT_TIMING_PROMPT, max_len - positive[-1] - runs_each * len(positive) - 1)
        if prompt < 2:
            return
        tokens = torch.zeros(prompt, dtype=torch.int64)

        def timed(budget: int) -> float:
            self._sync()
            t0 = time.perf_counter()
            self.drafter.propose(DraftContext(tokens, budget))
            self._sync()
            return time.perf_counter() - t0

        if self.static_shapes:  # a sequence's first proposal makes what later ones replay (the draft's
            self.drafter.reset([tokens.clone()])  # prefill and loop captures): one-time, not a catch-up cost
            timed(positive[0])
        self.drafter.reset([tokens.clone()])
        caught_up = timed(positive[0])
        for budget in positive:
            runs = []
            for _ in range(runs_each):
                tokens = torch.cat([tokens, tokens.new_zeros(1)])
                runs.append(timed(budget))
            self.budget.costs.record_draft(budget, sorted(runs)[len(runs) // 2])
        self.budget.costs.record_catch_up(positive[0], caught_up, prompt - 1)
        say(f"specdec warmup: the drafter caught up on {prompt - 1} tokens in {caught_up:.2f} s; drafting "
            + ", ".join(f"n={n}: {self.budget.costs.draft_s(1, n) * 1e3:.1f} ms" for n in positive))

    def _warm_chunk(self, cache: KVCache, batch: int, shared: KVCache | None = None,
                    sampling: SamplingConfig | None = None) -> float | None:  # fmt: skip
        """Plain decoding with chunks: run (and so capture) the greedy chunk over ``cache`` --
        prefilled, with room for it -- once, and the ``sampling`` one if given; the seconds of the
        captures this run made, else None."""
        if not self._chunking(min(self.tree_budgets)) or max(cache.lengths) + self.decode_chunk > cache.capacity:
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

    def _time_budgets(self, cache: KVCache, batch: int, shared: KVCache | None = None) -> None:
        """``tree_size="auto"``: make (first run: capture / compile) and time the forward of every
        candidate budget over ``cache`` (prefilled; ``shared``: the prompt's cache), the median of
        ``_timing_runs`` synchronized runs each, into the budget policy's costs."""
        if self.budget is None:
            return
        for budget in self.tree_budgets:
            forward = self._tree_forward(cache, [TokenTree.chain(torch.zeros(budget + 1, dtype=torch.int64))] * batch,
                                         budget, shared)  # fmt: skip
            if self.static_shapes:
                forward()  # made here if new (captured / compiled): not timed
            runs = []
            for _ in range(self._timing_runs):
                self._sync()
                start = time.perf_counter()
                forward()
                self._sync()
                runs.append(time.perf_counter() - start)
            self.budget.costs.record_forward(batch, cache.capacity, budget, sorted(runs)[len(runs) // 2])

    def _warm_shared(self, batch: int, rows_cap: int, n: int, prompt_cap: int,
                     sampling: SamplingConfig | None = None) -> WarmupEntry:  # fmt: skip
        """Step 3 of ``warmup`` for one pair: a 2-token dummy prompt prefilled into the batch-1 cache of
        ``prompt_cap`` slots (through its prefill forward, if any), then the tree forward of ``batch``
        rows of ``rows_cap`` slots over it run once (made and compiled / captured here if new)."""
        shared_key = (batch, rows_cap, n, prompt_cap)
        existing_shared = self._shared_graphs.get(shared_key)
        existing_prefill = self._prefill_graphs.get((1, prompt_cap))
        timer = PhaseTimer(self._sync)  # the report is device time: always synchronized
        self._sync()
        with timer("all"):
            rows = self._cache_for(batch, rows_cap)
            with timer("prefill"):
                prompt_cache, _ = self._prefill_shared(torch.zeros(2, dtype=torch.int64), batch, prompt_cap)
                rows.allocate_like(prompt_cache)  # as generate does: buffers before the first forward
            chain = TokenTree.chain(torch.zeros(n, dtype=torch.int64))
            self._tree_forward(rows, [chain] * batch, n - 1, prompt_cache)()
            over_shared = self._shared_graphs.get(shared_key)  # None with dynamic shapes
            shared_first = over_shared is not None and over_shared.calls == 1  # before the budgets' timing runs
            self._time_budgets(rows, batch, prompt_cache)
            chunk_s = self._warm_chunk(rows, batch, prompt_cache, sampling)
            rows.reset()
            prompt_cache.reset()
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
        timer = PhaseTimer(self._sync)  # the report is device time: always synchronized
        self._sync()
        with timer("all"):
            cache = self._cache_for(batch, capacity)
            with timer("prefill"):
                self._prefill(cache, torch.zeros(batch, 2, dtype=torch.int64), [2] * batch)
            chain = TokenTree.chain(torch.zeros(n, dtype=torch.int64))
            self._tree_forward(cache, [chain] * batch, n - 1)()
            graphed = self._graphs.get(key)  # None with dynamic shapes
            first = graphed is not None and graphed.calls == 1  # its first run: timings are ours
            self._time_budgets(cache, batch)
            chunk_s = self._warm_chunk(cache, batch, None, sampling)
            cache.reset()
            over_shared = None  # the shared-prompt forward's entry, if warmed here
            context = 2 * capacity if self.static_shapes else capacity + 1  # what the call's obstacle check sees
            if shared and self.shared_prefix and batch > 1 and hf.shared_prefix_obstacle(self.target, context) is None:
                over_shared = self._warm_shared(batch, capacity, n, capacity, sampling)
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
