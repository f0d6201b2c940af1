"""The `pivot` command as a user meets it: help, version, and bad input named. Real jobs:
test_run.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PIVOT = [sys.executable, "-m", "pivot.cli.main"]


def _pivot(
    *args: str, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run([*PIVOT, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


def test_help_and_version():
    out = _pivot("--help")
    assert out.returncode == 0
    for command in ("run", "bench", "version"):
        assert command in out.stdout
    out = _pivot("version")
    assert out.returncode == 0 and out.stdout.startswith("pivot ")


def test_bad_flag_and_bad_config_are_named(tmp_path):
    out = _pivot("run", "--no-such-flag")
    assert out.returncode == 2 and "--no-such-flag" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = 3\n[cluster]\ndevices = 'four'\n")
    out = _pivot("run", str(bad))
    assert out.returncode == 2
    assert f"{bad}: key 'cluster.devices': expected int, found str 'four'" in out.stderr
    missing_model = tmp_path / "m.toml"
    missing_model.write_text("[model]\npolicy = 'no-such-model'\n")
    out = _pivot("run", str(missing_model))
    assert out.returncode == 2 and "model.policy" in out.stderr and "no-such-model" in out.stderr
