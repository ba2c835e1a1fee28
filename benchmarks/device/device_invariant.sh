#!/usr/bin/env bash
# Shape-invariant numerics on the H200 (issue 17): the GPU test file, then `elesium bench` on MT-Bench
# (80 prompts x 128 tokens, T = 0, bf16, CUDA graphs) with invariant numerics on and off, one after the
# other in the same call. Expects the model at $ELESIUM_MODEL and the wheels (gguf, pydantic, pydantic-core,
# typing-inspection, annotated-types, typing-extensions, llguidance) in $CARRY. The wheels (5.8 MB) and the
# tree (12.9 MB) leave too little room beside a plain half of the 98 MB model, so the model travelled
# xz-compressed (90.5 MB) in two pieces: `xz -6 < model > m.xz; head -c 43000000 m.xz > .model/z_00;
# tail -c +43000001 m.xz > .model/z_01`; call 1 carried z_00, SHA256 and .whl, call 2 z_01 and ran
# `cat /root/m/z_00 .model/z_01 | python3 -c 'import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.stdin.buffer),
# open("/root/m/SmolLM2-135M-Instruct.Q4_1.gguf","wb"))' && (cd /root/m && sha256sum -c SHA256)` before this script.
set -uo pipefail
CARRY=${CARRY:-/root/whl}
source "$(dirname "$0")/device_env.sh"
P=tests/data/mt_bench_questions.jsonl
R=/root/results_invariant; mkdir -p $R
export ELESIUM_CACHE_DIR=/root/cache_invariant
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
date -u +%FT%TZ | tee -a "$OUT/gpu.txt"

timeout ${PYTEST_S:-240} python3 -P -m pytest -m gpu tests/test_gpu.py -ra -s -q -p no:cacheprovider \
  --durations=12 2>&1 | tee "$OUT/pytest_gpu.log"

# The bench command through its module: `elesium.cli` imports every subcommand, some of them langgraph,
# which the device lacks (and the bench does not need).
BENCH="import argparse, sys; from elesium.cli.commands import bench; p = argparse.ArgumentParser(); \
bench.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))"
for inv in on off; do
  date -u +%FT%TZ | tee -a "$OUT/summary.txt"
  echo "== invariant numerics $inv" | tee -a "$OUT/summary.txt"
  ELESIUM_INVARIANT_NUMERICS=$inv timeout ${BENCH_S:-250} python3 -P -c "$BENCH" bench --prompts "$P" --max-tokens 128 \
    --out "$R/inv-$inv" 2>"$OUT/bench_$inv.log" >>"$OUT/summary.txt"
  tail -3 "$OUT/bench_$inv.log" >>"$OUT/summary.txt"
  cp "$R/inv-$inv/bench.json" "$OUT/bench_$inv.json" 2>/dev/null
done
python3 - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print("invariant | identical/80 | vanilla ms/token | speculative ms/token | speedup | tau")
for inv in ("on", "off"):
    p = out / f"bench_{inv}.json"
    if not p.exists():
        print(f"{inv} | (no bench.json)")
        continue
    d = json.loads(p.read_text())
    s = d.get("speculative", {})
    print(inv, "|", d.get("identical_outputs"), "|", d["vanilla"].get("ms_per_token"), "|", s.get("ms_per_token"),
          "|", d.get("speedup"), "|", s.get("mean_accepted"))
EOF
