"""Train an EAGLE head by self-distillation: the frozen target's own answers to MBPP prompts.

Pipeline (:func:`run_eagle`, ``specdec train-eagle``):

1. **Prompts and answers** (``training.sources``: MBPP by default; a prompt file with ``--prompts``;
   prompts the target writes in the style of seed prompts with ``--seed-prompts FILE
   --self-prompts N``; every generation resumable after an interruption): exactly
   ``training.medusa``'s data (``training.distill``; MBPP from ``--data`` /
   ``$SPECDEC_MBPP`` / ``../shared/data/mbpp/mbpp.jsonl``; never APPS or HumanEval): the target
   answers every prompt itself (greedy by default); the token ids are cached in
   ``OUT/selfdistill.jsonl`` (``--cache`` elsewhere: a ``train-medusa`` run's cache made with the
   same settings is reused as is). The last ``--heldout`` problems are held out.
   ``--prompt-styles mbpp,function,stdin,starter`` phrases every problem in several instruction
   styles (``training.distill.PROMPT_STYLES``: the evaluation harness's own instructions applied
   to MBPP tasks), so the head learns the answer forms it will meet (default ``mbpp`` only).
   ``--answers-per-prompt N`` adds N - 1 answers per training prompt sampled at
   ``--sample-temperature`` (other seeds; each pass cached in ``selfdistill.sampledK.jsonl``):
   more and more varied sequences from the same prompts, at the cost of N generation passes.
2. **Features**: the target's final hidden states ``f_p`` (the LM head's input) of prompt + answer,
   computed per batch without gradients; for a head with feature layers (``--feature-layers``,
   EAGLE-3; default ``low,mid,high`` = the outputs of layers 2, L // 2, L - 3; ``EagleHead``) also
   those layers' outputs ``g_p`` in the same forward (``target_features``), which the head reads
   through its ``fuse`` where step 1 below reads ``f_{i-1}``; ``f`` stays the regression target and
   the soft labels' source. ``final``: the single final feature (EAGLE-1).
3. **Loss** (EAGLE-1 + EAGLE-3's training-time test). Unrolled step s = 1..U simulates a draft
   node at depth s - 1 below a root at position i: step 1 reads the real pair
   ``(f_{i-1}, t_i)``; step s > 1 reads ``(y^{s-1}_i, t_{i+s-1})``, the head's own output of step
   s - 1, and attends to the real pairs at positions <= i (step 1's keys) plus its own chain (the
   keys of steps 2..s at the same i) -- the attention pattern of a path in the draft tree. Step s
   at i predicts ``f_{i+s-1}`` and so the token ``t_{i+s}``::

       loss_s = reg_weight * smooth_l1(y^s_i, f_{i+s-1}) + ce_weight * CE(p_target(t_{i+s}), lm_head(y^s_i))

   with the target's own next-token distribution as the soft label (EAGLE's classification loss),
   over the positions whose predicted token belongs to the answer (the CE on a random subset of
   at most ``max_positions`` of them per step: the ``[N, V]`` logits dominate memory), weighted by
   ``step_decay^(s-1)``. Gradients flow through the unrolled chain. Only ``fc`` and the layer train
   (float32 weights, bf16 autocast on CUDA); the target (embedding, LM head included) is frozen.
   AdamW, linear warm-up, cosine decay, gradient clipping.
4. **Report**: held-out top-1 per unrolled depth (does the head's argmax at step s equal the
   target's token ``t_{i+s}``?) before and after training; ``OUT/eagle_head.safetensors`` +
   ``OUT/eagle_config.json`` (``EagleHead.load(OUT, target)``) + ``OUT/draft_vocab.safetensors``:
   the vocabulary ranked by each token's count in the training answers (``answer_token_counts``;
   answers only, prompts not counted), from which ``EagleDrafter(draft_vocab=N)`` drafts (EAGLE-3's
   reduced draft vocabulary). Tokens never seen rank after the seen ones by id (for a BPE vocabulary,
   merge order). The head itself is trained over the full vocabulary unless ``--train-vocab N``
restricts the cross-entropy to the N most frequent answer tokens (``EagleTrainConfig.train_vocab``;
not yet compared on a GPU).

Budget: by default the head trains about ``AUTO_PASSES`` passes over its training sequences (batches of
8, 4 unrolled steps; ``EagleTrainConfig.steps`` None). Measured on one H200 with Qwen2.5-Coder-1.5B
in bf16 (docs/RESULTS.md 2026-11-28, 07a2607): 3,686 MBPP sequences, 4,574 steps (~10 passes) at 70 ms
in 315 s gave held-out top-1 0.876 / 0.852 / 0.839 / 0.831 at unrolled steps 1-4 and τ 5.10 on
HumanEval, where 1,500 steps at 3 unrolled steps (~3 passes) gave 0.833 / 0.797 / 0.767 and τ 4.13;
a 1,000-prompt file took 169 s from the start to the saved head, its 952 answers' generation included.
On CUDA the target's features of every training sequence are computed once before the first
step and kept on the device when they take at most a quarter of its free memory
(``EagleTrainConfig.cache_features``; ~4 GB for the default data with Qwen2.5-Coder-1.5B, k + 1 times
that with k feature layers: ~16 GB for three), instead of
a frozen target forward per batch; the log reports the cache's size and time (not yet timed on a GPU).
``--time-budget SECONDS`` bounds the optimization itself (the cache is built before it starts): the step time measured over the first
steps fixes how many steps fit, and the learning-rate schedule is rescaled to that count.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from drafters.eagle import EagleHead, TargetParts, rank_tokens
from drafters.eagle_head import parse_feature_layers
from specdec import hf
from training.distill import (
    PROMPT_STYLES,
    Example,
    check_run_fields,
    distill_cached,
    encode_prompt,
    load_examples,
    load_target,
    padded_batch,
    save_examples,
    self_distill,
    target_hidden_states,
    warmup_cosine,
)
from training.exercises import exercise_prompt, exercise_request, humaneval_names, select_exercises
from training.sources import check_source_fields, read_sources, source_record, training_prompts

__all__ = [
    "EagleRun",
    "EagleTrainConfig",
    "UnrolledAttention",
    "answer_token_counts",
    "check_feature_spec",
    "evaluate_eagle",
    "run_eagle",
    "target_features",
    "train_eagle",
    "unrolled_features",
]


@dataclass(frozen=True)
class EagleTrainConfig:
    """Optimization settings of :func:`train_eagle`.

    Attributes:
        steps: optimizer steps; None (default): ``auto_steps`` of the training sequences left after
            ``max_len`` (about ``AUTO_PASSES`` passes).
        lr: peak learning rate (AdamW).
        batch_size: sequences per step.
        unroll: unrolled steps U of the training-time test (1 = plain EAGLE-1 teacher forcing).
        max_positions: at most this many positions per unrolled step enter the cross-entropy.
        max_len: training sequences (prompt + answer) longer than this many tokens are left out
            (``train_eagle`` prints how many): a batch is padded to its longest sequence, and the
            head's unrolled attention keeps ``[B, heads, T, T]`` float32 scores per unrolled step
            (one 3,965-token MBPP answer made that 6 GB a step in a batch of 8 and ran an H100 out of
            memory at ``unroll=4``).
        reg_weight, ce_weight: weights of the feature regression (smooth L1) and the
            cross-entropy (EAGLE-1: 1.0 and 0.1).
        step_decay: unrolled step s is weighted ``step_decay ** (s - 1)``.
        warmup: fraction of the steps spent warming up linearly.
        weight_decay: AdamW weight decay.
        grad_clip: gradient-norm clipping.
        seed: sampling of batches and positions.
        cache_features: compute the target's features of every training sequence once, before the
            first step, and keep them on the device (``[len, H]`` per sequence in the target's dtype)
            instead of running the frozen target over every batch. None (default): when the
            device is CUDA and the cache takes at most a quarter of its free memory.
        train_vocab: None (default): the cross-entropy over the whole vocabulary; N: over the N
            most frequent tokens of the training answers (``answer_token_counts``'s ranking, the one
            ``draft_vocab`` drafts from), both distributions renormalized there -- EAGLE-3's
            reduced vocabulary at training time: an N-row LM-head read instead of V rows.
    """

    steps: int | None = None
    lr: float = 5e-4
    batch_size: int = 8
    unroll: int = 4
    max_positions: int = 2048
    max_len: int = 2048
    reg_weight: float = 1.0
    ce_weight: float = 0.1
    step_decay: float = 0.8
    warmup: float = 0.05
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    cache_features: bool | None = None
    train_vocab: int | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "unroll", "max_positions", "max_len"):
            val = getattr(self, name)
            if name == "steps" and val is None:
                continue
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1{' or None (auto)' * (name == 'steps')}, got {val!r}")
        for name in ("lr", "grad_clip", "step_decay"):
            val = getattr(self, name)
            if not (val > 0 and math.isfinite(val)):
                raise ValueError(f"{name}: expected a finite float > 0, got {val!r}")
        for name in ("reg_weight", "ce_weight", "weight_decay"):
            val = getattr(self, name)
            if not (val >= 0 and math.isfinite(val)):
                raise ValueError(f"{name}: expected a finite float >= 0, got {val!r}")
        if self.reg_weight == 0 and self.ce_weight == 0:
            raise ValueError("ce_weight: expected reg_weight or ce_weight > 0, got both 0")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup: expected a fraction in [0, 1), got {self.warmup!r}")
        if self.train_vocab is not None and (not isinstance(self.train_vocab, int) or isinstance(self.train_vocab, bool)
                                             or self.train_vocab < 1):  # fmt: skip
            raise ValueError(f"train_vocab: expected None or an int >= 1, got {self.train_vocab!r}")
        if not (self.cache_features is None or isinstance(self.cache_features, bool)):
            raise ValueError(f"cache_features: expected None, True or False, got {self.cache_features!r}")


#: The form of ``EagleRun.feature_layers`` (``parse_feature_layers`` reads it once the target's depth is known).
_FEATURE_SPEC = re.compile(r"final|(?:\s*(?:low|mid|high|-?\d+)\s*)(?:,\s*(?:low|mid|high|-?\d+)\s*)*")


def check_feature_spec(spec: str, name: str = "feature_layers") -> str:
    """``spec`` if it has the form ``parse_feature_layers`` reads (``final``, or comma-separated layer
    indices and low / mid / high), else ValueError naming ``name``; its indices are checked against
    the target once it is loaded (``run_eagle``)."""
    if not isinstance(spec, str) or not _FEATURE_SPEC.fullmatch(spec.strip().lower()):
        raise ValueError(f"{name}: expected 'final' or comma-separated layer indices or low / mid / high, got "
                         f"{spec!r}")  # fmt: skip
    return spec


#: ``EagleTrainConfig.steps`` None: this many passes over the training sequences, within
#: [AUTO_MIN_STEPS, AUTO_MAX_STEPS] steps (the module docstring has the measurement behind it).
AUTO_PASSES = 10
AUTO_MIN_STEPS = 1500
AUTO_MAX_STEPS = 6000


def auto_steps(sequences: int, batch_size: int) -> int:
    """Optimizer steps for ``AUTO_PASSES`` passes over ``sequences`` training sequences at ``batch_size``,
    clamped to [``AUTO_MIN_STEPS``, ``AUTO_MAX_STEPS``]."""
    if sequences < 1 or batch_size < 1:
        raise ValueError(f"sequences, batch_size: expected ints >= 1, got {sequences!r}, {batch_size!r}")
    return min(AUTO_MAX_STEPS, max(AUTO_MIN_STEPS, -(-AUTO_PASSES * sequences // batch_size)))


#: Steps timed (after 3 warm-up steps) before a ``time_budget`` fixes the number of steps.
_BUDGET_PROBE = 10
#: new-token limit of the target's exercise writing (a stub with its docstring takes ~100-200 tokens)
EXERCISE_TOKENS = 256


# ----------------------------------------------------------------------------------------------
# the unrolled forward


class UnrolledAttention:
    """Attention state of one unrolled forward (EAGLE-3's training-time test), passed as ``specdec_state=``.

    The head is called once per unrolled step s = 1, 2, ...; each call's layer hands its query /
    key / value ``[B, H*, T, D]`` (row i = the chain rooted at position i) to :meth:`attend`, which
    keeps the keys / values of every step. Step s's query at row i attends to step 1's keys at rows
    ``1 <= j <= i`` (the real pairs up to the root) and to steps 2..s's keys at row i (its own chain),
    as a node at depth s - 1 of a draft tree does. Differentiable (no in-place writes).
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(self, module, query, key, value, scaling, sliding_window, softcap) -> tuple[torch.Tensor, None]:
        """``query [B, Hq, T, D]``, ``key / value [B, Hkv, T, D]`` -> ``([B, T, Hq, D], None)``."""
        self.keys.append(key)
        self.values.append(value)
        step = len(self.keys)
        group = query.shape[1] // key.shape[1]
        scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
        q = query.float()
        k1 = self.keys[0].float().repeat_interleave(group, dim=1)
        v1 = self.values[0].float().repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k1.transpose(-1, -2)) * scale  # [B, Hq, T, T]
        diag = [(q * k.float().repeat_interleave(group, dim=1)).sum(-1) * scale for k in self.keys[1:]]
        scores = torch.cat([scores] + [d[..., None] for d in diag], dim=-1)  # [B, Hq, T, T + step - 1]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        n = query.shape[2]
        rows = torch.arange(n, device=query.device)
        # step-1 key j for the chain rooted at row i: 1 <= j <= i (row 0 has no feature before it,
        # as the drafter never has a pair at position 0; it sees only itself so its softmax is finite)
        visible = (rows[None, :] <= rows[:, None]) & ((rows[None, :] >= 1) | (rows[:, None] == 0))
        if sliding_window is not None:  # the query sits at position i + step - 1
            visible = visible & ((rows[:, None] + step - 1 - rows[None, :]) < sliding_window)
        visible = torch.cat([visible, visible.new_ones(n, step - 1)], dim=1)
        probs = scores.masked_fill(~visible, -math.inf).softmax(dim=-1)
        out = torch.matmul(probs[..., :n], v1)
        for j, v in enumerate(self.values[1:]):
            out = out + probs[..., n + j, None] * v.float().repeat_interleave(group, dim=1)
        return out.to(query.dtype).transpose(1, 2), None


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x`` along dim 1 moved by ``k`` (``out[:, i] = x[:, i + k]``), zero-filled."""
    if k == 0:
        return x
    out = torch.zeros_like(x)
    n = x.shape[1]
    if k > 0:
        out[:, : max(n - k, 0)] = x[:, k:]
    else:
        out[:, -k:] = x[:, : n + k]
    return out


def unrolled_features(head: EagleHead, parts: TargetParts, ids: torch.Tensor, feats: torch.Tensor,
                      unroll: int) -> list[torch.Tensor]:  # fmt: skip
    """The head's outputs of ``unroll`` unrolled steps.

    Args:
        head, parts: the head and the target's frozen modules.
        ids: int64 ``[B, T]`` (right-padded sequences).
        feats: ``[B, T, F]``, the target's features the head reads (``F = head.feature_width``: the
            final hidden states ``f``, or with feature layers their outputs ``g``, concatenated).
        unroll: steps U.

    Returns:
        U tensors ``[B, T, H]``: entry s-1, row i is ``y^s_i``, the head's prediction of
        ``f_{i+s-1}`` along the chain rooted at position i (step 1 reads ``(f_{i-1}, t_i)`` --
        ``(fuse(g_{i-1}), t_i)`` with feature layers, as the drafter's catch-up does --, step s reads
        ``(y^{s-1}_i, t_{i+s-1})``, as its expansion does). Rows whose inputs fall outside a
        sequence are garbage.
    """
    state = UnrolledAttention()
    rows = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    prev = head.fuse_features(_shift(feats, -1))  # f_{i-1}, or fuse(g_{i-1})
    outs = []
    for s in range(1, unroll + 1):
        y = head(parts, _shift(ids, s - 1), prev, rows + (s - 1), state)
        outs.append(y)
        prev = y
    return outs


def _valid(lens: list[int], plens: list[int], width: int, step: int) -> torch.Tensor:
    """bool ``[B, width]``: rows i where step ``step`` predicts an answer token that exists:
    ``1 <= i``, ``i + step <= len - 1`` and ``i + step >= prompt_len``."""
    i = torch.arange(width)
    out = torch.zeros(len(lens), width, dtype=torch.bool)
    for b, (n, p) in enumerate(zip(lens, plens)):
        out[b] = (i >= 1) & (i + step <= n - 1) & (i + step >= p)
    return out


def target_features(target, head: EagleHead, ids: torch.Tensor,
                    attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """The target's features of right-padded sequences ``ids`` (int64 ``[B, T]``, mask ``[B, T]``), in
    one forward: ``(f [B, T, H], g [B, T, k * H] or None)``: its final hidden states (the LM head's
    input: what the head regresses on and the soft labels' logits) and, for a head with k feature
    layers, those layers' outputs concatenated (what the head reads; ``specdec.hf.layer_outputs``:
    the features the engine passes the drafter)."""
    layers = head.config.feature_layers
    taps = hf.layers_at(target, layers) if layers is not None else ()
    with hf.layer_outputs(taps) as got:
        final = target_hidden_states(target, ids, attention_mask)
    return final, (torch.cat(got, dim=-1) if taps else None)


def _padded(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """``[B, width, F]``: the ``[len_b, F]`` rows right-padded with zeros."""
    out = rows[0].new_zeros(len(rows), width, rows[0].shape[-1])
    for b, f in enumerate(rows):
        out[b, : f.shape[0]] = f
    return out


def _step_terms(target, head, parts, examples, unroll, max_positions, gen, device, cached=None):
    """Per unrolled step s (1-based): ``(s, pred [N, H], feat [N, H], labels [N], pick)`` at the
    step's valid rows; ``pick`` indexes the (at most ``max_positions``) rows the cross-entropy uses.
    ``cached``: the examples' target features (``(f [len, H], g [len, k * H] or None)`` each,
    ``_feature_cache``), else the target runs over the batch."""
    ids, mask, lens, plens = padded_batch(examples, device)
    if cached is None:
        feats, layered = target_features(target, head, ids, mask)
    else:  # right-padded like ids; padding rows are never valid
        feats = _padded([f for f, _ in cached], ids.shape[1])
        layered = None if cached[0][1] is None else _padded([g for _, g in cached], ids.shape[1])
    outs = unrolled_features(head, parts, ids, feats if layered is None else layered, unroll)
    for s, y in enumerate(outs, start=1):
        valid = _valid(lens, plens, ids.shape[1], s).to(ids.device)
        if not bool(valid.any()):
            continue
        pred = y[valid]
        feat = _shift(feats, s - 1)[valid]
        labels = _shift(ids, s)[valid]
        n = pred.shape[0]
        pick = torch.randperm(n, generator=gen)[:max_positions].to(pred.device) if n > max_positions else None
        yield s, pred, feat, labels, pick


def answer_token_counts(examples: Sequence[Example], vocab_size: int) -> torch.Tensor:
    """int64 ``[vocab_size]``: how often each token id occurs in the examples' answers (``ids`` after
    ``prompt_len``), the ranking of the reduced draft vocabulary (``EagleHead.set_token_counts``)."""
    answers = [torch.tensor(e.ids[e.prompt_len :], dtype=torch.int64) for e in examples]
    flat = torch.cat(answers) if answers else torch.zeros(0, dtype=torch.int64)
    if flat.numel() and not 0 <= int(flat.min()) <= int(flat.max()) < vocab_size:
        raise ValueError(f"examples: expected token ids in [0, {vocab_size}), got [{int(flat.min())}, {int(flat.max())}]")
    return torch.bincount(flat, minlength=vocab_size)


def _loss(parts, pred, feat, pick, config: EagleTrainConfig, vocab=None) -> torch.Tensor:
    """EAGLE's loss of one step: smooth L1 on the features + CE against the target's distribution
    (over the LM-head rows ``vocab = (weight [N, H], bias [N] or None)`` when given)."""
    logits = parts.logits if vocab is None else (lambda x: F.linear(x.to(vocab[0].dtype), *vocab))
    loss = pred.new_zeros((), dtype=torch.float32)
    if config.reg_weight > 0:
        loss = loss + config.reg_weight * F.smooth_l1_loss(pred.float(), feat.float())
    if config.ce_weight > 0:
        p, f = (pred, feat) if pick is None else (pred[pick], feat[pick])
        with torch.no_grad():
            target_p = logits(f).float().softmax(-1)
        logq = logits(p).float().log_softmax(-1)
        loss = loss + config.ce_weight * -(target_p * logq).sum(-1).mean()
    return loss


@torch.no_grad()
def _feature_cache(target, head: EagleHead, examples: Sequence[Example], device, amp: bool | None,
                   batch_size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor | None]]:  # fmt: skip
    """``target_features`` of every example, ``([len(ids), H], [len(ids), k * H] or None)`` each, on
    ``device`` (computed in batches of similar lengths; a causal target's features do not depend on
    the padding or the batch)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].ids))
    out: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(examples)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        ids, mask, lens, _ = padded_batch([examples[i] for i in rows], device)
        with _autocast(device, amp):
            feats, layered = target_features(target, head, ids, mask)
        for b, i in enumerate(rows):
            out[i] = (feats[b, : lens[b]].clone(), None if layered is None else layered[b, : lens[b]].clone())
    return out


