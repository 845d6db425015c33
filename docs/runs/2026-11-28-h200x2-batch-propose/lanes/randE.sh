#!/usr/bin/env bash
# random weights on GPU 0 while the models are set up and GPU 1 trains: the CUDA tests of the drafters and the budget,
# then EAGLE drafting at batch 8 / 16 (propose_batch, 4 side streams, one at a time) and the kernels of one
# depth-8 expansion replay (draft vocabulary 8,192, APPS's median prompt)
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=0
o=${OUT:-/tmp/out}; mkdir -p $o
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/drafters/test_eagle.py tests/specdec/test_budget.py -k "cuda or device or batch" \
  > $o/pytest_eagle_cuda.txt 2>&1; tail -3 $o/pytest_eagle_cuda.txt
timeout 330 python3 scripts/device/eagle_profile.py --config qwen2.5-1.5b --tree-size 64 --depth 8 --topk 8 --compile \
  --prompts 2 --prompt-len 449 --draft-vocab 8192 --batch-sizes 8 16 --expansion-kernels $o/expansion_kernels_d8.txt \
  --out $o/eagle_batch.json > $o/eagle_batch.log 2>&1
grep -E "'batch'" $o/eagle_batch.log; tail -2 $o/eagle_batch.log
