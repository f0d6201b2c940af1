"""The Trainer's state machine over the simulated backend on the virtual clock (local bus,
deterministic), then the DeepSpeed backend for real: two ranks (ZeRO-2 and ZeRO-3, gloo)
started by the bus Supervisor as child processes, driven over nng ipc:// like the driver and
the controller drive it, on a tiny random Qwen2 checkpoint. One launch per ZeRO stage
(DeepSpeed's imports and the rendezvous cost seconds); those tests run in order on the same
trainer group.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
import torch

from pivot.actors.agent import RoleAgent
from pivot.actors.assembly import agent_name, trainer_names
from pivot.actors.gradient_help import GradientWorker
from pivot.actors.messages import Ack
from pivot.actors.param_store import ParameterReader, ParameterStore, remove_store
from pivot.actors.shift_messages import TrainerPhaseChanged
from pivot.actors.tensor_wire import batch_to_wire, tensors_from_wire
from pivot.actors.trainer import Trainer, TrainResult, restart_text
from pivot.actors.trainer_deepspeed import (
    RankCommand,
    add_trainer_group,
    decode_command,
    encode_command,
    fingerprint,
)
from pivot.actors.trainer_messages import (
    ComputeGradients,
    GradientHelper,
    HelpEnded,
    HelperGradients,
    Helping,
    HelpTrainer,
    OffloadTrainer,
    QueryTrainer,
    ReloadTrainer,
    SimTrainBatch,
    TrainBatch,
    Trained,
    TrainerRestart,
    TrainerState,
    TrainerStatus,
)
from pivot.actors.trainer_sim import SimTrainingBackend
from pivot.actors.vocabulary import rl_messages
from pivot.bus import (
    Actor,
    Bus,
    BusError,
    Directory,
    LocalTransport,
    RemoteError,
    Supervisor,
    VirtualClock,
    handles,
    run_virtual,
)
from pivot.engines.sim_engine import SimTrainer
from pivot.engines.tokenizer import TextCodec, build_tokenizer, save_pretrained
from pivot.engines.torch_engine import TorchEngine
from pivot.grpo import (
    GRPOBatch,
    LossSums,
    RolloutSample,
    TrainingSettings,
    build_batch,
    micro_batch_loss,
    policy_loss,
    token_logprobs,
)
from pivot.trajectory import NO_VERSION

# adam_eps well above float noise in small gradients: Adam's first step is ~lr * sign(g)
# where |g| >> eps, which would hide a wrong gradient scale and amplify summation-order noise
# where |g| ~ eps; with eps near typical |g| the update follows g itself
SETTINGS = TrainingSettings(lr=5e-3, adam_eps=1e-3, micro_batch_size=3, zero_stage=2)
WORLD = 2
TIMEOUT = 120.0


# ---- what rank 0 broadcasts: msgpack bytes, never a pickle ---------------------------------------


def test_a_rank_command_travels_as_bytes_and_comes_back_equal() -> None:
    batch = GRPOBatch(
        input_ids=torch.tensor([[5, 6, 7, 0], [5, 8, 9, 2]]),
        response_mask=torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 1.0]]),
        old_logprobs=torch.tensor([[0.0, -0.5, 0.0], [0.0, -1.25, -0.75]]),
        advantages=torch.tensor([0.5, -0.5]),
        rewards=torch.tensor([1.0, 0.0]),
        groups=torch.tensor([3, 3]),
        masked=torch.tensor([0, 1]),
        stale=torch.tensor([1, 0]),
        pad_id=2,
    ).rows([1])  # a view: not contiguous in the batch it came from
    command = RankCommand("train", batch, publish=True, checkpoint="/runs/x/step-3")
    back = decode_command(encode_command(command))
    assert (back.kind, back.publish, back.checkpoint) == ("train", True, "/runs/x/step-3")
    assert back.batch is not None and back.batch.pad_id == 2
    for name in (
        "input_ids",
        "response_mask",
        "old_logprobs",
        "advantages",
        "rewards",
        "groups",
        "masked",
        "stale",
    ):
        sent, got = getattr(batch, name), getattr(back.batch, name)
        assert got.dtype == sent.dtype and torch.equal(got, sent), name
    assert decode_command(encode_command(RankCommand("quit"))) == RankCommand("quit")
    with pytest.raises(TypeError, match="float64"):
        encode_command(
            RankCommand(
                "train",
                GRPOBatch(**{**vars(batch), "rewards": torch.zeros(1, dtype=torch.float64)}),
            )
        )


# ---- the state machine, over the simulated backend on the virtual clock ------------------------

BATCH = SimTrainBatch(step=3, sequences=8, tokens=1000)


class FakeController(Actor):
    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.told = asyncio.Event()
        self.helpers_back: list[tuple[list[str], float]] = []  # HelpEnded: replicas, when

    @handles
    def phase(self, msg: TrainerPhaseChanged) -> Ack:
        assert msg.phase == "ready"
        self.told.set()
        return Ack()

    @handles
    def help_ended(self, msg: HelpEnded) -> Ack:
        self.helpers_back.append((msg.replicas, self.clock.now()))
        return Ack()


class BrokenBackend(SimTrainingBackend):
    async def train(self, batch: SimTrainBatch) -> TrainResult:
        raise RuntimeError("rank 1 is gone")


class Rig:
    """A trainer over a 1B-parameter policy on two simulated devices, a controller that
    records being asked for the pool, and a client."""

    def __init__(
        self,
        clock: VirtualClock,
        *,
        controller: str | None,
        backend=SimTrainingBackend,  # noqa: ANN001
        restarted: TrainerRestart | None = None,
    ):
        bus = Bus.local(rl_messages(), transport=LocalTransport(), clock=clock)
        self.clock = clock
        self.sim = SimTrainer(params_b=1.0, devices=2)
        self.trainer = Trainer(
            "trainer",
            bus,
            backend=backend(self.sim, clock=clock),
            controller=controller,
            restarted=restarted,
        )
        self.boss = FakeController("controller", bus)
        self.client = Actor("client", bus)
        self.down_s = self.sim.shift.trainer_down(1.0, 2).total_s
        self.up_s = self.sim.shift.trainer_up(1.0, 2).total_s
        self.step_s = self.sim.step_time_s(BATCH.tokens) + self.sim.write_s()

    async def __aenter__(self) -> Rig:
        for actor in (self.trainer, self.boss, self.client):
            await actor.start()
        self.states = self.client.subscribe("trainer")
        await self.states.wait_live("trainer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        for actor in (self.client, self.boss, self.trainer):
            await actor.stop()

    async def ask(self, message, expect=None):  # noqa: ANN001, ANN201
        # virtual seconds: a modelled reload alone takes longer than the default timeout
        return await self.client.request("trainer", message, expect=expect, timeout=600.0)

    def published(self) -> list[str]:
        return [p.message.state for p in self.states.drain() if isinstance(p.message, TrainerState)]


def test_offload_and_reload_are_idempotent_and_cost_the_modelled_time() -> None:
    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller="controller") as rig:
            started = clock.now()
            lent = await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            assert (lent.state, lent.holds_pool, lent.seconds) == ("offloaded", False, rig.down_s)
            assert clock.now() - started == pytest.approx(rig.down_s)
            again = await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            assert (again.state, again.seconds) == ("offloaded", 0.0)

            back = await rig.ask(ReloadTrainer(), expect=TrainerStatus)
            assert (back.state, back.holds_pool, back.seconds) == ("idle", True, rig.up_s)
            again = await rig.ask(ReloadTrainer(), expect=TrainerStatus)
            assert (again.state, again.seconds) == ("idle", 0.0)
            assert clock.now() - started == pytest.approx(rig.down_s + rig.up_s)

            trainer = rig.trainer
            assert (trainer.offloads, trainer.reloads) == (1, 1)
            assert trainer.shift_s == rig.down_s + rig.up_s
            assert rig.published() == ["offloaded", "idle"]
            assert rig.sim.steps == 0 and not rig.boss.told.is_set()

    run_virtual(main)


def test_a_batch_that_finds_the_pool_lent_asks_the_controller_and_waits() -> None:
    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller="controller") as rig:
            await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            step = asyncio.ensure_future(rig.ask(BATCH, expect=Trained))
            await asyncio.wait_for(rig.boss.told.wait(), 5)
            status = await rig.ask(QueryTrainer(), expect=TrainerStatus)
            # "training" without its pool: the Controller reads it as "reclaim the pool"
            assert (status.state, status.holds_pool, status.version) == ("training", False, 0)
            still = await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            assert (still.state, still.seconds) == ("training", 0.0)  # lent already
            with pytest.raises(RemoteError, match="while another step is in flight"):
                await rig.ask(msgspec.structs.replace(BATCH, step=4))
            await clock.sleep(100.0)
            assert rig.sim.steps == 0 and not step.done()  # never on devices inference holds

            reloaded = clock.now()
            back = await rig.ask(ReloadTrainer(), expect=TrainerStatus)
            assert (back.state, back.holds_pool) == ("training", True)  # the batch trains now
            trained = await step
            assert (trained.step, trained.stats.version, trained.gps_version) == (3, 1, 1)
            assert trained.gps_write_s == rig.sim.write_s()
            assert (trained.stats.sequences, trained.stats.tokens) == (8, 1000)
            [span] = rig.trainer.spans
            assert span.version == 1
            assert span.start == pytest.approx(reloaded + rig.up_s)
            assert span.end - span.start == pytest.approx(rig.step_s)
            assert trained.stats.seconds == pytest.approx(rig.step_s)
            status = await rig.ask(QueryTrainer(), expect=TrainerStatus)
            assert (status.state, status.version, status.steps) == ("idle", 1, 1)
            assert rig.published() == ["offloaded", "training", "idle"]

    run_virtual(main)


def test_the_trainer_measures_how_its_reloaded_pool_and_its_batch_missed_each_other() -> None:
    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller="controller") as rig:
            # held all along: no reclaim to measure
            await rig.ask(BATCH, expect=Trained)
            held = await rig.ask(QueryTrainer(), expect=TrainerStatus)
            assert (held.pool_slacks, held.pool_slack_s) == (0, 0.0)

            # back early: the pool idles 7 s before the batch
            await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            await rig.ask(ReloadTrainer(), expect=TrainerStatus)
            await clock.sleep(7.0)
            batch = msgspec.structs.replace(BATCH, step=4)
            await rig.ask(batch, expect=Trained)
            early = await rig.ask(QueryTrainer(), expect=TrainerStatus)
            assert early.pool_slacks == 1
            assert early.pool_slack_s == pytest.approx(7.0)

            # lent again before a batch came, then back late: the batch waits 30 s and the
            # reload for the pool
            await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            await rig.ask(ReloadTrainer(), expect=TrainerStatus)
            await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            batch = msgspec.structs.replace(BATCH, step=5)
            step = asyncio.ensure_future(rig.ask(batch, expect=Trained))
            await asyncio.wait_for(rig.boss.told.wait(), 5)
            await clock.sleep(30.0)
            await rig.ask(ReloadTrainer(), expect=TrainerStatus)
            await step
            late = await rig.ask(QueryTrainer(), expect=TrainerStatus)
            assert late.pool_slacks == 2
            assert late.pool_slack_s == pytest.approx(-(30.0 + rig.up_s))

    run_virtual(main)


def test_without_a_controller_a_batch_reloads_by_itself() -> None:
    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller=None) as rig:
            await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            arrived = clock.now()
            trained = await rig.ask(BATCH, expect=Trained)
            assert trained.stats.version == 1
            [span] = rig.trainer.spans
            assert span.start == pytest.approx(arrived + rig.up_s)
            trainer = rig.trainer
            assert (trainer.reloads, trainer.state, trainer.holds_pool) == (1, "idle", True)
            assert rig.published() == ["offloaded", "training", "idle"]
            assert not rig.boss.told.is_set()

    run_virtual(main)


def test_an_offload_is_refused_while_a_batch_waits_for_the_pool() -> None:
    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller="controller") as rig:
            await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            step = asyncio.ensure_future(rig.ask(BATCH, expect=Trained))
            await asyncio.wait_for(rig.boss.told.wait(), 5)
            # the offload queues behind the reload; by its turn the batch wants the pool
            reload = asyncio.ensure_future(rig.ask(ReloadTrainer(), expect=TrainerStatus))
            offload = asyncio.ensure_future(rig.ask(OffloadTrainer()))
            assert (await reload).state == "training"
            with pytest.raises(RemoteError, match="cannot be lent now"):
                await offload
            assert (await step).stats.version == 1
            assert (rig.trainer.offloads, rig.trainer.state) == (1, "idle")

    run_virtual(main)


def test_status_is_answered_mid_step_and_an_offload_waits_for_the_step() -> None:
    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller="controller") as rig:
            step = asyncio.ensure_future(rig.ask(BATCH, expect=Trained))
            await clock.sleep(rig.step_s / 2)
            status = await rig.ask(QueryTrainer(), expect=TrainerStatus)
            assert (status.state, status.holds_pool) == ("training", True)
            lent = await rig.ask(OffloadTrainer(), expect=TrainerStatus)
            [span] = rig.trainer.spans
            assert lent.state == "offloaded" and clock.now() >= span.end
            assert (await step).stats.version == 1
            assert rig.published() == ["training", "idle", "offloaded"]

    run_virtual(main)


def test_a_helper_that_joins_mid_step_shortens_it_by_hand_and_is_handed_back_first() -> None:
    big = SimTrainBatch(step=3, sequences=8, tokens=1_000_000)  # ~77 s of token work

    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller="controller") as rig:
            sim, shift = rig.sim, rig.sim.shift
            offer = HelpTrainer(helpers=[GradientHelper("ro0", "rollout", [4, 5])])
            idle = await rig.ask(offer, expect=Helping)
            assert idle.replicas == []  # no step runs: nothing to help
            started = clock.now()
            step = asyncio.ensure_future(rig.ask(big, expect=Trained))
            await clock.sleep(10.0)
            assert (await rig.ask(offer, expect=Helping)).replicas == ["ro0"]
            reply = await step
            # 2 pool devices alone until the helper is ready, then 4
            ready = 10.0 + shift.shift.engine_release_s + shift.weight_read_s(1.0, 2)
            left = sim.token_work_s(big.tokens) - 2 * ready
            reduce = 2.0 * 1e9 / (shift.shift.gps_write_gb_per_s * 1e9)
            tail = sim.costs.fixed_step_s + sim.write_s()  # the helper's 1.5 s wake hides in it
            expected = ready + left / 4 + reduce + tail
            assert clock.now() - started == pytest.approx(expected)
            assert expected < sim.step_time_s(big.tokens) + sim.write_s() - 20
            [span] = rig.trainer.spans
            [helper] = span.helpers
            assert (helper.replica, helper.devices) == ("ro0", (4, 5))
            assert helper.ready_at == pytest.approx(started + ready)
            # the controller hears of it before the step's reply
            assert rig.boss.helpers_back == [(["ro0"], pytest.approx(clock.now()))]
            assert reply.stats.version == 1

    run_virtual(main)


def test_a_bad_batch_is_an_error_reply_before_anything_runs() -> None:
    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller="controller") as rig:
            with pytest.raises(RemoteError, match="takes SimTrainBatch, not TrainBatch"):
                await rig.ask(TrainBatch(samples=[]))
            assert rig.published() == [] and clock.now() == 0.0
            trained = await rig.ask(BATCH, expect=Trained)  # nothing is left pending
            assert trained.stats.version == 1

    run_virtual(main)


def test_a_failed_step_crashes_the_trainer_and_leaves_its_request_unanswered() -> None:
    """No error reply: a transport that resends an unanswered request (nng's req socket, when
    the trainer's process is gone) hands the batch to the trainer started next."""

    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller="controller", backend=BrokenBackend) as rig:
            step = asyncio.ensure_future(rig.ask(BATCH))
            with pytest.raises(RuntimeError, match="training backend command failed"):
                await asyncio.wait_for(rig.trainer.wait(), 5)
            with pytest.raises(BusError) as failed:
                await step
            assert not isinstance(failed.value, RemoteError), failed.value

    run_virtual(main)


