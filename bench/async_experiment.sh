#!/usr/bin/env bash
# Asynchronous and heterogeneous FL: Fashion-MNIST, LeNet-5, 1,000 clients with
# lognormal compute speeds (sigma 1) and on/off availability; synchronous FedAvg
# against FedBuff and FedAsync (bench/async/*.toml), each with random and with
# Oort selection (clients.selection). Prints the simulated seconds each run took
# to reach 75 % and 80 % test accuracy (runs stop at 80 %, trainer.target_accuracy)
# and draws accuracy against simulated time for all six (cohort plot).
# Usage: bench/async_experiment.sh [DATA_DIR] [OUT_DIR]
#   DATA_DIR: default ../shared/data (needs fashion-mnist/); OUT_DIR: default a
#   new temporary folder, kept (the run folders and async_experiment.png).
# Env: COHORT_BIN (a release `cohort` instead of building one), CARGO_FLAGS,
#      ROUNDS_SCALE (a factor on every config's trainer.rounds; 0.1 for a short
#      look), ONLY ("sync_fedavg fedbuff" to run some configs), THREADS (workers,
#      default one per core: sized for a 16-core machine).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="$(cd "${1:-../shared/data}" && pwd)"
OUT="${2:-$(mktemp -d -t async_experiment.XXXXXX)}"
mkdir -p "$OUT"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
if [ -z "${COHORT_BIN:-}" ]; then
  # shellcheck disable=SC2086
  cargo build --release --locked -p cohort-cli ${CARGO_FLAGS:-} >/dev/null
  COHORT_BIN="$CARGO_TARGET_DIR/release/cohort"
fi
SCALE="${ROUNDS_SCALE:-1}"
THREADS="${THREADS:-$(nproc)}"

# The simulated seconds of the first round at or above $2 accuracy, or "-".
time_to() {
  awk -F, -v target="$2" 'NR > 1 && $2 >= target { print $10; found = 1; exit }
    END { if (!found) print "-" }' "$1/results.csv"
}

runs=()
printf '%-12s %-7s %7s %10s %10s %10s\n' config select rounds "final acc" "t(75%) s" "t(80%) s"
for config in ${ONLY:-sync_fedavg fedbuff fedasync}; do
  file="bench/async/$config.toml"
  rounds=$(awk -F' = ' '/^rounds = / { print $2 }' "$file")
  rounds=$(awk -v r="$rounds" -v s="$SCALE" 'BEGIN { n = int(r * s); print (n < 1 ? 1 : n) }')
  for selection in random oort; do
    base="$OUT/$config-$selection"
    rm -rf "$base"
    COHORT_DATA_DIR="$DATA" "$COHORT_BIN" run --config "$file" --cpu --quiet \
      --base "$base" --rounds "$rounds" \
      --set clients.selection="$selection" --set trainer.max_concurrency="$THREADS"
    run="$(ls -d "$base"/*/ | head -1)"
    runs+=("$run")
    done_rounds=$(($(wc -l <"$run/results.csv") - 1))
    final=$(tail -1 "$run/results.csv" | cut -d, -f2)
    printf '%-12s %-7s %7s %10s %10s %10s\n' "$config" "$selection" "$done_rounds" "$final" \
      "$(time_to "$run" 0.75)" "$(time_to "$run" 0.80)"
  done
done
"$COHORT_BIN" plot "${runs[@]}" --against simulated -o "$OUT/async_experiment.png" >/dev/null
echo "runs and chart: $OUT (async_experiment.png)"
