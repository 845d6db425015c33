#!/usr/bin/env bash
# On a 2-GPU device machine (kind nvidia-h200-x2): a tensor-parallel target (TP = 2, NCCL, transformers'
# TP plan, specdec.distributed.RankSync) against the same target on one GPU. The GPU half of the two-GPU tensor-parallel check.
#   bash scripts/device/multigpu.sh [build|llama|llama-bf16|forward|tp-bf16|qwen|sharded-humaneval|sharded-apps|sweep-note]...   (default: build llama qwen)
# Steps (each fits one device call; files in /tmp survive only while the machine stays warm):
#   build       random-weight Llama-3-8B shapes (hidden 4096, 32 heads / 8 KV heads, vocab 128256),
#               LAYERS layers (default 32, the real depth: 32 GB fp32 on disk; LAYERS=8 if time is
#               short -- every per-layer shape is unchanged), saved to /tmp/mg/llama8b in DTYPE (fp32;
#               bf16 for the speed steps only: 16 GB).
#   llama       (a) greedy fp32, plain decoding and prompt lookup (t=32), bs 1: one GPU, then TP=2;
#               outputs must be identical; tokens/s side by side.
#   llama-bf16  the same in bf16 (speed only: bf16 rounds differently in a sharded matmul).
#   qwen        (b) the real pair (after setup_models.sh): Qwen2.5-Coder-1.5B target, 0.5B draft, fp32,
#               plain decoding, prompt lookup and the draft model (replicated per rank), one GPU vs TP=2;
#               QWEN="model" (or any of plain lookup model) runs only those pairs.
#   forward     the captured verify forward at 1, 16, 64 nodes, bf16, compiled: one GPU, then TP=2 with
#               push all-reduces, one-shot all-reduces (where they work) and NCCL only (after build;
#               ONE_SHOT="push auto off" picks which; INDUCTOR="max_autotune_gemm=True" tries inductor settings,
#               files named -tuned).
#   tp-bf16     plain decoding, bf16, compiled, 3 prompts x 256 tokens: one GPU, then TP=2 (after build);
#               a profiler table of one call of each (tp-bf16-trace-world{1,2}.txt); TP_ALLREDUCE=push (or
#               off) for the TP run's small all-reduces (default: one-shot where they work); DECODE_CHUNK=k
#               plain-decoding steps per replay in both runs (default 8; at TP each chunk checks one token
#               fingerprint across the ranks: specdec/PERF.md v34); TAG= a suffix of the file names, for
#               runs under other environment settings (e.g. CUBLASLT_WORKSPACE_SIZE=0: cuBLASLt without a
#               workspace picks no split-K GEMMs, whose reduce kernels v34 counts at TP widths).
#   sharded-humaneval, sharded-apps
#               (c) the evaluation sharded over 2 GPUs (data parallel, `sweep --shard auto` under torchrun,
#               merged by `--report-only --shards 2`) against one GPU on the same problems: plain decoding
#               and prompt lookup (t=32; TREES="32 64" for more tree sizes: a longer sweep, where each process's
#               fixed load weighs less), bf16, 128 tokens; wall times and a token comparison per record.
# Every TP run goes with CUDA graphs first (the NCCL all-reduces captured in the tree forward's graph);
# if that fails it is rerun eagerly (SPECDEC_CUDA_GRAPHS=0) and the log says so.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # no NVLink multicast (KINDS.md); one-shot all-reduces need only peer loads
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home}
out=${OUT:-/tmp}
mg=/tmp/mg
mkdir -p "$mg"
py=(python3 scripts/device/multigpu.py)
tp=(timeout 300 torchrun --standalone --nproc-per-node 2 scripts/device/multigpu.py)