def test_a_batch_for_another_version_is_refused_before_anything_runs() -> None:
    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller=None) as rig:
            with pytest.raises(
                RemoteError, match="trains from policy version 3, the trainer holds version 0"
            ):
                await rig.ask(TrainBatch(samples=[], step=2, version=3))
            assert rig.published() == [] and clock.now() == 0.0

    run_virtual(main)


def test_a_restarted_trainer_says_how_it_came_back_in_its_next_reply() -> None:
    restart = TrainerRestart(source="gps", version=0, checkpoint=None, exact=False)

    async def main(clock: VirtualClock) -> None:
        async with Rig(clock, controller=None, restarted=restart) as rig:
            first = await rig.ask(BATCH, expect=Trained)
            second = await rig.ask(BATCH, expect=Trained)
            assert (first.restart, second.restart) == (restart, None)
        assert "optimizer moments reset" in restart_text(restart)

    run_virtual(main)


# ---- DeepSpeed, two ranks -----------------------------------------------------------------------

# every test of a ZeRO stage on the one group the module-scoped fixture started
ON_GROUP = pytest.mark.asyncio(loop_scope="module")


def make_checkpoint(folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    codec = TextCodec.char()
    config = Qwen2Config(
        vocab_size=codec.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=codec.bos_id,
        eos_token_id=codec.eos_id,
        pad_token_id=codec.pad_id,
    )
    torch.manual_seed(1234)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    save_pretrained(tok, folder)
    return folder


def load_model(checkpoint: Path, weights: dict[str, torch.Tensor] | None = None):
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    if weights is not None:
        model.load_state_dict(weights, strict=True)
    return model.eval()


def response_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = token_logprobs(model(input_ids=ids).logits, ids)[0]
    return logp[len(prompt) - 1 :].tolist()


def make_samples(checkpoint: Path) -> list[RolloutSample]:
    """Group 0: one prompt, four responses, only the first rewarded (advantages +1.5,
    -0.5 x3). Group 1: three responses rewarded 1, 0, 1. Seven rows: the two ranks hold 4
    and 3 (+1 empty), in micro-batches of 3. Behaviour logprobs are the checkpoint's own."""
    codec = TextCodec.char()
    model = load_model(checkpoint)
    rows = [
        (0, "12+34=", "2+4+0=6 1+3+0=4 >46", 1.0),
        # penalised responses share no character with the rewarded one
        (0, "12+34=", "abc", 0.0),
        (0, "12+34=", "xyz w", 0.0),
        (0, "12+34=", "hello", 0.0),
        (1, "5+5=", "5+5+0=10 >10", 1.0),
        (1, "5+5=", ">11", 0.0),
        (1, "5+5=", "5+5+0=10 >10", 1.0),
    ]
    samples = []
    for group, prompt_text, response_text, reward in rows:
        prompt = codec.encode(prompt_text)
        response = codec.encode(response_text, bos=False) + [codec.eos_id]
        samples.append(
            RolloutSample(
                prompt_ids=prompt,
                response_ids=response,
                logprobs=response_logprobs(model, prompt, response),
                reward=reward,
                group=group,
            )
        )
    return samples


class Group:
    """The running trainer group as the tests see it."""

    def __init__(self, supervisor, probe, store, checkpoint, samples, first, initial, after_first):
        self.supervisor: Supervisor = supervisor
        self.probe: Actor = probe
        self.store: str = store
        self.checkpoint: Path = checkpoint
        self.samples: list[RolloutSample] = samples
        self.first: Trained = first  # the reply to the first TrainBatch
        self.initial: dict[str, torch.Tensor] = initial  # GPS version 0
        self.after_first: dict[str, torch.Tensor] = after_first  # GPS version 1

    async def ask(self, message, expect=None):
        return await self.probe.request("trainer", message, timeout=TIMEOUT, expect=expect)

    def read_gps(self) -> tuple[int, dict[str, torch.Tensor]]:
        names = load_model(self.checkpoint).state_dict()
        into = {name: torch.empty_like(t) for name, t in names.items()}
        with ParameterReader(self.store) as reader:
            version = reader.read(into)
        return version, into


def test_a_rank_imports_deepspeed_without_compiling_its_muon_optimizer() -> None:
    """DeepSpeed decorates its Muon optimizer's functions with torch.compile as it imports them
    (``deepspeed.initialize`` does): about 1.7 s of CPU per rank at every group start for an
    optimizer the trainer never builds. A rank's import leaves them eager. (In a process of its
    own: another test's DeepSpeed may have imported Muon here already.)"""
    import subprocess
    import sys

    code = (
        "from pivot.actors.trainer_deepspeed import import_deepspeed\n"
        "import_deepspeed()\n"
        "import deepspeed.runtime.zero.muon.original_muon as muon\n"
        "fns = ('zeropower_via_newtonschulz5', 'zeropower_via_gram_newtonschulz', 'muon_update')\n"
        "print([n for n in fns if hasattr(getattr(muon, n), '_torchdynamo_orig_callable')])\n"
        "print(muon.muon_update.__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    compiled, name = done.stdout.splitlines()[-2:]
    assert (compiled, name) == ("[]", "muon_update"), done.stdout


@pytest_asyncio.fixture(
    scope="module",
    loop_scope="module",
    params=[2, pytest.param(3, marks=pytest.mark.fused_adam)],
    ids=["zero2", "zero3"],
)
async def group(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """The group at ZeRO-2 and at ZeRO-3 (parameters partitioned: no persistence threshold;
    DeepSpeed's FusedAdam, JIT-built on first use)."""
    settings = msgspec.structs.replace(SETTINGS, zero_stage=request.param)
    folder = tmp_path_factory.mktemp("trainer")
    checkpoint = make_checkpoint(folder / "tiny")
    names = trainer_names("trainer", WORLD)
    directory = Directory.ipc(folder, [*names, "probe", HELPER, FAILING_HELPER])
    store = f"pivot-test-trainer-{uuid.uuid4().hex[:8]}"
    supervisor = Supervisor()
    add_trainer_group(
        supervisor,
        "trainer",
        directory=directory,
        checkpoint=checkpoint,
        world_size=WORLD,
        run_dir=folder,
        store_name=store,
        settings=settings,
    )
    samples = make_samples(checkpoint)  # while nothing else runs: the ranks start next
    await supervisor.start()
    bus = Bus.nng(directory, rl_messages())
    probe = Actor("probe", bus)
    # a gradient helper's agent (free: the helper's role does not matter to the trainer),
    # and one that cannot compute gradients
    helpers = [RoleAgent(HELPER, bus), Actor(FAILING_HELPER, bus)]
    await probe.start()
    for actor in helpers:
        await actor.start()
    try:
        g = Group(supervisor, probe, store, checkpoint, samples, None, {}, {})
        version, g.initial = g.read_gps()
        assert version == 0
        g.first = await g.ask(TrainBatch(samples=samples, step=0), expect=Trained)
        version, g.after_first = g.read_gps()
        assert version == 1
        yield g
    finally:
        for actor in helpers:
            await actor.stop()
        await probe.stop()
        await bus.close()
        await supervisor.stop()
        remove_store(store)  # the job's: it outlives the ranks


@ON_GROUP
async def test_version_zero_in_gps_is_the_checkpoint(group: Group) -> None:
    checkpoint = load_model(group.checkpoint).state_dict()
    assert set(group.initial) == set(checkpoint)  # lm_head.weight included (tied)
    for name, tensor in checkpoint.items():
        assert torch.equal(group.initial[name], tensor), name


@ON_GROUP
async def test_first_step_equals_a_single_process_adamw_step(group: Group) -> None:
    """Two ranks, each on its share in micro-batches, must make the update one process makes
    on the whole batch: token-mean loss, gradient clipped to 1.0, AdamW."""
    s = SETTINGS
    model = load_model(group.checkpoint).train()
    batch = build_batch(group.samples, pad_id=TextCodec.char().padding_id)
    logp = token_logprobs(model(input_ids=batch.input_ids).logits, batch.input_ids)
    loss, _ = policy_loss(
        logp, batch.old_logprobs, batch.advantages, batch.response_mask, dual_clip=s.dual_clip
    )
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=s.lr,
        betas=s.adam_betas,
        eps=s.adam_eps,
        weight_decay=s.weight_decay,
    )
    opt.step()
    stats = group.first.stats
    assert stats.version == 1 and group.first.gps_version == 1
    assert stats.tokens == batch.tokens and stats.sequences == 7
    assert stats.loss == pytest.approx(loss.item(), abs=1e-6)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)  # on-policy: behaviour = current
    assert stats.grad_norm == pytest.approx(norm.item(), rel=1e-4)
    assert norm.item() > s.grad_clip  # so the clip mattered
    for name, want in model.state_dict().items():
        got = group.after_first[name]
        assert torch.allclose(got, want, atol=1e-6), (name, (got - want).abs().max().item())
        assert not torch.equal(got, group.initial[name]), name


@ON_GROUP
async def test_repeated_steps_raise_the_rewarded_response(group: Group) -> None:
    """Steps on the same batch (behaviour logprobs fixed): the one rewarded response of
    group 0 gains probability, the penalised ones lose it, and the loss falls."""
    rewarded, penalised = group.samples[0], group.samples[1:4]

    def total(model, sample: RolloutSample) -> float:
        return sum(response_logprobs(model, sample.prompt_ids, sample.response_ids))

    before = load_model(group.checkpoint)
    losses = [group.first.stats.loss]
    for step in range(1, 6):
        reply = await group.ask(TrainBatch(samples=group.samples, step=step), expect=Trained)
        assert reply.step == step and reply.stats.version == reply.gps_version
        losses.append(reply.stats.loss)
    version, weights = group.read_gps()
    assert version == reply.stats.version
    after = load_model(group.checkpoint, weights)
    assert total(after, rewarded) > total(before, rewarded) + 0.5
    for sample in penalised:
        assert total(after, sample) < total(before, sample)
    assert losses[-1] < losses[0] - 0.05, losses
    assert reply.stats.clip_fraction > 0  # ratios moved past 1.28 / 0.8 on some tokens


@ON_GROUP
async def test_gps_holds_what_every_rank_holds(group: Group) -> None:
    status = await group.ask(QueryTrainer(fingerprints=True), expect=TrainerStatus)
    version, weights = group.read_gps()
    assert status.version == version
    assert len(status.fingerprints) == WORLD
    assert set(status.fingerprints) == {fingerprint(weights)}  # bit for bit, on every rank
    # an inference replica takes the stored policy as it is
    engine = TorchEngine.from_pretrained(group.checkpoint, max_running=2)
    engine.load_weights(weights, version=version)
    assert engine.stats().weights_version == version


@ON_GROUP
async def test_offload_and_reload_keep_the_policy_and_training_works_after(group: Group) -> None:
    states = group.probe.subscribe("trainer")
    await states.wait_live("trainer", timeout=10)
    before = await group.ask(QueryTrainer(fingerprints=True), expect=TrainerStatus)

    offloaded = await group.ask(OffloadTrainer(), expect=TrainerStatus)
    assert offloaded.state == "offloaded"
    published = await asyncio.wait_for(_next_state(states), 10)
    assert (published.state, published.version) == ("offloaded", before.version)
    with pytest.raises(RemoteError, match="reload first"):
        await group.ask(QueryTrainer(fingerprints=True))
    again = await group.ask(OffloadTrainer(), expect=TrainerStatus)  # idempotent
    assert again.state == "offloaded"

    reloaded = await group.ask(ReloadTrainer(), expect=TrainerStatus)
    assert reloaded.state == "idle"
    after = await group.ask(QueryTrainer(fingerprints=True), expect=TrainerStatus)
    assert after.fingerprints == before.fingerprints

    # a batch that arrives while offloaded reloads first
    await group.ask(OffloadTrainer(), expect=TrainerStatus)
    trained = await group.ask(TrainBatch(samples=group.samples, step=99), expect=Trained)
    assert trained.stats.version == before.version + 1
    status = await group.ask(QueryTrainer(fingerprints=True), expect=TrainerStatus)
    assert status.state == "idle" and status.version == trained.stats.version
    assert len(set(status.fingerprints)) == 1 and status.fingerprints != before.fingerprints
    states.close()


async def _next_state(states) -> TrainerState:
    while True:
        publication = await states.get()
        if isinstance(publication.message, TrainerState):
            return publication.message


@ON_GROUP
async def test_a_bad_batch_is_refused_and_the_group_keeps_serving(group: Group) -> None:
    before = await group.ask(QueryTrainer(), expect=TrainerStatus)
    bad = group.samples[0]
    bad = RolloutSample(
        prompt_ids=bad.prompt_ids,
        response_ids=bad.response_ids,
        logprobs=bad.logprobs[:-1],
        reward=bad.reward,
        group=bad.group,
    )
    with pytest.raises(RemoteError, match=r"sample 1 .*logprobs for"):
        await group.ask(TrainBatch(samples=[group.samples[1], bad]))
    after = await group.ask(QueryTrainer(fingerprints=True), expect=TrainerStatus)
    assert after.version == before.version and after.state == "idle"
    assert len(set(after.fingerprints)) == 1


HELPER, FAILING_HELPER = agent_name(7), agent_name(8)


def helper_request(group: Group, version: int, batch: GRPOBatch) -> ComputeGradients:
    return ComputeGradients(
        version=version,
        store=group.store,
        policy=str(group.checkpoint),
        batches=[batch_to_wire(m) for m in batch.micro_batches(3)],
        denominator=5.0,
        settings=SETTINGS,
    )


@ON_GROUP
async def test_a_helpers_gradient_is_autograds_on_its_micro_batches(group: Group) -> None:
    version, weights = group.read_gps()
    batch = build_batch(group.samples, pad_id=TextCodec.char().padding_id)
    reply = await group.probe.request(
        HELPER, helper_request(group, version, batch), timeout=TIMEOUT, expect=HelperGradients
    )
    model = load_model(group.checkpoint, weights).train()
    sums = LossSums()
    for micro in batch.micro_batches(3):
        loss, part = micro_batch_loss(model, micro, SETTINGS, denominator=5.0)
        loss.backward()
        sums = sums + part
    got = tensors_from_wire(reply.grads)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == set(trained)
    for name, p in trained.items():
        assert torch.allclose(got[name], p.grad, atol=1e-6), name
    assert reply.sums == pytest.approx(sums.as_tensor().tolist(), rel=1e-5)
    assert not reply.stale
    # for a step that has ended (GPS holds a newer version): nothing computed, said so
    late = await group.probe.request(
        HELPER, helper_request(group, version - 1, batch), timeout=TIMEOUT, expect=HelperGradients
    )
    assert late.stale and late.grads == {} and late.sums == []


@ON_GROUP
async def test_a_helper_asked_twice_at_once_builds_its_model_once_and_answers_both(
    group: Group,
) -> None:
    # (transformers' loading patches module globals: two models built at once on two
    # threads came out with parameters on the meta device)
    version, _ = group.read_gps()
    batch = build_batch(group.samples, pad_id=TextCodec.char().padding_id)
    request = helper_request(group, version, batch)
    worker = GradientWorker()
    first, second = await asyncio.gather(
        asyncio.to_thread(worker.compute, request), asyncio.to_thread(worker.compute, request)
    )
    assert first.sums == second.sums
    for name, grad in tensors_from_wire(first.grads).items():
        assert torch.equal(grad, tensors_from_wire(second.grads)[name]), name


#: steps a helper gets to deliver in time: one that is late (its host's cores are busy) is
#: dropped by design and its rounds go back to the ranks, so one step may count no help
HELPED_STEP_TRIES = 3


@ON_GROUP
async def test_helpers_compute_part_of_a_step_and_the_step_is_the_batchs(group: Group) -> None:
    """Two replicas offered mid-step (ZeRO-2): one computes some rounds' gradients, the
    other cannot and its rounds go back to the ranks; the step's loss and gradient norm are
    those of the whole batch at the step's weights, whether or not the helper's came in time,
    and within a few steps one does. ZeRO-3 takes no helper."""
    samples = group.samples * 30  # 210 rows: 35 rounds of 3 a rank
    batch = build_batch(samples, pad_id=TextCodec.char().padding_id)
    # the helper's agent builds the policy's model on its first request: not in the step,
    # where the ranks would give up waiting for it
    version, _ = group.read_gps()
    await group.probe.request(
        HELPER, helper_request(group, version, batch.rows(slice(0, 3))), timeout=TIMEOUT
    )
    offered = [
        GradientHelper("rollout-7", "rollout", [7]),
        GradientHelper("reward-8", "reward", [8]),
    ]
    for attempt in range(HELPED_STEP_TRIES):
        status = await group.ask(QueryTrainer(), expect=TrainerStatus)
        _, weights = group.read_gps()
        model = load_model(group.checkpoint, weights).train()
        loss, _ = micro_batch_loss(model, batch, SETTINGS, denominator=batch.tokens)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        step = TrainBatch(samples=samples, step=90 + attempt)
        train = asyncio.create_task(group.ask(step, expect=Trained))
        taken: list[str] = []
        while not train.done() and len(taken) < len(offered):
            offer = [h for h in offered if h.replica not in taken]
            taken += (await group.ask(HelpTrainer(helpers=offer), expect=Helping)).replicas
            await asyncio.sleep(0.002)
        stats = (await train).stats
        assert stats.version == status.version + 1
        assert stats.tokens == batch.tokens
        assert stats.loss == pytest.approx(loss.item(), abs=1e-5)
        assert stats.grad_norm == pytest.approx(norm.item(), rel=1e-4)
        if status.zero_stage == 3:
            assert not status.takes_helpers and taken == [] and stats.helped_tokens == 0
            return
        assert status.takes_helpers and sorted(taken) == ["reward-8", "rollout-7"]
        assert stats.helped_tokens < stats.tokens
        if stats.helped_tokens > 0:
            break
    assert 0 < stats.helped_tokens, f"no helper delivered in time in {HELPED_STEP_TRIES} steps"
    after = await group.ask(QueryTrainer(fingerprints=True), expect=TrainerStatus)
    assert len(set(after.fingerprints)) == 1  # every rank made the same update


@ON_GROUP
async def test_masked_and_stale_tokens_are_left_out_of_the_step_and_counted(group: Group) -> None:
    version = (await group.ask(QueryTrainer(), expect=TrainerStatus)).version
    first = group.samples[0]
    n = len(first.response_ids)
    # its first two tokens a tool's, the third sampled by the policy before the trainer's
    turns = msgspec.structs.replace(
        first,
        loss_mask=[0, 0] + [1] * (n - 2),
        versions=[NO_VERSION, NO_VERSION, version - 1] + [version] * (n - 3),
    )
    samples = [turns, *group.samples[1:]]
    trained = await group.ask(
        TrainBatch(samples=samples, step=8, version=version, max_staleness=0), expect=Trained
    )
    stats = trained.stats
    assert (stats.masked_tokens, stats.stale_tokens) == (2, 1)
    assert stats.tokens == sum(len(s.response_ids) for s in samples) - 3
    assert stats.version == version + 1


@ON_GROUP
async def test_a_checkpoint_is_a_policy_transformers_loads_and_the_trainer_state(
    group: Group, tmp_path: Path
) -> None:
    """After the step, the policy as a Hugging Face folder (the step's weights, which GPS
    holds too) that transformers and pivot's engine generate the same greedy tokens from,
    and DeepSpeed's state with the optimizer, for a resumed group to continue."""
    from transformers import AutoModelForCausalLM

    from pivot.engines.protocol import SamplingParams
    from pivot.engines.stepping import generate

    folder = tmp_path / "checkpoint"
    trained = await group.ask(
        TrainBatch(samples=group.samples, step=7, checkpoint=str(folder)), expect=Trained
    )
    assert trained.checkpoint_s > 0
    version, weights = group.read_gps()
    assert version == trained.stats.version
    model = AutoModelForCausalLM.from_pretrained(folder / "policy", dtype=torch.float32).eval()
    saved = model.state_dict()
    assert set(saved) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(saved[name], tensor), name
    from pivot.cli.run import check_model

    check_model(folder / "policy")  # pivot run takes it as a policy
    codec = TextCodec.from_dir(folder / "policy")  # the tokenizer travelled with it
    prompts = [codec.encode(p) for p in ("12+34=", "5+5=", "99+1=")]
    engine = TorchEngine.from_pretrained(folder / "policy", max_running=4)
    ours = generate(engine, prompts, SamplingParams(max_new_tokens=24, temperature=0.0))
    for prompt, finished in zip(prompts, ours, strict=True):
        reference = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=24,
            eos_token_id=codec.eos_id,
            pad_token_id=codec.padding_id,
        )[0, len(prompt) :].tolist()
        assert list(finished.token_ids) == reference
    state = folder / "trainer" / "state"
    assert list(state.glob("*model_states.pt"))
    assert len(list(state.glob("*optim_states.pt"))) == WORLD  # one partition per rank


