#!/usr/bin/env bash
# Two builds of the zoo bench against each other and against PyTorch on one
# many-core host, everything at once, each single-thread process pinned to a
# core of its own (taskset): three runs of each build, three of
# bench/torch_zoo.py, then conv_passes (3 x 3 and 5 x 5) and
# bench/torch_conv_passes.py. The processes share the L3 and the memory, so
# only figures of one call compare. Needs 13 cores.
#
#   ZOO_OLD=<zoo bench> ZOO_NEW=<zoo bench> CONV_PASSES=<conv_passes bench> \
#     OUT=<dir> bash bench/zoo_pinned.sh
#
# With PAIRS_ONLY=1, only ZOO_NEW against PyTorch, fewer processes sharing
# the host: three of each at once on every other core, ROUNDS times
# (default 2), one line of samples/s per process:
#
#   PAIRS_ONLY=1 ZOO_NEW=<zoo bench> OUT=<dir> bash bench/zoo_pinned.sh
set -euo pipefail
cd "$(dirname "$0")/.."
: "${ZOO_NEW:?a zoo bench binary}" "${OUT:?a folder for the results}"
mkdir -p "$OUT"
lscpu | grep -E "Model name|Thread|Core|MHz" || true
if [ "${PAIRS_ONLY:-0}" = 1 ]; then
  for round in $(seq "${ROUNDS:-2}"); do
    pids=()
    for i in 1 2 3; do
      taskset -c $((2 * i)) "$ZOO_NEW" --threads 1 --samples 256 --reps 3 \
        > "$OUT/new_${round}_$i.txt" 2>&1 & pids+=($!)
      taskset -c $((2 * i + 8)) python3 bench/torch_zoo.py --device cpu --threads 1 --samples 256 \
        --reps 3 > "$OUT/torch_${round}_$i.txt" 2>&1 & pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p"; done
  done
  for f in "$OUT"/*.txt; do
    echo "== $(basename "$f") $(grep -v '^#' "$f" | awk '{print $1, $NF}' | tr '\n' ' ')"
  done
  exit 0
fi
: "${ZOO_OLD:?a zoo bench binary}" "${CONV_PASSES:?a conv_passes binary}"
pids=()
for i in 1 2 3; do
  taskset -c "$i" "$ZOO_OLD" --threads 1 --samples 256 --reps 3 > "$OUT/zoo_old_$i.txt" 2>&1 & pids+=($!)
  taskset -c $((i + 3)) "$ZOO_NEW" --threads 1 --samples 256 --reps 3 > "$OUT/zoo_new_$i.txt" 2>&1 & pids+=($!)
  taskset -c $((i + 6)) python3 bench/torch_zoo.py --device cpu --threads 1 --samples 256 --reps 3 \
    > "$OUT/torch_$i.txt" 2>&1 & pids+=($!)
done
(taskset -c 11 "$CONV_PASSES" --reps 7 > "$OUT/conv_passes3.txt" 2>&1
 taskset -c 11 "$CONV_PASSES" --reps 7 --kernel 5 --layers "32,64,14;1,32,28" > "$OUT/conv_passes5.txt" 2>&1) & pids+=($!)
taskset -c 12 python3 bench/torch_conv_passes.py > "$OUT/torch_conv_passes.txt" 2>&1 & pids+=($!)
for p in "${pids[@]}"; do wait "$p"; done
for f in "$OUT"/*.txt; do echo "== $(basename "$f")"; cat "$f"; done
