"""`pivot run`'s config on the command line and in the run directory: overrides change the
job, the resolved config.toml runs the same job again from anywhere, a bad override is one
line, and a run directory holds one run. In process, stopped where the job would start."""

from __future__ import annotations

from pathlib import Path

import pytest

from pivot.bus.codec import SECRET_ENV, SECRET_FILE_ENV
from pivot.cli import run
from pivot.cli.main import main
from pivot.cli.runconfig import read_header, resolved_config
from pivot.config import load_toml
from pivot.job import JobConfig

REPO = Path(__file__).resolve().parents[2]


class Started(Exception):
    """Raised where the job's processes would start."""


@pytest.fixture
def started(monkeypatch):
    """Stops `pivot run` where its Job would be made; the JobConfig it was given."""
    jobs: list[JobConfig] = []

    class Job:
        def __init__(self, job: JobConfig, *args, **kwargs) -> None:
            jobs.append(job)
            raise Started

    monkeypatch.setattr(run, "Job", Job)
    return jobs


def _own_job(folder: Path) -> Path:
    """A job whose data and reward code are paths relative to its file."""
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text(
        "".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(8))
    )
    (folder / "reward.py").write_text("def score(sample):\n    return 1.0\n")
    config = folder / "job.toml"
    config.write_text(
        "steps = 3\n[data]\ntrain = 'data/train.jsonl'\nreference_key = 'answer'\n"
        "[rollout]\nprompts_per_step = 4\n[reward]\nkind = 'function'\nfunction = 'reward.py:score'\n"
    )
    return config


def test_overrides_change_the_run_and_its_config_toml_runs_it_again(tmp_path, monkeypatch, started):
    config = _own_job(tmp_path / "job")
    run_dir = tmp_path / "run"
    with pytest.raises(Started):
        # flags between overrides: the ones after a flag are overrides too
        main(
            [
                "run",
                str(config),
                "training.lr=2e-4",
                "--run-dir",
                str(run_dir),
                "--seed",
                "7",
                "rollout.samples_per_prompt=8",
            ]
        )
    [job] = started
    assert job.training.lr == 2e-4 and job.rollout.samples_per_prompt == 8 and job.seed == 7
    written = run_dir / "config.toml"
    header = read_header(written)
    assert header.source == str(config.resolve())
    assert header.overrides == ["training.lr=2e-4", "rollout.samples_per_prompt=8", "seed=7"]
    resolved = load_toml(written, JobConfig)
    assert resolved == resolved_config(job, config)
    assert resolved.training.lr == 2e-4 and resolved.seed == 7
    assert resolved.data.train == str(config.parent / "data" / "train.jsonl")
    assert resolved.reward.function == f"{config.parent / 'reward.py'}:score"
    assert resolved.model.policy == "tiny-policy"  # a shipped model stays a name
    # the written config is the same job, read from another folder
    monkeypatch.chdir(tmp_path)
    again, *_ = run.prepare(str(written))
    assert again == resolved
    with pytest.raises(Started):
        main(["run", str(written), "--run-dir", str(tmp_path / "again")])
    assert load_toml(tmp_path / "again" / "config.toml", JobConfig) == resolved


def test_overrides_alone_override_the_default_config(monkeypatch, tmp_path, started):
    monkeypatch.chdir(REPO)
    with pytest.raises(Started):
        main(["run", "steps=2", "--run-dir", str(tmp_path / "run")])
    assert started[0].steps == 2
    assert read_header(tmp_path / "run" / "config.toml").source == str(REPO / "configs/tiny.toml")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("training.lrr=2e-4", "override training.lrr: key 'training.lrr': expected no such key"),
        ("training.lr=fast", "override training.lr: key 'training.lr': expected float, found str"),
        ("cluster.trainer_devices=4", "override cluster.trainer_devices: key 'cluster.trainer"),
    ],
)
def test_a_bad_override_is_one_line_naming_it(tmp_path, capsys, started, override, expected):
    run_dir = tmp_path / "run"
    code = main(["run", str(REPO / "configs/tiny.toml"), override, "--run-dir", str(run_dir)])
    assert code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert expected in line, line
    assert not run_dir.exists() and not started


