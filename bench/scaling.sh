#!/usr/bin/env bash
# Distributed simulation on one machine: 1,000 Fashion-MNIST clients of 60
# samples, 100 per round, on 1, 2 and 3 ranks (one worker each; RANKS="1 2 4 8"
# for others). One rank is a
# plain `cohort run`; more are `cohort worker` ranks of a ring plan from
# `cohort place` on a one-node cluster file with one core per rank (so one
# worker per rank). Prints, per rank count,
# the median round time, the wall time, each rank's peak RSS and whether the
# final model equals the single-process one. Results in docs/SCALING.md.
#
# A rank of more than one reads only the samples of its own clients, so its
# peak RSS falls as the ranks grow; each rank holds its slice of the test set.
#
#   COHORT_DATA_DIR=../shared/data [RANKS="1 2 4 8"] [REDUCE=partial] bash bench/scaling.sh [ROUNDS]
# REDUCE sets cluster.reduce (default gather: the model is the one process's
# bit for bit; partial: one partial sum per rank, equal up to rounding, so
# the last column then reads DIFFERS where the bits differ).
# CLIENTS, PER_ROUND and PARTITION_SIZE change the job (default 1000, 100,
# 60; CLIENTS=100000 PER_ROUND=1000 is the 100,000-client job, whose
# partitions repeat the training set: iid_cyclic). EPOCHS (default 1).
# STRATA sets clients.strata (default 1: a uniform draw; a multiple of the
# ranks gives every rank its equal share of each round).
# LAUNCH=mpirun starts the ranks with `mpirun -n R cohort run` (a build
# with --features cohort-cli/mpi; MPIRUN names the launcher) instead of
# the ring plan. BIND (mpirun only, default none) is mpirun's --bind-to:
# BIND=core pins each rank to a core of its own (--map-by core), so two
# ranks never share one core's hardware threads.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-4}"
cohort="${COHORT_BIN:-target/release/cohort}"
[ -x "$cohort" ] || { echo "build first: cargo build --release --workspace" >&2; exit 1; }
[ -d "${COHORT_DATA_DIR:-}" ] || { echo "set COHORT_DATA_DIR" >&2; exit 1; }
work="$(mktemp -d)"
sampler=iid
if [ $(( ${CLIENTS:-1000} * ${PARTITION_SIZE:-60} )) -gt 60000 ]; then sampler=iid_cyclic; fi
trap 'rm -rf "$work"' EXIT

cat > "$work/scale.toml" <<EOF
[clients]
total_clients = ${CLIENTS:-1000}
per_round = ${PER_ROUND:-100}
strata = ${STRATA:-1}
[server]
random_seed = 1
payload_timeout = 600
[data]
datasource = "FashionMNIST"
download = false
partition_size = ${PARTITION_SIZE:-60}
sampler = "$sampler"
[trainer]
rounds = $rounds
epochs = ${EPOCHS:-1}
batch_size = 32
max_concurrency = 1
optimizer = "sgd"
model_name = "lenet5"
model_seed = 1
training_seed = 1
[parameters.optimizer]
learning_rate = 0.01
momentum = 0.9
EOF
if [ -n "${REDUCE:-}" ]; then
  printf '[cluster]\nreduce = "%s"\n' "$REDUCE" >> "$work/scale.toml"
fi

median_round() {
  # round_time of every round but the first (which also loads and warms up).
  tail -n +3 "$1/results.csv" | cut -d, -f4 | sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'
}

printf '%-6s %-12s %-8s %-28s %s\n' ranks median_round wall peak_rss_MiB_per_rank same_model
for ranks in ${RANKS:-1 2 3}; do
  base="$work/runs-$ranks"
  start=$(date +%s.%N)
  if [ "$ranks" = 1 ]; then
    /usr/bin/time -f '%M' -o "$work/rss-1-0" "$cohort" run --config "$work/scale.toml" --base "$base" --cpu --quiet
  elif [ "${LAUNCH:-ring}" = mpirun ]; then
    # shellcheck disable=SC2016
    bind=(--bind-to "${BIND:-none}")
    [ "${BIND:-none}" = none ] || bind+=(--map-by core)
    "${MPIRUN:-mpirun}" -n "$ranks" "${bind[@]}" -x COHORT_DATA_DIR -x W="$work" -x C="$cohort" -x B="$base" -x R="$ranks" \
      sh -c '/usr/bin/time -f %M -o "$W/rss-$R-$OMPI_COMM_WORLD_RANK" "$C" run --config "$W/scale.toml" --base "$B" --cpu --quiet'
  else
    plan="$work/plan-$ranks"
    # One core per rank: the plan gives each rank one worker.
    printf '[[nodes]]\nid = "local"\nhost = "localhost"\nmemory = "16 GiB"\ncores = %d\n' \
      "$ranks" > "$work/cluster-$ranks.toml"
    "$cohort" place --cluster "$work/cluster-$ranks.toml" --config "$work/scale.toml" \
      --backend ring --ranks "$ranks" --instance "scale$ranks" --emit "$plan" > /dev/null 2>&1
    pids=()
    for ((r = 0; r < ranks; r++)); do
      /usr/bin/time -f '%M' -o "$work/rss-$ranks-$r" "$cohort" worker --config "$work/scale.toml" \
        --plan "$plan" --rank "$r" --base "$base" --cpu --quiet &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
  fi
  wall=$(awk -v end="$(date +%s.%N)" -v start="$start" 'BEGIN { print end - start }')
  run_dir=$(ls -d "$base"/*/)
  rss=$(for ((r = 0; r < ranks; r++)); do echo $(( $(cat "$work/rss-$ranks-$r") / 1024 )); done | paste -sd/)
  if [ "$ranks" = 1 ]; then
    cp "$run_dir/model.safetensors" "$work/single.safetensors"; same="(reference)"
  elif cmp -s "$run_dir/model.safetensors" "$work/single.safetensors"; then
    same="bit for bit"
  else
    same="DIFFERS"
  fi
  printf '%-6s %-12s %-8.1f %-28s %s\n' "$ranks" "$(median_round "$run_dir")" "$wall" "$rss" "$same"
done
nproc | sed 's/^/cores: /'
# Whether two ranks may share a core's hardware threads (then BIND=core
# matters): the topology, where lscpu can tell it.
if command -v lscpu > /dev/null; then
  lscpu | grep -E '^(Model name|Thread\(s\) per core|Core\(s\) per socket|Socket\(s\)):' || true
fi
