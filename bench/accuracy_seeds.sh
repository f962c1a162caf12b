#!/usr/bin/env bash
# cohort against plain PyTorch FedAvg from the same initial model on the same
# batches, seed by seed (docs/BENCHMARKS.md, "Every seed within a point"):
# for each seed, bench/zoo_resnet_20.sh's cohort side (SAME_INIT=1
# SAME_ORDER=1: one initial model, cohort's sample orders handed to PyTorch),
# then PyTorch on the same run, in float32. With cuda, a second PyTorch run
# lets cuDNN choose its convolutions' algorithms by timing
# (--cudnn-benchmark): PyTorch against itself, the same arithmetic summed in
# another order.
#
#   COHORT=path/to/cohort [MODEL=resnet_20|cnn|multilayer] [SEEDS="1 2 3"] \
#     [THREADS=5] [OUT=dir] bash bench/accuracy_seeds.sh [cuda|cpu]
#
# The seeds run at once, each cohort run with THREADS workers of one thread
# (bench/zoo_resnet_20.sh's THREADS); each PyTorch run with one thread on
# cuda, THREADS on cpu. Needs COHORT_DATA_DIR with Fashion-MNIST, torch and
# numpy. Prints, per seed, the last round's accuracy of each run, the
# differences in points, and the means over the last 10 and 5 rounds and
# the whole run; the runs' JSON are in $OUT/seedN/, and a chart of the three
# by round in $OUT/MODEL_seedN.png (`cohort plot`).
set -euo pipefail
cd "$(dirname "$0")/.."
device="${1:-cuda}"
export MODEL="${MODEL:-resnet_20}"
SEEDS="${SEEDS:-1 2 3}"
THREADS="${THREADS:-5}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
torch_threads=1
[ "$device" = cuda ] || torch_threads="$THREADS"

# SUMMARY_ONLY=1: summarize (and chart) the seeds already in $OUT.
# A seed that fails is named with its logs, and the script exits 1 after
# the others end.
pids=()
for seed in $SEEDS; do
  [ -z "${SUMMARY_ONLY:-}" ] || break
  (
    dir="$OUT/seed$seed"
    if ! SEED=$seed SAME_INIT=1 SAME_ORDER=1 THREADS="$THREADS" OUT="$dir" \
      bash bench/zoo_resnet_20.sh cohort > "$dir.cohort.log" 2>&1; then
      echo "error: seed $seed: cohort's side failed; see $dir.cohort.log" >&2
      exit 1
    fi
    run=$(ls -d "$dir"/runs/*/ | head -1)
    SEED=$seed THREADS=$torch_threads OUT="$dir" \
      bash bench/zoo_resnet_20.sh pytorch "$device" "$run" "$dir/parts.json" > /dev/null &
    torch=$!
    timed=""
    if [ "$device" = cuda ]; then
      SEED=$seed THREADS=$torch_threads OUT="$dir" TAG=_bench PYTORCH_ARGS=--cudnn-benchmark \
        bash bench/zoo_resnet_20.sh pytorch "$device" "$run" "$dir/parts.json" > /dev/null &
      timed=$!
    fi
    status=0
    wait "$torch" || { echo "error: seed $seed: PyTorch failed; see $dir/pytorch.log" >&2; status=1; }
    if [ -n "$timed" ]; then
      wait "$timed" || { echo "error: seed $seed: PyTorch by timing failed; see $dir/pytorch_bench.log" >&2; status=1; }
    fi
    exit "$status"
  ) &
  pids+=($!)
done
failed=0
for pid in ${pids[@]+"${pids[@]}"}; do
  wait "$pid" || failed=1
done
[ "$failed" = 0 ] || exit 1

for seed in $SEEDS; do
  grep -E "end to end" "$OUT/seed$seed.cohort.log" 2> /dev/null || true
  python3 - "$OUT/seed$seed" "$MODEL" "$seed" <<'PY'
import json, os, sys
folder, model, seed = sys.argv[1:]
runs = {"PyTorch": os.path.join(folder, f"{model}.json"),
        "PyTorch, cuDNN by timing": os.path.join(folder, f"{model}_bench.json")}
if not os.path.exists(runs["PyTorch"]):
    sys.exit(f"error: seed {seed}: no {runs['PyTorch']} (PyTorch's result for this seed)")
results = {name: json.load(open(path)) for name, path in runs.items() if os.path.exists(path)}
cohort = results["PyTorch"]["cohort_accuracy"]
mean = lambda values, n: sum(values[-n:]) / min(n, len(values))
line = f"seed {seed}: cohort {cohort[-1]:.4f}"
for name, result in results.items():
    theirs = result["pytorch_accuracy"]
    line += (f"; {name} {theirs[-1]:.4f} (cohort − it: last {100 * (cohort[-1] - theirs[-1]):+.2f},"
             f" last 10 {100 * (mean(cohort, 10) - mean(theirs, 10)):+.2f},"
             f" last 5 {100 * (mean(cohort, 5) - mean(theirs, 5)):+.2f},"
             f" all {100 * (mean(cohort, len(cohort)) - mean(theirs, len(theirs))):+.2f};"
             f" {result['pytorch_seconds']:.0f} s)")
print(line)
# Each side's accuracy by round as a run folder `cohort plot` reads (only the
# round and accuracy columns filled), for the chart below.
header = ("round,accuracy,elapsed_time,round_time,training_time,evaluation_time,"
          "bytes_to_clients,bytes_to_server,train_loss,simulated_time,extra_bytes_to_clients,"
          "federated_accuracy,epsilon,test_loss,simulated_start")
sides = {"cohort": cohort}
for name, result in zip(("pytorch", "pytorch_cudnn_timed"), results.values()):
    sides[name] = result["pytorch_accuracy"]
for name, accuracies in sides.items():
    os.makedirs(os.path.join(folder, "chart", name), exist_ok=True)
    with open(os.path.join(folder, "chart", name, "results.csv"), "w") as f:
        f.write(header + "\n")
        for number, accuracy in enumerate(accuracies, 1):
            f.write(f"{number},{accuracy:.4f},0,0,0,0,0,0,0,0,0,,,0,\n")
PY
  "$COHORT" plot --against round -o "$OUT/${MODEL}_seed$seed.png" \
    "$OUT/seed$seed"/chart/* > /dev/null
done
echo "charts: $OUT/${MODEL}_seed*.png"