pair() {  # name, run args...: one GPU, then TP=2 (graphs, else eager), then the comparison
  local name=$1; shift
  CUDA_VISIBLE_DEVICES=0 timeout 400 "${py[@]}" run "$@" --out "$out/$name-1gpu.json" >> "$out/$name.log" 2>&1 \
    || echo "$name: the one-GPU run failed (exit $?)" >> "$out/$name.log"
  rm -f "$out/$name-tp2.json"
  "${tp[@]}" run "$@" --out "$out/$name-tp2.json" >> "$out/$name.log" 2>&1 \
    || echo "$name: the TP=2 run exited $? (its results are kept if it wrote them)" >> "$out/$name.log"
  if [ ! -f "$out/$name-tp2.json" ]; then
    echo "$name: TP=2 with CUDA graphs wrote nothing; rerunning eagerly (SPECDEC_CUDA_GRAPHS=0)" >> "$out/$name.log"
    SPECDEC_CUDA_GRAPHS=0 "${tp[@]}" run "$@" --cuda-graphs off --out "$out/$name-tp2.json" >> "$out/$name.log" 2>&1 \
      || echo "$name: the eager TP=2 run failed too (exit $?)" >> "$out/$name.log"
  fi
  "${py[@]}" compare "$out/$name-1gpu.json" "$out/$name-tp2.json" >> "$out/$name.log" 2>&1
  tail -3 "$out/$name.log"
}

