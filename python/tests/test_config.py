import subprocess

import pytest

import cohort
from conftest import job


def test_every_problem_of_a_dict_config_is_raised_at_once_with_its_key():
    config = job()
    config["clients"]["per_round"] = 0
    config["trainer"]["roundz"] = 3
    with pytest.raises(cohort.ConfigError) as raised:
        cohort.check(config)
    error = raised.value
    keys = [key for _, key, _ in error.errors]
    assert len(error.errors) == 2, error.errors
    assert "clients.per_round" in keys
    assert any(key and "roundz" in key for key in keys), keys
    assert str(error).startswith("2 problems in the config:"), str(error)
    assert all(file == "<dict>" for file, _, _ in error.errors)
    assert isinstance(error, ValueError)


def test_a_config_file_error_is_the_message_the_cohort_command_prints(tmp_path, cohort_bin):
    path = tmp_path / "bad.toml"
    path.write_text(
        "[clients]\ntotal_clients = 4\nper_round = 9\n[trainer]\noptimiser = \"sgd\"\n"
    )
    with pytest.raises(cohort.ConfigError) as raised:
        cohort.check(path)
    message = str(raised.value)
    assert str(path) in message
    printed = subprocess.run(
        [cohort_bin, "check", "--config", str(path)], capture_output=True, text=True
    )
    assert printed.returncode != 0
    assert message in printed.stderr, (message, printed.stderr)


def test_overrides_are_checked_as_set_is_and_none_unsets_a_key():
    with pytest.raises(cohort.ConfigError) as raised:
        cohort.check(job(), {"trainer.rounds": 0})
    (file, key, _), = raised.value.errors
    assert (file, key) == ("--set trainer.rounds=0", "trainer.rounds")
    merged = cohort.check(job(), {"trainer.rounds": 7, "data.partition_size": None})
    assert "rounds = 7" in merged
    assert "partition_size" not in merged
    with pytest.raises(cohort.ConfigError, match="not.*KEY|key"):
        cohort.check(job(), {"": 1})


def test_a_value_toml_cannot_hold_is_refused_naming_its_key():
    config = job()
    config["trainer"]["rounds"] = None
    with pytest.raises(cohort.ConfigError, match="None has no TOML form"):
        cohort.check(config)
    with pytest.raises(TypeError, match="path or a dict"):
        cohort.check(42)
