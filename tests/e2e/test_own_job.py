"""`pivot run` on a user's own job, as the examples set it up: models the user made (a
Llama-shaped policy and a Qwen3-shaped GenRM, each with its own byte-level BPE tokenizer and
chat template), a JSONL data set with text and chat prompts, a Python reward function, a
jinja2 GenRM template and verdict parser. The examples are copied and run as written, with
fewer steps."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pivot.bus.codec import SECRET_FILE_ENV

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PIVOT = [sys.executable, "-m", "pivot.cli.main"]


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    """The examples folder, with the models its script makes (as a user runs it)."""
    root = tmp_path_factory.mktemp("examples") / "examples"
    shutil.copytree(EXAMPLES, root, ignore=shutil.ignore_patterns("models"))
    out = subprocess.run(
        [sys.executable, str(root / "make_models.py"), "--out", str(root / "models")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return root


def _run(
    examples: Path, config: str, name: str, env: dict | None = None, **changes: str
) -> tuple[Path, list[dict], list[dict]]:
    text = (examples / config).read_text()
    for old, new in changes.items():
        assert old in text
        text = text.replace(old, new)
    job = examples / f"short-{name}.toml"  # beside the example: its paths are relative to it
    job.write_text(text)
    run_dir = examples / f"run-{name}"
    out = subprocess.run(
        [*PIVOT, "run", str(job), "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return run_dir, reports, rows


def _user_module(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_users_policy_data_and_reward_function(examples):
    from pivot.engines.tokenizer import TextCodec
    from pivot.rewards import RewardInput

    # with the job's shared secret set, every frame of the job is signed (parent and children):
    # here from a secret file, which each process reads
    secret = examples / "job.secret"
    secret.write_text("a secret the user set\n")
    secret.chmod(0o600)
    _, reports, rows = _run(
        examples,
        "function.toml",
        "function",
        env={SECRET_FILE_ENV: str(secret)},
        **{"steps = 6": "steps = 3", "eval_every = 3": "eval_every = 2"},
    )
    policy = TextCodec.from_dir(examples / "models" / "policy")
    reward = _user_module(examples / "reward.py")
    data = [
        json.loads(line) for line in (examples / "data" / "train.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in reports] == [0, 1, 2]
    assert len(rows) == 3 * 8 * 4  # every sample of every step, scored once
    assert len({r["seq_id"] for r in rows}) == len(rows)
    for row in rows:
        record = data[row["index"]]
        # the prompt is the record's, encoded with the policy's own tokenizer (chat prompts
        # with its chat template); the response is the policy's text of its tokens
        assert row["prompt"] == record["prompt"] and row["reference"] == record["answer"]
        expected_ids = (
            policy.encode_chat(record["prompt"])
            if isinstance(record["prompt"], list)
            else policy.encode(record["prompt"])
        )
        assert row["prompt_ids"] == expected_ids
        assert row["response"] == policy.decode(row["response_ids"])
        # the reward is exactly the user's function on that sample
        sample = RewardInput(
            prompt=record["prompt"],
            response=row["response"],
            response_ids=row["response_ids"],
            reference=record["answer"],
            metadata={"id": record["id"], "style": record["style"]},
        )
        assert row["score"] == reward.score(sample)["score"] and row["failure"] is None
        assert row["correct"] == reward.correct(sample)
    for report in reports:
        scored = [r["score"] for r in rows if r["step"] == report["step"]]
        assert report["scores"]["reward_mean"] == pytest.approx(sum(scored) / len(scored))
        assert report["scores"]["reward_failures"] == 0
        assert report["train"]["sequences"] == len(scored)
        assert set(report["scores"]["reward_metrics"]) == {"correct", "tokens"}
    # the evaluation set ran after step 1 and after the last, with the policy trained so far
    evals = [(r["step"], r["eval"]) for r in reports if r["eval"] is not None]
    assert [(step, e["policy_version"], e["scores"]["samples"]) for step, e in evals] == [
        (1, 2, 8),
        (2, 3, 8),
    ]


def _gpt2(examples: Path) -> Path:
    """GPT-2 (no rotary attention, learned positions, fused qkv), with the example policy's
    tokenizer: a model outside pivot's families."""
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging

    from pivot.engines.checkpoint import FallbackSpec, inspect_checkpoint

    logging.disable_progress_bar()
    folder = examples / "models" / "gpt2"
    tokenizer = AutoTokenizer.from_pretrained(examples / "models" / "policy")
    torch.manual_seed(0)
    GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=512,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    ).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    assert isinstance(inspect_checkpoint(folder)[0], FallbackSpec)
    return folder


def test_a_users_genrm_judges_a_policy_outside_pivots_families(examples):
    """The GenRM example with a GPT-2 policy (one job for two things a user brings): the GenRM
    gets the template in its own tokenizer, its verdicts are the user's parser's; the policy
    is served by the transformers fallback, trained by DeepSpeed, and its new weights are read
    back through GPS every step."""
    from pivot.data import Record
    from pivot.engines.tokenizer import TextCodec
    from pivot.prompts import load_template

    _gpt2(examples)
    run_dir, reports, rows = _run(
        examples,
        "genrm.toml",
        "genrm",
        **{"steps = 4": "steps = 2", '"models/policy"': '"models/gpt2"'},
    )
    genrm = TextCodec.from_dir(examples / "models" / "genrm")
    policy = TextCodec.from_dir(examples / "models" / "gpt2")
    render = load_template(examples / "judge.j2", source="genrm.toml", key="reward.template")
    verdict = _user_module(examples / "reward.py").verdict
    data = [
        json.loads(line) for line in (examples / "data" / "train.jsonl").read_text().splitlines()
    ]
    assert [r["train"]["version"] for r in reports] == [1, 2]
    assert [r["policy_version"] for r in reports] == [0, 1]  # step 1 sampled the new weights
    assert len(rows) == 2 * 8 * 4
    for row in rows:
        record = data[row["index"]]
        as_record = Record(
            index=row["index"],
            prompt=record["prompt"],
            reference=record["answer"],
            metadata={"id": record["id"], "style": record["style"]},
        )
        assert row["response"] == policy.decode(row["response_ids"])
        messages = [
            {"role": "system", "content": "You are a strict grader."},
            {"role": "user", "content": render(as_record, row["response"])},
        ]
        # the GenRM got the template, as its chat template's user turn, in its own ids
        assert row["judge_prompt_ids"] == genrm.encode_chat(messages)
        assert row["judge_prompt_ids"] != policy.encode_chat(messages)
        # its judgment was read with its own tokenizer and scored by the user's parser; a
        # judgment without a verdict is a counted failure, not a 0
        value = verdict(row["judgment"])
        if value is None:
            assert row["failure"] == "unparseable judgment" and row["score"] is None
        else:
            assert row["score"] == value and row["failure"] is None
    for report in reports:
        failed = [r for r in rows if r["step"] == report["step"] and r["failure"] is not None]
        assert report["scores"]["reward_failures"] == len(failed)
        assert sum(report["reward_by_replica"].values()) == 8 * 4  # every response judged
        scored = [
            r["score"] for r in rows if r["step"] == report["step"] and r["score"] is not None
        ]
        if scored:
            assert report["scores"]["reward_mean"] == pytest.approx(sum(scored) / len(scored))
