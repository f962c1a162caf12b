"""cohort.simulate: Flower-style NumPy clients on cohort's round loop."""

import csv
import gc
import importlib
import json
import os
import sys
import time

import numpy as np
import pytest

import cohort
from cohort import _simulation

# Features and targets of each client's linear regression: client `cid`
# holds 10 * (cid + 1) samples of y = x·[1, -2, 0.5] + 0.3 with noise.
TRUE_W = np.array([1.0, -2.0, 0.5], np.float32)


def data_of(cid):
    rng = np.random.default_rng(100 + int(cid))
    x = rng.normal(size=(10 * (int(cid) + 1), 3)).astype(np.float32)
    y = x @ TRUE_W + 0.3 + rng.normal(scale=0.1, size=len(x)).astype(np.float32)
    return x, y


class Regression:
    """A NumPyClient by duck typing: linear regression by SGD, shuffled by
    the seed cohort passes, so that a run can be repeated exactly."""

    def __init__(self, cid):
        self.cid = cid
        self.x, self.y = data_of(cid)

    def get_parameters(self, config):
        return [np.zeros(3, np.float32), np.zeros(1, np.float32)]

    def fit(self, parameters, config):
        assert config["cid"] == self.cid, config
        w, b = (p.astype(np.float64) for p in parameters)
        rng = np.random.default_rng(config["seed"])
        for _ in range(config["local_epochs"]):
            for i in rng.permutation(len(self.x)):
                error = self.x[i] @ w + b[0] - self.y[i]
                w = w - config["learning_rate"] * error * self.x[i]
                b = b - config["learning_rate"] * error
        # float64 comes back: cohort narrows it to the model's float32.
        return [w, b], len(self.x), {"loss": self.mse([w, b])}

    def mse(self, parameters):
        w, b = parameters
        return float(np.mean((self.x @ w + b[0] - self.y) ** 2))

    def evaluate(self, parameters, config):
        return self.mse(parameters), len(self.x), {"accuracy": (int(self.cid) + 1) / 10}


class Shifted(Regression):
    """fit returns its input plus cid + 1 in every element: a FedAvg round
    of these is computed by hand below."""

    def fit(self, parameters, config):
        shift = int(self.cid) + 1
        return [p + shift for p in parameters], len(self.x), {}


class RaisesForOne(Shifted):
    def fit(self, parameters, config):
        if self.cid == "1":
            raise ValueError("broken client")
        if self.cid == "2":
            w, b = parameters
            return [np.zeros(4, np.float32), b], len(self.x), {}
        return super().fit(parameters, config)


def config(rounds=2, per_round=2, **clients):
    return {
        "clients": {"per_round": per_round, "min_per_round": 1, **clients},
        "trainer": {"rounds": rounds, "epochs": 1, "training_seed": 5},
        "parameters": {"optimizer": {"learning_rate": 0.05}},
    }


def selected(result, round_):
    """The cids the engine gave a round, from its clients' rows."""
    return sorted(str(c["client_id"] - 1) for c in result.clients if c["round"] == round_)


def test_fedavg_over_python_clients_is_the_sample_weighted_average(tmp_path):
    result = cohort.simulate(Shifted, 4, config(rounds=3), strategy="fedavg",
                             max_concurrency=2, run_dir=tmp_path / "run")
    assert [r["round"] for r in result.rounds] == [1, 2, 3]
    assert all(c["dropped"] is None for c in result.clients)
    w, b = np.zeros(3), np.zeros(1)
    for round_ in (1, 2, 3):
        cids = selected(result, round_)
        assert len(cids) == 2
        counts = np.array([10 * (int(c) + 1) for c in cids], float)
        shift = counts @ np.array([int(c) + 1 for c in cids], float) / counts.sum()
        w, b = w + shift, b + shift
    assert [len(p) for p in result.parameters] == [3, 1]
    np.testing.assert_allclose(result.parameters[0], w, rtol=1e-6)
    np.testing.assert_allclose(result.parameters[1], b, rtol=1e-6)
    # The same model is in the run folder's file, named by position.
    np.testing.assert_array_equal(result.model["0"], result.parameters[0])


