"""EAGLE-2-style dynamic trees from an ``EagleHead`` (drafters.eagle_head) on the target's hidden states.

**The drafter** (``EagleDrafter``, EAGLE-2's dynamic tree). Per sequence the head keeps its own
KV cache (one layer: keys / values of the pairs it has seen, ``specdec.KVCache``). Per step, with
root r = the last committed token at position L - 1:

1. **Catch up**: one causal forward over the pairs the cache lacks, ending with the root's pair
   ``(f_{L-2}, r)``; its output ``y_{L-1}`` gives the root's children. Features come from the
   engine (``DraftContext.hidden``) where it has them, else from the head's own predictions kept
   from the last step; a pair with neither is skipped (the head simply never attends to it).
   With static shapes a chain of at most ``FUSED_CATCH_UP`` pairs (the accepted path of every step;
   the prompt at the first step unless it is longer) runs padded -- to ``static_width`` rows or the
   next power-of-two multiple of it, one expansion (and graph) per width -- at the start of the
   expansion below, inside its CUDA graph; a longer one runs on its own first.
2. **Expand, one forward per depth, on the device**: the ``topk`` candidates of best cumulative
   draft log-probability at depth d (ties: the earlier candidate) run as one forward of ``topk``
   queries (pair = their token and their parent's output feature, position = root's + d), attending
   to the committed pairs and, through an explicit tree mask, to their expanded ancestors (written
   into the cache right after the committed pairs, root first). Each expanded node contributes its
   top-``w`` children. Everything between two forwards stays on the device (``drafters.eagle_expansion.Expansion``): the
   LM head, log-softmax (after the target's warping when sampling), per-row top-``w``, cumulative
   scores (float64, as the former host loop added them), a stable sort for the next frontier, the
   frontier's ancestor rows (parent's row | its own bit) and from them the mask. Shapes depend only
   on (``topk``, ``w``, depth) and the cache, so the loop is one CUDA graph (``cuda_graphs``).
   Per depth the candidates' tokens, scores and the picked frontier go to one preallocated record.
3. **Re-rank**: the best ``tree_size`` candidates by cumulative draft log-probability, ties to the
   earlier candidate -- the nodes and order of ``drafters._build.best_first`` over the former host
   loop's node pool (ancestor-closed), then depth-first. With ``rerank="device"`` (or ``"auto"``
   with CUDA graphs and ``compile_head``) on the device right after the loop, inside its graph
   (``rerank_record``: stable ranks by score, subtree sizes and depth-first indices depth by depth),
   and the tree (tokens, parents, expanded indices) is copied to the host; else (the default) the
   record is copied and re-ranked there (numpy, vectorized: ``ExpansionPlan.tree``). Either way one device-to-host copy per step, the
   step's only one. Children are deterministic (``"topk"``), so stochastic verification stays
   lossless without ``draft_probs``.
4. **Commit** (``update``): the accepted path's expanded nodes keep their KV (``KVCache.commit``);
   the last one's output feature is kept for the next step's catch-up.

Cost per step: ``depth`` head forwards (one layer + the LM head on at most ``topk`` rows each), the
step's integer inputs staged once in pinned memory (two host-to-device copies with a fused catch-up:
the scalars, its rows; plus the features' device copy) and one device-to-host copy of the tree or
the record (the only sync); with CUDA graphs, one replay for the catch-up, the expansion and (on the
device) the re-rank together; the re-rank picks the nodes the former per-depth host loop's pool and
``best_first`` picked, so trees are identical to it. At batch B the engine asks for all sequences at
once (``propose_batch``): each sequence's expansion is launched with its copy queued behind it before
the first tree is read, so the host's per-sequence work (catch-up inputs, the re-rank) overlaps the
device's replays instead of waiting for each. ``last_forwards`` / ``last_draft_s`` (and the
running ``draft_s`` / ``proposals``) let a benchmark report drafting time per step; ``profile=True``
splits it into phases (``last_phase_s``, below).

**Reduced draft vocabulary** (EAGLE-3's idea; ``EagleDrafter(draft_vocab=N)``): the head drafts only
among the N most frequent tokens of its training answers (``EagleHead.token_ids``, counted by
``train-eagle`` and saved beside the head as ``draft_vocab.safetensors``). The rows of the target's
frozen LM head for those tokens are gathered once (``[N, H]``, ids sorted ascending), every draft
logit is computed from them, the top-k runs over the subset and the indices map back to token ids:
the LM-head read per depth drops from V x H to N x H. Log-probabilities are renormalized over the
subset, and with a sampling transform the warping (temperature, top-k, top-p) is applied to the
subset's logits: the draft distribution is then the warped distribution *of the subset*. Children
stay deterministic top-k, so verification stays lossless; tokens outside the subset are simply
never drafted. This covers the root's children too (they come from the first depth of the expansion,
on the catch-up's root feature). **Prompt tokens** (``prompt_vocab``, default on): the training
answers hold few distinct tokens (about 5k for MBPP's), so a larger subset ends in never-seen ones,
while answers copy identifiers from their prompt; each call's first proposal therefore puts the
prompts' tokens that the subset lacks in place of its least frequent ones, regathered into the same
buffers (the captured graphs stay valid); a call that never drafts gathers nothing.

**Profiling** (``EagleDrafter(profile=True)``): ``propose`` synchronizes the device at its phase
boundaries and keeps ``last_phase_s`` = seconds of ``catch_up`` (host preparation; an unfused
catch-up's input copy and forward), ``expand`` (loading the expansion's inputs and the expansion:
graph replay or eager loop, a fused catch-up, a device re-rank and any capture included), ``copy``
(the record or the tree to the host), ``host_tree`` (a host re-rank, ``TokenTree``); ``update`` adds
``update`` (KV commit of the accepted path) to the same dict. The syncs serialize host and device
work a normal step overlaps, so the sum is an upper bound of the unprofiled step. Off (default): no sync, ``last_phase_s`` stays None.

What the engine provides today (``specdec.drafting``; ``needs_hidden_states = "all"``): the
target's features of *every* committed token, each once per ``generate`` call, as
``DraftContext.hidden`` of shape ``[m, H]`` = the features at positions ``L - 1 - m .. L - 2``: the
whole prompt's but its last token at the first step, afterwards the accepted path's (the root and
the accepted drafted nodes; the last row predicted the new root). So every committed pair is built
from the target's real feature: the catch-up recomputes the pairs of accepted drafted tokens
(computed from the head's own predicted features while drafting) with the real ones, as EAGLE
does. A one-token prompt has no feature at its first step (the tree is root-only). ``propose``
also takes fewer rows (e.g. ``[H]``: only ``f_{L-2}``); pairs without a real feature then use the
head's own predictions or are skipped -- a degraded catch-up. Verification -- and so greedy
equality and lossless sampling -- does not depend on it.

**Multi-layer features** (EAGLE-3; a head with ``EagleConfig.feature_layers``): the drafter's
``feature_layers`` asks the engine for the outputs of those target layers instead of the final
feature, so ``DraftContext.hidden`` is ``[m, k * H]``; each step's new rows go through the head's
``fuse`` once, as they arrive, and from there on everything above is unchanged: the catch-up reads
fused target features (or, for a pair without one, the head's own kept output), the expansion its
own outputs -- the unrolled training's steps (``training.eagle.unrolled_features``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from drafters._build import expanded_path, root_only
from drafters.draft_model import pick_attention
from drafters.draft_model_loop import ATTENTIONS
from drafters.eagle_expansion import CatchUp, Expansion, ExpansionPlan, expand_depths, rerank_rows
from drafters.eagle_head import (ATTENTION_NAME, CONFIG_NAME, VOCAB_NAME, WEIGHTS_NAME, EagleConfig, EagleHead,
                                 TargetParts, rank_tokens)
from specdec import hf
from specdec.attention import MaskedState, TreeState
from specdec.drafting import BaseDrafter, DraftContext
from specdec.fused import fuse_norms, fuse_projections
from specdec.graphs import compile_fixed_shapes
from specdec.kv import KVCache
from specdec.sampling import SamplingConfig
from specdec.timing import PhaseTimer, device_sync
from specdec.transfer import to_device
from specdec.tree import TokenTree
from specdec.verify import Verdict

__all__ = [
    "ATTENTION_NAME",
    "AUTO_DRAFT_VOCAB",
    "AUTO_PROMPT_ROOM",
    "CONFIG_NAME",
    "DRAFT_PHASES",
    "FUSED_CATCH_UP",
    "RERANKS",
    "VOCAB_NAME",
    "WEIGHTS_NAME",
    "EagleConfig",
    "auto_draft_vocab",
    "EagleDrafter",
    "EagleHead",
    "TargetParts",
    "rank_tokens",
]

#: The largest draft vocabulary of ``draft_vocab="auto"`` (EAGLE-3's size): at the 1.5B's shapes the draft LM
#: head per depth reads 32,768 x 1,536 weights (39 us on an H100) instead of 151,936 x 1,536 (~5x that).
AUTO_DRAFT_VOCAB = 32768
#: ``draft_vocab="auto"``'s room for prompt tokens (``prompt_vocab``) beyond the tokens seen in training.
AUTO_PROMPT_ROOM = 2048

#: ``EagleDrafter(rerank=)`` values: where the expansion's record is re-ranked into the tree.
RERANKS = ("auto", "device", "host")
#: ``EagleDrafter.last_phase_s`` keys of one ``propose`` (``update`` adds ``"update"``).
DRAFT_PHASES = ("catch_up", "expand", "copy", "host_tree")
#: Longest chain of pairs a step's catch-up runs inside the expansion's graph (padded to a power-of-two
#: multiple of ``static_width``): every accepted path, and prompts up to this length, so that no head
#: forward runs eagerly (docs/ENGINE.md: eager catch-ups cost tens of ms on a GPU). Longer prompts run
#: eagerly before the expansion. One graph per width.
FUSED_CATCH_UP = 2048


def auto_draft_vocab(head: EagleHead) -> int | None:
    """``draft_vocab="auto"`` for a head with token frequencies (``train-eagle`` saves them): the tokens
    its training answers hold plus ``AUTO_PROMPT_ROOM`` for the prompts' (``prompt_vocab``), rounded up
    to a multiple of 1,024 and at most ``AUTO_DRAFT_VOCAB``; None (the whole vocabulary) without
    frequencies or when that is not smaller. Beyond the seen tokens the ranking is by token id (count
    0), so a larger subset only adds tokens the head never saw follow anything: on HumanEval 94.65 %
    of the target's output tokens are among MBPP's 6,018 seen ones at 8,192 and at 32,768 alike
    (specdec/PERF.md v30), and the LM head costs a quarter."""
    if head.token_ids is None:
        return None
    seen = int((head.token_counts > 0).sum())
    size = min(AUTO_DRAFT_VOCAB, -(-(seen + AUTO_PROMPT_ROOM) // 1024) * 1024)
    return size if size < len(head.token_ids) else None


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (no copy), or a host copy of a device one."""
    return (t if t.device.type == "cpu" else t.cpu()).numpy()


