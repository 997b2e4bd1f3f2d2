#!/usr/bin/env bash
# Issue 34, item 1 on one H200: the warm set sent once per server and kept between capacity steps
# (topped up where the steps since could have evicted it), against the same warm set sent before
# every step after a prefix-cache reset (how steps were warmed before), on the window of
# benchmarks/gpu_preroll_run.sh (the whole Mooncake synthetic trace, carried in as
# .gpu/traces/mooncake_synthetic.jsonl, window [767, 797) s) with vLLM's default KV cache.
# Run there through benchmarks/gpu_background.sh (its files go to $BG_OUT):
#   bash benchmarks/gpu_background.sh start 530 bash benchmarks/gpu_preroll_once_run.sh
set -uo pipefail
OUT_DIR="${BG_OUT:-${OUT:-runs}}"
COMMON=(benchmarks/jobs/gpu-llama8b-preroll.yaml --compare preroll
  --trace .gpu/traces/mooncake_synthetic.jsonl --window 767:797
  --max-steps 6 --max-send-lag-ms 20 --max-scale 32 --args '{"kv-cache-memory-bytes": null}')
echo "== 1. default KV cache: the warm set kept between steps"
python3 benchmarks/preroll_benchmark.py "${COMMON[@]}" --rows kept --out "$OUT_DIR/kept"
echo "== 2. default KV cache: the warm set sent every step"
python3 benchmarks/preroll_benchmark.py "${COMMON[@]}" --rows every --out "$OUT_DIR/every"
