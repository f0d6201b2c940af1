"""Test doubles for users' rollout functions (``pivot.rollout``): a fake LLM and a fake judge
with scripted outputs, scripted aborts and version bumps, so a rollout function is unit-tested
on CPU against the machinery that runs it in a job. Re-exported by ``pivot.actors.testing``.

    llm = FakeLLM({"What is 17+25?": "calc 17+25|", "= 42\\n": "answer 42"})
    judge = FakeJudge(lambda response, task: float(response.endswith(task.reference)))
    task = make_task("What is 17+25?", reference="42", codec=llm.codec)
    result = await run_rollout(my_rollout, task, llm=llm, judge=judge,
                               aborts=[Abort(call=1, after_tokens=3)],   # shift its replica away
                               versions=[VersionBump(call=1, after_tokens=2, version=1)])
    result.trajectories, result.rewards     what the rollout returned, and the job's score of each
    result.calls                            each ctx.generate call's Generation, in call order
    result.judgments                        each score the judge gave (ctx.judge's and the job's)
    ctx = FakeContext(task, llm, judge)     the same doubles without actors, for the fastest tests

``run_rollout`` (``run_rollouts`` for a batch) runs the function as ``pivot run`` does: the
Driver runs it on a ``DriverContext``, its calls go to a real rollout scheduler and real agents
hosting ``ScriptedEngine``s that answer as the ``FakeLLM`` says, its trajectories are scored
by the Driver's default scoring through a real GenRM role whose engine answers as the
``FakeJudge`` says, all assembled by the one builder on the test kit's ``LocalCluster`` (the
local transport; the clock given, else wall time on the running loop), its invariants checked.
A scripted ``Abort`` removes the replica running that call once the call has that many tokens,
as a shift does (the scheduler requeues the sequence, another replica re-prefills its partial
output and continues; the device then rejoins), so the function gets the same Generation as
without it. A ``VersionBump`` makes the trainer publish ``version`` at that point: the replica
loads it with the call running (the call's chunks show both versions) and later calls carry it.

A prompt the script has no output for, and a scripted event that never struck, raise
``ScriptError`` naming them; an exception the rollout function raised is raised again.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import msgspec

from pivot.actors.agent import Inline, RoleAgent
from pivot.actors.assembly import AgentParts, AgentStart, DriverOptions
from pivot.actors.driver import StepReport
from pivot.actors.messages import Completion, Work
from pivot.actors.rollouts import EXTRA_IDS, DriverContext
from pivot.actors.shift_messages import (
    Acquire,
    QueryLoad,
    Register,
    Release,
    RemoveReplica,
    RoleLoadReport,
)
from pivot.actors.sources import GenRMJudge, Sample
from pivot.actors.trainer import TrainResult
from pivot.actors.trainer_messages import GradientHelper, SimTrainBatch, TrainBatch
from pivot.bus import Actor, RealClock
from pivot.cluster import Role
from pivot.data import Record
from pivot.deployment import Deployment, DeploymentKind, Split, plan_deployment
from pivot.engines.protocol import InferenceEngine, SamplingParams
from pivot.engines.scripted import ScriptedEngine
from pivot.engines.tokenizer import TextCodec
from pivot.planning.cost import CostModel
from pivot.planning.routing import RouterSettings, make_router
from pivot.prompts import JudgePrompt
from pivot.rewards import RewardFailed
from pivot.rollout import Task, rollout_result
from pivot.training import TrainStats
from pivot.trajectory import Chunk, Generation, Trajectory, add_chunk

__all__ = [
    "Abort",
    "FakeContext",
    "FakeJudge",
    "FakeLLM",
    "Judgment",
    "RolloutResult",
    "ScriptError",
    "Struck",
    "VersionBump",
    "make_task",
    "run_rollout",
    "run_rollouts",
]

SCRIPT = "rollout-script"  # the actor that strikes scripted events (a Controller's messages)
_CONTEXT_LIMIT = 120  # characters of a prompt an error shows (its end: a multi-turn's last turn)


class ScriptError(ValueError):
    """A double's script cannot answer (no output for a prompt), or an event never struck."""


def _shown(text: str) -> str:
    return repr(text if len(text) <= _CONTEXT_LIMIT else "..." + text[-_CONTEXT_LIMIT:])


Output = str | Sequence[int]


