#!/usr/bin/env bash
# 2026-12-06: the gpu-marked tests after the engine changes of 2026-12-05/06, the first GPU run of the ragged
# kernel's gpu-marked test (tests/test_ragged_attention.py), and benchmarks/gpu/ragged_attention_device.py
# (its bitwise check and decode-batch timings). device_gpu_tests.sh's recipe (three back-to-back calls, the
# model in three parts: a warm machine keeps /root for about 30 s after a call), STAGE picks the call:
#   here, once: PARTS=3 ../shared/device/split-model (.model/part_00..02, .model/SHA256); .whl holds the
#     wheels device_env.sh names.
#   STAGE=1, carry .model/part_00 .model/SHA256 .whl: stores them, then the model-free work:
#     `pytest -m gpu tests/test_ragged_attention.py` in its own process (the file sets TRITON_INTERPRET=1
#     at import, which makes test_gpu.py skip every test in a shared session), then the ragged script.
#   STAGE=2, carry .model/part_01: stores it.
#   STAGE=3, carry .model/part_02: assembles and checks the model, then `pytest -m gpu tests/test_gpu.py`
#     alone (optionally `-k "$PYTEST_K"`), then (COMBINED=1, the default) the two files in one pytest
#     session as asked, under a short timeout, to record what a shared session does.
set -uo pipefail
STAGE=${STAGE:?STAGE=1..3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/m /root/whl
M=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
here=$(cd "$(dirname "$0")" && pwd)
header() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__)"
  echo "date $(date -u +%FT%TZ) checkout $(git rev-parse --short HEAD 2>/dev/null) (+ working tree)"
}
case $STAGE in
  1) cp .model/part_00 .model/SHA256 /root/m/ && cp .whl/*.whl /root/whl/ ;;
  2) cp .model/part_01 /root/m/; ls -l /root/m; exit 0 ;;
  3) if [ ! -f "$M" ]; then cat /root/m/part_00 /root/m/part_01 .model/part_02 > "$M"; fi
     (cd /root/m && sha256sum -c SHA256) || { echo "model sha256 mismatch"; exit 3; } ;;
esac
CARRY=/root/whl
source "$here/device_env.sh"
export ELESIUM_INVARIANT_NUMERICS=on
pytest_run() {  # log name, timeout, files, -k expression (empty: all gpu-marked tests of the files)
  local log=$1 limit=$2 files=$3 k=$4
  { header; echo "command: python3 -P -m pytest -m gpu $files -ra -s -p no:cacheprovider --durations=30" \
      "${k:+-k \"$k\"}"; } >"$OUT/$log"
  # shellcheck disable=SC2086  # $files is a list of paths
  ELESIUM_CACHE_DIR=/root/cache_pytest timeout "$limit" python3 -P -m pytest -m gpu $files -ra -s \
    -p no:cacheprovider --durations=30 ${k:+-k "$k"} >>"$OUT/$log" 2>&1
  echo "exit $?" >>"$OUT/$log"
  tail -3 "$OUT/$log"
}
case $STAGE in
  1) pytest_run pytest_gpu_ragged.log "${RAGGED_TEST_S:-240}" tests/test_ragged_attention.py ""
     { header; echo "command: python3 -P benchmarks/gpu/ragged_attention_device.py \$OUT/ragged_attention.json"; } \
       >"$OUT/ragged_attention.log"
     timeout "${RAGGED_S:-240}" python3 -P benchmarks/gpu/ragged_attention_device.py "$OUT/ragged_attention.json" \
       >>"$OUT/ragged_attention.log" 2>&1
     echo "exit $?" >>"$OUT/ragged_attention.log"
     tail -6 "$OUT/ragged_attention.log" ;;
  3) export ELESIUM_MODEL=$M
     pytest_run pytest_gpu.log "${PYTEST_S:-420}" tests/test_gpu.py "${PYTEST_K:-}"
     if [ "${COMBINED:-1}" = 1 ]; then
       pytest_run pytest_gpu_combined.log "${COMBINED_S:-120}" "tests/test_gpu.py tests/test_ragged_attention.py" ""
     fi ;;
esac
