#!/usr/bin/env bash
# Every zoo model's training samples/s at batch 32, cohort then PyTorch eager
# in the same run, and their ratio.
#
#   bash bench/zoo.sh                 # CPU, one thread each (builds the bench)
#   ZOO_BIN=path/to/zoo-bench bash bench/zoo.sh --gpu   # a prebuilt bench
#                                     # binary (Vulkan build) on a GPU against
#                                     # PyTorch with CUDA
#
# Extra arguments go to both sides (--samples N, --reps R, --models a,b).
set -euo pipefail
cd "$(dirname "$0")/.."
gpu=false
args=()
for arg in "$@"; do
  if [ "$arg" = "--gpu" ]; then gpu=true; else args+=("$arg"); fi
done
out=$(mktemp -d)
if [ -n "${ZOO_BIN:-}" ]; then
  run_cohort() { "$ZOO_BIN" "$@"; }
else
  run_cohort() { cargo bench -q -p cohort-train --bench zoo -- "$@"; }
fi
if $gpu; then
  run_cohort --gpu "${args[@]}" | tee "$out/cohort.txt"
  python3 bench/torch_zoo.py --device cuda "${args[@]}" | tee "$out/torch.txt"
else
  run_cohort --threads 1 "${args[@]}" | tee "$out/cohort.txt"
  python3 bench/torch_zoo.py --device cpu --threads 1 "${args[@]}" | tee "$out/torch.txt"
fi
echo "# model data cohort/s torch/s cohort/torch"
join <(grep -v '^#' "$out/cohort.txt" | awk '{print $1, $2, $NF}' | sort) \
     <(grep -v '^#' "$out/torch.txt" | awk '{print $1, $NF}' | sort) |
  awk '{printf "%s %s %s %s %.2f\n", $1, $2, $3, $4, $3 / $4}'
