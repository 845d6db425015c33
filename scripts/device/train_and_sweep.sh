#!/usr/bin/env bash
# On the device machine: train the drafters' heads here (EAGLE, Medusa), then sweep them over APPS / HumanEval,
# one step per argument so a run splits them over device calls (each call <= 10 minutes). Needs the
# 1.5B target (and for `model` the 0.5B draft) staged and converted (scripts/device/setup_models.sh)
# and .evaldata/{mbpp.jsonl,apps_selected150.jsonl} carried; results go to /tmp/results (resumable)
# and the logs / summaries to $OUT.
#   bash scripts/device/train_and_sweep.sh setup | tests | profile | distill | train | userfile | user | medusa | apps |
#                                          humaneval | specbench | cascade
# (steps run in the given order: `setup train medusa` converts the models, then trains one head after the other;
# two trainings side by side ran out of GPU memory in the 2026-11-24 run `d7af2d9`)
# The full sweep is the same apps / humaneval steps with every drafter and baseline, e.g.
#   METHODS="specdec hf-static hf-lookup hf-assisted hf" LIMITS="hf-assisted=50 hf=50" TREES="32 64 128 256" \
#   DRAFTERS="l=lookup md=medusa:heads=/tmp/medusa mW=model:draft=qwen2.5-coder-0.5b,depth=4,topk=8,compile=true \
#             ecY=eagle:heads=/tmp/eagle-515daa7,draft_vocab=32768,compile_head=true,compile=true" bash ... humaneval
# split over calls by drafter (each call <= 10 minutes; the file resumes and its baselines are shared).
# Environment: BUDGET (train seconds, default 300), TREES (default "32 64"), HEAD (the head's directory,
# default /tmp/eagle; a new one gives the sweeps new drafter keys), EX (train-eagle --exercises: self-written
# exercises, default 0), CACHE (a folder of self-distillation caches, plain or gzipped, restored into HEAD instead of
# .evaldata's MBPP ones: e.g. the --mix general data kept in docs/runs/2026-11-28-h200x2-budget/specbench-general/mix,
# copied under .evaldata/ before docs/runs/ moves out), TRAIN_ARGS (more train-eagle arguments, e.g. "--train-vocab 8192"), EAGLE (drafter spec
# options after heads=, default none), DRAFTERS (the whole --drafters list instead, e.g.
# "eagle:heads=/tmp/eagle,profile=true v32k=eagle:heads=/tmp/eagle,profile=true,draft_vocab=32768"; the draft-model
# drafter: "m=model:draft=qwen2.5-coder-0.5b,depth=4"), PROBLEMS (default 0 = all), LIMITS (--method-problems after
# hf=0, which always comes first: no bf16 greedy reference unless LIMITS names hf, e.g. hf=50 for the first 50;
# LIMITS="hf-static=20" alone keeps hf at 0 -- it once replaced it and the reference ran on every problem), STYLES
# (train-eagle --prompt-styles, default function,stdin,starter), ANSWERS (--answers-per-prompt, default
# 1), GEN (--gen-batch-size, default 120; 384 ran out of memory on the H100), FRESH (1: distill anew, not from a carried cache), METHODS (default
# "specdec hf-static"), SAMPLES (--samples: completions per problem in one batched call, the 16-samples work's n = 16 run with
# TEMP=0.8; give it a TAG of its own), TEMP (sampling temperature, default 0 = greedy; results
# then go to $s-eagle-t$TEMP.jsonl), TAG (the results file is $s-$TAG.jsonl instead: a new TAG starts a new file,
# so its baselines run again in this process), SWEEP_S (the sweep's time limit in seconds, default 590: a
# shorter one leaves time in the call for the copy to $OUT; never wrap this script in an outer timeout,
# which kills it before that copy), CALIBRATE (--calibrate: a process with drafter rows and no HF static of its own
# times HF static again on this many first problems, ~35 s with its compile, so the table's "vs hf-static same
# process" holds each row against the baseline at its own machine's speed; default 8, 0: off), NO_GC_FREEZE (1:
# --no-gc-freeze, the A/B of specdec/PERF.md v15; give it a TAG of its own), NO_SHARED (1: with SAMPLES, --no-shared-prompt:
# each row its own copy of the prompt's KV, the 16-samples work's comparison; a TAG of its own). COMPILE (1: --compile,
# every engine row's target forward compiled, specdec-plain's too: drafter rows compile by their spec's compile=true),
# COMPILE_PREFILL (1: --compile-prefill, the compiled rows' prompt prefill too). Every apps / humaneval call adds its rows to one file per dataset
# (baselines reused), so calls may split drafters and tree sizes.
set -uo pipefail
export SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home} PYTHONUNBUFFERED=1
out=${OUT:-/tmp}
mkdir -p /tmp/results
trees=(${TREES:-32 64})
head=${HEAD:-/tmp/eagle}
read -ra drafters <<< "${DRAFTERS:-eagle:heads=$head${EAGLE:+,$EAGLE}}"
train=(--data .evaldata/mbpp.jsonl --out "$head" --answers-per-prompt "${ANSWERS:-1}" --max-new-tokens 192
       --gen-batch-size "${GEN:-120}" --prompt-styles "${STYLES:-function,stdin,starter}" --exercises "${EX:-0}"
       ${TRAIN_ARGS:-} --no-progress)
