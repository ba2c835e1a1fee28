#!/usr/bin/env bash
# Issue 18 on the H200: the eagle drafter tree (inference/drafters/drafter_tree.py) trained, then measured
# beside the shipped heads. Calls to one warm machine (device_model.sh: calls 1 and 2 carried the first two
# pieces of the model and the wheels; the first call of this script carries .model/z_02):
#   train   `train-heads --kind eagle`: distils into $W the first time (~3 minutes), then
#           trains the drafter unrolled over DEPTH levels, starting from the shipped heads' level-1 drafter,
#           until the call's time budget; a later `train` call resumes from $W/drafter_ckpt.pt (the same
#           command with --resume) on the same schedule. Each call scores the drafter as stored and writes
#           heads + manifest to $W and to $OUT/eagle.tgz.
#   bench   benchmarks/drafter_tree.py (vanilla, the shipped heads, the drafter tree at NODES) on MT-Bench
#           and the enterprise prompts at T in BENCH_TS, then `elesium bench --heads $W` on MT-Bench, and
#           the GPU tests in TESTS_K; PROFILE=1 also profiles one drafter-tree step (benchmarks/step_profile.py).
set -uo pipefail
CARRY=${CARRY:-/root/whl}
source "$(dirname "$0")/device_model.sh"
source "$(dirname "$0")/device_env.sh"
export ELESIUM_MODEL=$M ELESIUM_INVARIANT_NUMERICS=on
W=${WORK:-/root/eagle}
# INIT: the drafter to start from (the shipped heads' level-1 drafter, or the shipped eagle drafter to
# train further); STORAGE: the weights on disk (mixed, int8, ...); GEN_BATCH: the distillation's batch
# (1024 distils the 8,000 prompts in 178 s on the H200, 512 in 390 s).
INIT=${INIT:-inference/drafters/shipped/smollm2-135m-instruct}
CMD="train-heads --device cuda --kind eagle --num-heads ${DEPTH:-5} --init-drafter $INIT \
--drafter-steps ${STEPS:-4000} --drafter-batch ${BATCH:-32} --drafter-lr ${LR:-5e-4} --gen-batch ${GEN_BATCH:-1024} \
--storage ${STORAGE:-mixed} \
--eval-every ${EVAL_EVERY:-500} --ckpt-every 250 --eval-prompts $P --out $W --time-budget ${BUDGET:-500}"
case "$1" in
  train)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
    # A distillation file from an earlier session (DATA=path, carried) saves the ~6.5 minutes of distilling.
    if [ -n "${DATA:-}" ] && [ -f "$DATA" ] && [ ! -f "$W/distill.jsonl.gz" ]; then mkdir -p "$W" && cp "$DATA" "$W/distill.jsonl.gz"; fi
    resume=""; [ -f "$W/drafter_ckpt.pt" ] && resume="--resume"
    echo "start $(date -u +%FT%TZ): elesium $CMD $resume" | tee "$OUT/train.log"
    ELESIUM_CACHE_DIR=/root/cache_train $E $CMD $resume >"$OUT/train_full.log" 2>&1
    echo "exit $?" | tee -a "$OUT/train.log"
    tr '\r' '\n' <"$OUT/train_full.log" | grep -v "^\s*$" | grep -v "it/s\]$" | tail -40 | tee -a "$OUT/train.log"
    tr '\r' '\n' <"$OUT/train_full.log" | grep "it/s" | tail -2 | tee -a "$OUT/train.log"
    gzip -f "$OUT/train_full.log"
    echo "end $(date -u +%FT%TZ)" | tee -a "$OUT/train.log"
    tar czf "$OUT/eagle.tgz" -C "$W" manifest.json drafter.safetensors
    # KEEP_DATA=1: bring the distillation file back, so that a later session can train without distilling.
    if [ "${KEEP_DATA:-0}" = 1 ]; then cp "$W/distill.jsonl.gz" "$OUT/"; fi ;;
  bench)
    # A drafter trained in an earlier session (its machine gone) travels in the carry.
    if [ ! -f "$W/manifest.json" ] && [ -n "${EAGLE_DIR:-}" ]; then mkdir -p "$W" && cp "$EAGLE_DIR"/* "$W/"; fi
    source "$(dirname "$0")/device_bench_fns.sh"
    for t in ${BENCH_TS:-0 0.7}; do
      for set in ${SETS:-mt_bench_questions enterprise_prompts}; do
        echo "== drafter tree against the shipped heads and vanilla, $set, T=$t ($(date -u +%T))" | tee -a "$S"
        ELESIUM_CACHE_DIR=/root/cache_bench timeout ${TREE_S:-200} python3 -P benchmarks/drafter_tree.py \
          --heads "$W" --prompts tests/data/$set.jsonl --max-tokens 128 --nodes ${NODES:-32,48} --temperature "$t" \
          --out "$OUT/drafter_tree_${set}_t$t.json" ${TREE_ARGS:-} 2>"$OUT/drafter_tree_${set}_t$t.log" | tee -a "$S"
        echo "exit ${PIPESTATUS[0]}" | tee -a "$S"
      done
    done
    if [ "${BENCHES:-1}" = 1 ]; then
      for t in ${BENCH_TS:-0 0.7}; do
        bench "eagle_t${t}_mt_bench" ${BENCH_S:-100} tests/data/mt_bench_questions.jsonl --temperature "$t" --heads "$W"
      done
    fi
    if [ "${PROFILE:-0}" = 1 ]; then  # one drafter-tree step profiled (kernels by class; BENCHMARKS §6c's table)
      echo "== step profile, the drafter tree ($(date -u +%T))" | tee -a "$S"
      ELESIUM_CACHE_DIR=/root/cache_bench timeout ${PROFILE_S:-150} python3 -P benchmarks/step_profile.py --heads "$W" \
        --runner graphs --out "$OUT/step_profile.json" >"$OUT/step_profile.log" 2>&1
      echo "exit $?" | tee -a "$S"; grep -v "^\s*$" "$OUT/step_profile.log" | tail -30 | tee -a "$S"
    fi
    if [ -n "${TESTS_K:-}" ]; then
      echo "== pytest -m gpu tests/test_gpu.py -k '$TESTS_K' ($(date -u +%T))" | tee -a "$S"
      ELESIUM_CACHE_DIR=/root/cache_pytest timeout ${PYTEST_S:-200} python3 -P -m pytest -m gpu tests/test_gpu.py -ra -q \
        -p no:cacheprovider --durations=8 -k "$TESTS_K" >"$OUT/pytest_gpu.log" 2>&1
      echo "exit $?; $(tail -1 "$OUT/pytest_gpu.log")" | tee -a "$S"
    fi
    echo "end $(date -u +%FT%TZ)" | tee -a "$S"
    # One logs archive per summary, so that two bench runs in one call (SUMMARY=...) keep both.
    name=$(basename "$S" .md); (cd "$OUT" && tar czf "logs_$name.tar.gz" ./*.log "$name.md" && rm -f ./*.log)
    cat "$S" ;;
  *) echo "usage: $0 train|bench" >&2; exit 2 ;;
esac
