#!/usr/bin/env bash
# GPU 0: the code head (MBPP + exercises), then the never-slower batch table (EAGLE, budgets 0 16 32 64 auto,
# bs 1..16), then APPS at depth 6 against depth 8
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/specdec-home
o=$OUT; t0=$(date +%s); log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s g0: $*" >> /tmp/bg/progress.log; }
bash scripts/device/background.sh await setup; log "setup done"
HEAD=/tmp/eagle-code EX=974 BUDGET=270 OUT=$o bash scripts/device/train_and_sweep.sh train
log "trained: $(grep -E 'held-out|time:' $o/train_eagle.log | tr '\n' ' ')"
DRAFTER=eagle HEAD=/tmp/eagle-code TREES="0 16 32 64 auto" NO_HF=1 MODE=graph BATCH="1 2 4 8 16" OUT=$o \
  bash scripts/device/engine_bench.sh batch; log "batch: $(tail -c 400 $o/batch-1-2-4-8-16.log | tr '\n' ' ')"
TAG=d8 TREES=64 METHODS="specdec specdec-plain" COMPILE=1 CALIBRATE=0 SWEEP_S=300 OUT=$o \
  DRAFTERS="e6=eagle:heads=/tmp/eagle-code,compile_head=true,compile=true e8=eagle:heads=/tmp/eagle-code,depth=8,compile_head=true,compile=true" \
  bash scripts/device/train_and_sweep.sh apps; log "apps: $(tail -c 300 $o/apps-d8.log | tr '\n' ' ')"
