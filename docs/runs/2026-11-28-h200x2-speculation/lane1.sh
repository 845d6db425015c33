#!/usr/bin/env bash
# GPU 1: the EAGLE head at full size, then all of HumanEval and APPS at t = 64
export SPECDEC_HOME=/tmp/specdec-home PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=1
L=/tmp/L; cd $REPO; t0=$(date +%s)
log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s lane1: $*" >> $L/progress.log; }
while [ ! -f $L/qwen2.5-coder-1.5b.ok ]; do sleep 2; done; log "1.5b ready"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HEAD=/tmp/eagle-big EX=974 BUDGET=${BUDGET:-320} \
  TRAIN_ARGS="--feature-layers low,mid,high --unroll 4 --steps 6000" OUT=$L/g1 \
  bash scripts/device/train_and_sweep.sh train; log "trained: $(grep -E 'held-out|loss|time:' $L/g1/train_eagle.log | tr '\n' ' ')"
for s in humaneval apps; do
  TAG=big TREES=64 METHODS="specdec specdec-plain hf-static" LIMITS="hf-static=20" COMPILE=1 CALIBRATE=0 SWEEP_S=420 \
    DRAFTERS="e6=eagle:heads=/tmp/eagle-big,compile_head=true,compile=true" OUT=$L/g1 \
    bash scripts/device/train_and_sweep.sh $s; log "$s done: $(tail -3 $L/g1/$s-big.log | tr '\n' ' ' | cut -c1-300)"
done
touch $L/lane1.done
