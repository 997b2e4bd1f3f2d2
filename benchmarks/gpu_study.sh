#!/usr/bin/env bash
# The GPU study (examples/gpu-llama8b.yaml) and the GPU test tier on the GPU test machine.
#
#   bash benchmarks/gpu_study.sh stage        here (CPU machine): build .gpu/ with vLLM 0.26.0,
#                                             its deps and benchmarks/gpu-requirements.txt
#   bash benchmarks/gpu_study.sh run          there: unpack, run the study, write $OUT
#   bash benchmarks/gpu_study.sh tests        there: unpack, run `pytest -m gpu tests/gpu`
#   bash benchmarks/gpu_study.sh exec CMD...  there: unpack, run CMD (e.g. a benchmark)
#
# The GPU machine has no network and forgets everything ~30 s after a command: send .gpu/bin and
# one chunk .gpu/cK per transfer, back to back (../shared/gpu/README.md); the last transfer runs
# `run` or `tests` (each ends within 10 minutes). Every step runs install-on-gpu.sh first, which
# does nothing once /tmp/site is unpacked.
#
# What comes back under $OUT (at most 8 files): tune.log, summary.json (one record per trial),
# show.txt (status and Pareto tables), study.tar.gz (the whole study folder: Optuna SQLite
# storage, plan.json, every trial's result.json, engine.log and records), gpu-mem.csv (nvidia-smi
# every second, per GPU index: memory and utilization across trials), env.txt, ray-logs.tar.gz,
# show.json (`show --json`: every trial, the front, the capacity answer).
set -uo pipefail
MODE="${1:-run}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

if [ "$MODE" = stage ]; then
  # smac and pynisher (the default sampler's) publish no wheel and the staging fetches wheels
  # only: build them (pure Python) into its cache, where pip finds them.
  WHEELS="${STAGE_CACHE:-$HOME/.cache/gpu-stage}/wheels"
  mkdir -p "$WHEELS"
  NO_WHEEL=$(grep -E '^(smac|pynisher)==' benchmarks/gpu-requirements.txt)
  python3 -m pip wheel -q --no-deps -w "$WHEELS" $NO_WHEEL || exit 1
  PIP_FIND_LINKS="$WHEELS" exec bash "${STAGE_SH:-$ROOT/../shared/gpu/stage.sh}" \
    benchmarks/gpu-requirements.txt
fi

OUT="${OUT:-$ROOT/.gpu/out}"
mkdir -p "$OUT"
bash .gpu/bin/install-on-gpu.sh || exit 1
[ -f /tmp/site/.ready ] || { echo "gpu_study: /tmp/site not complete; send the other chunks"; exit 3; }

export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_USE_FLASHINFER_SAMPLER=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# Ray's memory monitor reads the VM's MemTotal, which starts far below the real limit on this
# machine (KINDS.md): it would kill the trial actor while vLLM loads. The servers' memory is not
# Ray's to manage here.
export RAY_memory_monitor_refresh_ms=0

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
  python3 - <<'EOF'
import importlib.metadata as md, sys
print("python", sys.version.split()[0], sys.executable)
for d in ("vllm", "torch", "ray", "optuna", "sqlalchemy", "pydantic", "httpx", "transformers",
          "tokenizers", "psutil", "numpy"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "MISSING")
EOF
  nproc; free -g | head -2
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv,noheader -l 1 \
  > "$OUT/gpu-mem.csv" 2>/dev/null &
SMI=$!
trap 'kill $SMI 2>/dev/null' EXIT

if [ "$MODE" = exec ]; then
  # Any command in this environment, e.g. a benchmark (its output in $OUT/exec.log).
  timeout -s INT -k 30 "${EXEC_TIMEOUT:-560}" "${@:2}" 2>&1 | tee "$OUT/exec.log"
  exit "${PIPESTATUS[0]}"
fi

if [ "$MODE" = tests ]; then
  # SIGINT, not SIGTERM, at the limit: pytest then runs its teardown (servers stopped).
  timeout -s INT -k 30 "${TESTS_TIMEOUT:-560}" python3 -m pytest -m gpu tests/gpu -v -s -rA \
    -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log"
  exit "${PIPESTATUS[0]}"
fi

JOB="${JOB:-examples/gpu-llama8b.yaml}"
STUDY="${STUDY_DIR:-$ROOT/runs/gpu-llama8b}"
echo "== python3 -m optimizer.cli tune $JOB --no-mlflow $*"
t0=$(date +%s)
timeout -s INT -k 30 "${TUNE_TIMEOUT:-540}" python3 -m optimizer.cli tune "$JOB" --no-mlflow \
  "${@:2}" 2>&1 | tee "$OUT/tune.log"
rc=${PIPESTATUS[0]}
echo "== tune exited $rc after $(( $(date +%s) - t0 )) s"
python3 benchmarks/study_summary.py "$STUDY" > "$OUT/summary.json" 2>> "$OUT/tune.log"
python3 -m optimizer.cli show "$STUDY" > "$OUT/show.txt" 2>&1
python3 -m optimizer.cli show "$STUDY" --json > "$OUT/show.json" 2>> "$OUT/tune.log"
tar -C "$(dirname "$STUDY")" --exclude="$(basename "$STUDY")/cache" -czf "$OUT/study.tar.gz" \
  "$(basename "$STUDY")"
tar -C /tmp/ray -czf "$OUT/ray-logs.tar.gz" session_latest/logs 2>/dev/null || true
cat "$OUT/show.txt"
exit "$rc"
