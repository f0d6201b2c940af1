"""`pivot bench trainer`: one short real run of a one-rank DeepSpeed group through the bench,
its JSON line alone on stdout."""

from __future__ import annotations

import json
import subprocess
import sys

from pivot.assets import ASSETS


def test_bench_trainer_prints_one_json_line_per_world_size():
    out = subprocess.run(
        [sys.executable, "-m", "pivot.cli.main", "bench", "trainer", "--json"]
        + ["--checkpoint", str(ASSETS / "tiny-policy"), "--world-sizes", "1", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    [line] = out.stdout.splitlines()
    result = json.loads(line)
    assert (result["world_size"], result["sequences"]) == (1, 64)
    for key in ("train_step_ms", "train_request_ms", "gps_write_ms", "offload_ms", "reload_ms"):
        assert result[key] > 0, key
    assert result["train_request_ms"] >= result["train_step_ms"]
