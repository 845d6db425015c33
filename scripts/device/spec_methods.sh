#!/usr/bin/env bash
# On the device machine, after scripts/device/setup_models.sh: the speculative half of the APPS
# sweep (docs/DEVICE_RUNS.md). Trains the Medusa heads into /tmp/medusa (unless there already),
# then runs the `specdec` rows into the baselines' JSONL (same settings, so one report pairs them),
# then the graphed draft model (20 problems) into its own file, then the fp32 exactness check.
# Every step resumes where a cut call stopped. Optional steps: `attn` re-times the attention-only
# columns of the main file (every record already there: no generation, no Medusa heads needed);
# `long` is DeFT's long-prompt setting (prompts padded to 4000 tokens with few-shot problems).
#   bash scripts/device/spec_methods.sh [train|medusa|model|fp32|attn|long]...   (default: the first four)
set -uo pipefail
export SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home} PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
mkdir -p /tmp/results
[ -f /tmp/results/apps-bf16.jsonl ] || cp .evaldata/apps-bf16.jsonl /tmp/results/ 2>/dev/null
common=(--dataset apps --problems 50 --tree-sizes 32 64 128 256 --data .evaldata/apps_selected150.jsonl
        --max-new-tokens 128 --seed 0 --dtype bf16 --device cuda --no-progress)
for step in "${@:-train medusa model fp32}"; do
  for s in $step; do
    case $s in
      train)
        [ -f /tmp/medusa/medusa_heads.safetensors ] || timeout 400 python3 -m specdec.cli train-medusa \
          --data .evaldata/mbpp.jsonl --out /tmp/medusa --max-new-tokens 192 --gen-batch-size 120 --steps 1000 \
          --no-progress > "$out/train_medusa.log" 2>&1
        cp /tmp/medusa/medusa_config.json "$out/" 2>/dev/null ;;
      medusa)
        timeout 560 python3 -m specdec.cli sweep "${common[@]}" --drafter medusa --drafter-option heads=/tmp/medusa \
          --methods specdec --out /tmp/results/apps-bf16.jsonl >> "$out/apps-bf16.log" 2>&1 ;;
      model)
        # Its own file (another drafter is another configuration), so greedy decoding re-runs the
        # `hf` reference there: 20 problems keep that to ~2 minutes.
        timeout 560 python3 -m specdec.cli sweep "${common[@]}" --problems 20 --drafter model \
          --methods specdec hf-static --out /tmp/results/apps-bf16-model.jsonl >> "$out/apps-bf16-model.log" 2>&1 ;;
      attn)
        timeout 300 python3 -m specdec.cli sweep "${common[@]}" --drafter medusa --drafter-option heads=/tmp/medusa \
          --out /tmp/results/apps-bf16.jsonl >> "$out/apps-bf16.log" 2>&1 ;;
      long)
        timeout 560 python3 -m specdec.cli sweep "${common[@]}" --problems 10 --tree-sizes 64 256 --pad-prompt-to 4000 \
          --drafter model --methods hf-static specdec --out /tmp/results/apps-bf16-long.jsonl >> "$out/apps-bf16-long.log" 2>&1 ;;
      fp32)
        # The Medusa heads where trained in this machine's life, else the draft model: exactness is the
        # engine's (tree forward, verification, KV commit), whatever proposes the tree.
        drafter=(--drafter model); [ -f /tmp/medusa/medusa_heads.safetensors ] && drafter=(--drafter medusa --drafter-option heads=/tmp/medusa)
        timeout 400 python3 -m specdec.cli eval apps --problems 4 --tree-sizes 64 --methods hf specdec \
          "${drafter[@]}" --data .evaldata/apps_selected150.jsonl \
          --max-new-tokens 64 --dtype fp32 --device cuda --no-progress --out /tmp/results/apps-fp32.jsonl \
          > "$out/apps-fp32.log" 2>&1; echo "fp32 check exit $? (0: every output identical to target-only)" >> "$out/apps-fp32.log" ;;
      *) echo "unknown step $s" >&2; exit 2 ;;
    esac
    echo "step $s done"; tail -4 "$out"/*.log 2>/dev/null | tail -12
  done
done
cp /tmp/results/* "$out/" 2>/dev/null
