"""Config errors name the file, the key, what was expected and what was found."""

import msgspec
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


@pytest.mark.parametrize(
    ("alias", "edge", "past", "rule"),
    [
        ("PositiveInt", 1, 0, "int >= 1"),
        ("NonNegativeInt", 0, -1, "int >= 0"),
        ("PositiveFloat", 1e-9, 0.0, "float > 0.0"),
        ("NonNegativeFloat", 0.0, -1e-9, "float >= 0.0"),
        ("Seconds", 1e-9, 0.0, "float > 0.0"),
        ("Fraction", 1.0, 0.0, "float > 0.0"),
        ("UnitInterval", 0.0, 1.5, "float <= 1.0"),
        ("OpenUnitInterval", 0.5, 1.0, "float < 1.0"),
        ("Correlation", -1.0, 1.5, "float <= 1.0"),
    ],
)
def test_shared_constraint_aliases_accept_the_edge_and_name_the_rule(alias, edge, past, rule):
    import msgspec

    import pivot.config as config

    section = msgspec.defstruct("Section", [("x", getattr(config, alias))], bases=(ConfigStruct,))
    assert config.convert({"x": edge}, section, "s").x == edge
    with pytest.raises(ConfigError) as err:
        config.convert({"x": past}, section, "s")
    assert (err.value.key, err.value.expected) == ("x", rule)


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


def _plan(text: str):
    from pivot.job import JobConfig

    return decode_toml(text, JobConfig, "j.toml").validate("j.toml").plan()


def _starts(deployment) -> dict:
    """What each agent device starts as: its role (free where nothing is placed)."""
    from pivot.cluster import Role

    placed = deployment.placements
    return {d: placed[d].role if d in placed else Role.FREE for d in deployment.agent_devices}


def test_deployment_plans_of_a_four_device_job():
    from pivot.cluster import Role

    ro, rm, free = Role.ROLLOUT, Role.REWARD, Role.FREE
    pivot = _plan("[deployment]\nkind = 'pivot'\n")
    assert pivot.trainer_devices == (2, 3) and pivot.lent_pool == (2, 3)
    # a real job's lent pool starts free: its Controller lends it before the first step
    assert _starts(pivot) == {0: ro, 1: rm, 2: free, 3: free}
    assert pivot.managed == 4 and pivot.policy == "planner"
    assert pivot.placements[0].replica == "rollout@0" and pivot.placements[1].replica == "reward@1"

    # fixed pools: the trainer pool hosts no role agent
    dis = _plan("[deployment]\nkind = 'disaggregated'\n")
    assert dis.trainer_devices == (2, 3) and dis.agent_devices == (0, 1)
    assert _starts(dis) == {0: ro, 1: rm}
    assert not dis.managed and dis.policy == "none" and dis.lent_pool == ()
    assert dis.engine_roles(0) == (ro,)  # an unmanaged agent keeps only its role's engine

    # rollout-reward colocated: the shared devices all start with rollout
    rr = _plan("[deployment]\nkind = 'rr-colocated'\n")
    assert _starts(rr) == {0: ro, 1: ro}
    assert rr.managed == 2 and rr.policy == "stages" and rr.lent_pool == ()
    assert rr.engine_roles(0) == (ro, rm)

    # colocated: every device trains and serves inference in turn
    co = _plan("[deployment]\nkind = 'colocated'\n")
    assert co.trainer_devices == (0, 1, 2, 3)
    assert _starts(co) == dict.fromkeys(range(4), free)
    assert co.managed == 4 and co.policy == "stages"

    exact = _plan("[reward]\nkind = 'exact'\n[deployment]\nrollout_devices = 1\n")
    assert _starts(exact) == {0: ro, 1: ro, 2: free, 3: free}
    assert exact.roles == (ro,)


def test_unknown_deployment_kind_names_the_choices():
    from pivot.job import JobConfig

    with pytest.raises(ConfigError) as err:
        decode_toml("[deployment]\nkind = 'colo'\n", JobConfig, "j.toml")
    assert "deployment.kind" in str(err.value) and "rr-colocated" in str(err.value)


def test_the_readme_config_reference_is_every_key_at_its_default():
    """The README's reference block parses as a job config equal to the defaults and names
    every key of it: a key added without its documentation, or a default changed without
    it, fails here."""
    import re
    import tomllib
    from pathlib import Path

    from pivot.job import JobConfig

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"### Config reference.*?```toml\n(.*?)```", readme, re.S).group(1)
    documented = tomllib.loads(block)

    def leaves(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for key, value in tree.items():
            if isinstance(value, dict):
                out |= leaves(value, f"{prefix}{key}.")
            else:
                out.add(prefix + key)
        return out

    defaults = msgspec.to_builtins(JobConfig())
    assert leaves(documented) == leaves(defaults)
    assert decode_toml(block, JobConfig, "README.md") == JobConfig()
