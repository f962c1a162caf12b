#!/usr/bin/env bash
# Flower's PyTorch quickstart client code (examples/flower_quickstart/: a small CNN on
# Fashion-MNIST, FedAvg, 100 clients, 10 per round, 5 rounds) through cohort.simulate and
# through Flower's own simulation (flwr[simulation], Ray), one after the other, with the
# same number of client processes: wall time to the last round, peak memory of the whole
# process tree (PSS, and RSS, summed over every process of the run, sampled every 0.2 s)
# and final test-set accuracy; then each process's memory at its tree's PSS peak.
# Usage: bench/flower_sim.sh [DATA_DIR] [WORKERS]   (defaults ../shared/data, 2)
# Installs into a fresh venv (downloads: torch, flwr[simulation] with Ray);
# builds the cohort wheel with maturin (CARGO_TARGET_DIR is used).
# Env: COHORT_WHEEL (a wheel built already, instead of a release build),
#      SYSTEM_TORCH=1 (the venv sees the system's packages and uses its torch).
#      FLWR_VERSION (default 1.42.0).
# Warns when a process outside a run maps the same torch library file while it runs
# (PSS splits shared pages, so that run's figure would be too low).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="$(cd "${1:-../shared/data}" && pwd)"
WORKERS="${2:-2}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"

python3 -m venv ${SYSTEM_TORCH:+--system-site-packages} "$OUT/venv"
PY="$OUT/venv/bin/python"
"$PY" -m pip install --quiet --disable-pip-version-check maturin==1.16.0 numpy
if [ -z "${SYSTEM_TORCH:-}" ]; then
  # torch from PyPI (its Linux wheel brings CUDA's libraries: gigabytes; TORCH_INDEX names
  # an index of CPU wheels where one is reachable).
  "$PY" -m pip install --quiet --disable-pip-version-check torch ${TORCH_INDEX:+--index-url "$TORCH_INDEX"}
fi
# The version the figures in docs/BENCHMARKS.md were measured with.
"$PY" -m pip install --quiet --disable-pip-version-check "flwr[simulation]==${FLWR_VERSION:-1.42.0}"
if [ -z "${COHORT_WHEEL:-}" ]; then
  (cd python && "$OUT/venv/bin/maturin" build --locked --release --out "$OUT/wheels" >/dev/null)
  COHORT_WHEEL="$(ls "$OUT"/wheels/cohort-*.whl)"
fi
"$PY" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$COHORT_WHEEL"

# Runs a command and samples the summed PSS and RSS of it and all its descendants;
# writes the peaks in MiB to $1, and to $1.procs each process's figures at the moment
# of the PSS peak (where the memory is), and to $1.foreign the processes outside the
# run that mapped the same torch library file while it ran (every 2 s).
measure() {
  local peak_file="$1"; shift
  "$@" &
  local root=$!
  "$PY" - "$root" "$peak_file" <<'PYEOF'
import json, os, sys, time
root, out = int(sys.argv[1]), sys.argv[2]
def tree(pid):
    # (pid, depth): the depth tells forked processes of one command apart.
    todo, seen = [(pid, 0)], []
    while todo:
        p, depth = todo.pop()
        seen.append((p, depth))
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend((int(c), depth + 1) for c in f.read().split())
        except OSError:
            pass
    return seen
KEYS = ("Pss:", "Rss:", "Pss_Anon:", "Pss_File:", "Private_Clean:", "Private_Dirty:")
def memory(pid):
    # KiB. PSS splits each shared page among the processes that map it, so
    # its sum over the tree is the tree's memory; RSS counts a page shared
    # by forked workers once per worker.
    found = dict.fromkeys(KEYS, 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key = line.split()[0]
                if key in found:
                    found[key] = int(line.split()[1])
    except OSError:
        pass
    return found
def name(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return "?"
    shown = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(args[:3]))
    return f"{comm}: {shown}"[:70]
def torch_library(pids):
    # The path of the libtorch_cpu.so the run maps, once one of its processes has imported torch.
    for p in pids:
        try:
            with open(f"/proc/{p}/maps") as f:
                for line in f:
                    if line.rstrip().endswith("/libtorch_cpu.so"):
                        return line.split()[-1]
        except OSError:
            pass
    return None
def foreign_users(library, pids):
    # Processes outside the run that map the same file: PSS splits the pages
    # they share with the run, so the run's figure is lowered by them. One of
    # the run's own process group is the run's, even where the walk of
    # /proc's children missed it.
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in pids:
            try:
                if os.getpgid(int(entry)) == group:
                    continue
                with open(f"/proc/{entry}/maps") as f:
                    if library in f.read():
                        found[entry] = name(int(entry))
            except OSError:
                pass
    return found
peak_pss = peak_rss = 0
at_peak = []
library, foreign, samples = None, {}, 0
group = os.getpgid(root)
while os.path.exists(f"/proc/{root}") and open(f"/proc/{root}/stat").read().split()[2] != "Z":
    figures = [(p, depth, memory(p)) for p, depth in tree(root)]
    if samples % 10 == 0:
        pids = {p for p, _, _ in figures}
        library = library or torch_library(pids)
        if library:
            foreign.update(foreign_users(library, pids))
    samples += 1
    pss = sum(f["Pss:"] for _, _, f in figures)
    if pss > peak_pss:
        peak_pss = pss
        at_peak = [dict(pid=p, depth=depth, name=name(p), **{k[:-1]: v // 1024 for k, v in f.items()})
                   for p, depth, f in figures]
    peak_rss = max(peak_rss, sum(f["Rss:"] for _, _, f in figures))
    time.sleep(0.2)
open(out, "w").write(f"{peak_pss / 1024:.0f} {peak_rss / 1024:.0f}")
json.dump(at_peak, open(out + ".procs", "w"))
json.dump(foreign, open(out + ".foreign", "w"))
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
print(f"{'':18} {'wall s':>8} {'peak PSS MiB':>13} {'peak RSS MiB':>13} {'accuracy':>9}")
for name, label in (("cohort", "cohort.simulate"), ("flower", "flwr simulation")):
    figures = json.load(open(f"{out}/{name}.json"))
    pss, rss = open(f"{out}/{name}.peak").read().split()
    print(f"{label:18} {figures['seconds']:8.1f} {pss:>13} {rss:>13} {figures['accuracy']:9.4f}")
for name, label in (("cohort", "cohort.simulate"), ("flower", "flwr simulation")):
    print(f"\n{label} at its PSS peak, MiB:")
    print(f"{'PSS':>6} {'anon':>6} {'file':>6} {'priv':>6} {'RSS':>6}  depth  process")
    for p in sorted(json.load(open(f"{out}/{name}.peak.procs")), key=lambda p: (p["depth"], -p["Pss"])):
        private = p["Private_Clean"] + p["Private_Dirty"]
        print(f"{p['Pss']:6} {p['Pss_Anon']:6} {p['Pss_File']:6} {private:6} {p['Rss']:6}  {p['depth']:5}  {p['name']}")
for name, label in (("cohort", "cohort.simulate"), ("flower", "flwr simulation")):
    foreign = json.load(open(f"{out}/{name}.peak.foreign"))
    if foreign:
        print(f"\nwarning: while {label} ran, {len(foreign)} process(es) outside it mapped the same "
              f"torch library ({'; '.join(f'{p} {n}' for p, n in sorted(foreign.items()))}); PSS "
              "splits the pages they share with the run, so its figure is too low: measure again "
              "when they are gone, or without SYSTEM_TORCH (the venv's own copy of torch)")
PYEOF
