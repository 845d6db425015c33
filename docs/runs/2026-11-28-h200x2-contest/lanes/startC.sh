#!/usr/bin/env bash
# the staged block's start call (after the 18 staging calls in the same batch); the random-weight tpC.sh runs first,
# in its own call, on the same 2-GPU machine
b=scripts/device/background.sh
# (background.sh start copies this call's .evaldata and .ab into /tmp/bg/repo, made by the TP job's earlier call)
bash $b start setup "bash scripts/device/setup_models.sh qwen2.5-coder-1.5b"
bash $b start g0 "bash .ab/next/laneC0.sh"
bash $b start g1 "bash .ab/next/laneC1.sh"
bash $b wait ${1:-540}; cat /tmp/bg/progress.log
