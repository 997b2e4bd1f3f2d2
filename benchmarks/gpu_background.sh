#!/usr/bin/env bash
# Work longer than one device call (10 minutes) on the GPU machine: started in a process session
# of its own (it outlives the call that started it, not the machine), then followed by further
# calls made back to back, each waiting a while and returning what is there so far.
#
#   bash benchmarks/gpu_background.sh start SECONDS CMD...
#       copy this tree to /tmp/bg/repo (so later calls, which copy the working tree again,
#       never touch the code that runs), then run `benchmarks/gpu_study.sh exec CMD...` there in
#       the background with OUT=/tmp/bg/out, then `wait SECONDS`
#   bash benchmarks/gpu_background.sh wait SECONDS
#       wait until it ends or SECONDS pass, then copy /tmp/bg/out to $OUT (its folders packed
#       into one tar, at most 8 files come back) and print the log's end
#
# The command's own files go under $BG_OUT (exported to it: /tmp/bg/out).
set -uo pipefail
MODE="${1:?start or wait}"
BG=/tmp/bg
ROOT="$(cd "$(dirname "$0")/.." && pwd)"

pack() {
  mkdir -p "$OUT"
  [ -d "$BG/out" ] || return 0
  (cd "$BG/out" && for f in *; do [ -f "$f" ] && cp "$f" "$OUT/"; done)
  # Folders (study folders, stability runs) in one archive; the plain files as they are.
  (cd "$BG/out" && find . -mindepth 1 -maxdepth 1 -type d | grep -q . &&
    tar --exclude='*/cache' -czf "$OUT/folders.tar.gz" $(find . -mindepth 1 -maxdepth 1 -type d))
  ls -la "$OUT" | tail -n +2
}

wait_for() {
  local limit="$1" t0
  t0=$(date +%s)
  while [ ! -f "$BG/rc" ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do sleep 5; done
  if [ -f "$BG/rc" ]; then echo "== background work ended, rc $(cat "$BG/rc")"; else
    echo "== background work still running after ${limit} s of this call"; fi
  tail -n 40 "$BG/log" 2>/dev/null
  pack
}

case "$MODE" in
  start)
    limit="${2:?SECONDS}"
    rm -rf "$BG" && mkdir -p "$BG/out"
    tar -C "$ROOT" --exclude='./.gpu/c*' --exclude='./.git' --exclude='./.venv*' \
      --exclude='*_cache' -cf - . | (mkdir -p "$BG/repo" && tar -C "$BG/repo" -xf -)
    export BG_OUT="$BG/out"
    setsid nohup env OUT="$BG/out" EXEC_TIMEOUT="${EXEC_TIMEOUT:-1700}" \
      bash -c 'bash "$0/benchmarks/gpu_study.sh" exec "${@}"; echo $? > /tmp/bg/rc' \
      "$BG/repo" "${@:3}" > "$BG/log" 2>&1 < /dev/null &
    echo "== started in the background (pid $!): ${*:3}"
    wait_for "$limit"
    ;;
  wait) wait_for "${2:?SECONDS}" ;;
  *) echo "usage: $0 start SECONDS CMD... | wait SECONDS" >&2; exit 2 ;;
esac
