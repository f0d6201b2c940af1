"""pivot as a library on a real job: ``pivot.Run`` from this process with a rollout function
object and steps by hand, and ``pivot.attach`` reaching it over its ipc bus like another
process would (its own bus, the run folder's address)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pivot
from pivot.bus import run_real
from pivot.config import ConfigError

CONFIG = """
seed = 3
steps = 3
[cluster]
devices = 3
trainer_devices = 1
[deployment]
kind = "disaggregated"
[rollout]
prompts_per_step = 4
samples_per_prompt = 2
max_new_tokens = 8
[reward]
kind = "exact"
[log]
tensorboard = false
"""

calls: list[pivot.Task] = []


async def two_turns(ctx: pivot.RolloutContext, task: pivot.Task) -> pivot.Trajectory:
    """A user's rollout: answer, append a masked "environment" token, answer again; its own
    reward (the second answer's length)."""
    calls.append(task)
    trajectory = pivot.Trajectory.of(await ctx.generate(task.prompt_ids, max_new_tokens=4))
    trajectory.add_tokens(ctx.tokenizer.encode("=", bos=False))
    second = await ctx.generate(trajectory.token_ids, max_new_tokens=3)
    trajectory.add_generation(second)
    trajectory.reward = len(second.token_ids) / 3
    return trajectory


def test_a_run_in_this_process_steps_by_hand_and_an_attached_client_generates_and_submits(
    tmp_path: Path,
):
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"

    async def main():
        async with pivot.Run(
            config, rollout=two_turns, run_dir=run_dir, steps_by_hand=True
        ) as run:
            first = await run.step()
            assert (run_dir / "job.json").is_file()
            async with pivot.attach(run_dir) as job:
                prompt = calls[0].prompt_ids
                g = await job.generate(prompt, max_new_tokens=5, seed=11)
                again = await job.generate(prompt, max_new_tokens=5, seed=11)
                assert g.token_ids == again.token_ids and len(g.token_ids) <= 5
                # sampled by the policy step 0 trained
                assert [c.version for c in g.chunks] == [1]
                assert sum(c.tokens for c in g.chunks) == len(g.token_ids)
                group = [
                    pivot.Trajectory.of(g, reward=1.0),
                    pivot.Trajectory.of(await job.generate(prompt, seed=12), reward=0.0),
                ]
                assert await job.submit([group]) == 2
            second = await run.step()
            later = await run.generate(prompt, max_new_tokens=5, seed=11)
            assert [c.version for c in later.chunks] == [2]
            return first, second, run.reports

    first, second, reports = run_real(main())
    assert [r.step for r in reports] == [0, 1]  # the third step was never allowed
    assert first.samples == 8 and first.submitted == 0
    assert second.samples == 10 and second.submitted == 2
    assert first.train is not None and second.train is not None
    # the environment token is masked out of the loss: one per trajectory of the rollouts
    assert first.train["masked_tokens"] == 8
    assert second.train["masked_tokens"] == 8
    state = json.loads((run_dir / "job.json").read_text())["state"]
    assert state == "stopped"
    assert len(calls) == 16


def test_a_bad_config_raises_before_anything_starts(tmp_path: Path):
    config = tmp_path / "job.toml"
    config.write_text(CONFIG.replace("devices = 3", "devices = 1"))

    async def main():
        async with pivot.Run(config, run_dir=tmp_path / "run"):
            pass

    try:
        asyncio.run(main())
    except ConfigError as exc:
        assert "cluster.trainer_devices" in str(exc)
    else:
        raise AssertionError("a config with no shared device started")
    assert not (tmp_path / "run").exists()
