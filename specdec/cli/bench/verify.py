"""(b) one target verify forward of a random tree per tree size over the first prompt's KV, eager
vs graphed."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from specdec.cli.bench.common import fmt, median_ms, random_tree, time_graphed
from specdec.cli.bench.setup import Setup, prefill_first_prompt


def run_verify(setup: Setup, log: Callable[[str], None]) -> dict[str, Any]:
    """Median ms of load + forward of an n-node random tree over the first prompt, eager vs graph."""
    import torch

    from specdec import hf
    from specdec.graphs import GraphedForward

    cfg = setup.cfg
    prompt, prefix, cache = prefill_first_prompt(setup)
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = hf.vocab_size(setup.target)
    sizes = sorted(set(cfg.tree_sizes) | {1})
    graph_ok = setup.device.type == "cuda"
    rows = []
    for n in sizes:
        tree = random_tree(n, int(prompt[-1]), vocab, gen)
        row: dict[str, Any] = {"nodes": n, "prefix_len": prefix}
        logits = {}
        for mode in ("eager", "graph"):
            graphed = GraphedForward(setup.target, cache, 1, n, impl=cfg.attn_impl, capture=mode == "graph" and graph_ok)
            # Two untimed runs first (the first captures); the logits of the last run, as float.
            times = time_graphed(setup.timer, cfg.reps, graphed, tree, prefix)
            logits[mode] = graphed.logits.float().clone()
            row[f"{mode}_ms"] = median_ms(times)
            row[f"{mode}_min_ms"] = min(times) * 1e3
        row["graph_captured"] = graph_ok
        row["max_abs_logit_diff"] = float((logits["eager"] - logits["graph"]).abs().max())
        rows.append(row)
    base = {m: rows[0][f"{m}_ms"] for m in ("eager", "graph")}
    for row in rows:
        for m in ("eager", "graph"):
            row[f"{m}_x_plain"] = row[f"{m}_ms"] / base[m] if base[m] > 0 else math.nan
    return {"prefix_len": prefix, "capacity": setup.capacity, "reps": cfg.reps, "rows": rows,
            "plain_ms_per_token": dict(setup.plain_ms)}


def format_verify(res: dict[str, Any]) -> str:
    plain = ", ".join(f"{k} {v:.2f}" for k, v in res.get("plain_ms_per_token", {}).items())
    lines = [f"prefix {res['prefix_len']} tokens, cache capacity {res['capacity']}, median of {res['reps']}"
             + (f"; (a) ms/token: {plain}" if plain else ""),
             f"{'nodes':>6}{'eager ms':>10}{'x plain':>9}{'graph ms':>10}{'x plain':>9}{'eager/graph':>13}{'max |dlogit|':>14}",
             "-" * 71]  # fmt: skip
    for r in res["rows"]:
        speed = r["eager_ms"] / r["graph_ms"] if r["graph_ms"] > 0 else math.nan
        lines.append(f"{r['nodes']:>6}{fmt(r['eager_ms'], '10.3f')}{fmt(r['eager_x_plain'], '9.2f')}"
                     f"{fmt(r['graph_ms'], '10.3f')}{fmt(r['graph_x_plain'], '9.2f')}{fmt(speed, '13.2f')}"
                     f"{fmt(r['max_abs_logit_diff'], '14.2e')}")  # fmt: skip
    return "\n".join(lines)