@ON_GROUP
async def test_stopping_the_supervisor_ends_every_rank(group: Group) -> None:
    pids = [group.supervisor.pid(name) for name in trainer_names("trainer", WORLD)]
    await group.supervisor.stop()
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    events = [(e.child, e.event) for e in group.supervisor.events]
    assert not [e for e in events if e[1] in ("crashed", "escalated")], events


@pytest.mark.asyncio(loop_scope="module")
async def test_a_group_with_no_checkpoint_of_the_published_version_starts_from_gps(tmp_path):
    """A trainer group restarted where no checkpoint holds the version GPS published last (one
    rank here; the job's store holds version 3, weights unlike the checkpoint's): it takes
    those weights as they are, at version 3, with a fresh optimizer and the learning rate of
    step 3, publishes nothing again, and its next step is version 4."""
    from pivot.grpo import warmup_factor

    checkpoint = make_checkpoint(tmp_path / "tiny")
    weights = {n: t * 0.5 for n, t in load_model(checkpoint).state_dict().items()}
    store = f"pivot-test-trainer-{uuid.uuid4().hex[:8]}"
    seeded = ParameterStore(store, adopt=True)
    seeded.write(weights, version=3)
    seeded.close()  # what a rank 0 that died leaves
    settings = msgspec.structs.replace(SETTINGS, warmup_steps=10)
    directory = Directory.ipc(tmp_path, ["trainer", "probe"])
    supervisor = Supervisor()
    add_trainer_group(
        supervisor,
        "trainer",
        directory=directory,
        checkpoint=checkpoint,
        world_size=1,
        run_dir=tmp_path,
        store_name=store,
        settings=settings,
        checkpoints=tmp_path / "checkpoints",  # none complete
    )
    bus = Bus.nng(directory, rl_messages())
    probe = Actor("probe", bus)
    try:
        await supervisor.start()
        await probe.start()
        status = await probe.request(
            "trainer", QueryTrainer(fingerprints=True), expect=TrainerStatus, timeout=TIMEOUT
        )
        assert status.version == 3 and status.fingerprints == [fingerprint(weights)]
        with ParameterReader(store) as reader:
            assert reader.published_version() == 3  # not published again
        trained = await probe.request(
            "trainer",
            TrainBatch(samples=make_samples(checkpoint), step=3, version=3),
            expect=Trained,
            timeout=TIMEOUT,
        )
        assert trained.stats.version == trained.gps_version == 4
        assert trained.stats.lr == pytest.approx(settings.lr * warmup_factor(3, 10))
    finally:
        await probe.stop()
        await bus.close()
        await supervisor.stop()
        remove_store(store)
