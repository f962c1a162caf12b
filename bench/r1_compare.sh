#!/usr/bin/env bash
# R1 with two cohort binaries (say, before and after a change), then eager
# PyTorch (../shared/bench/torch_r1.py, one thread), in one run on one machine.
# Usage: bench/r1_compare.sh BEFORE_BINARY AFTER_BINARY [DATA_DIR]
# Build each with `cargo build --release --locked -p cohort-cli` (in its own
# checkout; touch its sources first if the checkouts share a target folder).
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE="$(realpath "$1")"; AFTER="$(realpath "$2")"
DATA="$(cd "${3:-../shared/data}" && pwd)"
declare -A BINARY=([before]="$BEFORE" [after]="$AFTER")
MODELS="$(mktemp -d)"
for which in before after; do
  OUT="$(mktemp -d)"
  start=$(date +%s.%N)
  COHORT_DATA_DIR="$DATA" "${BINARY[$which]}" run --config configs/fashion_mnist/fedavg_lenet5_r1.toml --cpu --quiet --base "$OUT"
  end=$(date +%s.%N)
  RUN_DIR="$(ls -d "$OUT"/*/ | head -1)"
  echo "== cohort ($which): $(echo "$end - $start" | bc -l | cut -c1-6) s end to end"
  tail -1 "$RUN_DIR/results.csv" | cut -d, -f1-3
  awk -F, 'NR>1 { s += $4; t += $6 } END { printf "local training: %.0f samples/s\n", s / t }' "$RUN_DIR/clients.csv"
  cp "$RUN_DIR/model.safetensors" "$MODELS/$which.safetensors"
done
if cmp -s "$MODELS/before.safetensors" "$MODELS/after.safetensors"; then
  echo "== before and after: the same model bit for bit"
else
  echo "== before and after: different models"
fi
OUT="$(mktemp -d)"
start=$(date +%s.%N)
python3 ../shared/bench/torch_r1.py --data "$DATA/fashion-mnist" --threads 1 --json "$OUT/torch.json" > /dev/null
end=$(date +%s.%N)
echo "== torch: $(echo "$end - $start" | bc -l | cut -c1-6) s end to end"
python3 - "$OUT/torch.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
samples = sum(r["samples_per_s"] * r["train_s"] for r in d["rows"])
train = sum(r["train_s"] for r in d["rows"])
print(f"torch in-script total {d['total_s']:.2f}s, local training {samples / train:.0f} samples/s, final accuracy {d['rows'][-1]['accuracy']:.4f}")
PY
