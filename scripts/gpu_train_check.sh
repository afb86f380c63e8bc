#!/usr/bin/env bash
# The prepared GPU command of issue 40 (README "Gate training on a GPU"), separate from issue 38's
# scripts/gpu_check.sh so each fits a 15-minute device session: within GPU_TRAIN_CHECK_SECONDS (270)
#   1. `python -m benchmarks --suite gpu-train`: one GRPO gate-training step on random weights of Qwen2.5-7B's
#      geometry, its parts, plain and compressed-rollout steps side by side (gets all the time the
#      other steps do not need; the suite lowers the completion length to fit and says so);
#   2. the rollout memory report on the demo model (resident KV, peak allocated, importance-sampling ratio), on
#      the dynamic cache; the same on the static-shape cache (compiled, CUDA graphs) after step 3 if time is left;
#   3. one-process FSDP2 (recipes/accelerate/fsdp_one_gpu.yaml): one GRPO step with a checkpoint, then a
#      resume from it to step 2;
#   4. `scripts/demo.py --smoke --device cuda` (curriculum, training, evaluation on the GPU), if time is left.
# Results under $OUT (at most 7 files: gpu_train_check.log, bench_gpu_train.json/.md, rollout_memory.json,
# rollout_memory_static.json, fsdp_one_gpu.log, demo_cuda_report.md).
#
#   ../shared/gpu/wheels.sh      # once per machine: the carried wheels in .whl/
#   run(command="bash scripts/gpu_train_check.sh", carry=[".whl"], timeout_s=330)
#   GPU_TRAIN_CHECK_DEVICE=cpu PYTHON=.venv/bin/python OUT=/tmp/x bash scripts/gpu_train_check.sh --quick  # CPU smoke
#
# On CPU (the smoke) step 3 runs the same step + resume with recipes/accelerate/single_process.yaml, since
# accelerate runs FSDP only on GPUs (train_gates.py refuses the FSDP config there).
# A step that fails is logged and the next one still runs; the exit status is the first failure's.
set -u
NAME=gpu_train_check
DEVICE=${GPU_TRAIN_CHECK_DEVICE:-cuda}
TOTAL=${GPU_TRAIN_CHECK_SECONDS:-270}
STEP_TAIL=60
source "$(dirname "$0")/gpu_common.sh"
if [ "$DEVICE" != "cpu" ]; then
  FSDP_CONFIG=recipes/accelerate/fsdp_one_gpu.yaml USE_CPU=false STEP_S=60
else
  FSDP_CONFIG=recipes/accelerate/single_process.yaml USE_CPU=true STEP_S=180
fi
# the smoke's sizes: seconds on a loaded 2-core CPU
MEMORY_SIZE=(--max-new-tokens 128 --batch-size 16 --kv-cap-mib 8)
TRAIN_SIZE=(--dataset_num 32 --per_device_train_batch_size 8)
if [ -n "$QUICK" ]; then
  MEMORY_SIZE=(--max-new-tokens 24 --batch-size 2 --kv-cap-mib 0.25)
  TRAIN_SIZE=(--dataset_num 4 --per_device_train_batch_size 4 --max_completion_length 8)
fi
"$PY" -c "import trl; print('trl', trl.__version__)" 2>&1 | tee -a "$LOG"

# 1. the gpu-train suite, leaving ~100 s to steps 2-3 (step 4 runs only if the suite finished early)
BENCH_S=$(($(left) - 100))
if [ "$BENCH_S" -gt 30 ]; then
  step gpu-train $((BENCH_S + 60)) "$PY" -m benchmarks --suite gpu-train --device "$DEVICE" $QUICK \
    --train-budget-s "$BENCH_S" --out "$WORK/gpu-train"
  cp "$WORK/gpu-train/bench.json" "$OUT/bench_gpu_train.json" 2>/dev/null
  cp "$WORK/gpu-train/bench.md" "$OUT/bench_gpu_train.md" 2>/dev/null
else
  log "gpu-train: skipped, ${BENCH_S}s left for it"
fi

# 2. compressed rollouts on the demo model: resident KV, peak allocated, importance-sampling ratio
MEMORY=("$PY" -m benchmarks.memory.rollout --model assets/demo-model --device "$DEVICE" --sparsity 0.5 --sink 16
  --window 64 "${MEMORY_SIZE[@]}")
step rollout-memory "$STEP_S" "${MEMORY[@]}" --rollout-cache dynamic --out "$OUT/rollout_memory.json"

# 3. one GRPO step under the one-process FSDP2 config with a checkpoint, then a resume to step 2
TRAIN=("$PY" -m accelerate.commands.launch --config_file "$FSDP_CONFIG" train_gates.py --config recipes/demo.yaml
  --dataset_name chain "${TRAIN_SIZE[@]}" --use_cpu "$USE_CPU" --save_steps 1 --output_dir "$WORK/fsdp")
{
  step fsdp-step "$STEP_S" "${TRAIN[@]}" --max_steps 1 --overwrite_output_dir true
  step fsdp-resume "$STEP_S" "${TRAIN[@]}" --max_steps 2 --resume_from_checkpoint true
  ls "$WORK/fsdp" "$WORK/fsdp/checkpoint-2" 2>&1
  grep -h '"global_step"' "$WORK/fsdp"/checkpoint-*/trainer_state.json 2>&1
} > "$OUT/fsdp_one_gpu.log" 2>&1
tail -n 8 "$OUT/fsdp_one_gpu.log" | tee -a "$LOG"

# 2b. the same report on the static-shape cache (compiled per batch size: slower to start), if time is left
if [ "$(left)" -gt 150 ]; then
  step rollout-memory-static "$STEP_S" "${MEMORY[@]}" --rollout-cache static --out "$OUT/rollout_memory_static.json"
else
  log "rollout-memory-static: skipped, $(left)s left"
fi

# 4. the embedded pipeline on the device (smoke setting), if time is left
if [ "$(left)" -gt 90 ]; then
  step demo $(($(left) - 10)) "$PY" scripts/demo.py --smoke --device "$DEVICE" --out "$WORK/demo"
  cp "$WORK/demo/eval/report.md" "$OUT/demo_cuda_report.md" 2>/dev/null
else
  log "demo: skipped, $(left)s left (run: python3 scripts/demo.py --smoke --device cuda)"
fi

finish "^\[(PASS|FAIL|n/a)"
