"""Scheduler: the actor that owns one inference role's shared waiting queue.

It wraps ``pivot.planning.routing.RoleScheduler`` (queue, replica table, routing, ledger) and moves
the bytes: prompt and partial output of every sequence it holds, Assign requests to agents,
Finished reports from them, and Completed deliveries to the next stage. Each sequence has one
owner at every moment; the ledger proves it (``check_ownership``).

Shift commands from the Controller (``pivot.actors.shift_messages``), all idempotent:

* ``CutRouting`` / ``RestoreRouting``: a cut replica looks full to the router, so it gets no
  new sequence while what it runs carries on.
* ``RemoveReplica``: shift-down. The agent aborts everything the replica runs (``Evacuate``);
  each sequence goes back to the queue's front and its ``Work`` keeps the partial output, so
  the next dispatch re-prefills prompt + partial; completions the agent had not reported yet
  come back with the partials and are delivered as usual.
* ``MigrateSequences``: rebalance running sequences onto other replicas (abort + dispatch).
* ``QueryLoad``: replicas, what each runs, the queue and the cut set (the Controller's
  monitor and recovery read it). A replica joins through ``RegisterReplica`` as before.

Why nothing is lost or run twice across a removal: Assign requests and aborts to one replica
hold that replica's lock, so an Assign in flight when a removal starts lands before the
abort, and an Assign of sequences the removal already took back is not sent; the agent
answers ``Evacuate`` only after a report it has in flight was answered. A reported completion
of a sequence not running on that replica any more is stale and ignored, never an error: the
removal took it back, or the agent retried a report whose reply it did not get.

``RemoveReplica`` and ``MigrateSequences`` wait on agents, so they run outside the request
slots (``pivot.bus.actor``): however many removals wait on evacuations, the agents' reports
still find a slot. A replica whose Assigns fail ``assign_retries`` times in a row is cut from
routing, with an error logged.

Where a completion goes is fixed by its sequence's ``Work``: to its ``reply_to`` (a user's
process that generates through the job) or, when that is empty, to ``downstream``. Each
destination is retried within ``delivery_retries`` on its own. A failure downstream is the
job's: once the budget is spent the scheduler crashes with one error naming it. A
``reply_to`` is delivered by a task of its own, so one that went away or hangs holds up no
other destination; once its budget is spent its completions are dropped with one error line
and counted (``SchedulerStatus.undeliverable``).

A ``Work.session`` is a routing hint (``RoleScheduler``): the replica that finished the
session's last sequence holds its prefix. ``EndSession`` forgets it; the status counts the
session's dispatches that landed there and elsewhere.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import msgspec

from pivot.actors.messages import (
    Abort,
    Aborted,
    Accepted,
    Ack,
    Assign,
    Completed,
    Completion,
    EndSession,
    Finished,
    Partial,
    QueryStatus,
    RegisterReplica,
    SchedulerStatus,
    SubmitSequences,
    Work,
    copy_ids,
)
from pivot.actors.shift_messages import (
    AgentLost,
    CutRouting,
    Evacuate,
    Evacuated,
    MigrateSequences,
    QueryLoad,
    RegisterReplicas,
    RemoveReplica,
    ReplicaRemoved,
    ReplicaRunning,
    RestoreRouting,
    RoleLoadReport,
)
from pivot.bus import Actor, Bus, BusError, Ping, Pong, RemoteError, handles
from pivot.bus.logs import worth_logging
from pivot.cluster import Role
from pivot.planning.queue import Owner, Sequence, SequenceLedger
from pivot.planning.routing import RoleScheduler, Router
from pivot.retry import RetryBudget


class MigrationTiming(msgspec.Struct, frozen=True, kw_only=True):
    """One migrated sequence, the seed's Table 3 columns: ``abort_s`` to take it off its
    replica with its partial output (the whole evacuation or abort request), ``dispatch_s``
    from then until a new replica accepted it, ``reprefill_s`` for that replica to prefill
    prompt + partial output (0.0 from an engine without a clock)."""

    seq_id: int
    tokens: int  # of partial output carried over
    abort_s: float
    dispatch_s: float
    reprefill_s: float


class Scheduler(Actor):
    """The shared queue of ``role``; finished sequences go to their Work's ``reply_to``, or
    to ``downstream`` when it has none."""

    def __init__(
        self,
        name: str,
        bus: Bus,
        *,
        role: Role,
        router: Router,
        downstream: str,
        ledger: SequenceLedger | None = None,
        request_timeout: float = 30.0,
        controller: str | None = None,
        delivery_retries: RetryBudget | None = None,
        assign_retries: RetryBudget | None = None,
    ) -> None:
        super().__init__(name, bus)
        self.role = role
        self.downstream = downstream
        self.request_timeout = request_timeout
        self.controller = controller
        self.delivery_retries = delivery_retries or RetryBudget()
        self._delivery_failures = 0  # consecutive, downstream's
        # consecutive failed Assigns per replica: when spent, the replica is cut from routing
        self.assign_retries = assign_retries or RetryBudget()
        self._assign_failures: defaultdict[str, int] = defaultdict(int)
        self.stale_reports = 0  # with a sequence no longer running on the replica it names
        self.core = RoleScheduler(role, router, ledger or SequenceLedger())
        self._rows: dict[str, ReplicaRunning] = {}  # QueryLoad's row per replica, as last built
        self._work: dict[int, Work] = {}
        self._agents: dict[str, str] = {}  # replica -> agent actor
        # replica -> the incarnation of the agent instance that registered it: recovery
        # tells an agent that restarted (and lost the replica) from one that released it
        self._agent_incarnations: dict[str, int] = {}
        self._cut: set[str] = set()
        # replicas an Assign failed to reach: routing skips them until their agent answers a
        # Ping or registers again (the Controller's cut is separate: it restores its own)
        self._suspect: dict[str, asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Assigns in flight per replica: their task and the sequences they carry
        self._assigning: defaultdict[str, dict[asyncio.Task[None], set[int]]] = defaultdict(dict)
        # replica -> incarnation: an Assign placed on an earlier one (before a removal and a
        # registration under the same id) must not reach the new one
        self._incarnations: dict[str, int] = {}
        self._added = 0
        # destination -> completions not delivered yet, in order
        self._outbox: dict[str, list[Completion]] = {}
        self._couriers: dict[str, asyncio.Task[None]] = {}  # reply_to -> its delivery task
        self.undeliverable = 0  # completions dropped: their reply_to did not answer
        self._kick = asyncio.Event()
        self.completed = 0
        # migrated sequences: seq -> (abort_s, requeued at, tokens) until a replica accepts
        # them, then seq -> (abort_s, dispatch_s, tokens) until they finish
        self._migrating: dict[int, tuple[float, float, int]] = {}
        self._dispatched: dict[int, tuple[float, float, int]] = {}
        self.migrations: list[MigrationTiming] = []

    # --- replicas -------------------------------------------------------------------------

    def _lock(self, replica: str) -> asyncio.Lock:
        lock = self._locks.get(replica)
        if lock is None:
            lock = self._locks[replica] = asyncio.Lock()
        return lock

    def _update_cut(self) -> None:
        self._cut &= set(self._agents)
        self.core.set_unroutable(self._cut.union(self._suspect))

    @handles
    def register(self, msg: RegisterReplica) -> Ack:
        if msg.role != self.role.value:
            raise ValueError(
                f"replica {msg.replica!r} of role {msg.role!r} registered with the "
                f"{self.role.value} scheduler"
            )
        if msg.replica not in self._agents:
            self.core.add_replica(msg.replica)
            self._added += 1
            self._incarnations[msg.replica] = self._added
        elif not self._same_process(msg):
            self._requeue_lost(msg.replica, set(msg.held))
        self._trust(msg.replica)
        self._agents[msg.replica] = msg.agent
        self._agent_incarnations[msg.replica] = msg.agent_incarnation
        self.core.changed.add(msg.replica)  # its row names the agent
        self._update_cut()
        self.log.info("replica registered", replica=msg.replica, agent=msg.agent)
        self._kick.set()
        return Ack()

    @handles
    def register_together(self, msg: RegisterReplicas) -> Ack:
        for replica in msg.replicas:  # dispatch runs once all are in (it awaits the kick)
            self.register(replica)
        return Ack()

    def _same_process(self, msg: RegisterReplica) -> bool:
        """Whether a registration again comes from the agent process already registered: it
        lost nothing (its ``held`` may be a snapshot from before its latest Assign, as a
        restarted Controller's registration from an Acquire's reply is)."""
        return (
            msg.agent_incarnation != 0
            and self._agents.get(msg.replica) == msg.agent
            and self._agent_incarnations.get(msg.replica) == msg.agent_incarnation
        )

    def _requeue_lost(self, replica: str, held: set[int]) -> None:
        """A replica registered again (its agent restarted in place): what the scheduler
        placed there that the agent does not hold goes back to the queue's front, with the
        partial output its Work kept."""
        # an Assign still on its way may reach the new process: it is not lost (if it fails,
        # the sender puts its sequences back)
        on_the_way = set().union(*self._assigning.get(replica, {}).values())
        lost = [s.id for s in self.core.running_on(replica) if s.id not in held | on_the_way]
        if lost:
            kept = {i: len(self._work[i].generated_ids) for i in lost}
            self.core.abort(replica, lost, kept)
            self.log.warning(
                "requeued what a restarted agent lost", replica=replica, sequences=len(lost)
            )

    @handles
    def cut_routing(self, msg: CutRouting) -> Ack:
        known = msg.replica in self._agents
        if known:
            self._cut.add(msg.replica)
            self._update_cut()
        return Ack(count=int(known))

    @handles
    def restore_routing(self, msg: RestoreRouting) -> Ack:
        known = msg.replica in self._cut
        self._cut.discard(msg.replica)
        self._update_cut()
        self._kick.set()
        return Ack(count=int(known))

    @handles(calls_peers=True)  # waits on the agent's Evacuate
    async def remove_replica(self, msg: RemoveReplica) -> ReplicaRemoved:
        replica = msg.replica
        if replica not in self._agents:
            return ReplicaRemoved(replica=replica, known=False)
        self._cut.add(replica)
        self._update_cut()
        if msg.force:
            # an Assign to a dead agent would hold the lock until it timed out; what it
            # carried is requeued with the rest below
            for task in self._assigning.get(replica, ()):
                task.cancel()
        async with self._lock(replica):
            agent = self._agents.get(replica)
            if agent is None:  # a concurrent removal finished first
                return ReplicaRemoved(replica=replica, known=False)
            evacuated = Evacuated(replica=replica)
            began = self.clock.now()
            if not msg.force:
                # a failure here leaves the replica cut and registered: the Controller retries
                evacuated = await self.request(
                    agent,
                    Evacuate(replica=replica),
                    expect=Evacuated,
                    timeout=self.request_timeout,
                )
            running = {s.id for s in self.core.running_on(replica)}
            done = [c for c in evacuated.completions if c.seq_id in running]
            self._complete(replica, done)
            generated = self._keep_partials(evacuated.partials, running)
            self._mark_migrating(generated, began)
            requeued = self.core.remove_replica(replica, generated)
            del self._agents[replica]
            del self._agent_incarnations[replica]
            del self._incarnations[replica]
            self._locks.pop(replica, None)
            self._trust(replica)
            self._update_cut()
        self.log.info(
            "replica removed",
            replica=replica,
            requeued=len(requeued),
            completed=len(done),
            forced=msg.force,
        )
        self._kick.set()
        return ReplicaRemoved(
            replica=replica, known=True, requeued=len(requeued), completed=len(done)
        )

    def _keep_partials(self, partials: list[Partial], running: set[int]) -> dict[int, int]:
        """Store each aborted sequence's partial output in its Work (tokens, logprobs and
        the policy versions that sampled them): the next replica re-prefills prompt + partial.
        Returns the generated token count per sequence."""
        generated: dict[int, int] = {}
        for partial in partials:
            if partial.seq_id not in running:
                self.log.warning("partial of a sequence not running here", seq_id=partial.seq_id)
                continue
            work = self._work[partial.seq_id]
            self._work[partial.seq_id] = msgspec.structs.replace(
                work,
                generated_ids=copy_ids(partial.token_ids),
                generated_logprobs=list(partial.logprobs),
                generated_chunks=list(partial.chunks),
            )
            generated[partial.seq_id] = len(partial.token_ids)
        return generated

    def _mark_migrating(self, generated: dict[int, int], began: float) -> None:
        now = self.clock.now()
        for seq_id, tokens in generated.items():
            if tokens:
                self._migrating[seq_id] = (now - began, now, tokens)

    @handles(calls_peers=True)  # waits on the agents' Abort
    async def migrate(self, msg: MigrateSequences) -> Ack:
        by_source: dict[str, list] = defaultdict(list)
        for m in msg.migrations:
            by_source[m.source].append(m)
        placed: dict[str, list[Work]] = defaultdict(list)

        async def take_from(source: str, moves: list) -> None:
            agent = self._agents.get(source)
            if agent is None:
                return
            async with self._lock(source):
                if source not in self._agents:
                    return
                running = {s.id for s in self.core.running_on(source)}
                wanted = [
                    m
                    for m in moves
                    if m.seq_id in running
                    and m.target in self._agents
                    and m.target not in self._cut
                    and m.target != source
                ]
                if not wanted:
                    return
                began = self.clock.now()
                reply = await self.request(
                    agent,
                    Abort(seq_ids=[m.seq_id for m in wanted]),
                    expect=Aborted,
                    timeout=self.request_timeout,
                )
                generated = self._keep_partials(reply.partials, running)
                self._mark_migrating(generated, began)
                self.core.abort(source, list(generated), generated)
                for m in wanted:
                    if m.seq_id not in generated:
                        continue  # finished on the agent meanwhile: its report is on the way
                    if m.target in self._agents:
                        d = self.core.dispatch_to(m.seq_id, m.target, now=self.clock.now())
                        placed[d.replica_id].append(self._work[d.seq_id])

        # every source at once: each abort waits for its replica's step in flight. What a
        # source that failed (an abort timed out) took is not lost: the others' sequences
        # are placed, so their Assigns go out before the failure is the reply
        outcomes = await asyncio.gather(
            *(take_from(s, ms) for s, ms in sorted(by_source.items())), return_exceptions=True
        )
        moved = sum(len(ws) for ws in placed.values())
        if placed:
            # the core has placed them: their Assigns are the dispatch loop's kind of work,
            # and a new replica still loading its first sequences answers them late, so the
            # shift waiting on this reply ends without waiting for that (an Assign that fails
            # puts its sequences back, as any other). They go to the replicas' incarnations
            # of now: a forced removal may come before the task runs
            incarnations = {r: self._incarnations[r] for r in placed}
            self.spawn(self._send_assigns(placed, incarnations), name="migrate-assigns")
        self._kick.set()
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return Ack(count=moved)

    @handles
    def load(self, msg: QueryLoad) -> RoleLoadReport:
        changed, rows = self.core.changed, self._rows
        replicas = []
        for replica in self.core.replicas:
            row = rows.get(replica)
            if row is None or replica in changed:
                seqs = self.core.running_on(replica)
                row = rows[replica] = ReplicaRunning(
                    replica=replica,
                    agent=self._agents.get(replica, ""),
                    agent_incarnation=self._agent_incarnations.get(replica, 0),
                    seq_ids=tuple([s.id for s in seqs]),
                    seq_tokens=tuple([s.prompt_tokens + s.generated_tokens for s in seqs]),
                )
            replicas.append(row)
        changed.clear()
        if len(rows) > len(replicas):  # replicas removed since
            self._rows = {row.replica: row for row in replicas}
        return RoleLoadReport(
            role=self.role,
            replicas=replicas,
            queued=len(self.core.queue),
            queued_tokens=int(self.core.queue.tokens),
            cut=sorted(self._cut),
        )

    # --- sequences --------------------------------------------------------------------------

    @handles
    def submit(self, msg: SubmitSequences) -> Accepted:
        # a resent submission (its first reply was lost) is taken once; another sequence
        # under a known id is a caller's bug
        clashes = [
            w.seq_id
            for w in msg.sequences
            if w.seq_id in self._work and self._work[w.seq_id].prompt_ids != w.prompt_ids
        ]
        if clashes:
            raise ValueError(f"other sequences already submitted under ids {clashes[:10]}")
        for work in msg.sequences:
            if work.seq_id in self._work:
                continue
            self._work[work.seq_id] = work
            self.core.submit(
                Sequence(
                    id=work.seq_id,
                    prompt_tokens=len(work.prompt_ids),
                    generated_tokens=len(work.generated_ids),
                    policy_version=work.policy_version,
                    session=work.session,
                    queued_at=self.clock.now(),
                )
            )
        self._kick.set()
        return Accepted(count=len(msg.sequences))

    @handles
    def end_session(self, msg: EndSession) -> Ack:
        return Ack(count=int(self.core.end_session(msg.session)))

    @handles
    def finished(self, msg: Finished) -> Ack:
        if msg.replica not in self._agents:
            # a replica removed by force: its sequences were requeued and run again elsewhere
            self.log.warning(
                "report from a removed replica ignored",
                replica=msg.replica,
                sequences=len(msg.completions),
            )
            return Ack(count=0)
        # a completion of a sequence not running there is stale, not an error: the sequence was
        # taken back (and runs elsewhere), or a retried report repeats one whose reply was lost
        runs = self.core.runs
        fresh = [c for c in msg.completions if runs(msg.replica, c.seq_id)]
        if len(fresh) < len(msg.completions):
            self.stale_reports += 1
            if worth_logging(self.stale_reports):
                self.log.warning(
                    "stale completions ignored",
                    replica=msg.replica,
                    sequences=len(msg.completions) - len(fresh),
                    reports=self.stale_reports,
                )
        self._complete(msg.replica, fresh)
        self._kick.set()
        return Ack(count=len(fresh))

    def _complete(self, replica: str, completions: list[Completion]) -> None:
        for completion in completions:
            seq = self.core.complete(replica, completion.seq_id, len(completion.token_ids))
            if seq.first_wait_s:
                completion = msgspec.structs.replace(completion, queued_s=seq.first_wait_s)
            work = self._work.pop(completion.seq_id, None)
            to = (work.reply_to if work is not None else "") or self.downstream
            self._outbox.setdefault(to, []).append(completion)
            if (moved := self._dispatched.pop(completion.seq_id, None)) is not None:
                abort_s, dispatch_s, tokens = moved
                self.migrations.append(
                    MigrationTiming(
                        seq_id=completion.seq_id,
                        tokens=tokens,
                        abort_s=abort_s,
                        dispatch_s=dispatch_s,
                        reprefill_s=completion.reprefill_s,
                    )
                )
        self.completed += len(completions)

    @handles
    def status(self, msg: QueryStatus) -> SchedulerStatus:
        _, running, _ = self.core.loads()
        return SchedulerStatus(
            role=self.role.value,
            replicas=self.core.replicas,
            queued=len(self.core.queue),
            running=int(running.sum()),
            completed=self.completed,
            undeliverable=self.undeliverable,
            session_hits=self.core.session_hits,
            session_misses=self.core.session_misses,
        )

    async def on_stop(self) -> None:
        core = self.core
        if core.session_hits or core.session_misses or self.undeliverable:
            self.log.info(
                "sessions and replies",
                session_hits=core.session_hits,
                session_misses=core.session_misses,
                sessions=core.sessions,
                undeliverable=self.undeliverable,
            )

    async def run(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            await self._dispatch()
            if self._outbox:
                await self._deliver()

    async def _dispatch(self) -> None:
        placed: dict[str, list[Work]] = defaultdict(list)
        for d in self.core.dispatch(now=self.clock.now()):
            placed[d.replica_id].append(self._work[d.seq_id])
        await self._send_assigns(placed)

    async def _send_assigns(
        self, placed: dict[str, list[Work]], incarnations: dict[str, int] | None = None
    ) -> None:
        """Assign ``placed`` to the ``incarnations`` of its replicas (default: their
        incarnations now): a replica removed since then gets nothing."""
        if incarnations is None:
            incarnations = self._incarnations
        sends = [self._assign(r, ws, incarnations[r]) for r, ws in placed.items()]
        for replica, result in zip(
            placed, await asyncio.gather(*sends, return_exceptions=True), strict=True
        ):
            if isinstance(result, BaseException):
                sent, error = result.args if isinstance(result, _AssignFailed) else ([], result)
                if replica in self._agents and sent:
                    running = {s.id for s in self.core.running_on(replica)}
                    # back to the queue's front: the sequences stay owned, nothing is lost
                    self.core.abort(replica, [i for i in sent if i in running])
                self.log.warning("assign failed", replica=replica, error=repr(error))
                if replica in self._agents and not isinstance(error, RemoteError):
                    # (an agent that answered, if only to refuse, is there)
                    self._suspect_replica(replica, repr(error))
                self._kick.set()
                failures = self._assign_failures[replica] = self._assign_failures[replica] + 1
                if self.assign_retries.spent(failures) and replica in self._agents:
                    # the sequences would go back to it at once: route around it until the
                    # Controller restores or removes it
                    self._cut.add(replica)
                    self._update_cut()
                    self.log.error(
                        "assigns keep failing: replica cut from routing",
                        replica=replica,
                        failures=failures,
                        error=repr(error),
                    )
            else:
                self._assign_failures.pop(replica, None)

    # Pings to a replica whose agent did not answer, after 0.5, 1, 2, 4, 8, 8... s: ~3.5 min,
    # then the replica waits for its agent to register again
    PROBES = RetryBudget(attempts=30)

    def _suspect_replica(self, replica: str, cause: str) -> None:
        if replica in self._suspect:
            return
        self._suspect[replica] = self.spawn(self._probe(replica, cause), name=f"probe:{replica}")
        self._update_cut()

    def _trust(self, replica: str) -> None:
        probe = self._suspect.pop(replica, None)
        if probe is not None and probe is not asyncio.current_task():
            probe.cancel()

    async def _probe(self, replica: str, cause: str) -> None:
        """Until the replica's agent answers a Ping, route nothing to it; tell the Controller,
        which takes a dead agent's replica out (its sequences come back to the queue)."""
        agent = self._agents[replica]
        if self.controller is not None:
            try:
                await self.request(
                    self.controller,
                    AgentLost(agent=agent, cause=cause),
                    timeout=self.request_timeout,
                )
            except BusError as exc:
                self.log.warning("could not tell the controller", error=repr(exc))
        for failures in range(1, self.PROBES.attempts + 1):
            await self.clock.sleep(self.PROBES.backoff(failures))
            if self._agents.get(replica) != agent:
                return  # removed or registered again meanwhile
            try:
                await self.request(agent, Ping(), expect=Pong, timeout=self.request_timeout)
            except BusError:
                continue
            self.log.info("replica answers again", replica=replica)
            self._trust(replica)
            self._update_cut()
            self._kick.set()
            return
        self.log.error(
            "replica unreachable; no routing to it until its agent registers again",
            replica=replica,
            probes=self.PROBES.attempts,
        )

    async def _assign(self, replica: str, works: list[Work], incarnation: int) -> None:
        task = asyncio.current_task()
        assert task is not None
        assigning = self._assigning[replica]
        assigning[task] = {w.seq_id for w in works}
        try:
            await self._assign_now(replica, works, incarnation)
        finally:
            del assigning[task]

    async def _assign_now(self, replica: str, works: list[Work], incarnation: int) -> None:
        async with self._lock(replica):
            if self._incarnations.get(replica) != incarnation:
                return  # removed meanwhile: the removal took these sequences back
            # still on this replica (not taken back meanwhile): the ledger knows at once
            here, owner = Owner.replica(replica), self.core.ledger.owner
            works = [w for w in works if owner(w.seq_id) == here]
            if not works:
                return
            try:
                await self.request(
                    self._agents[replica], Assign(sequences=works), timeout=self.request_timeout
                )
            except BusError as exc:
                raise _AssignFailed([w.seq_id for w in works], exc) from exc
            if self._migrating:
                now = self.clock.now()
                for w in works:
                    if (moved := self._migrating.pop(w.seq_id, None)) is not None:
                        abort_s, requeued_at, tokens = moved
                        self._dispatched[w.seq_id] = (abort_s, now - requeued_at, tokens)

    async def _deliver(self) -> None:
        """Downstream's completions here, in the loop; each reply_to's by its courier."""
        outbox = self._outbox
        for to in outbox:
            if to != self.downstream and to not in self._couriers:
                self._couriers[to] = self.spawn(self._courier(to), name=f"deliver:{to}")
        batch = outbox.pop(self.downstream, None)
        if batch is None:
            return
        try:
            await self._send_completed(self.downstream, batch)
        except BusError as exc:
            outbox[self.downstream] = batch + outbox.get(self.downstream, [])
            self._delivery_failures += 1
            budget = self.delivery_retries
            if budget.spent(self._delivery_failures):
                what = f"{self.name}: delivering {len(batch)} completions to {self.downstream!r}"
                raise budget.exhausted(what, exc) from exc
            self.log.warning("delivery failed, will retry", error=repr(exc), pending=len(batch))
            await self.clock.sleep(budget.backoff(self._delivery_failures))
            self._kick.set()
            return
        self._delivery_failures = 0

    async def _courier(self, to: str) -> None:
        """Deliver what ``to`` is owed until nothing is left. A reply_to is a user's actor,
        not the job's: once its budget is spent, what it is owed is dropped, not fatal."""
        budget, failures = self.delivery_retries, 0
        try:
            while (batch := self._outbox.pop(to, None)) is not None:
                try:
                    await self._send_completed(to, batch)
                except BusError as exc:
                    batch += self._outbox.pop(to, [])
                    failures += 1
                    if budget.spent(failures):
                        self.undeliverable += len(batch)
                        self.log.error(
                            "completions dropped: their reply_to does not answer",
                            destination=to,
                            sequences=len(batch),
                            attempts=failures,
                            error=repr(exc),
                        )
                        return
                    self._outbox[to] = batch
                    self.log.warning(
                        "delivery failed, will retry",
                        destination=to,
                        error=repr(exc),
                        pending=len(batch),
                    )
                    await self.clock.sleep(budget.backoff(failures))
                else:
                    failures = 0
        finally:
            self._couriers.pop(to, None)

    async def _send_completed(self, to: str, batch: list[Completion]) -> None:
        await self.request(
            to, Completed(role=self.role.value, completions=batch), timeout=self.request_timeout
        )

    def outstanding(self) -> int:
        return len(self._work)

    @property
    def routes(self) -> dict[str, str]:
        """Registered replicas and the agent of each."""
        return dict(self._agents)

    @property
    def cut(self) -> frozenset[str]:
        """Replicas routing is cut from."""
        return frozenset(self._cut)


class _AssignFailed(Exception):
    """An Assign that did not arrive: args are (sequence ids sent, the bus error)."""
