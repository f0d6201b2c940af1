"""Command-line overrides of a config and the config written back as TOML: an override is
checked like the file and an error in one names it; what ``to_toml`` writes reads back
equal."""

from __future__ import annotations

import pytest

from pivot.config import ConfigError, apply_overrides, decode_toml, load_toml, to_toml
from pivot.deployment import DeploymentKind
from pivot.job import JobConfig
from pivot.training import TrainingSettings

FILE = "seed = 1\n[training]\nlr = 1e-3\n"


def test_values_are_toml_and_a_bare_word_is_a_string():
    job = decode_toml(
        FILE,
        JobConfig,
        "f.toml",
        [
            "training.lr=2e-4",
            "rollout.samples_per_prompt=8",
            "model.policy=path/to/x",  # not TOML: a string, no quotes needed
            "deployment.kind=rr-colocated",
            "training.adam_betas=[0.8, 0.9]",
            "log.samples=true",
            "data.train=",
            "reward.system_prompt='be brief = fair'",  # '=' inside a value
        ],
    )
    assert job.seed == 1  # the file's keys that no override names stay
    assert job.training.lr == 2e-4 and job.rollout.samples_per_prompt == 8
    assert job.model.policy == "path/to/x"
    assert job.deployment.kind is DeploymentKind.RR_COLOCATED
    assert job.training.adam_betas == (0.8, 0.9)
    assert job.log.samples is True and job.data.train == ""
    assert job.reward.system_prompt == "be brief = fair"


def test_later_overrides_win_and_the_file_is_not_changed():
    raw = {"seed": 1, "training": {"lr": 1.0}}
    merged = apply_overrides(raw, ["seed=2", "seed=3", "control.planner.horizon_s=9.0"])
    assert merged == {
        "seed": 3,
        "training": {"lr": 1.0},
        "control": {"planner": {"horizon_s": 9.0}},
    }
    assert raw == {"seed": 1, "training": {"lr": 1.0}}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("training.lrr=1", "override training.lrr: key 'training.lrr': expected no such key"),
        ("training.lr=abc", "override training.lr: key 'training.lr': expected float, found str"),
        (
            "training.lr=-1.0",
            "override training.lr: key 'training.lr': expected float > 0.0, found float -1.0",
        ),
        ("deployment.kind=colo", "override deployment.kind: key 'deployment.kind': expected one"),
        ("seed.x=1", "override seed.x: key 'seed': expected a table, found int 1"),
        ("seed", "override seed: expected key.path=value"),
        ("=3", "expected key.path=value"),
        (
            "control.planner={horizon_s = 1.0, nope = 2}",
            "override control.planner: key 'control.planner.nope': expected no such key",
        ),
    ],
)
def test_a_bad_override_names_itself_not_the_file(override, message):
    with pytest.raises(ConfigError) as err:
        decode_toml(FILE, JobConfig, "f.toml", [override])
    assert message in str(err.value)
    assert "f.toml" not in str(err.value)


def test_an_error_the_file_makes_still_names_the_file(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[cluster]\ndevices = 'four'\n")
    with pytest.raises(ConfigError, match=f"^{path}: key 'cluster.devices'"):
        load_toml(path, JobConfig, ["training.lr=2e-4"])
    # an override of the bad key fixes it
    assert load_toml(path, JobConfig, ["cluster.devices=5"]).cluster.devices == 5


def test_to_toml_reads_back_equal_with_its_header_as_comments():
    job = decode_toml(
        FILE,
        JobConfig,
        overrides=["training.adam_betas=[0.8, 0.9]", "control.planner.policy=rule_based"],
    )
    text = to_toml(job, header="first line\nsecond line")
    assert text.startswith("# first line\n# second line\n")
    assert decode_toml(text, JobConfig) == job
    assert decode_toml(to_toml(JobConfig()), JobConfig) == JobConfig()


def test_to_toml_leaves_out_a_none_it_cannot_write():
    text = to_toml(TrainingSettings(dual_clip=None))
    assert "dual_clip" not in text and "lr = 0.0001" in text
