"""cohort.connect: NumPyClient processes join a network-mode run served by
the wheel's `cohort` command, as own-data clients over cohort's gRPC
protocol."""

import csv
import gzip
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import cohort
from conftest import FIXTURE_DATA, REPO

SERVER_CONFIG = """
[clients]
total_clients = 2
per_round = 2
own_data_clients = 2
comm_simulation = false

[server]
port = {port}
registration_timeout = 60
random_seed = 2

[data]
datasource = "FashionMNIST"
download = false

[trainer]
rounds = 2
epochs = 1
batch_size = 20
optimizer = "sgd"
model_name = "lenet5"
model_seed = 3
max_concurrency = 2

[parameters.optimizer]
learning_rate = 0.05

[results]
keep_client_updates = true
"""

# Each client shifts every tensor of the model it gets by 0.001 · (cid + 1),
# so that its update can be recomputed from the model it was sent.
CLIENT = """
import sys
import numpy as np
import cohort

class Shift:
    def __init__(self, cid):
        self.cid = cid
        self.shift = np.float32(0.001 * (int(cid) + 1))

    def get_parameters(self, config):
        return []

    def fit(self, parameters, config):
        assert config["cid"] == self.cid, config
        return [p + self.shift for p in parameters], {samples}, {{"loss": 0.25}}

    def evaluate(self, parameters, config):
        return 0.0, 0, {{}}

done = cohort.connect("127.0.0.1:{port}", Shift, num_examples={samples}, client_id={client_id})
print("connect returned", done["tasks"], done["failed"])
"""

SAMPLES = {1: 30, 2: 50}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def wheel_command():
    found = shutil.which("cohort", path=os.path.dirname(sys.executable))
    if not found:
        pytest.skip("the wheel's `cohort` command is not beside this interpreter")
    return found


