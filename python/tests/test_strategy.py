"""cohort.Strategy: strategies in Python inside cohort's round loop, their
state in checkpoints, and the built-in strategies by name."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cohort
from conftest import FIXTURE_DATA, job
from strategies_support import (
    NumpyFedAvg, NumpyFedAvgM, Regression, SlowWide, Wide, simulate,
)

HERE = Path(__file__).resolve().parent


def same_bits(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def test_a_numpy_fedavg_gives_the_builtin_fedavgs_models_bit_for_bit(tmp_path):
    # Wide's 4096 noisy elements tell float32 arithmetic in cohort's order
    # from float64 or another order (checked when this test was written).
    builtin = simulate("fedavg", tmp_path / "builtin", client=Wide)
    python = simulate(NumpyFedAvg(), tmp_path / "python", client=Wide)
    same_bits(python.parameters, builtin.parameters)
    # The clients trained in the same order on the same models.
    assert [(c["round"], c["client_id"]) for c in python.clients] == \
        [(c["round"], c["client_id"]) for c in builtin.clients]
    # The run is not a fixed point: the model moved in every round.
    assert not np.array_equal(builtin.parameters[0], np.zeros(3, np.float32))


def test_a_numpy_fedavg_in_cohort_run_gives_the_builtins_model(tmp_path):
    """cohort.run trains LeNet-5 on the fixture; the Python strategy gets
    the model's tensors in name order and returns them."""
    builtin = cohort.run(job(), run_dir=tmp_path / "builtin", data_dir=FIXTURE_DATA)
    python = cohort.run(job(), run_dir=tmp_path / "python", data_dir=FIXTURE_DATA,
                        strategy=NumpyFedAvg())
    assert sorted(python.model) == sorted(builtin.model)
    for name in builtin.model:
        assert python.model[name].tobytes() == builtin.model[name].tobytes(), name
    assert [r["accuracy"] for r in python.rounds] == [r["accuracy"] for r in builtin.rounds]


def test_a_numpy_fedavgm_gives_the_builtin_fedavgm_with_the_same_options(tmp_path):
    options = {"server_learning_rate": 0.7, "momentum": 0.5}
    builtin = simulate({"type": "fedavgm", **options}, tmp_path / "builtin", client=Wide)
    python = simulate(NumpyFedAvgM(**options), tmp_path / "python", client=Wide)
    same_bits(python.parameters, builtin.parameters)
    # Other options give another model: they are read.
    other = simulate({"type": "fedavgm", "server_learning_rate": 0.7, "momentum": 0.1},
                     tmp_path / "other", client=Wide)
    assert other.parameters[0].tobytes() != builtin.parameters[0].tobytes()


def test_builtin_strategies_by_name_with_options_in_run_and_simulate(tmp_path):
    # By name: fedavgm's defaults; by dict: its options, checked as [algorithm]'s.
    named = simulate("fedavgm", tmp_path / "named", rounds=2)
    assert "type = \"fedavgm\"" in (Path(named.run_dir) / "config.toml").read_text()
    with pytest.raises(cohort.ConfigError, match="momentum") as error:
        simulate({"type": "fedavgm", "momentum": 1.5}, tmp_path / "bad", rounds=1)
    assert any(key and "momentum" in key for _, key, _ in error.value.errors)
    with pytest.raises(cohort.ConfigError, match="fedavgx"):
        simulate("fedavgx", tmp_path / "unknown", rounds=1)
    result = cohort.run(job(rounds=1), run_dir=tmp_path / "run", data_dir=FIXTURE_DATA,
                        strategy={"type": "fedavgm", "momentum": 0.25})
    config = (Path(result.run_dir) / "config.toml").read_text()
    assert "type = \"fedavgm\"" in config and "momentum = 0.25" in config
    with pytest.raises(TypeError, match="cohort.Strategy instance"):
        simulate(42, tmp_path / "number", rounds=1)


KILLED_RUN = """
import sys
sys.path.insert(0, {here!r})
from strategies_support import NumpyFedAvg, NumpyFedAvgM, SlowWide, simulate
simulate({strategy}, {run_dir!r}, rounds=6, client=SlowWide)
"""

# Plain FedAvg (the round loop's own state alone) and FedAvgM (state of the
# strategy's own as well): as the child process's script builds it, and as
# this process does.
KILLED_STRATEGIES = [
    ("NumpyFedAvg()", NumpyFedAvg),
    ("NumpyFedAvgM(momentum=0.5)", lambda: NumpyFedAvgM(momentum=0.5)),
]


