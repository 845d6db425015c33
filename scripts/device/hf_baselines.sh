#!/usr/bin/env bash
# On the device machine: the full sweep's HF baselines other than HF static -- HF prompt lookup (`hf-lookup`) on
# every problem, HF assisted generation with the 0.5B (`hf-assisted`) and the default-cache greedy reference
# (`hf`) on the first LIMIT problems -- for both datasets. Needs both Qwen models staged and converted
# (scripts/device/setup_models.sh) and .evaldata/{apps_selected150.jsonl,wheels} carried.
#   bash scripts/device/hf_baselines.sh par | solo-humaneval | solo-apps | tests-shared
# par:  2 x SHARDS sweep processes per dataset side by side, each pinned to its own 2 cores (taskset): these
#       methods are host-bound (40-55 ms of Python a token on a GPU that is busy a few ms of it), so
#       they share the GPU; each process writes /tmp/results/<ds>-$TAG<lk|as>.rank<r>-of-<SHARDS>.jsonl
#       (resumable: a second `par` call goes on where the first stopped).
#       The 2026-11-25 run `429f876` measured what that costs (the same problems run alone): hf-lookup 3.2x slower per
#       call with 8 processes, hf-assisted 1.5x, hf 1.1x -- too much to report; use `solo-*`.
# solo-<dataset>: METHODS (default hf-lookup) in one process alone on the GPU, on the first PROBLEMS problems
#       (default 0 = all; hf-assisted on the first LIMIT), into /tmp/results/<ds>-${TAG}solo.jsonl
#       (resumable); no `hf` reference here (it ran side by side, where it lost only ~10 %).
# tests-shared: the CUDA tests of the shared-prompt path (cascade kernel, shared-prompt graphs and warm-up) within TESTS_S seconds.
# Environment: TAG (default hf), SHARDS (default 2), LIMIT (default 50), SWEEP_S (each process's time
# limit, default 540), CALL_S (the whole call's budget in seconds, default 570: a step never runs past it, so
# the records are copied to $OUT before the call's 600-s limit; never wrap this script in an outer timeout).
# Records come back gzipped, all in one archive ($OUT/results.tgz: a call returns a limited number of files).
set -uo pipefail
export SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
out=${OUT:-/tmp}
tag=${TAG:-hf} shards=${SHARDS:-2} limit=${LIMIT:-50}
start=$(date +%s)
left() {  # seconds this call has left for a step, at most $1
  local l=$(( ${CALL_S:-570} - ($(date +%s) - start) )); echo $(( l < $1 ? l : $1 ))
}
mkdir -p /tmp/results
common=(--max-new-tokens 128 --seed 0 --temperature 0 --dtype bf16 --device cuda --no-progress --no-attn)
data_of() { [ "$1" = apps ] && echo "--data .evaldata/apps_selected150.jsonl"; }
pin() {  # cores 2i, 2i+1 when taskset is there
  if command -v taskset > /dev/null; then echo "taskset -c $((2 * $1)),$((2 * $1 + 1))"; fi
}
for s in "$@"; do
  echo "== $s $(date +%T)" >> "$out/steps.log"
  case $s in
    par)
      i=0
      for ds in humaneval apps; do
        for group in lk as; do
          methods=$([ $group = lk ] && echo hf-lookup || echo "hf-assisted hf")
          for ((r = 0; r < shards; r++)); do
            # shellcheck disable=SC2046
            $(pin $i) timeout "$(left "${SWEEP_S:-540}")" python3 -m specdec.cli sweep --dataset $ds $(data_of $ds) \
              "${common[@]}" --problems 0 --method-problems "hf=$limit" "hf-assisted=$limit" --methods $methods \
              --shard "$r/$shards" --out "/tmp/results/$ds-$tag$group.jsonl" \
              >> "$out/$ds-$tag$group.rank$r.log" 2>&1 &
            i=$((i + 1))
          done
        done
      done
      wait
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> "$out/steps.log" 2>&1 ;;
    solo-humaneval|solo-apps)
      ds=${s#solo-}
      # shellcheck disable=SC2046
      timeout "$(left "${SWEEP_S:-540}")" python3 -m specdec.cli sweep --dataset "$ds" $(data_of "$ds") "${common[@]}" \
        --problems "${PROBLEMS:-0}" --method-problems hf=0 "hf-assisted=$limit" --methods ${METHODS:-hf-lookup} \
        --out "/tmp/results/$ds-${tag}solo.jsonl" >> "$out/$ds-${tag}solo.log" 2>&1 ;;
    tests-shared)  # its log kept the name pytest_cuda17.txt of the records
      timeout "$(left "${TESTS_S:-400}")" python3 -m pytest -v -p no:cacheprovider tests/specdec/test_graphs.py \
        tests/specdec/test_warmup.py tests/treeattn/test_cascade_device_len.py tests/treeattn/test_cascade.py \
        -k "cascade or shared" > "$out/pytest_cuda17.txt" 2>&1 ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
  echo "   rc=$? $(date +%T)" >> "$out/steps.log"
done
(cd /tmp/results && tar czf "$out/results.tgz" ./*-"$tag"*.jsonl 2>/dev/null)
