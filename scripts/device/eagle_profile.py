"""Where an EAGLE step's time goes at real shapes, with random weights (no staging needed).

Builds a random target of ``--config`` shapes (``specdec.cli.bench.scale.build_scale_model``, e.g.
Qwen2.5-Coder-1.5B's) and a random EAGLE head on it, then decodes ``--prompts`` random prompts with
``SpecDecoder(profile=True)`` and ``EagleDrafter(profile=True)`` (each phase ends in a device sync:
the phase times are device time, and the step is slower than unprofiled) and prints per-step medians:
the engine's draft / forward / verify / commit and the drafter's catch_up / expand / copy / host_tree /
update, and apart the same for a call's first step (the head's catch-up on the whole prompt,
``--prompt-len`` tokens). ``--inductor NAME=VALUE`` sets ``torch._inductor.config`` first. Plain
decoding of the same target runs first for the forward's cost alone. ``--trace FILE``
writes a ``torch.profiler`` table of one unprofiled call (kernels and host ops). Random heads accept
almost nothing: this measures what a step costs, not how many tokens it yields.

    python3 scripts/device/eagle_profile.py --config qwen2.5-1.5b --tree-size 64 --compile \\
        --out $OUT/eagle_profile.json --trace $OUT/eagle_trace.txt
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere: the repo's packages

import torch  # noqa: E402


def _median_ms(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(1e3 * statistics.median(values), 4) if values else None


def expansion_kernels(drafter, path: Path, replays: int = 50) -> dict:
    """Replay the drafter's last captured expansion graph ``replays`` times: its device time per replay
    (CUDA events) and, under ``torch.profiler``, the kernels one replay launches (written to ``path``)."""
    from torch.profiler import ProfilerActivity, profile

    exps = [e for st in drafter._states.values() for e in st.expansions.values() if e.graph is not None]
    if not exps:
        return {}
    exp = min(exps, key=lambda e: e.width)  # the steady steps: the narrowest fused catch-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        exp.graph.replay()
    start.record()
    for _ in range(replays):
        exp.graph.replay()
    end.record()
    torch.cuda.synchronize()
    per_replay_ms = start.elapsed_time(end) / replays
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            exp.graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(ev.name, []).append(ev.device_time_total if hasattr(ev, "device_time_total")
                                                   else ev.cuda_time_total)  # fmt: skip
    rows = sorted(((sum(v) / replays, len(v) / replays, k) for k, v in kernels.items()), reverse=True)
    launches = sum(r[1] for r in rows)
    lines = [f"expansion graph: width {exp.width}, plan {exp.plan.topk}x{exp.plan.width}x{exp.plan.depth}, "
             f"{per_replay_ms * 1e3:.1f} us a replay (events), {launches:.0f} kernels a replay",
             f"{'us/replay':>10} {'launches':>9}  kernel"]
    lines += [f"{us:10.2f} {n:9.1f}  {name[:150]}" for us, n, name in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return {"replay_us": round(per_replay_ms * 1e3, 2), "kernels_per_replay": round(launches, 1),
            "kernel_us_sum": round(sum(r[0] for r in rows), 2)}


def main(argv=None) -> int:
    from drafters.eagle import DRAFT_PHASES, EagleDrafter, EagleHead
    from drafters.eagle_head import parse_feature_layers
    from specdec import SpecDecoder
    from specdec.cli.bench.common import set_inductor_options
    from specdec.cli.bench.config import SCALE_CONFIGS
    from specdec.cli.bench.scale import build_scale_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=sorted(SCALE_CONFIGS), default="qwen2.5-1.5b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's)")
    p.add_argument("--tree-size", type=int, default=64)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--draft-vocab", type=int, default=32768, help="0: the whole vocabulary")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--attention", default="auto", help="EagleDrafter(attention=...): auto, sdpa or tree")
    p.add_argument("--feature-layers", default="low,mid,high",
                   help="the head's target features, as train-eagle's option (default low,mid,high; final: one)")
    p.add_argument("--compile", action="store_true", help="SpecDecoder(compile=True) and compile_head=True")
    p.add_argument("--rerank", choices=("auto", "device", "host"), default="auto",
                   help="EagleDrafter(rerank=...): the re-rank inside the expansion's graph or on the host "
                        "(auto: device with CUDA graphs and --compile); its host side shows in copy / host_tree")
    p.add_argument("--batch-sizes", type=int, nargs="*", default=[],
                   help="also decode B prompts at once, unprofiled, for each B: the median drafting per step with "
                        "EagleDrafter.propose_batch (every expansion launched before the first tree is read) over "
                        "each count of --batch-streams side streams, with one expansion of all B (batch_expansion, "
                        "after SpecDecoder.warmup), and with one proposal at a time")
    p.add_argument("--batch-streams", type=int, nargs="+", default=[0, 4],
                   help="the batch_streams of the --batch-sizes runs (default 0 4; 0: the current stream)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, help="JSON of the medians")
    p.add_argument("--trace", help="write a torch.profiler table of one unprofiled call here")
    p.add_argument("--expansion-kernels", help="write the kernels of one replay of the expansion's CUDA graph here "
                   "(name, launches and device µs per replay) and add its device time to --out")
    p.add_argument("--inductor", nargs="+", default=[], metavar="NAME=VALUE",
                   help="torch._inductor.config settings for this run (a Python literal each), e.g. "
                        "max_autotune_gemm=True: the head's GEMMs from inductor's autotuned Triton templates")
    ns = p.parse_args(argv)
    inductor = set_inductor_options(ns.inductor)
    device = torch.device(ns.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cap = ns.prompt_len + ns.new + ns.tree_size + 64
    target = build_scale_model(ns.config, device, dtype, max_positions=cap, layers=ns.layers)
    vocab = int(target.config.vocab_size)
    torch.manual_seed(0)
    head = EagleHead(target, parse_feature_layers(ns.feature_layers, int(target.config.num_hidden_layers)))
    with torch.no_grad():
        for q in head.parameters():
            if q.dim() >= 2:
                q.normal_(0.0, 0.02)
    head = head.to(device=device, dtype=dtype).eval()
    if ns.draft_vocab:
        head.set_token_counts(torch.randint(0, 1000, (vocab,)))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (ns.prompt_len,), generator=g) for _ in range(ns.prompts)]
    res: dict = {"config": ns.config, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "tree_size": ns.tree_size, "depth": ns.depth, "topk": ns.topk, "draft_vocab": ns.draft_vocab,
                 "compile": ns.compile, "attention": ns.attention, "rerank": ns.rerank,
                 "feature_layers": ns.feature_layers, "inductor": inductor, "prompt_len": ns.prompt_len}  # fmt: skip

    plain = SpecDecoder(target, None, 0, compile=ns.compile)
    plain.generate(prompts[0], 16)
    sync()
    t = time.perf_counter()
    out = plain.generate(prompts[0], ns.new)
    sync()
    res["plain_ms_per_token"] = round(1e3 * (time.perf_counter() - t) / max(1, len(out.new_tokens())), 4)
    plain.release()

    def build(profile: bool, streams: int = 0, batched: bool = False):
        attention = {} if ns.attention == "auto" else {"attention": ns.attention}
        drafter = EagleDrafter(target, head, ns.tree_size, depth=ns.depth, topk=ns.topk, profile=profile,
                               draft_vocab=ns.draft_vocab or None, compile_head=ns.compile, rerank=ns.rerank,
                               batch_streams=streams, batch_expansion=batched, **attention)  # fmt: skip
        res["rerank_resolved"] = drafter.rerank
        return drafter, SpecDecoder(target, drafter, ns.tree_size, compile=ns.compile, profile=profile)

    drafter, dec = build(True)
    phases: dict[str, list[float]] = {k: [] for k in (*DRAFT_PHASES, "update")}
    propose, update = drafter.propose, drafter.update

    def recording_propose(ctx):
        tree = propose(ctx)
        for k, v in (drafter.last_phase_s or {}).items():
            phases.setdefault(k, []).append(v)
        return tree

    def recording_update(ctx, tree, verdict):
        update(ctx, tree, verdict)
        if drafter.last_phase_s and "update" in drafter.last_phase_s:
            phases["update"].append(drafter.last_phase_s["update"])

    dec.generate(prompts[0], 16)  # first-call costs (compile, capture)
    drafter.propose, drafter.update = recording_propose, recording_update
    for v in phases.values():
        v.clear()
    steps, firsts, first_phases = [], [], []
    t = time.perf_counter()
    new = 0
    for prompt in prompts:
        marks = {k: len(v) for k, v in phases.items()}
        out = dec.generate(prompt, ns.new)
        steps += out.steps
        firsts.append(out.steps[0])
        first_phases.append({k: v[marks[k]] for k, v in phases.items() if len(v) > marks[k]})
        new += len(out.new_tokens())
    sync()
    engine = ("draft", "forward", "verify", "commit")
    res["profiled_ms_per_token"] = round(1e3 * (time.perf_counter() - t) / max(1, new), 4)
    res["engine_ms"] = {k: _median_ms(getattr(s, f"{k}_s") for s in steps) for k in engine}
    res["drafter_ms"] = {k: _median_ms(v) for k, v in phases.items()}
    # a call's first step: the head catches up on the whole prompt (--prompt-len tokens) before it drafts
    res["first_step_ms"] = {"engine": {k: _median_ms(getattr(s, f"{k}_s") for s in firsts) for k in engine},
                            "drafter": {k: _median_ms(f.get(k) for f in first_phases) for k in phases}}
    res["steps"] = len(steps)
    res["mean_accepted"] = round(sum(sum(s.tokens_accepted) for s in steps) / max(1, len(steps)), 3)

    drafter, dec = build(False)  # unprofiled: the real step
    dec.generate(prompts[0], 16)
    sync()
    t = time.perf_counter()
    new, n_steps = 0, 0
    for prompt in prompts:
        out = dec.generate(prompt, ns.new)
        new += len(out.new_tokens())
        n_steps += len(out.steps)
    sync()
    res["unprofiled_ms_per_step"] = round(1e3 * (time.perf_counter() - t) / max(1, n_steps), 4)
    res["batch"] = []
    for b in ns.batch_sizes:  # drafting at batch B: the sequences' expansions overlapped, or one at a time
        batch = [prompts[i % len(prompts)] for i in range(b)]
        for streams in [*ns.batch_streams, "one expansion", None]:
            mode = ("one at a time" if streams is None else streams if isinstance(streams, str)
                    else f"propose_batch, {streams} streams")  # fmt: skip
            batched = streams == "one expansion"
            drafter, dec = build(False, streams=0 if batched or streams is None else streams, batched=batched)
            if batched:
                dec.warmup(batch_sizes=(b,), max_len=ns.prompt_len + ns.new + ns.tree_size, log=None)
            if streams is None:
                drafter.propose_batch = None  # the engine then asks propose per sequence
            dec.generate(batch, ns.new)  # captures (each sequence's expansions, its catch-up widths)
            sync()
            out = dec.generate(batch, ns.new)
            sync()
            drafted = [s for s in out.steps if sum(s.nodes_proposed)]
            res["batch"].append({"batch": b, "mode": mode, "steps": len(out.steps),
                                 "draft_ms": _median_ms(s.draft_s for s in drafted),
                                 "verify_ms": _median_ms(s.verify_s for s in drafted),
                                 "capture_s": round(sum(s.capture_s for s in out.steps), 4),
                                 "one_expansion_steps": drafter.batched_steps})  # fmt: skip
            print(res["batch"][-1], flush=True)
    if ns.trace:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            dec.generate(prompts[0], 32)
            sync()
        tables = [prof.key_averages().table(sort_by=key, row_limit=30) for key in
                  (("self_cuda_time_total",) if device.type == "cuda" else ()) + ("cpu_time_total",)]  # fmt: skip
        Path(ns.trace).write_text("\n\n".join(tables))
    if ns.expansion_kernels and device.type == "cuda":
        res["expansion"] = expansion_kernels(drafter, Path(ns.expansion_kernels))
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
