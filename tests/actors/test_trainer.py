"""The trainer actor's protocol on the local bus with a stand-in rank group (no DeepSpeed), then
the DeepSpeed trainer for real: two ranks (ZeRO-2, gloo) started by the bus Supervisor as
child processes, driven over nng ipc:// like the driver and the controller drive it, on a
tiny random Qwen2 checkpoint. One launch for the whole module (DeepSpeed's imports and the
rendezvous cost seconds); those tests run in order on the same trainer group.
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

from pivot.actors.messages import Ack
from pivot.actors.param_store import ParameterReader
from pivot.actors.shift_messages import TrainerPhaseChanged
from pivot.actors.trainer import Trainer, add_trainer_group, fingerprint, trainer_names
from pivot.actors.trainer_messages import (
    OffloadTrainer,
    QueryTrainer,
    ReloadTrainer,
    TrainBatch,
    Trained,
    TrainerState,
    TrainerStatus,
)
from pivot.actors.vocabulary import rl_messages
from pivot.bus import Actor, Bus, Directory, LocalTransport, RemoteError, Supervisor, handles
from pivot.engines.tokenizer import TextCodec, build_tokenizer, save_pretrained
from pivot.engines.torch_engine import TorchEngine
from pivot.grpo import (
    RolloutSample,
    TrainingSettings,
    TrainStats,
    build_batch,
    policy_loss,
    token_logprobs,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

# adam_eps well above float noise in small gradients: Adam's first step is ~lr * sign(g)
# where |g| >> eps, which would hide a wrong gradient scale and amplify summation-order noise
# where |g| ~ eps; with eps near typical |g| the update follows g itself
SETTINGS = TrainingSettings(lr=5e-3, adam_eps=1e-3, micro_batch_size=3, zero_stage=2)
WORLD = 2
TIMEOUT = 120.0


# ---- the actor's protocol, with a stand-in group -----------------------------------------------


class FakeEngine:
    def __init__(self) -> None:
        self.version = 0
        self.offloaded = False
        self.zero_stage = 2
        self.settings = TrainingSettings()


class FakeGroup:
    """Runs commands instantly and records them; a train command waits for ``release``."""

    world_size = 2
    store = None
    last_write_s = 0.0

    def __init__(self) -> None:
        self.engine = FakeEngine()
        self.commands: list[str] = []
        self.release = asyncio.Event()
        self.release.set()
        self.loop = asyncio.get_running_loop()

    def lead(self, command):  # noqa: ANN001, ANN201 (called in a worker thread)
        self.commands.append(command.kind)
        if command.kind == "train":
            asyncio.run_coroutine_threadsafe(self.release.wait(), self.loop).result()
            self.engine.version += 1
            return TrainStats(
                version=self.engine.version,
                loss=0.0,
                grad_norm=0.0,
                lr=1e-4,
                sequences=command.batch.size,
                tokens=command.batch.tokens,
                reward_mean=0.0,
                clip_fraction=0.0,
                ratio_mean=1.0,
            )
        if command.kind in ("offload", "reload"):
            self.engine.offloaded = command.kind == "offload"
        return None


class FakeController(Actor):
    def __init__(self, name: str, bus: Bus) -> None:
        super().__init__(name, bus)
        self.told = asyncio.Event()

    @handles
    def phase(self, msg: TrainerPhaseChanged) -> Ack:
        assert msg.phase == "ready"
        self.told.set()
        return Ack()


SMALL = [
    RolloutSample(prompt_ids=[1, 5], response_ids=[6, 2], logprobs=[-1.0, -1.0], reward=r, group=0)
    for r in (1.0, 0.0)
]


async def make_trainer(controller: str | None):
    transport = LocalTransport()
    bus = Bus.local(rl_messages(), transport=transport)
    group = FakeGroup()
    trainer = Trainer("trainer", bus, group=group, pad_id=0, controller=controller)
    boss = FakeController("controller", bus)
    client = Actor("client", bus)
    for actor in (trainer, boss, client):
        await actor.start()
    return trainer, group, boss, client


async def test_a_batch_that_finds_the_pool_lent_waits_for_the_controller() -> None:
    trainer, group, boss, client = await make_trainer(controller="controller")
    try:
        states = client.subscribe("trainer")
        await states.wait_live("trainer")
        lent = await client.request("trainer", OffloadTrainer(), expect=TrainerStatus)
        assert lent.state == "offloaded"
        step = asyncio.ensure_future(client.request("trainer", TrainBatch(samples=SMALL, step=3)))
        await asyncio.wait_for(boss.told.wait(), 5)
        status = await client.request("trainer", QueryTrainer(), expect=TrainerStatus)
        assert (status.state, status.version) == ("training", 0)  # "reclaim the pool"
        still = await client.request("trainer", OffloadTrainer(), expect=TrainerStatus)
        assert still.state == "training"  # lent already: nothing to do
        with pytest.raises(RemoteError, match="while another step is in flight"):
            await client.request("trainer", TrainBatch(samples=SMALL, step=4))
        assert group.commands == ["offload"]  # nothing trained on devices inference holds

        back = await client.request("trainer", ReloadTrainer(), expect=TrainerStatus)
        assert back.state == "training"  # the waiting batch trains now
        trained = await asyncio.wait_for(step, 5)
        assert isinstance(trained, Trained) and trained.step == 3 and trained.stats.version == 1
        assert group.commands == ["offload", "reload", "train"]
        status = await client.request("trainer", QueryTrainer(), expect=TrainerStatus)
        assert (status.state, status.version, status.steps) == ("idle", 1, 1)
        seen = [p.message.state for p in states.drain() if isinstance(p.message, TrainerState)]
        assert seen == ["offloaded", "training", "idle"]
    finally:
        for actor in (client, boss, trainer):
            await actor.stop()


async def test_without_a_controller_a_batch_reloads_by_itself() -> None:
    trainer, group, _, client = await make_trainer(controller=None)
    try:
        await client.request("trainer", OffloadTrainer(), expect=TrainerStatus)
        again = await client.request("trainer", OffloadTrainer(), expect=TrainerStatus)
        assert again.state == "offloaded"  # idempotent: no second offload command
        trained = await client.request("trainer", TrainBatch(samples=SMALL), expect=Trained)
        assert trained.stats.version == 1
        assert group.commands == ["offload", "reload", "train"]
        assert trainer.state == "idle"
    finally:
        for actor in (client, trainer):
            await actor.stop()


async def test_status_is_answered_and_offload_refused_while_a_step_runs() -> None:
    trainer, group, _, client = await make_trainer(controller=None)
    try:
        group.release.clear()
        step = asyncio.ensure_future(client.request("trainer", TrainBatch(samples=SMALL)))
        for _ in range(100):
            if group.commands:
                break
            await asyncio.sleep(0.01)
        status = await client.request("trainer", QueryTrainer(), expect=TrainerStatus, timeout=2)
        assert status.state == "training" and status.version == 0
        with pytest.raises(RemoteError, match="cannot be lent now"):
            await client.request("trainer", OffloadTrainer())
        group.release.set()
        assert (await step).stats.version == 1
    finally:
        for actor in (client, trainer):
            await actor.stop()


# ---- DeepSpeed, two ranks -----------------------------------------------------------------------


def make_checkpoint(folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = build_tokenizer()
    codec = TextCodec(tok)
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
    codec = TextCodec(build_tokenizer())
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


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[2, 3], ids=["zero2", "zero3"])
async def group(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest):
    """The group at ZeRO-2 and at ZeRO-3 (parameters partitioned: no persistence threshold;
    DeepSpeed's FusedAdam, JIT-built on first use)."""
    settings = msgspec.structs.replace(SETTINGS, zero_stage=request.param)
    folder = tmp_path_factory.mktemp("trainer")
    checkpoint = make_checkpoint(folder / "tiny")
    names = trainer_names("trainer", WORLD)
    directory = Directory.ipc(folder, [*names, "probe"])
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
    await probe.start()
    try:
        g = Group(supervisor, probe, store, checkpoint, samples, None, {}, {})
        version, g.initial = g.read_gps()
        assert version == 0
        g.first = await g.ask(TrainBatch(samples=samples, step=0), expect=Trained)
        version, g.after_first = g.read_gps()
        assert version == 1
        yield g
    finally:
        await probe.stop()
        await bus.close()
        await supervisor.stop()


async def test_version_zero_in_gps_is_the_checkpoint(group: Group) -> None:
    checkpoint = load_model(group.checkpoint).state_dict()
    assert set(group.initial) == set(checkpoint)  # lm_head.weight included (tied)
    for name, tensor in checkpoint.items():
        assert torch.equal(group.initial[name], tensor), name


async def test_first_step_equals_a_single_process_adamw_step(group: Group) -> None:
    """Two ranks, each on its share in micro-batches, must make the update one process makes
    on the whole batch: token-mean loss, gradient clipped to 1.0, AdamW."""
    s = SETTINGS
    model = load_model(group.checkpoint).train()
    batch = build_batch(group.samples, pad_id=TextCodec(build_tokenizer()).pad_id)
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


async def test_stopping_the_supervisor_ends_every_rank(group: Group) -> None:
    pids = [group.supervisor.pid(name) for name in trainer_names("trainer", WORLD)]
    await group.supervisor.stop()
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    events = [(e.child, e.event) for e in group.supervisor.events]
    assert not [e for e in events if e[1] in ("crashed", "escalated")], events
