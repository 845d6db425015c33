#!/usr/bin/env bash
# On a GPU device machine, after setup_models.sh: the README's main command with --baseline. Runs (RUNS,
# in its order; default all): auto-1, auto-2 -- the defaults (on a GPU prompt lookup with the target
# compiled, node budget "auto"), cold, then with the compile cache warm (the first-token bar); model-1,
# model-2 -- the draft model, compiled in its loop; model-eager -- the draft model, nothing compiled
# (the GPU default before 2026-11-28); lookup-eager -- prompt lookup uncompiled; t64 -- the defaults at
# a fixed t = 64; lookup-model-yield -- prompt lookup merged with the draft model, the budget split by
# yield. Each run's summary line and --json go to $OUT.
#   [RUNS="auto-1 auto-2"] bash scripts/device/main_command.sh     (at most LIMIT_S seconds, default 560)
export SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home} PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
out=${OUT:-/tmp}
t0=$(date +%s)
prompt="Write a Python function is_prime(n) with a docstring and tests."
run() {  # name, generate arguments...: one process, its own time limit within LIMIT_S
  local name=$1 left; shift
  left=$(( ${LIMIT_S:-560} - ($(date +%s) - t0) ))
  [ $left -gt 20 ] || { echo "$name: no time left"; return; }
  timeout $(( left < 200 ? left : 200 )) python3 -m specdec.cli generate "$@" --baseline --no-progress \
    --json "$out/$name.json" > "$out/$name.log" 2>&1
  echo "$name: exit $?"; tail -1 "$out/$name.log"
}
# RUNS: which runs, in this order (default: all of them as listed below)
for r in ${RUNS:-auto-1 auto-2 model-1 model-2 model-eager lookup-eager t64 lookup-model-yield}; do
  case $r in
    auto-*) run "$r" "$prompt" --max-new-tokens 256 ;;
    model-eager) run "$r" "$prompt" --max-new-tokens 256 --drafter model --no-compile ;;
    model-*) run "$r" "$prompt" --max-new-tokens 256 --drafter model ;;
    lookup-eager) run "$r" "$prompt" --max-new-tokens 256 --drafter lookup --no-compile ;;
    t64) run t64 "$prompt" --max-new-tokens 256 --tree-size 64 ;;
    lookup-model-yield) run "$r" "$prompt" --max-new-tokens 256 --drafter lookup+model --split yield ;;
    *) echo "unknown run $r" >&2 ;;
  esac
done
