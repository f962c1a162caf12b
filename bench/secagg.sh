#!/usr/bin/env bash
# Secure aggregation's cost per round, simulated in process (every message
# encoded, counted and decoded): per-client and server compute and the bytes
# of a round, for a LeNet-5-sized update (61,706 values) and a 1 M-value one,
# at 10, 100 and 1,000 clients with 0, 10 and 30 % dropout (half after
# sharing keys, half after the masked input). SecAgg (the complete graph) is
# measured up to 100 clients: its cost grows with n², and at 1,000 clients
# one round is out of a benchmark's reach.
# Usage: bench/secagg.sh [flower] [quick]
#   quick:  the 10- and 100-client rows only.
#   flower: also runs Flower's own SecAgg+ (bench/flower_secagg.py) on each
#           row's settings right after cohort's, and prints one table with
#           both sides and the ratios (Flower / cohort; Flower's wall
#           time, its process CPU time in brackets). Flower runs from a
#           virtual environment of its own, never a dependency of cohort:
#           FLOWER_PYTHON names its python, else FLOWER_VENV (default
#           ~/.cache/cohort-flwr-venv) is created with flwr 1.42.0 and numpy.
#           FLOWER_ROW_LIMIT (default 600) caps one Flower row in seconds; a
#           row past it reads "> N s". FLOWER_REPEAT_BUDGET (default 60 s)
#           stops repeating a Flower row once its rounds took that long.
# JOBS=N runs N rows at once (default 1; each row is one thread, so on a
# machine with more cores than N the rows do not slow each other much,
# apart from memory bandwidth). COHORT_SECAGG_BENCH names a built bench binary.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOWER=0
QUICK=0
for arg in "$@"; do
  case "$arg" in
    flower) FLOWER=1 ;;
    quick) QUICK=1 ;;
    *) echo "usage: bench/secagg.sh [flower] [quick]" >&2; exit 2 ;;
  esac
done
if [ "$FLOWER" = 1 ] && [ -z "${FLOWER_PYTHON:-}" ]; then
  FLOWER_VENV="${FLOWER_VENV:-$HOME/.cache/cohort-flwr-venv}"
  if [ ! -x "$FLOWER_VENV/bin/python" ]; then
    python3 -m venv "$FLOWER_VENV"
    # The harness drives the workflow's and the mod's internals: pinned.
    "$FLOWER_VENV/bin/pip" install --quiet flwr==1.42.0 numpy >&2
  fi
  FLOWER_PYTHON="$FLOWER_VENV/bin/python"
fi
export FLOWER_PYTHON
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
    if [ "$QUICK" = 0 ]; then
      rows+=("1000 $values 21:11 $dropout 1")
    fi
  done
  # k = 21, t = 11 aborts most rounds at 30 % dropout once there are 100
  # clients or more (`cohort check` gives the bound: a neighbourhood of 20
  # peers keeps 10 with probability 0.98, and one of 100 clients falls
  # short in 82 % of rounds). These are the smallest degrees, with
  # t = k/2 + 1, whose rounds complete 99 % of the time at 30 % dropout
  # by the same bound (`Params::dropout_tolerance`).
  rows+=("100 $values 79:40 30 $repeats")
  if [ "$QUICK" = 0 ]; then
    rows+=("1000 $values 105:53 30 1")
  fi
done
# ONLY=REGEX keeps the rows whose "CLIENTS VALUES GRAPH DROPOUT REPEATS"
# line matches, so one row can be measured again without the others.
if [ -n "${ONLY:-}" ]; then
  kept=()
  for row in "${rows[@]}"; do
    if [[ "$row" =~ $ONLY ]]; then kept+=("$row"); fi
  done
  rows=("${kept[@]}")
fi
if [ "$FLOWER" = 0 ]; then
  echo "| clients | values | graph | dropout | client ms | server ms | up MB | down MB | in sum |"
  echo "|---|---|---|---|---|---|---|---|---|"
  printf '%s\n' "${rows[@]}" | xargs -P "$JOBS" -L 1 sh -c '"$0" --row "$@"' "$BIN"
  exit
fi
# cohort's row, then Flower's on the same settings; the script merges them.
echo "| clients | values | graph | dropout | client ms cohort | client ms Flower (CPU) | Flower / cohort | server ms cohort | server ms Flower (CPU) | Flower / cohort | up MB cohort / Flower | down MB cohort / Flower | in sum cohort / Flower |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}" | xargs -P "$JOBS" -L 1 sh -c \
  'line="$("$0" --row "$@")"; "$FLOWER_PYTHON" bench/flower_secagg.py --row "$@" --cohort "$line"' "$BIN"
