"""The target's fixed-shape tree forward at fixed addresses, replayed as a CUDA graph.

``GraphedForward(model, cache, batch, n)`` owns everything one verification forward of shape
``[B, n]`` reads or writes, except the model's weights and the ``KVCache`` buffers:

- **inputs** -- views into ONE int64 device vector, refilled in place every step (``load``):
  per sequence, the n node tokens, their position ids (``prefix_len + depth``), their cache slots
  (``prefix_len + node index``), the tree's ancestor bit words ``[n, ceil(n / 64)]`` and depths
  (``treeattn.TreeMask`` layout), and the prefix length; with a shared prompt (``shared=``), also
  its length P (positions are then ``P + prefix_len + depth``). The host packs them into one staging
  vector (pinned on CUDA) and a single asynchronous host-to-device copy moves it. Trees smaller
  than n are padded with dummy nodes under the root (no real node attends to them).
- **the captured region** (``_body``): ``hf.run_state`` over those inputs -- embedding, every
  decoder layer (its attention writes the n new keys / values into the cache at ``slots`` and
  calls ``tree_attention(..., check_prefix_lens=False)`` over the whole cache capacity S), the
  final norm, the LM head -> logits ``[B, n, V]``, and the LM head's input (final hidden states
  ``[B, n, H]``) when ``return_hidden`` -- or, with ``feature_layers``, the outputs of those decoder
  layers concatenated, ``[B, n, k * H]``. No host sync happens inside and every shape depends only
  on (B, n, S): variable prefix lengths are data in the input vector, never shapes. The Triton
  kernel's launch configuration depends on (B, heads, n, S, D) only, and S is the cache capacity,
  so it is the same every step. With ``shared=`` (a batch-1 ``KVCache`` of capacity C holding a
  prompt all B sequences share, ``hf.ForwardState.shared``), every layer attends through
  ``treeattn.cascade.cascade_tree_attention`` over all C slots with the prompt length P read from
  the input vector (``shared_len``): the launch depends on C, never on P, so one capture serves
  every prompt of up to C tokens. The op's temporaries (output, split partials) are allocated
  inside the capture from the graph's private memory pool, at the same addresses every replay.
- **outputs** -- ``logits`` / ``hidden``: fixed tensors, overwritten by every forward. Callers
  read them before the next ``forward`` (the engine verifies, then copies what it keeps).

Outside the graph, on the same stream and the same buffers: building the trees, verification
and ``KVCache.commit``.

``GraphedMaskedForward(model, cache, batch, m)`` is the same for ``hf.masked_forward``: up to m
tokens per sequence attending through an explicit visibility mask over the whole cache capacity
(a draft model's per-depth forward: catch-up chain, then the frontier of each depth). Its inputs
are the tokens, position ids and cache slots ``[B, m]``, the position id of every slot ``[B, S]``
(sliding-window layers) in one int64 vector, and the mask ``[B, m, S]`` in one bool vector; rows
past a call's token count are padding that writes only the cache's last slot (kept free by the
caller) and attends only to it.

Both classes run the same code on the same buffers in two modes: ``capture=True`` records the body once as a
``torch.cuda.CUDAGraph`` (after a first forward, which compiles the kernels -- and allocates the
cache's buffers if nothing wrote them yet --, and ``warmup`` more -- default 2,
``SPECDEC_CAPTURE_WARMUP`` -- on a side stream; see ``_capture``)
and replays it; ``capture=False`` ("eager replay", any device) calls the body each time
and copies its results into the same fixed output tensors. The eager mode is what CPU tests run:
it checks everything the graph depends on (what is copied where, output aliasing) but the capture.

Compiling (``compile=...``): the body goes through ``torch.compile`` (``dynamic=False``: every
shape, the cache capacity S included, is baked in, so each (B, n, S) compiles once). Before the
first inductor compile of the process, ``configure_compile_cache`` points inductor's on-disk caches
at a persistent directory (``$SPECDEC_HOME/compile-cache`` unless ``TORCHINDUCTOR_CACHE_DIR`` is
set) and makes sure the FX graph cache and the AOT autograd cache are on, so that a later process
compiling the same shapes loads the compiled code from disk instead of regenerating it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator, Sequence

import torch

from specdec import hf
from specdec.attention import MaskedState
from specdec.kv import KVCache
from specdec.tree import TokenTree
from specdec.tree_inputs import InputLayout, pack_trees
from treeattn import TreeMask

__all__ = [
    "GraphedForward",
    "GraphedMaskedForward",
    "Replayed",
    "capture_warmup",
    "compile_fixed_shapes",
    "compile_plan",
    "graph_capture",
    "LAYERS",
    "configure_compile_cache",
    "prefill_chunks",
    "DEFAULT_PREFILL_WIDTH",
    "replay_modes",
    "uses_inductor",
]

_COMPILE_VARIANTS = 64  # compiled forwards (shapes x instances) kept per process
_compile_cache_dir: str | None = None  # set by the first configure_compile_cache() of the process
#: side-stream forwards before a capture when a forward is made with ``warmup=None`` (the default)
DEFAULT_CAPTURE_WARMUP = 2
CAPTURE_WARMUP_ENV = "SPECDEC_CAPTURE_WARMUP"
#: "1": the first forward, the warm-up and the recording of a capture on one side stream (PERF.md v9)
ONE_STREAM_ENV = "SPECDEC_CAPTURE_ONE_STREAM"


def capture_warmup(warmup: int | None = None) -> int:
    """The side-stream warm-up forwards before a CUDA-graph capture: ``warmup`` if given, else
    ``$SPECDEC_CAPTURE_WARMUP`` if set, else ``DEFAULT_CAPTURE_WARMUP`` (2). See ``Replayed._capture``."""
    if warmup is not None:
        if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
            raise ValueError(f"warmup: expected None or an int >= 0, got {warmup!r}")
        return warmup
    env = os.environ.get(CAPTURE_WARMUP_ENV, "").strip()
    if not env:
        return DEFAULT_CAPTURE_WARMUP
    if not env.isdigit():
        raise ValueError(f"{CAPTURE_WARMUP_ENV}: expected an int >= 0, got {env!r}")
    return int(env)


def configure_compile_cache() -> str:
    """Make torch.compile's inductor caches persistent; return the directory they use.

    Called before the first inductor compile of a ``GraphedForward`` / ``GraphedMaskedForward``
    (never at import time); later calls only return the directory. It

    - sets ``TORCHINDUCTOR_CACHE_DIR`` to ``$SPECDEC_HOME/compile-cache`` (``SPECDEC_HOME`` defaults to
      ``~/.cache/specdec``, see ``specdec.models.specdec_home``) unless it is already set -- by the
      user, or by an inductor compile earlier in this process (torch's own default is
      ``/tmp/torchinductor_$USER``, which does not survive a reboot or a fresh container). Inductor
      keeps its FX graph cache, AOT autograd cache and the Triton kernels it generates
      (``<dir>/triton``, unless ``TRITON_CACHE_DIR`` is set) under it. The tree-attention kernel
      is not inductor's: Triton caches it in its own directory (``~/.triton/cache``).
    - turns inductor's FX graph cache (``torch._inductor.config.fx_graph_cache``) and the AOT
      autograd cache (``torch._functorch.config.enable_autograd_cache``) on -- the default in
      recent torch -- unless the environment decides (``TORCHINDUCTOR_FX_GRAPH_CACHE`` /
      ``TORCHINDUCTOR_AUTOGRAD_CACHE`` set, e.g. to 0 to turn them off).

    With both caches warm, a new process still traces the model with dynamo (seconds) but skips
    inductor's code generation and kernel compilation, and CUDA graphs are re-captured (fast).
    """
    global _compile_cache_dir
    if _compile_cache_dir is None:
        if not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
            from specdec.models import specdec_home

            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(specdec_home() / "compile-cache")
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        if "TORCHINDUCTOR_FX_GRAPH_CACHE" not in os.environ:
            inductor_config.fx_graph_cache = True
        if "TORCHINDUCTOR_AUTOGRAD_CACHE" not in os.environ:
            functorch_config.enable_autograd_cache = True
        _compile_cache_dir = os.path.abspath(os.environ["TORCHINDUCTOR_CACHE_DIR"])  # as inductor reads it
    return _compile_cache_dir



#: ``compile=`` value of the layer-wise compile: each decoder layer's forward compiled once for all layers
#: (``hf.compile_layers``) with inductor; ``"layers:BACKEND"`` with another backend (e.g. aot_eager).
#: ``compile=True`` means the same for the target's tree forward (PERF.md v20)
LAYERS = "layers"


def compile_plan(compile: bool | str) -> tuple[str | None, bool]:
    """``(backend, per_layer)`` of a ``compile=`` option: False -> (None, False); True or ``"layers"``
    -> ("inductor", True): the layer-wise compile; ``"layers:BACKEND"`` -> (BACKEND, True); another
    name, ``"inductor"`` included -> (it, False): the whole fixed-shape body through that backend
    (``compile_fixed_shapes``). Why True is layer-wise: docs/ENGINE.md, "Compile"."""
    if not isinstance(compile, (bool, str)) or compile == "":
        raise ValueError(f"compile: expected a bool or a torch.compile backend name, got {compile!r}")
    if compile is False:
        return None, False
    if compile is True:
        return "inductor", True
    if compile == LAYERS or compile.startswith(LAYERS + ":"):
        backend = compile[len(LAYERS) + 1 :] or "inductor"
        if backend in (LAYERS, "max-autotune"):
            raise ValueError(f"compile: expected 'layers' or 'layers:BACKEND' with a plain backend, got {compile!r}")
        return backend, True
    return compile, False


def uses_inductor(backend: bool | str) -> bool:
    """Whether a ``compile=`` option compiles with inductor (True, ``"inductor"``, ``"max-autotune"``,
    ``"layers"``): the compiles whose on-disk caches ``configure_compile_cache`` sets."""
    name = compile_plan(backend)[0] if backend else None
    return name in ("inductor", "max-autotune")


def compile_fixed_shapes(fn, backend: bool | str):
    """``torch.compile(fn)`` for fixed shapes (``dynamic=False``, graph breaks allowed); ``backend``:
    True or ``"inductor"`` (whose on-disk caches ``configure_compile_cache`` makes persistent),
    ``"max-autotune"`` (inductor timing Triton GEMM templates against cuBLAS for every matmul shape,
    mode ``max-autotune-no-cudagraphs``: the callers capture their own graphs; a longer first compile,
    cached on disk like the rest), or another backend name. Every caller compiles its code object for
    its own shapes and buffers; dynamo's default of 8 variants per code object would silently leave
    later ones uncompiled (e.g. a sweep over tree sizes, batch sizes and cache capacities), so the
    limit is raised. (Inductor's weight freezing was tried and measured no faster on the H100; in the
    draft model's step it merged only gate / up into one GEMM: PERF.md v13, v14.)"""
    mode = "max-autotune-no-cudagraphs" if backend == "max-autotune" else None
    backend = prepare_compile(backend)
    return torch.compile(fn, backend=backend, mode=mode, fullgraph=False, dynamic=False)


def prepare_compile(backend: bool | str) -> str:
    """What every fixed-shape compile of this module needs before it runs: inductor's persistent caches
    (``configure_compile_cache``) and dynamo's variant limit raised (see ``compile_fixed_shapes``);
    returns the torch.compile backend name (True / ``"max-autotune"`` -> ``"inductor"``)."""
    if uses_inductor(backend):
        backend = "inductor"
        configure_compile_cache()
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, _COMPILE_VARIANTS)
    return backend