def _cache_fits(target, head: EagleHead, examples: Sequence[Example], device) -> bool:
    """Whether the feature cache takes at most a quarter of the device's free memory (CUDA only)."""
    if device.type != "cuda":
        return False
    layered = head.config.feature_layers is not None
    widths = head.config.hidden_size + (head.feature_width if layered else 0)  # f, and g when the head reads layers
    per_token = widths * torch.finfo(target.dtype).bits // 8
    need = per_token * sum(len(e.ids) for e in examples)
    return need <= torch.cuda.mem_get_info(device)[0] // 4


def _autocast(device: torch.device, enabled: bool | None):
    """bf16 autocast on CUDA by default (the head's weights stay float32), a no-op elsewhere."""
    on = device.type == "cuda" if enabled is None else enabled
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=on)


def train_eagle(target, head: EagleHead, examples: Sequence[Example], config: EagleTrainConfig = EagleTrainConfig(),
                progress: bool = True, amp: bool | None = None, time_budget: float | None = None) -> list[float]:  # fmt: skip
    """Train ``head`` in place on ``examples`` (target frozen); return every step's loss.

    ``amp``: run the forwards under bf16 autocast (default: on CUDA), as the drafter later runs
    the head in the target's dtype; the head's parameters and optimizer state stay float32.
    ``time_budget``: seconds the optimization may take (None = no limit). After
    ``_BUDGET_PROBE`` steps the mean step time fixes the number of steps that fit, and the
    learning-rate schedule (warm-up, cosine decay) is rescaled to it, so a budget-cut run still
    decays to zero instead of stopping mid-schedule. The result has one loss per step taken.
    """
    if not examples:
        raise ValueError("examples: expected at least one training sequence, got none")
    long = [len(e.ids) for e in examples if len(e.ids) > config.max_len]
    if long:
        examples = [e for e in examples if len(e.ids) <= config.max_len]
        print(f"left out {len(long)} training sequence(s) longer than max_len = {config.max_len} tokens (the longest "
              f"{max(long)}); {len(examples)} left")  # fmt: skip
        if not examples:
            raise ValueError(f"examples: expected sequences of at most max_len = {config.max_len} tokens, got none")
    if time_budget is not None and not time_budget > 0:
        raise ValueError(f"time_budget: expected seconds > 0 or None, got {time_budget!r}")
    device = target.get_input_embeddings().weight.device
    for p in target.parameters():
        p.requires_grad_(False)
    parts = TargetParts.of(target)
    head.train()
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    steps = auto_steps(len(examples), config.batch_size) if config.steps is None else config.steps
    total_steps = steps  # lowered once by the time budget (the schedule reads it each step)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, total_steps, config.warmup))
    gen = torch.Generator().manual_seed(config.seed)
    vocab = None
    if config.train_vocab is not None:
        counts = answer_token_counts(examples, parts.lm_head.weight.shape[0])
        ids = torch.sort(rank_tokens(counts)[: config.train_vocab]).values.to(device)
        bias = getattr(parts.lm_head, "bias", None)
        vocab = (parts.lm_head.weight.detach()[ids], None if bias is None else bias.detach()[ids])
    cache = (config.cache_features if config.cache_features is not None
             else _cache_fits(target, head, examples, device))  # fmt: skip
    cache_start = time.perf_counter()
    features = _feature_cache(target, head, examples, device, amp) if cache else None
    losses: list[float] = []
    bar = tqdm(total=steps, desc="train eagle", unit="step", disable=not progress)
    if features is not None:
        gib = sum(t.numel() * t.element_size() for pair in features for t in pair if t is not None) / 2**30
        bar.write(f"target features cached: {len(features)} sequences, {gib:.2f} GiB, "
                  f"{time.perf_counter() - cache_start:.1f} s")  # fmt: skip
    started = time.perf_counter()
    step = 0
    while step < total_steps:
        step += 1
        bar.update(1)
        if step == 4:  # steps 1-3 carry the warm-up (allocator, autotuning)
            probe_start = time.perf_counter()
        if time_budget is not None and step == 4 + _BUDGET_PROBE:
            per_step = (time.perf_counter() - probe_start) / _BUDGET_PROBE
            left = time_budget - (time.perf_counter() - started)
            fit = max(step, step + int(left / per_step))
            if fit < total_steps:
                total_steps = fit
                bar.reset(total=fit)
                bar.update(step)
                bar.write(f"time budget {time_budget:.0f} s at {per_step * 1e3:.0f} ms/step: {fit} of "
                          f"{steps} steps")  # fmt: skip
        pick = torch.randint(len(examples), (config.batch_size,), generator=gen).tolist()
        opt.zero_grad(set_to_none=True)
        total = None
        with _autocast(device, amp):
            cached = None if features is None else [features[i] for i in pick]
            for s, pred, feat, _, rows in _step_terms(target, head, parts, [examples[i] for i in pick], config.unroll,
                                                      config.max_positions, gen, device, cached):  # fmt: skip
                term = config.step_decay ** (s - 1) * _loss(parts, pred, feat, rows, config, vocab)
                total = term if total is None else total + term
        if total is None:  # no answer position in this batch
            losses.append(float("nan"))
            continue
        total.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), config.grad_clip)
        opt.step()
        sched.step()
        losses.append(float(total.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()
    head.eval()
    return losses


@torch.no_grad()
def evaluate_eagle(target, head: EagleHead, examples: Sequence[Example], unroll: int = 3,
                   batch_size: int = 8, amp: bool | None = None) -> list[float]:  # fmt: skip
    """Top-1 accuracy per unrolled depth on ``examples``.

    Entry s-1: over the answer positions, how often the head's most likely token at unrolled step
    s (a draft node at depth s, reading its own features from steps < s) is the target's token
    ``t_{i+s}``. Depth 1 is the root's best child: an upper bound on the first acceptance (all
    earlier features real, as with the full catch-up). ``amp`` as in :func:`train_eagle`.
    """
    if unroll < 1:
        raise ValueError(f"unroll: expected >= 1, got {unroll}")
    device = target.get_input_embeddings().weight.device
    parts = TargetParts.of(target)
    was_training = head.training
    head.eval()
    hits, seen = [0] * unroll, [0] * unroll
    for start in range(0, len(examples), batch_size):
        with _autocast(device, amp):
            for s, pred, _, labels, _ in _step_terms(target, head, parts, examples[start : start + batch_size],
                                                     unroll, 1 << 62, None, device):  # fmt: skip
                top = parts.logits(pred).argmax(-1)
                hits[s - 1] += int((top == labels.to(top.device)).sum())
                seen[s - 1] += len(labels)
    head.train(was_training)
    return [h / n if n else 0.0 for h, n in zip(hits, seen)]


# ----------------------------------------------------------------------------------------------
# the whole pipeline


@dataclass(frozen=True)
class EagleRun:
    """Everything ``specdec train-eagle`` does, as settings of :func:`run_eagle`.

    Attributes:
        out: output directory (head, config, draft vocabulary, self-distillation cache).
        target: default model name, HF id or local directory of the frozen target.
        data: MBPP jsonl (None: ``eval.datasets.default_mbpp_path``).
        cache: the self-distillation cache (None: ``OUT/selfdistill.jsonl``; a ``train-medusa``
            cache made with the same settings is reused).
        steps: optimizer steps (0: no training, the untrained head is saved; None: ``auto_steps``).
        lr, batch_size, unroll, max_positions, max_len, train_vocab, reg_weight, ce_weight, seed:
            :class:`EagleTrainConfig`'s.
        num_prompts: use only the first N MBPP problems, and the first N prompts of ``prompts``
            (None: all).
        heldout: the last N problems are held out for the accuracy report (MBPP's when MBPP is
            used, else the last N prompts; ``training.sources``); None: 48, at most a fifth.
        prompts: a prompt file to train on (``training.sources``: JSONL of ``{"prompt": ...}`` or
            ``{"messages": [...]}``, or a ``datasets`` directory / parquet / JSON file); with it
            MBPP is used only when ``data`` is given.
        seed_prompts, self_prompts: the target first writes ``self_prompts`` new prompts in the
            style of the seed prompts (a prompt file) and answers them too (sampled at
            ``self_prompt_temperature``); MBPP then only with ``data``.
        mix, mix_per_kind: ``"general"`` / ``"contest"``: MBPP plus ``mix_per_kind`` prompts per kind
            written from the mix's built-in seeds (``training.sources.MIXES``; None: its default).
        max_new_tokens, gen_batch_size, temperature: the self-distillation's answer length,
            prompts per ``generate`` batch, sampling temperature (0 = greedy).
        answers_per_prompt: answers per training prompt: the first at ``temperature``, each further
            one sampled at ``sample_temperature`` (held-out problems keep one answer).
        time_budget: seconds the optimization may take (None: no limit; ``train_eagle``).
        prompt_styles: instruction styles of the training prompts (``training.distill.PROMPT_STYLES``),
            each MBPP problem in every one.
        exercises: the target first writes N new exercises from the training problems and answers
            them too (``training.exercises``); ``exercise_temperature`` samples the writing.
        chat: prompts through the chat template (False: plain prompts).
        device, dtype: the target's (None: cuda if available; bf16 on cuda, fp32 elsewhere);
            the head trains in fp32.
        feature_layers: the target features the head reads (``drafters.eagle_head.parse_feature_layers``):
            ``"low,mid,high"`` (default; EAGLE-3's layers 2, L // 2, L - 3: on Qwen2.5-Coder-1.5B held-out
            top-1 0.833 / 0.797 / 0.767 at unrolled steps 1-3 against 0.805 / 0.742 / 0.710, and τ 4.13
            against 3.57 on HumanEval, docs/RESULTS.md 2026-11-27), ``"final"`` (the final hidden state,
            EAGLE-1) or comma-separated layer indices (negative from the end).
        progress: progress bars.
    """

    out: str
    target: str = "qwen2.5-coder-1.5b"
    data: str | None = None
    cache: str | None = None
    steps: int | None = EagleTrainConfig.steps
    lr: float = EagleTrainConfig.lr
    batch_size: int = EagleTrainConfig.batch_size
    unroll: int = EagleTrainConfig.unroll
    max_positions: int = EagleTrainConfig.max_positions
    max_len: int = EagleTrainConfig.max_len
    train_vocab: int | None = None
    reg_weight: float = EagleTrainConfig.reg_weight
    ce_weight: float = EagleTrainConfig.ce_weight
    num_prompts: int | None = None
    heldout: int | None = None
    prompts: str | None = None
    seed_prompts: str | None = None
    self_prompts: int = 0
    self_prompt_temperature: float = 0.8
    mix: str | None = None
    mix_per_kind: int | None = None
    max_new_tokens: int = 192
    gen_batch_size: int = 120
    temperature: float = 0.0
    answers_per_prompt: int = 1
    sample_temperature: float = 0.8
    time_budget: float | None = None
    prompt_styles: tuple[str, ...] = ("mbpp",)
    exercises: int = 0
    exercise_temperature: float = 0.8
    chat: bool = True
    device: str | None = None
    dtype: str | None = None
    seed: int = 0
    feature_layers: str = "low,mid,high"
    progress: bool = True

    def __post_init__(self) -> None:
        counts = ("exercises",) if self.steps is None else ("steps", "exercises")  # steps None: auto_steps
        check_run_fields(self, ("batch_size", "unroll", "max_positions", "max_len", "max_new_tokens", "gen_batch_size",
                                "answers_per_prompt"), counts)  # fmt: skip
        check_source_fields(self)
        check_feature_spec(self.feature_layers)
        styles = self.prompt_styles
        if (not isinstance(styles, tuple) or not styles or len(set(styles)) != len(styles)
                or any(s not in PROMPT_STYLES for s in styles)):  # fmt: skip
            raise ValueError(f"prompt_styles: expected a tuple of distinct styles of {PROMPT_STYLES}, got {styles!r}")


def _exercise_examples(target, tok, rows: Sequence[dict], run: EagleRun, meta: dict, cache: Path, eos,
                       pad: int) -> list[Example]:  # fmt: skip
    """The target's answers to ``run.exercises`` exercises it writes itself from the training ``rows``
    (cycled), cached beside ``cache`` (``*.exercises.jsonl``; the stubs in ``*.exercises.stubs.jsonl``)."""
    ex_meta = {**meta, "prompts": run.exercises, "exercises_from": len(rows),
               "exercise_temperature": run.exercise_temperature}  # fmt: skip
    ex_cache = cache.with_name(f"{cache.stem}.exercises{cache.suffix}")
    examples = load_examples(ex_cache, ex_meta)
    if examples is not None:
        print(f"self-written exercises: {len(examples)} cached answers from {ex_cache}")
        return examples
    progress = run.progress
    requests = [encode_prompt(tok, exercise_request(rows[i % len(rows)]), chat=run.chat)
                for i in range(run.exercises)]  # fmt: skip
    written = self_distill(target, requests, EXERCISE_TOKENS, run.gen_batch_size, eos, pad, run.exercise_temperature,
                           run.seed + 1000, progress)  # fmt: skip
    answers = [tok.decode(e.ids[e.prompt_len :], skip_special_tokens=True) for e in written]
    stubs, report = select_exercises(answers, humaneval_names())
    print(report.line())
    _save_stubs(stubs, report, ex_cache.with_name(f"{ex_cache.stem}.stubs{ex_cache.suffix}"))
    prompts = [encode_prompt(tok, exercise_prompt(s), chat=run.chat) for s in stubs]
    examples = self_distill(target, prompts, run.max_new_tokens, run.gen_batch_size, eos, pad, run.temperature, run.seed,
                            progress)  # fmt: skip
    save_examples(examples, ex_cache, ex_meta)
    return examples


def _save_stubs(stubs: Sequence[str], report, path: Path) -> None:
    """The kept exercise stubs as JSONL (first line: the selection's counts), for inspection."""
    with open(path, "w") as f:
        f.write(json.dumps({"report": asdict(report)}) + "\n")
        for stub in stubs:
            f.write(json.dumps({"stub": stub}) + "\n")


def run_eagle(run: EagleRun) -> None:
    """Self-distill the target on its training prompts (MBPP by default; a prompt file; prompts it
    writes itself: ``training.sources``) and train an EAGLE head; save it in ``run.out`` and print
    the data, the loss, the held-out accuracy per depth before and after, and the time of each part."""
    clock = {"start": time.perf_counter()}
    progress = run.progress
    sources = read_sources(run)  # a bad prompt row fails here, before any model loads
    steps = None if run.steps is None else max(run.steps, 1)
    cfg = EagleTrainConfig(steps=steps, lr=run.lr, batch_size=run.batch_size, unroll=run.unroll,
                           max_positions=run.max_positions, max_len=run.max_len, reg_weight=run.reg_weight,
                           ce_weight=run.ce_weight, seed=run.seed, train_vocab=run.train_vocab)  # fmt: skip
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)

    loaded = load_target(run.target, run.device, run.dtype, progress)
    tok, target, device, dtype, eos, pad = (loaded.tokenizer, loaded.model, loaded.device, loaded.dtype, loaded.eos,
                                            loaded.pad)  # fmt: skip
    clock["load"] = time.perf_counter()
    cache = Path(run.cache) if run.cache else out / "selfdistill.jsonl"
    # the same cache key as train-medusa: its answers serve both
    base = {"target": str(run.target), "dtype": str(dtype), "max_new_tokens": run.max_new_tokens,
            "temperature": run.temperature, "chat": run.chat, "seed": run.seed}  # fmt: skip
    styles = run.prompt_styles if sources.rows else ()
    data = training_prompts(sources, run, loaded, base, cache, out, styles)
    print(data.line)
    prompts, held = data.ids, data.held
    meta = {**base, "prompts": len(prompts)}
    if list(styles) not in (["mbpp"], []):  # only when set: caches made before the option stay valid
        meta["styles"] = list(run.prompt_styles)
    meta.update(data.key)
    gen = dict(max_new_tokens=run.max_new_tokens, batch_size=run.gen_batch_size, eos_token_id=eos, pad_token_id=pad,
               progress=progress)  # fmt: skip
    examples = distill_cached(target, prompts, cache, meta, temperature=run.temperature, seed=run.seed, **gen)
    train = [e for e, h in zip(examples, held) if not h]
    heldout = [e for e, h in zip(examples, held) if h]
    train_prompts = [p for p, h in zip(prompts, held) if not h]
    for k in range(1, run.answers_per_prompt):  # extra sampled answers to the training prompts, cached per pass
        extra_meta = {**meta, "prompts": len(train_prompts), "temperature": run.sample_temperature, "seed": run.seed + k}
        extra_cache = cache.with_name(f"{cache.stem}.sampled{k}{cache.suffix}")
        train = train + distill_cached(target, train_prompts, extra_cache, extra_meta, temperature=run.sample_temperature,
                                       seed=run.seed + k, desc=f"sampled answers {k}", **gen)  # fmt: skip
    split = data.split
    # the exercises come from the MBPP rows alone: their cache outlives other prompts joining (--mix, a file)
    ex_base = {k: v for k, v in meta.items() if k not in data.key}
    exercises = _exercise_examples(target, tok, data.rows[:split], run, ex_base, cache, eos, pad) if run.exercises else []
    parts = [f"{split} problems x {len(styles)} prompt styles ({', '.join(styles)})"] if sources.rows else []
    general = sum(not h for h in held[data.mbpp_prompts :])  # training prompts of the file / written by the target
    if general:
        parts.append(f"{general} prompts")
    print(f"training sequences: {len(train) + len(exercises)} ({' + '.join(parts)} x {run.answers_per_prompt} answers, "
          f"fewer where a style needs a signature; {len(exercises)} answers to self-written exercises), held out: "
          f"{len(heldout)}")  # fmt: skip
    train = train + exercises
    clock["data"] = time.perf_counter()

    torch.manual_seed(run.seed)
    layers = parse_feature_layers(run.feature_layers, hf.num_layers(target))
    head = EagleHead(target, layers).to(device)
    print("head features: " + ("the target's final hidden state" if layers is None else
                               f"the outputs of the target's layers {list(layers)} (of {hf.num_layers(target)}), "
                               f"fused {len(layers)}H -> H"))  # fmt: skip
    before = evaluate_eagle(target, head, heldout, cfg.unroll) if heldout else []
    losses = train_eagle(target, head, train, cfg, progress=progress, time_budget=run.time_budget) if run.steps != 0 else []
    after = evaluate_eagle(target, head, heldout, cfg.unroll) if heldout and losses else before
    clock["train"] = time.perf_counter()
    counts = answer_token_counts(train, head.config.vocab_size)
    head.set_token_counts(counts)
    seen, total = int((counts > 0).sum()), int(counts.sum())
    cover = {n: float(head.token_counts[:n].sum()) / max(total, 1) for n in (1024, 4096, 16384, 32768)
             if n < head.config.vocab_size}  # fmt: skip
    print(f"answer tokens: {total}, distinct {seen} of {head.config.vocab_size}; the most frequent N cover "
          + (", ".join(f"{c:.1%} (N = {n})" for n, c in cover.items()) or "all"))  # fmt: skip
    head.save(out, target=str(run.target), train={**asdict(cfg), "steps": len(losses), "answers_per_prompt": run.answers_per_prompt,
                                                   "prompt_styles": list(styles), "exercises": run.exercises,
                                                   **source_record(run, data), "feature_layers": run.feature_layers},
              train_examples=len(train),
              heldout_examples=len(heldout), heldout_top1_before=before, heldout_top1=after,
              final_loss=losses[-1] if losses else None,
              notes=f"self-distilled on the target's answers to {data.line.removeprefix('training prompts: ')}; "
                    "held-out top-1 per unrolled depth, all earlier features real")  # fmt: skip
    if losses:
        print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} ({len(losses)} steps)")
    for s, (b, a) in enumerate(zip(before, after), start=1):
        print(f"depth {s} (unrolled step {s}): held-out top-1 {b:.3f} -> {a:.3f}")
    print(f"saved {out / 'eagle_head.safetensors'}, {out / 'eagle_config.json'} and {out / 'draft_vocab.safetensors'}")
    print(f"time: model {clock['load'] - clock['start']:.0f} s, data {clock['data'] - clock['load']:.0f} s, training "
          f"{clock['train'] - clock['data']:.0f} s (feature cache and held-out evaluation included), total "
          f"{time.perf_counter() - clock['start']:.0f} s")  # fmt: skip