class _Scripted:
    """A double whose script runs inside an engine, where an exception would only fail the
    agent's request: each ``ScriptError`` is also told to ``on_error`` (``run_rollouts``
    stops the run and raises it)."""

    on_error: Callable[[ScriptError], None] | None = None

    def _error(self, message: str) -> ScriptError:
        error = ScriptError(message)
        if self.on_error is not None:
            self.on_error(error)
        return error


class FakeLLM(_Scripted):
    """The policy, scripted. ``script`` maps a prompt to its output, text or token ids: the
    output of the longest key the prompt ends with (a text key against the decoded prompt, an
    id key against its ids), so a multi-turn rollout's later turns are keyed by their last
    part; or it is a function ``(prompt text, sampling) -> output | None``. ``default``: the
    output of any other prompt (None: such a prompt is a ``ScriptError``). Every token's
    logprob is ``logprob``. Outputs stop early at a call's stop tokens, eos or
    ``max_new_tokens``, as an engine's do (``pivot.engines.scripted.ScriptedEngine``).
    ``prefills``: every sequence an engine was handed, as (seq_id, generated tokens it came
    with): more than 0 is a re-prefill, a sequence continuing where an abort left it."""

    def __init__(
        self,
        script: Mapping[str | tuple[int, ...], Output] | Callable[[str, SamplingParams], Any],
        default: Output | None = None,
        *,
        codec: TextCodec | None = None,
        logprob: float = -0.5,
        max_running: int = 8,
    ) -> None:
        self.script = script
        self.default = default
        self.codec = codec if codec is not None else TextCodec.char()
        self.logprob = logprob
        self.max_running = max_running
        self.prefills: list[tuple[int, int]] = []

    def _lookup(self, text: str, ids: tuple[int, ...], sampling: SamplingParams) -> Any:
        if callable(self.script):
            return self.script(text, sampling)
        best, best_len = None, -1
        for key, out in self.script.items():
            n = len(key)
            matches = text.endswith(key) if isinstance(key, str) else ids[len(ids) - n :] == key
            if matches and n > best_len:
                best, best_len = out, n
        return best

    def output(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
        """The whole output for ``prompt_ids`` (the engines' script)."""
        ids = tuple(int(t) for t in prompt_ids)
        text = self.codec.decode(ids)
        try:
            out = self._lookup(text, ids, sampling)
        except Exception as exc:
            raise self._error(
                f"FakeLLM's script failed on the prompt {_shown(text)}: {type(exc).__name__}: {exc}"
            ) from exc
        if out is None:
            out = self.default
        if out is None:
            raise self._error(f"FakeLLM has no output for the prompt {_shown(text)}")
        tokens = self.codec.encode(out, bos=False) if isinstance(out, str) else list(out)
        if not tokens:
            raise self._error(f"FakeLLM's output for the prompt {_shown(text)} is empty")
        return [int(t) for t in tokens]

    def engine(self, version: int = 0) -> _FakeEngine:
        """A replica's engine answering as scripted, with policy ``version`` loaded."""
        eos = [self.codec.eos_id] if self.codec.eos_id is not None else []
        return _FakeEngine(
            self.output,
            self.prefills,
            eos_token_ids=eos,
            logprob=self.logprob,
            max_running=self.max_running,
            weights_version=version,
        )


class _FakeEngine(ScriptedEngine):
    """A scripted engine that counts each held sequence's tokens (so a scripted event knows
    when its call reached its point)."""

    def __init__(self, script: Callable, prefills: list[tuple[int, int]], **kwargs: Any) -> None:
        super().__init__(script, **kwargs)
        self.prefills = prefills
        self.tokens: dict[int, int] = {}

    def add(self, seq_id, prompt_ids, generated_ids=(), sampling=None, generated_logprobs=None):  # noqa: ANN001, ANN201
        super().add(seq_id, prompt_ids, generated_ids, sampling, generated_logprobs)
        self.tokens[int(seq_id)] = len(generated_ids)
        self.prefills.append((int(seq_id), len(generated_ids)))

    def step(self):  # noqa: ANN201 - StepOutput
        out = super().step()
        for event in out.events:
            self.tokens[int(event.seq_id)] += 1
        for f in out.finished:
            self.tokens.pop(int(f.seq_id), None)
        return out

    def abort(self, seq_ids: Iterable[int] | None = None):  # noqa: ANN201 - [PartialOutput]
        out = super().abort(seq_ids)
        for p in out:
            self.tokens.pop(int(p.seq_id), None)
        return out


Verdict = float | None


class FakeJudge(_Scripted):
    """The job's reward, scripted: ``score(response text, task) -> float | None`` (or a
    mapping response -> score, with ``default`` for any other). In ``run_rollout`` it is a
    GenRM: the response goes to a reward replica as a judge prompt, its scripted engine writes
    the judgment ``"score: <value>"`` and the job's verdict parser reads it back, so both
    ``ctx.judge`` and the default scoring of a trajectory returned without a reward reach
    it. None (or no entry) is a judgment without a verdict: that reward fails, as a real
    GenRM's would (``ctx.judge`` raises ``pivot.rewards.RewardFailed``)."""

    def __init__(
        self,
        score: Callable[[str, Task], Verdict] | Mapping[str, Verdict],
        default: Verdict = None,
        *,
        codec: TextCodec | None = None,
        max_new_tokens: int = 64,
    ) -> None:
        self.score = score
        self.default = default
        self.codec = codec if codec is not None else TextCodec.char()
        self.genrm = GenRMJudge(
            JudgePrompt(self.codec, self._render), _verdict, max_new_tokens=max_new_tokens
        )
        self._asked: dict[int, tuple[str, Task]] = {}  # judge prompt key -> what it judges
        self._keys = itertools.count()

    def __call__(self, response: str, task: Task) -> Verdict:
        if callable(self.score):
            return self.score(response, task)
        return self.score.get(response, self.default)

    def work(self, sample: Sample, response: str) -> Work:
        """The GenRM sequence judging ``sample``'s ``response``."""
        key = next(self._keys)
        self._asked[key] = (response, sample.task)
        task = sample.task
        record = Record(
            index=key,
            prompt=task.prompt if task.prompt is not None else "",
            reference=task.reference,
            metadata=task.metadata,
        )
        return self.genrm.work(sample.seq_id, record, response)

    @staticmethod
    def _render(record: Record, response: str) -> str:
        return f"judge {record.index}\n{response}"

    def output(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> list[int]:
        """The GenRM's judgment of a judge prompt (its engines' script)."""
        # the key the render wrote (a chat template may have written more around it)
        key = re.search(r"judge (\d+)\n", self.codec.decode(prompt_ids))
        assert key is not None, "a judge prompt the FakeJudge did not render"
        response, task = self._asked[int(key.group(1))]
        try:
            value = self(response, task)
            text = "no verdict" if value is None else f"score: {float(value)!r}"
        except Exception as exc:
            raise self._error(
                f"FakeJudge's score failed on the response {_shown(response)}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        return self.codec.encode(text, bos=False)

    def engine(self) -> ScriptedEngine:
        return ScriptedEngine(self.output, logprob=0.0)


def _verdict(text: str) -> float | None:
    head, _, value = text.partition("score: ")
    return float(value) if not head and value else None


class Abort(msgspec.Struct, frozen=True, kw_only=True):
    """Shift away the replica running generate call ``call`` (0-based, in the rollout's call
    order) once it has ``after_tokens`` tokens (fewer than its whole output), as the
    Controller's shift-down does; ``task``: the seq_id of the task whose call it is (None:
    the first task's call to get there). Strikes once."""

    call: int
    after_tokens: int
    task: int | None = None

    def __post_init__(self) -> None:
        _check_event(self)


class VersionBump(msgspec.Struct, frozen=True, kw_only=True):
    """The trainer publishes policy ``version`` when generate call ``call`` has
    ``after_tokens`` tokens: the replica running it loads it at once (the call's tokens so
    far stay the old policy's, the rest are the new one's) and later calls carry it.
    ``task`` as for ``Abort``. Strikes once."""

    call: int
    after_tokens: int
    version: int
    task: int | None = None

    def __post_init__(self) -> None:
        _check_event(self)


def _check_event(event: Abort | VersionBump) -> None:
    if event.call < 0 or event.after_tokens < 1:
        raise ValueError(f"{event!r}: call must be >= 0 and after_tokens >= 1")


Event = Abort | VersionBump


class Struck(msgspec.Struct, frozen=True, kw_only=True):
    """A scripted event where it struck: the call's sequence, the replica running it, and
    the tokens it had."""

    event: Abort | VersionBump
    task: int
    seq_id: int
    replica: str
    tokens: int


class Judgment(msgspec.Struct, frozen=True, kw_only=True):
    """One score the job's reward gave: ``by`` ``"ctx.judge"`` (the rollout asked) or
    ``"job"`` (the default scoring of a trajectory returned without a reward); ``score`` None
    with ``failure`` its cause; ``text`` the GenRM's judgment."""

    task: int
    response: str
    score: float | None
    failure: str | None
    by: Literal["ctx.judge", "job"]
    text: str = ""


class RolloutResult(msgspec.Struct, kw_only=True):
    """One task's rollout: the trajectories it returned (``[]``: it rejected the task) with
    the score the job trained each on (its own reward, or the judge's), each generate call's
    Generation in call order, and the judgments. ``report``: the step's report;
    ``sequences``: each scheduler's ledger counts at the end (every sequence submitted once
    and done once); ``struck``: the scripted events, where they struck."""

    task: Task
    trajectories: list[Trajectory]
    rewards: list[float | None]
    calls: list[Generation]
    judgments: list[Judgment]
    report: StepReport
    sequences: dict[str, dict[str, int]]
    struck: list[Struck]


def make_task(
    prompt: str | list[dict[str, Any]],
    *,
    reference: Any = None,
    codec: TextCodec | None = None,
    seq_id: int = 0,
    group: int | None = None,
    sample: int = 0,
    sampling: SamplingParams | None = None,
    metadata: dict[str, Any] | None = None,
) -> Task:
    """A task of ``prompt`` (text, or chat messages through the codec's chat template)
    encoded with ``codec`` (the FakeLLM's: the character codec by default); ``sampling``
    defaults to 64 new tokens seeded by ``seq_id``."""
    codec = codec if codec is not None else TextCodec.char()
    ids = codec.encode(prompt) if isinstance(prompt, str) else codec.encode_chat(prompt)
    return Task(
        seq_id=seq_id,
        step=0,
        group=seq_id if group is None else group,
        sample=sample,
        prompt_ids=ids,
        sampling=sampling if sampling is not None else SamplingParams(seed=seq_id),
        prompt=prompt,
        reference=reference,
        metadata=metadata or {},
    )


# --- the pure double ---------------------------------------------------------------------


class _MemoryCalls:
    """``DriverContext``'s calls answered in memory: each generate call runs a fresh scripted
    engine to its end, a scripted version bump splitting its chunks where it strikes."""

    def __init__(self, llm: FakeLLM, versions: Sequence[VersionBump], task: Task) -> None:
        self.llm = llm
        self.version = 0
        self.pending = [v for v in versions if v.task in (None, task.seq_id)]
        self.task = task
        self.struck: list[Struck] = []
        self._calls = 0
        self._ids = itertools.count(EXTRA_IDS)

    def new_id(self) -> int:
        return next(self._ids)

    def end_session(self, session: str) -> None:
        pass  # no scheduler holds a routing hint

    async def call(self, role: str, work: Work) -> Completion:
        n, self._calls = self._calls, self._calls + 1
        engine = self.llm.engine(self.version)
        engine.add(work.seq_id, work.prompt_ids, (), work.sampling)
        chunks: list[Chunk] = []
        closed = 0
        while True:
            out = engine.step()
            tokens = engine.tokens.get(work.seq_id)
            if out.finished:
                break
            for bump in [v for v in self.pending if v.call == n and v.after_tokens <= tokens]:
                self.pending.remove(bump)
                add_chunk(chunks, tokens - closed, engine.weights_version)
                closed = tokens
                engine.load_weights({}, bump.version)
                self.version = bump.version
                self.struck.append(
                    Struck(
                        event=bump,
                        task=self.task.seq_id,
                        seq_id=work.seq_id,
                        replica="memory",
                        tokens=tokens,
                    )
                )
        (done,) = out.finished
        add_chunk(chunks, len(done.token_ids) - closed, engine.weights_version)
        return Completion(
            seq_id=work.seq_id,
            token_ids=list(done.token_ids),
            logprobs=list(done.logprobs),
            finish_reason=done.finish_reason,
            chunks=chunks,
            replica="memory",
        )


class FakeContext(DriverContext):
    """A ``RolloutContext`` in memory, no actors: the Driver's own context over calls that
    ``llm`` answers at once (same seeds, prompt encoding and Generations as in a job), and
    ``judge`` scoring ``ctx.judge`` directly. ``versions``: scripted version bumps (an
    abort is invisible to a rollout by design: test it with ``run_rollout``). ``calls`` and
    ``judgments`` record what the rollout asked, ``unstruck`` the bumps that never struck."""

    def __init__(
        self,
        task: Task,
        llm: FakeLLM,
        judge: FakeJudge | None = None,
        *,
        versions: Sequence[VersionBump] = (),
    ) -> None:
        self._memory = _MemoryCalls(llm, versions, task)
        self._fake_judge = judge
        super().__init__(
            task,
            self._memory,  # type: ignore[arg-type]
            codec=llm.codec,
            policy_version=lambda: self._memory.version,
            judge=self._judged,
        )
        self.calls: list[Generation] = []
        self.judgments: list[Judgment] = []

    async def generate(self, prompt: Any, **kwargs: Any) -> Generation:
        made = await super().generate(prompt, **kwargs)
        self.calls.append(made)
        return made

    async def _judged(self, task: Task, trajectory: Trajectory) -> float:
        if self._fake_judge is None:
            raise RuntimeError("this FakeContext has no FakeJudge: give one to call ctx.judge")
        response = self.tokenizer.decode(trajectory.response_ids)  # as the job's source reads it
        value = self._fake_judge(response, task)
        score = None if value is None else float(value)
        failure = "unparseable judgment" if score is None else None
        self.judgments.append(
            Judgment(
                task=task.seq_id, response=response, score=score, failure=failure, by="ctx.judge"
            )
        )
        if score is None:
            raise RewardFailed("unparseable judgment", "the FakeJudge gave no verdict")
        return score

    @property
    def struck(self) -> list[Struck]:
        return list(self._memory.struck)

    @property
    def unstruck(self) -> list[VersionBump]:
        return list(self._memory.pending)


# --- the doubles on the real machinery ---------------------------------------------------


class _Policy:
    """The policy version the fake trainer has published."""

    def __init__(self) -> None:
        self.version = 0


class _Script:
    """The scripted events of one run and where they struck. Every fake engine steps under
    ``lock``, and an event strikes holding it, so the others wait while a replica is shifted
    away or loads weights: each strikes at exactly its token."""

    def __init__(self, events: Sequence[Event], policy: _Policy) -> None:
        self.pending: list[Event] = list(events)
        self.struck: list[Struck] = []
        self.policy = policy
        self.contexts: dict[int, DriverContext] = {}  # by task, as their rollouts started
        self.lock = asyncio.Lock()
        self.actor: Callable[[], Actor] = lambda: None  # type: ignore[assignment,return-value]
        self.driver: Callable[[], Any] = lambda: None

    def _due(self, engine: _FakeEngine) -> tuple[Event, int, int, int] | None:
        for event in self.pending:
            tasks = [event.task] if event.task is not None else list(self.contexts)
            for task in tasks:
                ctx = self.contexts.get(task)
                if ctx is None or len(ctx.seq_ids) <= event.call:
                    continue
                seq_id = ctx.seq_ids[event.call]
                tokens = engine.tokens.get(seq_id, -1)
                if tokens >= event.after_tokens:
                    return event, task, seq_id, tokens
        return None

    async def after_step(self, agent: RoleAgent, engine: InferenceEngine) -> None:
        if not isinstance(engine, _FakeEngine) or not self.pending:
            return
        due = self._due(engine)
        if due is None:
            return
        event, task, seq_id, tokens = due
        self.pending.remove(event)
        self.struck.append(
            Struck(
                event=event, task=task, seq_id=seq_id, replica=agent.replica or "", tokens=tokens
            )
        )
        if isinstance(event, Abort):
            await self._shift_away(agent, seq_id)
        else:
            await self._publish(agent, event.version)

    async def _shift_away(self, agent: RoleAgent, seq_id: int) -> None:
        """The Controller's shift-down of the agent's replica, then its shift-up as the same
        replica once the sequence runs on another (when there is one)."""
        actor, replica = self.actor(), agent.replica
        scheduler, role, devices = agent.scheduler, agent.role, list(agent.devices)
        assert replica is not None and scheduler is not None
        await actor.request(scheduler, RemoveReplica(replica=replica))
        for _ in range(100):  # a few loop turns: the scheduler dispatches at once (if it has room)
            load = await actor.request(scheduler, QueryLoad(), expect=RoleLoadReport)
            if not load.replicas or any(seq_id in r.seq_ids for r in load.replicas):
                break
            await asyncio.sleep(0)
        await actor.request(agent.name, Release(replica=replica))
        await actor.request(
            agent.name,
            Acquire(
                role=role,
                replica=replica,
                devices=devices,
                min_version=self.policy.version,
                scheduler=scheduler,
            ),
        )
        await actor.request(agent.name, Register(replica=replica))

    async def _publish(self, agent: RoleAgent, version: int) -> None:
        """The trainer published ``version``: later calls carry it, and the replica loads it
        now, as an Assign of that version would make it (``RoleAgent.catch_up``)."""
        self.policy.version = max(self.policy.version, version)
        driver = self.driver()
        driver.policy_version = max(driver.policy_version, version)
        await agent.catch_up(version)

    def unstruck(self) -> ScriptError | None:
        if not self.pending:
            return None
        made = {t: len(ctx.seq_ids) for t, ctx in self.contexts.items()}
        return ScriptError(
            f"scripted events never struck: {', '.join(repr(e) for e in self.pending)} "
            f"(generate calls per task: {made}; a call must still run at after_tokens)"
        )


class _ScriptedStepping(Inline):
    """``Inline`` stepping under the script's lock, striking the events due after a step."""

    def __init__(self, script: _Script) -> None:
        super().__init__()
        self.script = script

    async def turn(self, agent: RoleAgent, engine: InferenceEngine) -> None:
        async with self.script.lock:
            await super().turn(agent, engine)
            await self.script.after_step(agent, engine)


class _FrozenTrainer:
    """A ``TrainingBackend`` that trains nothing: a step leaves the published version."""

    def __init__(self, policy: _Policy) -> None:
        self.policy = policy

    @property
    def version(self) -> int:
        return self.policy.version

    world_size = 1
    zero_stage = 0
    store = None

    async def start(self) -> None:
        pass

    async def prepare(self, msg: TrainBatch | SimTrainBatch) -> SimTrainBatch:
        assert isinstance(msg, SimTrainBatch)
        return msg

    async def train(self, batch: SimTrainBatch) -> TrainResult:
        stats = TrainStats(
            version=self.policy.version,
            loss=0.0,
            grad_norm=0.0,
            lr=0.0,
            sequences=batch.sequences,
            tokens=batch.tokens,
            reward_mean=0.0,
            clip_fraction=0.0,
            ratio_mean=1.0,
        )
        return TrainResult(stats=stats, gps_version=None)

    @property
    def takes_helpers(self) -> bool:
        return False

    async def help(self, helpers: list[GradientHelper]) -> list[str]:
        return []

    async def offload(self) -> float:
        return 0.0

    async def reload(self) -> float:
        return 0.0

    async def fingerprints(self) -> list[str]:
        return []

    async def close(self) -> None:
        pass


class _FakeBackend:
    """The assembly's ``Backend``: agents host the fakes' engines in process."""

    def __init__(
        self, llm: FakeLLM, judge: FakeJudge | None, script: _Script, policy: _Policy
    ) -> None:
        self.llm = llm
        self.judge = judge
        self.script = script
        self.policy = policy

    def router(self, role: Role):  # noqa: ANN201 - a Router
        return make_router(
            RouterSettings(policy="lowest_itl", max_concurrent_per_replica=8),
            CostModel(a=1e-7, b=1e-3, c=5e-5, d=5e-4),
        )

    def _weights(self, model: str, min_version: int) -> tuple[dict, int]:
        return {}, max(min_version, self.policy.version)

    def agent(self, agent: AgentStart) -> Callable[[], AgentParts]:
        def parts() -> AgentParts:
            engines: dict[Role, InferenceEngine] = {}
            for role in agent.engine_roles:
                if role is Role.ROLLOUT:
                    engines[role] = self.llm.engine(self.policy.version)
                elif self.judge is not None:
                    engines[role] = self.judge.engine()
            return AgentParts(
                engines=engines,
                weights={Role.ROLLOUT: self._weights, Role.REWARD: self._weights},
                models={},
                stepping=_ScriptedStepping(self.script),
            )

        return parts

    def controller(self, deployment: Deployment) -> None:
        return None

    def trainer(self, name: str, deployment: Deployment, controller: str | None):  # noqa: ANN201
        return lambda clock: _FrozenTrainer(self.policy)


class _TaskSource:
    """The run's ``Source``: the given tasks at step 0, the FakeJudge as the job's GenRM
    (scored by its verdict parser, as ``PromptSource`` scores a GenRM), what was scored kept
    per task."""

    def __init__(self, tasks: Sequence[Task], codec: TextCodec, judge: FakeJudge | None) -> None:
        self._tasks = list(tasks)
        self.codec = codec
        self.fake = judge
        self.judged = judge is not None
        self.scored: dict[int, list[Sample]] = {t.seq_id: [] for t in tasks}
        self.judgments: dict[int, list[Judgment]] = {t.seq_id: [] for t in tasks}

    def tasks(self, step: int) -> list[Task]:
        return list(self._tasks) if step == 0 else []

    def check(self, sample: Sample) -> bool | None:
        return None

    def _text(self, sample: Sample) -> str:
        return self.codec.decode(sample.response_ids)

    def judge(self, sample: Sample) -> Work:
        assert self.fake is not None
        return self.fake.work(sample, self._text(sample))

    def score(self, sample: Sample) -> None:
        if self.fake is None:
            sample.failure = "no judge"  # run_rollout was given none
            return None
        assert sample.judgment is not None
        try:
            result = self.fake.genrm.result(sample.judgment.token_ids)
        except RewardFailed as failed:
            sample.failure = failed.cause
        else:
            sample.score, sample.metrics = result.score, result.metrics
        return None

    def done(self, sample: Sample, dump: bool = True) -> None:
        task = sample.task.seq_id
        if dump:
            self.scored[task].append(sample)
        if sample.trajectory is None or (sample.judgment is None and sample.failure is None):
            return  # the rollout failed, or set its own reward
        text = ""
        if sample.judgment is not None and self.fake is not None:
            text = self.fake.codec.decode(sample.judgment.token_ids)
        self.judgments[task].append(
            Judgment(
                task=task,
                response=self._text(sample),
                score=sample.score,
                failure=sample.failure,
                by="job" if dump else "ctx.judge",
                text=text,
            )
        )

    def train_request(self, step: int, samples: list[Sample]) -> SimTrainBatch:
        tokens = sum(len(s.response_ids) for s in samples)
        return SimTrainBatch(step=step, sequences=len(samples), tokens=tokens)


class _Recorded:
    """A rollout's ``DriverContext`` as its function sees it: every call passes through, and
    each generate call's Generation is kept in call order."""

    def __init__(self, ctx: DriverContext) -> None:
        self._ctx = ctx
        self.calls: list[Generation | None] = []

    @property
    def tokenizer(self) -> Any:
        return self._ctx.tokenizer

    @property
    def policy_version(self) -> int:
        return self._ctx.policy_version

    @property
    def openai_base_url(self) -> str:
        return self._ctx.openai_base_url

    async def generate(self, prompt: Any, **kwargs: Any) -> Generation:
        slot = len(self.calls)
        self.calls.append(None)
        made = await self._ctx.generate(prompt, **kwargs)
        self.calls[slot] = made
        return made

    async def judge(self, response: str | Trajectory) -> float:
        return await self._ctx.judge(response)

    def end_session(self, session: str | None = None) -> None:
        return self._ctx.end_session(session)


def _deployment(replicas: int, judges: int) -> Deployment:
    """Fixed pools (no Controller: the script shifts): ``replicas`` rollout devices,
    ``judges`` reward devices, one trainer device."""
    gpus = replicas + judges + 1
    split = Split(
        kind=DeploymentKind.DISAGGREGATED,
        gpus=gpus,
        rollout=replicas,
        reward=judges,
        training=1,
    )
    sizes = {Role.ROLLOUT: 1, Role.REWARD: 1}
    return plan_deployment(split, sizes, devices_per_host=gpus, judged=judges > 0)


async def run_rollouts(
    fn: Callable[[Any, Task], Any],
    tasks: Sequence[Task],
    *,
    llm: FakeLLM,
    judge: FakeJudge | None = None,
    aborts: Sequence[Abort] = (),
    versions: Sequence[VersionBump] = (),
    replicas: int = 2,
    judges: int = 1,
    clock: Any = None,
) -> list[RolloutResult]:
    """Run the rollout function ``fn`` on every task as one step of a job (see the module
    docstring), on ``replicas`` rollout replicas and (with a judge) ``judges`` GenRM ones;
    ``clock``: the running loop's (a ``VirtualClock`` under ``pivot.bus.run_virtual``;
    default: wall time). One result per task, in order."""
    from pivot.actors.testing import LocalCluster  # it re-exports this module

    tasks = list(tasks)
    ids = [t.seq_id for t in tasks]
    if not tasks or len(set(ids)) != len(ids) or max(ids) >= EXTRA_IDS or min(ids) < 0:
        raise ValueError(f"tasks need distinct seq_ids in [0, {EXTRA_IDS}), got {ids}")
    if replicas < 1 or judges < (1 if judge is not None else 0):
        raise ValueError(
            f"replicas must be >= 1 and judges >= 1 with a judge: {replicas}, {judges}"
        )
    policy = _Policy()
    script = _Script([*aborts, *versions], policy)
    errors: list[BaseException] = []
    failed = asyncio.Event()

    def script_failed(error: ScriptError) -> None:
        errors.append(error)
        failed.set()

    recorders: dict[int, _Recorded] = {}
    returned: dict[int, Any] = {}

    async def recorded(ctx: DriverContext, task: Task) -> Any:
        script.contexts[task.seq_id] = ctx
        view = recorders[task.seq_id] = _Recorded(ctx)
        try:
            value = returned[task.seq_id] = await fn(view, task)
        except Exception as exc:
            errors.append(exc)
            raise
        return value

    source = _TaskSource(tasks, llm.codec, judge)
    clock = clock if clock is not None else RealClock()
    sequences: dict[str, dict[str, int]] = {}
    cluster: LocalCluster | None = None

    def at_end() -> None:
        assert cluster is not None
        for role, scheduler in cluster.assembly.schedulers.items():
            sequences[role.value] = scheduler.core.ledger.counts()

    cluster = LocalCluster(
        clock,
        _deployment(replicas, judges if judge is not None else 0),
        backend=_FakeBackend(llm, judge, script, policy),
        source=source,
        steps=1,
        # a rollout that stops making progress is an error, not a hang
        driver=DriverOptions(rollout=recorded, stall_timeout=60.0),
        watchers=[(SCRIPT, lambda: Actor(SCRIPT, cluster.bus))],
    )
    script.actor = lambda: cluster.assembly.actor(SCRIPT)  # type: ignore[assignment,return-value]
    script.driver = lambda: cluster.assembly.driver
    doubles = [d for d in (llm, judge) if d is not None]
    for double in doubles:
        double.on_error = script_failed
    try:
        run = asyncio.ensure_future(cluster.run(at_end))
        stopped = asyncio.ensure_future(failed.wait())
        await asyncio.wait({run, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not run.done():  # a script error: nothing will finish the step
            run.cancel()
        assembly_error = None
        try:
            await run
        except asyncio.CancelledError:
            if not errors:
                raise
        except Exception as exc:
            assembly_error = exc
    finally:
        for double in doubles:
            double.on_error = None
    if errors:
        raise errors[0]
    if assembly_error is not None:
        raise assembly_error
    unstruck = script.unstruck()
    if unstruck is not None:
        raise unstruck
    report = cluster.assembly.driver.reports[0]
    results = []
    for task in tasks:
        trajectories = rollout_result(returned.get(task.seq_id))
        scores = {id(s.trajectory): s.score for s in source.scored[task.seq_id]}
        view = recorders.get(task.seq_id)
        results.append(
            RolloutResult(
                task=task,
                trajectories=trajectories,
                rewards=[scores.get(id(t)) for t in trajectories],
                calls=[c for c in view.calls if c is not None] if view is not None else [],
                judgments=source.judgments[task.seq_id],
                report=report,
                sequences=dict(sequences),
                struck=[s for s in script.struck if s.task == task.seq_id],
            )
        )
    return results


async def run_rollout(fn: Callable[[Any, Task], Any], task: Task, **kwargs: Any) -> RolloutResult:
    """``run_rollouts`` of one task."""
    (result,) = await run_rollouts(fn, [task], **kwargs)
    return result
