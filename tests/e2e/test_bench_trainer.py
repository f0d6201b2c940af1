"""`pivot bench trainer`: short real runs of a one-rank DeepSpeed group through the bench
(the command runs in this process; the rank and the helper's agent are child processes), one
JSON line per run alone on stdout, and nothing on stderr (the ranks' logs go to the run's
log)."""

from __future__ import annotations

import json

from pivot.assets import ASSETS
from pivot.cli.main import main


def test_bench_trainer_prints_one_json_line_per_world_size_and_helper_count(capfd):
    argv = ["bench", "trainer", "--json", "--checkpoint", str(ASSETS / "tiny-policy")]
    argv += ["--world-sizes", "1", "--helpers", "0", "1", "--micro-batch-size", "8"]
    assert main([*argv, "--steps", "2"]) == 0
    out = capfd.readouterr()
    assert out.err == ""
    alone, helped = (json.loads(line) for line in out.out.splitlines())
    for result, helpers in ((alone, 0), (helped, 1)):
        assert (result["world_size"], result["helpers"], result["sequences"]) == (1, helpers, 64)
        for key in ("train_step_ms", "train_request_ms", "gps_write_ms", "offload_ms", "reload_ms"):
            assert result[key] > 0, key
        assert result["train_request_ms"] >= result["train_step_ms"]
    # eight rounds of 8 sequences: the helper, offered as each step starts, takes some
    assert alone["helped_share"] == 0.0 and 0.0 < helped["helped_share"] < 1.0
