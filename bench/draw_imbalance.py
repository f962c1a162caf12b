"""How much more than its share the busiest rank trains under a uniform draw.

A rank of a distributed run trains the clients of its own contiguous block
of ids, so a round waits for the rank that drew the most. This prints, for
each rank count, the busiest block's mean count over many uniform draws as a
multiple of its share (docs/SCALING.md, "Speed-up with strata"); with
clients.strata a multiple of the ranks it is 1 by construction.

    python3 bench/draw_imbalance.py [--clients 100000] [--per-round 1000] [--draws 4000]
"""

import argparse

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=100_000)
    parser.add_argument("--per-round", type=int, default=1_000)
    parser.add_argument("--draws", type=int, default=4_000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    for ranks in args.ranks:
        # Equal contiguous blocks, as cohort splits clients over equal ranks.
        bounds = np.linspace(0, args.clients, ranks + 1).round().astype(int)
        busiest = []
        for _ in range(args.draws):
            drawn = rng.choice(args.clients, args.per_round, replace=False)
            busiest.append(np.histogram(drawn, bins=bounds)[0].max())
        share = args.per_round / ranks
        print(f"{ranks} ranks: busiest rank {np.mean(busiest) / share:.3f} x its share")


if __name__ == "__main__":
    main()
