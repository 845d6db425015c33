"""``specdec bench-engine``: the engine's own speed on a real target, eager vs CUDA graphs, vs HF.

Six sections (``--sections``; default ``plain,verify,spec``, the last three are opt-in), each
printed as a table and written to ``--out`` (JSON, rewritten after every section -- and after
every row of the long ones -- so that a run cut off by a time limit keeps what it measured):

``plain``  (a) plain (non-speculative) greedy decoding of the same APPS chat prompts with the same
           ``--max-new-tokens``: HF ``generate`` with its default (dynamic) cache, HF ``generate``
           with ``cache_implementation="static"`` (compiled decode on CUDA; warmed up twice and run
           last of all, after the other sections, since it compiles), the engine eager
           (``SpecDecoder(target, None, cuda_graphs=False)``), the engine with its forward
           replayed as a CUDA graph, and the same forward compiled by inductor before the capture
           (``engine-compiled``, ``SpecDecoder(compile=True)``; its compile time is in
           ``warmup_s``), all three with ``SpecDecoder``'s default ``decode_chunk`` (greedy steps
           per graph replay), and ``engine-graph-step`` / ``engine-compiled-step``: the same with
           ``decode_chunk=0`` (a host round trip per token). Tokens/s, ms/token, and how many completions are identical to
           the reference (HF default cache; in bf16 some differ by rounding, in fp32 none may).
``verify`` (b) one target verify forward (inputs to the device + forward, as a decoding step pays
           it) of a random tree (``treeattn.layout.random_tree_parents``) of n nodes over the first
           prompt's KV, for each ``--tree-sizes`` n (root included), eager and graphed: median ms
           and the multiple of the n = 1 forward (a plain decode step) in the same mode; plus the
           largest logit difference between the two modes (a sanity check of the graph).
``spec``   (c) speculative decoding at ``--spec-tree-size`` t with the draft-model drafter and with
           prompt lookup, in each of ``--spec-modes``: eager, graphed, and (opt-in) ``compiled``
           (graphs of inductor-compiled forwards); for the draft model its per-depth forwards
           follow the mode too (``DraftModelDrafter(static_shapes=, cuda_graphs=, compile=)``).
           Per step: ms drafting, verifying (of which the target forward), committing, and host overhead (the rest of the wall time, prefill excluded);
           draft tokens accepted and tokens emitted per step; tokens/s; identical completions.
``batch``  (d) batch throughput: for each ``--batch-sizes`` B, speculative decoding at
           ``--spec-tree-size`` t with each ``--batch-drafter`` (``medusa``, the default, with heads
           from ``--medusa-heads DIR``; ``lookup``: prompt lookup) in ``--batch-mode`` (default
           graph), and HF ``generate`` with the static cache on left-padded batches (compiled on
           CUDA; run at the end with the other HF static-cache rows; ``--batch-skip-hf`` leaves it
           out). The rows of a batch are the APPS prompts cycled (row i of call k is problem
           (k B + i) mod N), with as many calls as it takes to cover the N problems. Every batch
           size is warmed up first (graph captures, HF compiles; ``warmup_s``, not timed).
           Tokens/s over the batch (new tokens of all rows / wall time), per row (tokens/s / B:
           what one sequence sees), tokens emitted and draft tokens accepted per step and row
           (``tokens_per_step`` = the mean accepted length tau), ms per step, and rows identical
           to the reference (the plain section's, else the first batch row set).
``profile`` (e) kernel profile of one verify forward of the target with a random tree of
           ``--profile-tree-size`` t draft nodes (t + 1 nodes with the root) over the first
           prompt's KV, in each of ``--profile-modes`` (``graph``: the graphed forward;
           ``compiled``: the same compiled by inductor before the capture). The forward is
           timed as a CUDA-graph replay (``captured_ms``) and not captured (``uncaptured_ms``:
           the same body called eagerly, compiled or not), then ``--profile-reps`` replays run
           under ``torch.profiler`` (``specdec.cli.bench.kernels``): GPU kernels per forward, their
           summed time against the wall time of the profiled variant, kernels per decoder layer
           (everything over the layer count: embedding, final norm and LM head included), the
           time in GEMMs / attention (tree-attention Triton kernels) / other, and the
           ``--profile-top`` kernels by total time. ``source`` says what was profiled: ``graph
           replay`` when the profiler sees the kernels inside the replayed graph, else
           ``uncaptured forward`` (the same kernels launched one by one; ``graph_replay_kernels``
           records how many the replay showed). On CPU the profile counts operators instead
           (``source`` ``cpu ops``: the innermost ATen operators doing work). Plus the
           weight-streaming floor of the forward (weights once, and weights + the prompt's KV) at
           ``--bandwidth-gbs`` and at the copy bandwidth measured in the run.
``scale``  (f) the engine at Llama-3-8B shapes with random weights (``--scale-config llama3-8b``:
           32 layers, hidden 4096, 32 / 8 heads, vocab 128256; ``tiny``: a 2-layer model, the
           default on CPU), built on the device without HF's weight init (values: normal, std
           0.02), no model files needed. For each ``--scale-prompts`` L (random token ids;
           default 1024 16384 for llama3-8b, 64 256 for tiny): plain greedy decode of
           ``--scale-new-tokens`` tokens (ms/token with the prefill excluded) by the graphed
           engine (``engine-graph``), optionally compiled (``engine-compiled``: ``compile=True``,
           layer-wise; ``engine-inductor``: the whole forward compiled as one; and
           ``engine-compiled-step``: ``engine-compiled`` with ``decode_chunk=0``, a host round
           trip per token), and HF
           ``generate`` with the static cache (``hf-static``: compiled by HF on CUDA, warmed up
           twice -- compile time in ``warmup_s`` -- then ms/token from one timed call: the time
           between the first and the last new token reaching the host over new - 1, read by a
           streamer); a verify forward (graphed, median ms of ``--reps``) of a random tree of t
           draft nodes for t = 0 and each ``--scale-tree-sizes``;
           the weight-streaming floor (streamed parameter bytes / bandwidth, at ``--bandwidth-gbs``
           and at the measured copy bandwidth; also with the prompt's KV bytes), and the issue's
           bars: plain decode ms / floor (<= 1.3) and verify(t = 64) / verify(t = 0) (<= 1.2;
           t = 64 draft nodes are 65 nodes with the root). ``--scale-parts`` picks which of
           engine-graph, engine-compiled, engine-inductor, engine-compiled-step, hf-static, verify run (default
           engine-graph, hf-static, verify). Everything is freed between cells.

On CPU the "graph" rows run the same fixed-buffer code without a capture (``captured: false``).
Timing: CUDA events with a synchronize on CUDA, ``time.perf_counter`` on CPU.

Commands for the H100 are in docs/DEVICE_RUNS.md, "The engine benchmark":

    python3 -m specdec.cli bench-engine --dtype bf16 --device cuda --problems 4 --max-new-tokens 128 \\
        --data .evaldata/apps_selected150.jsonl --out $OUT/engine.json > $OUT/engine.log 2>&1

The batch table, the kernel profile and the 8B-shape scale run: one call each, after ``export SPECDEC_HOME=/tmp/specdec-home
PYTHONUNBUFFERED=1`` (``batch`` and ``profile`` need the staged and converted Qwen2.5-Coder-1.5B,
``batch`` Medusa heads trained in the machine's life; ``scale`` needs no model files). Expected on
an H100: scale 3-5 min per prompt length (two compiles of the 8B forward: engine and HF), batch
4-6 min (mostly HF compiling per batch size), profile 2-3 min (the compiled mode compiles once):

    timeout 560 python3 -m specdec.cli bench-engine --sections scale --device cuda --scale-prompts 1024 \\
        --scale-parts engine-graph,engine-compiled,hf-static,verify --out $OUT/scale-1k.json > $OUT/scale-1k.log 2>&1
    timeout 560 python3 -m specdec.cli bench-engine --sections scale --device cuda --scale-prompts 16384 \\
        --scale-parts engine-graph,engine-compiled,hf-static,verify --out $OUT/scale-16k.json > $OUT/scale-16k.log 2>&1
    bash scripts/device/spec_methods.sh train   # Medusa heads into /tmp/medusa (~4-5 min)
    timeout 560 python3 -m specdec.cli bench-engine --sections batch --dtype bf16 --device cuda --problems 4 \\
        --max-new-tokens 128 --data .evaldata/apps_selected150.jsonl --medusa-heads /tmp/medusa \\
        --batch-drafter medusa,lookup --batch-sizes 1 2 4 8 16 --no-progress --out $OUT/batch.json > $OUT/batch.log 2>&1
    timeout 560 python3 -m specdec.cli bench-engine --sections profile --dtype bf16 --device cuda --problems 1 \\
        --data .evaldata/apps_selected150.jsonl --profile-tree-size 64 --no-progress \\
        --out $OUT/profile.json > $OUT/profile.log 2>&1

Modules: ``config`` (``BenchConfig``, the names and defaults), ``setup`` (models, prompts, the
engine every section builds), ``common`` (timing, random trees, error rows, table cells), one
module per section (``plain``, ``verify``, ``spec``, ``batch``, ``profile``, ``scale``: each
runs its rows and formats its table), ``floor`` (weight-streaming floor, copy bandwidth) and
``kernels`` (profiler traces) for (e) and (f), ``run`` (``run_bench``: the sections in order, the
JSON) and ``cli`` (the flags, ``main``).
"""

from specdec.cli.bench.cli import build_parser, main
from specdec.cli.bench.config import BenchConfig
from specdec.cli.bench.run import run_bench
from specdec.cli.bench.scale import build_scale_model

__all__ = ["BenchConfig", "build_parser", "build_scale_model", "main", "run_bench"]
