"""Device helper of scripts/device/multigpu.sh: a tensor-parallel target vs one GPU (argparse -> library calls).

    python scripts/device/multigpu.py build --layers 32 --out /tmp/mg/llama8b      # random Llama-3-8B shapes
    python scripts/device/multigpu.py run --model DIR --out one.json [--drafter lookup|model --draft DIR]
    torchrun --standalone --nproc-per-node 2 scripts/device/multigpu.py run --model DIR --out tp2.json ...
    python scripts/device/multigpu.py compare one.json tp2.json
    [torchrun --standalone --nproc-per-node 2] scripts/device/multigpu.py forward --model DIR --nodes 1 16 64 --out f.json

``run`` under torchrun (``WORLD_SIZE`` > 1) loads the target split over the ranks
(``specdec.distributed.load_tensor_parallel``: ``specdec.tensor_parallel``'s local shards, each rank
on ``cuda:LOCAL_RANK``) and a draft model replicated per rank; ``SpecDecoder`` finds the TP group
and keeps the ranks in lockstep. Rank 0 writes the JSON: per prompt the new tokens and seconds,
tokens/s at batch size 1 after a warm-up. ``forward`` times one captured tree forward (the verify
forward) per node count over a prompt already in the cache: the replay's median, CUDA events.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repo's packages

import torch  # noqa: E402

from specdec.engine import DEFAULT_DECODE_CHUNK  # noqa: E402

CODE_PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "# Read n integers from stdin and print their sum, then their product.\nimport sys\n\n",
    "class Stack:\n    \"\"\"A stack with push, pop, peek and is_empty.\"\"\"\n\n    def __init__(self):\n",
    "Write a Python function that returns the longest palindromic substring of a string s.\n\n",
]


def _build(ns) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from specdec.cli.bench.config import SCALE_CONFIGS

    fields = dict(SCALE_CONFIGS[ns.config], num_hidden_layers=ns.layers)
    config = LlamaConfig(**fields, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    device = torch.device(ns.device)
    t0 = time.perf_counter()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[ns.dtype]
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    gen = torch.Generator(device=device).manual_seed(ns.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, ns.std, generator=gen)
            else:
                p.fill_(1.0)  # RMSNorm weights (Llama has no biases)
    model.generation_config = GenerationConfig(pad_token_id=0)
    model.save_pretrained(ns.out, max_shard_size="4GB")
    n = sum(p.numel() for p in model.parameters())
    print(f"built {ns.layers}-layer {ns.config} shapes ({n / 1e9:.2f} B params, {ns.dtype}) into {ns.out} in "
          f"{time.perf_counter() - t0:.0f} s")  # fmt: skip


def _prompts(ns, tokenizer, vocab: int) -> list[torch.Tensor]:
    if tokenizer is None:  # a random-weight model: random ids with a repeated stretch (prompt lookup finds it)
        g = torch.Generator().manual_seed(ns.seed)
        out = []
        for _ in range(ns.num_prompts):
            head = torch.randint(10, vocab, (ns.prompt_len // 2,), generator=g)
            out.append(torch.cat([head, head])[: ns.prompt_len])
        return out
    texts = list(CODE_PROMPTS)
    if ns.prompts_file:
        with open(ns.prompts_file, encoding="utf-8") as f:
            texts = [json.loads(line)["description"] for line in f if line.strip()][: ns.num_prompts]
    return [tokenizer(t, return_tensors="pt").input_ids[0] for t in texts[: ns.num_prompts]]


def _load(ns):
    """The target on this rank (split over the ranks under torchrun): (model, rank, world, device)."""
    from transformers import AutoModelForCausalLM

    from specdec.distributed import load_tensor_parallel

    from specdec.cli.bench.common import set_inductor_options

    ns.inductor = set_inductor_options(ns.inductor)  # recorded as set in the results
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[ns.dtype]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()  # without: a CPU smoke test of this script (gloo under torchrun)
    if world > 1:
        target = load_tensor_parallel(ns.model, dtype=dtype, one_shot={"auto": "auto", "off": False, "push": "push"}[ns.one_shot])
        rank = int(os.environ["RANK"])
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    else:
        rank, device = 0, torch.device("cuda", 0) if cuda else torch.device("cpu")
        target = AutoModelForCausalLM.from_pretrained(ns.model, dtype=dtype).to(device).eval()
    return target, rank, world, device


def _one_shot_option(parser) -> None:
    """``--one-shot``: how a TP target's small all-reduces run (``load_tensor_parallel``'s ``one_shot``);
    ``--inductor``: inductor settings for the compiled forwards."""
    parser.add_argument("--one-shot", choices=["auto", "off", "push"], default="auto",
                        help="TP: small all-reduces as one-shot kernels over symmetric memory where they work (auto), "
                             "NCCL only (off), or push all-reduces (push: each rank writes into its peers' slots)")
    parser.add_argument("--inductor", nargs="+", default=[], metavar="NAME=VALUE",
                        help="torch._inductor.config settings before any compile (a Python literal each), e.g. "
                             "max_autotune_gemm=True: the layers' GEMMs from autotuned Triton templates instead of "
                             "cuBLAS's split-K kernels at TP widths (specdec/PERF.md v34)")


def _one_shot_on(target) -> bool | str:
    """How the TP target's small all-reduces run: "push" (push all-reduces), True (one-shot), False (NCCL)."""
    from specdec.tensor_parallel import RowParallelLinear

    rows = [m for m in target.modules() if isinstance(m, RowParallelLinear)]
    if any(m.push is not None for m in rows):
        return "push"
    return any(m.slot is not None for m in rows)


