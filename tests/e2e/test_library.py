"""pivot as a library on a real job: ``pivot.Run`` from this process with a rollout function
object and steps by hand, and ``pivot.attach`` reaching it over its ipc bus like another
process would (its own bus, the run folder's address)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

import pivot
from pivot.bus import run_real
from pivot.bus.codec import SECRET_FILE_ENV
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
[attach]
tcp = "tcp://127.0.0.1:0"
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
    tmp_path: Path, monkeypatch
):
    secret = tmp_path / "secret"
    secret.write_text("the job's secret")
    secret.chmod(0o600)
    monkeypatch.setenv(SECRET_FILE_ENV, str(secret))  # the children sign with it too
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    run_dir = tmp_path / "run"

    async def main():
        async with pivot.Run(config, rollout=two_turns, run_dir=run_dir, steps_by_hand=True) as run:
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
            # from another host: the tcp address the job listens on besides its ipc one
            tcp = json.loads((run_dir / "job.json").read_text())["tcp"]
            async with pivot.attach(tcp) as remote:
                far = await remote.generate(prompt, max_new_tokens=5, seed=11)
                assert far.token_ids == g.token_ids
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


@pytest.mark.parametrize(
    ("change", "key"),
    [
        (("devices = 3", "devices = 1"), "cluster.trainer_devices"),
        (("", ""), "attach.tcp"),  # a tcp address without the job's secret
    ],
)
def test_a_bad_config_raises_before_anything_starts(tmp_path: Path, change, key):  # noqa: ANN001
    config = tmp_path / "job.toml"
    config.write_text(CONFIG.replace(*change))

    async def main():
        async with pivot.Run(config, run_dir=tmp_path / "run"):
            pass

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        asyncio.run(main())
    assert not (tmp_path / "run").exists()


def test_a_job_that_fails_before_its_actors_start_leaves_no_process_or_socket_behind(
    tmp_path: Path, monkeypatch
):
    """An embedding program goes on after the failure: the fork server the job began (it
    imports the children's libraries from the start) and the job's sockets go with it."""
    import pivot.cli.run as run_module

    begun = []
    real_launcher, real_sockets = run_module.job_launcher, run_module.make_socket_dir
    monkeypatch.setattr(
        run_module, "job_launcher", lambda *a: begun.append(real_launcher(*a)) or begun[-1]
    )
    folders: list[Path] = []
    monkeypatch.setattr(
        run_module, "make_socket_dir", lambda: folders.append(real_sockets()) or folders[-1]
    )

    def cannot_assemble(*args, **kwargs):  # noqa: ANN002, ANN003
        raise RuntimeError("an actor that cannot be built")

    monkeypatch.setattr(run_module, "assemble", cannot_assemble)
    config = tmp_path / "job.toml"
    config.write_text(CONFIG.replace('tcp = "tcp://127.0.0.1:0"', ""))

    async def main():
        async with pivot.Run(config, run_dir=tmp_path / "run"):
            pass

    with pytest.raises(RuntimeError, match="cannot be built"):
        run_real(main())
    [launcher] = begun
    assert launcher.pid is not None  # a fork server was begun, and is gone (reaped)
    assert not Path(f"/proc/{launcher.pid}").exists()
    [folder] = folders
    assert not folder.exists()
