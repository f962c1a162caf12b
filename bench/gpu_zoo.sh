#!/usr/bin/env bash
# The model zoo's training speed on a GPU machine (an NVIDIA H200 through
# Vulkan), in one go: every model's training samples/s at batch 32 on the
# GPU against PyTorch eager with CUDA (bench/zoo.sh --gpu), one model at a
# time.
#
# A model's first GPU epoch pays for autotuning and for compiling its
# kernels (cubecl to SPIR-V, the driver to machine code): minutes for the
# CIFAR models on a fresh machine. So the script first trains one epoch of
# every model at once, each in a process of its own with a kernel cache of
# its own (COHORT_KERNEL_CACHE, keyed by model and sample count), so the
# compilation runs on all the host's cores; each model's wall time there is
# its cold start (with the others beside it). Then each model is measured
# alone, its kernels from that cache: best of --reps epochs after a warm-up
# epoch, against PyTorch's. Autotuning timed its candidates beside the other
# models' work, which can pick a slower kernel; it cannot change a result.
#
# Expects the Vulkan loader and glvnd .debs in .gl/ (see bench/gpu_env.sh)
# and the zoo bench built with the Vulkan feature at .gpu/zoo.xz:
#   cargo bench --no-run -p cohort-train --features vulkan --bench zoo
#   strip -o .gpu/zoo "$CARGO_TARGET_DIR"/release/deps/zoo-<hash> && xz -T2 -f .gpu/zoo
# WARM_LIMIT (seconds, default 330) bounds the parallel first epochs,
# GPU_MODEL_LIMIT (default 60) each model's measurement; ZOO_CPU=1 also
# measures the host's CPU first, one thread each side. MODELS (comma
# separated) picks models. PHASE=warm or PHASE=measure runs one of the two
# phases (two calls on one machine, COHORT_KERNEL_CACHE naming a directory
# that outlives the first; by default under $OUT). Results go to $OUT (zoo_warm.txt, zoo_gpu.txt,
# zoo_cpu.txt).
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

MODELS="${MODELS:-multilayer,cnn,cnn_femnist,lstm_shakespeare,resnet_20,resnet_18,vgg_11}"
export COHORT_KERNEL_CACHE="${COHORT_KERNEL_CACHE:-$OUT/kernels}"
samples=1024

if [ "${ZOO_CPU:-0}" = 1 ]; then
  # Fewer samples: the CIFAR models take seconds a batch on one core.
  ZOO_BIN=.gpu/zoo bash bench/zoo.sh --samples 128 --reps 2 | tee "$OUT/zoo_cpu.txt"
fi

if [ "${PHASE:-all}" != measure ]; then
  echo "== first epochs, all models at once (limit ${WARM_LIMIT:-330} s)"
  : > "$OUT/zoo_warm.txt"
  for model in ${MODELS//,/ }; do
    (
      started=$SECONDS
      if timeout "${WARM_LIMIT:-330}" .gpu/zoo --gpu --samples "$samples" --reps 0 \
        --models "$model" > "$OUT/warm_$model.log" 2>&1; then
        echo "$model first epoch $((SECONDS - started)) s" >> "$OUT/zoo_warm.txt"
      else
        echo "$model first epoch: not done within the limit (status $?)" >> "$OUT/zoo_warm.txt"
      fi
    ) &
  done
  wait
  cat "$OUT/zoo_warm.txt"
fi
[ "${PHASE:-all}" = warm ] && exit 0

: > "$OUT/zoo_gpu.txt"
for model in ${MODELS//,/ }; do
  echo "== $model on the GPU (limit ${GPU_MODEL_LIMIT:-60} s)"
  timeout "${GPU_MODEL_LIMIT:-60}" env ZOO_BIN=.gpu/zoo bash bench/zoo.sh --gpu \
    --samples "$samples" --reps 3 --models "$model" | tee -a "$OUT/zoo_gpu.txt" ||
    echo "$model: no figure within the limit (status $?)" | tee -a "$OUT/zoo_gpu.txt"
done
nvidia-smi --query-gpu=memory.used --format=csv,noheader || true
