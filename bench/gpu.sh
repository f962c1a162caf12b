#!/usr/bin/env bash
# The GPU profile, run on a machine with a GPU (here: the `device` tool's H200).
# Expects a Vulkan build of cohort at .gpu/cohort (or .gpu/cohort.xz), Fashion-MNIST
# under .gpu/data/fashion-mnist, and Debian's libvulkan1 .deb under .gl/.
# Build here:  cargo build --release -p cohort-cli --features vulkan
#              mkdir -p .gpu/data && strip -o .gpu/cohort "$CARGO_TARGET_DIR/release/cohort" && xz -T2 -f .gpu/cohort
#              cp -r ../shared/data/fashion-mnist .gpu/data/
# For each job (R1, and the seed's reference job on Fashion-MNIST) it runs --gpu
# and --cpu, prints both results and training samples/s, reports how far apart
# the global models are after round 1 (relative L2), and requires the round-1
# accuracies to agree within ACCURACY_TOLERANCE. The per-step agreement of the
# kernels is checked by the gpu_profile test (built with a GPU feature).
# Fails (non-zero) when no GPU answers: --gpu refuses to fall back to the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
ACCURACY_TOLERANCE="${ACCURACY_TOLERANCE:-0.02}"
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true

run() { # job name, config, device flag
  local name=$1 config=$2 flag=$3
  local start end
  start=$(date +%s.%N)
  .gpu/cohort run --config "$config" --quiet --base "$OUT/$name" "$flag"
  end=$(date +%s.%N)
  echo "== $name: $(awk "BEGIN { printf \"%.2f\", $end - $start }") s end to end"
  cat "$OUT/$name"/*/results.csv
  local epochs
  epochs=$(awk -F' *= *' '$1 == "epochs" { print $2 }' "$config")
  awk -F, -v e="${epochs:-1}" 'NR>1 { s += $4 * e; t += $6 } END { printf "local training: %.0f samples/s\n", s / t }' "$OUT/$name"/*/clients.csv
  grep -h "compute device" "$OUT/$name"/*/run.log | sed 's/.*device=/device: /'
}
compare_round1() { # job name
  echo "== $1: global model after round 1, GPU against CPU"
  .gpu/cohort compare "$OUT/$1-cpu"/*/checkpoints/round-0001.safetensors \
    "$OUT/$1-gpu"/*/checkpoints/round-0001.safetensors --tolerance 1e9
  paste -d, <(sed -n 2p "$OUT/$1-cpu"/*/results.csv) <(sed -n 2p "$OUT/$1-gpu"/*/results.csv) |
    awk -F, -v tol="$ACCURACY_TOLERANCE" '{ d = $2 - $12; if (d < 0) d = -d;
      printf "round-1 accuracy CPU %s, GPU %s, difference %.4f\n", $2, $12, d;
      if (d > tol) { print "difference above " tol; exit 1 } }'
}
run r1-gpu configs/fashion_mnist/fedavg_lenet5_r1.toml --gpu
run r1-cpu configs/fashion_mnist/fedavg_lenet5_r1.toml --cpu
compare_round1 r1
run reference-gpu configs/fashion_mnist/fedavg_lenet5_reference.toml --gpu
run reference-cpu configs/fashion_mnist/fedavg_lenet5_reference.toml --cpu
compare_round1 reference
# The GPU run must reach R1's reference accuracy too.
awk -F, 'END { if ($2 + 0 < 0.82) { print "GPU R1 accuracy " $2 " < 0.82"; exit 1 } }' "$OUT"/r1-gpu/*/results.csv
echo "GPU profile passed"
