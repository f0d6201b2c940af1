"""The `pivot` command as a user runs it: real processes, nng ipc://, a tiny checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def random_checkpoint(tmp_path_factory) -> Path:
    """A randomly initialised Qwen2 checkpoint with our tokenizer, saved like any HF model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pivot.tokenizer import TextCodec, build_tokenizer, save_pretrained

    path = tmp_path_factory.mktemp("ckpt")
    save_pretrained(build_tokenizer(), path)
    codec = TextCodec.from_dir(path)
    config = Qwen2Config(
        vocab_size=codec.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=96,
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
        pad_token_id=codec.pad_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _children_of(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
    return found


def test_run_trains_shifts_and_leaves_no_processes(tmp_path, random_checkpoint):
    """The whole pipeline on a random tiny checkpoint: rollout, GenRM judging, DeepSpeed
    steps, the Controller lending and reclaiming the trainer pool, then a clean exit."""
    config = tmp_path / "job.toml"
    config.write_text(
        f"steps = 3\n[cluster]\ndevices = 3\ntrainer_devices = 1\n"
        f"[model]\npolicy = '{random_checkpoint}'\ngenrm = '{random_checkpoint}'\n"
        "[rollout]\nprompts_per_step = 4\nsamples_per_prompt = 3\nmax_new_tokens = 12\n"
        "[reward]\nmax_new_tokens = 8\n"
    )
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [*PIVOT, "run", str(config), "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr + stdout
    assert "deployment pivot" in stdout and "done: 3 steps" in stdout
    reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in reports] == [0, 1, 2]
    # every sample answered and judged exactly once, on whichever replica held it
    assert all(r["samples"] == 12 for r in reports)
    assert all(sum(r["rollout_by_replica"].values()) == 12 for r in reports)
    assert all(sum(r["reward_by_replica"].values()) == 12 for r in reports)
    # each step trained and the next step's sequences carried the new policy version
    assert [r["policy_version"] for r in reports] == [0, 1, 2]
    assert [r["train"]["version"] for r in reports] == [1, 2, 3]
    # the trainer pool was lent to inference and reclaimed (the last reclaim may land after
    # the monitor stopped)
    marks = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    kinds = [m["kind"] for m in marks if "kind" in m]
    assert kinds.count("reclaim_trainer") >= 2 and "lend_trainer" in kinds
    assert (run_dir / "shift.journal").stat().st_size > 0
    assert (run_dir / "throughput.png").read_bytes()[:4] == b"\x89PNG"
    assert _children_of(proc.pid) == []
    assert not any(p for p in _children_of(os.getpid()) if p != proc.pid and _is_agent(p))


def test_run_disaggregated_keeps_its_pools(tmp_path, random_checkpoint):
    config = tmp_path / "job.toml"
    config.write_text(
        f"steps = 2\n[cluster]\ndevices = 3\ntrainer_devices = 1\n"
        f"[model]\npolicy = '{random_checkpoint}'\ngenrm = '{random_checkpoint}'\n"
        "[rollout]\nprompts_per_step = 2\nsamples_per_prompt = 2\nmax_new_tokens = 6\n"
        "[reward]\nmax_new_tokens = 6\n"
    )
    run_dir = tmp_path / "run"
    out = _pivot(
        "run",
        str(config),
        "--run-dir",
        str(run_dir),
        "--deployment",
        "disaggregated",
        timeout=300,
    )
    assert out.returncode == 0, out.stderr + out.stdout
    reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [set(r["rollout_by_replica"]) for r in reports] == [{"agent-0"}] * 2
    assert [set(r["reward_by_replica"]) for r in reports] == [{"agent-1"}] * 2
    assert "    shift (" not in out.stdout and "shifts 0 {}" in out.stdout


def _is_agent(pid: int) -> bool:
    try:
        return b"pivot.bus.child" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
