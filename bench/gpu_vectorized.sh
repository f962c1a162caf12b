#!/usr/bin/env bash
# Vectorized clients on the GPU against PyTorch's vmap, in one device session
# (issue 12, goal 4). Same setup as bench/gpu.sh: a Vulkan build of cohort at
# .gpu/cohort (or .gpu/cohort.xz), Fashion-MNIST under .gpu/data/fashion-mnist,
# Debian's libvulkan1 and glvnd .debs under .gl/, and torch with CUDA.
#
#   cohort: configs/fashion_mnist/vectorized_100.toml, 100 clients per round
#           x 10 rounds (6,000 samples each, batch 32, SGD momentum), --gpu,
#           K chosen by "auto" unless K=... is given (K=100 sets it).
#   torch:  torch_clients_gpu.py --clients 100 (sequential, vmap, vmap-graph),
#           one round's work after a warm-up.
#
# Prints cohort's end-to-end samples/s (all rounds, evaluation included), its
# local-training samples/s (clients.csv), and torch's samples/s per mode, then
# the ratios. Usage: bench/gpu_vectorized.sh [ROUNDS]   (K=100 to fix K,
# RUNS=2 to run cohort twice on the same machine, TORCH=0 to leave torch out;
# COHORT_KERNEL_CACHE=DIR keeps kernels between the runs; MODEL=cnn,
# cnn_femnist, multilayer or resnet_20 (with GroupNorm) trains that zoo model
# instead of LeNet-5, against bench/torch_zoo_vmap.py's vmap of its PyTorch
# twin; SAMPLES=N gives each client N samples instead of 6,000, on both
# sides)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
ROUNDS="${1:-10}"
CONFIG=configs/fashion_mnist/vectorized_100.toml
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
MODEL="${MODEL:-lenet5}"
TORCH_SCRIPT="${TORCH_SCRIPT:-}"
torch_args=()
if [ "$MODEL" != lenet5 ]; then
  TORCH_SCRIPT=bench/torch_zoo_vmap.py
  torch_args=(--model "$MODEL")
fi
for candidate in shared/bench/torch_clients_gpu.py ../shared/bench/torch_clients_gpu.py; do
  [ -n "$TORCH_SCRIPT" ] || { [ -f "$candidate" ] && TORCH_SCRIPT=$candidate; } || true
done
[ -n "$TORCH_SCRIPT" ] || { echo "torch_clients_gpu.py not found (set TORCH_SCRIPT)"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true

SAMPLES="${SAMPLES:-6000}"
extra=(--set "trainer.rounds=$ROUNDS" --set "trainer.model_name=$MODEL"
  --set "data.partition_size=$SAMPLES")
[ "$MODEL" = resnet_20 ] && extra+=(--set "parameters.model.norm=group")
[ -n "${K:-}" ] && extra+=(--set "trainer.vectorized_clients=$K")
round_samples=$((100 * SAMPLES))
samples=$((round_samples * ROUNDS))

# One run of cohort; sets cohort_e2e, cohort_train and cohort_steady.
run_cohort() {
  local base="$OUT/cohort-$1" start end run_dir
  start=$(date +%s.%N)
  .gpu/cohort run --config "$CONFIG" --quiet --base "$base" --gpu "${extra[@]}"
  end=$(date +%s.%N)
  # The newest run folder: an OUT shared by several invocations (one per
  # MODEL) holds earlier runs under the same base.
  run_dir=$(ls -dt "$base"/*/ | head -1)
  cat "$run_dir/results.csv"
  grep -h "compute device\|vectorized clients" "$run_dir/run.log" | sed 's/^.*INFO //' || true
  cohort_e2e=$(awk -v s="$samples" -v a="$start" -v b="$end" 'BEGIN { printf "%.0f", s / (b - a) }')
  cohort_train=$(awk -F, 'NR>1 { s += $4; t += $6 } END { printf "%.0f", s / t }' "$run_dir/clients.csv")
  echo "cohort run $1: $ROUNDS rounds x 100 clients in $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }') s:" \
    "$cohort_e2e samples/s end to end, $cohort_train samples/s local training," \
    "first round $(awk -F, 'NR == 2 { print $4 }' "$run_dir/results.csv") s"
  # Rounds after the first two (which compile and autotune every kernel the
  # run uses unless the tuning cache has them): the rate a long run settles
  # at, from results.csv's round_time.
  cohort_steady=$(awk -F, -v r="$round_samples" 'NR > 3 { t += $4; n++ } END { if (n) printf "%.0f", n * r / t; else print 0 }' "$run_dir/results.csv")
  echo "cohort run $1: steady rounds (3 on): $cohort_steady samples/s"
}

# RUNS=2 runs cohort twice on the same machine: the first run tunes and
# compiles every kernel, the second shows what every later run of this
# configuration on that machine pays. Between processes, the NVIDIA driver
# keeps its shader cache; cohort keeps tuning results and compiled kernels
# only where COHORT_KERNEL_CACHE names a directory (one per configuration:
# see README's GPU section). The ratios below are for the last run; each
# run's numbers are printed above them.
for run in $(seq 1 "${RUNS:-1}"); do
  run_cohort "$run"
  [ -z "${COHORT_KERNEL_CACHE:-}" ] || du -sh "$COHORT_KERNEL_CACHE" | sed 's/^/kernel cache: /'
done
[ "${TORCH:-1}" = 0 ] && exit 0

python3 "$TORCH_SCRIPT" "${torch_args[@]}" --data .gpu/data/fashion-mnist --clients 100 \
  --samples "$SAMPLES" | tee "$OUT/torch-$MODEL.jsonl"
for mode in vmap vmap-graph; do
  torch=$(python3 -c "import json,sys; print(next(json.loads(l)['samples_per_s'] for l in open(sys.argv[1]) if json.loads(l)['mode'] == sys.argv[2]))" "$OUT/torch-$MODEL.jsonl" "$mode")
  awk -v c="$cohort_train" -v e="$cohort_e2e" -v s="$cohort_steady" -v t="$torch" -v m="$mode" \
    'BEGIN { printf "cohort / torch %s: %.2f (local training), %.2f (end to end), %.2f (steady rounds)\n", m, c / t, e / t, s / t }'
done
[ "$MODEL" = lenet5 ] && echo "target: 344,000 samples/s (torch vmap-graph on the H200, issue 12)"
true
