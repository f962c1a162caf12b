#!/usr/bin/env python3
"""Reads the CSV of `benches/gpu_products.rs` and prints, for each role of
`vectorized/product.rs`, the routine that would make a whole job shortest
if the step's products ran as the bench's do: the first launch (what a cold
run compiles) plus the steady time of every launch a job makes, summed over
the role's products,

    cost(role, routine) = sum over products (first_ms + launches * ms)

with `launches` = rounds * steps a round (10 rounds of 188 steps for
configs/fashion_mnist/vectorized_100.toml). Each role's choice is
independent of the others' (each product is compiled and launched for
itself), so the best table is each role's best routine. A routine whose
result is further than `--tolerance` from burn's (relative to the largest
value) is not chosen. burn's product runs first in the bench and is
`simple_unit_large`'s kernel, so that routine is charged burn's first
launch.

What this does not capture (docs/BENCHMARKS.md, "A product's kernel chosen
without timing"): on an H100 the isolated products did not predict the
step. simple_unit_small's products summed 0.53 ms a step less than
simple_unit_large's, its runs 0.52 s a round less (188 steps: 2.8 ms a
step), and the products' first launches are not what a run's first round
pays. Confirm a choice with `bench/gpu_cold.sh` before shipping it.

    python3 bench/gpu_products_pick.py products.csv [--rounds 10] [--steps 188]

Prints a table of every role's costs, then the last line: the
`COHORT_GPU_PRODUCTS` value of the choice (role=routine pairs).
"""

import argparse
import csv
import sys
from collections import defaultdict


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="the output of the gpu_products bench")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=188, help="steps a round")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args()
    launches = args.rounds * args.steps

    cost = defaultdict(lambda: defaultdict(float))
    steady = defaultdict(lambda: defaultdict(float))
    refused = set()
    burn_first = {}
    with open(args.csv, newline="") as lines:
        rows = csv.DictReader(line for line in lines if not line.startswith("#"))
        for row in rows:
            role, routine = row["role"], row["routine"]
            try:
                first, ms = float(row["first_ms"]), float(row["ms"])
                distance = float(row["distance_from_burn"])
            except (TypeError, ValueError):
                # A bench stopped at its time limit ends in a cut line.
                sys.exit(f"{args.csv}: not a whole row of the gpu_products bench: {row}")
            if distance > args.tolerance:
                refused.add((role, routine))
            if routine == "burn":
                burn_first[row["product"]] = first
            if routine == "simple_unit_large":
                first = max(first, burn_first.get(row["product"], first))
            cost[role][routine] += first + launches * ms
            steady[role][routine] += ms
    if not cost:
        sys.exit(f"{args.csv}: no rows of the gpu_products bench")

    pairs = []
    print(f"# {launches} launches of each product; seconds of a job by role and routine")
    for role in cost:
        options = {r: c for r, c in cost[role].items() if (role, r) not in refused}
        best = min(options, key=options.get)
        for routine, seconds in sorted(cost[role].items(), key=lambda kv: kv[1]):
            mark = "*" if routine == best else (" x" if (role, routine) in refused else "")
            print(f"{role:24} {routine:20} {seconds / 1e3:8.2f} s"
                  f" (steady {steady[role][routine]:.4f} ms a step){mark}")
        pairs.append(f"{role}={best}")
    print(",".join(pairs))


if __name__ == "__main__":
    main()
