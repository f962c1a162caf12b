"""Flower's PyTorch quickstart through cohort.simulate: FedAvg, 100 clients,
10 per round, 5 rounds, the server evaluating on the test set.

    COHORT_DATA_DIR=../shared/data python examples/flower_quickstart/run_cohort.py [--workers N]
"""

import argparse
import json
import sys
import time

try:
    import torch  # noqa: F401
except ImportError:
    sys.exit("this example needs PyTorch: pip install torch")

import cohort
from client import NUM_CLIENTS, client_fn, evaluate_fn


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2, help="client processes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    started = time.perf_counter()
    result = cohort.simulate(
        client_fn,
        NUM_CLIENTS,
        {
            "trainer": {"epochs": 1, "batch_size": 32, "training_seed": 1},
            "parameters": {"optimizer": {"learning_rate": 0.01}},
        },
        strategy="fedavg",
        num_rounds=args.rounds,
        clients_per_round=10,
        max_concurrency=args.workers,
        evaluate_fn=evaluate_fn,
        run_dir=args.run_dir,
        on_round=lambda row: print(f"round {row['round']}: accuracy {row['accuracy']:.4f}", flush=True),
    )
    seconds = time.perf_counter() - started
    accuracy = result.rounds[-1]["accuracy"]
    print(f"cohort.simulate: {seconds:.1f} s, final accuracy {accuracy:.4f}, run folder {result.run_dir}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "accuracy": accuracy}, f)


if __name__ == "__main__":
    main()
