#!/usr/bin/env bash
# The seed's reference job in both transport modes on this machine, then plain
# TCP loopback throughput in the same session.
# Usage: bench/network.sh [DATA_DIR] [CONFIG]   (defaults: ../shared/data and the
# reference job on Fashion-MNIST, since the shared data has no MNIST training set).
# FEATURES="--features vulkan" reuses a GPU release build (run here with --cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="$(cd "${1:-../shared/data}" && pwd)"
CONFIG="${2:-configs/fashion_mnist/fedavg_lenet5_reference.toml}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
# shellcheck disable=SC2086
cargo build --release --locked -p cohort-cli ${FEATURES:-} >/dev/null
BIN="$CARGO_TARGET_DIR/release/cohort"
OUT="$(mktemp -d)"
sed 's/^comm_simulation = true/comm_simulation = false/' "$CONFIG" > "$OUT/network.toml"
grep -q '^comm_simulation = false' "$OUT/network.toml" || { echo "no comm_simulation line in $CONFIG"; exit 1; }

for mode in simulation network; do
  config="$CONFIG"; [ "$mode" = network ] && config="$OUT/network.toml"
  start=$(date +%s.%N)
  COHORT_DATA_DIR="$DATA" "$BIN" run --config "$config" --cpu --quiet --base "$OUT/$mode"
  end=$(date +%s.%N)
  run_dir="$(ls -d "$OUT/$mode"/*/ | head -1)"
  echo "== $mode: $(echo "$end - $start" | bc -l | cut -c1-6) s end to end"
  cat "$run_dir/results.csv"
  awk -F, 'NR>1 { p += $7; c += $8; b += $9; n++ } END { printf "per client: processing %.4f s, comm %.4f s, update %d bytes\n", p/n, c/n, b/n }' "$run_dir/clients.csv"
done
"$BIN" compare "$(ls -d "$OUT"/simulation/*/)model.safetensors" "$(ls -d "$OUT"/network/*/)model.safetensors"
CARGO_TARGET_DIR="${CORE_TARGET_DIR:-$CARGO_TARGET_DIR}" cargo bench --locked -p cohort-core --bench loopback 2>/dev/null | grep loopback
