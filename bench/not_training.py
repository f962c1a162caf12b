#!/usr/bin/env python3
"""The share of a run's rounds spent outside local training, from its run folder.

Outside training: the server's steps (aggregating, packing, dispatching,
checkpointing, and recording less the test-set evaluation, which overlaps the
next round's training) and the clients' codec work (clients.csv's
processing_time, run on the workers in parallel, so divided by their number).
Round 1 includes starting the workers and is left out by default.

Usage: bench/not_training.py RUN_DIR WORKERS [FIRST-LAST ...]
e.g. `bench/not_training.py RUN 2 2-5 26-30` compares a long run's early and
late rounds; bench/scale.sh uses the same arithmetic for its table.
"""
import csv
import re
import sys


def read_run(run_dir):
    rounds = {int(r["round"]): r for r in csv.DictReader(open(run_dir + "/results.csv"))}
    processing = {}
    for row in csv.DictReader(open(run_dir + "/clients.csv")):
        r = int(row["round"])
        processing[r] = processing.get(r, 0.0) + float(row["processing_time"] or 0)
    steps = {}
    for line in open(run_dir + "/run.log"):
        if "round steps" in line:
            fields = dict(re.findall(r"(\w+)=([0-9.e-]+)", line))
            steps[int(fields["round"])] = {k: float(v) for k, v in fields.items()}
    return rounds, processing, steps


def share(run, workers, measured):
    """Means over the rounds `measured`: round time, the share outside
    training, evaluation, checkpointing and the results files (seconds)."""
    rounds, processing, steps = run
    totals = dict(round_s=0.0, not_training=0.0, evaluation=0.0, checkpointing=0.0, results=0.0)
    for r in measured:
        s, row = steps[r], rounds[r]
        evaluation = float(row["evaluation_time"])
        results = max(s["recording"] - evaluation, 0.0)
        server = s["aggregating"] + s["packing"] + s["dispatching"] + s["checkpointing"] + results
        totals["round_s"] += float(row["round_time"])
        totals["not_training"] += server + processing.get(r, 0.0) / workers
        totals["evaluation"] += evaluation
        totals["checkpointing"] += s["checkpointing"]
        totals["results"] += results
    n = len(measured)
    means = {k: v / n for k, v in totals.items()}
    means["share"] = totals["not_training"] / totals["round_s"]
    return means


def main():
    run_dir, workers = sys.argv[1], int(sys.argv[2])
    run = read_run(run_dir)
    last = max(run[0])
    ranges = sys.argv[3:] or [f"2-{last}"]
    for spec in ranges:
        first, end = (int(x) for x in spec.split("-"))
        m = share(run, workers, list(range(first, end + 1)))
        print(f"rounds {first}-{end}: round {m['round_s']:.2f} s, not training "
              f"{100 * m['share']:.2f} %, checkpointing {1000 * m['checkpointing']:.1f} ms, "
              f"results files {1000 * m['results']:.1f} ms")


if __name__ == "__main__":
    main()