@pytest.mark.parametrize("strategy, make", KILLED_STRATEGIES)
def test_a_python_strategy_killed_and_resumed_equals_the_uninterrupted_run(
        tmp_path, strategy, make):
    uninterrupted = make()
    whole = simulate(uninterrupted, tmp_path / "whole", rounds=6, client=Wide)

    run_dir = tmp_path / "killed"
    script = KILLED_RUN.format(here=str(HERE), run_dir=str(run_dir), strategy=strategy)
    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    checkpoint = run_dir / "checkpoints" / "round-0002.json"
    deadline = time.monotonic() + 120
    while not checkpoint.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    # The run in the child, and its workers, die mid-run without a word.
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    assert checkpoint.exists(), "the run ended before its second checkpoint"
    assert not (run_dir / "checkpoints" / "round-0006.json").exists(), "the run was not cut"
    resumed_strategy = make()
    resumed = simulate(resumed_strategy, run_dir, rounds=6, client=SlowWide, resume=True)
    same_bits(resumed.parameters, whole.parameters)
    assert [r["round"] for r in resumed.rounds] == list(range(1, 7))
    if isinstance(uninterrupted, NumpyFedAvgM):
        assert_same_momentum_state(run_dir, resumed_strategy, uninterrupted)


def assert_same_momentum_state(run_dir, resumed_strategy, uninterrupted):
    # The state in the checkpoint is arrays and scalars, as stored.
    assert (run_dir / "checkpoints" / "round-0002.state.safetensors").exists()
    same_bits(resumed_strategy.velocity, uninterrupted.velocity)
    assert resumed_strategy.steps == uninterrupted.steps == 6
    assert type(resumed_strategy.steps) is int
    assert resumed_strategy.last_step.hex() == uninterrupted.last_step.hex()


class Keeps(cohort.Strategy):
    """FedAvg whose state is whatever the test gives."""

    def __init__(self, state):
        self.state = state

    def aggregate_fit(self, server_round, parameters, results):
        return NumpyFedAvg().aggregate_fit(server_round, parameters, results)

    def get_state(self):
        return self.state


@pytest.mark.parametrize("state, refused", [
    ({"history": [1.0, 2.0]}, r"key 'history' is a builtins.list"),
    ({"model": object()}, r"key 'model' is a builtins.object"),
    ({"table": {"a": 1}}, r"key 'table' is a builtins.dict"),
    ({"names": np.array(["a", "b"])}, r"key 'names' is an array of dtype <U1"),
    ({"objects": np.array([None], dtype=object)}, r"key 'objects' is an array of dtype object"),
    ({"not.an.identifier": 1}, r"key 'not.an.identifier' is not an identifier"),
    ({"huge": 1 << 70}, r"key 'huge' = \d+ does not fit 64 bits"),
    ({"nan": np.array([np.nan], np.float32)}, r"array 'nan' holds values that are not finite"),
])
def test_a_state_that_is_not_arrays_and_scalars_is_refused_naming_the_key(tmp_path, state, refused):
    with pytest.raises((TypeError, ValueError), match=refused):
        simulate(Keeps(state), tmp_path / "run", rounds=1)


def test_a_state_that_goes_bad_later_stops_the_run_in_that_round(tmp_path):
    class Grows(Keeps):
        def aggregate_fit(self, server_round, parameters, results):
            if server_round == 2:
                self.state = {"seen": [server_round]}
            return super().aggregate_fit(server_round, parameters, results)

    with pytest.raises(TypeError, match="key 'seen' is a builtins.list"):
        simulate(Grows({"seen": 1}), tmp_path / "run", rounds=3)
    checkpoints = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("round-*.json"))
    assert checkpoints == ["round-0001.json"]


def test_an_exception_in_the_strategy_fails_the_run_with_it(tmp_path):
    class Broken(cohort.Strategy):
        def aggregate_fit(self, server_round, parameters, results):
            if server_round == 2:
                raise ZeroDivisionError("the strategy's own bug")
            return fedavg_of(parameters, results)

    def fedavg_of(parameters, results):
        return NumpyFedAvg().aggregate_fit(0, parameters, results)

    with pytest.raises(ZeroDivisionError, match="the strategy's own bug"):
        simulate(Broken(), tmp_path / "run", rounds=3)
    # Round 1 is recorded and checkpointed: the run resumes once fixed.
    assert (tmp_path / "run" / "checkpoints" / "round-0001.json").exists()


def test_what_aggregate_fit_returns_is_checked_against_the_model(tmp_path):
    class WrongShape(cohort.Strategy):
        def aggregate_fit(self, server_round, parameters, results):
            return [np.zeros(4, np.float32), parameters[1]]

    with pytest.raises(ValueError, match=r"aggregate_fit returned `0` as float32 \[4\]"):
        simulate(WrongShape(), tmp_path / "shape", rounds=1)

    class TooFew(cohort.Strategy):
        def aggregate_fit(self, server_round, parameters, results):
            return parameters[:1]

    with pytest.raises(ValueError, match="returned 1 arrays; the model has 2"):
        simulate(TooFew(), tmp_path / "few", rounds=1)

    with pytest.raises(TypeError, match="does not implement aggregate_fit"):
        simulate(cohort.Strategy(), tmp_path / "base", rounds=1)


