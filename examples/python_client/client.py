"""A cohort own-data client in Python on `cohort.connect`: LeNet-5 trained
with numpy (train.py, on lenet5.py) on the data it holds.

    python3 client.py --server HOST:PORT --data mine.safetensors [--client-id K]

`cohort.connect` speaks cohort's protocol (it is the Rust client's); this
file is only the NumPyClient. grpc_client.py is the same client written
against the protocol by hand (grpcio), for writers of clients in other
languages. See README.md.
"""

import argparse
import os
import sys

import numpy as np

import cohort

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import lenet5  # noqa: E402  (beside this file)
import train  # noqa: E402
from own_data import load_data  # noqa: E402  (the format `cohort client --data` reads)

# The server's model tensors, in the order fit's list of arrays has them.
NAMES = list(lenet5.SHAPES)


class LeNet5Client:
    def __init__(self, data, momentum, weight_decay):
        (self.images, self.labels), self.test = data
        self.momentum, self.weight_decay = momentum, weight_decay

    def get_parameters(self, config):
        return []  # the server's model is the start

    def fit(self, parameters, config):
        if config.get("proximal_mu"):
            raise ValueError("this example client trains plain FedAvg only")
        params = dict(zip(NAMES, (p.astype(np.float32) for p in parameters)))
        lenet5.check(params)
        optimizer = train.Sgd(config["learning_rate"], self.momentum, self.weight_decay)
        rng = np.random.default_rng(config["seed"])
        loss, _ = train.train(params, self.images, self.labels, config["local_epochs"],
                              config["batch_size"], optimizer, rng)
        return [params[name] for name in NAMES], len(self.labels), {"loss": loss}

    def evaluate(self, parameters, config):
        if self.test is None:
            return 0.0, 0, {}
        correct = train.count_correct(dict(zip(NAMES, parameters)), *self.test)
        return 0.0, len(self.test[1]), {"accuracy": correct / len(self.test[1])}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="HOST:PORT of `cohort run`")
    parser.add_argument("--data", required=True, help="safetensors file of images and labels")
    parser.add_argument("--client-id", type=int, help="own-data client to claim [default: lowest free]")
    parser.add_argument("--token", default=os.environ.get("COHORT_TOKEN"), help="server.auth_token [env: COHORT_TOKEN]")
    parser.add_argument("--momentum", type=float, default=0.0, help="the run's parameters.optimizer.momentum")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="the run's parameters.optimizer.weight_decay")
    args = parser.parse_args()
    data = load_data(args.data)
    (_, labels), test = data
    done = cohort.connect(
        args.server, lambda cid: LeNet5Client(data, args.momentum, args.weight_decay),
        num_examples=len(labels), num_test_examples=0 if test is None else len(test[1]),
        client_id=args.client_id, parameter_names=NAMES, token=args.token,
    )
    print(f"done: {done['tasks']} tasks, {done['failed']} failed", flush=True)


if __name__ == "__main__":
    main()
