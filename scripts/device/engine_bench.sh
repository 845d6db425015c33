#!/usr/bin/env bash
# On the device machine: the engine's measurements (step, stalls, stress, scale), one step
# per argument so a run can split them over device calls (each call <= 10 minutes). Needs the 1.5B
# target staged and converted (scripts/device/setup_models.sh qwen2.5-coder-1.5b) for the steps
# marked (Qwen) and .evaldata/apps_selected150.jsonl; `tests`, `stress`, `scale*` and `fprofile` need no files.
#   bash scripts/device/engine_bench.sh tests stress | profile plain batch | stalls ttft | scale1k scale16k | fprofile fprofile-unfused
# (BATCH="1 2 4" for the batch sizes of a `batch` call)
set -uo pipefail
export SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home} PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
apps=(--data .evaldata/apps_selected150.jsonl --no-progress)
for s in "$@"; do
  echo "== $s $(date +%T)" >> "$out/steps.log"
  case $s in
    tests)  # the CUDA tests of the engine, warm-up, graphs, stress harness and benchmark
      timeout 400 python3 -m pytest -q -p no:cacheprovider tests/specdec tests/specdec/test_stress.py -k "cuda" \
        > "$out/pytest_cuda.txt" 2>&1 ;;
    stress)  # >= 200 generate calls, tiny random models, fp32, graphs / compile on and off, HF generate between
      timeout 400 python3 scripts/device/stress.py --models tiny --calls 240 --seed 0 --device cuda --dtype fp32 \
        --compile-share 0.02 --budget-s 270 --out "$out/stress.json" > "$out/stress.log" 2>&1 ;;
    profile)  # (Qwen) kernels of one 65-node verify forward, graphed and compiled
      timeout 400 python3 -m specdec.cli bench-engine --sections profile --dtype bf16 --device cuda --problems 1 \
        "${apps[@]}" --profile-tree-size 64 --out "$out/profile.json" > "$out/profile.log" 2>&1 ;;
    plain)  # (Qwen) plain decode tokens/s compiled, in chunks of 8 greedy steps per replay and one step at a time, vs HF static
            # (PLAIN_ARGS= more flags, e.g. --no-fuse; TAG= a suffix of the output names)
      timeout 400 python3 -m specdec.cli bench-engine --sections plain \
        --plain-methods "${PLAIN_METHODS:-engine-compiled,engine-compiled-step,hf-static}" --dtype bf16 --device cuda \
        --problems 4 --max-new-tokens 128 "${apps[@]}" ${PLAIN_ARGS:-} --out "$out/plain${TAG:-}.json" \
        > "$out/plain${TAG:-}.log" 2>&1 ;;
    batch)  # (Qwen) throughput at bs $BATCH (default 1 2 4 8 16), $DRAFTER (default medusa: heads in /tmp/medusa from
            # train_and_sweep.sh medusa; eagle: /tmp/eagle) at the budgets $TREES (default 64; e.g. "0 16 32 64 auto":
            # specdec-plain, fixed t, auto, and the summary of auto against both), compiled, vs HF static
            # (NO_HF=1: without); MODE=graph: captured, not compiled (each batch size compiles every budget: split the
            # sizes over calls); EAGLE_OPTIONS="batch_expansion=true ...": more EagleDrafter options
      sizes=${BATCH:-1 2 4 8 16} heads=()
      [[ ${DRAFTER:-medusa} == *medusa* ]] && heads+=(--medusa-heads /tmp/medusa)
      [[ ${DRAFTER:-medusa} == *eagle* ]] && heads+=(--eagle-heads "${HEAD:-/tmp/eagle}")
      [ -n "${EAGLE_OPTIONS:-}" ] && heads+=(--eagle-option $EAGLE_OPTIONS)
      timeout 580 python3 -m specdec.cli bench-engine --sections batch --batch-drafter "${DRAFTER:-medusa}" \
        "${heads[@]}" --batch-tree-sizes ${TREES:-64} \
        ${NO_HF:+--batch-skip-hf} --batch-mode "${MODE:-compiled}" --dtype bf16 --device cuda --problems 8 --max-new-tokens 128 \
        "${apps[@]}" --batch-sizes $sizes --out "$out/batch${TAG:-}-${sizes// /-}.json" \
        > "$out/batch${TAG:-}-${sizes// /-}.log" 2>&1 ;;
    stalls)  # (Qwen) 50 APPS problems after warm-up, compiled, HF static alongside (cold compile cache)
      timeout 560 python3 -m specdec.cli bench-stalls --device cuda --dtype bf16 --compile --problems 50 --hf-static \
        "${apps[@]}" --out "$out/stalls.json" > "$out/stalls.log" 2>&1 ;;
    ttft)  # (Qwen) two fresh processes to their first token; the second reads the compile cache
           # (COMPILE=inductor: the whole forward compiled as one, the default before v20; TAG= a suffix of the output names)
      for i in 1 2; do
        timeout 200 python3 -m specdec.cli bench-stalls --mode first-token --device cuda --dtype bf16 --compile \
          ${COMPILE:-} "${apps[@]}" --out "$out/ttft$i${TAG:-}.json" > "$out/ttft$i${TAG:-}.log" 2>&1
      done ;;
    scale1k|scale16k)  # $SCALE_CONFIG (default Llama-3-8B) shapes, random weights; PARTS= the --scale-parts,
                       # SCALE_ARGS= more flags (e.g. --no-fuse), TAG= a suffix of the output names
      L=$([ "$s" = scale1k ] && echo 1024 || echo 16384)
      timeout 560 python3 -m specdec.cli bench-engine --sections scale --device cuda --scale-prompts "$L" \
        --scale-config "${SCALE_CONFIG:-llama3-8b}" --scale-parts "${PARTS:-engine-graph,hf-static,verify}" \
        ${SCALE_ARGS:-} --out "$out/$s${TAG:-}.json" > "$out/$s${TAG:-}.log" 2>&1 ;;
    fprofile|fprofile-unfused)  # kernels of the compiled forward (1 and 65 nodes) at $CONFIGS' shapes (default
                                # Llama-3-8B and the 1.5B's), random weights; -unfused: separate q/k/v, gate/up GEMMs;
                                # COMPILE=model: the whole forward compiled as one (default: layer-wise, what
                                # compile=True does); TAG= a suffix of the output names
      flag=$([ "$s" = fprofile ] && echo "" || echo "--no-fuse")
      for c in ${CONFIGS:-llama3-8b qwen2.5-1.5b}; do
        name="fp-$c${flag:+-unfused}${TAG:-}"
        timeout 330 python3 scripts/device/forward_profile.py --config "$c" --prompt 1024 --nodes 1 65 $flag \
          ${COMPILE:+--compile $COMPILE} --out "$out/$name.json" > "$out/$name.log" 2>&1
      done ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
  echo "   rc=$? $(date +%T)" >> "$out/steps.log"
done
