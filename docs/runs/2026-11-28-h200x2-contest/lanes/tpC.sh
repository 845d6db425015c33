#!/usr/bin/env bash
# both GPUs, random Llama-3-8B shapes, bf16 (no staging): TP = 2 towards 1.6x one GPU (specdec/PERF.md v34)
export PYTHONUNBUFFERED=1
DTYPE=bf16 bash scripts/device/multigpu.sh build
TP_ALLREDUCE=push DECODE_CHUNK=32 bash scripts/device/multigpu.sh tp-bf16      # the chunk turnaround
CUBLASLT_WORKSPACE_SIZE=0 TAG=nows TP_ALLREDUCE=push DECODE_CHUNK=32 bash scripts/device/multigpu.sh tp-bf16  # no split-K
INDUCTOR="max_autotune_gemm=True" ONE_SHOT=push timeout 560 bash scripts/device/multigpu.sh forward        # autotuned GEMMs