def _end(rank: int, world: int, release) -> None:
    """A clean exit: every CUDA graph that captured a collective freed before the group goes (NCCL
    waits for them when it destroys the communicator), then ``end_tensor_parallel`` (garbage
    collected, a barrier, the group destroyed). A watchdog bounds the teardown and the interpreter's
    exit: after ``EXIT_WATCHDOG_S`` seconds (default 60) it prints every thread's stack and ends the
    rank with exit status 1, so a hang shows where it is instead of running into the call's limit."""
    if world <= 1:
        return
    import faulthandler

    from specdec.distributed import end_tensor_parallel

    faulthandler.dump_traceback_later(float(os.environ.get("EXIT_WATCHDOG_S", "60")), exit=True)
    t_end = time.perf_counter()
    release()
    print(f"rank {rank}: graphs released at {time.perf_counter() - t_end:.2f} s", flush=True)
    end_tensor_parallel()
    print(f"rank {rank}: released, process group destroyed at {time.perf_counter() - t_end:.2f} s", flush=True)


def _forward(ns) -> None:
    from specdec import hf
    from specdec.cli.bench.common import Timer, median_ms, random_tree
    from specdec.graphs import GraphedForward
    from specdec.kv import KVCache

    target, rank, world, device = _load(ns)
    torch.set_grad_enabled(False)
    hf.prepare_model(target)
    cuda = device.type == "cuda"
    vocab = hf.vocab_size(target)
    gen = torch.Generator().manual_seed(ns.seed)
    prompt = torch.randint(10, vocab, (ns.prompt_len,), generator=gen)
    prefix = ns.prompt_len - 1
    cap = -(-(ns.prompt_len + max(ns.nodes) + 8) // 256) * 256
    cache = KVCache(1, cap, num_layers=hf.num_layers(target))
    hf.prefill(target, prompt[None, :prefix].to(device), cache)
    timer = Timer(device)
    res = {"model": ns.model, "world": world, "dtype": ns.dtype, "compile": ns.compile, "prompt": ns.prompt_len,
           "inductor": ns.inductor,
           "one_shot": _one_shot_on(target),
           "device": torch.cuda.get_device_name(device) if cuda else "cpu", "rows": []}  # fmt: skip
    graphs = []
    for n in ns.nodes:
        tree = random_tree(n, int(prompt[-1]), vocab, gen)
        g = GraphedForward(target, cache, 1, n, capture=cuda, compile="layers" if ns.compile else False)
        graphs.append(g)
        g.load([tree], [prefix])
        t0 = time.perf_counter()
        g.forward()  # compiles and captures
        first_s = time.perf_counter() - t0
        for _ in range(3):
            g.forward()
        ms = median_ms([timer(g.forward)[0] for _ in range(ns.reps)])
        res["rows"].append({"nodes": n, "replay_ms": ms, "first_s": first_s})
        if rank == 0:
            print(f"world {world}: {n} nodes: replay {ms:.3f} ms (first call {first_s:.1f} s)", flush=True)
    base = res["rows"][0]["replay_ms"]
    for row in res["rows"]:
        row["vs_first"] = row["replay_ms"] / base
    if rank == 0:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(res, indent=1))
    del g
    _end(rank, world, graphs.clear)