class Replayed:
    """What both fixed-address forwards share: argument checks, the output tensors, eager replay and
    the CUDA-graph capture of ``_body`` (which subclasses define over their fixed input buffers)."""

    def __init__(self, model, cache: KVCache, batch: int, n: int, *, capture: bool, warmup: int | None = None,
                 compile: bool | str = False, n_name: str = "n") -> None:  # fmt: skip
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache: expected a specdec.KVCache, got {type(cache).__name__}")
        for name, val in (("batch", batch), (n_name, n)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if cache.batch_size != batch:
            raise ValueError(f"cache: expected batch size {batch}, got a cache of batch size {cache.batch_size}")
        if n > cache.capacity:
            raise ValueError(f"{n_name}: expected at most the cache capacity {cache.capacity}, got {n}")
        warmup = capture_warmup(warmup)
        backend, per_layer = compile_plan(compile)
        self.device = hf.input_device(model)
        devices = model_devices(model)
        if capture:
            if self.device.type != "cuda":
                raise ValueError(f"capture: CUDA graphs need the model on a CUDA device, got {self.device}")
            if len(devices) > 1:
                raise ValueError(f"capture: CUDA graphs need the model on one device, got {sorted(map(str, devices))}")
        self.model = model
        self.cache = cache
        self.batch = batch
        self.capture = bool(capture)
        self.warmup = warmup
        #: torch.compile backend ("inductor" for True), or None: run the body as is
        self.compile = backend
        #: ``compile="layers"``: the body runs as is, its decoder layers through one compiled forward
        #: (``hf.compile_layers``; the state carries ``layer_backend``)
        self.compile_layers = per_layer
        if per_layer:
            prepare_compile(backend)
            hf.compile_layers(model)
        self._compiled = None
        self.logits: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None
        self.logits_to_keep = 0  # the body's logits_to_keep (hf.run_state): 0 = every input row
        #: the decoder layers whose outputs the body returns as its hidden states (hf.run_state); None: the final ones
        self.feature_layers: tuple[torch.nn.Module, ...] | None = None
        self.graph = None  # torch.cuda.CUDAGraph once captured
        #: forwards run (eager calls or graph replays), for tests and accounting
        self.calls = 0
        #: seconds of the body's first run (device synchronized): with ``compile``, the
        #: torch.compile of this shape (tracing, code generation or a cache hit, kernel builds);
        #: without, one eager forward (plus any first-use kernel compilation). None before it ran.
        self.first_run_s: float | None = None
        #: seconds of the capture after that first run (side-stream warm-up forwards and the
        #: recording); None without ``capture`` or before it.
        self.capture_s: float | None = None
        #: the part of ``capture_s`` spent in the side-stream warm-up forwards (the rest: the recording)
        self.capture_warmup_s: float | None = None

    def _stage(self, size: int, dtype: torch.dtype) -> tuple[torch.Tensor, "_Copy"]:
        """A device input vector and its copier from a host staging vector (pinned on CUDA)."""
        host = torch.zeros(size, dtype=dtype, pin_memory=self.device.type == "cuda")
        flat = torch.zeros(size, dtype=dtype, device=self.device)
        return flat, _Copy(host, flat)

    def _body(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured region: the model's forward over the fixed inputs (no host sync inside).

        Subclasses set ``tokens``, ``positions`` (fixed ``[B, m]`` device tensors), ``state`` (a
        ``hf.ForwardState`` / ``attention.MaskedState`` over fixed tensors) and ``return_hidden``.
        """
        out = hf.run_state(self.model, self.tokens, self.positions, self.state, logits_to_keep=self.logits_to_keep,
                           return_hidden=self.return_hidden, feature_layers=self.feature_layers)  # fmt: skip
        return out if self.return_hidden else (out, None)

    def _run(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The body, through ``torch.compile`` when asked (compiled on the first call, which the
        capture makes outside the recorded region). The fused elementwise work of the model's
        layers is what compiling buys; the tree attention stays one custom op."""
        if self.compile is None or self.compile_layers:
            return self._body()
        if self._compiled is None:
            self._compiled = compile_fixed_shapes(self._body, self.compile)
        return self._compiled()

    @torch.no_grad()
    def forward(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the forward on the loaded inputs: ``(logits, hidden or None)``.

        The returned tensors are the same objects every call (overwritten by the next one).
        """
        if self.capture:
            if self.graph is None:
                self._capture()
            self.graph.replay()
        else:
            first = self.first_run_s is None
            start = self._clock() if first else 0.0
            logits, hidden = self._run()
            if first:
                self.first_run_s = self._clock() - start
            if self.logits is None:
                self.logits, self.hidden = logits, hidden
            else:
                self.logits.copy_(logits)
                if hidden is not None:
                    self.hidden.copy_(hidden)
        self.calls += 1
        return self.logits, self.hidden

    @property
    def captured(self) -> bool:
        return self.graph is not None

    @property
    def build_s(self) -> float:
        """Seconds of this forward's one-time work so far: its first run (a compile, kernel loads) and
        its capture; 0.0 before its first run."""
        return (self.first_run_s or 0.0) + (self.capture_s or 0.0)

    def _capture(self) -> None:
        """Warm up (a first forward, then ``warmup`` more on a side stream), then record ``_body`` as
        a CUDA graph.

        Why these forwards: nothing lazily initialized may happen inside a capture (kernel loading
        or compilation, cuBLAS handle creation, cuDNN / autotuning benchmarks, caching-allocator
        growth of the general pool, the KV cache's first allocation). The first forward does all
        of that (and torch.compile's compile or cache load) on the current stream, so that the
        buffers it allocates belong to the stream every later step runs on; the warm-up forwards
        run on a side stream, and the recording on ``torch.cuda.graph``'s own capture stream (what
        every GPU measurement so far ran). ``warmup`` (``capture_warmup``: default 2) sets the count.

        With ``$SPECDEC_CAPTURE_ONE_STREAM=1`` (a candidate for a faster first token, PERF.md v9,
        not yet run on a GPU): when the cache's buffers exist (the engine's case: its prefill wrote
        them) the first forward runs on the side stream too, and the graph is recorded on that same
        stream, so that the compiled code is called on one stream only (a guard on the current stream
        would recompile at the first call on another one) and the per-stream lazy state (PyTorch's
        cuBLAS / cuBLASLt workspace of a stream) is warmed on the stream the graph is recorded on, as
        PyTorch's ``make_graphed_callables`` does since pytorch#187745. No op of the forward autotunes
        or benchmarks (inductor's default mode), so one warm-up forward should suffice there
        (``SPECDEC_CAPTURE_WARMUP=1``).

        The body is idempotent for fixed inputs (it rewrites the same slots of the cache and reads
        them back), so the warm-up forwards on the loaded inputs change nothing that the replay
        after the capture does not rewrite.
        """
        device = self.device
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            one_stream = os.environ.get(ONE_STREAM_ENV, "0") == "1"
            start = self._clock()
            if one_stream and self.cache.layer_indices:  # buffers exist (the engine prefilled): one stream
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    self._run()  # compiles (or loads from the compile cache) and loads the kernels
            else:
                self._run()  # allocates the cache's buffers on this stream (the one later steps run on)
                side.wait_stream(torch.cuda.current_stream(device))
            self.first_run_s = self._clock() - start
            layers = list(self.cache.layer_indices)
            if not layers:
                raise RuntimeError("cache: the warm-up forward wrote no KV buffers; cannot capture the forward")
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self._run()
            torch.cuda.current_stream(device).wait_stream(side)
            self.capture_warmup_s = self._clock() - start - self.first_run_s
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph, stream=side if one_stream else None):
                logits, hidden = self._run()
            torch.cuda.current_stream(device).wait_stream(side)
            if list(self.cache.layer_indices) != layers:
                raise RuntimeError("cache: KV buffers were allocated during the CUDA-graph capture")
            self.capture_s = self._clock() - start - self.first_run_s
        self.graph = graph
        self.logits, self.hidden = logits, hidden

    def _clock(self) -> float:
        """``time.perf_counter()`` after the device has finished its queued work."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def _clear_cublas_workspaces() -> None:
    """Drop PyTorch's cached cuBLAS workspaces (one per cuBLAS handle and stream).

    A GEMM captured in a CUDA graph keeps the address of the workspace that was cached for the
    capture stream when it was recorded. If that workspace had been allocated earlier -- inside
    another graph's private memory pool during its capture, or in the general pool -- the graph
    depends on memory it does not own: once the workspace cache is cleared (torch.compile's
    CUDA-graph trees clear it around every recording, e.g. under HF ``generate`` with the static
    cache) and the owning pool is released, replaying the graph reads and writes freed device
    memory ("unspecified launch failure"). Clearing right before a capture makes the
    capture allocate a fresh workspace inside its own pool, which lives as long as the graph.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


@contextlib.contextmanager
def graph_capture(graph: "torch.cuda.CUDAGraph", stream: "torch.cuda.Stream | None" = None) -> Iterator[None]:
    """Record what runs inside into ``graph`` (``torch.cuda.graph``, errors of this thread only), with
    cuBLAS's cached workspaces dropped before and after (``_clear_cublas_workspaces``: the capture
    allocates its own, inside the graph's pool, and later eager work does not use it) and Python's
    automatic garbage collection off.

    The collector must not run during a capture: a decoder dropped in a reference cycle (a
    ``SpecDecoder`` built per configuration in a loop) may own captured graphs, and freeing one
    resets it, which CUDA does not permit while a stream captures: the capture is invalidated
    (``cudaErrorStreamCaptureInvalidated``) and the process aborts at its next event. torch no
    longer collects before a capture by default (``torch.compiler.config.force_cudagraph_gc``).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        _clear_cublas_workspaces()
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            yield
        _clear_cublas_workspaces()
    finally:
        if enabled:
            gc.enable()


class _Copy:
    """Host staging vector -> device input vector, one asynchronous copy per step on CUDA.

    An event recorded after each copy makes the next ``put`` wait until the copy has read the
    staging vector before overwriting it.
    """

    def __init__(self, host: torch.Tensor, flat: torch.Tensor) -> None:
        self.host, self.flat = host, flat
        self._copied = torch.cuda.Event() if flat.is_cuda else None
        self._pending = False

    def put(self, values: torch.Tensor) -> None:
        if self._pending:
            self._copied.synchronize()
        self.host.copy_(values)
        self.flat.copy_(self.host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record(torch.cuda.current_stream(self.flat.device))
            self._pending = True


#: Prompt tokens per chunk of the fixed-shape prompt prefill (the default ``prefill_width`` of
#: ``SpecDecoder`` and of the draft-model drafter's device loop).
DEFAULT_PREFILL_WIDTH = 256


def prefill_chunks(total: int, width: int, capacity: int) -> list[tuple[int, int]]:
    """The chunks ``[start, stop)`` that prefill prompt positions ``[0, total)`` through a fixed
    forward of ``width`` nodes over a cache of ``capacity`` slots (``width <= capacity``, ``total
    <= capacity``).

    A chunk loaded at prefix ``start`` writes slots ``[start, start + width)``, so it needs
    ``start <= last = capacity - width``. Rule (W = width): a chunk takes all the rest if that is
    at most W tokens, else it stops at ``min(start + W, last)``. So the starts are 0, W, 2W, ...
    until one would pass ``last``; that one is clamped to ``last``, and the chunk before it is
    shorter than W.

    Proof that every chunk fits the cache, has 1..W tokens, and the chunks tile ``[0, total)`` in
    order: by induction, every start satisfies ``start <= last`` (true for 0). If ``total - start
    <= W`` the chunk ``[start, total)`` is the last one (``start <= last``: it fits). Otherwise
    ``start < last`` (``start == last`` would give ``total - start <= capacity - last = W``), so
    the stop ``min(start + W, last)`` is larger than start, at most ``start + W``, and, as the next
    start, at most ``last``. Count: ``ceil(total / W)`` chunks, one more when a W-aligned start
    passes ``last`` before the end (a request nearly filling its cache).
    """
    if not 1 <= width <= capacity or not 0 <= total <= capacity:
        raise ValueError(f"width, total: expected 1 <= width <= capacity {capacity} and 0 <= total <= capacity, "
                         f"got width {width}, total {total}")  # fmt: skip
    chunks = []
    start, last = 0, capacity - width
    while start < total:
        stop = total if total - start <= width else min(start + width, last)
        chunks.append((start, stop))
        start = stop
    return chunks


class GraphedForward(Replayed):
    """One ``[B, n]`` tree forward of ``model`` over ``cache`` at fixed addresses (see the module doc).

    Args:
        model: a causal LM after ``hf.prepare_model``, all on one device.
        cache: the ``KVCache`` (batch size B) the forward writes into and attends over; its
            buffers must never be reallocated while this object is used (``KVCache`` never does).
        batch, n: the static shape: B sequences, n tree nodes each (root included).
        impl: ``treeattn.tree_attention``'s ``impl``.
        return_hidden: also produce the final hidden states (for drafters that read them): True, of
            the nodes whose logits are kept; ``"all"``, of all n nodes whatever ``logits_to_keep``
            keeps (a prompt prefill for a drafter that reads every prompt feature: ``hf.run_state``).
        feature_layers: with ``return_hidden``, the outputs of these decoder-layer modules
            (``hf.layers_at``) instead, concatenated: ``hidden`` is ``[B, n, k * H]`` for k layers
            (``hf.run_state``; taken inside the captured / compiled body).
        capture: record a CUDA graph (the model must be on CUDA); False = eager replay.
        warmup: side-stream forwards before the capture (after one on the current stream); None:
            ``capture_warmup()`` (2 unless ``$SPECDEC_CAPTURE_WARMUP`` says otherwise).
        compile: fuse the layers' elementwise kernels with ``torch.compile`` before the capture.
            True or ``"layers"`` (``"layers:BACKEND"``): run the body as is and each decoder layer
            through one forward compiled for all of them (``hf.compile_layers``; ``compile_plan``),
            a fraction of the whole body's compile time; ``"inductor"`` (or another backend name):
            the whole body through ``torch.compile``.
        logits_to_keep: 0 (default) = logits (and hidden states) of all n nodes; k in [1, n] = of
            the last k nodes only (``hf.run_state``'s semantics), e.g. 1 for a chunked prompt
            prefill that only writes KV: the LM head and the ``[B, n, V]`` logits buffer shrink to k rows.
        shared: a batch-1 ``KVCache`` (capacity C) holding a prompt all B sequences share
            (``hf.ForwardState.shared``), or None. ``cache`` then holds what follows the prompt;
            every ``load`` reads the prompt's length P from ``shared.lengths[0]`` (set by whoever
            prefilled it) into the input vector: positions are offset by P, and attention reads
            the first P of the C slots (``hf.ForwardState.shared_len``). Its KV buffers must exist
            before the first forward (prefill it first) and, like ``cache``'s, never move.

    Use: ``load(trees, prefix_lens)`` then ``forward()`` (or ``run`` for both) returns
    ``(logits [B, n, V], hidden [B, n, H] or None)`` (k rows instead of n with ``logits_to_keep``;
    ``hidden`` keeps all n with ``return_hidden="all"``) -- the same tensor objects every call.
    """

    def __init__(self, model, cache: KVCache, batch: int, n: int, *, impl: str = "auto",
                 return_hidden: bool | str = False, capture: bool = False, warmup: int | None = None,
                 compile: bool | str = False, logits_to_keep: int = 0, shared: KVCache | None = None,
                 feature_layers: tuple[torch.nn.Module, ...] | None = None) -> None:  # fmt: skip
        super().__init__(model, cache, batch, n, capture=capture, warmup=warmup, compile=compile)
        if not isinstance(logits_to_keep, int) or isinstance(logits_to_keep, bool) or not 0 <= logits_to_keep <= n:
            raise ValueError(f"logits_to_keep: expected an int in [0, n = {n}], got {logits_to_keep!r}")
        self.n = n
        #: 0 = logits of every node; k = of the last k nodes only
        self.logits_to_keep = logits_to_keep
        if return_hidden not in (False, True, "all"):
            raise ValueError(f"return_hidden: expected False, True or 'all', got {return_hidden!r}")
        self.return_hidden = return_hidden
        self.feature_layers = None if feature_layers is None else tuple(feature_layers)
        #: the shared prompt's cache (None: each sequence's prompt is in ``cache``)
        self.shared = shared
        self.layout = InputLayout(batch, n, shared=shared is not None)
        self._flat, self._copy = self._stage(self.layout.size, torch.int64)
        view = lambda name: self.layout.view(self._flat, name)  # noqa: E731
        self.tokens, self.positions, self.slots = view("tokens"), view("positions"), view("slots")
        self.prefix_lens = view("prefix_lens")
        self.tree_mask = TreeMask(words=view("words"), depth=view("depth"))
        self.state = hf.ForwardState(cache, self.slots, self.positions, self.tree_mask, self.prefix_lens,
                                     kv_len=None, impl=impl, shared=shared,
                                     shared_len=None if shared is None else view("shared_len"),
                                     layer_backend=self.compile if self.compile_layers else None)  # fmt: skip

    # ------------------------------------------------------------------ inputs

    def load(self, trees: Sequence[TokenTree], prefix_lens: Sequence[int] | torch.Tensor) -> None:
        """Copy one step's inputs into the fixed input buffers (in place; one host-to-device copy).

        Args:
            trees: B ``TokenTree``\\ s of at most n nodes each.
            prefix_lens: B committed KV lengths (host ints or a CPU tensor); the tree of sequence
                b goes to cache slots ``[prefix_lens[b], prefix_lens[b] + n)``, which must fit.
                With ``shared``, the lengths after the shared prompt, whose own length is read
                from ``shared.lengths[0]``.
        """
        if isinstance(prefix_lens, torch.Tensor):
            prefix_lens = prefix_lens.tolist()
        prefix = [int(p) for p in prefix_lens]
        if len(trees) != self.batch or len(prefix) != self.batch:
            raise ValueError(f"trees, prefix_lens: expected {self.batch} of each, got {len(trees)} and {len(prefix)}")
        for b, tree in enumerate(trees):
            if not isinstance(tree, TokenTree):
                raise ValueError(f"trees[{b}]: expected a specdec.TokenTree, got {type(tree).__name__}")
            if tree.n > self.n:
                raise ValueError(f"trees[{b}]: expected at most n = {self.n} nodes, got {tree.n}")
        lo, hi = min(prefix), max(prefix)
        if lo < 0 or hi + self.n > self.cache.capacity:
            raise ValueError(
                f"prefix_lens: expected 0 <= prefix_len and prefix_len + n <= {self.cache.capacity} (cache capacity, "
                f"n = {self.n}), got values in [{lo}, {hi}]"
            )
        shared_len = 0
        if self.shared is not None:
            shared_len = self.shared.lengths[0]
            if not 0 <= shared_len <= self.shared.capacity:
                raise ValueError(f"shared: expected a prompt length 0 <= lengths[0] <= capacity "
                                 f"{self.shared.capacity}, got {shared_len}")
        self._copy.put(torch.frombuffer(pack_trees(trees, prefix, self.layout, shared_len), dtype=torch.int64))
        self.state.refresh()

    def run(self, trees: Sequence[TokenTree], prefix_lens) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``load(trees, prefix_lens)`` then ``forward()``."""
        self.load(trees, prefix_lens)
        return self.forward()



class GraphedMaskedForward(Replayed):
    """``hf.masked_forward`` of up to m tokens per sequence at fixed addresses (see the module doc).

    Args:
        model: a causal LM after ``hf.prepare_model``, all on one device.
        cache: the ``KVCache`` (batch size B) written and attended over; the forward reads all
            ``S = cache.capacity`` slots, and padding rows write slot ``S - 1``, which must hold no
            live KV (callers keep their data below it).
        batch, m: the static shape: B sequences, m input tokens each.
        return_hidden: also produce the final hidden states.
        capture: record a CUDA graph (the model must be on CUDA); False = eager replay.
        warmup: side-stream forwards before the capture; None: ``capture_warmup()``.
        compile: run the whole body through ``torch.compile`` (True or ``"inductor"``: inductor; or a
            backend name).

    Use: ``load(tokens, positions, slots, visible, key_positions)`` then ``forward()`` returns
    ``(logits [B, m, V], hidden [B, m, H] or None)`` -- the same tensor objects every call; rows
    past the loaded tokens are padding.
    """

    def __init__(self, model, cache: KVCache, batch: int, m: int, *, return_hidden: bool = False,
                 capture: bool = False, warmup: int | None = None, compile: bool | str = False) -> None:  # fmt: skip
        if compile is True:  # the whole masked forward: the layer-wise compile is the tree forward's
            compile = "inductor"
        if compile_plan(compile)[1]:
            raise ValueError(f"compile: expected a bool or a backend name for a masked forward, got {compile!r} "
                             f"(the layer-wise compile is for the target's tree forward)")
        super().__init__(model, cache, batch, m, capture=capture, warmup=warmup, compile=compile, n_name="m")
        if m >= cache.capacity:
            raise ValueError(f"m: expected fewer tokens than the cache capacity {cache.capacity} (one slot is scratch), got {m}")
        self.m = m
        self.return_hidden = bool(return_hidden)
        cap = cache.capacity
        self._ints, self._copy_ints = self._stage(batch * (3 * m + cap), torch.int64)
        self._mask, self._copy_mask = self._stage(batch * m * cap, torch.bool)
        seg = batch * m
        self.tokens = self._ints[:seg].view(batch, m)
        self.positions = self._ints[seg : 2 * seg].view(batch, m)
        self.slots = self._ints[2 * seg : 3 * seg].view(batch, m)
        self.key_positions = self._ints[3 * seg :].view(batch, cap)
        self.visible = self._mask.view(batch, m, cap)
        self.state = MaskedState(cache, self.slots, self.positions, self.visible, self.key_positions)

    def load(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor,
             key_positions: torch.Tensor | None = None) -> None:  # fmt: skip
        """Copy one call's inputs (host tensors, as for ``hf.masked_forward``) into the fixed buffers.

        Args:
            tokens, positions, slots: int64 ``[B, m']`` with ``m' <= m``; slots below ``S - 1``.
            visible: bool ``[B, m', kv_len]`` with ``kv_len <= S - 1`` (slots past kv_len: hidden).
            key_positions: int64 ``[B, kv_len]`` (default: the slot index, a plain causal prefix).
        """
        batch, m, cap = self.batch, self.m, self.cache.capacity
        if tokens.dim() != 2 or tokens.shape[0] != batch or not 1 <= tokens.shape[1] <= m:
            raise ValueError(f"tokens: expected shape [{batch}, 1..{m}], got {tuple(tokens.shape)}")
        rows = tokens.shape[1]
        for name, t in (("positions", positions), ("slots", slots)):
            if tuple(t.shape) != (batch, rows):
                raise ValueError(f"{name}: expected shape [{batch}, {rows}] (tokens'), got {tuple(t.shape)}")
        if visible.dim() != 3 or tuple(visible.shape[:2]) != (batch, rows) or visible.shape[2] > cap - 1:
            raise ValueError(f"visible: expected shape [{batch}, {rows}, kv_len <= {cap - 1}], got {tuple(visible.shape)}")
        kv_len = visible.shape[2]
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= cap - 1:
            raise ValueError(f"slots: expected values in [0, {cap - 2}] (slot {cap - 1} is scratch), got [{lo}, {hi}]")
        ints = torch.zeros(3, batch, m, dtype=torch.int64)
        ints[0, :, :rows] = tokens
        ints[1, :, :rows] = positions
        ints[2, :, :rows] = slots
        ints[2, :, rows:] = cap - 1  # padding rows: token 0 at position 0 in the scratch slot
        keypos = torch.arange(cap, dtype=torch.int64).expand(batch, cap).clone()
        if key_positions is not None:
            if tuple(key_positions.shape) != (batch, kv_len):
                raise ValueError(f"key_positions: expected shape [{batch}, {kv_len}], got {tuple(key_positions.shape)}")
            keypos[:, :kv_len] = key_positions
        mask = torch.zeros(batch, m, cap, dtype=torch.bool)
        mask[:, :rows, :kv_len] = visible
        mask[:, rows:, cap - 1] = True
        self._copy_ints.put(torch.cat([ints.view(-1), keypos.view(-1)]))
        self._copy_mask.put(mask.view(-1))


def replay_modes(model, static_shapes: bool | None, cuda_graphs: bool | None, compile: bool | str,
                 name: str) -> tuple[bool, bool, bool | str]:  # fmt: skip
    """Resolve and check the (static_shapes, cuda_graphs, compile) options of a user of these classes.

    Defaults: static shapes on CUDA (or when graphs are asked for); CUDA graphs with static shapes
    on one CUDA device, unless the environment sets ``SPECDEC_CUDA_GRAPHS=0``; no compile.
    ``name`` says whose forward it is in the errors (e.g. "the target").
    """
    for arg, val in (("static_shapes", static_shapes), ("cuda_graphs", cuda_graphs)):
        if val is not None and not isinstance(val, bool):
            raise ValueError(f"{arg}: expected None, True or False, got {val!r}")
    compile_plan(compile)  # raises for a bad value
    device = hf.input_device(model)
    one_device = len(model_devices(model)) == 1
    if cuda_graphs:
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs: True needs {name} on a CUDA device, got {device}")
        if not one_device:
            raise ValueError(f"cuda_graphs: True needs {name} on one device, got a model split across devices")
        if static_shapes is False:
            raise ValueError("cuda_graphs: True needs static_shapes, got static_shapes=False")
    if static_shapes is None:
        static_shapes = device.type == "cuda" or bool(cuda_graphs)
    if cuda_graphs is None:
        cuda_graphs = (static_shapes and device.type == "cuda" and one_device
                       and os.environ.get("SPECDEC_CUDA_GRAPHS", "1") != "0")  # fmt: skip
    if compile and not static_shapes:
        raise ValueError("compile: needs static_shapes, got static_shapes=False")
    return bool(static_shapes), bool(cuda_graphs), compile


def model_devices(model) -> set[torch.device]:
    """The devices holding the model's parameters and buffers."""
    devices = {p.device for p in model.parameters()}
    devices |= {b.device for b in model.buffers()}
    return devices
