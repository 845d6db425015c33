#!/usr/bin/env bash
# On the device machine, after the staging calls (docs/DEVICE_RUNS.md): assemble the staged GGUF
# pieces in /tmp/staged, install the carried wheels (.evaldata/wheels), and convert both Qwen models
# into $SPECDEC_HOME (default /tmp/specdec-home), each with its bf16 copy of the weights. Writes sha256 sums and the conversion log to $OUT.
# Takes ~3 minutes of CPU; run it in the background (`... &`) next to GPU work.
# Arguments: the models to convert (default: both Qwen models; only those staged can be).
set -euo pipefail
export SPECDEC_HOME=${SPECDEC_HOME:-/tmp/specdec-home}
out=${OUT:-/tmp}
cd /tmp/staged
for b in $(ls parts | sed 's/\.part\.[0-9]*$//' | sort -u); do cat parts/"$b".part.* > "$b"; done
rm -rf parts
sha256sum /tmp/staged/*.gguf > "$out/staged.sha256"
cd - > /dev/null
python3 -m pip install --no-deps -q .evaldata/wheels/*.whl > "$out/pip.log" 2>&1  # not `pip`: another interpreter there
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(qwen2.5-coder-1.5b qwen2.5-coder-0.5b)
for m in "${models[@]}"; do
  mkdir -p "$SPECDEC_HOME/models/$m"
  mv "/tmp/staged/$m.gguf" "$SPECDEC_HOME/models/$m/"
  python3 -m specdec.cli models fetch "$m"
  # the bf16 copy the GPU runs load (specdec.models.ensure_dtype_copy; otherwise the first bf16 load writes it)
  python3 -c "import sys, torch; from specdec import models; print(models.ensure_dtype_copy(sys.argv[1], torch.bfloat16))" "$m"
done > "$out/convert.log" 2>&1
echo "converted into $SPECDEC_HOME" >> "$out/convert.log"
