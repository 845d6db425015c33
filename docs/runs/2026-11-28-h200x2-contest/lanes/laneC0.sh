#!/usr/bin/env bash
# GPU 0: the contest-mix head (MBPP + exercises + ~900 stdin programs the target writes), then all of APPS at
# depths 6 and 8 and all of HumanEval at depth 8 (against the MBPP head's 2026-11-28 run: APPS tau 4.14 / 4.30)
export CUDA_VISIBLE_DEVICES=0 PYTHONUNBUFFERED=1 SPECDEC_HOME=/tmp/specdec-home
o=$OUT; t0=$(date +%s); log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s g0: $*" >> /tmp/bg/progress.log; }
bash scripts/device/background.sh await setup; log "setup done"
HEAD=/tmp/eagle-contest EX=974 BUDGET=330 TRAIN_ARGS="--mix contest" OUT=$o bash scripts/device/train_and_sweep.sh train
log "contest head: $(grep -E 'held-out|time:|kept' $o/train_eagle.log | tr '\n' ' ')"
touch /tmp/bg/contest-head.ok
mkdir -p $o/mix; for f in /tmp/eagle-contest/selfdistill*.jsonl; do
  cmp -s "$f" ".evaldata/$(basename $f)" || gzip -c "$f" > "$o/mix/$(basename $f).gz"; done
c="compile_head=true,compile=true"
TAG=contest TREES=64 METHODS="specdec specdec-plain" COMPILE=1 CALIBRATE=0 SWEEP_S=420 OUT=$o \
  DRAFTERS="c6=eagle:heads=/tmp/eagle-contest,$c c8=eagle:heads=/tmp/eagle-contest,depth=8,$c" \
  bash scripts/device/train_and_sweep.sh apps; log "apps: $(grep -E '^\| specdec' $o/apps-contest.log | tr '\n' ' ')"
TAG=contest TREES=64 METHODS="specdec specdec-plain" COMPILE=1 CALIBRATE=0 SWEEP_S=300 OUT=$o \
  DRAFTERS="c8=eagle:heads=/tmp/eagle-contest,depth=8,$c" \
  bash scripts/device/train_and_sweep.sh humaneval; log "humaneval: $(grep -E '^\| specdec' $o/humaneval-contest.log | tr '\n' ' ')"
