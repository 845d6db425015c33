#!/usr/bin/env bash
# GPU 1, random weights at the 1.5B's shapes: where an EAGLE step goes at APPS's median prompt, vocabulary 8192,
# then the head's GEMMs autotuned
export CUDA_VISIBLE_DEVICES=1 PYTHONUNBUFFERED=1
c="--config qwen2.5-1.5b --tree-size 64 --depth 6 --topk 8 --compile --prompts 3 --prompt-len 449 --draft-vocab 8192"
timeout 280 python3 scripts/device/eagle_profile.py $c --expansion-kernels $OUT/k8192.txt --out $OUT/e8192.json \
  --trace $OUT/t8192.txt > $OUT/e8192.log 2>&1; echo "e8192 rc=$?"
timeout 280 python3 scripts/device/eagle_profile.py $c --inductor max_autotune_gemm=True \
  --expansion-kernels $OUT/kauto.txt --out $OUT/eauto.json > $OUT/eauto.log 2>&1; echo "eauto rc=$?"
