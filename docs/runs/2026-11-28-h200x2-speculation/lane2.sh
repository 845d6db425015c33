#!/usr/bin/env bash
# both GPUs, after the lanes: the real pair at TP = 2 against one GPU, the draft model in fp32
export SPECDEC_HOME=/tmp/specdec-home PYTHONUNBUFFERED=1
L=/tmp/L; cd $REPO; t0=$(date +%s)
log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s lane2: $*" >> $L/progress.log; }
while [ ! -f $L/lane0.done ] || [ ! -f $L/lane1.done ]; do sleep 3; done; log "start"
QWEN=model OUT=$L/tp timeout 420 bash scripts/device/multigpu.sh qwen > $L/tp/main.log 2>&1; log "qwen model rc=$?: $(tail -3 $L/tp/main.log | tr '\n' ' ')"
TREES="32 64" OUT=$L/tp timeout 560 bash scripts/device/multigpu.sh sharded-apps > $L/tp/sharded.log 2>&1; log "sharded apps rc=$?: $(grep sharded-apps: $L/tp/sharded-apps.log)"
touch $L/lane2.done
