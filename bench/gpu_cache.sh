#!/usr/bin/env bash
# Which of the GPU kernel cache's stores makes a run wrong when a run of other
# shapes filled it. Same setup as bench/gpu.sh (a Vulkan build at .gpu/cohort
# or .gpu/cohort.xz, Fashion-MNIST under .gpu/data, the loader .debs in .gl/).
#
# 1. a run of other shapes (4,000 clients of 32 samples, K "auto") fills a
#    cache directory;
# 2. K = 100 vectorized clients, 1 round, with a copy of that whole cache;
# 3. the same K = 100 run with a fresh cache: the reference;
# 4. the K = 100 run with a copy of one store of the filled cache at a time.
# Prints each run's accuracy and first-round time, and the cache's layout.
# A run whose accuracy differs from the reference's is what a shared cache
# breaks. Usage: bench/gpu_cache.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
CONFIG=configs/fashion_mnist/vectorized_100.toml
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh

k100=(--set trainer.rounds=1 --set trainer.vectorized_clients=100)
other=(--set trainer.rounds=1 --set clients.total_clients=4000 --set clients.per_round=4000
  --set data.partition_size=32)

# One run: name, cache directory, then cohort's --set arguments.
run() {
  local name="$1" cache="$2" run_dir
  shift 2
  COHORT_KERNEL_CACHE="$cache" .gpu/cohort run --config "$CONFIG" --quiet --gpu \
    --base "$OUT/$name" "$@" > "$OUT/$name.out" 2>&1 || echo "$name: failed: $(tail -3 "$OUT/$name.out")"
  run_dir=$(ls -d "$OUT/$name"/*/ 2>/dev/null | head -1)
  [ -n "$run_dir" ] && [ -f "$run_dir/results.csv" ] || return 0
  awk -F, -v n="$name" 'NR == 2 { printf "%-28s accuracy %s  first round %s s\n", n, $2, $4 }' "$run_dir/results.csv"
}

run other-shapes "$OUT/cache-shared" "${other[@]}"
echo "cache filled by the other shapes:"
(cd "$OUT/cache-shared" && find . -maxdepth 4 | sort | head -40 && du -sh .)
cp -r "$OUT/cache-shared" "$OUT/cache-whole"
run "after-other-shapes" "$OUT/cache-whole" "${k100[@]}"
run reference "$OUT/cache-fresh" "${k100[@]}"
# The stores: the first level of the cache with more than one entry.
level=.
while [ "$(find "$OUT/cache-shared/$level" -mindepth 1 -maxdepth 1 | wc -l)" = 1 ]; do
  level="$level/$(ls "$OUT/cache-shared/$level")"
done
for entry in "$OUT/cache-shared/$level"/*; do
  name=$(basename "$entry")
  mkdir -p "$OUT/cache-only-$name/$level"
  cp -r "$entry" "$OUT/cache-only-$name/$level/"
  run "only-$name" "$OUT/cache-only-$name" "${k100[@]}"
done
