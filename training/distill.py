"""What the Medusa and EAGLE training loops share: the self-distillation data and its plumbing.

* **Prompts**: MBPP rows (``eval.datasets.load_mbpp``; MBPP is training data only, APPS and
  HumanEval stay the evaluation sets) phrased in one of :data:`PROMPT_STYLES`
  (:func:`mbpp_prompt`, :func:`styled_prompts`) and tokenized through the chat template
  (:func:`encode_prompt`).
* **Answers**: the frozen target's own answers (:func:`self_distill`, batched HF ``generate``),
  cached as JSONL keyed by the settings that made them (:func:`save_examples`,
  :func:`load_examples`), so a rerun -- or the other loop, with the same settings -- skips the
  generation. :func:`distill_cached` also writes every finished batch to ``CACHE.partial`` as it
  goes: an interrupted generation resumes from what it wrote; and a greedy cache made for another
  prompt list (MBPP alone, then MBPP with ``--mix general``) lends the answers of the prompts the two
  lists share (:func:`_greedy_answers`). Prompts from a user's file or
  written by the target come through ``training.sources`` (chat conversations:
  :func:`encode_messages`).
* **Batches and features**: right-padded batches (:func:`padded_batch`) and the target's final
  hidden states, the LM head's input (:func:`target_hidden_states`).
* **Schedule**: linear warm-up then cosine decay (:func:`warmup_cosine`).
* **The target**: device / dtype defaults and loading, eos and pad ids (:func:`load_target`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from eval.datasets import AppsProblem, HumanEvalProblem, mbpp_signature
from specdec.dtypes import DTYPE_NAMES, parse_dtype

__all__ = [
    "DTYPES",
    "Example",
    "LoadedTarget",
    "check_run_fields",
    "PROMPT_STYLES",
    "distill_cached",
    "encode_messages",
    "encode_prompt",
    "prompts_digest",
    "load_examples",
    "load_target",
    "mbpp_prompt",
    "padded_batch",
    "save_examples",
    "self_distill",
    "styled_prompts",
    "target_hidden_states",
    "warmup_cosine",
]

#: ``--dtype`` names of the target's dtype.
DTYPES = DTYPE_NAMES


@dataclass(frozen=True)
class Example:
    """One self-distillation sequence: prompt followed by the target's answer.

    Attributes:
        ids: token ids (prompt + answer).
        prompt_len: number of prompt tokens at the start of ``ids``.
    """

    ids: tuple[int, ...]
    prompt_len: int


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


def encode_messages(tokenizer, messages: Sequence[dict[str, str]], chat: bool = True) -> list[int]:
    """Token ids of a chat conversation whose last message is the user turn to answer: through the
    chat template (generation prompt added) when it has one and ``chat``; else plain
    ``Role: content`` paragraphs ending in ``Assistant:`` (one user message alone: its text, as
    :func:`encode_prompt` writes it)."""
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True,
                                            return_dict=True)  # fmt: skip
        return list(out["input_ids"])
    if len(messages) == 1 and messages[0]["role"] == "user":
        return list(tokenizer(messages[0]["content"])["input_ids"])
    body = "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)
    return list(tokenizer(f"{body}\n\nAssistant:")["input_ids"])


def prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    """A short hash of token-id prompts (a cache's key when the prompts are not MBPP's alone)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(list(p), separators=(",", ":")).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def _generate(target, ids: torch.Tensor, mask: torch.Tensor, config) -> torch.Tensor:
    """One batch of ``target.generate`` (a function of its own so that tests can interrupt it)."""
    return target.generate(ids, attention_mask=mask, generation_config=config)


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
    on_batch: Callable[[list[int], list[Example]], None] | None = None,
    desc: str = "self-distill",
) -> list[Example]:
    """The target's own answers to ``prompts`` (batched HF ``generate``, left padding).

    Greedy for ``temperature == 0`` (default), else sampling at that temperature. Each answer is
    cut after its first eos. Batches are formed from the prompts sorted by length (less padding);
    a batch that runs out of device memory is retried at half the size (with a warning), down to
    one prompt. Returns one :class:`Example` per prompt, in the given order. ``on_batch(indices,
    examples)`` is called after every batch with the prompts' indices and their examples (what
    :func:`distill_cached` writes as it goes); ``desc`` labels the progress bar.
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
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress)
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
            gen = _generate(target, ids.to(device), mask.to(device), config)
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
        if on_batch is not None:
            on_batch(list(rows), [out[i] for i in rows])
    bar.close()
    return out


def _read_partial(path: Path, meta: dict[str, Any], total: int) -> dict[int, Example]:
    """The examples an interrupted :func:`distill_cached` wrote to ``path`` (``{prompt index:
    example}``), {} when absent or made with other settings; a torn last line is ignored."""
    if not path.is_file():
        return {}
    done: dict[int, Example] = {}
    with open(path) as f:
        try:
            head = json.loads(f.readline() or "{}")
        except json.JSONDecodeError:
            return {}
        if head.get("meta") != meta:
            return {}
        for line in f:
            try:
                r = json.loads(line)
                i, ex = int(r["i"]), Example(tuple(r["ids"]), int(r["prompt_len"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                break  # a line torn by the interruption: everything after it is regenerated
            if 0 <= i < total:
                done[i] = ex
    return done


#: the cache settings a greedy answer depends on besides its prompt (the rest of a cache's ``meta``
#: describes its prompt list)
ANSWER_KEYS = ("target", "dtype", "max_new_tokens", "temperature", "chat")


def _greedy_answers(cached: tuple[dict[str, Any] | None, list[Example]] | None,
                    meta: dict[str, Any]) -> dict[tuple[int, ...], Example]:  # fmt: skip
    """Prompt ids -> example of a greedy cache (``_read_examples``' meta and examples) made for another
    prompt list with the same :data:`ANSWER_KEYS` as ``meta`` ({} when sampled, absent or made
    otherwise). Greedy answers depend on the prompt alone: the target's answer to the same ids (up to
    the rounding of another batch's padding in 16-bit dtypes)."""
    if (meta.get("temperature") != 0 or cached is None or cached[0] is None
            or any(cached[0].get(k) != meta.get(k) for k in ANSWER_KEYS)):  # fmt: skip
        return {}
    return {ex.ids[: ex.prompt_len]: ex for ex in cached[1]}


def distill_cached(target, prompts: Sequence[Sequence[int]], cache: str | os.PathLike[str], meta: dict[str, Any], *,
                   max_new_tokens: int, batch_size: int, eos_token_id=None, pad_token_id: int = 0,
                   temperature: float = 0.0, seed: int = 0, progress: bool = True,
                   desc: str = "self-distill") -> list[Example]:  # fmt: skip
    """:func:`self_distill` with a cache: the examples of ``cache`` when it was made with ``meta``;
    else the target answers the prompts, every finished batch appended to ``CACHE.partial`` (first
    line ``{"meta": ...}``, then ``{"i", "ids", "prompt_len"}`` per prompt) so that an interrupted
    run resumes from what it wrote (a torn last line is dropped), and at the end the whole cache is
    written atomically (:func:`save_examples`) and the partial file removed. A resumed sampled
    generation draws other samples for the rest than an uninterrupted one would (greedy: the same)."""
    cache = Path(cache)
    cached = _read_examples(cache)
    examples = _made_with(cached, meta)
    if examples is not None and len(examples) == len(prompts):
        print(f"{desc}: {len(examples)} cached answers from {cache}")
        return examples
    partial = cache.with_name(cache.name + ".partial")
    done = _read_partial(partial, meta, len(prompts))
    if done:
        print(f"{desc}: resuming with {len(done)} of {len(prompts)} answers already in {partial}")
    lent = _greedy_answers(cached, meta)
    reused = {i: lent[tuple(p)] for i, p in enumerate(prompts) if i not in done and tuple(p) in lent}
    if reused:
        done.update(reused)
        print(f"{desc}: {len(reused)} of {len(prompts)} answers from {cache} (greedy, made for another prompt list)")
    missing = [i for i in range(len(prompts)) if i not in done]
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial.with_name(partial.name + ".tmp")
    with open(tmp, "w") as f:  # rewritten clean (the meta and what is done, no torn line), atomically
        f.write(json.dumps({"meta": meta}) + "\n")
        for i, ex in sorted(done.items()):
            f.write(json.dumps({"i": i, "ids": list(ex.ids), "prompt_len": ex.prompt_len}) + "\n")
    os.replace(tmp, partial)
    with open(partial, "a") as f:

        def write(rows: list[int], batch: list[Example]) -> None:
            for j, ex in zip(rows, batch):
                f.write(json.dumps({"i": missing[j], "ids": list(ex.ids), "prompt_len": ex.prompt_len}) + "\n")
            f.flush()

        new = self_distill(target, [prompts[i] for i in missing], max_new_tokens, batch_size, eos_token_id,
                           pad_token_id, temperature, seed + len(done), progress, on_batch=write, desc=desc)  # fmt: skip
    done.update(zip(missing, new))
    examples = [done[i] for i in range(len(prompts))]
    save_examples(examples, cache, meta)
    partial.unlink()
    return examples


def save_examples(examples: Sequence[Example], path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
    """Write examples as JSONL (first line: ``{"meta": ...}``), atomically."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for ex in examples:
            f.write(json.dumps({"ids": list(ex.ids), "prompt_len": ex.prompt_len}) + "\n")
    os.replace(tmp, p)


def _read_examples(path: str | os.PathLike[str]) -> tuple[dict[str, Any] | None, list[Example]] | None:
    """A cache written by :func:`save_examples`: its meta (None when it has none) and examples; None if absent."""
    p = Path(path)
    if not p.is_file():
        return None
    with open(p) as f:
        head = json.loads(f.readline() or "{}")
        return head.get("meta"), [Example(tuple(r["ids"]), int(r["prompt_len"])) for r in map(json.loads, f) if r]


def _made_with(cached: tuple[dict[str, Any] | None, list[Example]] | None,
               meta: dict[str, Any]) -> list[Example] | None:  # fmt: skip
    """A read cache's (``_read_examples``) examples if it was made with ``meta``, else None."""
    return cached[1] if cached is not None and cached[0] == meta else None


def load_examples(path: str | os.PathLike[str], meta: dict[str, Any]) -> list[Example] | None:
    """Examples cached by :func:`save_examples`, or None if absent or made with other settings."""
    return _made_with(_read_examples(path), meta)


@torch.no_grad()
def target_hidden_states(target, ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, H]`` final hidden states (what the LM head reads) of right-padded sequences."""
    out = target(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True, logits_to_keep=1,
                 use_cache=False)  # fmt: skip
    return out.hidden_states[-1]


def padded_batch(examples: Sequence[Example], device) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
    """``(ids [B, T], attention mask [B, T], lengths, prompt lengths)`` of ``examples``, right-padded
    with 0 to the longest one, on ``device``."""
    width = max(len(e.ids) for e in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    mask = torch.zeros(len(examples), width, dtype=torch.long)
    for b, e in enumerate(examples):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        mask[b, : len(e.ids)] = 1
    return ids.to(device), mask.to(device), [len(e.ids) for e in examples], [e.prompt_len for e in examples]


def warmup_cosine(step: int, total: int, warmup: float) -> float:
    """Learning-rate factor at optimizer step ``step`` (0-based) of ``total``: linear warm-up over
    the first ``warmup`` fraction of the steps (at least one), then cosine decay to 0 at ``total``."""
    warm = max(1, int(warmup * total))
    if step < warm:
        return (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return 0.5 * (1 + math.cos(math.pi * min(frac, 1.0)))


def check_run_fields(run: Any, at_least_one: Sequence[str], at_least_zero: Sequence[str]) -> None:
    """ValueError naming the field of a training run's settings that is out of range: the
    ``at_least_one`` / ``at_least_zero`` int fields, ``num_prompts`` (None or >= 1) and ``dtype``
    (None or one of :data:`DTYPES`)."""
    for names, low in ((at_least_one, 1), (at_least_zero, 0)):
        for name in names:
            val = getattr(run, name)
            if not isinstance(val, int) or isinstance(val, bool) or val < low:
                raise ValueError(f"{name}: expected an int >= {low}, got {val!r}")
    n = run.num_prompts
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"num_prompts: expected None or an int >= 1, got {n!r}")
    if run.dtype is not None and run.dtype not in DTYPES:
        raise ValueError(f"dtype: expected None or one of {tuple(DTYPES)}, got {run.dtype!r}")


@dataclass(frozen=True)
class LoadedTarget:
    """The frozen target of a training run (:func:`load_target`).

    Attributes:
        tokenizer, model: the target's.
        device, dtype: where and in which dtype the model sits.
        eos: the eos id(s) its answers end at (the generation config's, else the tokenizer's).
        pad: the padding id (the tokenizer's, else the eos id when a single one, else 0).
    """

    tokenizer: Any
    model: Any
    device: torch.device
    dtype: torch.dtype
    eos: int | list[int] | None
    pad: int


def load_target(name: str, device: str | None = None, dtype: str | None = None, progress: bool = True) -> LoadedTarget:
    """The target ``name`` (a default model name, HF id or local directory; ``specdec.models``).

    ``device``: default cuda when available, else cpu. ``dtype``: one of :data:`DTYPES`' names;
    default bf16 on cuda, fp32 elsewhere.
    """
    from specdec import models

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = parse_dtype(dtype, dev)
    tok = models.load_tokenizer(name, progress=progress)
    target = models.load_model(name, dtype=torch_dtype, device=dev, progress=progress)
    eos = target.generation_config.eos_token_id if target.generation_config is not None else None
    eos = eos if eos is not None else tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if isinstance(eos, int) else 0)
    return LoadedTarget(tok, target, dev, torch_dtype, eos, pad)
