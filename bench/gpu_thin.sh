#!/usr/bin/env bash
# The measurement that decides COHORT_GPU_THIN_PRODUCTS's default, in one
# device call on one binary (docs/BENCHMARKS.md, "Thin products in cohort's
# own kernels"): the GPU profile's tests of the thin products, a cold
# 10-round run of vectorized LeNet-5 with the switch off and on (each with
# empty kernel and driver caches, bench/gpu_cold.sh), PyTorch's whole job
# beside them, then a kernel profile of the step with the switch on.
#
#   COHORT=<untuned cohort> GPU_PROFILE=<gpu_profile test binary> \
#     DATA_DIR=<folder with fashion-mnist/> OUT=<dir> bash bench/gpu_thin.sh
#
# Same setup as bench/gpu_cold.sh (loader packages in .gl/); the kernel
# profile reads .gpu/cohort and .gpu/data, which this script links.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${COHORT:?an untuned cohort binary}" "${GPU_PROFILE:?the gpu_profile test binary}"
: "${DATA_DIR:?a folder holding fashion-mnist/}" "${OUT:?a folder for the results}"
mkdir -p "$OUT" .gpu
ln -sfn "$(realpath "$COHORT")" .gpu/cohort
ln -sfn "$(realpath "$DATA_DIR")" .gpu/data
echo "== the thin products' tests"
COHORT_BIN="$(realpath "$COHORT")" COHORT_DATA_DIR="$(realpath "$DATA_DIR")" \
  "$GPU_PROFILE" thin chunked narrow --nocapture --test-threads 1
echo "== cold runs, shipped then thin"
DATA_DIR="$DATA_DIR" BINS="shipped=$COHORT" TORCH=0 OUT="$OUT/shipped" bash bench/gpu_cold.sh 10
COHORT_GPU_THIN_PRODUCTS=1 DATA_DIR="$DATA_DIR" BINS="thin=$COHORT" TORCH=0 OUT="$OUT/thin" \
  bash bench/gpu_cold.sh 10
echo "== PyTorch's job"
python3 bench/torch_fedavg_gpu.py --data "$DATA_DIR/fashion-mnist"
echo "== kernel profile, thin products on"
COHORT_GPU_THIN_PRODUCTS=1 COHORT_KERNEL_CACHE=off OUT="$OUT/profile" bash bench/gpu_kernel_profile.sh 3
