#!/usr/bin/env bash
# The strategy experiments of docs/ALGORITHMS.md, reproducible from the shipped
# configs: Fashion-MNIST, LeNet-5, 100 clients, 10 per round, 30 rounds of one
# local epoch, plain SGD at 0.05.
#   1. non-IID: fedavg, fedprox, fedadam, scaffold, trimmed_mean at Dirichlet
#      alpha 0.1 and 0.5;
#   2. attacks (alpha 0.5): fedavg, krum, median, trimmed_mean (beta 0.2) with
#      2 of the 10 clients of every round sending scaled (x10) or sign-flipped
#      (x5) updates, and without attackers.
# Usage: COHORT_DATA_DIR=../shared/data bash bench/strategies.sh [OUT_DIR] [JOBS]
# Runs JOBS runs at a time (default: the number of cores), one compute thread each.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-runs/strategies}"
jobs="${2:-$(nproc)}"
cohort="${COHORT:-target/release/cohort}"
[ -x "$cohort" ] || cargo build --release -p cohort-cli
mkdir -p "$out/configs"

# variant NAME STRATEGY ALPHA [EXTRA_ALGORITHM_LINES] [EXTRA_CLIENT_LINES]
variant() {
  local name=$1 strategy=$2 alpha=$3 algorithm=${4:-} clients=${5:-}
  python3 - "$strategy" "$alpha" "$algorithm" "$clients" >"$out/configs/$name.toml" <<'PY'
import re, sys
strategy, alpha, algorithm, clients = sys.argv[1:]
text = open(f"configs/strategies/{strategy}.toml").read()
text = text.replace("concentration = 0.5", f"concentration = {alpha}")
if algorithm:
    # Options given here replace the shipped ones of the same name.
    for line in algorithm.split(";"):
        key = line.split("=")[0].strip()
        text = re.sub(rf"(?m)^{key} = .*\n", "", text)
        text = text.replace(f'type = "{strategy}"\n', f'type = "{strategy}"\n{line.strip()}\n')
if clients:
    text = text.replace("per_round = 10\n", "per_round = 10\n" + clients.replace(";", "\n") + "\n")
print(text, end="")
PY
  echo "$name"
}

{
  for alpha in 0.1 0.5; do
    for strategy in fedavg fedprox fedadam scaffold trimmed_mean; do
      variant "noniid-$alpha-$strategy" "$strategy" "$alpha"
    done
  done
  for attack in none scale sign_flip; do
    case $attack in
      none) clients="" ;;
      scale) clients="attack = \"scale\";attackers_per_round = 2;attack_scale = 10.0" ;;
      sign_flip) clients="attack = \"sign_flip\";attackers_per_round = 2;attack_scale = 5.0" ;;
    esac
    variant "attack-$attack-fedavg" fedavg 0.5 "" "$clients"
    variant "attack-$attack-krum" krum 0.5 "byzantine = 2" "$clients"
    variant "attack-$attack-median" median 0.5 "" "$clients"
    variant "attack-$attack-trimmed_mean" trimmed_mean 0.5 "beta = 0.2" "$clients"
  done
} >"$out/names.txt"

run_one() {
  local name=$1
  "$cohort" run --config "$out/configs/$name.toml" --cpu --quiet --base "$out/$name" \
    >"$out/$name.log" 2>&1 || { echo "FAILED: $name (see $out/$name.log)" >&2; return 1; }
  echo "done: $name"
}
export -f run_one
export out cohort
xargs -P "$jobs" -I{} bash -c 'run_one {}' <"$out/names.txt"

# One table row per run: final and best test accuracy, and the round the best came.
printf '%-34s %8s %8s %6s\n' run final best round >"$out/table.txt"
while read -r name; do
  csv=$(ls "$out/$name"/*/results.csv)
  awk -F, -v name="$name" 'NR > 1 { final = $2; if ($2 > best) { best = $2; at = $1 } }
    END { printf "%-34s %8.4f %8.4f %6d\n", name, final, best, at }' "$csv" >>"$out/table.txt"
done <"$out/names.txt"
cat "$out/table.txt"

for alpha in 0.1 0.5; do
  "$cohort" plot $(for s in fedavg fedprox fedadam scaffold trimmed_mean; do ls -d "$out/noniid-$alpha-$s"/*/; done) \
    --output "$out/noniid-$alpha.png"
done
for attack in none scale sign_flip; do
  "$cohort" plot $(for s in fedavg krum median trimmed_mean; do ls -d "$out/attack-$attack-$s"/*/; done) \
    --output "$out/attack-$attack.png"
done
