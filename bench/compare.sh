#!/usr/bin/env bash
# cohort against eager PyTorch on the same machine, in one run, one after the other:
#  1. R1 end to end (configs/fashion_mnist/fedavg_lenet5_r1.toml as shipped: one worker
#     per core) against ../shared/bench/torch_r1.py --threads 1: wall time, peak RSS,
#     local-training samples/s per core, test-set evaluation time, final accuracy;
#  2. LeNet-5 on one core (crates/cohort-train/benches/lenet_cpu.rs against
#     bench/torch_lenet_cpu.py): training samples/s and evaluation time, in process CPU time.
# Usage: bench/compare.sh [DATA_DIR]   (default ../shared/data)
# Env: COHORT_BIN (a release `cohort` to use instead of building one), CARGO_FLAGS (extra
#      cargo flags for the builds), SKIP_KERNELS=1 (R1 only).
# Needs: python3 with torch and numpy, /usr/bin/time (GNU), bc.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="$(cd "${1:-../shared/data}" && pwd)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/cohort-target}"
# shellcheck disable=SC2086
if [ -z "${COHORT_BIN:-}" ]; then
  cargo build --release --locked -p cohort-cli ${CARGO_FLAGS:-} >/dev/null
  COHORT_BIN="$CARGO_TARGET_DIR/release/cohort"
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT

# Wall seconds and peak RSS (MiB) from GNU time's verbose report.
wall() { awk -F': ' '/Elapsed \(wall clock\)/ { n = split($2, p, ":"); s = 0; for (i = 1; i <= n; i++) s = s * 60 + p[i]; print s }' "$1"; }
rss() { awk -F': ' '/Maximum resident set size/ { printf "%.0f", $2 / 1024 }' "$1"; }

COHORT_DATA_DIR="$DATA" /usr/bin/time -v -o "$OUT/cohort.time" "$COHORT_BIN" run \
  --config configs/fashion_mnist/fedavg_lenet5_r1.toml --cpu --quiet --base "$OUT/runs"
RUN_DIR="$(ls -d "$OUT"/runs/*/ | head -1)"
/usr/bin/time -v -o "$OUT/torch.time" python3 ../shared/bench/torch_r1.py \
  --data "$DATA/fashion-mnist" --threads 1 --json "$OUT/torch.json" >/dev/null

cohort_s=$(wall "$OUT/cohort.time")
torch_s=$(wall "$OUT/torch.time")
# Training samples over summed client training seconds (each client on one core);
# evaluation: the last round's, which overlaps no training.
read -r c_rate c_eval c_acc < <(awk -F, '
  FNR == 1 { next }
  FILENAME ~ /clients/ { s += $4; t += $6 }
  FILENAME ~ /results/ { e = $6; a = $2 }
  END { printf "%.0f %.3f %.4f\n", s / t, e, a }' "$RUN_DIR/clients.csv" "$RUN_DIR/results.csv")
read -r t_rate t_eval t_acc t_total < <(python3 - "$OUT/torch.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["rows"]
samples = sum(r["samples_per_s"] * r["train_s"] for r in rows)
train = sum(r["train_s"] for r in rows)
print(f"{samples / train:.0f} {min(r['test_s'] for r in rows):.3f} {rows[-1]['accuracy']:.4f} {d['total_s']:.2f}")
PY
)
ratio() { echo "scale=2; $1 / $2" | bc -l; }
echo "== R1 end to end (cohort: $(nproc) cores, default workers; torch: one thread)"
printf '%-34s %12s %12s %14s\n' "" cohort torch "cohort/torch"
printf '%-34s %12s %12s %14s\n' "wall time, whole process (s)" "$cohort_s" "$torch_s" "$(ratio "$cohort_s" "$torch_s")"
printf '%-34s %12s %12s\n' "torch's rounds alone (s)" "" "$t_total"
printf '%-34s %12s %12s %14s\n' "training samples/s per core" "$c_rate" "$t_rate" "$(ratio "$c_rate" "$t_rate")"
printf '%-34s %12s %12s %14s\n' "test evaluation, 10k images (s)" "$c_eval" "$t_eval" "$(ratio "$c_eval" "$t_eval")"
printf '%-34s %12s %12s\n' "final accuracy" "$c_acc" "$t_acc"
printf '%-34s %12s %12s\n' "peak RSS (MiB)" "$(rss "$OUT/cohort.time")" "$(rss "$OUT/torch.time")"

if [ "${SKIP_KERNELS:-0}" != 1 ]; then
  echo "== LeNet-5 on one core (process CPU time, best of 3)"
  # shellcheck disable=SC2086
  cargo bench --locked -p cohort-train ${CARGO_FLAGS:-} --bench lenet_cpu 2>/dev/null | grep -E "samples|evaluation"
  python3 bench/torch_lenet_cpu.py
fi