def test_numpy_clients_join_a_cohort_server_and_their_updates_are_aggregated(tmp_path, wheel_command):
    port = free_port()
    config = tmp_path / "server.toml"
    config.write_text(SERVER_CONFIG.format(port=port))
    base = tmp_path / "runs"
    server = subprocess.Popen(
        [wheel_command, "run", "--config", str(config), "--cpu", "--quiet", "--base", str(base),
         "--local-clients", "0"],
        env={**os.environ, "COHORT_DATA_DIR": str(FIXTURE_DATA)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    clients = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT.format(port=port, samples=samples, client_id=client_id)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for client_id, samples in SAMPLES.items()
    ]
    try:
        _, server_err = server.communicate(timeout=240)
        outputs = [client.communicate(timeout=60) for client in clients]
    finally:
        for process in [server, *clients]:
            if process.poll() is None:
                process.kill()
    assert server.returncode == 0, server_err
    for client, (out, err) in zip(clients, outputs):
        assert client.returncode == 0, err
        assert "connect returned 2 0" in out, out

    (run_dir,) = base.iterdir()
    with open(run_dir / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((int(r["round"]), int(r["client_id"])) for r in rows) == \
        [(1, 1), (1, 2), (2, 1), (2, 2)]
    for row in rows:
        assert row["dropped"] == "", row
        assert int(row["samples"]) == SAMPLES[int(row["client_id"])], row

    # Round 2's updates are the model after round 1, shifted by each client.
    after_one = safetensors.numpy.load_file(run_dir / "checkpoints" / "round-0001.safetensors")
    updates = {}
    for client_id in SAMPLES:
        update = safetensors.numpy.load_file(
            run_dir / "updates" / "round-0002" / f"client-{client_id:04d}.safetensors")
        shift = np.float32(0.001 * client_id)
        for name, array in update.items():
            if array.dtype == np.float32:
                assert array.tobytes() == (after_one[name] + shift).tobytes(), name
        updates[client_id] = update
    # The final model is their sample-weighted FedAvg.
    final = safetensors.numpy.load_file(run_dir / "model.safetensors")
    expected = cohort.aggregate("fedavg", after_one,
                                [(updates[c], SAMPLES[c]) for c in SAMPLES])
    for name, array in expected.items():
        assert final[name].tobytes() == array.tobytes(), name


def test_connect_names_an_unreachable_server():
    class Never:
        def fit(self, parameters, config):
            raise AssertionError("no task can come")

    with pytest.raises(cohort.CohortError, match="cannot reach the cohort server"):
        cohort.connect(f"127.0.0.1:{free_port()}", Never, num_examples=10, connect_timeout=0.5)


EXAMPLE_CONFIG = """
[clients]
total_clients = 1
per_round = 1
own_data_clients = 1
comm_simulation = false
do_test = true

[server]
port = {port}
registration_timeout = 60

[data]
datasource = "FashionMNIST"
download = false

[trainer]
rounds = 2
epochs = 1
batch_size = 20
optimizer = "sgd"
model_name = "lenet5"
model_seed = 3
max_concurrency = 1

[parameters.optimizer]
learning_rate = 0.05

[results]
keep_client_updates = true
"""


def idx(name, header):
    with gzip.open(FIXTURE_DATA / "fashion-mnist" / name) as f:
        return np.frombuffer(f.read()[header:], dtype=np.uint8)


def test_the_example_client_on_connect_trains_lenet5_in_a_network_run(tmp_path, wheel_command):
    """examples/python_client/client.py: a few lines of NumPyClient on
    cohort.connect, with the example's numpy LeNet-5."""
    images = idx("train-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    labels = idx("train-labels-idx1-ubyte.gz", 8).astype(np.int64)
    data = tmp_path / "mine.safetensors"
    safetensors.numpy.save_file({
        "images": images[:120].copy(), "labels": labels[:120].copy(),
        "test_images": images[120:160].copy(), "test_labels": labels[120:160].copy(),
    }, str(data))
    port = free_port()
    config = tmp_path / "server.toml"
    config.write_text(EXAMPLE_CONFIG.format(port=port))
    base = tmp_path / "runs"
    server = subprocess.Popen(
        [wheel_command, "run", "--config", str(config), "--cpu", "--quiet", "--base", str(base),
         "--local-clients", "0"],
        env={**os.environ, "COHORT_DATA_DIR": str(FIXTURE_DATA)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    example = REPO / "examples" / "python_client" / "client.py"
    client = subprocess.Popen(
        [sys.executable, str(example), "--server", f"127.0.0.1:{port}", "--data", str(data)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _, server_err = server.communicate(timeout=300)
        out, err = client.communicate(timeout=60)
    finally:
        for process in (server, client):
            if process.poll() is None:
                process.kill()
    assert server.returncode == 0, server_err
    assert client.returncode == 0 and "done: 2 tasks, 0 failed" in out, err

    (run_dir,) = base.iterdir()
    with open(run_dir / "clients.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["samples"], r["dropped"]) for r in rows] == [("120", ""), ("120", "")], rows
    assert all(r["test_accuracy"] != "" for r in rows), rows
    # It trained: its update is not the model it was sent.
    after_one = safetensors.numpy.load_file(run_dir / "checkpoints" / "round-0001.safetensors")
    update = safetensors.numpy.load_file(run_dir / "updates" / "round-0002" / "client-0001.safetensors")
    assert any(update[n].tobytes() != after_one[n].tobytes() for n in update)


WAITING_CLIENT = """
import cohort

class Idle:
    def fit(self, parameters, config):
        raise AssertionError("the run never starts: its second client never joins")

cohort.connect("127.0.0.1:{port}", Idle, num_examples=10, client_id=1)
"""


def test_ctrl_c_stops_a_client_waiting_for_the_server(tmp_path, wheel_command):
    port = free_port()
    config = tmp_path / "server.toml"
    # Two own-data clients, of which only one joins: the run waits for the other.
    config.write_text(SERVER_CONFIG.format(port=port))
    server = subprocess.Popen(
        [wheel_command, "run", "--config", str(config), "--cpu", "--quiet", "--base",
         str(tmp_path / "runs"), "--local-clients", "0"],
        env={**os.environ, "COHORT_DATA_DIR": str(FIXTURE_DATA)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    client = subprocess.Popen(
        [sys.executable, "-c", WAITING_CLIENT.format(port=port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        time.sleep(3)
        assert client.poll() is None, client.communicate()
        client.send_signal(signal.SIGINT)
        _, err = client.communicate(timeout=10)
    finally:
        for process in (server, client):
            if process.poll() is None:
                process.kill()
                process.wait()
    assert client.returncode != 0
    assert "KeyboardInterrupt" in err, err


REFUSING_CLIENT = """
import cohort

class Never:
    def fit(self, parameters, config):
        raise AssertionError("a client that refuses the run trains nothing")

try:
    cohort.connect("127.0.0.1:{port}", Never, num_examples=10, client_id=1,
                   require_secure_aggregation=True)
except cohort.CohortError as error:
    print("refused:", error)
"""


def test_a_client_that_requires_secure_aggregation_refuses_a_plain_run(tmp_path, wheel_command):
    port = free_port()
    config = tmp_path / "server.toml"
    # The server's config has no [secure_aggregation]: updates would go in the clear.
    config.write_text(SERVER_CONFIG.format(port=port))
    server = subprocess.Popen(
        [wheel_command, "run", "--config", str(config), "--cpu", "--quiet", "--base",
         str(tmp_path / "runs"), "--local-clients", "0"],
        env={**os.environ, "COHORT_DATA_DIR": str(FIXTURE_DATA)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        client = subprocess.run(
            [sys.executable, "-c", REFUSING_CLIENT.format(port=port)],
            capture_output=True, text=True, timeout=60,
        )
    finally:
        server.kill()
        server.wait()
    assert client.returncode == 0, client.stderr
    assert "refused:" in client.stdout, (client.stdout, client.stderr)
    assert "[secure_aggregation]" in client.stdout and "--require-secure-aggregation" in client.stdout, \
        client.stdout
