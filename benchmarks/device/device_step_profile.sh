#!/usr/bin/env bash
# One decode step profiled on the H200 (issue 17, the "before" half of "a profile of one step, kernel
# count and time by kernel class, before and after"): `benchmarks/step_profile.py` on the bundled model
# with the shipped heads and the committed H200 profile, bf16, CUDA graphs (and eager steps beside them,
# `--runner both`), once with ELESIUM_INVARIANT_NUMERICS=on (the default on CUDA) and once off.
# Expects the model at $ELESIUM_MODEL (default /root/m/SmolLM2-135M-Instruct.Q4_1.gguf) and the wheels
# (gguf, pydantic, pydantic-core, typing-inspection, annotated-types, typing-extensions, llguidance) in
# $CARRY (default /root/whl). The model travelled as in device_invariant.sh: xz-compressed in two pieces
# (.model/z_00 with SHA256 and .whl in call 1, copied to /root/m and /root/whl; .model/z_01 in call 2,
# which unpacked the model, checked its sha256 and ran this script).
# Writes under $OUT: gpu.txt, step_profile_{on,off}.json|.log, summary.md, traces_on.tar (gzipped
# Chrome traces of the invariant-on run, for looking at single kernels later).
set -uo pipefail
CARRY=${CARRY:-/root/whl}
source "$(dirname "$0")/device_env.sh"
export ELESIUM_MODEL=${ELESIUM_MODEL:-/root/m/SmolLM2-135M-Instruct.Q4_1.gguf}
export ELESIUM_CACHE_DIR=/root/cache_step_profile
ARGS=${STEP_PROFILE_ARGS:---limit 3 --steps 20 --skip 4 --max-tokens 64 --runner both}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__)" | tee -a "$OUT/gpu.txt"
date -u +%FT%TZ | tee -a "$OUT/gpu.txt"

for inv in on off; do
  trace=""
  [ "$inv" = on ] && trace="--trace-dir /root/traces_$inv"
  echo "== invariant numerics $inv ($(date -u +%T))" | tee -a "$OUT/summary.md"
  # shellcheck disable=SC2086
  ELESIUM_INVARIANT_NUMERICS=$inv timeout ${STEP_S:-240} python3 -P benchmarks/step_profile.py $ARGS \
    --out "$OUT/step_profile_$inv.json" $trace 2>"$OUT/step_profile_$inv.log" | tee -a "$OUT/summary.md"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$OUT/summary.md"
  grep -v USDT "$OUT/step_profile_$inv.log" | tail -5
done
[ -d /root/traces_on ] && tar cf "$OUT/traces_on.tar" -C /root/traces_on .
ls -la "$OUT"
