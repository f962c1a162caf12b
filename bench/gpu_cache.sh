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
#            run of one configuration does); one-root: "other" then K = 100
#            under one COHORT_KERNEL_CACHE, as users run them.
#   STAGE=2: copied: as "shared", with the other configuration's database
#            (cubecl keeps every store in one default.db) copied through
#            SQLite; store-N: the same with only the entries of one store.
# Usage: OUT=DIR STAGE=1|2 bash bench/gpu_cache.sh   (STAGE=2 reuses STAGE=1's
# OUT, or fills a cache itself; MINE names the K = 100 subdirectory then)
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
  run one-root-other "$OUT/root-one" "${other[@]}"
  run one-root "$OUT/root-one" "${k100[@]}"
else
  # The K = 100 configuration's subdirectory name (its config's result hash
  # and cohort's version), from STAGE=1's reference run or given.
  # Without STAGE=1's OUT or MINE, the reference run names it (and gives
  # this stage's accuracy to compare with).
  [ -n "${MINE:-}" ] || [ -d "$OUT/root-reference" ] || run reference "$OUT/root-reference" "${k100[@]}"
  mine="${MINE:-$(basename "$(key_dir "$OUT/root-reference")")}"
  [ -n "$mine" ] || { echo "error: no K = 100 cache subdirectory to copy into (set MINE)" >&2; exit 1; }
  [ -d "$OUT/root-other" ] || run other "$OUT/root-other" "${other[@]}"
  theirs=$(key_dir "$OUT/root-other")
  # cubecl keeps every store in one database (default.db): a table of
  # entries, each named by its store, and a table of metadata. A copy made
  # through SQLite with everything (the control), then with the entries of
  # one store at a time.
  python3 - "$theirs/default.db" "$OUT/stores" <<'PY'
import sqlite3, sys
db = sqlite3.connect(sys.argv[1])
columns = db.execute("PRAGMA table_info(entries)").fetchall()
print("entries columns:", [(c[1], c[2]) for c in columns])
print("meta:", db.execute("SELECT * FROM meta").fetchall())
best = None
for column in (c[1] for c in columns):
    distinct = db.execute(f'SELECT COUNT(DISTINCT "{column}") FROM entries').fetchone()[0]
    if 1 < distinct <= 40 and best is None:
        best = column
groups = []
if best:
    groups = db.execute(f'SELECT "{best}", COUNT(*) FROM entries GROUP BY "{best}" ORDER BY COUNT(*) DESC').fetchall()
    for value, count in groups:
        print(f"  {best} = {str(value)[:80]!r}: {count} entries")
with open(sys.argv[2], "w") as out:
    out.write(f"{best}\n")
    for value, _ in groups:
        out.write(f"{value}\n")
PY
  copy_db() { # target, column, value ('' keeps every entry)
    python3 - "$theirs/default.db" "$1" "$2" "$3" <<'PY'
import sqlite3, sys
source, target, column, value = sys.argv[1:]
copy = sqlite3.connect(target)
sqlite3.connect(source).backup(copy)
if value:
    copy.execute(f'DELETE FROM entries WHERE CAST("{column}" AS TEXT) != ?', (value,))
copy.commit()
print(target, "keeps", copy.execute("SELECT COUNT(*) FROM entries").fetchone()[0], "entries")
copy.close()
PY
  }
  column=$(head -1 "$OUT/stores")
  if [ -z "${SKIP_COPIED:-}" ]; then
    mkdir -p "$OUT/root-copied/$mine" && copy_db "$OUT/root-copied/$mine/default.db" "$column" ""
    run copied "$OUT/root-copied" "${k100[@]}"
  fi
  # One store at a time, by the prefix of its namespace: tuning results
  # (autotune/), compiled SPIR-V (vulkan/), throughput probes (throughput/).
  for prefix in ${STORES:-autotune/ vulkan/ throughput/}; do
    name=${prefix%/}
    mkdir -p "$OUT/root-store-$name/$mine"
    python3 - "$theirs/default.db" "$OUT/root-store-$name/$mine/default.db" "$prefix" <<'PY'
import sqlite3, sys
source, target, prefix = sys.argv[1:]
copy = sqlite3.connect(target)
sqlite3.connect(source).backup(copy)
copy.execute("DELETE FROM entries WHERE substr(namespace, 1, ?) != ?", (len(prefix), prefix))
copy.commit()
print(target, "keeps", copy.execute("SELECT COUNT(*) FROM entries").fetchone()[0], "entries")
copy.close()
PY
    run "store-$name" "$OUT/root-store-$name" "${k100[@]}"
  done
fi
