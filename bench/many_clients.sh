#!/usr/bin/env bash
# One network-mode server and CLIENTS light protocol clients on this machine
# (crates/cohort-cli/benches/many_clients.rs): per round, the server's wall
# and CPU time to admit and aggregate every client's LeNet-5 update, and its
# peak RSS; with PROFILE=1, a perf profile of the server's second round on.
#
#   COHORT_DATA_DIR=../shared/data [COHORT_BIN=<cohort>] [CARGO_PROFILE=dev] \
#     bash bench/many_clients.sh [CLIENTS] [ROUNDS] [INFLIGHT_MIB] [WINDOW_BYTES]
#
# Results in docs/SCALING.md ("1,000 clients of one server").
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d "${COHORT_DATA_DIR:-}" ] || { echo "set COHORT_DATA_DIR" >&2; exit 1; }
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
# The clients are light; the server is COHORT_BIN when set (an optimised
# build), so the bench itself may be built in the quick dev profile.
PROFILE_NAME="${CARGO_PROFILE:-dist}"
cargo bench --locked --profile "$PROFILE_NAME" -p cohort-cli --bench many_clients --no-run 2>/dev/null
dir="$PROFILE_NAME"; [ "$dir" = dev ] && dir=debug
bench=$(ls -t "$CARGO_TARGET_DIR/$dir"/deps/many_clients-* | grep -v '\.d$' | head -1)
log="$(mktemp)"
# An empty INFLIGHT_MIB stays a placeholder, so WINDOW_BYTES keeps its place.
"$bench" "${1:-1000}" "${2:-4}" "${3:-default}" ${4:+"$4"} | tee "$log" &
runner=$!
if [ "${PROFILE:-0}" = 1 ]; then
  # The server's pid is the bench's first line; profile from the second
  # round on (round 1 includes admitting the clients and loading data).
  while ! grep -q "server pid" "$log"; do sleep 0.1; done
  pid=$(awk '/server pid/ { print $3 }' "$log")
  sleep "${PROFILE_DELAY:-8}"
  perf record -F 499 -g -p "$pid" -o "$log.perf" -- sleep "${PROFILE_SECONDS:-6}" 2>/dev/null || true
  wait "$runner"
  perf report -i "$log.perf" --no-children --percent-limit 2 --stdio 2>/dev/null | grep -v "^$" | head -60
else
  wait "$runner"
fi
