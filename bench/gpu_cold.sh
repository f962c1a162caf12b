#!/usr/bin/env bash
# What a first GPU run pays, build against build: each build in BINS runs
# configs/fashion_mnist/vectorized_100.toml (100 clients of 6,000 samples a
# round, batch 32, all 100 as one stacked batch) as a run on a machine that
# has never run it: an empty kernel cache (COHORT_KERNEL_CACHE) and an empty
# driver shader cache (__GL_SHADER_DISK_CACHE_PATH) of its own, so no build
# profits from another's compilations. Then PyTorch's vmap of the same
# clients (torch_clients_gpu.py, one round's work after a warm-up).
#
#   BINS="tuned=.gpu/cohort untuned=.gpu/cohort-untuned" bash bench/gpu_cold.sh [ROUNDS]
#
# A build is a path to a Vulkan build of `cohort` (a missing one is unpacked
# from PATH.xz). MODELS="lenet5 cnn" trains each model in turn with every
# build (zoo models take 3 rounds). Setup as bench/gpu.sh: .gl/ holds the
# Vulkan loader .debs; DATA_DIR names the folder holding fashion-mnist/
# (default .gpu/data); TORCH_SCRIPT the PyTorch reference (TORCH=0 leaves it
# out). Prints, for each build and model: seconds end to end, the first
# round, and the steady rounds' samples/s (rounds 3 on).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS="${1:-10}"
OUT="${OUT:-$(mktemp -d)}"
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
export COHORT_DATA_DIR="${DATA_DIR:-$COHORT_DATA_DIR}"
CONFIG=configs/fashion_mnist/vectorized_100.toml
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true

cold_run() {
  local name=$1 bin=$2 model=$3 rounds=$4 kernels shaders start end run_dir
  kernels=$(mktemp -d)
  shaders=$(mktemp -d)
  start=$(date +%s.%N)
  COHORT_KERNEL_CACHE=$kernels __GL_SHADER_DISK_CACHE_PATH=$shaders \
    "$bin" run --config "$CONFIG" --quiet --base "$OUT/$name-$model" --gpu \
    --set "trainer.rounds=$rounds" --set "trainer.model_name=$model" \
    --set trainer.vectorized_clients=100
  end=$(date +%s.%N)
  run_dir=$(ls -dt "$OUT/$name-$model"/*/ | head -1)
  cat "$run_dir/results.csv"
  echo "$name $model: $rounds rounds in $(awk -v a="$start" -v b="$end" 'BEGIN { printf "%.2f", b - a }') s end to end;" \
    "first round $(awk -F, 'NR == 2 { print $4 }' "$run_dir/results.csv") s;" \
    "steady rounds (3 on) $(awk -F, 'NR > 3 { t += $4; n++ } END { if (n) printf "%.0f", n * 600000 / t; else print "-" }' "$run_dir/results.csv") samples/s;" \
    "kernel cache $(du -sh "$kernels" | cut -f1), driver cache $(du -sh "$shaders" | cut -f1)"
}

for model in ${MODELS:-lenet5}; do
  rounds=$ROUNDS
  [ "$model" = lenet5 ] || rounds=3
  for entry in $BINS; do
    name=${entry%%=*}
    bin=${entry#*=}
    [ -f "$bin" ] || xz -dk "$bin.xz"
    chmod +x "$bin"
    cold_run "$name" "$bin" "$model" "$rounds"
  done
done
[ "${TORCH:-1}" = 0 ] && exit 0
python3 "${TORCH_SCRIPT:-.gpu/torch_clients_gpu.py}" --clients 100
