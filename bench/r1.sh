#!/usr/bin/env bash
# Times workload R1 end to end with the release binary, then the same work in plain
# eager PyTorch (../shared/bench/torch_r1.py) right after it on the same machine.
# Usage: bench/r1.sh [DATA_DIR]   (default ../shared/data)
# Needs: python3 with torch and numpy for the reference.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="$(cd "${1:-../shared/data}" && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
# FEATURES="--features vulkan" reuses a GPU release build (the run stays on the CPU).
# shellcheck disable=SC2086
cargo build --release --locked -p cohort-cli ${FEATURES:-} >/dev/null
BIN="$CARGO_TARGET_DIR/release/cohort"
OUT="$(mktemp -d)"

start=$(date +%s.%N)
COHORT_DATA_DIR="$DATA" "$BIN" run --config configs/fashion_mnist/fedavg_lenet5_r1.toml --cpu --quiet --base "$OUT"
end=$(date +%s.%N)
cohort_s=$(echo "$end - $start" | bc -l)
RUN_DIR="$(ls -d "$OUT"/*/ | head -1)"
echo "== cohort R1: ${cohort_s}s end to end"
cat "$RUN_DIR/results.csv"
# Local-training throughput: samples over summed client training time.
awk -F, 'NR>1 { s += $4; t += $6 } END { printf "cohort local training: %.0f samples/s\n", s / t }' "$RUN_DIR/clients.csv"

start=$(date +%s.%N)
python3 ../shared/bench/torch_r1.py --data "$DATA/fashion-mnist" --threads 1 --json "$OUT/torch.json"
end=$(date +%s.%N)
torch_s=$(echo "$end - $start" | bc -l)
echo "== torch R1: ${torch_s}s end to end (process, including imports)"
python3 - "$OUT/torch.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
samples = sum(r["samples_per_s"] * r["train_s"] for r in d["rows"])
train = sum(r["train_s"] for r in d["rows"])
print(f"torch in-script total {d['total_s']:.2f}s, local training {samples / train:.0f} samples/s, final accuracy {d['rows'][-1]['accuracy']:.4f}")
PY
echo "== ratio cohort/torch (end to end): $(echo "$cohort_s / $torch_s" | bc -l | cut -c1-5)"
