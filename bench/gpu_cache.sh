#!/usr/bin/env bash
# The GPU kernel cache against runs of other shapes. Same setup as
# bench/gpu.sh (a Vulkan build at .gpu/cohort or .gpu/cohort.xz,
# Fashion-MNIST under .gpu/data, the loader .debs in .gl/).
#
# cohort keeps one cache subdirectory per configuration under
# COHORT_KERNEL_CACHE. Each run below is K = 100 vectorized LeNet-5 clients
# for 1 round unless named "other"; its accuracy is compared with the
# reference's, a run with an empty cache.
#
#   STAGE=1: reference (empty cache); other (4,000 clients of 32 samples, K
#            "auto") fills a cache; shared: the K = 100 run with the other
#            configuration's cache copied into its own subdirectory (what a
#            cache shared between shapes did before the subdirectories);
#            again: the K = 100 run with its own filled cache (what a second
#            run of one configuration does).
#   STAGE=2: only-<store>: as "shared", with one store of the other
#            configuration's cache at a time; one-root: "other" then K = 100
#            sharing one COHORT_KERNEL_CACHE, as users run them.
# Usage: OUT=DIR STAGE=1|2 bash bench/gpu_cache.sh   (STAGE=2 reuses STAGE=1's OUT)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
CONFIG=configs/fashion_mnist/vectorized_100.toml
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh

k100=(--set trainer.rounds=1 --set trainer.vectorized_clients=100)
other=(--set trainer.rounds=1 --set clients.total_clients=4000 --set clients.per_round=4000
  --set data.partition_size=32)

# One run: name, cache root, then cohort's --set arguments. Prints its
# accuracy and first-round time.
run() {
  local name="$1" cache="$2" run_dir
  shift 2
  local started=$SECONDS
  COHORT_KERNEL_CACHE="$cache" .gpu/cohort run --config "$CONFIG" --quiet --gpu \
    --base "$OUT/$name" "$@" > "$OUT/$name.out" 2>&1 || echo "$name: failed: $(tail -3 "$OUT/$name.out")"
  run_dir=$(ls -d "$OUT/$name"/*/ 2>/dev/null | head -1)
  [ -n "$run_dir" ] && [ -f "$run_dir/results.csv" ] || return 0
  awk -F, -v n="$name" -v w=$((SECONDS - started)) \
    'NR == 2 { printf "%-24s accuracy %s  first round %6.1f s  wall %d s\n", n, $2, $4, w }' "$run_dir/results.csv"
}

# The one configuration subdirectory under a cache root.
key_dir() { find "$1" -mindepth 1 -maxdepth 1 -type d | head -1; }

if [ "${STAGE:-1}" = 1 ]; then
  run reference "$OUT/root-reference" "${k100[@]}"
  run other "$OUT/root-other" "${other[@]}"
  mine=$(basename "$(key_dir "$OUT/root-reference")")
  theirs=$(key_dir "$OUT/root-other")
  echo "configuration directories: K = 100 $mine, other $(basename "$theirs")"
  echo "the other configuration's cache:"
  (cd "$theirs" && find . -maxdepth 3 | sort | head -30 && du -sh .)
  mkdir -p "$OUT/root-shared" && cp -r "$theirs" "$OUT/root-shared/$mine"
  run shared "$OUT/root-shared" "${k100[@]}"
  cp -r "$OUT/root-reference" "$OUT/root-again"
  run again "$OUT/root-again" "${k100[@]}"
else
  mine=$(basename "$(key_dir "$OUT/root-reference")")
  theirs=$(key_dir "$OUT/root-other")
  # The stores: the first level of the cache with more than one entry.
  level=.
  while [ "$(find "$theirs/$level" -mindepth 1 -maxdepth 1 | wc -l)" = 1 ]; do
    level="$level/$(ls "$theirs/$level")"
  done
  for entry in "$theirs/$level"/*; do
    store=$(basename "$entry")
    mkdir -p "$OUT/root-only-$store/$mine/$level"
    cp -r "$entry" "$OUT/root-only-$store/$mine/$level/"
    run "only-$store" "$OUT/root-only-$store" "${k100[@]}"
  done
  run one-root-other "$OUT/root-one" "${other[@]}"
  run one-root "$OUT/root-one" "${k100[@]}"
fi
