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

    from pivot.assets import ASSETS

    gpt2 = tmp_path / "gpt2"
    shutil.copytree(ASSETS / "tiny-policy", gpt2)
    config = json.loads((gpt2 / "config.json").read_text())
    (gpt2 / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    garbled = tmp_path / "garbled"
    shutil.copytree(ASSETS / "tiny-policy", garbled)
    (garbled / "tokenizer.json").write_text("{not json")
    endless = tmp_path / "endless"  # a tokenizer without an eos token: generation never stops
    shutil.copytree(ASSETS / "tiny-policy", endless)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        specials = json.loads((endless / name).read_text())
        del specials["eos_token"]
        (endless / name).write_text(json.dumps(specials))
    untokenized = tmp_path / "untokenized"
    shutil.copytree(ASSETS / "tiny-policy", untokenized)
    (untokenized / "tokenizer.json").unlink()
    unweighted = tmp_path / "unweighted"
    shutil.copytree(ASSETS / "tiny-policy", unweighted)
    (unweighted / "model.safetensors").unlink()
    cases = [
        (gpt2, f"{gpt2 / 'config.json'}: key 'model_type': expected one of", "found 'gpt2'"),
        (
            garbled,
            f"{garbled / 'tokenizer.json'}: expected a tokenizer AutoTokenizer loads",
            "found JSONDecodeError",
        ),
        (
            endless,
            f"{endless / 'tokenizer_config.json'}: key 'eos_token': expected an eos token",
            "found none",
        ),
        (untokenized, f"{untokenized / 'tokenizer.json'}: expected a tokenizer", "found none"),
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
