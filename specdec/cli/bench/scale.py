"""(f) the engine at Llama-3-8B shapes with random weights (no model files): plain decode graphed /
compiled vs HF static cache, verify forwards per tree size, against the weight-streaming floor."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from specdec.cli.bench.common import Timer, fmt, free_memory, gb, guarded, median_ms, num, random_tree, time_graphed
from specdec.cli.bench.config import SCALE_CONFIGS, SCALE_PROMPTS, BenchConfig
from specdec.cli.bench.floor import bandwidth_info, forward_floors
from specdec.cli.bench.setup import device_dtype


def _no_init_weights():
    """transformers' context that skips weight initialisation (v5: ``transformers.initialization``)."""
    import contextlib

    for module in ("transformers.initialization", "transformers.modeling_utils"):
        try:
            mod = __import__(module, fromlist=["no_init_weights"])
        except ImportError:
            continue
        fn = getattr(mod, "no_init_weights", None)
        if fn is not None:
            return fn()
    return contextlib.nullcontext()


def build_scale_model(name: str, device, dtype, max_positions: int = 0, seed: int = 0, std: float = 0.02,
                      layers: int | None = None):
    """A random-weight causal LM of ``SCALE_CONFIGS[name]`` (Llama unless the entry names another
    ``model_type``) built directly on ``device``; ``layers``: that many decoder layers instead of the
    config's (e.g. a CPU check at the real widths).

    HF's weight init is skipped (``no_init_weights``) and replaced by one cheap pass on the device:
    matrices normal(0, ``std``) from a seeded generator, norm weights 1, biases 0 (finite, small;
    the values do not matter for speed). On the meta device nothing is initialised (sizes only).
    ``max_position_embeddings`` is at least ``max_positions``. The generation config has no eos:
    plain decoding always runs to ``max_new_tokens``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if name not in SCALE_CONFIGS:
        raise ValueError(f"name: expected one of {tuple(SCALE_CONFIGS)}, got {name!r}")
    fields = dict(SCALE_CONFIGS[name])
    model_type = fields.pop("model_type", "llama")
    fields["max_position_embeddings"] = max(int(fields["max_position_embeddings"]), int(max_positions))
    if layers is not None:
        if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
            raise ValueError(f"layers: expected None or an int >= 1, got {layers!r}")
        fields["num_hidden_layers"] = layers
    config = AutoConfig.for_model(model_type, **fields, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    device = torch.device(device)
    with torch.device(device), _no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if device.type != "meta":
        gen = torch.Generator(device=device).manual_seed(seed)
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, std, generator=gen)
                elif pname.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
            for bname, b in model.named_buffers():
                if b.is_floating_point() and not bool(torch.isfinite(b).all()):
                    raise RuntimeError(f"model: buffer {bname} is not finite after the build")
    model.generation_config = GenerationConfig(pad_token_id=0)
    return model.eval()


def _scale_capacity(prompt_len: int, new: int, max_tree: int) -> int:
    return -(-(prompt_len + new + max_tree + 1 + 8) // 256) * 256


def _scale_engine_decode(model, prompt, cap: int, new: int, method: str, cfg: BenchConfig, timer: Timer,
                         device) -> tuple[dict[str, Any], list[int]]:  # fmt: skip
    """``method``: engine-graph, engine-compiled (``compile=True``: layer-wise), engine-inductor (the whole
    forward compiled as one, ``compile="inductor"``), or engine-compiled-step (``decode_chunk=0``)."""
    from specdec import SpecDecoder
    from specdec.engine import DEFAULT_DECODE_CHUNK

    cuda = device.type == "cuda"
    dec = SpecDecoder(model, None, 0, max_cache_len=cap, attn_impl=cfg.attn_impl, static_shapes=True,
                      cuda_graphs=cuda, compile={"engine-graph": False, "engine-inductor": "inductor"}.get(method, True),
                      decode_chunk=0 if method.endswith("-step") else DEFAULT_DECODE_CHUNK)  # fmt: skip
    t0 = time.perf_counter()
    dec.generate(prompt, min(8, new))  # captures (and compiles)
    warm_s = time.perf_counter() - t0
    wall, out = timer(lambda: dec.generate(prompt, new))
    ms = 1e3 * (wall - out.prefill_s) / new
    row = {"method": method, "captured": cuda, "new_tokens": new,
           "ms_per_token": ms, "tokens_per_s": 1e3 / ms if ms > 0 else math.nan, "prefill_ms": 1e3 * out.prefill_s,
           "warmup_s": warm_s}  # fmt: skip
    tokens = out.new_tokens(0).tolist()
    del dec, out
    free_memory(device)
    return row, tokens


def _step_clock():
    """An HF ``generate`` streamer that records when each ``put`` arrives: the prompt first, then every
    new token (HF copies each to the host, a synchronizing copy, before it puts it)."""
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    return StepClock()


def _scale_hf_decode(model, prompt, cap: int, new: int, timer: Timer, device) -> tuple[dict[str, Any], list[int]]:
    import torch

    ids = prompt[None].to(device)
    mask = torch.ones_like(ids)

    def gen(k: int, streamer=None):
        return model.generate(ids, attention_mask=mask, max_new_tokens=k, do_sample=False, pad_token_id=0,
                              cache_implementation="static", max_cache_len=cap, streamer=streamer)  # fmt: skip

    t0 = time.perf_counter()
    for _ in range(2):  # compiles the decode step on CUDA (and records its graphs)
        gen(min(8, new))
    warm_s = time.perf_counter() - t0
    clock = _step_clock()
    wall, out = timer(lambda: gen(new, clock))
    times = clock.times  # the prompt, then tokens 1..new (token 1 comes from the prefill)
    if len(times) != new + 1:
        raise RuntimeError(f"streamer: expected {new + 1} puts (prompt + {new} tokens), got {len(times)}")
    ms = 1e3 * (times[new] - times[1]) / (new - 1)
    row = {"method": "hf-static", "captured": device.type == "cuda", "new_tokens": new, "ms_per_token": ms,
           "tokens_per_s": 1e3 / ms if ms > 0 else math.nan, "prefill_ms": 1e3 * (times[1] - times[0]),
           "wall_s": wall, "warmup_s": warm_s}  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    del out
    free_memory(device)
    return row, tokens


def _scale_verify(model, prompt, cap: int, cfg: BenchConfig, timer: Timer, device, gen) -> list[dict[str, Any]]:
    from specdec import hf
    from specdec.graphs import GraphedForward
    from specdec.kv import KVCache

    cuda = device.type == "cuda"
    prefix = len(prompt) - 1
    cache = KVCache(1, cap, num_layers=hf.num_layers(model))
    hf.prefill(model, prompt[None, :prefix], cache, impl=cfg.attn_impl)
    vocab = hf.vocab_size(model)
    rows = []
    for t in sorted(set(cfg.scale_tree_sizes) | {0}):
        tree = random_tree(t + 1, int(prompt[-1]), vocab, gen)
        graphed = GraphedForward(model, cache, 1, t + 1, impl=cfg.attn_impl, capture=cuda)
        times = time_graphed(timer, cfg.reps, graphed, tree, prefix)
        rows.append({"prompt_len": len(prompt), "t": t, "nodes": t + 1, "ms": median_ms(times),
                     "min_ms": min(times) * 1e3, "captured": cuda})  # fmt: skip
        del graphed
        free_memory(device)
    for r in rows:
        r["x_t0"] = r["ms"] / rows[0]["ms"] if rows[0]["ms"] > 0 else math.nan
    del cache
    free_memory(device)
    return rows


def run_scale(cfg: BenchConfig, log: Callable[[str], None], save: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """(f): build the random-weight model, then per prompt length decode / verify / HF static / bars.

    ``save(partial)`` is called after every cell with the section's result so far."""
    import torch

    from specdec import hf

    device, dtype = device_dtype(cfg)
    name = cfg.scale_config or ("llama3-8b" if device.type == "cuda" else "tiny")
    lengths = list(cfg.scale_prompts or SCALE_PROMPTS[name])
    new = cfg.scale_new_tokens
    caps = {L: _scale_capacity(L, new, max(cfg.scale_tree_sizes)) for L in lengths}
    t0 = time.perf_counter()
    model = build_scale_model(name, device, dtype, max(caps.values()), seed=cfg.seed)
    hf.prepare_model(model, "target", fuse=cfg.fuse)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    build_s = time.perf_counter() - t0
    timer = Timer(device)
    res: dict[str, Any] = {"config": name, "fused": cfg.fuse, "dtype": str(dtype).replace("torch.", ""),
                           "build_s": build_s,
                           "model_config": {k: v for k, v in SCALE_CONFIGS[name].items()},
                           "max_position_embeddings": model.config.max_position_embeddings,
                           "bandwidth": bandwidth_info(cfg, device), "new_tokens": new, "reps": cfg.reps,
                           "prompts": [], "decode": [], "verify": [], "bars": []}  # fmt: skip
    log(f"  built {name} in {build_s:.1f} s ({dtype}, {device}); copy bandwidth "
        f"{res['bandwidth']['measured_gbs']:.0f} GB/s measured, {cfg.bandwidth_gbs:.0f} GB/s flag")  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed)
    vocab = hf.vocab_size(model)
    for L in lengths:
        cap = caps[L]
        prompt = torch.randint(0, vocab, (L,), generator=gen)
        floors = forward_floors(model, L, res["bandwidth"])
        res["prompts"].append({"prompt_len": L, "capacity": cap, **floors})
        tokens: dict[str, list[int]] = {}
        rows: list[dict[str, Any]] = []

        def cell(method: str, fn) -> None:
            def run():
                row, tokens[method] = fn()
                row = {"prompt_len": L, **row}
                for key, floor in (("x_floor", "floor_ms"), ("x_floor_measured", "floor_measured_ms"),
                                   ("x_floor_kv", "floor_kv_ms")):  # fmt: skip
                    row[key] = row["ms_per_token"] / floors[floor]
                log(f"  L={L:<6} {method:<16} {row['ms_per_token']:8.3f} ms/token  {num(row['x_floor'])} x floor "
                    f"(warm-up {row['warmup_s']:.1f} s)")  # fmt: skip
                return row

            guarded(rows, {"prompt_len": L, "method": method}, run, log)
            res["decode"].append(rows[-1])
            save(res)

        for method in ("engine-graph", "engine-compiled", "engine-inductor", "engine-compiled-step"):
            if method in cfg.scale_parts:
                cell(method, lambda: _scale_engine_decode(model, prompt, cap, new, method, cfg, timer, device))
        verify: list[dict[str, Any]] = []
        if "verify" in cfg.scale_parts:
            try:
                verify = _scale_verify(model, prompt, cap, cfg, timer, device, gen)
                res["verify"].extend(verify)
                log(f"  L={L:<6} verify t={verify[0]['t']}..{verify[-1]['t']}: {verify[0]['ms']:.3f} .. "
                    f"{verify[-1]['ms']:.3f} ms")  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported, the other cells still run
                log(f"  error: {type(e).__name__}: {e}")
                res["verify"].append({"prompt_len": L, "error": f"{type(e).__name__}: {e}"})
            save(res)
        if "hf-static" in cfg.scale_parts:
            cell("hf-static", lambda: _scale_hf_decode(model, prompt, cap, new, timer, device))
        for r in rows:
            if "error" not in r and r["method"] != "engine-graph" and "engine-graph" in tokens:
                r["identical_to_engine_graph"] = tokens[r["method"]][:new] == tokens["engine-graph"][:new]
        by_t = {r["t"]: r for r in verify if "error" not in r}
        bar = {"prompt_len": L}
        for r in rows:
            if "error" not in r:
                bar[f"{r['method']}_x_floor"] = r["x_floor"]
                bar[f"{r['method']}_x_floor_measured"] = r["x_floor_measured"]
        bar["verify_t64_x_t0"] = by_t[64]["x_t0"] if 64 in by_t else None
        res["bars"].append(bar)
        save(res)
        free_memory(device)
    del model
    free_memory(device)
    return res


