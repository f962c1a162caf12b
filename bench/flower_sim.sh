#!/usr/bin/env bash
# Flower's PyTorch quickstart client code (examples/flower_quickstart/: a small CNN on
# Fashion-MNIST, FedAvg, 100 clients, 10 per round, 5 rounds) through cohort.simulate and
# through Flower's own simulation (flwr[simulation], Ray), one after the other, with the
# same number of client processes: wall time to the last round, peak memory of the whole
# process tree (RSS summed over every process of the run, sampled every 0.2 s) and final
# test-set accuracy.
# Usage: bench/flower_sim.sh [DATA_DIR] [WORKERS]   (defaults ../shared/data, 2)
# Installs into a fresh venv (downloads: torch, flwr[simulation] with Ray);
# builds the cohort wheel with maturin (CARGO_TARGET_DIR is used).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="$(cd "${1:-../shared/data}" && pwd)"
WORKERS="${2:-2}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"

python3 -m venv "$OUT/venv"
PY="$OUT/venv/bin/python"
"$PY" -m pip install --quiet --disable-pip-version-check maturin==1.16.0 numpy
# torch from PyPI (its Linux wheel brings CUDA's libraries: gigabytes; TORCH_INDEX names an
# index of CPU wheels where one is reachable).
"$PY" -m pip install --quiet --disable-pip-version-check torch ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
"$PY" -m pip install --quiet --disable-pip-version-check "flwr[simulation]"
(cd python && "$OUT/venv/bin/maturin" build --locked --release --out "$OUT/wheels" >/dev/null)
"$PY" -m pip install --quiet --disable-pip-version-check "$OUT"/wheels/cohort-*.whl

# Runs a command and samples the summed RSS of it and all its descendants; prints the
# peak in MiB to $1.
measure() {
  local peak_file="$1"; shift
  "$@" &
  local root=$!
  "$PY" - "$root" "$peak_file" <<'PYEOF'
import os, sys, time
root, out = int(sys.argv[1]), sys.argv[2]
def tree(pid):
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return seen
def rss(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
peak = 0
while os.path.exists(f"/proc/{root}") and open(f"/proc/{root}/stat").read().split()[2] != "Z":
    peak = max(peak, sum(rss(p) for p in tree(root)))
    time.sleep(0.2)
open(out, "w").write(f"{peak / 1024:.0f}")
PYEOF
  wait "$root"
}

export COHORT_DATA_DIR="$DATA"
cd examples/flower_quickstart
measure "$OUT/cohort.peak" "$PY" run_cohort.py --workers "$WORKERS" --run-dir "$OUT/run" --json "$OUT/cohort.json"
measure "$OUT/flower.peak" "$PY" run_flower.py --workers "$WORKERS" --json "$OUT/flower.json"

"$PY" - "$OUT" "$WORKERS" <<'PYEOF'
import json, sys
out, workers = sys.argv[1], sys.argv[2]
print(f"\n{workers} client processes, 5 rounds of 10 of 100 clients")
print(f"{'':18} {'wall s':>8} {'peak MiB':>9} {'accuracy':>9}")
for name, label in (("cohort", "cohort.simulate"), ("flower", "flwr simulation")):
    figures = json.load(open(f"{out}/{name}.json"))
    peak = open(f"{out}/{name}.peak").read()
    print(f"{label:18} {figures['seconds']:8.1f} {peak:>9} {figures['accuracy']:9.4f}")
PYEOF