@dataclass
class _Proposal:
    """The last proposed tree of a sequence, for ``update``."""

    n: int  # tree nodes
    node_exp: list[int]  # tree node -> expanded index (-1: a leaf the head never ran)
    exp_feat: torch.Tensor  # [E, H] output features of the expanded nodes, index 0 = the root (a reused buffer)
    base: int  # cache slot of expanded node 0 (the root's pair); expanded node e sits at base + e
    root_pos: int  # position of the root


@dataclass
class _Prepared:
    """One sequence's step after its catch-up's preparation (``EagleDrafter._prepare``): what its
    expansion needs."""

    st: "_SeqState"
    plan: ExpansionPlan
    sampling: SamplingConfig | None
    base: int
    root_pos: int
    root: int
    root_out: torch.Tensor | None  # the unfused catch-up's output for the root; None when fused
    catch_up: CatchUp | None  # the fused catch-up's inputs; None when unfused
    budget: int


@dataclass
class _Launched:
    """One sequence's expansion, launched: ``read()`` waits for its host copy and gives the tree, each
    tree node's expanded index and the ``[E, H]`` expanded features (``EagleDrafter._expand``)."""

    st: "_SeqState"
    read: Callable[[], "tuple[TokenTree, list[int], torch.Tensor]"]
    base: int
    root_pos: int


@dataclass
class _SeqState:
    cache: KVCache  # the head's KV; slots [0, len(slot_pos)) hold committed pairs
    slot_pos: list[int] = field(default_factory=list)  # position of the pair in each committed slot (ascending)
    #: the tokens the committed pairs were computed for (int64, a copy: compared with each step's history)
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    feats: dict[int, torch.Tensor] = field(default_factory=dict)  # position q -> predicted f_q (for pair q + 1)
    last: _Proposal | None = None
    #: (plan, sampling) -> its expansion over ``cache`` (buffers and CUDA graph; dropped with the cache)
    expansions: dict[tuple[ExpansionPlan, SamplingConfig | None], Expansion] = field(default_factory=dict)


