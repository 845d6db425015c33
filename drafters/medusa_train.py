"""Train Medusa heads by self-distillation: the frozen target's own answers to MBPP prompts.

Pipeline (``python -m drafters.medusa_train`` or ``specdec train-medusa``):

1. **Prompts**: MBPP problems (``mbpp.jsonl``: ``text`` + ``test_list``) from ``--data``, else
   ``$SPECDEC_MBPP``, else ``../shared/data/mbpp/mbpp.jsonl`` beside the project root. MBPP is
   training data only (APPS stays the evaluation set); it is read in place, never copied.
   The last ``--heldout`` problems are held out for evaluation.
2. **Self-distillation data**: the target answers every prompt (greedy by default, batched HF
   ``generate``); the token ids are cached in ``OUT/selfdistill.jsonl`` so a rerun skips this.
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

import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from drafters.medusa import MedusaHeads
from eval.datasets import AppsProblem, HumanEvalProblem, default_mbpp_path, load_mbpp, mbpp_signature
from specdec.cli import args as cliargs

__all__ = [
    "Example",
    "TrainConfig",
    "default_mbpp_path",
    "evaluate_heads",
    "rank_rates",
    "load_mbpp",
    "main",
    "PROMPT_STYLES",
    "mbpp_prompt",
    "mbpp_signature",
    "styled_prompts",
    "self_distill",
    "target_hidden_states",
    "train_heads",
    "warmup_cosine",
]

@dataclass(frozen=True)
class Example:
    """One self-distillation sequence: prompt followed by the target's answer.

    Attributes:
        ids: token ids (prompt + answer).
        prompt_len: number of prompt tokens at the start of ``ids``.
    """

    ids: tuple[int, ...]
    prompt_len: int


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
# data


#: Instruction styles of the training prompts built from an MBPP row (``mbpp_prompt(row, style)``):
#: ``"mbpp"`` the statement and its tests; the evaluation harness's own instructions applied to the
#: MBPP task (written by ``eval.datasets``' problem classes, so the text is theirs): ``"function"`` as
#: a HumanEval prompt (complete a function given its signature and a docstring of the statement and
#: examples), ``"stdin"`` as an APPS standard-input problem, ``"starter"`` as an APPS call-based
#: problem (the signature as starter code). A drafter learns the answers' form (fenced code, a
#: repeated signature and docstring) it will meet. No evaluation problem is used.
PROMPT_STYLES = ("mbpp", "function", "stdin", "starter")


def _doc_examples(row: dict[str, Any]) -> str:
    """The row's ``assert CALL == VALUE`` tests as doctest lines (others as they are)."""
    lines = []
    for test in row.get("test_list") or []:
        call, sep, value = test.strip().removeprefix("assert ").partition(" == ")
        lines += [f">>> {call.strip()}", value.strip()] if sep else [f">>> {test.strip()}"]
    return "\n".join(f"    {line}" for line in lines)


def mbpp_prompt(row: dict[str, Any], style: str = "mbpp") -> str | None:
    """The task as a user message in one of ``PROMPT_STYLES`` (None: the style needs a function
    signature and the row's code has none)."""
    if style not in PROMPT_STYLES:
        raise ValueError(f"style: expected one of {PROMPT_STYLES}, got {style!r}")
    text = row["text"].strip()
    if style == "mbpp":
        tests = "\n".join(row.get("test_list") or [])
        return f"{text}\nYour code should pass these tests:\n\n{tests}\n" if tests else text + "\n"
    if style == "stdin":
        return AppsProblem("mbpp", "introductory", text).messages()[0]["content"]
    sig = mbpp_signature(row)
    if sig is None:
        return None
    if style == "starter":
        return AppsProblem("mbpp", "introductory", text, starter_code=sig).messages()[0]["content"]
    examples = _doc_examples(row)
    doc = f'    """{text}\n' + (f"{examples}\n" if examples else "") + '    """'
    return HumanEvalProblem("mbpp", f"{sig}\n{doc}\n", "", "", "").messages()[0]["content"]


def styled_prompts(rows: Sequence[dict[str, Any]], styles: Sequence[str]) -> list[tuple[int, str]]:
    """(row index, prompt text) for every row in every style, grouped by style in ``styles`` order
    (rows a style cannot phrase are left out of it)."""
    out = []
    for style in styles:
        for i, row in enumerate(rows):
            text = mbpp_prompt(row, style)
            if text is not None:
                out.append((i, text))
    return out


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``: through the chat template (generation prompt added) when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)  # fmt: skip
        return list(out["input_ids"])
    return list(tokenizer(text)["input_ids"])


