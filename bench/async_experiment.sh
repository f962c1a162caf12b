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
#      default one per core: sized for a 16-core machine), PARALLEL (any value:
#      the six runs at once, each run's output in OUT/CONFIG-SELECTION.log).
# Run again with the same OUT_DIR, a run cut short (a time limit, a kill)
# continues from its checkpoint; finished ones are kept.
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
TARGET=0.8

# The simulated seconds of the first round at or above $2 accuracy, or "-".
time_to() {
  awk -F, -v target="$2" 'NR > 1 && $2 >= target { print $10; found = 1; exit }
    END { if (!found) print "-" }' "$1/results.csv"
}

# Rounds written to a run folder's results.csv, and its best accuracy.
done_rounds() { echo $(($(wc -l <"$1/results.csv") - 1)); }
best() { awk -F, 'NR > 1 && $2 > best { best = $2 } END { print best + 0 }' "$1/results.csv"; }

# One run: started afresh, or continued from its newest checkpoint when its
# folder is there from an earlier call that was cut short (a time limit), so
# a long experiment can be run in pieces.
one_run() {
  local config="$1" selection="$2" rounds="$3" base="$OUT/$1-$2"
  local run
  run="$(ls -d "$base"/*/ 2>/dev/null | head -1 || true)"
  if [ -n "$run" ] && [ -f "$run/results.csv" ]; then
    if [ "$(done_rounds "$run")" -ge "$rounds" ] || \
       awk -v b="$(best "$run")" -v t="$TARGET" 'BEGIN { exit !(b >= t) }'; then
      return 0
    fi
    COHORT_DATA_DIR="$DATA" "$COHORT_BIN" run --resume "$run" --cpu --quiet --rounds "$rounds"
  else
    rm -rf "$base"
    COHORT_DATA_DIR="$DATA" "$COHORT_BIN" run --config "bench/async/$config.toml" --cpu --quiet \
      --set general.run_name="$config-$selection" \
      --base "$base" --rounds "$rounds" \
      --set clients.selection="$selection" --set trainer.max_concurrency="$THREADS"
  fi
}

rounds_of() {
  local rounds
  rounds=$(awk -F' = ' '/^rounds = / { print $2 }' "bench/async/$1.toml")
  awk -v r="$rounds" -v s="$SCALE" 'BEGIN { n = int(r * s); print (n < 1 ? 1 : n) }'
}

configs=(${ONLY:-sync_fedavg fedbuff fedasync})
pids=()
for config in "${configs[@]}"; do
  for selection in random oort; do
    if [ -n "${PARALLEL:-}" ]; then
      one_run "$config" "$selection" "$(rounds_of "$config")" >"$OUT/$config-$selection.log" 2>&1 &
      pids+=($!)
    else
      one_run "$config" "$selection" "$(rounds_of "$config")"
    fi
  done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done

runs=()
printf '%-12s %-7s %7s %10s %10s %10s\n' config select rounds "final acc" "t(75%) s" "t(80%) s"
for config in "${configs[@]}"; do
  for selection in random oort; do
    run="$(ls -d "$OUT/$config-$selection"/*/ 2>/dev/null | head -1 || true)"
    if [ -z "$run" ] || [ ! -f "$run/results.csv" ]; then
      printf '%-12s %-7s %7s\n' "$config" "$selection" "(no results; see $OUT/$config-$selection.log)"
      status=1
      continue
    fi
    runs+=("$run")
    final=$(tail -1 "$run/results.csv" | cut -d, -f2)
    printf '%-12s %-7s %7s %10s %10s %10s\n' "$config" "$selection" "$(done_rounds "$run")" \
      "$final" "$(time_to "$run" 0.75)" "$(time_to "$run" 0.80)"
  done
done
if [ "${#runs[@]}" -gt 0 ]; then
  "$COHORT_BIN" plot "${runs[@]}" --against simulated -o "$OUT/async_experiment.png" >/dev/null
fi
echo "runs and chart: $OUT (async_experiment.png)"
exit "$status"
