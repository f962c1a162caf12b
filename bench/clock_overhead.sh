#!/usr/bin/env bash
# The simulated clock's overhead at 10,000 clients: its cost per event (the
# replay of crates/cohort-core/benches/clock.rs, which calls the core code the
# asynchronous server calls) against a real asynchronous run's time per event,
# both measured in this call. The run is bench/async/fedbuff.toml (FedBuff,
# Fashion-MNIST, LeNet-5, lognormal compute speeds, on/off availability) with
# 10,000 clients of 6 samples each (data.sampler = "iid"), 100 in flight.
# An event is an update's arrival, lost and stale ones included (a row of
# clients.csv). Prints the clock's share of the run's time per event, and of
# that time without the server's test-set evaluation (a stricter denominator).
# Usage: bench/clock_overhead.sh [DATA_DIR]   (default ../shared/data)
# Env: COHORT_BIN (a release `cohort` instead of building one), ROUNDS
#      (aggregations, default 40), THREADS (workers, default one per core).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="$(cd "${1:-../shared/data}" && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
if [ -z "${COHORT_BIN:-}" ]; then
  cargo build --release --locked -p cohort-cli >/dev/null
  COHORT_BIN="$CARGO_TARGET_DIR/release/cohort"
fi
ROUNDS="${ROUNDS:-40}"
THREADS="${THREADS:-$(nproc)}"
OUT="$(mktemp -d -t clock_overhead.XXXXXX)"

if [ -n "${CLOCK_BENCH:-}" ]; then
  # A prebuilt replay (the bench binary), for a machine without cargo.
  "$CLOCK_BENCH" bench/async/fedbuff.toml | tee "$OUT/clock.txt"
else
  cargo bench --locked -p cohort-core --bench clock -- bench/async/fedbuff.toml | tee "$OUT/clock.txt"
fi
clock_us=$(awk '$1 == 10000 && $2 == 100 { print $3 }' "$OUT/clock.txt")

COHORT_DATA_DIR="$DATA" "$COHORT_BIN" run --config bench/async/fedbuff.toml --cpu --quiet \
  --base "$OUT/run" --rounds "$ROUNDS" \
  --set clients.total_clients=10000 --set data.sampler=iid \
  --set trainer.max_concurrency="$THREADS" 2>/dev/null
run="$(ls -d "$OUT"/run/*/ | head -1)"
python3 - "$run" "$clock_us" <<'PY'
import csv, sys
run, clock_us = sys.argv[1], float(sys.argv[2])
rows = list(csv.DictReader(open(run + "/results.csv")))
events = sum(1 for r in csv.DictReader(open(run + "/clients.csv")) if int(r["round"]) > 1)
# Round 1 includes starting the workers and loading the data: left out.
seconds = float(rows[-1]["elapsed_time"]) - float(rows[0]["elapsed_time"])
evaluation = sum(float(r["evaluation_time"]) for r in rows[1:])
per_event = seconds / events * 1e6
without_eval = (seconds - evaluation) / events * 1e6
print(f"run: {len(rows)} aggregations, {events} events after the first, "
      f"{per_event:.0f} us per event ({without_eval:.0f} us without the test-set evaluation)")
print(f"clock at 10,000 clients, 100 in flight: {clock_us:.1f} us per event = "
      f"{100 * clock_us / per_event:.2f} % of the run's time per event, "
      f"{100 * clock_us / without_eval:.2f} % of it without the evaluation")
PY
echo "run folder: $run"
