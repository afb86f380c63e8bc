# Shared by the prepared GPU commands (scripts/gpu_check.sh, scripts/gpu_train_check.sh); source it after
# setting NAME (the log's name), DEVICE, TOTAL (seconds for the whole command) and, optionally, STEP_TAIL
# (lines of each step's output echoed to the terminal; all of it goes to the log).
# Sets PY, QUICK, START, WORK, LOG, STATUS and the functions left / log / step; on a GPU machine it
# installs the carried wheels (../shared/gpu/README.md) and records the card.
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the folder for the results}"
QUICK=""
if [ "${1:-}" = "--quick" ]; then QUICK="--quick"; fi
START=$(date +%s)
WORK=$(mktemp -d)
LOG="$OUT/$NAME.log"
mkdir -p "$OUT"
: > "$LOG"
STATUS=0
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

left() { echo $((TOTAL - ($(date +%s) - START))); }
log() { echo "[$NAME $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
step() {  # step NAME SECONDS COMMAND...: run with a hard time limit, output into the log
  local name=$1 limit=$2
  shift 2
  log "$name: up to ${limit}s: $*"
  timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee -a "$LOG" | tail -n "${STEP_TAIL:-+1}"
  local rc=${PIPESTATUS[0]}
  log "$name: exit $rc"
  if [ "$rc" -ne 0 ] && [ "$STATUS" -eq 0 ]; then STATUS=$rc; fi
}

if [ "$DEVICE" != "cpu" ]; then  # the GPU machine: newer transformers & co. from the carried wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 || exit 3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
else
  export PYTHONPATH=$PWD
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  2>&1 | tee -a "$LOG"

finish() {  # finish REGEX: log the report lines matching REGEX (the targets' verdicts), the files, and exit
  log "verdicts:"
  grep -h -E "$1" "$OUT"/*.md 2>/dev/null | tee -a "$LOG"
  log "done in $(($(date +%s) - START))s, exit $STATUS; files: $(ls "$OUT" | tr '\n' ' ')"
  rm -rf "$WORK"
  exit "$STATUS"
}
