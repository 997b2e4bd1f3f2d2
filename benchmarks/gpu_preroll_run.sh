#!/usr/bin/env bash
# Issue 34, item 1 on one H200: the pre-roll comparison of benchmarks/jobs/gpu-llama8b-preroll.yaml
# on the whole Mooncake synthetic trace (carried in as .gpu/traces/mooncake_synthetic.jsonl),
# window [767, 797) s, in the order that matters most if the device time runs out:
#   1. vLLM's default KV cache (~0.92 M tokens: the warm set fits whole): cold and the warm set;
#   2. the same cache: the old default (the 701 s stretch, uncut, one step);
#   3. the job's 30 GiB cache (245,760 tokens): the warm set cut to it.
# Run there through benchmarks/gpu_background.sh (its files go to $BG_OUT):
#   bash benchmarks/gpu_background.sh start 540 bash benchmarks/gpu_preroll_run.sh
set -uo pipefail
OUT_DIR="${BG_OUT:-${OUT:-runs}}"
COMMON=(benchmarks/jobs/gpu-llama8b-preroll.yaml --compare preroll
  --trace .gpu/traces/mooncake_synthetic.jsonl --window 767:797
  --max-steps 6 --stretch-steps 1 --max-send-lag-ms 20 --max-scale 32)
DEFAULT_KV='{"kv-cache-memory-bytes": null}'
echo "== 1. default KV cache: cold, warm set"
python3 benchmarks/preroll_benchmark.py "${COMMON[@]}" --args "$DEFAULT_KV" --rows cold,kept \
  --out "$OUT_DIR/defaultkv"
echo "== 2. default KV cache: the old default (stretch, uncut, one step)"
python3 benchmarks/preroll_benchmark.py "${COMMON[@]}" --args "$DEFAULT_KV" --rows stretch \
  --out "$OUT_DIR/defaultkv-stretch"
echo "== 3. 30 GiB KV cache: the warm set cut to it"
python3 benchmarks/preroll_benchmark.py "${COMMON[@]}" --rows kept --out "$OUT_DIR/kv30"