sweep=(--problems "${PROBLEMS:-0}" --max-new-tokens 128 --seed 0 --dtype bf16 --device cuda --no-progress --no-attn
       --method-problems hf=0 ${LIMITS:-} --temperature "${TEMP:-0}" ${SAMPLES:+--samples "$SAMPLES"}
       --calibrate "${CALIBRATE:-8}" ${NO_GC_FREEZE:+--no-gc-freeze} ${NO_SHARED:+--no-shared-prompt} ${COMPILE:+--compile}
       ${COMPILE_PREFILL:+--compile-prefill})
read -ra methods <<< "${METHODS:-specdec hf-static}"
# the self-distillation data of the 2026-11-24 run `8875823` (MBPP answers of the 1.5B target and its own exercises,
# gzipped in the repository): `distill`, `train` and `medusa` start from it unless .evaldata has a copy or FRESH=1
cache=docs/runs/2026-11-24-h100-8875823/selfdistill
restore_eagle_data() {
  mkdir -p "$head"
  if [ -n "${CACHE:-}" ]; then  # another prompt list's caches (e.g. --mix general's) over .evaldata's, plain or gzipped
    cp .evaldata/selfdistill*.jsonl "$head/" 2>/dev/null
    for f in "$CACHE"/selfdistill*.jsonl*; do
      case $f in *.gz) zcat "$f" > "$head/$(basename "$f" .gz)" ;; *) cp "$f" "$head/" ;; esac
    done
    return
  fi
  cp .evaldata/selfdistill*.jsonl "$head/" 2>/dev/null && return
  for f in selfdistill.jsonl selfdistill.exercises.jsonl selfdistill.exercises.stubs.jsonl; do
    zcat "$cache/eagle.$f.gz" > "$head/$f"
  done
}
tag=${TAG:-$([ "${TEMP:-0}" = 0 ] && echo eagle || echo "eagle-t${TEMP}")}
for s in "$@"; do
  echo "== $s $(date +%T)" >> "$out/steps.log"
  case $s in
    tests)  # the CUDA paths of the drafters: device-side draft loops, graph replay, Triton top-k, all-token features
      timeout 280 python3 -m pytest -q -p no:cacheprovider tests/drafters/test_eagle.py tests/drafters/test_draft_model.py \
        tests/drafters/test_selection.py tests/specdec/test_hidden_states.py tests/specdec/test_prefill.py -m cuda \
        > "$out/pytest_cuda.txt" 2>&1 ;;
    profile)  # where an EAGLE step goes at the 1.5B's shapes (random weights) and the expansion graph's kernels
      timeout 200 python3 scripts/device/eagle_profile.py --config qwen2.5-1.5b --tree-size 64 --depth 6 --topk 8 \
        --compile --prompts 2 --out "$out/eagle_profile.json" --expansion-kernels "$out/expansion_kernels.txt" \
        > "$out/eagle_profile.log" 2>&1 ;;
    distill)  # the self-distillation data only (cached in /tmp/eagle; a carried .evaldata/selfdistill*.jsonl of
              # the same settings is reused -- train-eagle checks its settings -- and the cache comes back in $OUT)
      [ "${FRESH:-0}" = 1 ] && mkdir -p "$head" || restore_eagle_data
      timeout 560 python3 -m specdec.cli train-eagle "${train[@]}" --steps 0 \
        > "$out/distill.log" 2>&1
      cp "$head"/selfdistill*.jsonl "$out/" ;;
    train)  # the head, on the cached data (restored as in `distill`; made here if none), within BUDGET seconds
      [ "${FRESH:-0}" = 1 ] || [ -f "$head/selfdistill.jsonl" ] || restore_eagle_data
      timeout 580 python3 -m specdec.cli train-eagle "${train[@]}" \
        --time-budget "${BUDGET:-300}" > "$out/train_eagle.log" 2>&1
      cp "$head/eagle_config.json" "$out/" ;;
    userfile)  # a 1,000-prompt user file (the train-on-your-prompts bar): MBPP's 974 task texts and the first 26
               # of the package's general seed prompts, as {"prompt": ...} lines in /tmp/user1000.jsonl
      python3 -c 'import json, sys
