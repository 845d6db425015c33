#!/usr/bin/env bash
# assemble and convert each model as soon as all its staged pieces are there (the 1.5B's 18, the 0.5B's 8)
export SPECDEC_HOME=/tmp/specdec-home PYTHONUNBUFFERED=1
L=/tmp/L; cd $REPO; t0=$(date +%s)
log() { echo "$(date +%T) +$(( $(date +%s) - t0 ))s setup: $*" >> $L/progress.log; }
log start
python3 -m pip install --no-deps -q .evaldata/wheels/*.whl > $L/pip.log 2>&1
for mp in qwen2.5-coder-1.5b:18 qwen2.5-coder-0.5b:8; do
  m=${mp%:*} n=${mp#*:}
  until [ $(ls /tmp/staged/parts/$m.gguf.part.* 2>/dev/null | wc -l) -ge $n ]; do
    [ $(( $(date +%s) - t0 )) -gt 1500 ] && { log "gave up waiting for $m"; exit 1; }; sleep 2; done
  sleep 3  # the last piece's copy finishing
  cat /tmp/staged/parts/$m.gguf.part.* > /tmp/staged/$m.gguf && rm -f /tmp/staged/parts/$m.gguf.part.*
  want=$(grep "$m.gguf" .ab/sums.txt 2>/dev/null | cut -d' ' -f1); got=$(sha256sum /tmp/staged/$m.gguf | cut -d' ' -f1)
  echo "$got $m" >> $L/staged.sha256
  [ -z "$want" ] || [ "$want" = "$got" ] || { log "$m: sha256 mismatch ($got, want $want)"; continue; }
  log "assembled $m (sha256 ${got:0:12})"
  mkdir -p $SPECDEC_HOME/models/$m && mv /tmp/staged/$m.gguf $SPECDEC_HOME/models/$m/
  python3 -m specdec.cli models fetch $m >> $L/convert.log 2>&1
  python3 -c "import sys, torch; from specdec import models; print(models.ensure_dtype_copy(sys.argv[1], torch.bfloat16))" $m >> $L/convert.log 2>&1
  log "converted $m rc=$?"; touch $L/$m.ok
done
touch $L/setup.done
