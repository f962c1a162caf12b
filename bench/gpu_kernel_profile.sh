#!/usr/bin/env bash
# A kernel-level profile of vectorized clients on the GPU (issue 12, goal 5):
# every kernel cubecl launches, timed on the device by cubecl's own profiler
# (timestamp queries around each dispatch), summed by kernel name.
#
# Same setup as bench/gpu_vectorized.sh (a Vulkan build at .gpu/cohort or
# .gpu/cohort.xz, Fashion-MNIST under .gpu/data, loader packages in .gl/).
# Runs configs/fashion_mnist/vectorized_100.toml with K=100 for ROUNDS rounds
# (default 5; the first two include compilation and autotuning) and
# prints, for the last round: kernels launched per training step, device time per step, and
# the kernels that take the most time.
#
# Usage: bench/gpu_kernel_profile.sh [ROUNDS]   (extra env passes through,
# e.g. COHORT_VECTORIZED_AUTODIFF=1; MODEL=cnn, multilayer or resnet_20
# (with GroupNorm) profiles that zoo model instead of LeNet-5, and SAMPLES=N
# gives each client N samples instead of 6,000, as in gpu_vectorized.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
ROUNDS="${1:-5}"
# shellcheck source=bench/gpu_env.sh
source bench/gpu_env.sh
log="$OUT/kernels.log"
# cubecl reads cubecl.toml from the working directory up (cohort keeps its
# settings and sets its caches: with COHORT_KERNEL_CACHE naming the directory
# a bench/gpu_vectorized.sh run of K=100 filled, no round here tunes or
# compiles).
[ ! -e cubecl.toml ] || { echo "cubecl.toml exists: move it away first"; exit 1; }
trap 'rm -f cubecl.toml' EXIT
cat > cubecl.toml <<EOF
[profiling]
logger = { level = "basic", file = "$log", append = false }
EOF
MODEL="${MODEL:-lenet5}"
SAMPLES="${SAMPLES:-6000}"
extra=(--set "trainer.model_name=$MODEL" --set "data.partition_size=$SAMPLES")
[ "$MODEL" = resnet_20 ] && extra+=(--set "parameters.model.norm=group")
.gpu/cohort run --config configs/fashion_mnist/vectorized_100.toml --quiet --base "$OUT/profiled" \
  --gpu --set "trainer.rounds=$ROUNDS" --set trainer.vectorized_clients=100 "${extra[@]}"
# One summary per read back to the host; training a round ends with one.
python3 - "$log" "$(( (SAMPLES + 31) / 32 ))" <<'EOF'
import re, sys
from collections import defaultdict
units = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}
rounds, current = [], []
for line in open(sys.argv[1], encoding="utf-8", errors="replace"):
    m = re.match(r"\|\s*([0-9.]+)(ns|µs|us|ms|s)\s*\|\s*(.+)$", line.strip())
    if m:
        current.append((float(m.group(1)) * units[m.group(2)], m.group(3).strip()))
    elif current and len(current) > 1000:
        rounds.append(current); current = []
if current:
    rounds.append(current)
print("launches between reads:", [len(r) for r in rounds])
# The last round's training: of the last few chunks, the one with the most
# launches (an evaluation launches far fewer, though a deep model's can pass
# a thousand).
last = max([r for r in rounds if len(r) >= 1000][-4:], key=len)
# Autotune's roofline probes, where tuning is still going on: not training.
probes = [t for t, name in last if "DirectThroughput" in name]
if probes:
    print(f"autotune probes in that round: {len(probes)} launches, {sum(probes):.3f} s (left out below)")
last = [(t, name) for t, name in last if "DirectThroughput" not in name]
# A read back to the host does not come every round, so a chunk may span
# several: every matrix product of the step runs once a step, so the least
# launched of them (among those launched at least a round's steps,
# ceil(SAMPLES / 32), which leaves autotune's candidates out) counts the steps.
from collections import Counter
round_steps = int(sys.argv[2])
launches = Counter(name for _, name in last)
products = sorted(n for name, n in launches.items() if name.startswith("MatmulEntry") and n >= round_steps)
steps = products[0] if products else round_steps
print(f"steps in that chunk: {steps}")
total = sum(t for t, _ in last)
by_name = defaultdict(lambda: [0.0, 0])
for t, name in last:
    by_name[name][0] += t
    by_name[name][1] += 1
print(f"kernels in the profiled round: {len(last)} ({len(last) / steps:.0f} per step)")
print(f"device time: {total:.3f} s ({1e3 * total / steps:.2f} ms per step of 100 clients' batches of 32)")
print(f"{'time %':>7} {'ms/step':>8} {'launches/step':>13}  kernel")
for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{100 * t / total:7.1f} {1e3 * t / steps:8.3f} {n / steps:13.1f}  {name[:110]}")
EOF
