#!/usr/bin/env bash
# On the device machine: issue 15's HF baselines other than HF static -- HF prompt lookup (`hf-lookup`) on
# every problem, HF assisted generation with the 0.5B (`hf-assisted`) and the default-cache greedy reference
# (`hf`) on the first LIMIT problems -- for both datasets. Needs both Qwen models staged and converted
# (scripts/device/setup_models.sh) and .evaldata/{apps_selected150.jsonl,wheels} carried.
#   bash scripts/device/hf_baselines.sh par | solo
# par:  2 x SHARDS sweep processes per dataset side by side, each pinned to its own 2 cores (taskset): these
#       methods are host-bound (40-55 ms of Python a token on a GPU that is busy a few ms of it), so
#       they share the GPU; each process writes /tmp/results/<ds>-$TAG<lk|as>.rank<r>-of-<SHARDS>.jsonl
#       (resumable: a second `par` call goes on where the first stopped).
# solo: the same three methods alone, one process, on the first SOLO HumanEval problems, into
#       /tmp/results/humaneval-${TAG}solo.jsonl: what the side-by-side run cost each call, problem by problem.
# Environment: TAG (default s15), SHARDS (default 2), LIMIT (default 50), SOLO (default 6), SWEEP_S (each
# process's time limit, default 540; never wrap this script in an outer timeout, which kills it before the
# copy to $OUT). Records come back gzipped in $OUT with one log per process.
set -uo pipefail
export SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 MKL_NUM_THREADS=2
out=${OUT:-/tmp}
tag=${TAG:-s15} shards=${SHARDS:-2} limit=${LIMIT:-50}
mkdir -p /tmp/results
common=(--problems 0 --max-new-tokens 128 --seed 0 --temperature 0 --dtype bf16 --device cuda --no-progress
        --no-attn --method-problems "hf=$limit" "hf-assisted=$limit")
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
            $(pin $i) timeout "${SWEEP_S:-540}" python3 -m specdec.cli sweep --dataset $ds $(data_of $ds) "${common[@]}" \
              --methods $methods --shard "$r/$shards" --out "/tmp/results/$ds-$tag$group.jsonl" \
              >> "$out/$ds-$tag$group.rank$r.log" 2>&1 &
            i=$((i + 1))
          done
        done
      done
      wait
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> "$out/steps.log" 2>&1 ;;
    solo)
      timeout "${SWEEP_S:-540}" python3 -m specdec.cli sweep --dataset humaneval "${common[@]}" --problems "${SOLO:-6}" \
        --methods hf-lookup hf-assisted hf --out "/tmp/results/humaneval-${tag}solo.jsonl" \
        >> "$out/humaneval-${tag}solo.log" 2>&1 ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
  echo "   rc=$? $(date +%T)" >> "$out/steps.log"
  for f in /tmp/results/*-"$tag"*.jsonl; do [ -f "$f" ] && gzip -c "$f" > "$out/$(basename "$f").gz"; done
done