rows = [json.loads(l)["text"] for l in open(".evaldata/mbpp.jsonl")]
rows += [json.loads(l)["prompt"] for l in open("training/data/general_seeds.jsonl")]
sys.stdout.writelines(json.dumps({"prompt": p}) + "\n" for p in rows[:1000])' > /tmp/user1000.jsonl
      wc -l /tmp/user1000.jsonl >> "$out/steps.log" ;;
    user)  # train-eagle on the user file alone, data generation included, timed (bar: 10 minutes on one GPU)
      t0=$(date +%s)
      timeout 580 python3 -m specdec.cli train-eagle --prompts /tmp/user1000.jsonl --out "$head" --max-new-tokens 192 \
        --gen-batch-size "${GEN:-120}" ${TRAIN_ARGS:-} --time-budget "${BUDGET:-240}" --no-progress > "$out/train_user.log" 2>&1
      echo "train-eagle on /tmp/user1000.jsonl: exit $?, $(( $(date +%s) - t0 )) s from the start to the saved head" \
        | tee -a "$out/train_user.log" >> "$out/steps.log"
      cp "$head/eagle_config.json" "$out/" ;;
    apps|humaneval|specbench)  # the drafters at each t vs the baselines, every problem of the dataset (none used for
                               # tuning); specbench: the first turns of Spec-Bench's 480 questions (.evaldata/specbench.jsonl)
      data=$(case $s in apps) echo .evaldata/apps_selected150.jsonl ;; specbench) echo .evaldata/specbench.jsonl ;; esac)
      # rows of an earlier machine (carried in .evaldata/results/, gzipped or not) are kept: its baselines are reused
      [ -f "/tmp/results/$s-$tag.jsonl" ] || cp ".evaldata/results/$s-$tag.jsonl" /tmp/results/ 2>/dev/null \
        || zcat ".evaldata/results/$s-$tag.jsonl.gz" > "/tmp/results/$s-$tag.jsonl" 2>/dev/null \
        || rm -f "/tmp/results/$s-$tag.jsonl"
      timeout "${SWEEP_S:-590}" python3 -m specdec.cli sweep --dataset "$s" ${data:+--data $data} "${sweep[@]}" \
        --draft "" --drafters "${drafters[@]}" --tree-sizes "${trees[@]}" --methods "${methods[@]}" \
        --out "/tmp/results/$s-$tag.jsonl" >> "$out/$s-$tag.log" 2>&1
      # the records gzipped (a 15-MB file next to another one was once left out of what a call returns)
      cp /tmp/results/$s-$tag.{csv,summary.json,png} "$out/" 2>/dev/null
      gzip -c "/tmp/results/$s-$tag.jsonl" > "$out/$s-$tag.jsonl.gz" ;;
    setup)  # assemble and convert the staged models (scripts/device/setup_models.sh; ~170 s)
      bash scripts/device/setup_models.sh > "$out/setup.log" 2>&1 ;;
    medusa)  # Medusa heads for the full sweep (the full sweep), trained on MBPP into /tmp/medusa (unless there already);
             # a carried .evaldata/medusa_selfdistill.jsonl of the same settings spares the generation (~100 s)
      mkdir -p /tmp/medusa && [ -f /tmp/medusa/selfdistill.jsonl ] || [ "${FRESH:-0}" = 1 ] || cp .evaldata/medusa_selfdistill.jsonl \
        /tmp/medusa/selfdistill.jsonl 2>/dev/null || zcat "$cache/medusa.selfdistill.jsonl.gz" > /tmp/medusa/selfdistill.jsonl
      [ -f /tmp/medusa/medusa_heads.safetensors ] || timeout 500 python3 -m specdec.cli train-medusa \
        --data .evaldata/mbpp.jsonl --out /tmp/medusa --max-new-tokens 192 --gen-batch-size "${GEN:-120}" --steps 1000 \
        --no-progress > "$out/train_medusa.log" 2>&1
      cp /tmp/medusa/medusa_config.json /tmp/medusa/selfdistill.jsonl "$out/" 2>/dev/null ;;
    cascade)  # shared-prefix tree attention vs the unshared kernel and two SDPA calls (the 16-samples work)
      timeout 300 python3 -m treeattn.bench_cascade --out "$out/cascade.json" > "$out/cascade.log" 2>&1 ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
  echo "   rc=$? $(date +%T)" >> "$out/steps.log"
done
