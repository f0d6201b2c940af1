"""Agents serving with the SGLang backend (on the test kit's fake SGLang) as a real job drives
them: default (threaded) stepping on wall time, the engine's steps in a worker thread while
Assign, Abort and weight loads arrive on the actor's loop. Sequences complete with the output
they have alone, a sequence moved between replicas mid-output continues exactly, and a
weight load mid-sequence splits its version chunks where it happened."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pivot.actors import fake_sglang
from pivot.actors.agent import RoleAgent
from pivot.actors.messages import Ack, Completed, Completion, SubmitSequences, Work
from pivot.actors.scheduler import Scheduler
from pivot.actors.sglang_engine import SGLangEngine
from pivot.actors.shift_messages import MigrateSequences, SequenceMigration
from pivot.actors.vocabulary import rl_messages
from pivot.bus import Actor, Bus, LocalTransport, handles, run_real
from pivot.cluster import Role
from pivot.engines.protocol import SamplingParams
from pivot.engines.stepping import generate
from pivot.planning.cost import CostModel
from pivot.planning.routing import RouterSettings, make_router

TOKENS = 160  # at 2 ms a token: time for a move or a load to land mid-output


class Sink(Actor):
    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.completions: dict[int, Completion] = {}

    @handles
    def completed(self, msg: Completed) -> Ack:
        self.completions.update((c.seq_id, c) for c in msg.completions)
        return Ack(count=len(msg.completions))


def _engine(version: int = 0) -> SGLangEngine:
    # iteration_s: requests take a while, so moves and loads land mid-output
    fake = fake_sglang.api(iteration_s=0.002)
    return SGLangEngine.launch("fake/tiny", api=fake, weights_version=version, wait_s=5.0)


def _sampling(seq_id: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=TOKENS, seed=100 + seq_id, ignore_eos=True)


def _work(seq_id: int, policy_version: int = 0) -> Work:
    return Work(
        seq_id=seq_id,
        prompt_ids=[3, 4, 5 + seq_id],
        sampling=_sampling(seq_id),
        policy_version=policy_version,
    )


def _alone(seq_id: int) -> list[int]:
    (out,) = generate(_engine(), [[3, 4, 5 + seq_id]], _sampling(seq_id))  # type: ignore[arg-type]
    return list(out.token_ids)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.001)


async def _start(clock):  # noqa: ANN001, ANN202
    bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
    router = make_router(
        RouterSettings(policy="lowest_itl", max_concurrent_per_replica=8),
        CostModel(a=1e-7, b=1e-3, c=5e-5, d=5e-4),
    )
    sink = Sink("sink", bus)
    scheduler = Scheduler("sched", bus, role=Role.ROLLOUT, router=router, downstream="sink")
    client = Actor("client", bus)
    for actor in (sink, scheduler, client):
        await actor.start()
    return bus, sink, scheduler, client


def test_a_sequence_moved_between_sglang_replicas_continues_exactly():
    async def main(clock):  # noqa: ANN001, ANN202
        bus, sink, scheduler, client = await _start(clock)
        first, second = _engine(), _engine()
        a = RoleAgent("a", bus, engine=first, role="rollout", scheduler="sched")
        await a.start()
        await client.request("sched", SubmitSequences(sequences=[_work(0), _work(1)]))
        await _until(lambda: first.stats().generated_tokens >= 8)
        b = RoleAgent("b", bus, engine=second, role="rollout", scheduler="sched")
        await b.start()
        moved = await client.request(
            "sched", MigrateSequences(migrations=[SequenceMigration(0, "a", "b")]), expect=Ack
        )
        await _until(lambda: len(sink.completions) == 2)
        continued = second.stats().generated_tokens
        for actor in (b, a, client, scheduler, sink):
            await actor.stop()
        return moved.count, sink.completions, continued

    moved, done, continued = run_real(main)
    assert moved == 1 and done[0].replica == "b" and done[1].replica == "a"
    for seq_id in (0, 1):
        assert done[seq_id].token_ids == _alone(seq_id)
    assert 0 < continued < TOKENS  # the second replica generated only what was missing


def test_a_weight_load_mid_sequence_splits_its_version_chunks():
    async def main(clock):  # noqa: ANN001, ANN202
        bus, sink, scheduler, client = await _start(clock)
        engine = _engine()
        agent = RoleAgent(
            "a",
            bus,
            engine=engine,
            role="rollout",
            scheduler="sched",
            weights={"rollout": lambda model, least: ({"w": [1.0]}, max(1, least))},
        )
        await agent.start()
        await client.request("sched", SubmitSequences(sequences=[_work(0)]))
        await _until(lambda: engine.stats().generated_tokens >= 6)
        await client.request("sched", SubmitSequences(sequences=[_work(1, policy_version=1)]))
        await _until(lambda: len(sink.completions) == 2)
        calls = list(engine._tm.calls)
        for actor in (agent, client, scheduler, sink):
            await actor.stop()
        return sink.completions, calls

    done, calls = run_real(main)
    first, later = done[0].chunks
    assert (first.version, later.version) == (0, 1) and first.tokens + later.tokens == TOKENS
    assert 6 <= first.tokens < TOKENS
    assert [c.version for c in done[1].chunks] == [1]
    assert calls[0] == "pause:retract" and "update_weights_from_tensor" in calls


def test_agents_sharing_one_gpu_launch_sglang_on_it_with_their_share_of_its_memory(
    monkeypatch, tmp_path
):
    # pivot run's path: the job's layout -> each agent process's kwargs -> its engines
    from pivot.actors import sglang_engine
    from pivot.actors.agent import engines_for
    from pivot.actors.assembly import AgentStart, agent_name, trainer_names
    from pivot.actors.processes import ProcessBackend
    from pivot.assets import ASSETS
    from pivot.bus import Directory
    from pivot.config import decode_toml
    from pivot.job import JobConfig
    from pivot.training import TrainingSettings

    toml = '[cluster]\naccelerator = "cuda"\ngpus = [0, 0, 0, 0]\n[model]\nengine = "sglang"\n'
    job = decode_toml(toml, JobConfig, "j.toml").validate("j.toml")
    deployment = job.plan()
    backend = ProcessBackend(
        Directory.ipc(tmp_path, trainer_names("trainer", 1)),
        checkpoints={Role.ROLLOUT: ASSETS / "tiny-policy", Role.REWARD: ASSETS / "tiny-genrm"},
        store="",
        router=lambda role: None,
        max_running=8,
        threads=1,
        seed=0,
        training=TrainingSettings(),
        engine="sglang",
        layout=job.layout(),
        rendezvous_dir=tmp_path,
    )
    monkeypatch.setattr(sglang_engine, "real_api", lambda: fake_sglang.api(vocab_size=512))
    launched = {}
    for device in deployment.agent_devices:
        kw = backend.agent(
            AgentStart(
                name=agent_name(device),
                device=device,
                role=Role.FREE,
                replica=None,
                devices=(),
                scheduler=None,
                engine_roles=deployment.engine_roles(device),
            )
        ).kwargs
        wanted = ("engine", "device", "gpu", "mem_fraction", "accelerator", "max_running", "seed")
        engines, _ = engines_for(
            kw["checkpoints"], {}, reader_name="a", **{k: kw[k] for k in wanted}
        )
        for role, engine in engines.items():
            args = engine._engine.server_args
            launched[device, role] = (args["base_gpu_id"], args["mem_fraction_static"])
            engine.close()
    # 4 agents x (rollout, GenRM) on GPU 0 split 0.8 of it, less the trainer rank's 0.3
    assert launched == {(d, r): (0, 0.0625) for d in range(4) for r in ("rollout", "reward")}
    [(_, rank)] = backend.trainer("trainer", deployment, None)  # NCCL: one rank on GPU 0
    assert (rank.kwargs["world_size"], rank.kwargs["gpu"]) == (1, 0)
