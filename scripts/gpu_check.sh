#!/usr/bin/env bash
# The one prepared GPU command of issue 38 (README "On a GPU"): rlkv correctness on the demo model, then
# `python -m benchmarks --suite gpu` and `--suite serve` on random weights of Qwen2.5-7B's geometry, within
# GPU_CHECK_SECONDS (510) in all, the results under $OUT (6 files: gpu_check.log, gpu_correctness.md,
# bench_gpu.json/.md, bench_serve.json/.md).
#
#   ../shared/gpu/wheels.sh      # once per machine: the carried wheels in .whl/
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=560)
#   GPU_CHECK_DEVICE=cpu PYTHON=.venv/bin/python OUT=/tmp/x bash scripts/gpu_check.sh --quick   # CPU smoke
#
# A step that fails is logged and the next one still runs; the exit status is the first failure's.
set -u
NAME=gpu_check
DEVICE=${GPU_CHECK_DEVICE:-cuda}
TOTAL=${GPU_CHECK_SECONDS:-510}
source "$(dirname "$0")/gpu_common.sh"

# 1. correctness on the demo model (~1 min on a GPU: two compiled static-cache runs)
if [ "$(left)" -gt 200 ]; then
  step correctness 120 "$PY" scripts/gpu_correctness.py --device "$DEVICE" $QUICK --out "$OUT/gpu_correctness.md"
else
  log "correctness: skipped, $(left)s left"
fi

# 2. the gpu suite, leaving the serve suite ~150 s; 3. the serve suite with what is left
SERVE_S=150
GPU_S=$(($(left) - SERVE_S - 30))
if [ "$GPU_S" -gt 30 ]; then
  step gpu $((GPU_S + 60)) "$PY" -m benchmarks --suite gpu --device "$DEVICE" $QUICK --gpu-budget-s "$GPU_S" \
    --gpu-row-s 15 --out "$WORK/gpu"
  cp "$WORK/gpu/bench.json" "$OUT/bench_gpu.json" 2>/dev/null \
    || cp "$WORK/gpu/bench_gpu_rows.json" "$OUT/bench_gpu.json" 2>/dev/null  # the rows of a killed run
  cp "$WORK/gpu/bench.md" "$OUT/bench_gpu.md" 2>/dev/null
else
  log "gpu: skipped, ${GPU_S}s left for it"
fi
SERVE_S=$(($(left) - 15))
if [ "$SERVE_S" -gt 20 ]; then
  # rows of 4096 tokens as the suite's GPU default, with 256 new tokens (not 512) to fit this run
  step serve $((SERVE_S + 60)) "$PY" -m benchmarks --suite serve --device "$DEVICE" $QUICK \
    --serve-time-limit "$SERVE_S" --prompt-tokens 3840 --serve-tokens 256 --out "$WORK/serve"
  cp "$WORK/serve/bench.json" "$OUT/bench_serve.json" 2>/dev/null
  cp "$WORK/serve/bench.md" "$OUT/bench_serve.md" 2>/dev/null
else
  log "serve: skipped, ${SERVE_S}s left for it"
fi

finish "^\[(PASS|FAIL|N/A)|\| (PASS|FAIL) \|"
