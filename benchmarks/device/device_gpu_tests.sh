#!/usr/bin/env bash
# 2026-12-05: tests/test_gpu.py after the proposer / tree-chain refactor (294c9aa: tree_chain in decoding/,
# drafting through drafters/protocol.Proposer and runtime/drafting.StepDrafter), the device chain's
# exactness at production settings (Issue 41 item 2), and `elesium bench` on the current tree against the
# pre-refactor commit 69e4f35, alternating in one process tree on one machine.
#
# Back-to-back calls (a warm machine keeps /root for about 30 s after a call), STAGE picks the call:
#   here, once: PARTS=3 ../shared/device/split-model (.model/part_00..02, .model/SHA256); .whl holds the
#     wheels device_env.sh names; .old/old.tar.gz is `git archive 69e4f35 elesium inference kernels state
#     graphs api ':!inference/drafters/shipped'` (the shipped heads are unchanged since) and .old/whl-alt an
#     older llguidance (manylinux_2_28) in case 1.9.1's manylinux_2_31 build does not load.
#   STAGE=1, carry .model/part_00 .model/SHA256 .whl: stores them, then the model-free device tests
#     (`-k "$PYTEST_K1"`: the device chain's exactness at each setting and its negative control; skip: none).
#   STAGE=2, carry .model/part_01 .old: stores them.
#   STAGE=3, carry .model/part_02: assembles and checks the model, then `pytest -m gpu tests/test_gpu.py`
#     (optionally `-k "$PYTEST_K"`).
#   STAGE=4 (no carry): `elesium bench` at T = 0 on MT-Bench (--limit 20, 128 tokens), current tree and
#     69e4f35 alternating ROUNDS times; medians in bench_summary.md, the JSONs and logs in bench.tgz.
set -uo pipefail
STAGE=${STAGE:?STAGE=1..4}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/m /root/whl
M=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
here=$(cd "$(dirname "$0")" && pwd)
header() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__)"
  echo "date $(date -u +%FT%TZ)"
}
case $STAGE in
  1) cp .model/part_00 .model/SHA256 /root/m/ && cp .whl/*.whl /root/whl/ ;;
  2) cp .model/part_01 /root/m/ && mkdir -p /root/old /root/whl-alt && tar -xzf .old/old.tar.gz -C /root/old \
       && cp .old/whl-alt/*.whl /root/whl-alt/; ls /root/m /root/old; exit 0 ;;
  3) if [ ! -f "$M" ]; then cat /root/m/part_00 /root/m/part_01 .model/part_02 > "$M"; fi
     (cd /root/m && sha256sum -c SHA256) || { echo "model sha256 mismatch"; exit 3; } ;;
esac
CARRY=/root/whl
source "$here/device_env.sh"
if ! python3 -c "import llguidance, pydantic, gguf" 2>/dev/null && ls /root/whl-alt/*.whl >/dev/null 2>&1; then
  echo "llguidance 1.9.1 did not import: installing the manylinux_2_28 1.6.1"
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /root/whl-alt/*.whl
fi
export ELESIUM_MODEL=$M ELESIUM_INVARIANT_NUMERICS=on
pytest_run() {  # log name, timeout, -k expression (empty: the whole file)
  local log=$1 limit=$2 k=$3
  { header; echo "command: python3 -P -m pytest -m gpu tests/test_gpu.py -ra -s ${k:+-k \"$k\"}"; } >"$OUT/$log"
  ELESIUM_CACHE_DIR=/root/cache_pytest timeout "$limit" python3 -P -m pytest -m gpu tests/test_gpu.py -ra -s \
    -p no:cacheprovider --durations=30 ${k:+-k "$k"} >>"$OUT/$log" 2>&1
  echo "exit $?" >>"$OUT/$log"
  tail -3 "$OUT/$log"
}
case $STAGE in
  1) [ "${PYTEST_K1:-}" = skip ] || pytest_run pytest_gpu_exactness.log "${PYTEST_S:-330}" \
       "${PYTEST_K1:-on_device_are_exact_at_setting or device_chain_ignoring_temperature}" ;;
  3) pytest_run pytest_gpu.log "${PYTEST_S:-540}" "${PYTEST_K:-}" ;;
  4) source "$here/device_bench_ab.sh" ;;
esac
