"""The RL messages of rollout and judging: driver <-> schedulers <-> agents, and the load
metrics agents publish. ``pivot.actors.vocabulary`` lists every message of the job.

Whatever must arrive (sequences, completions, scores, shift commands) travels as a request and
is acknowledged; only what the next sample replaces (load metrics) is published. Token ids
travel as lists of ints; msgpack keeps them compact. A simulated engine's are
``pivot.engines.sim_engine.Placeholders``: only their count travels.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pivot.bus import Message
from pivot.engines.protocol import FinishReason, SamplingParams
from pivot.engines.sim_engine import Placeholders
from pivot.events import EventRecord
from pivot.trajectory import Chunk, Generation, Trajectory

PROTOCOL_VERSION = 1


class RLMessage(Message):
    """Base of every RL message (the job's union is ``pivot.actors.vocabulary.MESSAGES``)."""


# a simulated engine's ids travel as their count: copying thousands of ids per hop would
# dominate a simulation's wall time
TokenIds = list[int] | Placeholders


def copy_ids(ids: Sequence[int] | Placeholders) -> TokenIds:
    """``ids`` as a message carries them: a list, or the placeholders as they are."""
    return ids if isinstance(ids, Placeholders) else list(ids)


class Work(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence as a replica needs it: prompt, partial output to re-prefill, sampling."""

    seq_id: int
    prompt_ids: TokenIds
    sampling: SamplingParams
    generated_ids: TokenIds = []
    generated_logprobs: list[float] = []
    # which policy version sampled which of ``generated_ids`` (run-length, in order)
    generated_chunks: list[Chunk] = []
    policy_version: int = 0
    # a routing hint: the replica that served this session's last turn holds its prefix
    session: str = ""
    # the actor its Completion goes to ("": the scheduler's downstream stage)
    reply_to: str = ""


class Completion(msgspec.Struct, frozen=True, kw_only=True):
    """A finished sequence: its whole output."""

    seq_id: int
    token_ids: TokenIds
    logprobs: list[float]
    finish_reason: FinishReason
    # which policy version sampled which tokens (run-length; sums to len(token_ids))
    chunks: list[Chunk] = []
    replica: str = ""
    # a migrated sequence: its re-prefill's seconds on the replica that finished it
    reprefill_s: float = 0.0
    # seconds it waited in its role's queue before its first dispatch (set by the scheduler;
    # its waits after an abort are the migration's)
    queued_s: float = 0.0


# -- driver <-> scheduler


class SubmitSequences(RLMessage, kw_only=True):
    """New sequences for a role's shared queue."""

    sequences: list[Work]


class Accepted(RLMessage, kw_only=True):
    count: int


class Completed(RLMessage, kw_only=True):
    """Sequences the role finished, delivered to the stage after it."""

    role: str
    completions: list[Completion]


class QueryStatus(RLMessage, kw_only=True):
    """Ask a scheduler for its state (monitors, and the driver before its first step)."""


class SchedulerStatus(RLMessage, kw_only=True):
    role: str
    replicas: list[str]
    queued: int
    running: int
    completed: int
    # completions dropped: their ``reply_to`` did not answer within the delivery budget
    undeliverable: int = 0
    # dispatches of a session with a remembered replica: landed on it / elsewhere
    session_hits: int = 0
    session_misses: int = 0


class EndSession(RLMessage, kw_only=True):
    """A multi-turn session is over: the scheduler forgets which replica served it (Ack count:
    1 when it knew one)."""

    session: str


# -- scheduler <-> agent


class RegisterReplica(RLMessage, kw_only=True):
    """An agent offers a replica of ``role`` to the role's scheduler. ``held``: the sequences
    it holds for the replica now; a sequence the scheduler placed there that it does not hold
    was lost with an earlier process of the agent and goes back to the queue."""

    replica: str
    agent: str
    role: str
    max_running: int
    held: list[int] = []
    agent_incarnation: int = 0  # the agent instance's (Actor.incarnation); 0: not said
    protocol: int = PROTOCOL_VERSION


class Assign(RLMessage, kw_only=True):
    """Scheduler -> agent: run these sequences (Dispatch; non-empty partial output re-prefills)."""

    sequences: list[Work]


class Finished(RLMessage, kw_only=True):
    """Agent -> scheduler: sequences that finished on the replica in the last step(s)."""

    replica: str
    completions: list[Completion]


class Abort(RLMessage, kw_only=True):
    """Scheduler -> agent: stop these sequences (all when ``seq_ids`` is None), return partials."""

    seq_ids: list[int] | None = None


class Partial(msgspec.Struct, frozen=True, kw_only=True):
    seq_id: int
    token_ids: TokenIds
    logprobs: list[float]
    chunks: list[Chunk] = []  # as in Completion


class Aborted(RLMessage, kw_only=True):
    partials: list[Partial]


class Ack(RLMessage, kw_only=True):
    count: int = 0


# -- metrics (published, lossy)


class ReplicaLoad(RLMessage, kw_only=True):
    """A replica's load after a step, for routing and the planner's cost-model refit."""

    replica: str
    role: str
    running: int
    kv_tokens: int
    itl_s: float
    generated_tokens: int
    seq_tokens: dict[int, int] = {}
    # the last decode iteration (EngineStats.decode_*): the cost-model refit's sample
    decode_running: int = 0
    decode_tokens: int = 0
    decode_itl_s: float = 0.0


class EngineSegments(RLMessage, kw_only=True):
    """What a replica's engine ran since its last batch of segments, for the run's time
    account (``pivot.account``): per segment (columns of equal length) its start and end on
    the agent's clock, the sequences it held, and its first seconds of prefill, of which
    the last ``reprefill_s`` re-prefilled sequences that had output already. ``batch``
    counts ``agent``'s batches, so a reader can tell one was lost."""

    agent: str
    replica: str
    role: str
    devices: list[int]
    batch: int
    start: list[float]
    end: list[float]
    running: list[int]
    prefill_s: list[float]
    reprefill_s: list[float]


# -- a process attached to the job <-> driver


class GenerateRequest(RLMessage, kw_only=True):
    """``ctx.generate`` from a process attached to the job (``pivot.cli.jobs.attach``): one
    sequence through the job's rollout scheduler, answered once it completed (a shift in
    between only delays the answer)."""

    prompt_ids: list[int]
    sampling: SamplingParams
    session: str = ""


class GenerateReply(RLMessage, kw_only=True):
    generation: Generation


class SubmitTrajectories(RLMessage, kw_only=True):
    """Scored trajectories for the job's training, from a process attached to it or a
    library user: each inner list is one prompt group (advantages are normalised in it).
    They join the step now rolling out (or the next one) and train with it."""

    groups: list[list[Trajectory]]


class StopJob(RLMessage, kw_only=True):
    """``pivot stop``: end the job. Graceful: the Driver finishes the step in progress,
    checkpoints it and stops; ``now``: it abandons the step and stops at once (what Ctrl-C
    does, without the signal)."""

    now: bool = False


class StopAccepted(RLMessage, kw_only=True):
    """The Driver will stop after ``step`` (-1: at once, or before its first step), writing
    ``checkpoint`` ("" when none will be written: ``now``, or the job has no trainer)."""

    step: int
    checkpoint: str = ""


# -- the job's events (pivot.events), for watchers: the Monitor publishes and answers them


class EventBatch(RLMessage, kw_only=True):
    """One monitor interval's new records, published on ``EVENTS_TOPIC`` (best effort)."""

    events: list[EventRecord]


class QueryEvents(RLMessage, kw_only=True):
    """Ask the Monitor for its snapshot (a watcher that joins late)."""


class EventSnapshot(RLMessage, kw_only=True):
    """The latest record of each kind that describes state (job phase, device map, trainer
    phase, latest decision, each role's latest rate) and the recent history (the last steps,
    shift phases and alerts), oldest first: what a late joiner draws the same screen from.
    ``events`` is the record count so far: a batch's records come after it."""

    state: list[EventRecord]
    history: list[EventRecord]
    events: int = 0