def _run(ns) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec import SpecDecoder

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[ns.dtype]
    target, rank, world, device = _load(ns)
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    drafter = None
    if ns.drafter == "lookup":
        from drafters.lookup import LookupDrafter

        drafter = LookupDrafter()
    elif ns.drafter == "model":
        from drafters.draft_model import DraftModelDrafter

        draft = AutoModelForCausalLM.from_pretrained(ns.draft, dtype=dtype).to(device).eval()
        drafter = DraftModelDrafter(draft)
    tokenizer = AutoTokenizer.from_pretrained(ns.model) if ns.tokenizer else None
    prompts = _prompts(ns, tokenizer, int(target.config.vocab_size))
    cap = max(len(p) for p in prompts) + ns.new + ns.tree_size + 64
    graphs = {"auto": None, "on": True, "off": False}[ns.cuda_graphs]
    dec = SpecDecoder(target, drafter, ns.tree_size if drafter else 0, max_cache_len=-(-cap // 256) * 256,
                      cuda_graphs=graphs, compile=ns.compile, decode_chunk=ns.decode_chunk)  # fmt: skip
    t0 = time.perf_counter()
    dec.warmup([1], log=None)
    dec.generate(prompts[0], 8)  # drafter warm-up, first-call costs
    sync()
    warm_s = time.perf_counter() - t0
    rows = []
    if ns.trace and rank == 0:  # where one call's time goes: host ops and device kernels
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            dec.generate(prompts[0], ns.new)
            sync()
        lines = []
        for key in ("self_cuda_time_total", "cpu_time_total"):
            lines.append(prof.key_averages().table(sort_by=key, row_limit=25))
        trace = Path(ns.trace)  # one file per world size: a one-GPU run and a TP run may share the argument
        trace.with_name(f"{trace.stem}-world{world}{trace.suffix}").write_text("\n\n".join(lines))
    elif ns.trace:
        dec.generate(prompts[0], ns.new)  # the other ranks run the same call (collectives)
    for p in prompts:
        sync()
        t = time.perf_counter()
        out = dec.generate(p, ns.new)
        sync()
        rows.append({"prompt_len": len(p), "tokens": out.new_tokens().tolist(), "seconds": time.perf_counter() - t,
                     "steps": len(out.steps), "mean_accepted": out.mean_accepted})  # fmt: skip
    new = sum(len(r["tokens"]) for r in rows)
    secs = sum(r["seconds"] for r in rows)
    res = {"model": ns.model, "world": world, "dtype": ns.dtype, "drafter": ns.drafter, "tree_size": dec.tree_size,
           "one_shot": _one_shot_on(target),
           "cuda_graphs": dec.cuda_graphs, "static_shapes": dec.static_shapes, "rank_sync": dec.rank_sync is not None,
           "decode_chunk": dec.decode_chunk, "inductor": ns.inductor,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu", "warmup_s": warm_s, "new_tokens": new,
           "seconds": secs, "tokens_per_s": new / secs,
           "max_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0, "rows": rows}  # fmt: skip
    if rank == 0:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(res, indent=1))
        print(f"{ns.out}: world {world} {ns.dtype} drafter={ns.drafter} t={dec.tree_size} graphs={dec.cuda_graphs}: "
              f"{new} tokens in {secs:.2f} s = {new / secs:.1f} tok/s (bs 1), "
              f"{res['max_memory_gib']:.1f} GiB on rank 0")  # fmt: skip
    _end(rank, world, dec.release)


def _compare(ns) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (ns.one, ns.other))
    same = True
    for i, (ra, rb) in enumerate(zip(a["rows"], b["rows"])):
        ta, tb = ra["tokens"], rb["tokens"]
        if ta != tb:
            same = False
            first = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
            print(f"  prompt {i}: DIFFERENT from token {first} of {max(len(ta), len(tb))}")
    if len(a["rows"]) != len(b["rows"]):
        same = False
    print(f"{ns.one} (world {a['world']}) vs {ns.other} (world {b['world']}), {a['dtype']}, drafter {a['drafter']}: "
          f"{'IDENTICAL' if same else 'DIFFERENT'} outputs; {a['tokens_per_s']:.1f} vs {b['tokens_per_s']:.1f} tok/s "
          f"(x{b['tokens_per_s'] / a['tokens_per_s']:.2f})")  # fmt: skip
    return 0 if same or not ns.strict else 1


