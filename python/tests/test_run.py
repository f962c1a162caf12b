import os
import signal
import threading

import numpy as np
import pytest
import safetensors.numpy

import cohort
from conftest import FIXTURE_DATA, job


def run(config, run_dir, **kwargs):
    return cohort.run(config, run_dir=run_dir, data_dir=FIXTURE_DATA, **kwargs)


def test_a_run_returns_its_rows_and_the_model_it_wrote(tmp_path):
    seen = []
    result = run(job(), tmp_path / "run", on_round=seen.append)
    assert [r["round"] for r in result.rounds] == [1, 2]
    assert seen == list(result.rounds)
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in result.rounds)
    # Two clients a round, each row naming its round and client.
    assert [(c["round"], c["dropped"]) for c in result.clients] == [(1, None)] * 2 + [(2, None)] * 2
    assert all(1 <= c["client_id"] <= 4 and c["samples"] == 100 for c in result.clients)
    # The final model is the run folder's model file, in PyTorch's layout.
    on_disk = safetensors.numpy.load_file(result.model_path)
    assert sorted(on_disk) == sorted(result.model)
    for name, array in on_disk.items():
        assert result.model[name].dtype == array.dtype
        np.testing.assert_array_equal(result.model[name], array)
    assert result.model["conv1.weight"].shape == (6, 1, 5, 5)
    assert result.model["conv1.weight"].flags.writeable
    assert os.path.isfile(os.path.join(result.run_dir, "results.csv"))


def test_the_rows_become_data_frames_where_pandas_is_installed(tmp_path):
    result = run(job(rounds=1), tmp_path / "run")
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pandas"):
            result.to_pandas()
        return
    frame = result.to_pandas()
    assert list(frame["round"]) == [1]
    assert len(result.clients.to_pandas()) == 2


def test_a_run_from_a_file_with_overrides_equals_the_same_dict(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(cohort.check(job(rounds=3)))
    from_file = run(path, tmp_path / "file", overrides={"trainer.rounds": 1})
    from_dict = run(job(rounds=1), tmp_path / "dict")
    assert len(from_file.rounds) == 1
    for name in from_dict.model:
        np.testing.assert_array_equal(from_file.model[name], from_dict.model[name])


def test_a_config_error_is_raised_before_anything_runs(tmp_path):
    config = job()
    config["clients"]["per_round"] = 9
    with pytest.raises(cohort.ConfigError, match="clients.per_round"):
        run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_failing_callback_stops_the_run_after_its_round_resumably(tmp_path):
    whole = run(job(rounds=3), tmp_path / "whole")

    def fail_at_one(row):
        if row["round"] == 1:
            raise ValueError("stop here")

    stopped_dir = tmp_path / "stopped"
    with pytest.raises(ValueError, match="stop here"):
        run(job(rounds=3), stopped_dir, on_round=fail_at_one)
    results = (stopped_dir / "results.csv").read_text().splitlines()
    assert len(results) == 2, results  # the header and round 1
    resumed = run(job(rounds=3), stopped_dir, resume=True)
    assert [r["round"] for r in resumed.rounds] == [1, 2, 3]
    for name in whole.model:
        np.testing.assert_array_equal(resumed.model[name], whole.model[name])


def test_ctrl_c_stops_the_run_cleanly_and_it_resumes_to_the_same_model(tmp_path):
    whole = run(job(rounds=4), tmp_path / "whole")
    main = threading.main_thread().ident

    def interrupt_soon(row):
        # A real SIGINT, delivered while the engine trains the next round
        # with the GIL released, as a Ctrl-C at the terminal would be.
        if row["round"] == 1:
            threading.Timer(0.01, signal.pthread_kill, (main, signal.SIGINT)).start()

    stopped_dir = tmp_path / "stopped"
    with pytest.raises(KeyboardInterrupt):
        run(job(rounds=4), stopped_dir, on_round=interrupt_soon)
    done = len((stopped_dir / "results.csv").read_text().splitlines()) - 1
    assert 1 <= done < 4, done
    assert (stopped_dir / "checkpoints").is_dir()
    resumed = run(job(rounds=4), stopped_dir, resume=True)
    assert [r["round"] for r in resumed.rounds] == [1, 2, 3, 4]
    for name in whole.model:
        np.testing.assert_array_equal(resumed.model[name], whole.model[name])


def test_resume_needs_the_folder_of_the_run():
    with pytest.raises(ValueError, match="run_dir"):
        cohort.run(job(), resume=True)
