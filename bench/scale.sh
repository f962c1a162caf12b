#!/usr/bin/env bash
# Scale: R1's model and training with 100, 1,000 and 10,000 clients, 100 per
# round, 600 samples each (iid_cyclic: the training set repeated as often as
# the clients need), on two workers (one per core). For each it prints the
# round time, the share of it that is not training (selection, dispatch,
# codec, aggregation, result and checkpoint writes; the test-set evaluation,
# which overlaps the next round's training, separately), and the peak RSS.
# Usage: bench/scale.sh [DATA_DIR] [CLIENT_COUNTS...]   (default ../shared/data, 100 1000 10000)
# PER_ROUND (default 100) and PARTITION_SIZE (default 600) change the round:
# PER_ROUND=1000 PARTITION_SIZE=60 bash bench/scale.sh DATA 100000 is 100,000
# clients of 60 samples, 1,000 a round (still 60,000 samples a round).
# EXTRA adds --set overrides, e.g. EXTRA="algorithm.type=scaffold
# parameters.optimizer.momentum=0 server.client_state_memory_bytes=1" for
# SCAFFOLD with its client variates in a file.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="$(cd "${1:-../shared/data}" && pwd)"
shift || true
COUNTS=("${@:-100 1000 10000}")
# shellcheck disable=SC2206
COUNTS=(${COUNTS[*]})
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
BIN="${COHORT_BIN:-}"
if [ -z "$BIN" ]; then
  cargo build --release --locked -p cohort-cli >/dev/null
  BIN="$CARGO_TARGET_DIR/release/cohort"
fi
ROUNDS="${ROUNDS:-4}"
WORKERS="${WORKERS:-2}"
OUT="$(mktemp -d)"
extra=()
for setting in ${EXTRA:-}; do extra+=(--set "$setting"); done
printf '%8s %10s %12s %14s %12s %10s\n' clients round_s not_training evaluation_s peak_rss_MiB accuracy
for clients in "${COUNTS[@]}"; do
  base="$OUT/$clients"
  # Peak RSS of the run (KiB), without relying on GNU time being installed.
  python3 -c 'import resource, subprocess, sys
code = subprocess.run(sys.argv[2:]).returncode
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(code)' "$OUT/rss-$clients" \
    env COHORT_DATA_DIR="$DATA" "$BIN" run --config configs/fashion_mnist/fedavg_lenet5_r1.toml \
      --cpu --quiet --base "$base" \
      --set "clients.total_clients=$clients" --set "clients.per_round=${PER_ROUND:-100}" \
      --set data.sampler=iid_cyclic --set "data.partition_size=${PARTITION_SIZE:-600}" \
      --set "trainer.rounds=$ROUNDS" --set "trainer.max_concurrency=$WORKERS" \
      --set trainer.threads_per_worker=1 "${extra[@]}"
  run_dir="$(ls -d "$base"/*/ | head -1)"
  python3 - "$run_dir" "$clients" "$(cat "$OUT/rss-$clients")" "$WORKERS" <<'PY'
import sys
sys.path.insert(0, "bench")
from not_training import read_run, share
run_dir, clients, rss_kib, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
run = read_run(run_dir)
# Round 1 includes starting the workers; the steady state is the rest.
m = share(run, workers, [r for r in sorted(run[0]) if r > 1])
accuracy = float(run[0][max(run[0])]["accuracy"])
print(f"{clients:>8} {m['round_s']:>10.2f} {100 * m['share']:>11.2f}% "
      f"{m['evaluation']:>14.2f} {rss_kib / 1024:>12.1f} {accuracy:>10.4f}")
PY
done
