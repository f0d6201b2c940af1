"""Config errors name the file, the key, what was expected and what was found."""

import pytest

from pivot.config import ConfigError, ConfigStruct, decode_toml, load_toml


class Trainer(ConfigStruct):
    lr: float = 1e-3
    zero_stage: int = 2


class Cluster(ConfigStruct):
    devices: int
    hosts: list[str] = []


class Job(ConfigStruct):
    name: str
    cluster: Cluster
    trainer: Trainer = Trainer()


def test_valid_config_decodes_with_defaults():
    job = decode_toml('name = "t"\n[cluster]\ndevices = 4\n', Job, "tiny.toml")
    assert job.cluster.devices == 4
    assert job.trainer.zero_stage == 2
    assert job.cluster.hosts == []


def test_wrong_type_names_file_key_expected_found():
    with pytest.raises(ConfigError) as err:
        decode_toml('name = "t"\n[cluster]\ndevices = "four"\n', Job, "tiny.toml")
    e = err.value
    assert (e.source, e.key, e.expected) == ("tiny.toml", "cluster.devices", "int")
    assert "'four'" in e.found
    assert str(e) == "tiny.toml: key 'cluster.devices': expected int, found str 'four'"


def test_unknown_key_is_an_error_not_ignored():
    with pytest.raises(ConfigError) as err:
        decode_toml('name = "t"\n[cluster]\ndevices = 4\ndevice = 5\n', Job, "x.toml")
    assert err.value.key == "cluster.device"
    assert "unknown" in str(err.value)


def test_missing_required_key():
    with pytest.raises(ConfigError) as err:
        decode_toml('name = "t"\n[cluster]\n', Job, "x.toml")
    assert err.value.key == "cluster.devices"
    assert err.value.found == "nothing"


def test_list_element_path():
    with pytest.raises(ConfigError) as err:
        decode_toml('name = "t"\n[cluster]\ndevices = 1\nhosts = ["a", 3]\n', Job, "x.toml")
    assert err.value.key == "cluster.hosts[1]"
    assert err.value.expected == "str"
    assert err.value.found == "int 3"


def test_syntax_error_and_missing_file(tmp_path):
    with pytest.raises(ConfigError) as err:
        decode_toml("name = \n", Job, "bad.toml")
    assert "bad.toml" in str(err.value) and "TOML" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_toml(tmp_path / "nope.toml", Job)
    assert "no such file" in str(err.value)


def test_load_toml_reads_file(tmp_path):
    p = tmp_path / "job.toml"
    p.write_text('name = "j"\n[cluster]\ndevices = 2\n[trainer]\nlr = 0.5\n')
    job = load_toml(p, Job)
    assert job.trainer.lr == 0.5 and job.name == "j"


def test_constraint_violation_names_the_rule():
    from pivot.job import JobConfig

    with pytest.raises(ConfigError) as err:
        decode_toml("[cluster]\ndevices = 0\n", JobConfig, "tiny.toml")
    assert str(err.value) == "tiny.toml: key 'cluster.devices': expected int >= 1, found int 0"
    with pytest.raises(ConfigError) as err:
        decode_toml("[rollout]\ntop_p = 2.0\n", JobConfig, "tiny.toml")
    assert err.value.key == "rollout.top_p" and err.value.expected == "float <= 1.0"


def test_shipped_tiny_config_is_valid():
    from pathlib import Path

    from pivot.job import JobConfig

    root = Path(__file__).resolve().parents[2]
    job = load_toml(root / "configs" / "tiny.toml", JobConfig)
    assert job.validate(str(root / "configs" / "tiny.toml")) is job


def test_job_rules_across_sections():
    from pivot.job import JobConfig

    job = decode_toml("[cluster]\ndevices = 2\ntrainer_devices = 2\n", JobConfig, "j.toml")
    with pytest.raises(ConfigError) as err:
        job.validate("j.toml")
    assert err.value.key == "cluster.trainer_devices"
    job = decode_toml(
        '[deployment]\nkind = "disaggregated"\nrollout_devices = 2\n', JobConfig, "j.toml"
    )
    with pytest.raises(ConfigError) as err:
        job.validate("j.toml")
    assert err.value.key == "deployment.rollout_devices" and "GenRM" in err.value.expected
    job = decode_toml("[deployment]\nrollout_devices = 2\n", JobConfig, "j.toml")
    assert job.validate("j.toml") is job  # under pivot, all shared devices may start as rollout
    job = decode_toml("[training]\ntemperature = 0.5\n", JobConfig, "j.toml")
    with pytest.raises(ConfigError) as err:
        job.validate("j.toml")
    assert err.value.key == "training.temperature"
