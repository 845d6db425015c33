#!/usr/bin/env bash
b=scripts/device/background.sh
bash $b start setup "bash scripts/device/setup_models.sh qwen2.5-coder-1.5b"
bash $b start g0 "bash .ab/laneB0.sh"
bash $b start g1 "bash .ab/laneB1.sh"
bash $b wait ${1:-540}; cat /tmp/bg/progress.log