def test_a_bad_secret_file_is_one_line_and_starts_nothing(tmp_path, capsys, started, monkeypatch):
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    secret.chmod(0o644)
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))
    run_dir = tmp_path / "run"
    assert main(["run", str(REPO / "configs/tiny.toml"), "--run-dir", str(run_dir)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"{SECRET_FILE_ENV}={secret}" in line and "open to other users" in line
    assert not run_dir.exists() and not started


def test_a_run_directory_holding_a_run_is_refused(tmp_path, capsys, started):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"type": "step"}\n')
    code = main(["run", str(REPO / "configs/tiny.toml"), "--run-dir", str(run_dir)])
    assert code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"{run_dir}: " in line and "a run already there (metrics.jsonl)" in line
    assert "use --resume RUN_DIR to continue it, or another --run-dir" in line
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"] and not started
    # an empty directory is no run
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Started):
        main(["run", str(REPO / "configs/tiny.toml"), "--run-dir", str(empty)])
    assert (empty / "config.toml").is_file()


def test_resume_runs_the_runs_own_config_and_records_its_overrides(tmp_path, started, capsys):
    import json
    import shutil

    import msgspec

    from pivot.actors.checkpoints import CheckpointState
    from pivot.assets import ASSETS

    config = _own_job(tmp_path / "job")
    run_dir = tmp_path / "run"
    with pytest.raises(Started):
        main(["run", str(config), "--run-dir", str(run_dir), "training.lr=3e-4"])
    # what a run leaves after step 0's checkpoint (the policy folder is the shipped one)
    checkpoint = run_dir / "checkpoints" / "step-000000"
    shutil.copytree(ASSETS / "tiny-policy", checkpoint / "policy")
    state = CheckpointState(step=0, policy_version=1, next_step=1)
    (checkpoint / "state.json").write_bytes(msgspec.json.encode(state))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"type": "step", "step": s}) + "\n" for s in range(2))
    )
    # the run's own config, and its first overrides, when no config is named
    with pytest.raises(Started):
        main(["run", "--resume", str(run_dir)])
    assert started[-1].training.lr == 3e-4 and started[-1].steps == 3
    # a config named beside --resume that differs is refused, unless the key is overridden
    changed = tmp_path / "job" / "changed.toml"
    changed.write_text(config.read_text().replace("steps = 3", "steps = 5"))
    assert main(["run", str(changed), "--resume", str(run_dir)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "key 'steps'" in line and "pass steps=VALUE as an override" in line
    with pytest.raises(Started):
        main(["run", str(changed), "--resume", str(run_dir), "steps=5"])
    assert started[-1].steps == 5 and started[-1].training.lr == 3e-4
    assert read_header(run_dir / "config.toml").overrides == ["training.lr=3e-4", "steps=5"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in records if r["type"] == "step"] == [0]  # step 1 runs again
    resumes = [r for r in records if r["type"] == "resume"]
    assert [(r["cut_steps"], r["overrides"]) for r in resumes] == [([1], []), ([], ["steps=5"])]
    assert records[-1] == resumes[-1] and resumes[-1]["next_step"] == 1
    # a run dir without a complete checkpoint cannot be resumed
    shutil.rmtree(run_dir / "checkpoints")
    assert main(["run", "--resume", str(run_dir)]) == 2
    assert "expected a run with a complete checkpoint" in capsys.readouterr().err


def test_a_job_over_the_hosts_memory_is_refused_with_its_estimate(tmp_path, capsys, started):
    """The estimate is made from config.json before any weight is read: a policy whose config
    says 64 layers of hidden size 65536 (trillions of parameters) is refused in one line
    beside the tiny model's weight file, which would never be read."""
    import json
    import shutil

    from pivot.assets import ASSETS

    huge = tmp_path / "huge"
    shutil.copytree(ASSETS / "tiny-policy", huge)
    config = json.loads((huge / "config.json").read_text())
    config.update(
        hidden_size=65536,
        intermediate_size=262144,
        num_hidden_layers=64,
        num_attention_heads=512,
        num_key_value_heads=128,
        layer_types=["full_attention"] * 64,
    )
    (huge / "config.json").write_text(json.dumps(config))
    job = tmp_path / "job.toml"
    job.write_text(f"[model]\npolicy = '{huge}'\n[reward]\nkind = 'exact'\n")
    run_dir = tmp_path / "run"
    assert main(["run", str(job), "--run-dir", str(run_dir)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"{job}: expected a job that fits in the " in line, line
    assert "GiB of memory available here (MemAvailable in /proc/meminfo)" in line
    assert "found an estimated " in line and "trainer optimizer states" in line
    assert not run_dir.exists() and not started


def test_the_memory_check_compares_the_estimate_with_what_is_available(tmp_path):
    from pivot.assets import ASSETS
    from pivot.cluster import Role
    from pivot.config import ConfigError
    from pivot.engines.checkpoint import model_shape
    from pivot.memory import estimate_memory

    job = load_toml(REPO / "configs/tiny.toml", JobConfig)
    tiny = model_shape(ASSETS / "tiny-policy")
    shapes = {Role.ROLLOUT: tiny, Role.REWARD: tiny}
    needed = estimate_memory(job, shapes).total
    run.check_memory(job, shapes, "tiny.toml", available=needed)
    with pytest.raises(
        ConfigError, match=r"tiny.toml: expected a job that fits in the .*process runtimes"
    ):
        run.check_memory(job, shapes, "tiny.toml", available=needed - 1)


def test_the_summary_names_the_bus_troubles_of_every_process(tmp_path):
    from pivot.bus.statsfile import StatsRecord, write_record

    folder = tmp_path / "bus"
    folder.mkdir()
    assert run.bus_trouble_line(tmp_path) is None  # no files: nothing to say
    for process, counts in (
        ("main", {"requests_sent": 9, "request_timeouts": 2}),
        ("agent-0", {"requests_sent": 4, "lost_frames": 3, "request_timeouts": 1}),
    ):
        write_record(
            folder / f"{process}.json",
            StatsRecord(process=process, pid=1, final=True, actors={}, totals=counts),
        )
    assert run.bus_trouble_line(tmp_path) == (
        f"bus: 3 lost_frames, 3 request_timeouts (see {folder})"
    )


def test_the_sglang_engine_without_sglang_installed_is_one_line_and_starts_nothing(
    tmp_path, capsys, started, monkeypatch
):
    import sys

    monkeypatch.setitem(sys.modules, "sglang", None)  # as on a machine without the extra
    run_dir = tmp_path / "run"
    code = main(
        ["run", str(REPO / "configs/tiny.toml"), "model.engine=sglang", "--run-dir", str(run_dir)]
    )
    assert code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "override model.engine: key 'model.engine': expected 'torch', or SGLang" in line
    assert "'gpu' extra" in line and "no module named 'sglang'" in line
    assert not run_dir.exists() and not started


def test_a_cuda_config_on_a_host_without_cuda_is_one_line_and_starts_nothing(
    tmp_path, capsys, started
):
    run_dir = tmp_path / "run"
    tiny = str(REPO / "configs/tiny.toml")
    code = main(["run", tiny, "cluster.accelerator=cuda", "--run-dir", str(run_dir)])
    assert code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "override cluster.accelerator: key 'cluster.accelerator': expected a CUDA device" in line
    assert "found none: this torch is the CPU build" in line
    assert not run_dir.exists() and not started


def test_more_cuda_devices_than_the_host_has_is_one_line_and_starts_nothing(
    tmp_path, capsys, started, monkeypatch
):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a host with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run_dir = tmp_path / "run"
    tiny = str(REPO / "configs/tiny.toml")
    code = main(["run", tiny, "cluster.accelerator=cuda", "--run-dir", str(run_dir)])
    assert code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "key 'cluster.devices': expected at most the 1 CUDA devices here" in line
    assert not run_dir.exists() and not started


def test_job_devices_sharing_gpus_are_checked_against_the_host_before_anything_starts(
    tmp_path, capsys, started, monkeypatch
):
    import torch

    run_dir = tmp_path / "run"
    tiny = str(REPO / "configs/tiny.toml")
    shared = ["run", tiny, "cluster.accelerator=cuda", "--run-dir", str(run_dir)]
    assert main([*shared, "cluster.gpus=[0, 0, 0, 0]"]) == 2  # this host: the CPU build
    [line] = capsys.readouterr().err.splitlines()
    assert "found none: this torch is the CPU build" in line
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a host with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main([*shared, "cluster.gpus=[0, 0, 1, 1]"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "key 'cluster.gpus': expected GPU indices below the 1 CUDA devices here" in line
    assert "found GPU 1 in [0, 0, 1, 1]" in line
    assert not run_dir.exists() and not started
