#!/usr/bin/env bash
# GPU 0: the layer-wise compiled draft loop's CUDA test, the main command (compiled, lookup, auto), then
# train-eagle on a 1,000-prompt user file, data generation included (the 10-minute bar)
export SPECDEC_HOME=/tmp/specdec-home PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
L=/tmp/L; cd $REPO; t0=$(date +%s)
log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s lane0: $*" >> $L/progress.log; }
while [ ! -f $L/qwen2.5-coder-0.5b.ok ]; do sleep 2; done; log "0.5b ready"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/drafters/test_draft_model.py -k layer_wise \
  > $L/g0/pytest_layerwise.txt 2>&1; log "pytest layer_wise: $(tail -1 $L/g0/pytest_layerwise.txt)"
mkdir -p $L/g0/main
RUNS="compiled-1 compiled-2 lookup auto-1 auto-2 t64" LIMIT_S=420 OUT=$L/g0/main bash scripts/device/main_command.sh \
  > $L/g0/main/summary.txt 2>&1; log "main command: $(tr '\n' ' ' < $L/g0/main/summary.txt | cut -c1-900)"
HEAD=/tmp/eagle-user BUDGET=200 TRAIN_ARGS="--feature-layers low,mid,high" OUT=$L/g0 \
  bash scripts/device/train_and_sweep.sh userfile user; log "user file: $(tail -1 $L/g0/train_user.log)"
touch $L/lane0.done