@torch.no_grad()
def self_distill(
    target,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 256,
    batch_size: int = 16,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int = 0,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
) -> list[Example]:
    """The target's own answers to ``prompts`` (batched HF ``generate``, left padding).

    Greedy for ``temperature == 0`` (default), else sampling at that temperature. Each answer is
    cut after its first eos. Batches are formed from the prompts sorted by length (less padding);
    a batch that runs out of device memory is retried at half the size (with a warning), down to
    one prompt. Returns one :class:`Example` per prompt, in the given order.
    """
    from transformers import GenerationConfig

    device = target.get_input_embeddings().weight.device
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
        top_k=None, top_p=None, eos_token_id=eos or None, pad_token_id=pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    out: list[Example | None] = [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc="self-distill", unit="prompt", disable=not progress)
    start = 0
    while start < len(prompts):
        rows = order[start : start + batch_size]
        chunk = [list(prompts[i]) for i in rows]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for b, p in enumerate(chunk):
            ids[b, width - len(p) :] = torch.tensor(p)
            mask[b, width - len(p) :] = 1
        try:
            gen = target.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
        except torch.OutOfMemoryError:
            if len(rows) == 1:
                raise
            batch_size = (len(rows) + 1) // 2
            if device.type == "cuda":
                torch.cuda.empty_cache()
            bar.write(f"self-distill: out of device memory at {len(rows)} prompts a batch; retrying at {batch_size}")
            continue
        start += len(rows)
        bar.update(len(rows))
        for b, p in enumerate(chunk):
            answer = gen[b, width:].tolist()
            for j, tok in enumerate(answer):
                if tok in eos:
                    answer = answer[: j + 1]
                    break
            out[rows[b]] = Example(tuple(p) + tuple(answer), len(p))
    bar.close()
    return out


