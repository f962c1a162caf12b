#!/usr/bin/env python3
"""Shares of a profile's samples by what their call stacks hold.

Reads `perf script` output of a `perf record --call-graph dwarf` profile and
prints, for each category given, the samples whose stack holds one of its
names (within the innermost DEPTH frames), as a count and a share of all
samples. A sample goes to the first category it matches, in the order given.
A category is `LABEL=name,name…`, optionally `…:leaf=name,name…` to count
only samples whose innermost frame also holds one of those names (say, the
`memset` under one layer). `--within NAME` counts only the samples whose
stack holds NAME anywhere (the zoo bench's `ClientTrainer>::train`, which
leaves the bench's setup out); a deep stack needs a large dwarf copy
(`--call-graph dwarf,60000`) to reach it.

  perf record -F 1999 --call-graph dwarf,8192 -o prof.data <zoo bench> \\
      --threads 1 --samples 256 --reps 1 --models resnet_20
  perf script -i prof.data | python3 bench/perf_shares.py \\
      norm=group_norm,GroupNorm,batch_norm,BatchNorm relu=relu
"""

import argparse
import sys


def parse_category(spec):
    label, _, rest = spec.partition("=")
    names, _, leaf = rest.partition(":leaf=")
    if not label or not names:
        raise SystemExit(f"perf_shares: a category is LABEL=name,name[:leaf=name,…], not {spec!r}")
    return label, names.split(","), leaf.split(",") if leaf else None


def samples(stream):
    """Each sample's frames, innermost first (perf script separates samples by blank lines)."""
    frames = []
    for line in stream:
        line = line.strip()
        if not line:
            if frames:
                yield frames
            frames = []
        else:
            frames.append(line)
    if frames:
        yield frames


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("categories", nargs="+", help="LABEL=name,name[:leaf=name,name]")
    parser.add_argument("--depth", type=int, default=25, help="innermost frames searched (25)")
    parser.add_argument(
        "--within",
        help="count only samples whose whole stack holds this name (a bench's measured "
        "function, leaving its setup out); shares are of those samples",
    )
    args = parser.parse_args()
    categories = [parse_category(c) for c in args.categories]
    counts = {label: 0 for label, _, _ in categories}
    total = 0
    for sample in samples(sys.stdin):
        frames = sample[1:]  # the first line names the process and event
        if not frames:
            continue
        if args.within and not any(args.within in frame for frame in frames):
            continue
        total += 1
        stack = " ".join(frames[: args.depth])
        for label, names, leaf in categories:
            if any(n in stack for n in names) and (leaf is None or any(n in frames[0] for n in leaf)):
                counts[label] += 1
                break
    if total == 0:
        within = f" within {args.within!r}" if args.within else ""
        raise SystemExit(f"perf_shares: no samples{within} on stdin (perf script output expected)")
    print(f"{total} samples")
    for label, count in counts.items():
        print(f"{label} {count} {100 * count / total:.1f} %")


if __name__ == "__main__":
    main()
