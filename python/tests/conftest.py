import gzip
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
# The repository's small copies of the data sets (tests/fixtures/data).
FIXTURE_DATA = REPO / "tests" / "fixtures" / "data"


def job(rounds=2, **sections):
    """A small FashionMNIST federation on the fixture data, as a dict."""
    config = {
        "clients": {"total_clients": 4, "per_round": 2},
        "data": {"datasource": "FashionMNIST", "download": False, "partition_size": 100},
        "trainer": {
            "rounds": rounds,
            "epochs": 1,
            "batch_size": 20,
            "optimizer": "sgd",
            "model_seed": 3,
            "training_seed": 1,
        },
        "parameters": {"optimizer": {"learning_rate": 0.05}},
    }
    for section, keys in sections.items():
        config.setdefault(section, {}).update(keys)
    return config


def fixture_labels(name="fashion-mnist"):
    """The fixture's training labels (IDX: an 8-byte header, then one byte each)."""
    with gzip.open(FIXTURE_DATA / name / "train-labels-idx1-ubyte.gz") as f:
        return np.frombuffer(f.read()[8:], dtype=np.uint8).astype(np.int64)


@pytest.fixture
def cohort_bin():
    """The `cohort` command (COHORT_BIN, or on PATH); CI sets COHORT_BIN."""
    found = os.environ.get("COHORT_BIN") or shutil.which("cohort")
    if not found:
        pytest.skip("the cohort command is needed: set COHORT_BIN")
    return found
