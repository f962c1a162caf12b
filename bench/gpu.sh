#!/usr/bin/env bash
# The GPU profile, run on a machine with a GPU (here: the `device` tool's H200).
# Expects a wgpu build of cohort at .gpu/cohort (or .gpu/cohort.xz), Fashion-MNIST
# under .gpu/data/fashion-mnist, and Debian's libvulkan1 .deb under .gl/.
# Build here:  cargo build --release -p cohort-cli --features wgpu
#              mkdir -p .gpu/data && strip -o .gpu/cohort "$CARGO_TARGET_DIR/release/cohort" && xz -T2 -f .gpu/cohort
#              cp -r ../shared/data/fashion-mnist .gpu/data/
# Fails (non-zero) when no GPU answers: --gpu refuses to fall back to the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
for f in .gl/*.deb; do dpkg -x "$f" /; done
ldconfig
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
[ -f .gpu/cohort ] || xz -dk .gpu/cohort.xz
chmod +x .gpu/cohort
export COHORT_DATA_DIR="$PWD/.gpu/data"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true

run() { # name, extra args...
  local name=$1; shift
  local start end
  start=$(date +%s.%N)
  .gpu/cohort run --config configs/fashion_mnist/fedavg_lenet5_r1.toml --quiet --base "$OUT/$name" "$@"
  end=$(date +%s.%N)
  echo "== $name: $(awk "BEGIN { printf \"%.2f\", $end - $start }") s end to end"
  cat "$OUT/$name"/*/results.csv
  awk -F, 'NR>1 { s += $4; t += $6 } END { printf "local training: %.0f samples/s\n", s / t }' "$OUT/$name"/*/clients.csv
  grep -h "compute device" "$OUT/$name"/*/run.log | sed 's/.*device=/device: /'
}
run gpu --gpu
run cpu --cpu
# The GPU run must reach R1's reference accuracy too.
awk -F, 'END { if ($2 + 0 < 0.82) { print "GPU R1 accuracy " $2 " < 0.82"; exit 1 } }' "$OUT"/gpu/*/results.csv
echo "GPU profile passed"
