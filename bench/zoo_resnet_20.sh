#!/usr/bin/env bash
# resnet_20 (group norm) against plain PyTorch FedAvg on the same clients and
# samples (docs/BENCHMARKS.md, "Accuracy against plain PyTorch FedAvg on the
# same clients"), and cohort's peak memory as the federation grows from 100
# to 10,000 clients ("Memory of a resnet_20 federation"; iid partitions: a
# Dirichlet(0.5) draw cannot give each of 10,000 clients a sample).
#
#   COHORT=path/to/cohort [SEED=N] [SAME_INIT=1] [SAME_ORDER=1] [THREADS=N] [MODEL=cnn] bash bench/zoo_resnet_20.sh accuracy [cpu|cuda]
#   COHORT=path/to/cohort [SAME_INIT=1] bash bench/zoo_resnet_20.sh cohort   # cohort's side alone
#   [TAG=name] [PYTORCH_ARGS="--cudnn-benchmark"] bash bench/zoo_resnet_20.sh pytorch [cpu|cuda] RUN_DIR PARTS_JSON
#   COHORT=path/to/cohort bash bench/zoo_resnet_20.sh memory [CLIENTS...]
#
# accuracy: bench/zoo_accuracy.toml with resnet_20 and group norm, 30 rounds
# of 10 of 100 clients, cohort on the CPU (THREADS workers of one thread each, default 10),
# then PyTorch with the given device. SAME_INIT=1: both sides start from one
# initial model (below). memory: one round of 10 clients from
# federations of 100, 1,000 and 10,000 clients; peak RSS of the cohort
# process from getrusage. Needs COHORT_DATA_DIR with Fashion-MNIST; results
# go to $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
COHORT="${COHORT:-cohort}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
mode="${1:-accuracy}"
# cohort's side on the CPU unless COHORT_DEVICE=--gpu.
COHORT_DEVICE="${COHORT_DEVICE:---cpu}"
# MODEL (accuracy, cohort): another model of bench/zoo_accuracy.toml's job
# (multilayer, cnn) in place of resnet_20 with group norm; the results are
# named after it.
MODEL="${MODEL:-resnet_20}"
job=(--set trainer.model_name="$MODEL")
case "$MODEL" in
resnet_*) job+=(--set parameters.model.norm=group) ;;
esac
# SEED (accuracy, cohort): another partition, selection, initial model and
# training stream on cohort's side, and torch.manual_seed(SEED) on PyTorch's.
SEED="${SEED:-}"
if [ -n "$SEED" ]; then
  job+=(--set data.random_seed="$SEED" --set server.random_seed="$SEED"
    --set trainer.model_seed="$SEED" --set trainer.training_seed="$SEED")
fi
# SAME_INIT=1 (accuracy, cohort): one initial model for both sides. PyTorch's
# twin drawn after torch.manual_seed(SEED, default 0), the model PyTorch's
# side starts from without it, is written to $OUT/initial.safetensors and
# given to cohort as trainer.initial_model (in place of trainer.model_seed's
# draw); bench/pytorch_fedavg.py reads that key from the run's config.toml
# and loads the file with strict=True. Both evaluate it before round 1.
SAME_INIT="${SAME_INIT:-}"
initial=()
# SAME_ORDER=1 (accuracy): the partitions file carries cohort's sample order
# for every client, round and epoch (`cohort partitions --sample-orders`), and
# bench/pytorch_fedavg.py trains its batches in that order; with SAME_INIT=1
# the two sides then differ by floating-point rounding alone.
SAME_ORDER="${SAME_ORDER:-}"
# THREADS: cohort's workers (trainer.max_concurrency, one thread each) and
# PyTorch's intra-op threads.
THREADS="${THREADS:-10}"

