"""The decoding loop: prefill, then per step draft -> one tree forward -> verify -> commit.

``SpecDecoder(target, drafter, tree_size)`` owns the loop; ``wrap(model, drafter)`` gives a
``generate`` with transformers-like arguments. ``drafter=None`` (or ``tree_size=0``) is plain
autoregressive decoding through the same path (every tree is just its root): the baseline that
matches ``model.generate``.

Shapes: with ``static_shapes=True`` (the default on CUDA) every tree forward has the same
``[B, tree_size + 1]`` input (trees padded with dummy nodes that no real node attends to) and
attends over the whole preallocated cache, so the forward has fixed shapes and buffer addresses.
It runs through ``specdec.graphs.GraphedForward``: inputs copied in place into fixed buffers each
step, and with ``cuda_graphs`` (the default on CUDA) the forward recorded once per (batch size,
n) as a CUDA graph and replayed; without, the same code runs eagerly on the same buffers.
Otherwise trees are padded only to the batch's largest tree and attention reads only the filled
part of the cache (cheaper on CPU).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specdec.drafting import DraftContext, Drafter
from specdec import hf
from specdec.graphs import GraphedForward, replay_modes
from specdec.kv import KVCache
from specdec.sampling import SamplingConfig, logits_to_probs
from specdec.tree import TokenTree
from specdec.verify import Verdict, verify_greedy, verify_stochastic
from treeattn import TreeMask

__all__ = ["GenerationOutput", "SpecDecoder", "SpeculativeModel", "StepStats", "wrap"]

_CAPACITY_STEP = 256  # with CUDA graphs and no max_cache_len, the kept cache grows in these steps


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
        commit_s: seconds in the KV commit and bookkeeping.
        forward_s: the part of ``verify_s`` from handing the inputs to the device to the forward's
            end (device synchronized): the target forward itself.
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
    """

    sequences: torch.Tensor
    lengths: tuple[int, ...]
    prompt_lengths: tuple[int, ...]
    steps: list[StepStats] = field(default_factory=list)
    prefill_s: float = 0.0

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


