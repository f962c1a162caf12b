#!/usr/bin/env bash
# Secure aggregation's cost per round, simulated in process (every message
# encoded, counted and decoded): per-client and server compute and the bytes
# of a round, for a LeNet-5-sized update (61,706 values) and a 1 M-value one,
# at 10, 100 and 1,000 clients with 0, 10 and 30 % dropout (half after
# sharing keys, half after the masked input). SecAgg (the complete graph) is
# measured up to 100 clients: its cost grows with n², and at 1,000 clients
# one round is out of a benchmark's reach.
# Usage: bench/secagg.sh [quick]   (quick: the 10- and 100-client rows only)
# JOBS=N runs N rows at once (default 1; each row is one thread, so on a
# machine with more cores than N the rows do not slow each other much,
# apart from memory bandwidth). COHORT_SECAGG_BENCH names a built bench binary.
# Flower's SecAgg+ on the same sizes is not measured by this script yet.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
BIN="${COHORT_SECAGG_BENCH:-}"
if [ -z "$BIN" ]; then
  BIN="$(cargo bench --no-run --locked -p cohort-core --bench secagg --message-format=json 2>/dev/null |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "secagg" and m.get("executable"):
        print(m["executable"])')"
fi
JOBS="${JOBS:-1}"
LENET5=61706
MILLION=1000000
rows=()
for values in $LENET5 $MILLION; do
  for dropout in 0 10 30; do
    # One repeat at 1 M values (each round takes seconds); three (best of) below.
    repeats=3; [ "$values" = "$MILLION" ] && repeats=1
    rows+=("10 $values all:6 $dropout $repeats" "10 $values 7:4 $dropout $repeats")
    rows+=("100 $values all:51 $dropout $repeats" "100 $values 21:11 $dropout $repeats")
    if [ "${1:-}" != quick ]; then
      rows+=("1000 $values 21:11 $dropout 1")
    fi
  done
done
echo "| clients | values | graph | dropout | client ms | server ms | up MB | down MB | in sum |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}" | xargs -P "$JOBS" -L 1 sh -c '"$0" --row "$@"' "$BIN"
