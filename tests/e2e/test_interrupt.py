"""`kill` (SIGTERM) on `pivot run` stops it as Ctrl-C does: every child process (role agents,
trainer ranks) stops, the run directory keeps the steps done, the socket folder goes, and the
exit code is 143. Ctrl-C itself (130) is tests/e2e/test_run.py's resume test. A closed
terminal's SIGHUP takes the same handlers (``pivot.cli.interrupts.RAISED``, the supervisor's
``STOP_SIGNALS``): its exit code and message are tests/unit/test_interrupts.py's, the
supervisor taking it over tests/actors/test_bus_supervisor.py's, so no second job runs here
for it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pivot.bus.testing import process_alive


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


def _socket_folders(pid: int) -> list[Path]:
    return [
        folder
        for folder in Path(tempfile.gettempdir()).glob("pivot-*")
        if (folder / "owner").is_file() and (folder / "owner").read_text().split()[:1] == [str(pid)]
    ]


def test_kill_mid_run_stops_every_child_and_keeps_the_steps_done(tmp_path):
    sig, code = signal.SIGTERM, 143
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
        assert len(_socket_folders(process.pid)) == 1
        process.send_signal(sig)
        rest, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(os.getpgid(process.pid), signal.SIGKILL)
    assert process.returncode == code, rest[-3000:]
    assert f"interrupted by {sig.name} after" in rest
    assert rest.rstrip().endswith(f"pivot: interrupted by {sig.name}")
    deadline = time.monotonic() + 0.5  # the slack the fixed wait gave, polled
    while any(process_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in children if process_alive(pid)] == []
    steps = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(steps) >= 2
    # the plot and the report of what ran, as a finished run leaves
    assert (run_dir / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    report = (run_dir / "report.html").read_text()
    assert report.count('src="data:image/png;base64,') == 2
    assert "<tr><td>1</td><td>v1</td>" in report  # step 1, reported before the signal
    assert _socket_folders(process.pid) == []
