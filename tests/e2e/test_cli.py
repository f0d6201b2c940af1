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


def test_a_model_folder_pivot_cannot_serve_is_named_before_any_child_starts(tmp_path):
    import json
    import shutil

    from tokenizers import Tokenizer, models

    from pivot.assets import ASSETS

    unknown = tmp_path / "unknown"
    shutil.copytree(ASSETS / "tiny-policy", unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    bpe = tmp_path / "bpe"
    shutil.copytree(ASSETS / "tiny-policy", bpe)
    Tokenizer(models.BPE()).save(str(bpe / "tokenizer.json"))  # no pivot special tokens
    unweighted = tmp_path / "unweighted"
    shutil.copytree(ASSETS / "tiny-policy", unweighted)
    (unweighted / "model.safetensors").unlink()
    cases = [
        (
            unknown,
            f"{unknown / 'config.json'}: key 'model_type': expected one of",
            "found 'no-such-model'",
        ),
        (bpe, f"{bpe / 'tokenizer.json'}: expected pivot's character tokenizer", "<pad>"),
        (unweighted, f"{unweighted}: expected model.safetensors", "found neither"),
    ]
    for folder, where, what in cases:
        job = tmp_path / f"{folder.name}.toml"
        job.write_text(f"[model]\npolicy = '{folder}'\n")
        run_dir = tmp_path / f"run-{folder.name}"
        out = _pivot("run", str(job), "--run-dir", str(run_dir))
        assert out.returncode == 2, out.stderr
        [line] = out.stderr.splitlines()
        assert where in line and what in line, line
        assert not run_dir.exists()  # nothing started, nothing written
