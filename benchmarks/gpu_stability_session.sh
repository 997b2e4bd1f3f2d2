#!/usr/bin/env bash
# One H200 session's work (issues 16, 18, 19), run in the background on the GPU machine:
#
#   bash benchmarks/gpu_background.sh start 520 bash benchmarks/gpu_stability_session.sh
#   bash benchmarks/gpu_background.sh wait 560      (again, back to back, until it ends)
#
# 1. A two-trial study through Ray trial actors (benchmarks/jobs/gpu-preload-check.yaml):
#    each trial's placement.json (CUDA_VISIBLE_DEVICES, Ray's GPU ids, nvidia-smi's processes)
#    and the second trial's start from the interpreter its actor prepared during the first
#    trial's replay.
# 2. The stability check of a GPU capacity study's winner (the study folder given as
#    STUDY, default runs/gpu-llama8b-capacity, carried along): 10 minutes of sustained load at
#    0.7 x its measured capacity, a burst, recovery, long inputs; the chosen configuration only
#    (the baseline's run would not fit the device time of one session).
#
# Everything it writes goes to $BG_OUT (gpu_background.sh packs it).
set -uo pipefail
cd "$(dirname "$0")/.."
O="${BG_OUT:?run through benchmarks/gpu_background.sh}"
STUDY="${STUDY:-runs/gpu-llama8b-capacity}"
MINUTES="${MINUTES:-10}"

echo "== $(date -u +%H:%M:%S) 1. two-trial Ray study"
timeout -s INT -k 30 600 python3 -m optimizer.cli tune benchmarks/jobs/gpu-preload-check.yaml \
  --no-mlflow 2>&1 | tee "$O/tune.log"
python3 -m optimizer.cli show runs/gpu-preload-check --json > "$O/show-preload.json" 2>>"$O/tune.log"
python3 -m optimizer.cli show runs/gpu-preload-check > "$O/show-preload.txt" 2>&1
mkdir -p "$O/preload" && cp -r runs/gpu-preload-check/. "$O/preload/"
rm -rf "$O/preload/cache"
nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv > "$O/apps-after-study.csv" 2>&1

echo "== $(date -u +%H:%M:%S) 2. stability of $STUDY's winner, ${MINUTES} min sustained"
# A folder written by an older version records absolute paths of the tree it was written in:
# point them at this tree.
python3 - "$STUDY" <<'EOF'
import json, sys
from pathlib import Path
folder = Path(sys.argv[1]).resolve()
plan = folder / "plan.json"
text = plan.read_text()
doc = json.loads(text)
out = doc.get("job", {}).get("out", "")
if out.startswith("/") and Path(out) != folder:
    old_root, new_root = str(Path(out).parent.parent), str(folder.parent.parent)
    plan.write_text(text.replace(old_root + "/", new_root + "/"))
    print(f"plan.json: {old_root}/ -> {new_root}/")
EOF
timeout -s INT -k 60 1300 python3 -m optimizer.cli stability "$STUDY" --minutes "$MINUTES" \
  --burst-s 10 --no-baseline 2>&1 | tee "$O/stability.log"
echo "stability exited ${PIPESTATUS[0]}"
mkdir -p "$O/stab" && cp -r "$STUDY/stability" "$STUDY/stability.json" "$O/stab/" 2>/dev/null
echo "== $(date -u +%H:%M:%S) done"
