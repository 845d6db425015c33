#!/usr/bin/env bash
# GPU 1: the general head (MBPP + exercises + prompts the target writes from the package's seeds of each Spec-Bench
# kind), then all 480 Spec-Bench first turns at the auto budget against specdec-plain
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/specdec-home
o=$OUT; t0=$(date +%s); log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s g1: $*" >> /tmp/bg/progress.log; }
bash scripts/device/background.sh await setup; log "setup done"
HEAD=/tmp/eagle-general EX=974 BUDGET=270 TRAIN_ARGS="--mix general" OUT=$o bash scripts/device/train_and_sweep.sh train
log "trained: $(grep -E 'held-out|time:' $o/train_eagle.log | tr '\n' ' ')"
mkdir -p $o/mix; for f in /tmp/eagle-general/selfdistill*.jsonl; do
  cmp -s "$f" ".evaldata/$(basename $f)" || gzip -c "$f" > "$o/mix/$(basename $f).gz"; done
TAG=sb TREES="auto" METHODS="specdec specdec-plain" COMPILE=1 CALIBRATE=0 SWEEP_S=420 OUT=$o \
  DRAFTERS="g=eagle:heads=/tmp/eagle-general,compile_head=true,compile=true" \
  bash scripts/device/train_and_sweep.sh specbench; log "specbench: $(tail -c 300 $o/specbench-sb.log | tr '\n' ' ')"