def _same_tokens(ns) -> int:
    """One run's records against the merged shard files of another: the same tokens for every timed key."""
    from eval.records import is_timed, load_records, record_key
    from eval.shard import merge

    one = {record_key(r): r for r in load_records(ns.one) if is_timed(r)}
    other = {record_key(r): r for r in merge(ns.shards) if is_timed(r)}
    missing = sorted(set(one) ^ set(other), key=str)
    differ = [k for k in one.keys() & other.keys() if one[k].get("token_ids") != other[k].get("token_ids")]
    res = {"one": ns.one, "shards": ns.shards, "records": len(one), "merged": len(other), "missing": len(missing),
           "different": len(differ), "examples": [list(map(str, k)) for k in (differ + missing)[:5]]}  # fmt: skip
    print(json.dumps(res))
    if ns.out:
        Path(ns.out).write_text(json.dumps(res, indent=1))
    return 0 if not missing and not differ else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="save a random-weight Llama-3-8B-shaped model (fp32)")
    b.add_argument("--config", choices=["llama3-8b", "tiny"], default="llama3-8b")
    b.add_argument("--layers", type=int, default=32)
    b.add_argument("--out", required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--std", type=float, default=0.02)
    b.add_argument("--device", default="cuda:0")
    b.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the saved weights' dtype")
    r = sub.add_parser("run", help="decode prompts at batch size 1 (TP under torchrun) and write JSON")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--drafter", choices=["none", "lookup", "model"], default="none")
    r.add_argument("--draft", help="the draft model's directory (--drafter model)")
    r.add_argument("--tree-size", type=int, default=32)
    r.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    r.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    r.add_argument("--num-prompts", type=int, default=4)
    r.add_argument("--prompt-len", type=int, default=256, help="random prompts (no --tokenizer)")
    r.add_argument("--tokenizer", action="store_true", help="real prompts through the model's tokenizer")
    r.add_argument("--prompts-file", help="JSONL with a 'description' per line (APPS), with --tokenizer")
    r.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto")
    r.add_argument("--compile", action="store_true", help="SpecDecoder(compile=True): the layer-wise compile")
    r.add_argument("--decode-chunk", type=int, default=DEFAULT_DECODE_CHUNK,
                   help="SpecDecoder(decode_chunk=): plain-decoding steps per replay (at TP, one token fingerprint "
                        "checked across the ranks per chunk)")
    r.add_argument("--trace", help="write a torch.profiler table of one call (rank 0) to this file, "
                   "'-world{W}' added to its name")
    r.add_argument("--seed", type=int, default=0)
    _one_shot_option(r)
    f = sub.add_parser("forward", help="time one captured tree (verify) forward per node count (TP under torchrun)")
    f.add_argument("--model", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--nodes", type=int, nargs="+", default=[1, 16, 64], help="tree nodes per forward (root included)")
    f.add_argument("--dtype", choices=["fp32", "bf16"], default="bf16")
    f.add_argument("--prompt-len", type=int, default=512, help="random prompt tokens in the cache")
    f.add_argument("--reps", type=int, default=30)
    f.add_argument("--compile", action="store_true", help="the layer-wise compile (what compile=True does)")
    f.add_argument("--seed", type=int, default=0)
    _one_shot_option(f)
    c = sub.add_parser("compare", help="compare two run JSONs (outputs, tokens/s)")
    c.add_argument("one")
    c.add_argument("other")
    c.add_argument("--strict", action="store_true", help="exit 1 when the outputs differ")
    t = sub.add_parser("same-tokens", help="a one-GPU results file against the merged shard files of a sharded run")
    t.add_argument("one")
    t.add_argument("shards", nargs="+")
    t.add_argument("--out")
    ns = parser.parse_args(argv)
    if ns.cmd == "build":
        _build(ns)
    elif ns.cmd == "forward":
        _forward(ns)
    elif ns.cmd == "run":
        if ns.drafter == "model" and not ns.draft:
            parser.error("--drafter model needs --draft DIR")
        _run(ns)
    elif ns.cmd == "same-tokens":
        return _same_tokens(ns)
    else:
        return _compare(ns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
