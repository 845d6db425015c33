"""``specdec generate``: speculative decoding of one prompt from the command line.

Loads the target (and the draft for ``--drafter model``, the default on a CPU; on a GPU prompt lookup
with the target compiled is: ``device_defaults``) through the model store
(``specdec.models``: default names are fetched and converted on first use, with progress bars),
builds the drafter with ``drafters.make_drafter``, decodes with ``SpecDecoder`` and prints the
completion (token by token as steps are accepted with ``--stream``) followed by a one-line
summary on stderr::

    64 tokens in 3.10 s (20.6 tok/s) | 21 steps, 3.05 tokens/step (accepted + bonus) | budgets 0x12 16x9

(``budgets``: with the default ``--tree-size auto``, the steps run at each node budget; the last
decision's costs and acceptance estimate are in ``--json``'s ``budget_reason``.)

The summary shows measured numbers only. ``--baseline`` also decodes the prompt with the target
alone (same engine, no drafter) and adds the measured speedup (and, greedy, whether the two texts
are identical; in fp32 they must be). Neither timed call pays the process's first-touch costs
(weight pages read from disk, buffer allocation, CUDA-graph capture): on a GPU the speculative
decoder's warm-up makes what its call replays, and the target alone makes a short untimed call
after the speculative call, before its own (so the speculative call and its first token are what
they are without ``--baseline``); on a CPU the target alone makes that call first (the decoders
share the target, and the speculative decoder's first steps measure the budgets' costs as they
would without ``--baseline``)::

    ... | target alone 6.20 s: measured speedup 2.00x (identical text)

The one-time costs are reported apart from the timed call: loading the models, the warm-up (on a
GPU the captures and compiles of every node budget's forward and their timing for the budget rule;
with ``--baseline`` the two untimed calls), and when the timed call's first token came, counted from
the process's start::

    ... | load 8.2 s, warm-up 3.1 s, first token 14.6 s after the process started

Tokens per step alone do not tell the speedup: a tree forward costs more than a one-token step
(on a CPU several times more), and drafting costs time too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from specdec.cli import args as cliargs
from specdec.dtypes import DTYPE_NAMES, cpu_bf16_native, parse_dtype

__all__ = ["GenerateResult", "build_parser", "main", "run_generate"]

#: On a CPU the draft-model drafter proposes a chain of this many tokens (depth = tree size, top-1):
#: measured 1.12x the target alone on a 2-core machine, where trees of 4-16 nodes (0.79-0.81x) and
#: prompt lookup (0.75-0.81x) were slower than the target alone (docs/runs/2026-11-23-cpu/).
CPU_CHAIN = 5
#: ``--baseline``: new tokens of the untimed call each decoder makes before the two timed ones.
_BASELINE_WARMUP_TOKENS = 8
DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"


def device_defaults(device_type: str) -> tuple[str, bool]:
    """The drafter and the ``compile`` setting ``run_generate`` uses when not given, on ``device_type``.

    On a GPU: prompt lookup with the target compiled layer-wise. The main command measured 1.32x the
    (compiled) target alone there, its first token 20.0 s after the process start with a warm compile
    cache, where the 0.5B draft model gave 1.02x uncompiled and 1.17x compiled (first token 45.8 s): the
    draft's forward costs too large a share of the 1.5B's (2 x H200, docs/RESULTS.md 2026-11-28, 07a2607).
    On a CPU: the draft model's chains, uncompiled (1.39-1.89x the target alone in bf16 on 2 cores).
    """
    return ("lookup", True) if device_type == "cuda" else ("model", False)


@dataclass(frozen=True)
class GenerateResult:
    """What ``run_generate`` produced.

    Attributes:
        text: the decoded completion (special tokens skipped).
        token_ids: the new token ids.
        output: the engine's ``GenerationOutput`` (per-step statistics).
        seconds: wall time of the speculative generate call.
        tokens_per_s: new tokens per second.
        mean_accepted: tokens emitted per target forward (accepted drafts + the bonus token).
        baseline_seconds: target-only decoding time (``baseline=True``), else None.
        baseline_text: target-only completion (``baseline=True``), else None.
        load_s: seconds loading the tokenizer, the models and the drafter (None: not measured).
        warmup_s: seconds between the load and the timed call: the decoder's warm-up and, with
            ``baseline=True``, both decoders' untimed calls (None: not measured).
        first_token_s: seconds from the process's start to the timed call's first new token (None:
            not measured).
        drafter, compiled: the drafter and the compile setting that ran (``device_defaults`` where
            not given; None: not recorded).
    """

    text: str
    token_ids: list[int]
    output: Any
    seconds: float
    tokens_per_s: float
    mean_accepted: float
    baseline_seconds: float | None = None
    baseline_text: str | None = None
    load_s: float | None = None
    warmup_s: float | None = None
    first_token_s: float | None = None
    drafter: str | None = None
    compiled: bool | None = None

    def numbers(self) -> dict[str, Any]:
        """The measured numbers as JSON-ready values (``--json``)."""
        base = self.baseline_seconds
        budget = self.output.budget
        return {
            "drafter": self.drafter, "compile": self.compiled,
            "budget_steps": None if budget is None else {str(n): k for n, k in budget.histogram.items()},
            "budget_reason": None if budget is None else budget.reason,
            "new_tokens": len(self.token_ids), "seconds": self.seconds, "tokens_per_s": self.tokens_per_s,
            "steps": len(self.output.steps), "tokens_per_step": self.mean_accepted,
            "baseline_seconds": base,
            "measured_speedup": base / self.seconds if base is not None and self.seconds > 0 else None,
            "same_text": None if self.baseline_text is None else self.baseline_text == self.text,
            "load_s": self.load_s, "warmup_s": self.warmup_s, "first_token_since_start_s": self.first_token_s,
            "phases_s": {k: v for k, v in self.output.totals().items() if k.endswith("_s")},
        }  # fmt: skip

    def summary(self) -> str:
        n = len(self.token_ids)
        steps = len(self.output.steps)
        line = (f"{n} tokens in {self.seconds:.2f} s ({self.tokens_per_s:.1f} tok/s) | {steps} steps, "
                f"{self.mean_accepted:.2f} tokens/step (accepted + bonus)")
        if self.output.budget is not None:
            line += " | budgets " + " ".join(f"{b}x{k}" for b, k in self.output.budget.histogram.items())
        if self.baseline_seconds is not None:
            measured = self.baseline_seconds / self.seconds if self.seconds > 0 else float("nan")
            same = "identical" if self.baseline_text == self.text else "different"
            line += f" | target alone {self.baseline_seconds:.2f} s: measured speedup {measured:.2f}x ({same} text)"
        once = [f"{name} {value:.1f} s" for name, value in (("load", self.load_s), ("warm-up", self.warmup_s))
                if value is not None]  # fmt: skip
        if self.first_token_s is not None:
            once.append(f"first token {self.first_token_s:.1f} s after the process started")
        if once:
            line += " | " + ", ".join(once)
        return line


class _Streamer:
    """Prints the decoded text of a growing token list, holding back incomplete characters."""

    def __init__(self, tokenizer, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, seq: int, tokens: list[int]) -> None:
        self.ids.extend(tokens)
        self._emit(final=False)

    def _emit(self, final: bool) -> None:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not final and text.endswith("\ufffd"):  # a multi-byte character split across tokens
            return
        if len(text) > self.printed:
            self.out.write(text[self.printed :])
            self.out.flush()
            self.printed = len(text)

    def finish(self) -> None:
        self._emit(final=True)


def encode(tokenizer, prompt: str, chat: bool | None) -> list[int]:
    """Prompt ids: through the chat template (with a generation prompt) when ``chat`` (None: if there is one)."""
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat: the tokenizer has no chat template; pass --no-chat")
        enc = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)  # fmt: skip
        return list(enc["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def run_generate(
    prompt: str,
    *,
    target: str = DEFAULT_TARGET,
    draft: str = DEFAULT_DRAFT,
    drafter: str | None = None,
    heads: str | None = None,
    tree_size: int | str | None = None,
    max_tree_size: int | None = None,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    device: str | None = None,
    dtype: str | None = None,
    chat: bool | None = None,
    stream: bool = False,
    baseline: bool = False,
    attn_impl: str = "auto",
    depth: int | None = None,
    topk: int | None = None,
    split: str | None = None,
    compile: bool | None = None,
    progress: bool = True,
    out: TextIO | None = None,
) -> GenerateResult:
    """Decode ``prompt`` speculatively; print the completion to ``out`` (streamed if ``stream``).

    ``temperature == 0`` is greedy decoding (the target's own greedy output; see ``dtype``);
    ``temperature > 0`` samples (with ``top_p``) losslessly. ``device`` defaults to cuda when
    available, else cpu; ``dtype`` (fp32 / bf16 / fp16) to bf16 on cuda and on a CPU that multiplies
    bf16 natively (``specdec.dtypes.cpu_bf16_native``: about twice as fast as fp32 there), else fp32.
    Greedy output is the target's own in that dtype; in bf16 a tree's logits may round differently
    from a one-token step's, so a near-tie can decode another token than the target alone would.
    ``tree_size``: an int, or ``"auto"`` (the default, None): every step picks its node budget --
    plain decoding included -- from measured costs (``SpecDecoder(tree_size="auto")``: on a GPU a
    warm-up before the timed call captures every budget's forward and times it; on a CPU the call's
    first steps measure them), up to ``max_tree_size``: default 64 on cuda and 16 on cpu,
    except for the draft-model drafter on a CPU: chains of up to ``CPU_CHAIN`` tokens (``depth`` =
    ``CPU_CHAIN``, ``topk`` 1; measured faster than the target alone there, unlike trees).
    ``drafter`` / ``compile``: None takes ``device_defaults`` (prompt lookup, compiled, on a GPU; the
    draft model on a CPU).
    ``depth`` / ``topk`` tune the draft-model drafter; ``split`` (``"priority"`` / ``"yield"``) how a
    merged drafter divides each step's budget (``drafters.merge.MergedDrafter``). ``compile`` (CUDA only):
    the target's forwards through the layer-wise compile (``SpecDecoder(compile=True)``, the target alone
    of ``baseline`` too), the draft model's device loop likewise (``compile="layers"``) and the EAGLE
    head's expansion (``compile_head``): inductor's kernels cached on disk, so the first process pays the
    compile in its warm-up and later ones load it.
    """
    import torch

    from drafters import DRAFTERS, make_drafter
    from specdec import hf, models
    from specdec.engine import SpecDecoder
    from specdec.timing import since_process_start

    out = sys.stdout if out is None else out
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    default_drafter, default_compile = device_defaults(dev.type)
    drafter = default_drafter if drafter is None else drafter
    compile = default_compile if compile is None else compile
    parts = _drafter_parts(drafter)
    if parts is None:
        raise ValueError(f"drafter: expected one of {DRAFTERS} or distinct ones joined by '+' (a merged tree, e.g. "
                         f"lookup+eagle), got {drafter!r}")  # fmt: skip
    with_heads = [p for p in parts if p in ("medusa", "eagle")]
    if with_heads and not heads:
        raise ValueError(f"heads: --drafter {drafter} needs --heads DIR (trained with specdec train-{with_heads[0]})")
    if len(with_heads) > 1:
        raise ValueError(f"drafter: one --heads DIR serves one of medusa / eagle, got {drafter!r}")
    if not temperature >= 0:
        raise ValueError(f"temperature: expected >= 0 (0 = greedy), got {temperature!r}")
    if split is not None and len(parts) == 1:
        raise ValueError(f"split: divides a merged drafter's budget (names joined by '+'), got it with --drafter {drafter}")
    if compile and dev.type != "cuda":
        raise ValueError(f"compile: needs a CUDA device (the compiled forwards are captured with fixed shapes), got {dev}")
    dtype = dtype or ("bf16" if dev.type == "cuda" or cpu_bf16_native() else "fp32")
    torch_dtype = parse_dtype(dtype)
    tree_size = "auto" if tree_size is None else tree_size
    if tree_size != "auto" and max_tree_size is not None:
        raise ValueError(f"max_tree_size: expected None unless tree_size is 'auto', got {max_tree_size!r}")
    if dev.type != "cuda" and drafter == "model" and tree_size == "auto" and max_tree_size is None:
        max_tree_size, depth, topk = CPU_CHAIN, depth or CPU_CHAIN, topk or 1  # measured on a 2-core CPU
    if tree_size == "auto" and max_tree_size is None:
        max_tree_size = 64 if dev.type == "cuda" else 16
    sizes: dict[str, Any] = {"tree_size": tree_size}
    if tree_size == "auto":
        sizes["max_tree_size"] = max_tree_size

    t_load = time.perf_counter()
    tokenizer = models.load_tokenizer(target, progress=progress)
    target_model = models.load_model(target, dtype=torch_dtype, device=dev, progress=progress)
    options: dict[str, Any] = {}
    draft_model = None
    if "model" in parts:
        draft_model = models.load_model(draft, dtype=torch_dtype, device=dev, progress=progress)
        prefix = "" if drafter == "model" else "model."
        options = {prefix + k: v for k, v in (("depth", depth), ("topk", topk)) if v is not None}
        if compile:
            options[prefix + "compile"] = "layers"
    if compile and "eagle" in parts:
        options["compile_head" if drafter == "eagle" else "eagle.compile_head"] = True
    if split is not None:
        options["split"] = split
    made = make_drafter(drafter, target=target_model, draft_model=draft_model, heads=heads, device=dev,
                        dtype=torch_dtype, **options)  # fmt: skip
    decoder = SpecDecoder(target_model, made, attn_impl=attn_impl, compile=compile, **sizes)

    ids = torch.tensor(encode(tokenizer, prompt, chat), dtype=torch.int64)
    load_s = time.perf_counter() - t_load
    t_warm = time.perf_counter()
    if decoder.static_shapes:
        # the forwards the call will replay, captured / compiled, caches (the drafter's too) sized for the
        # whole call, and with "auto" the step costs the budget rule starts from. Without it a fixed tree
        # size's draft cache grew inside the timed call and recaptured its loop there (0.7 s on an H200).
        # With dynamic shapes (a CPU) there is nothing to build, and the call's first steps measure each
        # budget (drafting there, on the real prompt, also tells the rule how much is accepted)
        need = len(ids) + max_new_tokens
        if progress:  # a quiet stretch otherwise: a first compile takes about a minute
            what = "compiling and capturing" if compile else "capturing"
            print(f"specdec generate: warming up ({what} every node budget's forward; a first compile on this "
                  f"machine takes about a minute, later runs load its kernels from disk)", file=sys.stderr, flush=True)  # fmt: skip
        decoder.warmup((1,), max_len=need, min_len=need, log=None)
    eos = hf.eos_token_ids(target_model, tokenizer)
    sample = temperature > 0
    kwargs = dict(do_sample=sample, temperature=temperature if sample else 1.0, top_p=top_p, eos_token_id=eos or None)

    plain = SpecDecoder(target_model, None, attn_impl=attn_impl, compile=compile) if baseline else None

    def warm_plain() -> None:
        plain.generate(ids, _BASELINE_WARMUP_TOKENS, generator=torch.Generator(device=dev).manual_seed(seed), **kwargs)

    # A fair comparison, and the speculative call (its first token included) as it runs without --baseline:
    # both decoders warm before their timed calls. With static shapes the warm-up above made the speculative
    # decoder's (and touched the target's weights); the target alone is warmed after the speculative call,
    # before its own. With dynamic shapes (a CPU) nothing is captured: the target is warmed first (its
    # first-touch weight pages serve both), and the speculative call's first steps measure the budgets.
    if plain is not None and not decoder.static_shapes:
        warm_plain()
    streamer = _Streamer(tokenizer, out) if stream else None
    first_token: list[float] = []

    def on_tokens(seq: int, tokens: list[int]) -> None:
        if not first_token and tokens:
            first_token.append(since_process_start())
        if streamer is not None:
            streamer(seq, tokens)

    gen = torch.Generator(device=dev).manual_seed(seed)
    _sync(dev)
    warmup_s = time.perf_counter() - t_warm
    t0 = time.perf_counter()
    result = decoder.generate(ids, max_new_tokens, generator=gen, on_tokens=on_tokens, **kwargs)
    _sync(dev)
    seconds = time.perf_counter() - t0
    new = result.new_tokens(0).tolist()
    text = tokenizer.decode(new, skip_special_tokens=True)
    if streamer is not None:
        streamer.finish()
    else:
        out.write(text)
    out.write("\n")
    out.flush()

    base_s = base_text = None
    if plain is not None:
        if decoder.static_shapes:
            warm_plain()
        gen = torch.Generator(device=dev).manual_seed(seed)
        _sync(dev)
        t0 = time.perf_counter()
        ref = plain.generate(ids, max_new_tokens, generator=gen, **kwargs)
        _sync(dev)
        base_s = time.perf_counter() - t0
        base_text = tokenizer.decode(ref.new_tokens(0).tolist(), skip_special_tokens=True)
    return GenerateResult(text, new, result, seconds, len(new) / seconds if seconds > 0 else float("nan"),
                          result.mean_accepted, base_s, base_text, load_s, warmup_s,
                          first_token[0] if first_token else None, drafter, compile)  # fmt: skip


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drafter_parts(name: Any) -> list[str] | None:
    """The drafter names in ``name`` (one, or several joined by '+'), or None if it names no valid drafter."""
    from drafters import DRAFTERS  # light: the drafters load their modules lazily

    parts = name.split("+") if isinstance(name, str) else []
    if not parts or any(p not in DRAFTERS for p in parts) or len(set(parts)) != len(parts):
        return None
    return parts


def _drafter_name(text: str) -> str:
    from drafters import DRAFTERS

    if _drafter_parts(text) is None:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DRAFTERS)} or distinct ones joined by '+', "
                                         f"got {text!r}")  # fmt: skip
    return text


def build_parser() -> argparse.ArgumentParser:

    parser = cliargs.ArgumentParser(
        prog="specdec generate",
        description="Speculative decoding of one prompt: prints the completion and a one-line summary "
        "(tokens/s, mean accepted tokens per step, speedup estimate) on stderr.",
    )
    parser.add_argument("prompt", type=cliargs.nonempty_text,
                        help="the prompt (a user message when the chat template is used)")  # fmt: skip
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"default model name, HF id or local dir (default {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help=f"draft model for --drafter model (default {DEFAULT_DRAFT})")
    parser.add_argument("--drafter", type=_drafter_name, default=None,
                        help="model: draft LM tree, medusa: Medusa heads (--heads), lookup: prompt lookup, eagle: EAGLE "
                             "heads (--heads); several joined by '+' merge their trees (lookup+eagle). Default: lookup "
                             "on cuda (with --compile), model on cpu: what measured fastest there")
    parser.add_argument("--heads", type=cliargs.existing_path, default=None,
                        help="Medusa / EAGLE heads directory (specdec train-medusa / train-eagle --out)")
    parser.add_argument("--tree-size", type=cliargs.tree_size(0), default="auto",
                        help="draft nodes per step, or auto (default): each step picks its budget, 0 (plain "
                             "decoding) included, from measured costs (on cuda a warm-up before the timed call "
                             "captures and times every budget; on cpu the call's first steps measure them)")
    parser.add_argument("--max-tree-size", type=cliargs.int_at_least(1), default=None,
                        help=f"with --tree-size auto, the largest budget (default 64 on cuda; on cpu chains of up "
                             f"to {CPU_CHAIN} for --drafter model, else 16)")
    parser.add_argument("--depth", type=cliargs.int_at_least(1), default=None, help=f"draft-model tree depth (default 3; {CPU_CHAIN} on cpu)")
    parser.add_argument("--topk", type=cliargs.int_at_least(1), default=None, help="draft-model frontier width (default 8; 1 on cpu)")
    parser.add_argument("--split", choices=["priority", "yield"], default=None,
                        help="how a merged drafter (names joined by '+') divides each step's budget: fixed caps in "
                             "order (priority, the default) or by the parts' recent yield")
    parser.add_argument("--max-new-tokens", type=cliargs.int_at_least(1), default=256)
    parser.add_argument("--temperature", type=cliargs.float_in(0.0), default=0.0, help="0 = greedy (default); > 0 samples losslessly")
    parser.add_argument("--top-p", type=cliargs.float_in(0.0, 1.0, low_open=True), default=1.0,
                        help="nucleus sampling mass in (0, 1] (default 1 = off)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", type=cliargs.device, default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="default: bf16 on cuda and on CPUs with native bf16 (AVX512-BF16 / AMX), else fp32")
    parser.add_argument("--stream", action="store_true", help="print tokens as each step accepts them")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="wrap the prompt in the tokenizer's chat template (default: when it has one)")
    parser.add_argument("--baseline", action="store_true", help="also decode with the target alone; report the measured speedup")
    parser.add_argument("--attn-impl", choices=["auto", "triton", "torch"], default="auto",
                        help="tree attention implementation (auto: Triton on CUDA)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="cuda only: compile the target's forwards layer-wise (the target alone of --baseline too), "
                             "the draft model's loop likewise and the EAGLE head's expansion; the first run's warm-up "
                             "compiles, later runs load the kernels from the on-disk cache (default: on with cuda, off "
                             "on cpu)")
    parser.add_argument("--no-progress", action="store_true", help="no model fetch/convert progress bars")
    parser.add_argument("--json", type=cliargs.output_file, default=None, dest="json_out",
                        help="also write the run's numbers (settings, tokens, seconds, tokens/step, target-alone "
                             "seconds with --baseline) to this JSON file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    result = run_generate(
        ns.prompt, target=ns.target, draft=ns.draft, drafter=ns.drafter, heads=ns.heads, tree_size=ns.tree_size,
        max_tree_size=ns.max_tree_size,
        max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_p=ns.top_p, seed=ns.seed,
        device=ns.device, dtype=ns.dtype, chat=ns.chat, stream=ns.stream, baseline=ns.baseline,
        attn_impl=ns.attn_impl, depth=ns.depth, topk=ns.topk, split=ns.split, compile=ns.compile,
        progress=not ns.no_progress,
    )  # fmt: skip
    print(result.summary(), file=sys.stderr)
    if ns.json_out:
        settings = {k: v for k, v in vars(ns).items() if k not in ("json_out", "stream", "no_progress")}
        with open(ns.json_out, "w") as f:
            json.dump({"settings": settings, **result.numbers()}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
