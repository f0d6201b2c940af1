"""The operator's verbs on a real short job (the tiny config, small batches): while it runs
`pivot ps` lists it with its step k/N, and a watcher attached from another process gets the
snapshot and the live event batches; `pivot stop` stops it after the step it is in, with a
checkpoint, and the job exits 0 with state ``stopped``; `pivot logs --actor driver` prints
readable lines of that actor only; events.jsonl holds its steps, device maps and phases.
A job whose process is gone without saying so reads as ``dead``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from pivot.actors.assembly import MONITOR
from pivot.actors.messages import EventBatch, EventSnapshot, QueryEvents
from pivot.actors.vocabulary import EVENTS_TOPIC
from pivot.cli.jobfile import JOB_FILE, JobFile, job_state, read_job
from pivot.cli.jobs import Attached
from pivot.cli.main import main
from pivot.events import DeviceMap, EventRecord, JobPhase, RoleRate, StepDone

PIVOT = [sys.executable, "-m", "pivot.cli.main"]
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"
STEPS = 500  # many more than it runs (a step of this size takes ~0.2 s): the stop lands mid-run
SMALL = (
    f"steps={STEPS}",
    "cluster.devices=3",  # the fewest processes of a pivot deployment: the quickest start
    "cluster.trainer_devices=1",
    "rollout.prompts_per_step=2",
    "rollout.samples_per_prompt=2",
    "rollout.max_new_tokens=8",
    "reward.kind=exact",  # the checker scores: every step trains, so each can checkpoint
    "log.tensorboard=false",
)


async def _watch(run_dir: Path) -> tuple[EventSnapshot, list]:
    async with Attached(run_dir, name="watcher") as job:
        live = job.actor.subscribe(EVENTS_TOPIC, publishers=MONITOR)
        snapshot = await job.actor.request(
            MONITOR, QueryEvents(), expect=EventSnapshot, timeout=30.0
        )
        # the monitor's 0.5 s batches, until one carries a role's rate (or 30 s)
        batches: list = []
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline and not any(
            isinstance(r, RoleRate) for b in batches for r in getattr(b, "events", ())
        ):
            await asyncio.sleep(0.1)
            batches += [pub.message for pub in live.drain()]
        return snapshot, batches


def test_ps_stop_and_logs_on_a_running_job(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ps looks under runs/ here; stop takes a name under it

    def pivot(*args: str) -> subprocess.CompletedProcess:
        """The verb in this process (a short one needs no interpreter of its own)."""
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, out, err)

    run_dir = tmp_path / "runs" / "job"
    out = (tmp_path / "out.txt").open("w")
    job = subprocess.Popen(
        [*PIVOT, "run", str(CONFIG), *SMALL, "--run-dir", str(run_dir)],
        cwd=tmp_path,
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while (read_job(run_dir) or {}).get("step", 0) < 1:
            assert job.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "no step done"
            time.sleep(0.2)
        ps = pivot("ps")
        assert ps.returncode == 0, ps.stderr
        header, *rows = ps.stdout.splitlines()
        assert header.split() == ["RUN", "PID", "STEP", "DEPLOYMENT", "STATE", "STARTED"]
        (row,) = rows
        fields = row.split()
        assert fields[:2] == ["runs/job", str(job.pid)]
        assert re.fullmatch(rf"\d+/{STEPS}", fields[2]) and int(fields[2].split("/")[0]) >= 1
        assert fields[3:5] == ["pivot", "running"]

        # a watcher from another process: the snapshot, then the live batches
        snapshot, batches = asyncio.run(_watch(run_dir))
        state = {type(r): r for r in snapshot.state}
        assert state[JobPhase].phase == "running" and set(state[DeviceMap].roles) == {0, 1, 2}
        assert any(isinstance(r, StepDone) for r in snapshot.history)
        assert batches and all(isinstance(b, EventBatch) for b in batches)
        assert any(isinstance(r, RoleRate) for b in batches for r in b.events)

        stop = pivot("stop", "job")
        assert stop.returncode == 0, stop.stderr
        said = re.search(r"stopping after step (\d+); checkpoint (\S+)", stop.stdout)
        assert said, stop.stdout
        step, checkpoint = int(said[1]), Path(said[2])
        assert stop.stdout.rstrip().endswith("stopped")
        assert job.wait(timeout=60) == 0, (tmp_path / "out.txt").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGKILL)
            job.wait()
        out.close()
    assert job_state(read_job(run_dir)) == "stopped"
    reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == list(range(step + 1)) and step + 1 < STEPS
    assert reports[-1]["checkpoint"] == str(checkpoint)
    assert json.loads((checkpoint / "state.json").read_text())["next_step"] == step + 1

    assert pivot("ps").stdout.splitlines()[1:] == []  # only running ones
    every = pivot("ps", "--all").stdout.splitlines()[1:]
    assert [line.split()[4] for line in every] == ["stopped"]

    logs = pivot("logs", str(run_dir), "--actor", "driver")
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    # time, level, actor, event: only the driver's, none a raw JSON line
    assert lines and all(re.match(r"\d\d:\d\d:\d\d\.\d{3} \w+ +driver ", ln) for ln in lines)
    assert any("stopped as asked" in ln and f"step={step}" in ln for ln in lines)

    decode = msgspec.json.Decoder(EventRecord).decode
    events = [decode(line) for line in (run_dir / "events.jsonl").read_bytes().splitlines()]
    assert [e.step for e in events if isinstance(e, StepDone)] == list(range(step + 1))
    devices = [e for e in events if isinstance(e, DeviceMap)]
    assert devices and set(devices[0].roles) == {0, 1, 2}
    phases = [e.phase for e in events if isinstance(e, JobPhase)]
    assert phases[0] == "starting" and "running" in phases and phases[-1] == "stopped"


def test_a_job_whose_process_is_gone_reads_dead(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    job = JobFile(tmp_path, state="running")
    job.update(pid=gone.pid, owner=f"{gone.pid}")
    assert (tmp_path / JOB_FILE).is_file()
    assert job_state(read_job(tmp_path)) == "dead"
    job.update(pid=os.getpid(), owner=JobFile(tmp_path).info["owner"])
    assert job_state(read_job(tmp_path)) == "running"
