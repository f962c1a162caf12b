#!/usr/bin/env bash
# The model zoo's training speed on a GPU machine (an NVIDIA H200 through
# Vulkan), in one go: every model's training samples/s at batch 32 on the
# host's CPU, one thread each side (bench/zoo.sh), then on the GPU against
# PyTorch eager with CUDA (bench/zoo.sh --gpu), one model at a time under a
# time limit each, so that one model's first-run autotuning cannot take the
# others' figures with it.
# Expects the Vulkan loader and glvnd .debs in .gl/ (see bench/gpu_env.sh)
# and the zoo bench built with the Vulkan feature at .gpu/zoo.xz:
#   cargo bench --no-run -p cohort-train --features vulkan --bench zoo
#   strip -o .gpu/zoo "$CARGO_TARGET_DIR"/release/deps/zoo-<hash> && xz -T2 -f .gpu/zoo
# GPU_MODEL_LIMIT (seconds, default 150) bounds each model's GPU step;
# CUBECL_AUTOTUNE_LEVEL is passed through (cubecl's own setting). Results go
# to $OUT (zoo_cpu.txt, zoo_gpu.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
fi
[ -f .gpu/zoo ] || xz -dk .gpu/zoo.xz
chmod +x .gpu/zoo
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
lscpu | grep -E '^Model name|^CPU\(s\)' || true

# The CPU first, one thread each side (fewer samples: the CIFAR models take
# seconds a batch on one core).
ZOO_BIN=.gpu/zoo bash bench/zoo.sh --samples 128 --reps 2 | tee "$OUT/zoo_cpu.txt"

: > "$OUT/zoo_gpu.txt"
for model in multilayer cnn cnn_femnist lstm_shakespeare resnet_20 resnet_18 vgg_11; do
  echo "== $model on the GPU (limit ${GPU_MODEL_LIMIT:-150} s)"
  timeout "${GPU_MODEL_LIMIT:-150}" env ZOO_BIN=.gpu/zoo bash bench/zoo.sh --gpu \
    --samples 1024 --reps 3 --models "$model" | tee -a "$OUT/zoo_gpu.txt" ||
    echo "$model: no figure within the limit (status $?)" | tee -a "$OUT/zoo_gpu.txt"
done
