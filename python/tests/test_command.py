"""The wheel's ``cohort`` command: the binary's command line, from the
extension, installed beside the interpreter by pip."""

import os
import socket
import subprocess
import sys
from pathlib import Path


from conftest import FIXTURE_DATA


def wheel_command():
    """The console script pip installed with the wheel (never the binary:
    this is what is tested here, so its absence fails)."""
    script = Path(sys.executable).parent / "cohort"
    assert script.is_file(), f"the wheel installs no `cohort` command beside {sys.executable}"
    return str(script)


def test_the_command_is_the_binarys_command_line(cohort_bin):
    ours = subprocess.run([wheel_command(), "--help"], capture_output=True, text=True)
    binary = subprocess.run([cohort_bin, "--help"], capture_output=True, text=True)
    assert ours.returncode == 0, ours.stderr
    assert ours.stdout == binary.stdout
    for command in ["run", "check", "plot", "partitions", "client", "place", "worker"]:
        assert f"\n  {command} " in ours.stdout, ours.stdout
    usage = subprocess.run([wheel_command(), "run", "--no-such-flag"], capture_output=True, text=True)
    assert usage.returncode == 2
    assert "--no-such-flag" in usage.stderr


def test_a_bad_config_is_an_error_and_exit_code_one(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[clients]\ntotal_clients = 4\nper_round = 9\n")
    printed = subprocess.run(
        [wheel_command(), "check", "--config", str(path)], capture_output=True, text=True
    )
    assert printed.returncode == 1
    assert "clients.per_round" in printed.stderr, printed.stderr


def test_a_network_run_starts_its_client_processes_through_the_command(tmp_path):
    # The server starts its local clients with the program it was started
    # as: here the console script, not the Python interpreter.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / "net.toml"
    config.write_text(
        "[clients]\ntotal_clients = 2\nper_round = 2\ncomm_simulation = false\n"
        f"[server]\nport = {port}\nregistration_timeout = 60\n"
        "[data]\ndatasource = \"FashionMNIST\"\ndownload = false\npartition_size = 40\n"
        "[trainer]\nrounds = 1\nepochs = 1\nbatch_size = 20\noptimizer = \"sgd\"\n"
        "max_concurrency = 2\nmodel_seed = 3\ntraining_seed = 1\n"
        "[parameters.optimizer]\nlearning_rate = 0.05\n"
    )
    env = dict(os.environ, COHORT_DATA_DIR=str(FIXTURE_DATA))
    done = subprocess.run(
        [wheel_command(), "run", "--config", str(config), "--base", str(tmp_path / "runs"), "--quiet"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    rows = (run_dir / "results.csv").read_text().splitlines()
    assert len(rows) == 2, rows
    clients = (run_dir / "clients.csv").read_text().splitlines()
    assert len(clients) == 3, clients
