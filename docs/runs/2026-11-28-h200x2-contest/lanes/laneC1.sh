#!/usr/bin/env bash
# GPU 1: the general head from the kept mix data, Spec-Bench at t = 64 and auto, then the never-slower batch table
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/specdec-home
o=$OUT; t0=$(date +%s); log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s g1: $*" >> /tmp/bg/progress.log; }
bash scripts/device/background.sh await setup; log "setup done"
CACHE=.evaldata/general HEAD=/tmp/eagle-general EX=974 BUDGET=270 TRAIN_ARGS="--mix general" OUT=$o \
  bash scripts/device/train_and_sweep.sh train; log "general head: $(grep -E 'held-out|time:|resum|cached' $o/train_eagle.log | tr '\n' ' ' | cut -c1-600)"
TAG=sb TREES="64 auto" METHODS="specdec specdec-plain" COMPILE=1 CALIBRATE=0 SWEEP_S=480 OUT=$o \
  DRAFTERS="g=eagle:heads=/tmp/eagle-general,compile_head=true,compile=true" \
  bash scripts/device/train_and_sweep.sh specbench; log "specbench: $(grep -E '^\| overall' $o/specbench-sb.log | tr '\n' ' ')"
while [ ! -f /tmp/bg/contest-head.ok ]; do sleep 3; done
DRAFTER=eagle HEAD=/tmp/eagle-contest TREES="0 16 32 64 auto" NO_HF=1 MODE=graph BATCH="1 2 4 8 16" OUT=$o \
  bash scripts/device/engine_bench.sh batch; log "batch: $(tail -c 500 $o/batch-1-2-4-8-16.log | tr '\n' ' ')"
