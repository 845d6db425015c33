"""Train Medusa heads by self-distillation: the frozen target's own answers to MBPP prompts.

Pipeline (:func:`run_medusa`, ``specdec train-medusa``; the data plumbing it shares with the EAGLE
loop is in ``training.distill``):

1. **Prompts** (``training.sources``; a prompt file with ``--prompts``, prompts the target writes
   in the style of seed prompts with ``--seed-prompts FILE --self-prompts N``): by default MBPP problems (``mbpp.jsonl``: ``text`` + ``test_list``) from ``--data``, else
   ``$SPECDEC_MBPP``, else ``../shared/data/mbpp/mbpp.jsonl`` beside the project root. MBPP is
   training data only (APPS stays the evaluation set); it is read in place, never copied.
   The last ``--heldout`` problems are held out for evaluation.
2. **Self-distillation data**: the target answers every prompt (greedy by default, batched HF
   ``generate``); the token ids are cached in ``OUT/selfdistill.jsonl`` so a rerun skips this, and
   written batch by batch to ``OUT/selfdistill.jsonl.partial`` so an interrupted run resumes.
   Training on the target's own outputs teaches the heads what the target will say, which is
   what they must guess at decoding time (Medusa's self-distillation).
3. **Training**: the target is frozen; its final hidden states ``h_j`` (the LM head's input) are
   computed without gradients. Head k (k = 1..K) is trained with cross-entropy to predict token
   ``j + 1 + k`` from ``h_j`` -- the tokens +1..+K beyond the target's own next token -- over the
   answer positions (``j >= prompt_len - 2``). AdamW, linear warm-up then cosine decay, gradient
   clipping at 1; the heads' loss is the mean over heads. Each head's graph is separate, so
   heads are backpropagated one at a time (peak memory: one ``[positions, V]`` logits block).
4. **Report**: per-head top-1 accuracy on the held-out answers before and after training;
   ``OUT/medusa_heads.safetensors`` + ``OUT/medusa_config.json`` (loadable with
   ``MedusaHeads.load(OUT)``; the config records the target, steps and accuracies).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from drafters.medusa import MedusaHeads
from training.distill import (
    Example,
    check_run_fields,
    distill_cached,
    load_target,
    padded_batch,
    target_hidden_states,
    warmup_cosine,
)
from training.sources import check_source_fields, read_sources, source_record, training_prompts

__all__ = [
    "MedusaRun",
    "TrainConfig",
    "evaluate_heads",
    "rank_rates",
    "run_medusa",
    "train_heads",
]


@dataclass(frozen=True)
class TrainConfig:
    """Optimization settings of :func:`train_heads`.

    Attributes:
        steps: optimizer steps.
        lr: peak learning rate (AdamW).
        batch_size: sequences per step.
        warmup: fraction of the steps spent warming up linearly.
        weight_decay: AdamW weight decay.
        max_positions: at most this many answer positions per step (a random subset).
        seed: sampling of batches and positions.
    """

    steps: int = 1000
    lr: float = 1e-3
    batch_size: int = 8
    warmup: float = 0.05
    weight_decay: float = 0.0
    max_positions: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_positions"):
            val = getattr(self, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {val!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: expected a finite float > 0, got {self.lr!r}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"warmup: expected a fraction in [0, 1), got {self.warmup!r}")


# ----------------------------------------------------------------------------------------------
# training


def _positions(lens: list[int], plens: list[int], limit: int, gen: torch.Generator | None):
    """(batch, position) pairs of answer positions j (j >= prompt_len - 2, j + 2 < len), at most ``limit``."""
    rows, cols = [], []
    for b, (n, p) in enumerate(zip(lens, plens)):
        for j in range(max(p - 2, 0), n - 2):
            rows.append(b)
            cols.append(j)
    b_idx, j_idx = torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
    if len(rows) > limit:
        keep = torch.randperm(len(rows), generator=gen)[:limit]
        b_idx, j_idx = b_idx[keep], j_idx[keep]
    return b_idx, j_idx


def _head_terms(target, heads: MedusaHeads, examples, max_positions: int, gen, device):
    """Yield, per head k (0-based), ``(logits [N_k, V] float32, labels [N_k])`` lazily."""
    ids, mask, lens, plens = padded_batch(examples, device)
    hidden = target_hidden_states(target, ids, mask)
    b_idx, j_idx = _positions(lens, plens, max_positions, gen)
    if len(b_idx) == 0:
        return
    lens_t = torch.tensor(lens)[b_idx]
    lm_head = target.get_output_embeddings()
    h = hidden[b_idx.to(hidden.device), j_idx.to(hidden.device)]
    for k in range(heads.num_heads):
        label_pos = j_idx + 2 + k  # head k (0-based) predicts token j + 1 + (k + 1)
        ok = label_pos < lens_t
        if not bool(ok.any()):
            continue
        feats = heads.head_features(h[ok.to(h.device)], k)
        logits = lm_head(feats.to(lm_head.weight.dtype)).float()
        labels = ids[b_idx[ok].to(ids.device), label_pos[ok].to(ids.device)]
        yield k, logits, labels


def train_heads(
    target,
    heads: MedusaHeads,
    examples: Sequence[Example],
    config: TrainConfig = TrainConfig(),
    progress: bool = True,
) -> list[float]:
    """Train ``heads`` in place on ``examples`` (target frozen); return the loss of every step."""
    if not examples:
        raise ValueError("examples: expected at least one training sequence, got none")
    device = target.get_input_embeddings().weight.device
    for p in target.parameters():
        p.requires_grad_(False)
    heads.train()
    opt = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: warmup_cosine(step, config.steps, config.warmup))
    gen = torch.Generator().manual_seed(config.seed)
    losses: list[float] = []
    bar = tqdm(range(config.steps), desc="train medusa", unit="step", disable=not progress)
    for _ in bar:
        pick = torch.randint(len(examples), (config.batch_size,), generator=gen).tolist()
        opt.zero_grad(set_to_none=True)
        total, count = 0.0, 0
        for k, logits, labels in _head_terms(target, heads, [examples[i] for i in pick], config.max_positions, gen,
                                             device):  # fmt: skip
            loss = F.cross_entropy(logits, labels.to(logits.device))
            (loss / heads.num_heads).backward()
            total += float(loss.detach())
            count += 1
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(total / max(count, 1))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    heads.eval()
    return losses


@torch.no_grad()
def rank_rates(target, heads: MedusaHeads, examples: Sequence[Example], ranks: int = 16,
               batch_size: int = 8) -> list[list[float]]:  # fmt: skip
    """``a[k][r]``: how often head k+1's rank-r prediction is the true token +(k+1) on ``examples``.

    Row k, column r = the fraction of answer positions where the target's own continuation token
    ``k + 1`` beyond the next one is the head's r-th most likely token (r < ``ranks``). Row sums
    are the top-``ranks`` accuracies; column 0 is the top-1 accuracy. Read as ``a[depth][rank]``
    it is the acceptance table ``drafters.trees.build_choices`` grows Medusa trees from (with
    Medusa's independence assumption: a head's accuracy given that the shallower guesses were right
    is taken to be its plain accuracy).
    """
    if ranks < 1:
        raise ValueError(f"ranks: expected >= 1, got {ranks}")
    device = target.get_input_embeddings().weight.device
    hits = [[0] * ranks for _ in range(heads.num_heads)]
    seen = [0] * heads.num_heads
    was_training = heads.training
    heads.eval()
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        for k, logits, labels in _head_terms(target, heads, chunk, 1 << 62, None, device):
            top = torch.topk(logits, min(ranks, logits.shape[-1]), dim=-1).indices
            found = (top == labels.to(logits.device)[:, None]).sum(0).tolist()  # hits per rank
            for r, c in enumerate(found):
                hits[k][r] += int(c)
            seen[k] += len(labels)
    heads.train(was_training)
    return [[h / seen[k] if seen[k] else 0.0 for h in hits[k]] for k in range(heads.num_heads)]


def evaluate_heads(target, heads: MedusaHeads, examples: Sequence[Example], batch_size: int = 8) -> list[float]:
    """Per-head top-1 accuracy (head k predicting token +k beyond the target's next) on ``examples``."""
    return [row[0] for row in rank_rates(target, heads, examples, ranks=1, batch_size=batch_size)]


# ----------------------------------------------------------------------------------------------
# the whole pipeline


@dataclass(frozen=True)
class MedusaRun:
    """Everything ``specdec train-medusa`` does, as settings of :func:`run_medusa`.

    Attributes:
        out: output directory (heads, config, self-distillation cache).
        target: default model name, HF id or local directory of the frozen target.
        data: MBPP jsonl (None: ``eval.datasets.default_mbpp_path``).
        num_heads, num_layers: heads, residual blocks per head.
        steps, lr, batch_size, max_positions, seed: :class:`TrainConfig`'s.
        num_prompts: use only the first N MBPP problems, and the first N prompts of ``prompts``
            (None: all).
        heldout: the last N problems are held out for the accuracy report (MBPP's when MBPP is
            used, else the last N prompts; ``training.sources``); None: 48, at most a fifth.
        prompts, seed_prompts, self_prompts, self_prompt_temperature, mix, mix_per_kind: other
            training prompts, as in ``training.eagle.EagleRun`` (``training.sources``).
        max_new_tokens, gen_batch_size, temperature: the self-distillation's answer length,
            prompts per ``generate`` batch, sampling temperature (0 = greedy).
        chat: prompts through the chat template (False: plain prompts).
        device, dtype: the target's (None: cuda if available; bf16 on cuda, fp32 elsewhere);
            the heads train in fp32.
        table_ranks: ranks of the held-out acceptance table saved with the heads.
        progress: progress bars.
    """

    out: str
    target: str = "qwen2.5-coder-1.5b"
    data: str | None = None
    num_heads: int = 4
    num_layers: int = 1
    steps: int = 1000
    lr: float = 1e-3
    batch_size: int = 8
    max_positions: int = 2048
    num_prompts: int | None = None
    heldout: int | None = None
    prompts: str | None = None
    seed_prompts: str | None = None
    self_prompts: int = 0
    self_prompt_temperature: float = 0.8
    mix: str | None = None
    mix_per_kind: int | None = None
    max_new_tokens: int = 256
    gen_batch_size: int = 16
    temperature: float = 0.0
    chat: bool = True
    device: str | None = None
    dtype: str | None = None
    table_ranks: int = 16
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        check_run_fields(self, ("num_heads", "num_layers", "batch_size", "max_positions", "max_new_tokens",
                                "gen_batch_size", "table_ranks"), ("steps",))  # fmt: skip
        check_source_fields(self)


def run_medusa(run: MedusaRun) -> None:
    """Self-distill the target on its training prompts (MBPP by default; a prompt file; prompts it
    writes itself: ``training.sources``) and train Medusa heads; save them in ``run.out`` and print
    the loss and each head's held-out accuracy before and after."""
    progress = run.progress
    sources = read_sources(run)  # a bad prompt row fails here, before any model loads
    out = Path(run.out)
    out.mkdir(parents=True, exist_ok=True)

    loaded = load_target(run.target, run.device, run.dtype, progress)
    target, device, dtype = loaded.model, loaded.device, loaded.dtype
    cache = out / "selfdistill.jsonl"
    base = {"target": str(run.target), "dtype": str(dtype), "max_new_tokens": run.max_new_tokens,
            "temperature": run.temperature, "chat": run.chat, "seed": run.seed}  # fmt: skip
    data = training_prompts(sources, run, loaded, base, cache, out)
    print(data.line)
    meta = {**base, "prompts": len(data.ids), **data.key}
    examples = distill_cached(target, data.ids, cache, meta, max_new_tokens=run.max_new_tokens,
                              batch_size=run.gen_batch_size, eos_token_id=loaded.eos, pad_token_id=loaded.pad,
                              temperature=run.temperature, seed=run.seed, progress=progress)  # fmt: skip
    train = [e for e, h in zip(examples, data.held) if not h]
    heldout = [e for e, h in zip(examples, data.held) if h]

    torch.manual_seed(run.seed)
    hidden_size = target.get_output_embeddings().weight.shape[1]
    heads = MedusaHeads(hidden_size, run.num_heads, run.num_layers).to(device)
    before = evaluate_heads(target, heads, heldout) if heldout else []
    cfg = TrainConfig(steps=run.steps, lr=run.lr, batch_size=run.batch_size, max_positions=run.max_positions,
                      seed=run.seed)  # fmt: skip
    losses = train_heads(target, heads, train, cfg, progress=progress)
    rates = rank_rates(target, heads, heldout, ranks=run.table_ranks) if heldout else []
    after = [row[0] for row in rates]
    # The measured table: MedusaDrafter builds its per-budget trees from it (drafters.trees.build_choices).
    heads.save(out, target=str(run.target), train={**asdict(cfg), **source_record(run, data)},
               train_examples=len(train), heldout_examples=len(heldout), heldout_top1_before=before, heldout_top1=after,
               heldout_rank_rates=rates, final_loss=losses[-1] if losses else None)  # fmt: skip
    print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} ({len(losses)} steps)")
    if heldout:
        for k, (b, a) in enumerate(zip(before, after), start=1):
            print(f"head {k} (token +{k} beyond the next): held-out top-1 {b:.3f} -> {a:.3f}, "
                  f"top-{run.table_ranks} {sum(rates[k - 1]):.3f}")
    print(f"saved {out / 'medusa_heads.safetensors'} and {out / 'medusa_config.json'}")
