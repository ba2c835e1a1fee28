# Sourced by device scripts: the bundled model in back-to-back calls (a warm machine keeps /root for about
# 30 s after a call), then device_env.sh. Here, once: PARTS=4 ../shared/device/split-model, and .whl/ holding
# the wheels device_env.sh names plus mt_bench_questions.jsonl. Four parts since 2026-12-07: the tracked tree
# (33 MB) and a third of the model were over the 64 MiB a call carries.
#   STAGE=1, carry .model/part_00 .model/SHA256: stores them, returns (the caller may run model-free work)
#   STAGE=2, carry one more part, and .whl once (with part_01): stores what it got and exits
#   STAGE=3, carry the last part: assembles the parts in order, checks the model, exports ELESIUM_MODEL
# After sourcing: $M (the model path), $OUT, $E, $P, PYTHONPATH (device_env.sh), and header() for logs.
STAGE=${STAGE:?STAGE=1..3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /root/m /root/whl
M=/root/m/SmolLM2-135M-Instruct.Q4_1.gguf
store_parts() { for f in .model/part_*; do [ -f "$f" ] && cp "$f" /root/m/; done; return 0; }
case $STAGE in
  1) rm -f "$M" /root/m/part_*; cp .model/part_00 .model/SHA256 /root/m/ ;;
  2) store_parts; [ -d .whl ] && cp .whl/* /root/whl/; ls -l /root/m; exit 0 ;;
  3) if [ ! -f "$M" ]; then store_parts; cat /root/m/part_* > "$M.part" && mv "$M.part" "$M"; fi
     (cd /root/m && sha256sum -c SHA256) || { echo "model sha256 mismatch"; rm -f "$M"; exit 3; }
     export ELESIUM_MODEL=$M ;;
esac
header() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__)"
  echo "date $(date -u +%FT%TZ) checkout $(git rev-parse --short HEAD 2>/dev/null) (+ working tree)"
}
CARRY=/root/whl
# shellcheck source=/dev/null
source "$(dirname "${BASH_SOURCE[0]}")/device_env.sh"
