"""Host time of the EAGLE drafter's ``propose`` / ``update`` around its head forwards (a dev tool).

A tiny random Qwen2 target and a random EAGLE head on the CPU, ``static_shapes=True`` (the fused
catch-up of the GPU runs), a long prompt, then ``--steps`` propose / update rounds per tree size with
a fixed acceptance walk. Per step it splits the drafter's wall time into:

- ``prep``: ``propose`` up to the expansion (token history, features, catch-up inputs, plan);
- ``tree``: ``propose`` after the expansion's record (or, with ``--rerank device``, its re-ranked
  tree) reached the host (the host re-rank, TokenTree, the proposal's bookkeeping);
- ``update``: the whole ``update`` (expanded path, KV commit, token history);
- the functions named by ``--detail`` (those the drafter has; each call's time, summed per step).

The expansion itself (head forwards, with ``--rerank device`` the re-rank, the copy back) is
excluded: on a GPU it is device work. Reports
the median µs per step over the steps after ``--skip`` (the first ones pay the long prompt's
unfused catch-up and allocations). CPU-measured on a tiny model: it predicts the host part of a GPU
step, not its device part.

    PYTHONPATH=. python scripts/eagle_host_profile.py --prompt 1500 --steps 400 --sizes 64 128
    PYTHONPATH=. python scripts/eagle_host_profile.py --rerank device   # the re-rank inside the expansion
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import torch
from host_profile import randomize, tiny_qwen2  # this directory (the script's own) is on sys.path

DETAIL = ("drafters.eagle_expansion:ExpansionPlan.tree", "drafters.eagle_expansion:ExpansionPlan.ranked_tree",
          "drafters.eagle:EagleDrafter._real_features",
          "drafters.eagle:EagleDrafter._catch_up_inputs", "drafters.eagle:EagleDrafter._history",
          "drafters.eagle:expanded_path", "specdec.tree:TokenTree.__init__")


def _wrap(spec: str, times: dict[str, float]) -> None:
    """Replace ``module:Owner.attr`` (or ``module:function``) by a timing wrapper, if it exists."""
    import importlib

    mod_name, path = spec.split(":")
    owner = importlib.import_module(mod_name)
    *owners, attr = path.split(".")
    for name in owners:
        owner = getattr(owner, name, None)
        if owner is None:
            return
    raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr, None)
    if raw is None:
        return
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[path] = times.get(path, 0.0) + time.perf_counter() - t

    setattr(owner, attr, type(raw)(timed) if isinstance(raw, (staticmethod, classmethod)) else timed)


def profile(size: int, args, target, head) -> dict[str, float]:
    from drafters.eagle import EagleDrafter
    from drafters.eagle_expansion import Expansion
    from specdec.drafting import DraftContext
    from specdec.verify import Verdict

    drafter = EagleDrafter(target, head, depth=args.depth, topk=args.topk, static_shapes=True, rerank=args.rerank)
    total_len = args.prompt + 5 * (args.steps + args.skip) + 16
    drafter.warmup(max_len=total_len)
    gen = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(3, target.config.vocab_size, (args.prompt,), generator=gen)
    drafter.reset([tokens])
    hidden = head.hidden_size

    marks: dict[str, float] = {}
    run = Expansion.run

    def timed_run(self, *a, **k):
        marks["enter"] = time.perf_counter()
        out = run(self, *a, **k)
        marks["exit"] = time.perf_counter()
        return out

    Expansion.run = timed_run
    details: dict[str, float] = {}
    for spec in args.detail:
        _wrap(spec, details)
    rows: list[dict[str, float]] = []
    new_feats = args.prompt - 1
    try:
        for step in range(args.skip + args.steps):
            feats = torch.randn(new_feats, hidden, generator=gen)
            ctx = DraftContext(tokens, size, hidden=feats)
            details.clear()
            marks.clear()
            t0 = time.perf_counter()
            tree = drafter.propose(ctx)
            t1 = time.perf_counter()
            # the acceptance walk: the first child for 0..3 levels, then a random bonus token
            path = [0]
            for _ in range(int(torch.randint(4, (1,), generator=gen))):
                kids = tree.children[path[-1]]
                if not kids:
                    break
                path.append(kids[0])
            bonus = int(torch.randint(3, target.config.vocab_size, (1,), generator=gen))
            verdict = Verdict(tuple(path), bonus)
            t2 = time.perf_counter()
            drafter.update(ctx, tree, verdict)
            t3 = time.perf_counter()
            tokens = torch.cat([tokens, torch.tensor(tree.path_tokens(path[1:]) + [bonus])])
            new_feats = len(path)
            if step < args.skip or "enter" not in marks:
                continue
            row = {"prep": marks["enter"] - t0, "tree": t1 - marks["exit"], "update": t3 - t2}
            row["host total"] = row["prep"] + row["tree"] + row["update"]
            row.update(details)
            rows.append(row)
    finally:
        Expansion.run = run
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return {k: 1e6 * statistics.median(r.get(k, 0.0) for r in rows) for k in keys} | {"len": float(len(tokens))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1500, help="prompt tokens (default 1500)")
    ap.add_argument("--steps", type=int, default=300, help="measured steps per tree size (default 300)")
    ap.add_argument("--skip", type=int, default=5, help="first steps not measured (default 5)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128], help="tree sizes (default 64 128)")
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1000, help="the tiny target's vocabulary (default 1000)")
    ap.add_argument("--hidden", type=int, default=64, help="the tiny target's hidden size (default 64)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rerank", choices=("host", "device"), default="host",
                    help="EagleDrafter(rerank=): where the record becomes the tree (default host, the CPU's auto)")
    ap.add_argument("--detail", nargs="*", default=list(DETAIL),
                    help="module:qualname of functions timed on their own (those missing are skipped)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per tree size")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from drafters.eagle import EagleHead

    target = tiny_qwen2(args.vocab, args.hidden, 2, args.seed)
    torch.manual_seed(args.seed + 1)
    head = randomize(EagleHead(target))
    for size in args.sizes:
        res = profile(size, args, target, head)
        if args.json:
            print(json.dumps({"tree_size": size, "rerank": args.rerank, **{k: round(v, 1) for k, v in res.items()}}))
            continue
        print(f"t = {size}, depth {args.depth}, topk {args.topk}, re-rank on the {args.rerank}, "
              f"prompt {args.prompt} -> {int(res.pop('len'))} "
              f"tokens: median µs per step over {args.steps} steps")
        for k, v in res.items():
            print(f"  {k:<32} {v:8.1f}")


if __name__ == "__main__":
    main()