# Peak resident memory of a command, in MiB (the largest of it and its
# children: cohort's workers are threads, so this is the cohort process).
peak_rss() {
  python3 - "$@" <<'PY'
import resource, subprocess, sys
status = subprocess.run(sys.argv[1:]).returncode
if status != 0:
    sys.exit(f"error: {sys.argv[1:]} exited with {status}")
print(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f}")
PY
}

# The shared initial model of SAME_INIT=1, drawn for the job's model and
# options as `cohort check` prints them.
write_initial() {
  "$COHORT" check --config bench/zoo_accuracy.toml "${job[@]}" > "$OUT/job.toml"
  python3 bench/pytorch_fedavg.py --write-initial "$OUT/initial.safetensors" \
    --config "$OUT/job.toml" --seed "${SEED:-0}"
  initial=(--set trainer.initial_model="$OUT/initial.safetensors")
}

run_cohort() {
  [ -z "$SAME_INIT" ] || write_initial
  start=$(date +%s.%N)
  "$COHORT" run --config bench/zoo_accuracy.toml "$COHORT_DEVICE" --quiet --base "$OUT/runs" \
    "${job[@]}" ${initial[@]+"${initial[@]}"} --set trainer.max_concurrency="$THREADS"
  end=$(date +%s.%N)
  echo "== cohort $MODEL: $(awk "BEGIN { printf \"%.1f\", $end - $start }") s end to end"
  run=$(ls -d "$OUT"/runs/*/ | head -1)
  tail -3 "$run/results.csv"
  "$COHORT" partitions --config "$run/config.toml" --json "$OUT/parts.json" \
    ${SAME_ORDER:+--sample-orders} > /dev/null
  if [ -n "$SAME_INIT" ]; then
    echo "== cohort on the initial model (PyTorch's: round 0 in pytorch.log and the JSON)"
    "$COHORT" evaluate --config "$run/config.toml" --model "$OUT/initial.safetensors" "$COHORT_DEVICE"
  fi
}

# PyTorch on a finished cohort run folder $1 with its partitions $2; its
# result in $OUT/$MODEL$TAG.json and its log in $OUT/pytorch$TAG.log, with
# PYTORCH_ARGS passed on (--cudnn-benchmark, --tf32: bench/pytorch_fedavg.py).
TAG="${TAG:-}"
run_pytorch() {
  # shellcheck disable=SC2086
  python3 bench/pytorch_fedavg.py --run "$1" --partitions "$2" \
    --data "$COHORT_DATA_DIR" --device "$device" --threads "$THREADS" --seed "${SEED:-0}" \
    ${PYTORCH_ARGS:-} --out "$OUT/$MODEL$TAG.json" 2> "$OUT/pytorch$TAG.log"
  cat "$OUT/$MODEL$TAG.json"
}

device="${2:-cpu}"
case "$mode" in
accuracy)
  run_cohort
  run_pytorch "$(ls -d "$OUT"/runs/*/ | head -1)" "$OUT/parts.json"
  ;;
cohort)
  run_cohort
  ;;
pytorch)
  # bench/zoo_resnet_20.sh pytorch DEVICE RUN_DIR PARTS_JSON
  run_pytorch "$3" "$4"
  ;;
memory)
  echo "# clients peak_rss_MiB wall_s"
  shift
  [ $# -gt 0 ] || set -- 100 1000 10000
  for clients in "$@"; do
    start=$(date +%s.%N)
    rss=$(peak_rss "$COHORT" run --config bench/zoo_accuracy.toml --cpu --quiet \
      --base "$OUT/memory-$clients" "${job[@]}" --rounds 1 --set data.sampler=iid \
      --set clients.total_clients="$clients" --set trainer.max_concurrency=10)
    end=$(date +%s.%N)
    echo "$clients $rss $(awk "BEGIN { printf \"%.1f\", $end - $start }")"
  done
  ;;
*)
  echo "usage: bench/zoo_resnet_20.sh accuracy|cohort|pytorch|memory (see the header)" >&2
  exit 2
  ;;
esac
