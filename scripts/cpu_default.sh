#!/usr/bin/env bash
# Which `specdec generate` configuration pays on a CPU: each candidate decodes each prompt
# with --baseline (the target alone, same process, right after), greedy, generate's default dtype
# (bf16 on a CPU with native bf16, else fp32; add --dtype to a config to pin it), 64 new tokens, and
# writes one JSON per run into OUT (default docs/runs/<date>-cpu). Prompts: the README's, plus two
# MBPP tasks (training data; never APPS / HumanEval). Run on an otherwise idle machine.
#   bash scripts/cpu_default.sh [OUT]      (CONFIGS="name:flags;name:flags" replaces the candidates)
set -uo pipefail
out=${1:-docs/runs/$(date +%F)-cpu}
mkdir -p "$out"
prompts=("Write a Python function is_prime(n)."
         "$(python3 -c 'import json;print(json.loads(open("../shared/data/mbpp/mbpp.jsonl").readlines()[10])["text"])')"
         "$(python3 -c 'import json;print(json.loads(open("../shared/data/mbpp/mbpp.jsonl").readlines()[20])["text"])')")
configs=("model16:--drafter model --tree-size 16" "model4:--drafter model --tree-size 4 --depth 2 --topk 2"
         "chain3:--drafter model --tree-size 3 --depth 3 --topk 1" "lookup8:--drafter lookup --tree-size 8"
         "lookup16:--drafter lookup --tree-size 16")
[ -n "${CONFIGS:-}" ] && IFS=';' read -ra configs <<< "$CONFIGS"  # e.g. CONFIGS="chain4:--drafter model --tree-size 4 --depth 4 --topk 1"
for i in "${!prompts[@]}"; do
  for c in "${configs[@]}"; do
    name=${c%%:*}
    # shellcheck disable=SC2086
    specdec generate "${prompts[$i]}" ${c#*:} --max-new-tokens 64 --baseline --no-progress \
      --json "$out/$name-p$i.json" > /dev/null 2>> "$out/log.txt"
  done
done
python3 - "$out" <<'PY'
import json, pathlib, statistics, sys
runs = {}
for p in sorted(pathlib.Path(sys.argv[1]).glob("*-p*.json")):
    runs.setdefault(p.stem.rsplit("-p", 1)[0], []).append(json.loads(p.read_text()))
print("| config | runs | tokens/step | spec s | target alone s | measured speedup (each) | geo-mean |")
print("| --- | --- | --- | --- | --- | --- | --- |")
for name, rs in runs.items():
    sp = [r["measured_speedup"] for r in rs]
    print(f"| {name} | {len(rs)} | {statistics.mean(r['tokens_per_step'] for r in rs):.2f} | "
          f"{sum(r['seconds'] for r in rs):.1f} | {sum(r['baseline_seconds'] for r in rs):.1f} | "
          f"{', '.join(f'{x:.2f}' for x in sp)} | {statistics.geometric_mean(sp):.2f}x |")
PY
