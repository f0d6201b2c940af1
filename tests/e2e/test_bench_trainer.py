"""`pivot bench trainer`: one short real run of a one-rank DeepSpeed group through the bench
(the command runs in this process; the rank is a child process), its JSON line alone on
stdout."""

from __future__ import annotations

import json

from pivot.assets import ASSETS
from pivot.cli.main import main


def test_bench_trainer_prints_one_json_line_per_world_size(capsys):
    argv = ["bench", "trainer", "--json", "--checkpoint", str(ASSETS / "tiny-policy")]
    assert main([*argv, "--world-sizes", "1", "--steps", "1"]) == 0
    out = capsys.readouterr()
    [line] = out.out.splitlines()
    result = json.loads(line)
    assert (result["world_size"], result["sequences"]) == (1, 64)
    for key in ("train_step_ms", "train_request_ms", "gps_write_ms", "offload_ms", "reload_ms"):
        assert result[key] > 0, key
    assert result["train_request_ms"] >= result["train_step_ms"]
