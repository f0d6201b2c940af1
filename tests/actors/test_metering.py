"""A real job's time account: a real agent (threaded stepping, pivot's torch engine on the
shipped tiny policy, the real clock) meters its engine steps, publishes them as
``EngineSegments``, and a Monitor's ``DeviceMeter`` turns them, with a trainer's span, into
the same account a simulation gets; and ``SegmentLog``'s joining rules on their own."""

from __future__ import annotations

import asyncio
import time

import pytest

from pivot.account import account
from pivot.actors.agent import RoleAgent
from pivot.actors.messages import Ack, Assign, Finished, RegisterReplica, Work
from pivot.actors.metering import DeviceMeter, SegmentLog
from pivot.actors.monitor import Monitor
from pivot.actors.trainer_messages import TrainerState
from pivot.actors.vocabulary import rl_messages
from pivot.assets import ASSETS
from pivot.bus import Actor, Bus, LocalTransport, handles, run_real
from pivot.cluster import Role
from pivot.deployment import DeploymentKind, Split, plan_deployment
from pivot.engines.protocol import SamplingParams
from pivot.planning.cost import CostModel

MAX_RUNNING = 8
PRIOR = CostModel(a=2e-7, b=1e-3, c=5e-5, d=5e-4)


class Reports(Actor):
    """The agent's scheduler, reduced to taking its registration and completions."""

    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.finished: set[int] = set()

    @handles
    def register(self, msg: RegisterReplica) -> Ack:
        return Ack(count=1)

    @handles
    def finished_(self, msg: Finished) -> Ack:
        self.finished.update(c.seq_id for c in msg.completions)
        return Ack(count=len(msg.completions))


def test_a_real_agents_segments_make_an_account_of_devices_x_window():
    from pivot.engines.torch_engine import TorchEngine

    # device 0 serves rollout, device 1 is the trainer's
    deployment = plan_deployment(
        Split(kind=DeploymentKind.DISAGGREGATED, gpus=2, rollout=1, training=1),
        {Role.ROLLOUT: 1, Role.REWARD: 1},
        devices_per_host=2,
        judged=False,
    )
    engine = TorchEngine.from_pretrained(
        ASSETS / "tiny-policy", max_running=MAX_RUNNING, threads=1, clock=time.perf_counter
    )
    # four fresh sequences of different lengths (the batch shrinks as they finish) and two
    # migrated ones that re-prefill the output they bring
    works = [
        Work(
            seq_id=i,
            prompt_ids=[1, 40 + i, 50, 60],
            sampling=SamplingParams(max_new_tokens=8 + 6 * i, temperature=0.0, ignore_eos=True),
            generated_ids=[70, 71, 72] if i >= 4 else [],
            generated_logprobs=[-1.0, -1.0, -1.0] if i >= 4 else [],
        )
        for i in range(6)
    ]

    async def main(clock):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        reports = Reports("sched", bus)
        meter = DeviceMeter(deployment)
        monitor = Monitor(
            "monitor", bus, agents=["agent-0"], schedulers={}, interval=0.02, meter=meter
        )
        agent = RoleAgent(
            "agent-0",
            bus,
            engine=engine,
            role="rollout",
            scheduler="sched",
            replica="rollout@0",
            device=0,
            devices=[0],
        )
        client = Actor("client", bus)
        for actor in (reports, monitor, agent, client):
            await actor.start()
        await asyncio.sleep(0.05)  # the Monitor's subscription is up
        start = clock.now()
        await client.request("agent-0", Assign(sequences=works))
        while len(reports.finished) < len(works):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # an idle tail, after the idle agent's last batch
        end = clock.now()
        for actor in (agent, monitor, client, reports):
            await actor.stop()
        meter.on_trainer_state(
            TrainerState(name="trainer", state="idle", version=1, span=(start, start + 0.02))
        )
        return meter, start, end

    meter, start, end = run_real(main)
    window = end - start
    thresholds = meter.measured_thresholds({"rollout": PRIOR}, MAX_RUNNING)
    result = account(meter.ledger, (start, end), 2, thresholds=thresholds)
    s = result.seconds
    assert sum(s.values()) == pytest.approx(2 * window, rel=1e-9)
    assert meter.lost_batches == 0
    # the engine's steps, joined: fewer segments than steps, none overlapping another
    segments, times, _ = meter.ledger.segments({})
    assert 2 <= len(segments) < engine.stats().steps
    assert (times[1:, 0] >= times[:-1, 3] - 1e-9).all()
    engine_s = s["busy"] + s["under_filled"] + s["re_prefilling"]
    assert s["re_prefilling"] > 0 and s["busy"] > 0
    assert engine_s == pytest.approx(times[-1, 3] - times[0, 0], rel=1e-6)
    # before the Assign and after the last finish no engine ran: device 0 waited on the
    # trainer side (the whole job's inference was done)
    assert s["stalled_on_trainer"] >= 0.1 and s["idle"] == pytest.approx(0.0, abs=1e-9)
    assert s["training"] == pytest.approx(0.02)
    assert s["trainer_waiting"] == pytest.approx(window - 0.02)
    # decode-only steps gave the refit its samples, at batches the engine ran (6 sequences at
    # most), and the rollout's threshold comes from them
    samples = meter.decode_samples["rollout"]
    assert samples and all(1 <= b <= len(works) and t > 0 and itl > 0 for b, t, itl in samples)
    assert set(thresholds) == {"rollout"}


def test_a_segment_log_joins_a_steady_decode_and_keeps_the_open_segment():
    log = SegmentLog()
    log.step(0.0, 1.0, 4, 0.5, 0.25, more=True)  # prefill of 4, 1 of them re-prefilled
    log.step(1.1, 1.5, 4, 0.0, 0.0, more=True)  # decodes the same 4: joined, gap included
    log.step(1.6, 2.0, 3, 0.0, 0.0, more=True)  # one finished: a new segment from 1.6
    assert log.take() == {  # the open one stays for the next step to extend
        "start": [0.0],
        "end": [1.6],
        "running": [4],
        "prefill_s": [0.5],
        "reprefill_s": [0.25],
    }
    log.idle(2.5)  # an abort took the rest at 2.5
    log.step(9.0, 9.5, 2, 0.1, 0.0, more=False)  # later work: no gap bridged
    assert log.take() == {
        "start": [1.6, 9.0],
        "end": [2.5, 9.5],
        "running": [3, 2],
        "prefill_s": [0.0, 0.1],
        "reprefill_s": [0.0, 0.0],
    }
    assert log.take() is None and log.batches == 2
