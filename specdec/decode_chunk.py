"""Plain decoding, several steps per replay: ``DecodeChunk`` over a ``[B, 1]`` ``GraphedForward``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.graphs import GraphedForward, graph_capture
from specdec.sampling import SamplingConfig, logits_to_probs, sample_inverse_cdf
from specdec.tree import TokenTree

__all__ = ["DecodeChunk"]


class DecodeChunk:
    """``steps`` plain-decoding steps of a ``[B, 1]`` ``GraphedForward`` in one replay: greedy, or
    sampled from the warped target distribution.

    Plain decoding through ``GraphedForward`` pays a host round trip per token: load the root,
    replay, pick the token, copy it to the host, bookkeeping (docs/ENGINE.md: what it costs). Here
    the device feeds itself: each step runs the forward's body on its inputs, picks each row's next
    token from its logits ``[B, 1, V]`` -- greedy: their argmax (the same op as the engine's greedy
    verdict); ``sampling``: an inverse-CDF draw (``specdec.sampling.sample_inverse_cdf``, what the
    stochastic verification draws its bonus tokens with) from ``logits_to_probs(logits, sampling)``
    with the run's uniform of that row and step -- writes it as the next step's input token and as
    column k of ``tokens``, and moves every sequence's position, cache slot and prefix length one
    on. With ``forward.capture`` the ``steps`` steps are recorded as ONE CUDA graph (the forward's
    compiled body, if any, is reused: no second compile); otherwise they run eagerly on the same
    buffers (what CPU tests check). No host sync inside.

    Args:
        forward: the ``[B, 1]`` forward (``n == 1``, logits of its one node); its input buffers are
            the chunk's: a chunk's run leaves them advanced, and the next ``forward.load`` rewrites
            them.
        steps: decoding steps per run (>= 1).
        sampling: None: greedy; a ``specdec.SamplingConfig``: sampled (recorded in the graph: one
            chunk per configuration).

    Use: ``run(roots, prefix_lens, generator=None)`` -> ``tokens`` ``[B, steps]`` (device int64,
    overwritten by the next run): row b's continuation of root ``roots[b]`` whose KV goes to slot
    ``prefix_lens[b]`` (the tokens' KV to the next ``steps - 1`` slots, which must fit in the cache:
    ``prefix_lens[b] + steps <= capacity``). Sampled runs draw ``B x steps`` float64 uniforms from
    ``generator`` (any device; None: torch's default one of the forward's device) before the replay,
    so each token is an independent draw from its row's distribution given the tokens before it. A
    row with no mass (NaN logits) gives token V (callers raise; the next step reads token V - 1).
    Every row decodes all ``steps`` steps: callers cut at eos.

    With a forward that returns hidden states (``return_hidden``: a drafter reads them), each step's
    ``[B, 1, D]`` rows are kept too: ``hidden`` ``[B, steps, D]`` after a run, row k the state of the
    token step k fed (the one that predicted ``tokens[:, k]``).
    """

    def __init__(self, forward: "GraphedForward", steps: int, sampling: SamplingConfig | None = None) -> None:
        if not isinstance(forward, GraphedForward) or forward.n != 1:
            got = f"GraphedForward of n = {forward.n}" if isinstance(forward, GraphedForward) else type(forward).__name__
            raise ValueError(f"forward: expected a GraphedForward of n = 1, got {got}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling: expected None (greedy) or a specdec.SamplingConfig, got {type(sampling).__name__}")
        self.forward = forward
        self.steps = steps
        self.sampling = sampling
        self.batch = forward.batch
        #: ``[B, steps]`` tokens of the last run
        self.tokens = torch.zeros(forward.batch, steps, dtype=torch.int64, device=forward.device)
        #: ``[B, steps]`` float64 uniforms of the run (sampling), written before each replay
        self.uniforms = (None if sampling is None else
                         torch.zeros(forward.batch, steps, dtype=torch.float64, device=forward.device))  # fmt: skip
        #: ``[B, steps, D]`` hidden states of the last run (forwards with ``return_hidden``), made on the first
        self.hidden: torch.Tensor | None = None
        self._root = torch.tensor([-1])
        self.graph = None  # torch.cuda.CUDAGraph once captured
        #: seconds of the capture (eager warm-up of the chunk and its recording); None before it
        self.capture_s: float | None = None
        #: runs (graph replays or eager chunks), for tests and accounting
        self.calls = 0

    def _body(self) -> None:
        fwd = self.forward
        for k in range(self.steps):
            logits, hidden = fwd._run()
            if hidden is not None:
                if self.hidden is None:  # the eager run before a capture makes it, outside the graph
                    self.hidden = hidden.new_empty(self.batch, self.steps, hidden.shape[-1])
                self.hidden[:, k].copy_(hidden[:, -1])
            last = logits[:, -1]  # [B, V]
            if self.sampling is None:
                nxt = last.argmax(dim=-1)  # [B]
            else:
                nxt = sample_inverse_cdf(logits_to_probs(last, self.sampling), self.uniforms[:, k])
            self.tokens[:, k].copy_(nxt)
            fwd.tokens[:, 0].copy_(nxt.clamp(max=last.shape[-1] - 1))  # token V (no mass) is the caller's error
            fwd.positions.add_(1)
            fwd.slots.add_(1)
            fwd.prefix_lens.add_(1)

    def _load(self, roots: Sequence[int], prefix_lens: Sequence[int]) -> None:
        if len(roots) != self.batch:
            raise ValueError(f"roots: expected {self.batch} root tokens, got {len(roots)}")
        room = self.forward.cache.capacity
        if any(int(p) + self.steps > room for p in prefix_lens):
            raise ValueError(f"prefix_lens: expected prefix_len + steps ({self.steps}) <= the cache capacity {room}, "
                             f"got {max(int(p) for p in prefix_lens)}")  # fmt: skip
        trees = [TokenTree(torch.tensor([int(r)]), self._root) for r in roots]
        self.forward.load(trees, prefix_lens)

    @torch.no_grad()
    def run(self, roots: Sequence[int], prefix_lens: Sequence[int],
            generator: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
        """``steps`` tokens per sequence after ``roots`` (see the class doc): ``[B, steps]``."""
        fwd = self.forward
        self._load(roots, prefix_lens)
        if self.uniforms is not None:
            where = generator.device if generator is not None else self.uniforms.device
            u = torch.rand(self.batch, self.steps, dtype=torch.float64, generator=generator, device=where)
            self.uniforms.copy_(u, non_blocking=True)
        if fwd.capture:
            if self.graph is None:
                self._capture()
                self._load(roots, prefix_lens)  # the capture's eager warm-up advanced the inputs
            self.graph.replay()
        else:
            self._body()
        self.calls += 1
        return self.tokens

    def _capture(self) -> None:
        """Run the chunk once eagerly on a side stream (the forward's first run before it, if it has
        not run: compile, kernel loading, cache buffers; the argmax's and the updates' kernels), then
        record it. The eager run writes the slots the replay rewrites."""
        fwd = self.forward
        device = fwd.device
        start = fwd._clock()
        if fwd.first_run_s is None:
            fwd.forward()  # compiles / captures the [B, 1] forward itself: nothing lazy is left for ours
            start = fwd._clock()
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                self._body()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with graph_capture(graph):
                self._body()
        self.graph = graph
        self.capture_s = fwd._clock() - start
