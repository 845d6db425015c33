#!/usr/bin/env bash
# the block's one start call (after the 18 staging calls in the same batch)
b=scripts/device/background.sh
bash $b start setup "bash scripts/device/setup_models.sh qwen2.5-coder-1.5b"
bash $b start rand "bash .ab/next/randE.sh"
bash $b start g0 "bash .ab/next/laneE0.sh"
bash $b start g1 "bash .ab/next/laneE1.sh"
bash $b wait ${1:-540}; cat /tmp/bg/progress.log
