#!/usr/bin/env bash
# On a GPU device machine, after setup_models.sh: the README's main command with --baseline, the
# defaults (draft model, node budget "auto") twice -- cold, then with the compile cache warm (the
# first-token bar) --, the same with --compile twice (the target and the draft's loop compiled layer-wise:
# the first process compiles, the second loads the kernels from the on-disk cache), prompt lookup alone
# (predicted ~1.4x there: 1.65 tokens a step at t = 16 measured on a CPU, a ~3.4-ms step against 2.9 ms a
# target token, PERF v30), a fixed t = 64, and prompt
# lookup merged with the draft model, the budget split by yield. Each run's summary line and --json go
# to $OUT.
#   [RUNS="compiled-1 compiled-2 lookup"] bash scripts/device/main_command.sh        (~90 s without the compiled runs on an H100; at most LIMIT_S
#                                                seconds, default 560)
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
for r in ${RUNS:-auto-1 auto-2 compiled-1 compiled-2 lookup t64 lookup-model-yield}; do
  case $r in
    auto-*) run "$r" "$prompt" --max-new-tokens 256 ;;
    compiled-*) run "$r" "$prompt" --max-new-tokens 256 --compile ;;
    lookup) run lookup "$prompt" --max-new-tokens 256 --drafter lookup ;;
    t64) run t64 "$prompt" --max-new-tokens 256 --tree-size 64 ;;
    lookup-model-yield) run "$r" "$prompt" --max-new-tokens 256 --drafter lookup+model --split yield ;;
    *) echo "unknown run $r" >&2 ;;
  esac
done
