"""Host microseconds per decoding step, per engine phase, on a tiny random Qwen2 model on the CPU.

The engine's ``SpecDecoder._step`` runs with static shapes (the fixed-shape ``GraphedForward``
path a GPU run takes, without CUDA graphs) and every phase below is timed with
``time.perf_counter`` around the call that makes it; the medians over many steps are printed.
The target forward (``forward``) and the drafter's own ``propose`` / ``update`` are shown apart
and left out of ``engine``: on a GPU the forward is asynchronous device work and the drafter is
not the engine's. So ``engine`` predicts the host time one step adds between the GPU's phases.

Phases (nested ones are not counted twice in ``engine``):
  draft_host   ``_draft`` minus ``propose`` (root-only trees, contexts, ``_checked_tree``)
  load         ``GraphedForward.load`` (tree inputs packed on the host and copied)
  verify       ``_verify`` (argmax / warp, the walk down the tree)
  accept       ``_accept`` (tokens appended, eos / length cuts, hidden-state gathers)
  commit       ``KVCache.commit``
  rest         the rest of ``_step`` (timers, rank sync, ``StepStats``, the callbacks)

Example: ``PYTHONPATH=. python scripts/host_profile.py --drafter eagle --tree-size 64``
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

PHASES = ("draft_host", "load", "verify", "accept", "commit", "rest")


def randomize(module: torch.nn.Module) -> torch.nn.Module:
    """Every matrix of ``module`` drawn from N(0, 0.2) (peaked, varied logits), in eval mode."""
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    return module.eval()


def tiny_qwen2(vocab: int, hidden: int, layers: int, seed: int):
    """A random Qwen2 causal LM of the given sizes (4 query heads, 2 KV heads), not yet prepared."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)  # fmt: skip
    return randomize(tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa"))


def _drafter(name: str, target, args):
    if name == "none":
        return None
    if name == "lookup":
        from drafters.lookup import LookupDrafter

        return LookupDrafter(max_depth=8)
    from drafters.eagle import EagleDrafter, EagleHead

    torch.manual_seed(args.seed + 1)
    head = randomize(EagleHead(target))
    return EagleDrafter(target, head, depth=args.depth, topk=args.topk, static_shapes=True)


class _Clock:
    """Seconds per phase of the current step, filled by wrapped methods."""

    def __init__(self) -> None:
        self.step: dict[str, float] | None = None
        self.steps: list[dict[str, float]] = []

    def wrap(self, owner, attr: str, phase: str) -> None:
        inner = getattr(owner, attr)
        clock = self

        def timed(*a, **k):
            if clock.step is None:
                return inner(*a, **k)
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                clock.step[phase] = clock.step.get(phase, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    @contextlib.contextmanager
    def stepping(self):
        self.step = {}
        yield
        self.steps.append(self.step)
        self.step = None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=("eagle", "lookup", "none"), default="eagle")
    ap.add_argument("--tree-size", type=int, default=64, help="nodes per step besides the root (0: plain decoding)")
    ap.add_argument("--depth", type=int, default=6, help="EAGLE tree depth")
    ap.add_argument("--topk", type=int, default=8, help="EAGLE frontier width")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=200, help="new tokens per sequence and call")
    ap.add_argument("--calls", type=int, default=3, help="timed generate calls (after one warm-up call)")
    ap.add_argument("--sample", action="store_true", help="sample (temperature 1) instead of greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    args = ap.parse_args(argv)

    from specdec.engine import SpecDecoder
    from specdec.graphs import GraphedForward
    from specdec.hf import prepare_model
    from specdec.kv import KVCache

    torch.set_num_threads(args.threads)
    target = tiny_qwen2(args.vocab, 64, args.layers, args.seed)
    prepare_model(target)
    drafter = _drafter(args.drafter, target, args)
    tree_size = args.tree_size if drafter is not None else 0
    dec = SpecDecoder(target, drafter, tree_size, static_shapes=True, cuda_graphs=False,
                      max_cache_len=args.prompt_len + args.new_tokens + tree_size + 8)  # fmt: skip

    clock = _Clock()
    for attr, phase in (("_draft", "draft"), ("_verify", "verify"), ("_accept", "accept")):
        clock.wrap(SpecDecoder, attr, phase)
    clock.wrap(GraphedForward, "load", "load")
    clock.wrap(GraphedForward, "forward", "forward")
    clock.wrap(KVCache, "commit", "commit")
    if drafter is not None:
        clock.wrap(drafter, "propose", "propose")
        clock.wrap(drafter, "update", "update")
    step = SpecDecoder._step

    def timed_step(self, run, budget):
        with clock.stepping():
            t0 = time.perf_counter()
            out = step(self, run, budget)
            clock.step["step"] = time.perf_counter() - t0
        return out

    SpecDecoder._step = timed_step

    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, args.vocab, (args.batch, args.prompt_len), generator=gen)
    kw = dict(do_sample=args.sample, generator=gen)
    dec.generate(prompts, args.new_tokens, **kw)  # warm-up: first runs, allocations
    clock.steps.clear()
    emitted = 0
    for _ in range(args.calls):
        emitted += dec.generate(prompts, args.new_tokens, **kw).num_new_tokens

    rows = []
    for s in clock.steps:
        g = s.get
        row = {"draft_host": g("draft", 0) - g("propose", 0), "load": g("load", 0), "verify": g("verify", 0),
               "accept": g("accept", 0), "commit": g("commit", 0)}  # fmt: skip
        inner = sum(row.values()) + g("forward", 0) + g("propose", 0) + g("update", 0)
        row["rest"] = g("step") - inner
        row["engine"] = sum(row[p] for p in PHASES)
        row["forward"], row["propose"], row["update"] = g("forward", 0), g("propose", 0), g("update", 0)
        rows.append(row)
    print(f"drafter={args.drafter} tree_size={tree_size} batch={args.batch} vocab={args.vocab} "
          f"layers={args.layers} {'sampling' if args.sample else 'greedy'}: {len(rows)} steps, "
          f"{emitted / max(len(rows), 1):.2f} tokens/step per batch")  # fmt: skip
    print("phase          median us   mean us")
    for name in (*PHASES, "engine", "forward", "propose", "update"):
        vals = [r[name] * 1e6 for r in rows]
        print(f"{name:<14} {statistics.median(vals):9.1f} {statistics.fmean(vals):9.1f}")


if __name__ == "__main__":
    main()
