#!/usr/bin/env bash
# GPU 0 (after the random-weight job): the general head from its kept mix, Spec-Bench at auto with it alone and
# merged with prompt lookup (the catch-up fit and the call-start probe: predicted above the last run's t = 64, 1.11x);
# then, if the lane is early, Medusa's heads and their batch table
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/specdec-home
o=$OUT; t0=$(date +%s); log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s g0: $*" >> /tmp/bg/progress.log; }
bash scripts/device/background.sh await setup
[ -e /tmp/bg/rand.log ] && bash scripts/device/background.sh await rand
log "setup and rand done"
CACHE=.evaldata/general HEAD=/tmp/eagle-general EX=974 BUDGET=270 TRAIN_ARGS="--mix general" OUT=$o \
  bash scripts/device/train_and_sweep.sh train; log "general head: $(grep -E 'held-out|time:' $o/train_eagle.log | tr '\n' ' ')"
c="compile_head=true,compile=true"
TAG=sb TREES=auto METHODS="specdec specdec-plain" COMPILE=1 CALIBRATE=0 SWEEP_S=480 OUT=$o \
  DRAFTERS="g=eagle:heads=/tmp/eagle-general,$c lg=lookup+eagle:heads=/tmp/eagle-general,$c" \
  bash scripts/device/train_and_sweep.sh specbench; log "specbench: $(grep -E '^\| overall' $o/specbench-sb.log | tr '\n' ' ')"
if [ $(( $(date +%s) - t0 )) -lt 960 ]; then
  OUT=$o bash scripts/device/train_and_sweep.sh medusa; log "medusa: $(grep -E 'held-out|time:' $o/train_medusa.log 2>/dev/null | tr '\n' ' ')"
  DRAFTER=medusa TREES="0 16 32 64 auto" NO_HF=1 MODE=graph BATCH="1 2 4 8 16" OUT=$o \
    bash scripts/device/engine_bench.sh batch; log "medusa batch: $(tail -c 600 $o/batch-1-2-4-8-16.log | tr '\n' ' ')"
fi
log "lane done"