class EagleDrafter(BaseDrafter):
    """EAGLE-2-style dynamic trees from an ``EagleHead`` on the target's hidden states.

    Args:
        target: the target causal LM (its embedding, rotary embedding and LM head are used frozen).
        head: an ``EagleHead`` made for ``target`` (moved to the target's LM-head device; its dtype
            is kept, so load it in the target's dtype: ``EagleHead.load(..., dtype=...)``).
        tree_size: default node budget when the engine asks for more (None = the engine's).
        depth: tree depth = head forwards per step (one catch-up / root forward, then one per depth).
        topk: frontier width: nodes expanded per depth after the root; each expanded node offers
            ``max(topk, ceil(tree_size / expanded))`` children so that trees fill their budget.
        static_shapes: every head forward attends over the whole cache (``kv_len`` = capacity), and
            the catch-up runs ``max(topk, 2)`` query rows (padding rows write a scratch slot; longer
            chains run unpadded): fixed shapes. Default: True on CUDA.
        cuda_graphs: replay each step's expansion loop (every head forward after the catch-up, the
            top-k and the frontier selection between them) as one CUDA graph, captured per sequence,
            (topk, children, depth, sampling transform) and cache; needs ``static_shapes`` and the
            head on CUDA. Default: True there unless the environment sets ``SPECDEC_CUDA_GRAPHS=0``
            (False on other devices; True there raises).
        draft_vocab: ``"auto"`` (default): the tokens seen in training plus room for the prompts', at most
            ``AUTO_DRAFT_VOCAB``, when the head was saved with token frequencies and the vocabulary is
            larger (``auto_draft_vocab``), else the whole vocabulary.
            None = draft over the whole vocabulary; N = only over the head's N most frequent
            training-answer tokens (``EagleHead.token_ids``; the LM-head rows of those tokens are
            gathered once, ``[N, H]`` in the LM head's dtype; see the module doc). Needs a head saved
            with token frequencies (``train-eagle``); 1 <= N <= V.
        prompt_vocab: with ``draft_vocab``, each ``generate`` call's first proposal puts the prompts'
            tokens missing from the subset in place of its least frequent ones (a subset larger than
            the training answers' distinct tokens ends in never-seen ones), so that identifiers the
            answer copies from its prompt can be drafted. Default True.
        profile: synchronize the device at the phase boundaries of every ``propose`` / ``update``
            and keep their seconds in ``last_phase_s`` (keys ``DRAFT_PHASES`` + ``"update"``).
        attention: how each depth's head forward attends: ``"sdpa"`` (its picked nodes as queries under
            an explicit mask over the head's cache), ``"tree"`` (all expanded nodes as queries through
            treeattn's kernel, which reads the committed pairs once, split over many blocks; needs
            ``static_shapes``; ``expand_depths``) or ``"auto"`` (default): ``"tree"`` with static shapes
            on a CUDA device unless the target's layers are soft-capped or windowed, else ``"sdpa"``.
        compile_head: run the expansion's depth loop (every head forward after the root's, the LM
            head, top-k and frontier selection) through ``torch.compile`` (True: inductor; or a
            backend name) before its capture: fewer, fused kernels per depth. Compiled once per
            (plan, sampling transform, cache capacity) and shared by the catch-up widths (the
            catch-up stays uncompiled); the device re-rank (``rerank="device"``) is compiled likewise,
            once per plan. Needs ``static_shapes``. Default False.
        rerank: where the expansion's record becomes the tree (the same nodes in the same order
            either way): ``"device"`` (``drafters.eagle_expansion.rerank_record`` after the depth
            loop, inside its CUDA graph with ``cuda_graphs``; the tree comes back to the host instead
            of the record), ``"host"`` (numpy over the record's host copy, ``ExpansionPlan.tree``)
            or ``"auto"`` (default): ``"device"`` with ``cuda_graphs`` and ``compile_head`` (compiled,
            a few fused kernels; uncompiled, its ~80 small kernels would likely cost the graph more
            device time than the numpy re-rank costs the host), else ``"host"``. Measured on an H100
            (specdec/PERF.md v29): the step's host tree work 0.29 -> 0.08 ms, its CUDA tests passed.
        batch_streams: at batch B >= 2, ``propose_batch`` spreads the sequences' expansions over this
            many side CUDA streams (round robin) so that they run side by side on the device; 0: all on
            the current stream, one after another (each sequence's host work still overlaps the device
            work before it). Each sequence's captured expansion has its own buffers and graph memory,
            so they may run at once. Default 8: drafting at the 1.5B's shapes (depth 8, H200) at B = 4 /
            8 / 16 took 3.4 / 5.3 / 10.5 ms a step against 4.8 / 9.2 / 17.2 ms with 0 (specdec/PERF.md
            v36). Ignored off CUDA.
        batch_expansion: with static shapes, ``propose_batch`` draws the trees of all of a call's
            sequences in ONE expansion where it can (every sequence asked, fused catch-ups, one plan):
            the head's forwards, the top-k and the re-ranks of the B sequences in one body (one CUDA
            graph), the sequences' head caches copied into its batch cache and back. The same trees
            as one proposal at a time. Default False: not yet measured on a GPU (specdec/PERF.md v36).

    Needs ``DraftContext.hidden`` (``needs_hidden_states = "all"``): ``[m, H]`` = the features at
    positions ``L - 1 - m .. L - 2`` (what the engine passes: those not given before; full catch-up,
    see the module doc), or ``[H]`` = only the one that predicted the root. Without it the tree is
    root-only. A head with feature layers asks the engine for them (``feature_layers``, the head's):
    the rows are then ``k * H`` wide.
    """

    needs_hidden_states = "all"  # every committed token's target feature (specdec.drafting.HIDDEN_ALL)

    def __init__(self, target, head: EagleHead, tree_size: int | None = None, depth: int = 6, topk: int = 8, *,
                 static_shapes: bool | None = None, cuda_graphs: bool | None = None, draft_vocab: int | str | None = "auto",
                 profile: bool = False, compile_head: bool | str = False,
                 prompt_vocab: bool = True, attention: str = "auto", rerank: str = "auto",
                 batch_streams: int = 8, batch_expansion: bool = False) -> None:  # fmt: skip
        hf.check_causal_lm(target, "target")
        if not isinstance(head, EagleHead):
            raise ValueError(f"head: expected a drafters.eagle.EagleHead, got {type(head).__name__}")
        head.config.check(target, "head")
        for name, val in (("depth", depth), ("topk", topk)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if tree_size is not None and (not isinstance(tree_size, int) or isinstance(tree_size, bool) or tree_size < 0):
            raise ValueError(f"tree_size: expected None or an int >= 0, got {tree_size!r}")
        for name, val in (("static_shapes", static_shapes), ("cuda_graphs", cuda_graphs)):
            if val is not None and not isinstance(val, bool):
                raise ValueError(f"{name}: expected None, True or False, got {val!r}")
        if not isinstance(profile, bool):
            raise ValueError(f"profile: expected True or False, got {profile!r}")
        if not isinstance(prompt_vocab, bool):
            raise ValueError(f"prompt_vocab: expected True or False, got {prompt_vocab!r}")
        if not isinstance(batch_expansion, bool):
            raise ValueError(f"batch_expansion: expected True or False, got {batch_expansion!r}")
        if attention != "auto" and attention not in ATTENTIONS:
            raise ValueError(f"attention: expected 'auto' or one of {ATTENTIONS}, got {attention!r}")
        if rerank not in RERANKS:
            raise ValueError(f"rerank: expected one of {RERANKS}, got {rerank!r}")
        if not isinstance(batch_streams, int) or isinstance(batch_streams, bool) or batch_streams < 0:
            raise ValueError(f"batch_streams: expected an int >= 0, got {batch_streams!r}")
        if not isinstance(compile_head, (bool, str)) or compile_head == "":
            raise ValueError(f"compile_head: expected a bool or a torch.compile backend name, got {compile_head!r}")
        if draft_vocab == "auto":
            draft_vocab = auto_draft_vocab(head)
        if draft_vocab is not None:
            if not isinstance(draft_vocab, int) or isinstance(draft_vocab, bool) or draft_vocab < 1:
                raise ValueError(f"draft_vocab: expected 'auto', None or an int >= 1, got {draft_vocab!r}")
            if head.token_ids is None:
                raise ValueError(f"draft_vocab: expected a head saved with token frequencies ({VOCAB_NAME}, written "
                                 f"by train-eagle), got one without; retrain it or leave draft_vocab=None")  # fmt: skip
            if draft_vocab > len(head.token_ids):
                raise ValueError(f"draft_vocab: expected at most the head's {len(head.token_ids)} ranked token ids, "
                                 f"got {draft_vocab}")  # fmt: skip
        self.parts = TargetParts.of(target)
        self.device = self.parts.lm_head.weight.device
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs: True needs the target's LM head (and the head) on a CUDA device, "
                             f"got {self.device}")  # fmt: skip
        if cuda_graphs and static_shapes is False:
            raise ValueError("cuda_graphs: True needs static_shapes, got static_shapes=False")
        self.head = head.to(self.device).eval()
        # q / k / v and gate / up as one GEMM each and the layer's RMSNorms as one op each in the head's
        # forwards (in place, no extra memory; the head's state dict is unchanged): at a few rows each GEMM
        # only streams its weights and each small kernel costs its launch
        fuse_projections(self.head)
        fuse_norms(self.head)
        #: the target layers whose outputs the head reads (in the engine's ``DraftContext.hidden``; None: the final
        #: feature)
        self.feature_layers = head.config.feature_layers
        self.vocab_size = hf.vocab_size(target)
        self.draft_vocab = draft_vocab
        #: the subset's token ids (int64 ``[N]``, ascending) and LM-head rows (``[N, H]``, bias ``[N]``)
        #: (fixed buffers: ``prompt_vocab`` regathers them in place, so captured graphs stay valid)
        self._vocab_ids = self._vocab_weight = self._vocab_bias = None
        self.prompt_vocab = prompt_vocab
        self._vocab_prompts: list[torch.Tensor] | None = None  # the call's prompts, until its first proposal
        if draft_vocab is not None:
            lm = self.parts.lm_head
            ranked = head.token_ids[:draft_vocab].long().to(self.device)  # most frequent first
            #: per token id, its place among the N most frequent training-answer tokens (0 = most
            #: frequent), N for every other token (int64 ``[V]``, on the device; ``prompt_subset``)
            self._vocab_rank = torch.full((max(self.vocab_size, lm.weight.shape[0]),), draft_vocab, dtype=torch.int64,
                                          device=self.device)  # fmt: skip
            self._vocab_rank[ranked] = torch.arange(draft_vocab, device=self.device)
            self._vocab_ids = torch.empty(draft_vocab, dtype=torch.int64, device=self.device)
            self._vocab_weight = lm.weight.detach().new_empty(draft_vocab, lm.weight.shape[1])
            bias = getattr(lm, "bias", None)
            self._vocab_bias = None if bias is None else bias.detach().new_empty(draft_vocab)
            self._set_vocab(ranked)
        self.profile = profile
        #: seconds per phase of the last ``propose`` (``DRAFT_PHASES``; ``update`` adds ``"update"``)
        #: with ``profile``, a new dict per call; else None
        self.last_phase_s: dict[str, float] | None = None
        self._clock: PhaseTimer | None = None
        self.tree_size = tree_size
        self.depth = depth
        self.topk = topk
        self.static_shapes = (on_cuda or bool(cuda_graphs)) if static_shapes is None else static_shapes
        if cuda_graphs is None:
            cuda_graphs = self.static_shapes and on_cuda and os.environ.get("SPECDEC_CUDA_GRAPHS", "1") != "0"
        self.cuda_graphs = bool(cuda_graphs)
        #: side CUDA streams ``propose_batch`` spreads the sequences' expansions over (none on other devices)
        self._streams = [torch.cuda.Stream(self.device) for _ in range(batch_streams)] if on_cuda else []
        if compile_head and not self.static_shapes:
            raise ValueError("compile_head: needs static_shapes, got static_shapes=False")
        if attention == "tree" and not self.static_shapes:
            raise ValueError("attention: 'tree' needs static_shapes, got static_shapes=False")
        #: how each depth's head forward attends ("auto" resolved): "tree" on CUDA with static shapes
        #: unless the target's layers are soft-capped or windowed (``drafters.draft_model.pick_attention``)
        self.attention = "sdpa" if not self.static_shapes else pick_attention(attention, target, self.device)
        #: the depth loop (``expand_depths``) as run by every expansion: compiled with ``compile_head``
        self._depth_loop = compile_fixed_shapes(expand_depths, compile_head) if compile_head else expand_depths
        #: where the record is re-ranked ("auto" resolved): "device" inside the expansion (its CUDA graph)
        #: with ``cuda_graphs`` and ``compile_head``, else "host"
        if rerank == "auto":
            rerank = "device" if self.cuda_graphs and compile_head else "host"
        self.rerank = rerank
        #: the device re-rank of every row (``rerank_rows``) as run by every expansion: compiled with ``compile_head``
        self._rerank = compile_fixed_shapes(rerank_rows, compile_head) if compile_head else rerank_rows
        self.static_width = max(topk, 2)
        #: ``propose_batch`` draws every sequence's tree in one expansion where it can (``_batchable``)
        self.batch_expansion = batch_expansion
        self._states: dict[int, _SeqState] = {}
        #: (plan, sampling, catch-up width, sequences) -> the one expansion of a call's sequences
        self._batch_expansions: dict[tuple, Expansion] = {}
        #: sequences -> (their head caches, the batch cache their expansions share)
        self._batch_caches: dict[int, tuple[list[KVCache], KVCache]] = {}
        self._call_batch = 0  # the sequences of the current call (``reset``)
        #: ``propose_batch`` calls whose trees one expansion of all the sequences drew (``batch_expansion``)
        self.batched_steps = 0
        #: the least capacity of a new head cache (``warmup`` raises it to what its requests need)
        self._min_cache = 256
        #: head forwards run by the last ``propose`` (tests and accounting)
        self.last_forwards = 0
        #: wall-clock seconds of the last ``propose`` (it ends with its one device-to-host copy, so the
        #: device's drafting work is included), and of any CUDA-graph capture inside it (0.0 if none)
        self.last_draft_s = 0.0
        self.last_capture_s = 0.0
        #: running totals over ``propose`` calls since construction (``draft_s`` includes captures;
        #: ``captured_s``: the captures' seconds, the ``Drafter`` protocol's)
        self.draft_s = 0.0
        self.captured_s = 0.0
        self.proposals = 0

    # ------------------------------------------------------------------ protocol

    def reset(self, input_ids: list[torch.Tensor]) -> None:
        """New ``generate`` call: forget every sequence (cache buffers and captured expansions are
        reused); with ``draft_vocab`` and ``prompt_vocab``, the subset takes in the prompts' tokens at
        the call's first proposal (a call that never drafts gathers nothing)."""
        self._vocab_prompts = list(input_ids) if self._vocab_ids is not None and self.prompt_vocab else None
        self._call_batch = len(input_ids)
        old, self._states = self._states, {}
        for b in sorted(set(old) | set(range(len(input_ids)))):  # slots beyond this batch kept for later calls
            prev = old.get(b)
            if prev is None:
                self._states[b] = _SeqState(self._new_cache(len(input_ids[b]) + 64))
            else:
                prev.cache.reset()
                self._states[b] = _SeqState(prev.cache, expansions=prev.expansions)

    def warmup(self, batch_sizes: Sequence[int] = (1,), max_len: int | None = None, log=None,
               tree_sizes: Sequence[int] = (), sampling: SamplingConfig | None = None) -> None:  # fmt: skip
        """Size the head caches for requests of up to ``max_len`` tokens per sequence (prompt and new
        tokens; called by ``SpecDecoder.warmup``): a cache that grows mid-run drops its expansions,
        so their captures (and, with ``compile_head``, the depth loop's compile for the new
        capacity) would come back inside a timed call.

        With static shapes and ``max_len``, each sequence slot of up to ``max(batch_sizes)`` also runs
        once (with ``cuda_graphs``: captures) every greedy expansion such a request can use: the plan
        of each of ``tree_sizes`` (the budgets the engine will ask with; default ``tree_size`` or
        ``topk``) with each fused catch-up width up to the one of ``min(max_len, FUSED_CATCH_UP)``
        pairs, and unfused beyond ``FUSED_CATCH_UP``. A call's catch-up width varies with its prompt
        and, under ``tree_size="auto"``, with the plain steps since the last drafting: without this,
        each new (slot, width) captured inside a call (1.7 s of one 16-sequence call, specdec/PERF.md
        v36). With ``batch_expansion``, also the one expansion of the first B slots for each B > 1 of
        ``batch_sizes`` at each fused width. With ``sampling`` (the calls' ``SamplingConfig``), the
        same expansions drafting under it as well (16 samples a prompt captured theirs inside timed
        calls). The dummy inputs write slots the next call's catch-up rewrites before any read;
        ``reset`` keeps every slot's expansions. ``log``: a callable given one line (None: quiet)."""
        if max_len is None:
            return
        self._min_cache = max(self._min_cache, max_len + self.topk * self.depth + 2)
        for b, st in list(self._states.items()):
            if st.cache.capacity < self._min_cache:
                self._states[b] = _SeqState(self._new_cache(self._min_cache))
        if not self.static_shapes:
            return
        start, made = time.perf_counter(), 0
        top = self._fused_width(min(max_len, max(FUSED_CATCH_UP, self.static_width)))
        widths = [self.static_width << k for k in range(top.bit_length()) if self.static_width << k <= top]
        widths += [0] if max_len > max(FUSED_CATCH_UP, self.static_width) else []
        budgets = sorted(set(tree_sizes)) or [self.tree_size or self.topk]
        configs = (None, sampling) if sampling is not None else (None,)
        for b in range(max(batch_sizes, default=1)):
            st = self._states.get(b)
            if st is None:
                st = self._states[b] = _SeqState(self._new_cache(self._min_cache))
            for budget, config in itertools.product(budgets, configs):
                plan, _ = self._plan(budget)
                for width in widths:
                    made += self._warm_expansion(st, plan, config, width, budget)
        if self.batch_expansion:
            for rows in sorted({b for b in batch_sizes if b > 1}):
                caches = [self._states[b].cache for b in range(rows)]
                if len({c.capacity for c in caches}) != 1 or not all(c.layer_indices for c in caches):
                    continue
                for budget, config in itertools.product(budgets, configs):
                    plan, _ = self._plan(budget)
                    for width in (w for w in widths if w):
                        made += self._warm_batch_expansion(caches, plan, config, width, budget)
        if made and callable(log):
            log(f"specdec warmup: the EAGLE drafter made {made} expansions for {max(batch_sizes, default=1)} "
                f"sequence slot(s) in {time.perf_counter() - start:.2f} s")

    def _warm_expansion(self, st: _SeqState, plan: ExpansionPlan, sampling: SamplingConfig | None, width: int,
                        budget: int) -> bool:  # fmt: skip
        """Make (with ``cuda_graphs``: capture) ``st``'s expansion of ``plan`` drafting under
        ``sampling`` (None: greedy) and catch-up ``width`` (0: unfused) by running it once on dummy
        inputs: a one-pair catch-up of token 0 at position 0 into slot 0 (the root's pair), or the
        unfused root's zero feature; False if it was made before."""
        if (plan, sampling, width) in st.expansions:
            return False
        exp = self._seq_expansion(st, plan, sampling, width)
        scratch = st.cache.capacity - 1
        kv_lens = [st.cache.capacity] * (plan.depth - 1)
        if width:
            done = exp.launch([0], [0], None, kv_lens, [self._dummy_catch_up(width, scratch)], [budget])
        else:
            zeros = torch.zeros(self.head.hidden_size, dtype=self.head.fc.weight.dtype, device=self.device)
            done = exp.launch([0], [0], [zeros], kv_lens, None, [budget])
        exp.fetch(done)
        return True

    def _warm_batch_expansion(self, caches: list[KVCache], plan: ExpansionPlan, sampling: SamplingConfig | None,
                              width: int, budget: int) -> bool:  # fmt: skip
        """Make (with ``cuda_graphs``: capture) the expansion of the sequences of ``caches`` under
        ``sampling`` at catch-up ``width`` by running it once on ``_warm_expansion``'s dummy inputs in
        every row; False if it was made before."""
        old = self._batch_expansions.get((plan, sampling, width, len(caches)))
        exp = self._batch_expansion(caches, plan, sampling, width)
        if exp is old:
            return False
        rows, catch_up = len(caches), self._dummy_catch_up(width, caches[0].capacity - 1)
        done = exp.launch([0] * rows, [0] * rows, None, [caches[0].capacity] * (plan.depth - 1), [catch_up] * rows,
                          [budget] * rows)  # fmt: skip
        exp.fetch(done)
        return True

    def _dummy_catch_up(self, width: int, scratch: int) -> CatchUp:
        """A warm-up's catch-up of ``width`` rows: one pair, token 0 at position 0 into slot 0 (the
        root's), zero features; the padding rows into ``scratch``."""
        zeros = torch.zeros(1, self.head.hidden_size, dtype=self.head.fc.weight.dtype, device=self.device)
        return CatchUp(1, [0, 0, 0], zeros, 0, 1).padded(width, scratch)

    @torch.no_grad()
    def propose(self, context: DraftContext) -> TokenTree:
        start = time.perf_counter()
        self.last_forwards, self.last_capture_s = 0, 0.0
        self._clock = PhaseTimer(device_sync(self.device), start) if self.profile else None
        try:
            tree = self._finish(self._launch(context))
            if self._clock is not None:
                self._clock.mark("host_tree")
                self.last_phase_s = {p: self._clock.seconds.get(p, 0.0) for p in DRAFT_PHASES}
        finally:
            self._clock = None
        self._count(start, 1)
        return tree

    @torch.no_grad()
    def propose_batch(self, contexts: Sequence[DraftContext]) -> list[TokenTree]:
        """``[propose(c) for c in contexts]`` (the ``Drafter`` protocol's optional method) with one wait
        for the device, not one per sequence: every sequence's catch-up and expansion is launched,
        each with its tree's copy to the host queued behind it, before the first tree is read, so a
        sequence's host work overlaps the device work of those launched before it; with
        ``batch_streams`` the sequences take turns over that many side streams, so their expansions
        (each a few hundred small kernels) also run side by side on the device. With
        ``batch_expansion``, one expansion of all the sequences draws the trees where it can
        (``_batchable``), else each sequence's is launched in turn. ``last_draft_s`` /
        ``last_forwards`` / ``last_capture_s`` then cover the whole batch. With ``profile`` (phase
        times per proposal): one at a time."""
        if self.profile:
            return [self.propose(c) for c in contexts]
        start = time.perf_counter()
        self.last_forwards, self.last_capture_s = 0, 0.0
        self._gather_prompt_vocab()  # on the current stream, before any side stream reads the subset
        streams = self._streams[: len(contexts)] if len(contexts) > 1 else []
        if self.batch_expansion and self.static_shapes and len(contexts) > 1:
            preps = [self._prepare(c) for c in contexts]
            if self._batchable(contexts, preps):
                trees = self._expand_batch(preps)
                self._count(start, len(contexts))
                return trees
            launched = [self._launch_prepared(p) for p in preps]  # on the current stream
        elif not streams:
            launched = [self._launch(c) for c in contexts]
        else:  # every side stream after the work that made the contexts' features; the main one after them
            main = torch.cuda.current_stream(self.device)
            for side in streams:
                side.wait_stream(main)
            launched = []
            for i, c in enumerate(contexts):
                with torch.cuda.stream(streams[i % len(streams)]):
                    launched.append(self._launch(c))
            for side in streams:
                main.wait_stream(side)
        trees = [self._finish(x) for x in launched]
        self._count(start, len(contexts))
        return trees

    def _count(self, start: float, proposals: int) -> None:
        """The drafting counters after ``proposals`` proposals that began at ``start`` (perf_counter)."""
        self.last_draft_s = time.perf_counter() - start
        self.draft_s += self.last_draft_s
        self.proposals += proposals

    def update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        """Keep the KV of the accepted path's expanded nodes; keep the last one's output feature."""
        clock = PhaseTimer(device_sync(self.device)) if self.profile else None
        self._update(context, tree, verdict)
        if clock is not None and self.last_phase_s is not None:
            clock.mark("update")
            self.last_phase_s["update"] = self.last_phase_s.get("update", 0.0) + clock.seconds["update"]

    def _update(self, context: DraftContext, tree: TokenTree, verdict: Verdict) -> None:
        st = self._states.get(context.seq)
        if st is None or st.last is None or st.last.n != tree.n:
            return
        prop, st.last = st.last, None
        path = expanded_path(verdict.path, prop.node_exp)
        st.cache.lengths = [prop.base]
        st.cache.commit([path])
        st.slot_pos += [prop.root_pos + j for j in range(len(path))]
        accepted = _host_array(tree.tokens)[list(verdict.path[1 : len(path)])]
        st.tokens = np.concatenate([_host_array(context.tokens), accepted])
        # predicts the token after the last committed pair: an accepted leaf's, or the next root's
        # (a copy: the expansion's feature buffer is rewritten by the next step)
        st.feats = {prop.root_pos + len(path) - 1: prop.exp_feat[path[-1]].clone()}

    # ------------------------------------------------------------------ internals

    def _launch(self, context: DraftContext) -> "TokenTree | _Launched":
        """Steps 1 and 2 of the module doc for one sequence, up to the expansion's copy to the host
        (queued, not waited for): a root-only tree where there is nothing to expand."""
        return self._launch_prepared(self._prepare(context))

    def _launch_prepared(self, prep: "TokenTree | _Prepared") -> "TokenTree | _Launched":
        """Step 2 of the module doc for a prepared sequence (``_prepare``): expand depth by depth
        (EAGLE-2) on the device, step 3 (the re-rank) when the copy is read."""
        if isinstance(prep, TokenTree):
            return prep
        read = self._expand(prep.st, prep.plan, prep.sampling, prep.base, prep.root_pos, prep.root_out, prep.root,
                            prep.catch_up, prep.budget)  # fmt: skip
        return _Launched(prep.st, read, prep.base, prep.root_pos)

    def _prepare(self, context: DraftContext) -> "TokenTree | _Prepared":
        """Step 1 of the module doc for one sequence: its catch-up's inputs when it runs fused inside
        the expansion (else the catch-up itself), the expansion's inputs, the sequence's state moved
        on to them; a root-only tree where there is nothing to expand."""
        self._gather_prompt_vocab()
        tokens = _host_array(context.tokens)
        n_tok, root = len(tokens), int(tokens[-1])
        root_pos = n_tok - 1
        budget = context.tree_size if self.tree_size is None else min(self.tree_size, context.tree_size)
        st = self._states.get(context.seq)
        if st is None:
            st = self._states[context.seq] = _SeqState(self._new_cache(n_tok + 64))
        st.last = None
        real = self._real_features(context.hidden, n_tok)  # rows for positions first .. n_tok - 2
        # The settled pairs still valid: those of a common token prefix (another history resets).
        c = min(len(st.tokens), n_tok - 1)
        if not np.array_equal(st.tokens[:c], tokens[:c]):
            c = int(np.flatnonzero(st.tokens[:c] != tokens[:c])[0])
        predicted = st.feats if c == len(st.tokens) else {}
        has_root = real is not None or (root_pos - 1) in predicted
        if budget <= 0 or not has_root:
            self._mark("catch_up")
            return root_only(root)

        # 1. catch up: pairs from `start` on are (re)computed, real features first
        start = c if real is None else min(c, real[0] + 1)
        keep = bisect.bisect_left(st.slot_pos, start)
        positions, feats = self._pending(real, predicted, start, n_tok)
        plan, expanded_max = self._plan(budget)  # the expansion's shape
        base = keep + len(positions) - 1  # slot of the root's pair
        self._ensure_capacity(st, keep, base + expanded_max + int(self.static_shapes))  # + the scratch slot
        # a chain of at most FUSED_CATCH_UP pairs runs inside the expansion (its graph); a longer one
        # (a long prompt) or dynamic shapes run it here first
        fused = self._fused_width(len(positions))
        if fused:
            catch_up, root_out = self._catch_up_inputs(st, tokens, positions, feats, keep, base, fused), None
        else:
            catch_up, root_out = None, self._catch_up(st, tokens, positions, feats, keep, base)[-1]
        del st.slot_pos[keep:]
        st.slot_pos += positions[:-1]
        st.tokens = tokens[:-1].copy()
        st.feats = {}
        st.cache.lengths = [base]
        self._mark("catch_up")
        return _Prepared(st, plan, context.sampling, base, root_pos, root, root_out, catch_up, budget)

    def _batchable(self, contexts: Sequence[DraftContext], preps: "list[TokenTree | _Prepared]") -> bool:
        """Whether one expansion of all the call's sequences can draw this step's trees (``propose_batch``):
        static shapes, at least two sequences, every one of the call's asked and expanding (none
        finished or root-only), each catch-up fused, one plan and sampling, head caches written and of
        one capacity."""
        if not self.static_shapes or len(preps) < 2 or len(preps) != self._call_batch:
            return False
        if sorted(c.seq for c in contexts) != list(range(len(preps))):
            return False
        if not all(isinstance(p, _Prepared) and p.catch_up is not None for p in preps):
            return False
        first = preps[0]
        return all(p.plan == first.plan and p.sampling == first.sampling and p.st.cache.layer_indices
                   and p.st.cache.capacity == first.st.cache.capacity for p in preps)  # fmt: skip

    def _batch_expansion(self, caches: list[KVCache], plan: ExpansionPlan, sampling: SamplingConfig | None,
                         width: int) -> Expansion:  # fmt: skip
        """The one expansion of the sequences whose head caches are ``caches`` (made on first use, again
        when a cache changed), in a batch cache shared by every such expansion of those caches."""
        key = (plan, sampling, width, len(caches))
        exp = self._batch_expansions.get(key)
        if exp is None or any(a is not b for a, b in zip(exp.sources, caches)):
            room = self._batch_caches.get(len(caches))
            if room is None or any(a is not b for a, b in zip(room[0], caches)):  # a cache was replaced (grown)
                self._batch_expansions = {k: v for k, v in self._batch_expansions.items() if k[3] != len(caches)}
                cache = KVCache(len(caches), caches[0].capacity, num_layers=1)
                cache.allocate_like(caches[0])
                room = self._batch_caches[len(caches)] = (list(caches), cache)
            exp = self._batch_expansions[key] = Expansion(self, caches, plan, sampling, self.cuda_graphs, width,
                                                          rerank=self.rerank == "device", batch_cache=room[1])  # fmt: skip
        return exp

    def _expand_batch(self, preps: "list[_Prepared]") -> list[TokenTree]:
        """Steps 2 and 3 of the module doc for every sequence of the call in one expansion (its rows the
        sequences, in slot order; each catch-up padded to the widest's width): one launch, one copy to
        the host, then each row's tree; each sequence's proposal kept for ``update``."""
        plan, sampling = preps[0].plan, preps[0].sampling
        width = max(p.catch_up.width for p in preps)
        caches = [p.st.cache for p in preps]
        exp = self._batch_expansion(caches, plan, sampling, width)
        captured = exp.graph is not None
        kv_lens = [caches[0].capacity] * (plan.depth - 1)
        catch_ups = [p.catch_up.padded(width, p.st.cache.capacity - 1) for p in preps]
        done = exp.launch([p.base for p in preps], [p.root_pos for p in preps], None, kv_lens, catch_ups,
                          [p.budget for p in preps])  # fmt: skip
        self._count_capture(exp, captured)
        self.last_forwards += plan.depth
        self.batched_steps += 1
        host = exp.fetch(done)
        trees = []
        for b, p in enumerate(preps):
            tree, node_exp = exp.host_tree(host[b], p.root, p.budget)
            p.st.last = _Proposal(tree.n, node_exp, exp.feat[b], p.base, p.root_pos)
            trees.append(tree)
        return trees

    def _plan(self, budget: int) -> tuple[ExpansionPlan, int]:
        """The expansion's plan for a node budget, and its most expanded nodes (the root included).

        A budget below ``topk`` expands like ``topk`` (then keeps its best ``budget`` nodes), so the
        budgets of an adaptive decoder (``tree_size="auto"``: 4, 8, 16, ...) share one expansion and
        its captured graph instead of capturing (and compiling) one mid-call."""
        shaped = max(budget, self.topk)
        depth = min(self.depth, shaped)
        frontier_width = min(self.topk, shaped)
        expanded_max = 1 + frontier_width * (depth - 1)
        width = min(self.draft_vocab or self.vocab_size, max(frontier_width, math.ceil(shaped / expanded_max)))
        return ExpansionPlan.make(frontier_width, width, depth), expanded_max

    def _finish(self, launched: "TokenTree | _Launched") -> TokenTree:
        """Step 3 of the module doc once the expansion's copy landed: the tree of the best ``budget``
        nodes; the proposal is kept for ``update``."""
        if isinstance(launched, TokenTree):
            return launched
        tree, node_exp, exp_feat = launched.read()
        launched.st.last = _Proposal(tree.n, node_exp, exp_feat, launched.base, launched.root_pos)
        return tree

    def _expand(self, st: _SeqState, plan: ExpansionPlan, sampling: SamplingConfig | None, base: int, root_pos: int,
                root_feat: torch.Tensor | None, root: int, catch_up: "CatchUp | None",
                budget: int) -> "Callable[[], tuple[TokenTree, list[int], torch.Tensor]]":  # fmt: skip
        """Steps 2 and 3 of the module doc (with ``catch_up``: step 1 first, fused), launched; returns
        ``read``: waits for the host copy and gives the tree of the best ``budget`` nodes, each tree
        node's expanded index (-1: never expanded) and the ``[E, H]`` expanded features (device).

        The loop runs on the device (``Expansion``, a CUDA-graph replay with ``cuda_graphs``); with
        ``rerank="device"`` the re-rank runs after it there (``rerank_record``) and the tree comes back
        in one copy, else the record does, from which ``ExpansionPlan.tree`` re-ranks on the host.
        """
        exp = self._seq_expansion(st, plan, sampling, catch_up.width if catch_up is not None else 0)
        cap = st.cache.capacity
        kv_lens = [cap if self.static_shapes else base + plan.offsets[d] + plan.rows[d] for d in range(1, plan.depth)]
        captured = exp.graph is not None
        done = exp.launch([base], [root_pos], None if root_feat is None else [root_feat], kv_lens,
                          None if catch_up is None else [catch_up], [budget])  # fmt: skip
        self._count_capture(exp, captured)
        self.last_forwards += plan.depth - 1 + int(catch_up is not None)
        return lambda: (*exp.host_tree(exp.fetch(done)[0], root, budget), exp.feat[0])

    def _seq_expansion(self, st: _SeqState, plan: ExpansionPlan, sampling: SamplingConfig | None,
                       width: int) -> Expansion:  # fmt: skip
        """``st``'s expansion of ``plan`` under ``sampling`` at catch-up ``width`` (made on first use)."""
        key = (plan, sampling, width)
        exp = st.expansions.get(key)
        if exp is None:
            exp = st.expansions[key] = Expansion(self, st.cache, plan, sampling, self.cuda_graphs, width,
                                                 rerank=self.rerank == "device")  # fmt: skip
        return exp

    def _count_capture(self, exp: Expansion, captured_before: bool) -> None:
        """Count ``exp``'s capture (``last_capture_s``, ``captured_s``) if its launch just made it."""
        if exp.capture and not captured_before:
            self.last_capture_s += exp.capture_s or 0.0
            self.captured_s += exp.capture_s or 0.0

    def _mark(self, phase: str) -> None:
        """With ``profile``: the time since the last mark (device synchronized) goes to ``phase``."""
        if self._clock is not None:
            self._clock.mark(phase)

    def prompt_subset(self, input_ids: Sequence[torch.Tensor]) -> torch.Tensor:
        """The draft vocabulary for these prompts (``draft_vocab`` needed): int64 ``[N]``, ascending,
        on the drafter's device: the N most frequent training-answer tokens with the last k replaced
        by the k prompt tokens (smallest ids first, at most N) that they lack.

        Computed on the device without a host sync (it runs on every ``reset``): the N smallest of a
        per-token key -- a token's frequency rank, or ``id - V`` (below every rank) for a prompt
        token outside the N most frequent.
        """
        n, key = self.draft_vocab, self._vocab_rank.clone()
        prompt = torch.cat([torch.as_tensor(p).flatten() for p in input_ids]).to(self.device, torch.int64)
        ranks = key[prompt]
        key[prompt] = torch.where(ranks >= n, prompt - key.numel(), ranks)
        return torch.sort(torch.topk(key, n, largest=False, sorted=False).indices).values

    def _gather_prompt_vocab(self) -> None:
        """The call's prompts' tokens into the draft vocabulary (``prompt_vocab``), once per call."""
        if self._vocab_prompts is not None:
            self._set_vocab(self.prompt_subset(self._vocab_prompts))
            self._vocab_prompts = None

    def _set_vocab(self, ids: torch.Tensor) -> None:
        """Gather the subset ``ids`` (int64 ``[N]``, distinct) into the fixed buffers, ascending."""
        ids = torch.sort(ids).values.to(self.device)
        lm = self.parts.lm_head
        self._vocab_ids.copy_(ids)
        torch.index_select(lm.weight.detach(), 0, ids, out=self._vocab_weight)
        if self._vocab_bias is not None:
            torch.index_select(lm.bias.detach(), 0, ids, out=self._vocab_bias)

    def _draft_logits(self, feats: torch.Tensor) -> torch.Tensor:
        """float32 draft logits of the output features ``feats [r, H]``: ``[r, V]``, or ``[r, N]`` over
        the ``draft_vocab`` subset (its gathered LM-head rows; column j is token ``_vocab_ids[j]``)."""
        if self._vocab_weight is None:
            return self.parts.logits(feats).float()
        w = self._vocab_weight
        return F.linear(feats.to(w.dtype), w, self._vocab_bias).float()

    def _token_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids of the columns ``idx`` of ``_draft_logits`` (a device gather with ``draft_vocab``)."""
        return idx if self._vocab_ids is None else self._vocab_ids[idx]

    def _real_features(self, hidden: torch.Tensor | None, n_tok: int) -> tuple[int, torch.Tensor] | None:
        """``(first, rows [m, H])``: the head's input features of the target's features at positions
        ``first .. n_tok - 2`` (the last: the root's predictor), from ``DraftContext.hidden`` (``[F]`` or
        ``[m, F]``, F = ``head.feature_width``; fused to ``[H]`` rows by ``head.fuse_features``); None
        without ``hidden``."""
        if hidden is None:
            return None
        h = self.head.feature_width
        rows = hidden[None] if hidden.dim() == 1 else hidden
        if rows.dim() != 2 or rows.shape[1] != h or not 1 <= rows.shape[0] <= n_tok - 1:
            raise ValueError(f"hidden: expected [{h}] or [m, {h}] with 1 <= m <= {n_tok - 1}, "
                             f"got {tuple(hidden.shape)}")
        return n_tok - 1 - rows.shape[0], self.head.fuse_features(rows.to(self.device))

    def _pending(self, real: tuple[int, torch.Tensor] | None, predicted: dict[int, torch.Tensor], start: int,
                 n_tok: int) -> tuple[list[int], torch.Tensor]:  # fmt: skip
        """The pairs to (re)compute, positions ``max(start, 1) .. n_tok - 1`` that have a feature:
        ``(positions, feats [m, H])`` in the head's dtype. Pair p reads the feature at p - 1: the
        target's real one (``real``'s rows, contiguous up to the root's predictor) where there is one,
        else the head's own prediction (``predicted``: what the last step kept); pairs with neither are
        left out. Built from slices of the real rows, not row by row (a long prompt's first step)."""
        lo = max(start, 1)
        first = n_tok - 1 if real is None else real[0]  # pairs p <= first read predicted features only
        early = [q + 1 for q in sorted(predicted) if lo <= q + 1 <= first]
        dtype = self.head.fc.weight.dtype
        parts = [torch.stack([predicted[p - 1] for p in early]).to(dtype)] if early else []
        positions = early
        if real is not None:
            a = max(lo, first + 1)
            positions = early + list(range(a, n_tok))
            parts.append(real[1][a - 1 - first :].to(dtype))
        return positions, torch.cat(parts) if len(parts) > 1 else parts[0]

    def _new_cache(self, need: int) -> KVCache:
        """A one-layer cache of at least ``need`` slots (a power of two >= 256 and >= the warmed size)."""
        need = max(need, self._min_cache)
        return KVCache(1, 1 << max(need - 1, 1).bit_length(), num_layers=1)

    def _ensure_capacity(self, st: _SeqState, keep: int, need: int) -> None:
        """Grow the cache (copying its first ``keep`` slots) when ``need`` slots would not fit."""
        if need <= st.cache.capacity:
            return
        old, st.cache = st.cache, self._new_cache(need)
        st.expansions = {}  # their buffers and graphs belong to the old cache
        if keep and old.layer_indices:
            k, v = old.buffers(0)
            st.cache.write(0, k[:, :, :keep], v[:, :, :keep], torch.arange(keep, device=k.device)[None])

    def _catch_up(self, st: _SeqState, tokens: np.ndarray, positions: list[int], feats: torch.Tensor, keep: int,
                  base: int) -> torch.Tensor:  # fmt: skip
        """One causal forward of the pending pairs (``positions``, their features ``feats [m, H]``,
        ``_pending``) into slots ``keep .. base``.

        Each pair attends to the committed slots ``[0, keep)`` and to the pending pairs up to itself
        (``_catch_up_visible``). Inputs go to the device in one asynchronous copy; the mask is built
        there. Runs unpadded: a chain of at most ``FUSED_CATCH_UP`` pairs under ``static_shapes`` runs
        padded inside the expansion instead (``_fused_width``, ``_catch_up_inputs``,
        ``Expansion._catch_up_body``).
        Returns the ``[m, H]`` output features (the last one: the root's).
        """
        ids = tokens[positions].tolist()
        ints = to_device(torch.tensor([ids, positions, list(range(keep, base + 1))], dtype=torch.int64), self.device)
        m = len(positions)
        visible = self._catch_up_visible(keep, m, m, base + 1, padded=False, device=self.device)
        out = self._forward(st.cache, ints[None, 0], feats[None], ints[None, 1], ints[None, 2], visible)[0]
        self.last_forwards += 1
        return out

    def _catch_up_inputs(self, st: _SeqState, tokens: np.ndarray, positions: list[int], feats: torch.Tensor,
                         keep: int, base: int, width: int) -> CatchUp:  # fmt: skip
        """The padded catch-up's inputs: ``width`` (``_fused_width(m)``) rows; padding rows (token 0,
        position 0) write and attend to the scratch slot (the cache's last) only (``CatchUp.padded``)."""
        m = len(positions)
        ints = tokens[positions].tolist() + positions + list(range(keep, base + 1))
        return CatchUp(m, ints, feats, keep, m).padded(width, st.cache.capacity - 1)

    def _fused_width(self, m: int) -> int:
        """Rows of the fused catch-up of ``m`` pairs: ``static_width`` times the smallest power of two
        that holds them; 0 (run it unfused) without static shapes or beyond ``FUSED_CATCH_UP`` pairs."""
        if not self.static_shapes or m > max(FUSED_CATCH_UP, self.static_width):
            return 0
        width = self.static_width
        while width < m:
            width *= 2
        return width

    @staticmethod
    def _catch_up_visible(keep, m, rows: int, kv_len: int, padded: bool, device: torch.device) -> torch.Tensor:
        """bool ``[B, rows, kv_len]``: in sequence b, row i < m sees the committed slots ``[0, keep)`` and
        the pending slots ``keep .. keep + i``; with ``padded``, rows >= m see only the scratch slot
        ``kv_len - 1``. ``keep`` / ``m``: ints (B = 1) or int64 ``[B]`` device tensors (a captured
        graph's inputs)."""
        keep, m = (x.view(-1, 1, 1) if isinstance(x, torch.Tensor) else x for x in (keep, m))
        row = torch.arange(rows, device=device)[:, None]
        col = torch.arange(kv_len, device=device)[None]
        visible = (col < keep) | ((col >= keep) & (col <= keep + row))
        if padded:
            visible = torch.where(row < m, visible, col == kv_len - 1)
        return visible if visible.dim() == 3 else visible[None]

    def _forward(self, cache: KVCache, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """One head forward of r pairs of each of B sequences over ``cache`` (batch size B; device
        tensors, no host sync).

        Args:
            ids: int64 ``[B, r]``, the pairs' tokens.
            feats: ``[B, r, H]``, the pairs' features.
            positions: int64 ``[B, r]``, their positions.
            slots: int64 ``[B, r]``, the cache slots their KV goes to.
            visible: bool ``[B, r, kv_len]``, the slots each pair attends to (its own included).

        Returns:
            ``[B, r, H]`` output features.
        """
        state = MaskedState(cache, slots, positions, visible)
        return self.head(self.parts, ids, feats, positions, state)

    def _tree_forward(self, ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
                      state: TreeState) -> torch.Tensor:  # fmt: skip
        """One head forward of the tree rows of ``attention="tree"`` of B sequences (``expand_depths``'
        ``tree``, or a fused catch-up's chain).

        Args:
            ids: int64 ``[B, n]``, the rows' tokens; feats: ``[B, n, H]``, their input features;
            positions: int64 ``[B, n]``; state: where their keys / values go and what each row sees.

        Returns:
            ``[B, n, H]`` output features.
        """
        return self.head(self.parts, ids, feats, positions, state)
