"""Probe (H100, 2026-11-23): where the non-forward time of a generate call goes, and one lever on
the compiled verify forward. Random-weight model of Qwen2.5-Coder-1.5B's shapes (speed only).

    python3 docs/runs/2026-11-23-h100/probe_step.py prefill      # eager prefill vs a graphed chain
    python3 docs/runs/2026-11-23-h100/probe_step.py verify 0|1   # compiled 65-node verify, inductor freezing off / on
"""

import statistics
import sys
import time

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from specdec import hf
from specdec.graphs import GraphedForward
from specdec.kv import KVCache
from specdec.tree import TokenTree
from treeattn.layout import random_tree_parents


def build():
    cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                      tie_word_embeddings=False, pad_token_id=0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02, generator=gen)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
    hf.prepare_model(model.eval(), "target")
    return model


def timed(fn, reps):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return 1e3 * statistics.median(out), 1e3 * min(out)


def chain(tokens):
    n = len(tokens)
    return TokenTree(torch.tensor(tokens), torch.arange(-1, n - 1))


def main():
    model = build()
    cache = KVCache(1, 2048, num_layers=28)
    ids = torch.randint(0, 151936, (1, 1000))
    if sys.argv[1] == "prefill":
        for L in (200, 500, 1000):
            x = ids[:, :L]
            med, lo = timed(lambda: hf.prefill(model, x, cache), 7)
            print(f"eager prefill L={L}: median {med:.1f} ms (min {lo:.1f})", flush=True)
        for width in (256, 512):
            g = GraphedForward(model, cache, 1, width, capture=True)
            toks = ids[0].tolist()

            def graphed(L):
                for start in range(0, L, width):
                    g.run([chain(toks[start : min(start + width, L)])], [start])

            g.run([chain(toks[:width])], [0])
            for L in (200, 500, 1000):
                med, lo = timed(lambda: graphed(L), 7)
                print(f"graphed chain prefill width {width} L={L}: median {med:.1f} ms (min {lo:.1f})", flush=True)
            del g
        med, lo = timed(lambda: model(ids[:, :1000].cuda(), use_cache=False, logits_to_keep=1), 7)
        print(f"plain HF forward L=1000 (no cache, sdpa): median {med:.1f} ms (min {lo:.1f})")
    else:
        torch._inductor.config.freezing = sys.argv[2] == "1"
        hf.prefill(model, ids, cache)
        cache.lengths = [1000]
        parents = random_tree_parents(65, generator=torch.Generator().manual_seed(0))
        tree = TokenTree(torch.randint(0, 151936, (65,)), parents)
        g = GraphedForward(model, cache, 1, 65, capture=True, compile=True)
        t = time.perf_counter()
        g.run([tree], [1000])
        torch.cuda.synchronize()
        print(f"freezing={torch._inductor.config.freezing}: compile + capture {time.perf_counter() - t:.1f} s")
        g.load([tree], [1000])
        med, lo = timed(g.forward, 50)
        print(f"compiled verify 65 nodes: median {med:.3f} ms (min {lo:.3f}); "
              f"GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB peak")


if __name__ == "__main__":
    main()