def save_examples(examples: Sequence[Example], path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
    """Write examples as JSONL (first line: ``{"meta": ...}``), atomically."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for ex in examples:
            f.write(json.dumps({"ids": list(ex.ids), "prompt_len": ex.prompt_len}) + "\n")
    os.replace(tmp, p)


def load_examples(path: str | os.PathLike[str], meta: dict[str, Any]) -> list[Example] | None:
    """Examples cached by :func:`save_examples`, or None if absent or made with other settings."""
    p = Path(path)
    if not p.is_file():
        return None
    with open(p) as f:
        head = json.loads(f.readline() or "{}")
        if head.get("meta") != meta:
            return None
        return [Example(tuple(r["ids"]), int(r["prompt_len"])) for r in map(json.loads, f) if r]


# ----------------------------------------------------------------------------------------------
# training


@torch.no_grad()
def target_hidden_states(target, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, H]`` final hidden states (what the LM head reads) of right-padded sequences."""
    out = target(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1,
                 use_cache=False)  # fmt: skip
    return out.hidden_states[-1]


def _batch(examples: Sequence[Example], device) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    width = max(len(e.ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for b, e in enumerate(examples):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        mask[b, : len(e.ids)] = 1
    return ids.to(device), mask.to(device), [len(e.ids) for e in examples], [e.prompt_len for e in examples]


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
    ids, mask, lens, plens = _batch(examples, device)
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


def warmup_cosine(step: int, total: int, warmup: float) -> float:
    """Learning-rate factor at optimizer step ``step`` (0-based) of ``total``: linear warm-up over
    the first ``warmup`` fraction of the steps (at least one), then cosine decay to 0 at ``total``."""
    warm = max(1, int(warmup * total))
    if step < warm:
        return (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


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
# CLI


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def main(argv: Sequence[str] | None = None) -> int:
    """``specdec train-medusa``: self-distill the target on MBPP and train Medusa heads."""
    parser = cliargs.ArgumentParser(
        prog="specdec train-medusa",
        description="Train Medusa heads on the frozen target's own answers to MBPP prompts (self-distillation).",
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="default model name, HF id or local dir")
    parser.add_argument("--data", type=cliargs.existing_path, default=None, help="MBPP jsonl (default $SPECDEC_MBPP or ../shared/data/mbpp)")
    parser.add_argument("--out", type=cliargs.output_dir, required=True, help="output directory (heads, config, self-distillation cache)")
    parser.add_argument("--num-heads", type=cliargs.int_at_least(1), default=4)
    parser.add_argument("--num-layers", type=cliargs.int_at_least(1), default=1, help="residual blocks per head")
    parser.add_argument("--steps", type=cliargs.int_at_least(0), default=1000)
    parser.add_argument("--lr", type=cliargs.float_in(0.0, low_open=True), default=1e-3)
    parser.add_argument("--batch-size", type=cliargs.int_at_least(1), default=8)
    parser.add_argument("--max-positions", type=cliargs.int_at_least(1), default=2048, help="answer positions per step (subsampled)")
    parser.add_argument("--num-prompts", type=cliargs.int_at_least(1), default=None, help="use only the first N MBPP problems")
    parser.add_argument("--heldout", type=cliargs.int_at_least(0), default=48, help="problems held out for the accuracy report")
    parser.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=256, help="answer length of the self-distillation")
    parser.add_argument("--gen-batch-size", type=cliargs.int_at_least(1), default=16)
    parser.add_argument("--temperature", type=cliargs.float_in(0.0), default=0.0, help="self-distillation sampling (0 = greedy)")
    parser.add_argument("--no-chat", action="store_true", help="plain prompts instead of the chat template")
    parser.add_argument("--device", type=cliargs.device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="target dtype (default bf16 on cuda, fp32 on cpu); heads train in fp32")
    parser.add_argument("--table-ranks", type=cliargs.int_at_least(1), default=16,
                        help="ranks of the held-out acceptance table saved with the heads (tree building)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    from specdec import models

    device = torch.device(ns.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(ns.dtype or ("bf16" if device.type == "cuda" else "fp32"))
    progress = not ns.no_progress
    rows = load_mbpp(ns.data)
    if ns.num_prompts is not None:
        rows = rows[: ns.num_prompts]
    if not 0 <= ns.heldout < len(rows):
        raise ValueError(f"--heldout: expected 0 <= heldout < the {len(rows)} problems used, got {ns.heldout}")
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)

    tok = models.load_tokenizer(ns.target, progress=progress)
    target = models.load_model(ns.target, dtype=dtype, device=device, progress=progress)
    eos = target.generation_config.eos_token_id if target.generation_config is not None else None
    eos = eos if eos is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if isinstance(eos, int) else 0)
    prompts = [encode_prompt(tok, mbpp_prompt(r), chat=not ns.no_chat) for r in rows]

    meta = {"target": str(ns.target), "dtype": str(dtype), "max_new_tokens": ns.max_new_tokens,
            "temperature": ns.temperature, "chat": not ns.no_chat, "prompts": len(prompts), "seed": ns.seed}  # fmt: skip
    cache = out / "selfdistill.jsonl"
    examples = load_examples(cache, meta)
    if examples is None:
        examples = self_distill(target, prompts, ns.max_new_tokens, ns.gen_batch_size, eos, pad, ns.temperature,
                                ns.seed, progress)  # fmt: skip
        save_examples(examples, cache, meta)
    else:
        print(f"self-distillation data: {len(examples)} cached answers from {cache}")
    split = len(examples) - ns.heldout
    train, heldout = examples[:split], examples[split:]

    torch.manual_seed(ns.seed)
    hidden_size = target.get_output_embeddings().weight.shape[1]
    heads = MedusaHeads(hidden_size, ns.num_heads, ns.num_layers).to(device)
    before = evaluate_heads(target, heads, heldout) if heldout else []
    cfg = TrainConfig(steps=ns.steps, lr=ns.lr, batch_size=ns.batch_size, max_positions=ns.max_positions, seed=ns.seed)
    losses = train_heads(target, heads, train, cfg, progress=progress)
    rates = rank_rates(target, heads, heldout, ranks=ns.table_ranks) if heldout else []
    after = [row[0] for row in rates]
    # The measured table: MedusaDrafter builds its per-budget trees from it (drafters.trees.build_choices).
    heads.save(out, target=str(ns.target), train=asdict(cfg), train_examples=len(train),
               heldout_examples=len(heldout), heldout_top1_before=before, heldout_top1=after,
               heldout_rank_rates=rates, final_loss=losses[-1] if losses else None)  # fmt: skip
    print(f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f} ({len(losses)} steps)")
    if heldout:
        for k, (b, a) in enumerate(zip(before, after), start=1):
            print(f"head {k} (token +{k} beyond the next): held-out top-1 {b:.3f} -> {a:.3f}, "
                  f"top-{ns.table_ranks} {sum(rates[k - 1]):.3f}")
    print(f"saved {out / 'medusa_heads.safetensors'} and {out / 'medusa_config.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
