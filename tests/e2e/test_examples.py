"""`pivot run` on the rollout-function examples as a user runs them, with fewer steps and
prompts: examples/tool_use (a multi-turn rollout calling a calculator, its results masked
out of the loss) and examples/openai_agent (the same loop against the `openai` client through
the gateway). Their policy is made by the example's own maker, with a short SFT (the full
one is the example's README's); that they learn is shown in the README, not asserted here."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PIVOT = [sys.executable, "-m", "pivot.cli.main"]
PROMPTS, SAMPLES = 8, 4
SFT_STEPS = 30  # enough for the policy to call the tool in some rollouts


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("examples") / "examples"
    for name in ("tool_use", "openai_agent"):
        shutil.copytree(EXAMPLES / name, root / name)
    out = subprocess.run(
        [
            sys.executable,
            str(root / "tool_use" / "make_model.py"),
            "--max-steps",
            str(SFT_STEPS),
            "--first-check",
            str(SFT_STEPS + 1),  # no check: SFT_STEPS steps
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return root


def _run(config: Path, steps: int) -> tuple[list[dict], list[dict]]:
    run_dir = config.parent / f"run-{steps}"
    out = subprocess.run(
        [
            *PIVOT,
            "run",
            str(config),
            "--run-dir",
            str(run_dir),
            f"steps={steps}",
            f"rollout.prompts_per_step={PROMPTS}",
            "log.samples=true",
            # one inference device and one trainer rank: fewer processes to start
            "cluster.devices=2",
            "cluster.trainer_devices=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    reports = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return reports, rows


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _turns(row: dict, codec) -> list[tuple[int, str]]:
    """The response as runs of (loss mask, text)."""
    runs: list[tuple[int, list[int]]] = []
    mask = row["loss_mask"] or [1] * len(row["response_ids"])
    for m, token in zip(mask, row["response_ids"], strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return [(m, codec.decode(ids)) for m, ids in runs]


@pytest.fixture(scope="module")
def tool_use(examples):
    return _run(examples / "tool_use" / "config.toml", steps=2)


def test_tool_use_trains_on_its_turns_with_the_tools_results_masked(examples, tool_use):
    from pivot.engines.tokenizer import TextCodec
    from pivot.rewards import RewardInput

    reports, rows = tool_use
    codec = TextCodec.from_dir(examples / "models" / "tool-policy")
    tool = _module(examples / "tool_use" / "rollout.py")
    reward = _module(examples / "tool_use" / "reward.py")
    assert [r["step"] for r in reports] == [0, 1]
    assert len(rows) == 2 * PROMPTS * SAMPLES
    for report in reports:
        assert report["train"]["sequences"] == PROMPTS * SAMPLES  # every rollout trained
        assert report["scores"]["reward_failures"] == 0
        # the trainer left exactly the tool's tokens out of the loss
        masks = [r["loss_mask"] or [] for r in rows if r["step"] == report["step"]]
        assert report["train"]["masked_tokens"] == sum(m.count(0) for m in masks)
    called = 0
    for row in rows:
        turns = _turns(row, codec)
        assert row["response"] == "".join(text for _, text in turns)
        calls = [text for m, text in turns if m == 0]
        # every masked run is the calculator's answer to the call the policy just closed
        for i, (m, text) in enumerate(turns):
            if m == 0:
                before = "".join(t for _, t in turns[:i])
                assert before.endswith(tool.CLOSE) and text == tool.calculator(before[:-1])
        assert row["metrics"]["tool_calls"] == len(calls)
        called += bool(calls)
        sample = RewardInput(
            prompt=row["prompt"],
            response=row["response"],
            response_ids=row["response_ids"],
            reference=row["reference"],
        )
        assert row["score"] == reward.score(sample)["score"]
    assert called, "no rollout called the tool"


def test_the_openai_agent_makes_the_same_trajectories_through_the_gateway(examples, tool_use):
    """Same seeds, same policy at step 0: the agent's text-only loop through the gateway gives
    the token-level rollout's trajectories, masks included (but where the policy wrote eos
    inside a call: the agent cannot tell that from the call's stop)."""
    _, expected = tool_use
    tool = _module(examples / "tool_use" / "rollout.py")
    reports, rows = _run(examples / "openai_agent" / "config.toml", steps=1)
    assert reports[0]["train"]["sequences"] == PROMPTS * SAMPLES
    by_id = {r["seq_id"]: r for r in expected if r["step"] == 0}
    assert sorted(by_id) == sorted(r["seq_id"] for r in rows)
    compared = 0
    for row in rows:
        want = by_id[row["seq_id"]]
        if tool.open_call(want["response"]):
            continue
        compared += 1
        assert (row["response_ids"], row["loss_mask"]) == (want["response_ids"], want["loss_mask"])
        assert row["score"] == want["score"] and row["metrics"] == want["metrics"]
    assert compared >= len(rows) // 2