class SpecDecoder:
    """Speculative decoding of a HuggingFace causal LM with token trees.

    Args:
        target: the target causal LM (any dtype, CPU / CUDA / ``device_map="auto"``); its attention
            is routed through specdec's function (``hf.prepare_model``), which leaves its ordinary
            forward / generate unchanged.
        drafter: a ``specdec.drafting.Drafter``, or None for plain decoding.
        tree_size: node budget per step besides the root (0 = plain decoding).
        max_cache_len: fixed KV capacity per sequence, reused across calls (a request that does not
            fit raises); None sizes the cache per call to prompt + max_new_tokens + tree_size.
        static_shapes: fixed ``[B, tree_size + 1]`` tree forwards over the whole cache through
            ``specdec.graphs.GraphedForward`` (default: True when the target is on CUDA, or when
            ``cuda_graphs`` is True).
        attn_impl: ``treeattn.tree_attention``'s ``impl`` ("auto", "triton", "torch").
        cuda_graphs: replay the target's tree forward as a CUDA graph, captured once per (batch
            size, tree size) and per cache (default None: on when the target is on one CUDA device
            and shapes are static, unless the environment sets ``SPECDEC_CUDA_GRAPHS=0``; False on
            CPU). Needs static shapes. With ``max_cache_len=None``
            the cache is then kept across calls (grown, and the graphs recaptured, only when a
            request does not fit), so that the graphs are reused.
        compile: run the fixed-shape tree forward through ``torch.compile`` before it is captured
            (True: inductor, or a backend name; needs static shapes): fuses the layers'
            elementwise kernels; the tree attention stays one custom op. The first forward of
            each shape compiles (tens of seconds for a real model). Default False.
    """

    def __init__(
        self,
        target,
        drafter: Drafter | None = None,
        tree_size: int = 64,
        *,
        max_cache_len: int | None = None,
        static_shapes: bool | None = None,
        attn_impl: str = "auto",
        cuda_graphs: bool | None = None,
        compile: bool | str = False,
    ) -> None:
        hf.prepare_model(target, "target")
        if not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0:
            raise ValueError(f"tree_size: expected an int >= 0, got {tree_size!r}")
        if attn_impl not in ("auto", "triton", "torch"):
            raise ValueError(f"attn_impl: expected 'auto', 'triton' or 'torch', got {attn_impl!r}")
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 2):
            raise ValueError(f"max_cache_len: expected None or an int >= 2, got {max_cache_len!r}")
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
        # Drafters that read the target's hidden state (Medusa heads) get it in DraftContext.hidden.
        self._wants_hidden = bool(getattr(drafter, "needs_hidden_states", False)) and self.tree_size > 0
        self.max_cache_len = max_cache_len
        self.device = hf.input_device(target)
        self.static_shapes, self.cuda_graphs, self.compile = replay_modes(
            target, static_shapes, cuda_graphs, compile, "the target")
        self.attn_impl = attn_impl
        self._cache: KVCache | None = None
        self._graphs: dict[tuple[int, int], GraphedForward] = {}
        self._num_layers = hf.num_layers(target)  # the KV cache keeps all layers in one tensor

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

    def _get_cache(self, batch: int, need: int) -> KVCache:
        if self.max_cache_len is None:
            if not self.cuda_graphs:
                return KVCache(batch, need, num_layers=self._num_layers)
            # Graphs record the cache's buffer addresses: keep one cache while requests fit.
            if self._cache is None or self._cache.batch_size != batch or self._cache.capacity < need:
                self._cache = KVCache(batch, -(-need // _CAPACITY_STEP) * _CAPACITY_STEP, num_layers=self._num_layers)
            self._cache.reset()
            return self._cache
        if need > self.max_cache_len:
            raise ValueError(
                f"max_new_tokens: prompt + max_new_tokens + tree_size needs {need} cache slots per sequence, "
                f"max_cache_len is {self.max_cache_len}"
            )
        if self._cache is None or self._cache.batch_size != batch:
            self._cache = KVCache(batch, self.max_cache_len, num_layers=self._num_layers)
        self._cache.reset()
        return self._cache

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
                the tokens (host ints) appended to sequence ``seq`` in that step (never empty).

        Returns:
            ``GenerationOutput`` with the sequences and per-step statistics.
        """
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
        sampling = SamplingConfig(temperature, top_k, top_p) if do_sample else None
        eos = set() if eos_token_id is None else ({eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id))
        if pad_token_id is None:
            pad_token_id = min(eos) if eos else 0
        prompts = self._prompts(input_ids, attention_mask)
        batch = len(prompts)
        longest = max(len(p) for p in prompts)
        limit = hf.max_positions(self.target)
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens: prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"target's context of {limit} positions"
            )
        cache = self._get_cache(batch, longest + max_new_tokens + self.tree_size)

        # Committed tokens per sequence (host), prompt included; the last one is the next root.
        seqs = torch.zeros(batch, longest + max_new_tokens + self.tree_size + 1, dtype=torch.int64)
        lens = [len(p) for p in prompts]
        for b, p in enumerate(prompts):
            seqs[b, : len(p)] = p
        # hidden[b]: the target's final hidden state at the token before sequence b's root (the
        # state that predicted the root), for drafters with needs_hidden_states; None if unknown.
        hidden: list[torch.Tensor | None] = [None] * batch
        self._sync()
        t0 = time.perf_counter()
        if longest > 1:
            at = torch.tensor([max(n - 2, 0) for n in lens]) if self._wants_hidden else None
            h = hf.prefill(self.target, seqs[:, : longest - 1], cache, impl=self.attn_impl, hidden_at=at)
            if h is not None:
                hidden = [h[b] if lens[b] > 1 else None for b in range(batch)]
        self._sync()
        prefill_s = time.perf_counter() - t0
        cache.lengths = [n - 1 for n in lens]
        if self.drafter is not None:
            self.drafter.reset([p.clone() for p in prompts])

        done = [False] * batch
        steps: list[StepStats] = []
        while not all(done):
            steps.append(self._step(seqs, lens, done, cache, sampling, generator, eos, max_new_tokens, prompts,
                                    hidden, on_tokens))

        width = max(lens)
        out = torch.full((batch, width), pad_token_id, dtype=torch.int64)
        for b in range(batch):
            out[b, : lens[b]] = seqs[b, : lens[b]]
        return GenerationOutput(out, tuple(lens), tuple(len(p) for p in prompts), steps, prefill_s)

    def _step(self, seqs, lens, done, cache, sampling, generator, eos, max_new_tokens, prompts, hidden,
              on_tokens) -> StepStats:
        batch = len(lens)
        t0 = time.perf_counter()
        trees: list[TokenTree] = []
        contexts: list[DraftContext | None] = []
        for b in range(batch):
            root = seqs[b, lens[b] - 1 : lens[b]]
            if done[b] or self.drafter is None or self.tree_size == 0:
                trees.append(TokenTree(root.clone(), torch.tensor([-1])))
                contexts.append(None)
                continue
            ctx = DraftContext(seqs[b, : lens[b]], self.tree_size, b, sampling, generator, hidden[b])
            trees.append(self._checked_tree(self.drafter.propose(ctx), ctx))
            contexts.append(ctx)
        self._sync()
        t1 = time.perf_counter()

        n = self.tree_size + 1 if self.static_shapes else max(t.n for t in trees)
        cache.check_room(n)
        if self.static_shapes:
            graphed = self._graphed(cache, batch, n)
            tf0 = time.perf_counter()
            graphed.load(trees, cache.lengths)  # padding nodes hang off the root
            logits, node_hidden = graphed.forward()
        else:
            tokens = torch.zeros(batch, n, dtype=torch.int64)
            parents = torch.zeros(batch, n, dtype=torch.int64)  # padding nodes hang off the root
            for b, t in enumerate(trees):
                tokens[b, : t.n] = t.tokens.cpu()
                parents[b, : t.n] = t.parents.cpu()
            parents[:, 0] = -1
            mask = TreeMask.from_parents(parents)
            prefix = torch.tensor(cache.lengths, dtype=torch.int64)
            kv_len = max(cache.lengths) + n
            tf0 = time.perf_counter()
            out = hf.tree_forward(self.target, tokens, mask, prefix, cache, kv_len=kv_len, impl=self.attn_impl,
                                  return_hidden=self._wants_hidden)
            logits, node_hidden = out if self._wants_hidden else (out, None)
        self._sync()
        forward_s = time.perf_counter() - tf0
        verdicts: list[Verdict | None] = []
        for b, t in enumerate(trees):
            if done[b]:
                verdicts.append(None)
            elif sampling is None:
                verdicts.append(verify_greedy(t, logits[b, : t.n]))
            else:
                probs = logits_to_probs(logits[b, : t.n], sampling)
                verdicts.append(verify_stochastic(t, probs, generator))
        self._sync()
        t2 = time.perf_counter()

        emitted, accepted, streamed = [], [], []
        keep: list[tuple[int, ...] | None] = []  # per sequence, the accepted nodes whose KV is committed
        for b, v in enumerate(verdicts):
            if v is None:
                emitted.append(0)
                accepted.append(0)
                keep.append(None)
                continue
            new = v.new_tokens(trees[b])
            room = len(prompts[b]) + max_new_tokens - lens[b]
            new = new[:room]
            for j, tok in enumerate(new):
                if tok in eos:
                    new = new[: j + 1]
                    break
            seqs[b, lens[b] : lens[b] + len(new)] = torch.tensor(new, dtype=torch.int64)
            lens[b] += len(new)
            if lens[b] - len(prompts[b]) >= max_new_tokens or (new and new[-1] in eos):
                done[b] = True
            emitted.append(len(new))
            accepted.append(v.num_accepted)
            # The root and the accepted nodes whose tokens were kept (a path cut by max_new_tokens or
            # eos commits only its kept part): the cache always holds a sequence's tokens but its last.
            keep.append(v.path[: len(new)])
            if node_hidden is not None:  # predicted the bonus token, the next root; copied: the
                hidden[b] = node_hidden[b, v.path[-1]].clone()  # next forward overwrites node_hidden
            if new:
                streamed.append((b, list(new)))
        cache.commit(keep)  # nodes already in place (a first-child chain) are not copied
        self._sync()
        t3 = time.perf_counter()
        if on_tokens is not None:
            for b, new in streamed:
                on_tokens(b, new)
        if self.drafter is not None:
            for b, v in enumerate(verdicts):
                if contexts[b] is not None:
                    self.drafter.update(contexts[b], trees[b], v)
        t4 = time.perf_counter()
        return StepStats(
            nodes_proposed=tuple(t.n - 1 for t in trees),
            tokens_accepted=tuple(accepted),
            tokens_emitted=tuple(emitted),
            draft_s=(t1 - t0) + (t4 - t3),
            verify_s=t2 - t1,
            commit_s=t3 - t2,
            forward_s=forward_s,
        )

    def _graphed(self, cache: KVCache, batch: int, n: int) -> GraphedForward:
        """The fixed-buffer forward of shape ``[batch, n]`` over ``cache`` (captured on first use)."""
        if any(g.cache is not cache for g in self._graphs.values()):  # a new cache: old graphs are stale
            self._graphs = {k: g for k, g in self._graphs.items() if g.cache is cache}
        graphed = self._graphs.get((batch, n))
        if graphed is None:
            graphed = self._graphs[(batch, n)] = GraphedForward(
                self.target, cache, batch, n, impl=self.attn_impl, return_hidden=self._wants_hidden,
                capture=self.cuda_graphs, compile=self.compile,
            )  # fmt: skip
        return graphed

    def _checked_tree(self, tree, ctx: DraftContext) -> TokenTree:
        if not isinstance(tree, TokenTree):
            raise ValueError(f"drafter: propose() must return a specdec.TokenTree, got {type(tree).__name__}")
        if tree.n - 1 > ctx.tree_size:
            raise ValueError(f"drafter: expected at most tree_size = {ctx.tree_size} nodes besides the root, got {tree.n - 1}")
        root, last = int(tree.tokens[0]), int(ctx.tokens[-1])
        if root != last:
            raise ValueError(f"drafter: expected the tree's root token to be the last committed token {last}, got {root}")
        if ctx.sampling is not None and tree.proposal != "topk" and tree.draft_probs is None:
            raise ValueError(f"drafter: a {tree.proposal!r} tree needs draft_probs for stochastic verification")
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
    ):
        """Like ``model.generate``; unset sampling / eos arguments come from ``model.generation_config``.

        Returns ``sequences`` (int64 ``[B, T]``, prompts without padding, right-padded), or the
        full ``GenerationOutput`` with ``return_output=True``.
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
        )
        return out if return_output else out.sequences


def wrap(model, drafter: Drafter | None, tree_size: int = 64, **decoder_kwargs) -> SpeculativeModel:
    """``specdec.wrap(model, drafter).generate(input_ids, max_new_tokens=...)`` decodes speculatively.

    ``decoder_kwargs`` go to ``SpecDecoder`` (``max_cache_len``, ``static_shapes``, ``attn_impl``,
    ``cuda_graphs``, ``compile``).
    """
    return SpeculativeModel(model, drafter, tree_size, **decoder_kwargs)
