#!/usr/bin/env python3
"""How far float32 training drifts from exact, in cohort and in PyTorch: one
round of one client of a finished cohort run, retrained by the PyTorch twin
from the same initial model on the same batches, in float32 and in float64.

Takes a cohort run of one round and one client per round, started from a
shared initial model (`trainer.initial_model`), and its partitions file with
`--sample-orders`, so the batches are cohort's. Prints the L2 distance over
every floating-point tensor of cohort's model and of PyTorch's float32 model
from the float64 one, as a fraction of the float64 run's change from the
initial model (and each one's largest tensor-wise ratio).

  cohort check --config job.toml > job-full.toml
  python3 bench/pytorch_fedavg.py --write-initial initial.safetensors --config job-full.toml --seed 1
  cohort run --config job.toml --base runs --set trainer.initial_model=initial.safetensors \\
      --set trainer.rounds=1 --set clients.per_round=1
  cohort partitions --config runs/RUN/config.toml --json parts.json --sample-orders
  python3 bench/pytorch_float_drift.py --run runs/RUN --partitions parts.json --data DATA_DIR
"""

import argparse
import json
import os
import sys
import tomllib

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pytorch_fedavg as fedavg  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True)
    parser.add_argument("--partitions", required=True)
    parser.add_argument("--data", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with open(os.path.join(args.run, "config.toml"), "rb") as f:
        config = tomllib.load(f)
    with open(args.partitions) as f:
        assignment = json.load(f)
    orders = fedavg.sample_orders(assignment, config)
    if orders is None:
        raise SystemExit(f"{args.partitions} has no sample orders: write it with --sample-orders")
    initial_path = config["trainer"].get("initial_model")
    if not initial_path:
        raise SystemExit("the run has no trainer.initial_model to start both sides from")
    rounds = fedavg.selected_clients(args.run)
    if len(rounds) != 1 or len(rounds[0][1]) != 1:
        raise SystemExit("the run must be one round of one client")
    (round_number, (client,)), = rounds
    x, y = fedavg.load_split(args.data, config["data"]["datasource"], "train")
    indices = {c["client_id"]: c["train"] for c in assignment["clients"]}[client]

    def train(dtype):
        _, model = fedavg.build_model(config)
        fedavg.load_initial(model, initial_path)
        model = model.to(dtype)
        state = fedavg.train_client(model, config, x.to(dtype), y, indices, torch.device("cpu"),
                                    None, orders[client][round_number - 1])
        return {k: v.double().numpy() for k, v in state.items() if v.is_floating_point()}

    exact, single = train(torch.float64), train(torch.float32)
    cohort = {k: v.astype(np.float64)
              for k, v in fedavg.read_safetensors(os.path.join(args.run, "model.safetensors")).items()}
    initial = {k: v.astype(np.float64) for k, v in fedavg.read_safetensors(initial_path).items()}

    def distance(model):
        change = sum(float(((exact[k] - initial[k]) ** 2).sum()) for k in exact)
        gap = sum(float(((model[k] - exact[k]) ** 2).sum()) for k in exact)
        worst = max(float(np.abs(model[k] - exact[k]).max())
                    / max(float(np.abs(exact[k] - initial[k]).max()), 1e-30) for k in exact)
        return (gap / change) ** 0.5, worst

    steps = -(-len(indices) // config["trainer"].get("batch_size", 32))
    for name, model in (("cohort", cohort), ("PyTorch float32", single)):
        l2, worst = distance(model)
        print(f"{name:16s} from float64 after {steps} steps: L2 {l2:.3g} of the change, "
              f"largest tensor-wise {worst:.3g}")


if __name__ == "__main__":
    main()
