import json
import os
import subprocess

import numpy as np
import pytest

import cohort
from conftest import FIXTURE_DATA, fixture_labels


def test_partitions_equal_those_of_cohort_partitions_for_the_same_seed(tmp_path, cohort_bin):
    labels = fixture_labels()
    options = {"alpha": 0.5, "seed": 7, "min_size": 2}
    config = tmp_path / "split.toml"
    config.write_text(
        "[clients]\ntotal_clients = 4\nper_round = 2\n"
        "[data]\ndatasource = \"FashionMNIST\"\ndownload = false\nsampler = \"dirichlet\"\n"
        "concentration = 0.5\nrandom_seed = 7\nmin_partition_size = 2\n"
        "[parameters.optimizer]\nlearning_rate = 0.01\n"
    )
    out = tmp_path / "assignment.json"
    subprocess.run(
        [cohort_bin, "partitions", "--config", str(config), "--json", str(out)],
        check=True,
        capture_output=True,
        env={**os.environ, "COHORT_DATA_DIR": str(FIXTURE_DATA)},
    )
    expected = [c["train"] for c in json.loads(out.read_text())["clients"]]
    got = cohort.partition(labels, "dirichlet", num_clients=4, **options)
    assert [p.tolist() for p in got] == expected


def test_iid_partitions_are_disjoint_seeded_and_of_equal_size():
    labels = np.arange(1000) % 10
    parts = cohort.partition(labels, "iid", num_clients=10, seed=1)
    assert [len(p) for p in parts] == [100] * 10
    assert all(p.dtype == np.int64 for p in parts)
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == 1000
    again = cohort.partition(labels, "iid", num_clients=10, seed=1)
    other = cohort.partition(labels, "iid", num_clients=10, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_dirichlet_skews_labels_more_as_alpha_shrinks():
    labels = np.repeat(np.arange(10), 200)

    def mean_classes(alpha):
        parts = cohort.partition(labels, "dirichlet", num_clients=20, alpha=alpha, seed=3)
        assert sum(len(p) for p in parts) <= len(labels)
        return np.mean([len(np.unique(labels[p])) for p in parts])

    assert mean_classes(0.05) < mean_classes(100.0)


def test_shards_and_natural_partitions():
    labels = np.repeat(np.arange(4), 25)
    parts = cohort.partition(labels, "shards", num_clients=4, shards_per_client=2, seed=0)
    assert all(len(np.unique(labels[p])) <= 2 for p in parts)
    users = np.array([0, 1, 1, 2, 2, 2])
    natural = cohort.partition(np.zeros(6, dtype=int), "natural", num_clients=3, users=users)
    assert sorted(len(p) for p in natural) == [1, 2, 3]
    with pytest.raises(cohort.CohortError, match="users|writers|natural"):
        cohort.partition(np.zeros(6, dtype=int), "natural", num_clients=3)


def test_bad_partition_input_is_refused_naming_what():
    with pytest.raises(cohort.ConfigError, match="data.sampler"):
        cohort.partition([0, 1], "dirichlett", num_clients=2)
    with pytest.raises(cohort.ConfigError, match="data.concentration"):
        cohort.partition([0, 1, 0, 1], "dirichlet", num_clients=2, alpha=-1.0)
    with pytest.raises(ValueError, match="labels"):
        cohort.partition([0, -1], "iid", num_clients=2)
    with pytest.raises(TypeError, match="labels must be integers"):
        cohort.partition([0.5, 1.0], "iid", num_clients=2)
    with pytest.raises(TypeError, match="unknown option"):
        cohort.partition([0, 1], "iid", num_clients=2, concentration=1.0)


def _model(rng):
    return {
        "fc.weight": rng.standard_normal((3, 4)).astype(np.float32),
        "fc.bias": rng.standard_normal(3).astype(np.float32),
    }


def test_fedavg_is_the_sample_weighted_mean():
    rng = np.random.default_rng(0)
    global_model = _model(rng)
    updates = [(_model(rng), n) for n in (10, 30, 60)]
    got = cohort.aggregate("fedavg", global_model, updates)
    assert sorted(got) == sorted(global_model)
    for name in global_model:
        stacked = np.stack([u[name].astype(np.float64) for u, _ in updates])
        expected = np.average(stacked, axis=0, weights=[10, 30, 60])
        assert got[name].dtype == np.float32
        np.testing.assert_allclose(got[name], expected, rtol=1e-6, atol=1e-6)


def test_median_of_flower_style_parameter_lists():
    rng = np.random.default_rng(1)
    global_model = [rng.standard_normal((2, 2)).astype(np.float32) for _ in range(12)]
    updates = [([rng.standard_normal((2, 2)).astype(np.float32) for _ in range(12)], 5)
               for _ in range(5)]
    got = cohort.aggregate("median", global_model, updates)
    assert isinstance(got, list) and len(got) == 12
    for index in range(12):
        expected = np.median(np.stack([u[index] for u, _ in updates]), axis=0)
        np.testing.assert_allclose(got[index], expected, rtol=1e-6)


def test_krum_says_which_update_it_selected():
    rng = np.random.default_rng(2)
    global_model = _model(rng)
    honest = [({k: v + 0.01 * rng.standard_normal(v.shape).astype(np.float32)
                for k, v in global_model.items()}, 10) for _ in range(4)]
    attacker = ({k: v + 100.0 for k, v in global_model.items()}, 10)
    model, facts = cohort.aggregate("krum", global_model, honest + [attacker],
                                    byzantine=1, details=True)
    assert facts["selected"] and 5 not in facts["selected"]
    assert np.abs(model["fc.bias"] - global_model["fc.bias"]).max() < 1.0


def test_bad_aggregation_input_is_refused_naming_what():
    rng = np.random.default_rng(3)
    global_model = _model(rng)
    with pytest.raises(cohort.ConfigError, match="algorithm.type.*did you mean `fedavg`"):
        cohort.aggregate("fedavgg", global_model, [(global_model, 1)])
    with pytest.raises(cohort.ConfigError, match="algorithm"):
        cohort.aggregate("fedavgm", global_model, [(global_model, 1)], momentum=-3.0)
    wrong = {"fc.weight": np.zeros((4, 3), np.float32), "fc.bias": np.zeros(3, np.float32)}
    with pytest.raises(cohort.CohortError, match="fc.weight"):
        cohort.aggregate("fedavg", global_model, [(wrong, 1)])
    with pytest.raises(TypeError, match="dtype"):
        cohort.aggregate("fedavg", {"x": np.array(["a"])}, [({"x": np.array(["a"])}, 1)])
    with pytest.raises(TypeError, match="pair"):
        cohort.aggregate("fedavg", global_model, [global_model])
