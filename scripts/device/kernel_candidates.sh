#!/usr/bin/env bash
# On the device machine: GPU tests + config sweep of the tree-attention kernel candidates that
# docs/DEVICE_RUNS.md unpacks into .evaldata/v<N> (one folder per candidate branch), each run from
# its own folder (`python -m` puts the current directory first on sys.path). Usage:
#   bash scripts/device/kernel_candidates.sh 6 7 5      # candidates in this order
# Writes pytest-v<N>.txt and sweep-v<N>.json / .log to $OUT; a failing test suite skips the sweep.
set -uo pipefail
out=${OUT:-/tmp}
for v in "$@"; do
  dir=.evaldata/v$v
  [ -d "$dir/treeattn" ] || { echo "v$v: no $dir/treeattn" | tee -a "$out/kernels.log"; continue; }
  if (cd "$dir" && timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/treeattn) > "$out/pytest-v$v.txt" 2>&1; then
    (cd "$dir" && timeout 200 python3 -m treeattn.bench --sweep --skip-baselines --L 1024 4000 --t 256 \
      --out "$out/sweep-v$v.json") > "$out/sweep-v$v.log" 2>&1
    echo "v$v: tests passed; sweep rc $?" | tee -a "$out/kernels.log"
    tail -3 "$out/sweep-v$v.log" | tee -a "$out/kernels.log"
  else
    echo "v$v: GPU tests failed (see pytest-v$v.txt)" | tee -a "$out/kernels.log"
    tail -5 "$out/pytest-v$v.txt" | tee -a "$out/kernels.log"
  fi
done