def format_scale(res: dict[str, Any]) -> str:
    bw = res["bandwidth"]
    lines = [f"{res['config']} ({res['dtype']}), random weights, built in {res['build_s']:.1f} s; copy bandwidth "
             f"{bw['measured_gbs']:.0f} GB/s measured, {bw['flag_gbs']:.0f} GB/s flag; {res['new_tokens']} new tokens "
             f"(prefill excluded), verify median of {res['reps']}"]  # fmt: skip
    for p in res["prompts"]:
        lines.append(f"L = {p['prompt_len']}: weights {gb(p['streamed_bytes'])} streamed -> floor {num(p['floor_ms'])} "
                     f"ms (flag) / {num(p['floor_measured_ms'])} ms (measured); + KV {gb(p['kv_bytes'])}: "
                     f"{num(p['floor_kv_ms'])} / {num(p['floor_kv_measured_ms'])} ms")  # fmt: skip
    head = f"{'L':>6}  {'method':<16}{'ms/token':>9}{'tok/s':>8}{'x floor':>9}{'x meas.':>9}{'x +KV':>9}{'warm-up s':>10}"
    lines += ["", "plain decode", head, "-" * len(head)]
    for r in res["decode"]:
        if "error" in r:
            lines.append(f"{r['prompt_len']:>6}  {r['method']:<16} error: {r['error']}")
            continue
        lines.append(f"{r['prompt_len']:>6}  {r['method']:<16}{r['ms_per_token']:>9.3f}{fmt(r['tokens_per_s'], '8.1f')}"
                     f"{num(r['x_floor'], 9)}{num(r['x_floor_measured'], 9)}{num(r['x_floor_kv'], 9)}"
                     f"{r['warmup_s']:>10.1f}")  # fmt: skip
    if res["verify"]:
        head = f"{'L':>6}{'t':>5}{'nodes':>7}{'ms':>9}{'min ms':>9}{'x t=0':>7}"
        lines += ["", "verify forward (graphed; t draft nodes + the root)", head, "-" * len(head)]
        for r in res["verify"]:
            if "error" in r:
                lines.append(f"{r['prompt_len']:>6} error: {r['error']}")
                continue
            lines.append(f"{r['prompt_len']:>6}{r['t']:>5}{r['nodes']:>7}{r['ms']:>9.3f}{r['min_ms']:>9.3f}"
                         f"{r['x_t0']:>7.2f}")  # fmt: skip
    lines += ["", "bars: plain decode ms / weights floor <= 1.3 (flag bandwidth; measured); "
              "verify(t=64) / verify(t=0) <= 1.2"]
    for b in res["bars"]:
        parts = [f"{k[: -len('_x_floor')]} {num(b[k])} ({num(b[k + '_measured'])})" for k in b if k.endswith("_x_floor")]
        parts.append(f"verify t=64/t=0 {fmt(b['verify_t64_x_t0'], '.2f')}")
        lines.append(f"L = {b['prompt_len']}: " + ", ".join(parts))
    return "\n".join(lines)
