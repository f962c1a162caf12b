"""The same client code through Flower's own simulation (flwr[simulation],
Ray): FedAvg, 100 clients, 10 per round, 5 rounds, the same evaluate_fn.

    COHORT_DATA_DIR=../shared/data python examples/flower_quickstart/run_flower.py [--workers N]
"""

import argparse
import json
import time

import flwr as fl

from client import NUM_CLIENTS, client_fn, evaluate_fn


class Adapter(fl.client.NumPyClient):
    """Flower wants its own NumPyClient class; the methods are the shared client's."""

    def __init__(self, inner):
        self.inner = inner

    def get_parameters(self, config):
        return self.inner.get_parameters(config)

    def fit(self, parameters, config):
        return self.inner.fit(parameters, config)

    def evaluate(self, parameters, config):
        return self.inner.evaluate(parameters, config)


def flower_client_fn(cid):
    return Adapter(client_fn(cid)).to_client()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=2, help="CPUs Ray may use")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []

    def evaluate(server_round, parameters, config):
        loss, metrics = evaluate_fn(server_round, parameters, config)
        rows.append(metrics["accuracy"])
        return loss, metrics

    strategy = fl.server.strategy.FedAvg(
        fraction_fit=0.1,
        fraction_evaluate=0.0,
        min_fit_clients=10,
        min_evaluate_clients=0,
        min_available_clients=NUM_CLIENTS,
        evaluate_fn=evaluate,
        on_fit_config_fn=lambda server_round: {"local_epochs": 1, "learning_rate": 0.01,
                                               "server_round": server_round},
    )
    started = time.perf_counter()
    fl.simulation.start_simulation(
        client_fn=flower_client_fn,
        num_clients=NUM_CLIENTS,
        config=fl.server.ServerConfig(num_rounds=args.rounds),
        strategy=strategy,
        client_resources={"num_cpus": 1},
        ray_init_args={"num_cpus": args.workers, "include_dashboard": False},
    )
    seconds = time.perf_counter() - started
    # Flower evaluates the initial model too (round 0): the last is round 5's.
    print(f"flwr simulation: {seconds:.1f} s, final accuracy {rows[-1]:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "accuracy": rows[-1]}, f)


if __name__ == "__main__":
    main()
