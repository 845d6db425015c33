#!/usr/bin/env bash
# both GPUs, random Llama-3-8B shapes, bf16: the push all-reduce in the captured forward, then plain decoding
export PYTHONUNBUFFERED=1
DTYPE=bf16 bash scripts/device/multigpu.sh build
bash scripts/device/background.sh await prof
ONE_SHOT="push auto" DTYPE=bf16 bash scripts/device/multigpu.sh forward
TP_ALLREDUCE=push bash scripts/device/multigpu.sh tp-bf16
