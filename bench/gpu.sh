#!/usr/bin/env bash
# One prepared run for a single-GPU machine (an H200 here): at most 10 minutes in all (each run
# gets what is left of a 570-second budget, capped at 180 s; a run that would start with under
# 60 s left is skipped and says so).
# Checks the GPU backend, then tokens/s and MFU of the example LM for presets at stage 0 and
# stage 3 (bf16), then the largest preset that trains with offload_optimizer, as one table;
# and this GPU's autotune results, for `zerojax plan --gpu-autotune` (docs/planning.md).
# Not used by tests or CI.   Usage: bash bench/gpu.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/zerojax-gpu}}"
mkdir -p "$OUT"
python - <<'PY' || { echo "no GPU backend in this jax: install jax[cuda12] first"; exit 2; }
import jax
assert jax.devices()[0].platform == "gpu", jax.devices()
print("devices:", jax.devices(), "| kind:", jax.devices()[0].device_kind)
PY
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true

run() {  # name, then pretrain_lm arguments; prints one table row from its metrics.jsonl
  local name="$1"; shift
  local dir="$OUT/$name"
  rm -rf "$dir"
  local left=$((570 - SECONDS))
  if (( left < 60 )); then echo "$name: skipped (the 10-minute budget is spent)"; return 0; fi
  if timeout $(( left < 180 ? left : 180 )) python examples/pretrain_lm.py --no-progress --sample-len 0 --eval-every 0 \
        --log-dir "$dir" "$@" > "$dir.log" 2>&1; then
    python - "$dir" "$name" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l][5:]
tps = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r.get("mfu", float("nan")) for r in rows)
print(f"{sys.argv[2]:<34} {tps:>12,.0f} tok/s   MFU {100 * mfu:5.1f}%   loss {rows[-1]['loss']:.3f}")
PY
  else
    echo "$name: failed or out of memory (see $dir.log)"; tail -3 "$dir.log"
  fi
}

echo "config                              tokens/s        MFU         last loss"
for preset in 125m 1.3b; do
  for stage in 0 3; do
    dump=""  # the 1.3b stage-3 run also writes this GPU's autotune results, which
    # `zerojax plan --topology <this kind>:8 --gpu-autotune $OUT/autotune.textproto` loads
    [[ "$preset $stage" == "1.3b 3" ]] && dump="--xla_gpu_dump_autotune_results_to=$OUT/autotune.textproto"
    XLA_FLAGS="${XLA_FLAGS:-} $dump" run "$preset stage $stage bf16" --preset "$preset" \
      --stage "$stage" --precision bf16 --steps 20 --batch-size 8 --seq-len 1024
  done
done
[[ -s "$OUT/autotune.textproto" ]] && echo "autotune results: $OUT/autotune.textproto"
for preset in 7b 1.3b; do   # the largest that trains with the optimizer state offloaded
  if run "$preset stage 3 bf16 offload_optimizer" --config configs/zero3_offload.json \
      --preset "$preset" --steps 12 --batch-size 1 --seq-len 1024 | tee "$OUT/offload.txt" \
      && ! grep -q failed "$OUT/offload.txt"; then
    break
  fi
done