for s in ${@:-build llama qwen}; do
  case $s in
    build)
      [ -f $mg/llama8b/config.json ] || timeout 560 "${py[@]}" build --layers "${LAYERS:-32}" --dtype "${DTYPE:-fp32}" --out $mg/llama8b \
        > "$out/build.log" 2>&1
      tail -2 "$out/build.log"; du -sh $mg/llama8b ;;
    llama)
      pair llama-plain --model $mg/llama8b --new 128 --num-prompts 3
      pair llama-lookup --model $mg/llama8b --drafter lookup --tree-size 32 --new 128 --num-prompts 3 ;;
    llama-bf16)
      pair llama-bf16 --model $mg/llama8b --dtype bf16 --new 128 --num-prompts 3 ;;
    qwen)
      t=$SPECDEC_HOME/models/qwen2.5-coder-1.5b/hf d=$SPECDEC_HOME/models/qwen2.5-coder-0.5b/hf
      [ -f "$t/config.json" ] || { echo "qwen: no converted target in $t (run setup_models.sh first)"; continue; }
      data=(); [ -f .evaldata/apps_selected150.jsonl ] && data=(--prompts-file .evaldata/apps_selected150.jsonl)
      for q in ${QWEN:-plain lookup model}; do  # fp32 on an H200: ~2 min a pair (33 ms a token, a ~55-s warm-up)
        case $q in
          plain) pair qwen-plain --model "$t" --tokenizer "${data[@]}" --new 128 --num-prompts 3 ;;
          lookup) pair qwen-lookup --model "$t" --tokenizer "${data[@]}" --drafter lookup --tree-size 32 --new 128 --num-prompts 3 ;;
          model) pair qwen-model --model "$t" --tokenizer "${data[@]}" --drafter model --draft "$d" --tree-size 32 --new 128 --num-prompts 3 ;;
          *) echo "qwen: unknown pair $q (plain, lookup, model)" >&2 ;;
        esac
      done ;;
    forward)
      CUDA_VISIBLE_DEVICES=0 timeout 300 "${py[@]}" forward --model $mg/llama8b --compile ${INDUCTOR:+--inductor $INDUCTOR} \
        --out "$out/forward-1gpu${INDUCTOR:+-tuned}.json" \
        > "$out/forward${INDUCTOR:+-tuned}.log" 2>&1 || echo "forward: the one-GPU run failed (exit $?)" >> "$out/forward${INDUCTOR:+-tuned}.log"
      for os in ${ONE_SHOT:-push auto off}; do  # push all-reduces, one-shot ones where they work, NCCL only
        timeout 240 torchrun --standalone --nproc-per-node 2 scripts/device/multigpu.py forward --model $mg/llama8b \
          --compile --one-shot $os ${INDUCTOR:+--inductor $INDUCTOR} --out "$out/forward-tp2-$os${INDUCTOR:+-tuned}.json" >> "$out/forward${INDUCTOR:+-tuned}.log" 2>&1 \
          || echo "forward: the TP=2 run (one-shot $os) exited $?" >> "$out/forward${INDUCTOR:+-tuned}.log"
      done
      grep -E "nodes|failed" "$out/forward${INDUCTOR:+-tuned}.log" ;;
    tp-bf16)
      tag=tp-bf16${TP_ALLREDUCE:+-$TP_ALLREDUCE}${DECODE_CHUNK:+-chunk$DECODE_CHUNK}${TAG:+-$TAG}
      pair $tag --model $mg/llama8b --dtype bf16 --compile --new 256 --num-prompts 3 --trace "$out/$tag-trace.txt" \
        ${TP_ALLREDUCE:+--one-shot $TP_ALLREDUCE} ${DECODE_CHUNK:+--decode-chunk $DECODE_CHUNK} ;;
    sharded-humaneval|sharded-apps)
      ds=${s#sharded-}
      data=(); [ "$ds" = apps ] && data=(--data .evaldata/apps_selected150.jsonl)
      common=(sweep --dataset "$ds" "${data[@]}" --problems 0 --max-new-tokens 128 --seed 0 --dtype bf16 --device cuda
              --no-progress --no-attn --methods specdec specdec-plain --drafters l=lookup --tree-sizes ${TREES:-32} --draft ""
              --method-problems hf=0 --calibrate 0)
      mkdir -p /tmp/results; rm -f /tmp/results/$ds-1gpu.* /tmp/results/$ds-dp2.*
      t0=$(date +%s.%N)
      CUDA_VISIBLE_DEVICES=0 timeout 400 python3 -m specdec.cli "${common[@]}" --out /tmp/results/$ds-1gpu.jsonl \
        > "$out/sharded-$ds.log" 2>&1
      t1=$(date +%s.%N)
      timeout 400 torchrun --standalone --nproc-per-node 2 -m specdec.cli "${common[@]}" --shard auto \
        --out /tmp/results/$ds-dp2.jsonl >> "$out/sharded-$ds.log" 2>&1
      t2=$(date +%s.%N)
      python3 -m specdec.cli "${common[@]}" --report-only --shards 2 --out /tmp/results/$ds-dp2.jsonl \
        >> "$out/sharded-$ds.log" 2>&1
      "${py[@]}" same-tokens /tmp/results/$ds-1gpu.jsonl /tmp/results/$ds-dp2.rank*-of-2.jsonl \
        --out "$out/sharded-$ds-same.json" >> "$out/sharded-$ds.log" 2>&1
      echo "sharded-$ds: one GPU $(python3 -c "print(round($t1 - $t0, 1))") s, 2 GPUs $(python3 -c "print(round($t2 - $t1, 1))") s" | tee -a "$out/sharded-$ds.log"
      cp /tmp/results/$ds-dp2.{csv,summary.json} "$out/" 2>/dev/null
      gzip -c /tmp/results/$ds-1gpu.jsonl > "$out/$ds-1gpu.jsonl.gz"; tail -2 "$out/sharded-$ds-same.json" ;;
    sweep-note)
      # (c) Sharded APPS sweep. Data parallel (one whole model per GPU): `--shard auto` reads each
      #     process's place from torchrun's RANK / WORLD_SIZE (eval.shard.shard_env), runs only its
      #     problems (eval.shard.shard, by problem id) on cuda:$LOCAL_RANK into
      #     OUT.rank{R}-of-{W}.jsonl (eval.shard.shard_path), resuming from that file, and prints its
      #     partial table; `--report-only --shards 2` then merges both files (eval.shard.merge) and
      #     writes the single table / CSV / summary / plot next to OUT. The report takes the same
      #     settings flags as the run (they only label it). A TP target is not wired into the sweep.
      cat <<'EOF'
torchrun --standalone --nproc-per-node 2 -m specdec.cli sweep --dataset apps --problems 150 \
  --data .evaldata/apps_selected150.jsonl --tree-sizes 32 64 128 256 --drafter model --methods hf-static specdec \
  --dtype bf16 --device cuda --seed 0 --out /tmp/results/apps-dp2.jsonl --no-attn --shard auto
python3 -m specdec.cli sweep --report-only --dataset apps --problems 150 \
  --data .evaldata/apps_selected150.jsonl --tree-sizes 32 64 128 256 --drafter model --methods hf-static specdec \
  --dtype bf16 --device cuda --seed 0 --out /tmp/results/apps-dp2.jsonl --shards 2
EOF
      ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
  echo "step $s done"
done
