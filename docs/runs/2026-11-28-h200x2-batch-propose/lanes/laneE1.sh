#!/usr/bin/env bash
# GPU 1: the contest head from its kept mix, the never-slower batch table (steady tok/s, captures apart,
# budget_trace; propose_batch), then APPS and HumanEval at depth 8 with t = 64 and auto
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/specdec-home
o=$OUT; t0=$(date +%s); log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s g1: $*" >> /tmp/bg/progress.log; }
bash scripts/device/background.sh await setup; log "setup done"
CACHE=.evaldata/contest HEAD=/tmp/eagle-contest EX=974 BUDGET=330 TRAIN_ARGS="--mix contest" OUT=$o \
  bash scripts/device/train_and_sweep.sh train; log "contest head: $(grep -E 'held-out|time:' $o/train_eagle.log | tr '\n' ' ')"
DRAFTER=eagle HEAD=/tmp/eagle-contest TREES="0 16 32 64 auto" NO_HF=1 MODE=graph BATCH="1 2 4 8 16" OUT=$o \
  bash scripts/device/engine_bench.sh batch; log "batch: $(tail -c 600 $o/batch-1-2-4-8-16.log | tr '\n' ' ')"
c="compile_head=true,compile=true"
TAG=contest TREES="64 auto" METHODS="specdec specdec-plain" COMPILE=1 CALIBRATE=0 SWEEP_S=420 OUT=$o \
  DRAFTERS="c8=eagle:heads=/tmp/eagle-contest,depth=8,$c" \
  bash scripts/device/train_and_sweep.sh apps; log "apps: $(grep -E '^\| specdec' $o/apps-contest.log | tr '\n' ' ')"
TAG=contest TREES="64 auto" METHODS="specdec specdec-plain" COMPILE=1 CALIBRATE=0 SWEEP_S=300 OUT=$o \
  DRAFTERS="c8=eagle:heads=/tmp/eagle-contest,depth=8,$c" \
  bash scripts/device/train_and_sweep.sh humaneval; log "humaneval: $(grep -E '^\| specdec' $o/humaneval-contest.log | tr '\n' ' ')"
log "lane done"