def test_configure_fit_sets_each_clients_instructions_and_is_checked(tmp_path):
    class Halves(NumpyFedAvg):
        def configure_fit(self, server_round, parameters, client_id, config):
            assert len(parameters) == 2 and config["proximal_mu"] == 0.0
            return {**config, "learning_rate": config["learning_rate"] / 2}

    class Seen(Regression):
        def fit(self, parameters, config):
            assert config["learning_rate"] == 0.005, config
            return super().fit(parameters, config)

    result = simulate(Halves(), tmp_path / "halves", rounds=1, client=Seen)
    assert all(c["dropped"] is None for c in result.clients)

    class Unknown(NumpyFedAvg):
        def configure_fit(self, server_round, parameters, client_id, config):
            return {"learning_rate": 0.1, "epochs": 3}

    with pytest.raises(ValueError, match="unknown key\\(s\\) 'epochs'"):
        simulate(Unknown(), tmp_path / "unknown", rounds=1)


def test_the_strategys_evaluate_is_the_servers_evaluation_in_simulate(tmp_path):
    class Evaluates(NumpyFedAvg):
        def evaluate(self, server_round, parameters):
            return 0.5, {"accuracy": server_round / 10}

    result = simulate(Evaluates(), tmp_path / "run", rounds=2)
    assert [r["accuracy"] for r in result.rounds] == [0.1, 0.2]


def test_a_run_resumes_only_with_the_strategy_it_was_started_with(tmp_path):
    simulate(NumpyFedAvgM(), tmp_path / "run", rounds=1)
    # The other strategy refuses the state, so the checkpoint is skipped.
    with pytest.raises(cohort.CohortError, match="its strategy state is refused: strategy "
                       "python:NumpyFedAvg failed: set_state raised ValueError: NumpyFedAvg "
                       "keeps no state"):
        simulate(NumpyFedAvg(), tmp_path / "run", rounds=2, resume=True)

    class Renamed(NumpyFedAvgM):
        name = "momentum-v2"

    with pytest.raises(cohort.CohortError, match="strategy `python:NumpyFedAvgM`, but this run "
                       "uses `momentum-v2`"):
        simulate(Renamed(), tmp_path / "run", rounds=2, resume=True)


def every_kind():
    """A state of every kind a checkpoint stores, with values that a lossy
    path (JSON floats, a cast, a pickle of the wrong type) would change."""
    nan_with_payload = np.frombuffer(np.array([0x7FF8000000000123], "<u8").tobytes(), "<f8")[0]
    return {
        "count": 3,
        "big": -(1 << 62) - 7,
        "third": 1.0 / 3.0,
        "negative_zero": -0.0,
        "odd_nan": float(nan_with_payload),
        "flag": True,
        "label": "momentum ✓",
        "nothing": None,
        "f32_scalar": np.float32(0.1),
        "i64_scalar": np.int64(-5),
        "f64_scalar": np.float64(np.pi),
        "wide": np.array([[np.inf, -np.inf], [1e-310, -0.0]]),
        "f16": np.array([0.1, 65504], np.float16),
        "counts": np.arange(6, dtype=np.int32).reshape(2, 3),
        "mask": np.array([True, False]),
        "bytes": np.array([0, 255], np.uint8),
        "empty": np.zeros((0, 4), np.float32),
    }


def assert_same_state(got, expected):
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert type(got[key]) is type(value), key
        if isinstance(value, float):
            assert np.float64(got[key]).tobytes() == np.float64(value).tobytes(), key
        elif isinstance(value, (np.ndarray, np.generic)):
            assert got[key].dtype == value.dtype and np.shape(got[key]) == np.shape(value), key
            assert np.asarray(got[key]).tobytes() == np.asarray(value).tobytes(), key
        else:
            assert got[key] == value, key


class EveryKind(NumpyFedAvg):
    def __init__(self):
        self.restored = None

    def get_state(self):
        return every_kind()

    def set_state(self, state):
        self.restored = state


def test_every_kind_of_state_comes_back_from_a_checkpoint_exactly(tmp_path):
    class Stop(Exception):
        pass

    def stop_after_one(row):
        raise Stop

    with pytest.raises(Stop):
        simulate(EveryKind(), tmp_path / "run", rounds=2, on_round=stop_after_one)
    resumed = EveryKind()
    simulate(resumed, tmp_path / "run", rounds=2, resume=True)
    assert_same_state(resumed.restored, every_kind())


def test_a_stateful_strategy_in_cohort_run_stops_and_resumes_to_the_same_model(tmp_path):
    whole = cohort.run(job(rounds=3), run_dir=tmp_path / "whole", data_dir=FIXTURE_DATA,
                       strategy=NumpyFedAvgM(momentum=0.5))

    class Stop(Exception):
        pass

    def stop_at_two(row):
        if row["round"] == 2:
            raise Stop

    with pytest.raises(Stop):
        cohort.run(job(rounds=3), run_dir=tmp_path / "cut", data_dir=FIXTURE_DATA,
                   strategy=NumpyFedAvgM(momentum=0.5), on_round=stop_at_two)
    resumed = cohort.run(job(rounds=3), run_dir=tmp_path / "cut", data_dir=FIXTURE_DATA,
                         strategy=NumpyFedAvgM(momentum=0.5), resume=True)
    assert [r["round"] for r in resumed.rounds] == [1, 2, 3]
    for name, array in whole.model.items():
        assert resumed.model[name].tobytes() == array.tobytes(), name