def test_a_client_that_raises_and_one_of_the_wrong_shape_are_dropped(tmp_path):
    result = cohort.simulate(RaisesForOne, 4, config(rounds=2, per_round=4),
                             max_concurrency=2, run_dir=tmp_path / "run")
    assert [r["round"] for r in result.rounds] == [1, 2]
    reasons = {(c["round"], c["client_id"] - 1): c["dropped"] for c in result.clients}
    for round_ in (1, 2):
        assert reasons[(round_, 0)] is None and reasons[(round_, 3)] is None
        assert "fit raised ValueError: broken client (test_simulate.py:" in reasons[(round_, 1)]
        assert "does not match the global model" in reasons[(round_, 2)]
    # Only clients 0 and 3 are in the average: 10 samples shifted by 1, 40 by 4.
    np.testing.assert_allclose(result.parameters[0], np.full(3, 2 * (10 + 160) / 50), rtol=1e-6)
    with open(tmp_path / "run" / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum("broken client" in row["dropped"] for row in rows) == 2


def test_the_same_run_gives_the_same_model_whatever_the_workers(tmp_path):
    runs = [
        cohort.simulate(Regression, 5, config(rounds=3), max_concurrency=workers,
                        run_dir=tmp_path / f"run{index}")
        for index, workers in enumerate([1, 2, 2])
    ]
    first = runs[0].parameters
    assert not np.allclose(first[0], 0.0)
    for other in runs[1:]:
        for a, b in zip(first, other.parameters):
            np.testing.assert_array_equal(a, b)
    # The model learns: closer to the true weights than the start.
    assert np.linalg.norm(first[0] - TRUE_W) < np.linalg.norm(TRUE_W)


def test_evaluate_fn_and_the_clients_evaluate_are_in_the_results(tmp_path):
    seen = []

    def evaluate_fn(server_round, parameters, config):
        seen.append(server_round)
        w, b = parameters
        return float(np.abs(w).sum()), {"accuracy": float(b[0]) / 100}

    result = cohort.simulate(Shifted, 4, config(rounds=3, do_test=True),
                             evaluate_fn=evaluate_fn, run_dir=tmp_path / "run")
    assert seen == [1, 2, 3]
    for row in result.rounds:
        b = 0.0
        for round_ in range(1, row["round"] + 1):
            cids = selected(result, round_)
            counts = np.array([10 * (int(c) + 1) for c in cids], float)
            b += counts @ np.array([int(c) + 1 for c in cids], float) / counts.sum()
        assert row["accuracy"] == pytest.approx(b / 100, rel=1e-6)
        assert row["test_loss"] == pytest.approx(3 * b, rel=1e-6)
        # Each selected client evaluates first: accuracy (cid + 1) / 10 on
        # 10 * (cid + 1) samples.
        cids = selected(result, row["round"])
        counts = np.array([10 * (int(c) + 1) for c in cids], float)
        expected = counts @ np.array([(int(c) + 1) / 10 for c in cids]) / counts.sum()
        assert row["federated_accuracy"] == pytest.approx(expected, rel=1e-9)
    assert all(c["test_accuracy"] == pytest.approx(c["client_id"] / 10) for c in result.clients)


def test_a_stopped_run_resumes_to_the_uninterrupted_runs_model(tmp_path):
    whole = cohort.simulate(Regression, 5, config(rounds=3), run_dir=tmp_path / "whole")

    def stop_after_one(row):
        if row["round"] == 1:
            raise KeyboardInterrupt

    stopped = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        cohort.simulate(Regression, 5, config(rounds=3), run_dir=stopped, on_round=stop_after_one)
    assert (stopped / "checkpoints").is_dir()
    resumed = cohort.simulate(Regression, 5, config(rounds=3), run_dir=stopped, resume=True)
    assert [r["round"] for r in resumed.rounds] == [1, 2, 3]
    for a, b in zip(whole.parameters, resumed.parameters):
        np.testing.assert_array_equal(a, b)


def test_a_lambda_and_given_parameters_work_and_names_are_kept(tmp_path):
    result = cohort.simulate(lambda cid: Shifted(cid), 2, config(rounds=1),
                             initial_parameters=[np.ones(3), np.ones(1)],
                             parameter_names=["linear.weight", "linear.bias"],
                             run_dir=tmp_path / "run")
    assert sorted(result.model) == ["linear.bias", "linear.weight"]
    # Both clients: (10·1 + 20·2) / 30 added to ones.
    np.testing.assert_allclose(result.parameters[0], np.full(3, 1 + 50 / 30), rtol=1e-6)


def test_what_cannot_start_is_refused_clearly(tmp_path):
    class NoParameters(Shifted):
        def get_parameters(self, config):
            raise RuntimeError("no model here")

    with pytest.raises(RuntimeError, match=r"get_parameters raised RuntimeError: no model here"):
        cohort.simulate(NoParameters, 2, config(rounds=1), run_dir=tmp_path / "a")
    with pytest.raises(cohort.ConfigError, match="clients.per_round"):
        cohort.simulate(Shifted, 2, config(rounds=1, per_round=3), run_dir=tmp_path / "b")
    with pytest.raises(cohort.CohortError, match="SCAFFOLD"):
        cohort.simulate(Shifted, 2, config(rounds=1), strategy="scaffold",
                        overrides={"trainer.optimizer": "sgd"}, run_dir=tmp_path / "c")


class Hangs(Regression):
    """Client 1's fit never returns in round 1; every other fit does."""

    def fit(self, parameters, config):
        if self.cid == "1" and config["server_round"] == 1:
            time.sleep(3600)
        return super().fit(parameters, config)


def test_a_client_that_hangs_is_dropped_after_the_timeout_and_its_worker_replaced(tmp_path):
    # One worker: without a replacement, nothing after the hung fit could run.
    result = cohort.simulate(
        Hangs, num_clients=3, num_rounds=2, clients_per_round=3, max_concurrency=1,
        run_dir=tmp_path / "run",
        overrides={"server.payload_timeout": 1.0, "clients.min_per_round": 2},
    )
    reasons = {(c["round"], c["client_id"] - 1): c["dropped"] for c in result.clients}
    assert reasons[(1, 1)] == (
        "fit did not return within 1 s (server.payload_timeout); its worker process was replaced"
    )
    others = {key: reason for key, reason in reasons.items() if key != (1, 1)}
    assert len(others) == 5 and all(reason is None for reason in others.values()), reasons
    with open(tmp_path / "run" / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    assert sum("did not return within 1 s" in row["dropped"] for row in rows) == 1


# What client code keeps at module level, as Flower's examples keep their
# data set: built by whichever process first builds a client.
_KEPT = {}
_KEPT_MIB = 96


def private_dirty_mib():
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no Private_Dirty line in /proc/self/smaps_rollup")


class KeepsData(Regression):
    """Builds a 96 MiB array at module level once per process and, in fit,
    writes down which process built it and what its own process holds."""

    def __init__(self, cid, log):
        super().__init__(cid)
        self.log = log
        if "data" not in _KEPT:
            # Written, so that every page of it is resident.
            _KEPT["data"] = np.ones(_KEPT_MIB << 20, np.uint8)
            _KEPT["built_in"] = os.getpid()

    def fit(self, parameters, config):
        with open(self.log, "a") as f:
            f.write(json.dumps({"worker": os.getpid(), "built_in": _KEPT["built_in"],
                                "private_mib": private_dirty_mib(),
                                "frozen": gc.get_freeze_count()}) + "\n")
        return super().fit(parameters, config)


def fits_of(log):
    with open(log) as f:
        return [json.loads(line) for line in f]


def test_workers_share_what_the_initial_client_loaded(tmp_path):
    log = tmp_path / "fits.jsonl"
    cohort.simulate(lambda cid: KeepsData(cid, log), 4, config(rounds=2, per_round=4),
                    max_concurrency=2, run_dir=tmp_path / "run")
    fits = fits_of(log)
    workers = {fit["worker"] for fit in fits}
    assert len(fits) == 8 and len(workers) <= 2, fits
    # Built once, by the process that asked client "0" for the initial
    # parameters and then forked both workers: neither this process nor a
    # worker.
    (built_in,) = {fit["built_in"] for fit in fits}
    assert built_in not in workers and built_in != os.getpid(), fits
    # Shared copy-on-write: no worker holds a private copy of the 96 MiB.
    assert all(fit["private_mib"] < _KEPT_MIB / 2 for fit in fits), fits
    # Frozen before the fork, so that the workers' collections leave the
    # shared objects' pages alone.
    assert all(fit["frozen"] > 0 for fit in fits), fits
    # Neither the template nor a worker outlives the run.
    for pid in workers | {built_in}:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


class NotesFrozen(Regression):
    """get_parameters notes its process and how many objects it finds frozen."""

    def __init__(self, cid, log):
        super().__init__(cid)
        self.log = log

    def get_parameters(self, config):
        with open(self.log, "a") as f:
            f.write(json.dumps({"template": os.getpid(), "frozen": gc.get_freeze_count()}) + "\n")
        return super().get_parameters(config)


class NotesLazyImports(NotesFrozen):
    """fit imports a module of a stand-in library, as torch.optim imports
    torch._dynamo, and notes where it was imported and whether the absent
    library's was."""

    def fit(self, parameters, config):
        lazy = importlib.import_module("cohort_test_library.lazy")
        with open(self.log, "a") as f:
            f.write(json.dumps({"worker": os.getpid(), "imported_in": lazy.IMPORTED_IN,
                                "absent": "cohort_test_absent.lazy" in sys.modules}) + "\n")
        return super().fit(parameters, config)


def test_the_template_imports_what_the_clients_libraries_import_lazily(tmp_path, monkeypatch):
    for library in ("cohort_test_library", "cohort_test_absent"):
        (tmp_path / library).mkdir()
        (tmp_path / library / "__init__.py").write_text("")
        (tmp_path / library / "lazy.py").write_text("import os\nIMPORTED_IN = os.getpid()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_simulation, "_LAZY_IMPORTS", {
        "cohort_test_library": ("cohort_test_library.lazy",),
        "cohort_test_absent": ("cohort_test_absent.lazy",),
        # One that cannot be imported is left alone.
        "json": ("json.no_such_module",),
    })
    # The client code has imported the library, not the other one.
    importlib.import_module("cohort_test_library")
    try:
        log = tmp_path / "log.jsonl"
        cohort.simulate(lambda cid: NotesLazyImports(cid, log), 4, config(rounds=1, per_round=4),
                        max_concurrency=2, run_dir=tmp_path / "run")
    finally:
        for name in ("cohort_test_library", "cohort_test_library.lazy"):
            sys.modules.pop(name, None)
    notes = fits_of(log)
    (template,) = [note["template"] for note in notes if "template" in note]
    fits = [note for note in notes if "worker" in note]
    assert len(fits) == 4, notes
    # Imported once, by the template, before it forked the workers: each
    # worker shares it instead of importing its own.
    assert all(fit["imported_in"] == template != fit["worker"] for fit in fits), notes
    # Only for a library already imported: cohort imports none of its own accord.
    assert not any(fit["absent"] for fit in fits), notes


def test_the_callers_objects_are_frozen_while_the_template_shares_them(tmp_path):
    assert gc.get_freeze_count() == 0
    log = tmp_path / "log.jsonl"
    cohort.simulate(lambda cid: NotesFrozen(cid, log), 2, config(rounds=1, per_round=2),
                    max_concurrency=1, run_dir=tmp_path / "run")
    (note,) = [note for note in fits_of(log) if "template" in note]
    # Frozen in this process before the template was forked, so the
    # template's collections (while it builds client "0") do not write to
    # the pages it shares with this process...
    assert note["frozen"] > 0, note
    # ...and unfrozen here once the run is over.
    assert gc.get_freeze_count() == 0


def test_with_initial_parameters_no_client_is_built_before_the_workers(tmp_path):
    log = tmp_path / "fits.jsonl"
    cohort.simulate(lambda cid: KeepsData(cid, log), 4, config(rounds=2, per_round=4),
                    max_concurrency=2, initial_parameters=[np.zeros(3), np.zeros(1)],
                    run_dir=tmp_path / "run")
    fits = fits_of(log)
    assert len(fits) == 8 and all(fit["built_in"] == fit["worker"] for fit in fits), fits


def test_a_template_that_dies_while_building_client_0_is_an_error(tmp_path):
    class Exits(Shifted):
        def get_parameters(self, config):
            os._exit(3)

    with pytest.raises(RuntimeError, match="the worker template process exited before it gave "
                                           "the initial parameters"):
        cohort.simulate(Exits, 2, config(rounds=1), run_dir=tmp_path / "run")


class Sleepy(Shifted):
    """fit notes its process and when it ran in a file of the test's,
    after sleeping long enough that two fits that run at once overlap."""

    log = None

    def fit(self, parameters, config):
        started = time.monotonic()
        time.sleep(0.5)
        with open(Sleepy.log, "a") as f:
            f.write(f"{config['server_round']} {self.cid} {os.getpid()} "
                    f"{started} {time.monotonic()}\n")
        return super().fit(parameters, config)


def test_clients_of_a_round_train_at_once_in_processes_of_their_own(tmp_path):
    Sleepy.log = str(tmp_path / "fits.log")
    result = cohort.simulate(Sleepy, 4, config(rounds=2, per_round=2), max_concurrency=2,
                             run_dir=tmp_path / "run")
    assert all(c["dropped"] is None for c in result.clients)
    fits = [line.split() for line in open(Sleepy.log).read().splitlines()]
    assert len(fits) == 4
    for round_ in ("1", "2"):
        pair = [f for f in fits if f[0] == round_]
        assert len(pair) == 2
        # Two interpreters, neither of them this one, each with its own GIL.
        pids = {int(f[2]) for f in pair}
        assert len(pids) == 2 and os.getpid() not in pids
        # monotonic clocks of one machine: the two fits were under way at once.
        (_, _, _, start_a, end_a), (_, _, _, start_b, end_b) = pair
        assert max(float(start_a), float(start_b)) < min(float(end_a), float(end_b)), pair
