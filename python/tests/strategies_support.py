"""Strategies written in NumPy for the tests, following cohort's own
arithmetic (crates/cohort-core/src/aggregate.rs for FedAvg,
strategy/flat.rs and strategy/fedavgm.rs for FedAvgM) step by step, so that
they give the built-in strategies' models bit for bit; and the clients they
run with. Imported by the tests and by the script a killed run runs in."""

import time

import numpy as np

import cohort


def fedavg(parameters, results):
    """aggregate.rs's `fedavg`: the total weight summed in float64 in
    selection order; each coefficient w / W in float64, rounded once to
    float32; the first client's term stored, the others' added, all in
    float32; clients of zero weight skipped."""
    total = 0.0
    for result in results:
        total += float(result.num_examples)
    if total == 0.0:
        return None
    active = [r for r in results if r.num_examples > 0]
    coefficients = [np.float32(r.num_examples / total) for r in active]
    model = []
    for index in range(len(parameters)):
        accumulator = coefficients[0] * active[0].parameters[index]
        for coefficient, result in zip(coefficients[1:], active[1:]):
            accumulator += coefficient * result.parameters[index]
        model.append(accumulator)
    return model


def weighted_mean(parameters, results):
    """flat.rs's `weighted_mean`: float64 sums of (w / W)·x, every update
    (zero weights too), narrowed to float32 at the end."""
    total = 0.0
    for result in results:
        total += float(result.num_examples)
    if total == 0.0:
        return None
    means = []
    for index, reference in enumerate(parameters):
        accumulator = np.zeros(reference.shape, np.float64)
        for result in results:
            accumulator += (result.num_examples / total) * result.parameters[index].astype(np.float64)
        means.append(accumulator.astype(np.float32))
    return means


class NumpyFedAvg(cohort.Strategy):
    def aggregate_fit(self, server_round, parameters, results):
        return fedavg(parameters, results), {}


class NumpyFedAvgM(cohort.Strategy):
    """fedavgm.rs's `momentum_step` on flat.rs's mean: v ← β·v + (x − avg),
    x ← x − η·v, each element in float64 and stored in float32. Its state:
    the velocity arrays, the rounds it stepped (an int) and the last
    step's size (a float), all of which must come back from a checkpoint
    exactly."""

    def __init__(self, server_learning_rate=0.1, momentum=0.9):
        self.lr = server_learning_rate
        self.momentum = momentum
        self.velocity = None
        self.steps = 0
        self.last_step = 0.0

    def aggregate_fit(self, server_round, parameters, results):
        means = weighted_mean(parameters, results)
        if means is None:
            return None
        if self.velocity is None:
            self.velocity = [np.zeros(p.shape, np.float32) for p in parameters]
        model = []
        for index, (x, average) in enumerate(zip(parameters, means)):
            delta = x.astype(np.float64) - average.astype(np.float64)
            velocity = (self.momentum * self.velocity[index].astype(np.float64) + delta).astype(np.float32)
            self.velocity[index] = velocity
            model.append((x.astype(np.float64) - self.lr * velocity.astype(np.float64)).astype(np.float32))
        self.steps += 1
        self.last_step = float(sum(np.abs(v.astype(np.float64)).sum() for v in self.velocity)) / 3.0
        return model

    def get_state(self):
        state = {"steps": self.steps, "last_step": self.last_step}
        for index, velocity in enumerate(self.velocity or []):
            state[f"velocity_{index}"] = velocity
        return state

    def set_state(self, state):
        self.steps = state["steps"]
        self.last_step = state["last_step"]
        count = sum(1 for key in state if key.startswith("velocity_"))
        self.velocity = [state[f"velocity_{i}"] for i in range(count)] or None


# Each client's linear regression: client `cid` holds 10 * (cid + 1)
# samples of y = x·[1, -2, 0.5] + 0.3 with noise.
TRUE_W = np.array([1.0, -2.0, 0.5], np.float32)


class Regression:
    """A NumPyClient by duck typing: SGD on its own data, shuffled by the
    seed cohort passes, so that a run repeats exactly. `pause` seconds of
    sleep per fit make a run slow enough to be killed in the middle."""

    pause = 0.0

    def __init__(self, cid):
        self.cid = cid
        rng = np.random.default_rng(100 + int(cid))
        self.x = rng.normal(size=(10 * (int(cid) + 1), 3)).astype(np.float32)
        self.y = self.x @ TRUE_W + 0.3 + rng.normal(scale=0.1, size=len(self.x)).astype(np.float32)

    def get_parameters(self, config):
        return [np.zeros(3, np.float32), np.zeros(1, np.float32)]

    def fit(self, parameters, config):
        time.sleep(self.pause)
        w, b = (p.astype(np.float64) for p in parameters)
        rng = np.random.default_rng(config["seed"])
        for i in rng.permutation(len(self.x)):
            error = self.x[i] @ w + b[0] - self.y[i]
            w = w - config["learning_rate"] * error * self.x[i]
            b = b - config["learning_rate"] * error
        return [w, b], len(self.x), {}

    def evaluate(self, parameters, config):
        return 0.0, len(self.x), {}


class Wide(Regression):
    """Regression with a third array of 4096 elements that each fit moves
    by seeded noise: enough elements that float32 and float64 arithmetic
    (or another order of operations) give different bits somewhere."""

    def get_parameters(self, config):
        return super().get_parameters(config) + [np.zeros(4096, np.float32)]

    def fit(self, parameters, config):
        (w, b), count, metrics = super().fit(parameters[:2], config)
        noise = np.random.default_rng(config["seed"]).normal(size=4096).astype(np.float32)
        return [w, b, parameters[2] + noise / 3], count, metrics


class SlowWide(Wide):
    pause = 0.3


def simulate(strategy, run_dir, rounds=4, client=Regression, **kwargs):
    return cohort.simulate(
        client, num_clients=6, strategy=strategy, num_rounds=rounds, clients_per_round=3,
        max_concurrency=2, run_dir=run_dir, **kwargs,
    )
