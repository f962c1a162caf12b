#!/usr/bin/env bash
# The model zoo on a GPU machine (an NVIDIA H200 through Vulkan), in one go:
#  1. every zoo model's training samples/s at batch 32 against PyTorch eager
#     with CUDA (bench/zoo.sh --gpu), and on the host's CPU, one thread each;
#  2. resnet_20 (group norm) on bench/zoo_accuracy.toml, 30 rounds, cohort on
#     the GPU and plain PyTorch FedAvg with CUDA on the same clients and
#     samples (bench/pytorch_fedavg.py).
# Expects what bench/gpu_env.sh does (.gpu/cohort.xz, .gl/*.deb, Fashion-MNIST
# under .gpu/data) and the zoo bench built with the Vulkan feature at
# .gpu/zoo.xz:
#   cargo bench --no-run -p cohort-train --features vulkan --bench zoo
#   strip -o .gpu/zoo "$CARGO_TARGET_DIR"/release/deps/zoo-<hash> && xz -T2 -f .gpu/zoo
# Results go to $OUT (zoo.txt, resnet_20.json and the run folder).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
[ -f .gpu/zoo ] || xz -dk .gpu/zoo.xz
chmod +x .gpu/zoo
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'

ZOO_BIN=.gpu/zoo bash bench/zoo.sh --gpu --samples 1024 --reps 3 | tee "$OUT/zoo.txt"
# The same host's CPU, one thread each side (fewer samples: the CIFAR models
# take seconds a batch on one core).
ZOO_BIN=.gpu/zoo bash bench/zoo.sh --samples 128 --reps 2 | tee "$OUT/zoo_cpu.txt"

start=$(date +%s.%N)
.gpu/cohort run --config bench/zoo_accuracy.toml --gpu --quiet --base "$OUT/runs" \
  --set trainer.model_name=resnet_20 --set parameters.model.norm=group
end=$(date +%s.%N)
echo "== cohort resnet_20: $(awk "BEGIN { printf \"%.1f\", $end - $start }") s end to end"
run=$(ls -d "$OUT"/runs/*/ | head -1)
tail -3 "$run/results.csv"
.gpu/cohort partitions --config "$run/config.toml" --json "$OUT/parts.json" > /dev/null
python3 bench/pytorch_fedavg.py --run "$run" --partitions "$OUT/parts.json" \
  --data "$COHORT_DATA_DIR" --device cuda --out "$OUT/resnet_20.json" 2> "$OUT/pytorch.log"
cat "$OUT/resnet_20.json"
