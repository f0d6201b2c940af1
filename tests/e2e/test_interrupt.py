"""Ctrl-C on `pivot run`: every child process (role agents, trainer ranks) stops, the run
directory keeps the steps done, and the exit code says interrupted (130)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _descendants(pid: int) -> set[int]:
    found: set[int] = set()
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = (task / "children").read_text().split()
            except OSError:
                continue
            for child in map(int, children):
                if child not in found:
                    found.add(child)
                    todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_ctrl_c_mid_run_stops_every_child_and_keeps_the_steps_done(tmp_path):
    config = tmp_path / "long.toml"
    config.write_text(
        "steps = 100\n[cluster]\ndevices = 3\ntrainer_devices = 1\n"
        "[rollout]\nprompts_per_step = 4\nsamples_per_prompt = 2\n"
    )
    run_dir = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "pivot.cli.main", "run", str(config), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 240
        for line in process.stdout:
            lines.append(line)
            if line.startswith("step   1 ") or time.monotonic() > deadline:
                break
        assert any(line.startswith("step   1 ") for line in lines), "".join(lines)[-3000:]
        children = _descendants(process.pid)
        assert len(children) >= 4  # three role agents and a trainer rank at least
        process.send_signal(signal.SIGINT)
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(os.getpgid(process.pid), signal.SIGKILL)
    assert process.returncode == 130, rest[-3000:]
    assert "interrupted after" in rest
    time.sleep(0.5)
    assert [pid for pid in children if _alive(pid)] == []
    steps = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(steps) >= 2
