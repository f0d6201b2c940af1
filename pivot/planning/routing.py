"""Routing from a role's shared waiting queue to its replicas, and the role scheduler core.

One protocol, ``Router``, three small rules:

* ``ThroughputOptimalRouter`` (rollout): the replica whose throughput T = running / ITL gains
  most from one more sequence; admitted only if that gain is at least
  ``delta_throughput_threshold`` x 1/ITL(1, sequence length) and the replica is under its cap.
* ``LowestItlRouter`` (reward): the smallest (ITL(load + 1), load, position), under the cap.
* ``RoundRobinRouter`` (baselines): the next replica in turn that is under its cap.

Under any rule a role may **protect** the replicas that decode its oldest sequences
(``RouterSettings.protect_after_s``): a replica holding a sequence dispatched at least that
long ago, among the oldest ``protect_share`` of the replicas, takes no new sequence. A sequence
still running long after its dispatch is likely one of its batch's last, which set when the
batch is scored; on a protected replica it no longer stalls for newcomers' prefills (a
judgment's prompt holds its whole response, and the engine prefills it before the batch's
next decode) nor decodes among them. Measured on the simulated 1.5B group, whose GenRM
prefills slowly (PivotRL, 128 devices): a judgment of 14k+ tokens stayed on its replica 1.30x
as long as it decodes alone, half of the excess in others' prefills. Protecting the reward
role's replicas gains 5.0% / 2.5% (seeds 0 / 1, 63 steps) at Table 4's split and +0.6% /
-0.2% at the sweep's best (shared96/pool32): PivotRL holds up on a split nobody tuned.

Each rule routes one sequence (``choose``) and scores, for a batch of sequences of one mean
length, each (replica, k-th more sequence) slot (``slot_scores``). With one cost model per
role, every rule's scores fall as a replica fills, so routing the batch one sequence at a
time hands out the batch's highest slot scores: ``place_many`` and the planner's simulation
route thousands of sequences with numpy instead of a Python loop per sequence.

``RoleScheduler`` is the pure core of a Scheduler actor: the queue, the replica table, the
router, Abort (sequences leave a replica with their partial output and go to the front of
the queue) and Dispatch (a receiver re-prefills prompt + partial output; counted). It also
keeps session affinity: the replica that last finished a sequence of a multi-turn session
holds that session's prefix in its cache, so the session's next sequence goes there when the
replica is routable and under the router's cap, and is routed as any other when not (a hint,
never a wait).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, Protocol

import msgspec
import numpy as np

from pivot.cluster import Role
from pivot.config import ConfigStruct, NonNegativeFloat, PositiveInt, UnitInterval
from pivot.planning.cost import CostModel
from pivot.planning.queue import Owner, Sequence, SequenceLedger, WaitingQueue

RouterPolicy = Literal["throughput_optimal", "lowest_itl", "round_robin"]


class RouterSettings(ConfigStruct, kw_only=True):
    policy: RouterPolicy
    delta_throughput_threshold: NonNegativeFloat = 0.2
    max_concurrent_per_replica: PositiveInt = 512
    # protect the replicas decoding the oldest sequences (the module docstring): a replica
    # whose oldest sequence was dispatched at least this many seconds ago (0: never), among
    # the oldest ``protect_share`` of the role's replicas, takes no new sequence
    protect_after_s: NonNegativeFloat = 0.0
    protect_share: UnitInterval = 0.25


#: a role protects the replicas of its oldest sequences where a newcomer's prefill stalls a
#: replica's batch for at least this many decode iterations of one sequence alone (measured on
#: the simulated groups: 79 for the 1.5B group's GenRM, whose protection gains, 13-18 for the
#: others', whose protection gains nothing or loses 1%)
PROTECT_STALL_ITERATIONS = 32.0
#: a sequence still running this long after its dispatch is taken for one of its batch's last
#: (the 1.5B group gains the same 5% at 20 s and at 40 s)
PROTECT_AFTER_S = 20.0


# The paper launchers' router settings (reference/paper-notes.md, section 2.5)
ROLLOUT_ROUTER = RouterSettings(
    policy="throughput_optimal", delta_throughput_threshold=0.2, max_concurrent_per_replica=512
)
REWARD_ROUTER = RouterSettings(
    policy="lowest_itl", delta_throughput_threshold=0.005, max_concurrent_per_replica=128
)


class Router(Protocol):
    settings: RouterSettings
    model: CostModel

    def choose(self, running: np.ndarray, tokens: np.ndarray, seq_tokens: float) -> int:
        """Index of the replica for one sequence of ``seq_tokens`` tokens, or -1: stay queued."""
        ...

    def slot_scores(
        self, running: np.ndarray, tokens: np.ndarray, k_max: int, mean_tokens: float
    ) -> np.ndarray:
        """How much the rule wants to give each replica its k-th more sequence, k = 1..k_max.

        A (replicas, k_max) array that never rises along a row, -inf where the rule would
        not admit. Routing n sequences of ``mean_tokens`` one at a time hands out the n
        highest scores, which is what ``place_many`` and the planner's simulation rely on.
        """
        ...


def _grid(
    running: np.ndarray, tokens: np.ndarray, k_max: int, mean_tokens: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ks = np.arange(1, k_max + 1)
    rr = running[:, None] + ks[None, :]
    tt = tokens[:, None] + ks[None, :] * mean_tokens
    return ks, rr, tt


def _over_cap(running: np.ndarray, ks: np.ndarray, cap: int) -> np.ndarray:
    return running[:, None] + ks[None, :] > cap


class ThroughputOptimalRouter:
    def __init__(self, settings: RouterSettings, model: CostModel) -> None:
        self.settings = settings
        self.model = model

    def _floor(self, seq_tokens: float) -> float:
        return self.settings.delta_throughput_threshold / self.model.itl_one(1, seq_tokens)

    def choose(self, running: np.ndarray, tokens: np.ndarray, seq_tokens: float) -> int:
        if running.size == 0:
            return -1
        m = self.model
        gain = m.throughput(running + 1, tokens + seq_tokens) - m.throughput(running, tokens)
        gain = np.where(running < self.settings.max_concurrent_per_replica, gain, -np.inf)
        best = int(np.argmax(gain))
        return best if gain[best] >= self._floor(seq_tokens) and np.isfinite(gain[best]) else -1

    def slot_scores(
        self, running: np.ndarray, tokens: np.ndarray, k_max: int, mean_tokens: float
    ) -> np.ndarray:
        ks, rr, tt = _grid(running, tokens, k_max, mean_tokens)
        t_k = self.model.throughput(rr, tt)
        t_prev = np.empty_like(t_k)
        t_prev[:, 0] = self.model.throughput(running, tokens)
        t_prev[:, 1:] = t_k[:, :-1]
        gain = t_k - t_prev
        refused = (gain < self._floor(mean_tokens)) | _over_cap(
            running, ks, self.settings.max_concurrent_per_replica
        )
        gain[refused] = -np.inf
        return gain


class LowestItlRouter:
    def __init__(self, settings: RouterSettings, model: CostModel) -> None:
        self.settings = settings
        self.model = model

    def choose(self, running: np.ndarray, tokens: np.ndarray, seq_tokens: float) -> int:
        open_ = running < self.settings.max_concurrent_per_replica
        if not open_.any():
            return -1
        idx = np.flatnonzero(open_)
        itl_next = self.model.itl(running[idx] + 1, tokens[idx] + seq_tokens)
        # ties on ITL go to the lighter load, then the lower position (a lexsort's first, by
        # two minima instead of a sort per sequence)
        best = idx[itl_next == itl_next.min()]
        if best.size > 1:
            load = running[best]
            best = best[load == load.min()]
        return int(best[0])

    def slot_scores(
        self, running: np.ndarray, tokens: np.ndarray, k_max: int, mean_tokens: float
    ) -> np.ndarray:
        ks, rr, tt = _grid(running, tokens, k_max, mean_tokens)
        score = -self.model.itl(rr, tt)
        score[_over_cap(running, ks, self.settings.max_concurrent_per_replica)] = -np.inf
        return score


class RoundRobinRouter:
    def __init__(self, settings: RouterSettings, model: CostModel) -> None:
        self.settings = settings
        self.model = model
        self._turn = 0

    def choose(self, running: np.ndarray, tokens: np.ndarray, seq_tokens: float) -> int:
        n = running.size
        for step in range(n):
            i = (self._turn + step) % n
            if running[i] < self.settings.max_concurrent_per_replica:
                self._turn = i + 1
                return i
        return -1

    def slot_scores(
        self, running: np.ndarray, tokens: np.ndarray, k_max: int, mean_tokens: float
    ) -> np.ndarray:
        ks = np.arange(1, k_max + 1)
        # everyone's k-th turn comes before anyone's (k+1)-th; within a round, by position
        n = running.size
        score = -(ks[None, :] * n + np.arange(n)[:, None]).astype(np.float64)
        score[_over_cap(running, ks, self.settings.max_concurrent_per_replica)] = -np.inf
        return score


def protecting(
    settings: RouterSettings, model: CostModel, prompt_tokens: float, prefill_tokens_per_s: float
) -> RouterSettings:
    """``settings`` with the oldest sequences' replicas protected (``PROTECT_AFTER_S``) where a
    prompt of ``prompt_tokens`` (a role's mean) stalls the batch that long
    (``PROTECT_STALL_ITERATIONS``); unchanged elsewhere."""
    stall_s = prompt_tokens / prefill_tokens_per_s
    if stall_s < PROTECT_STALL_ITERATIONS * model.itl_one(1, prompt_tokens):
        return settings
    return msgspec.structs.replace(settings, protect_after_s=PROTECT_AFTER_S)


def place_many(
    router: Router, running: np.ndarray, tokens: np.ndarray, count: int, mean_tokens: float
) -> np.ndarray:
    """How many of ``count`` sequences (each ``mean_tokens`` long) each replica admits.

    The batch form of calling ``choose`` ``count`` times: the ``count`` highest slot scores.
    """
    n = np.zeros(running.size, dtype=np.int64)
    if running.size == 0 or count <= 0:
        return n
    score = router.slot_scores(running, tokens, count, mean_tokens)
    flat = score.ravel()
    eligible = np.flatnonzero(np.isfinite(flat))
    if eligible.size > count:
        eligible = eligible[np.argsort(-flat[eligible], kind="stable")[:count]]
    return np.bincount(eligible // count, minlength=running.size)


def make_router(settings: RouterSettings, model: CostModel) -> Router:
    match settings.policy:
        case "throughput_optimal":
            return ThroughputOptimalRouter(settings, model)
        case "lowest_itl":
            return LowestItlRouter(settings, model)
        case "round_robin":
            return RoundRobinRouter(settings, model)
    raise ValueError(f"unknown router policy {settings.policy!r}")


class Dispatch(msgspec.Struct, frozen=True):
    """A sequence sent to a replica; ``prefill_tokens`` is what the replica must prefill."""

    seq_id: int
    replica_id: str
    prefill_tokens: int
    reprefill: bool  # True when the sequence carries a partial output from an aborted run


# sessions remembered per role at most: sessions end (``end_session``), but a user that never
# says so must not grow the map without bound; the least recently served go first
MAX_SESSIONS = 100_000


class RoleScheduler:
    """The pure core of one role's Scheduler: shared queue, replica table, routing, migration.

    Every change of a sequence's holder goes through the shared ``SequenceLedger``, so
    ``check_ownership`` can prove after any event that nothing was lost or duplicated.
    """

    def __init__(
        self,
        role: Role,
        router: Router,
        ledger: SequenceLedger,
        *,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self.role = role
        self.router = router
        self.ledger = ledger
        self.max_sessions = max_sessions
        self.queue = WaitingQueue(role)
        self._owner = Owner.queue(role)
        self._running: dict[str, dict[int, Sequence]] = {}
        self._ids: list[str] = []
        self._load = np.zeros(0, dtype=np.int64)
        self._tokens = np.zeros(0, dtype=np.float64)
        # when each replica's oldest running sequence was placed (inf: it runs none), kept
        # as sequences come and go: protection reads it at every dispatch, and a scan of
        # every replica's sequences there made dispatch O(replicas) in Python
        self._oldest = np.zeros(0, dtype=np.float64)
        self._pos: dict[str, int] = {}
        self.reprefill_tokens = 0
        self.reprefills = 0
        self.aborts = 0
        # replicas routing skips (cut, suspect): they look full to the router, so it sends
        # them nothing new while what they run carries on; per replica (sorted ids), or None
        self._unroutable: frozenset[str] = frozenset()
        self._closed: np.ndarray | None = None
        # session -> the replica that last finished one of its sequences, least recent first
        self._affinity: dict[str, str] = {}
        # replica -> the sessions it is remembered for (so a removal forgets them without a
        # scan of every session; the affinity map holds up to ``max_sessions``)
        self._sessions_on: dict[str, set[str]] = {}
        # dispatches of a session with a remembered replica: landed there / elsewhere
        self.session_hits = 0
        self.session_misses = 0
        # replicas whose running sequences changed (or that came or went) since the owner
        # last cleared this set: a load report rebuilds only their rows
        self.changed: set[str] = set()

    # --- replicas -----------------------------------------------------------------------

    def _reindex(self, *, carry: bool = False) -> None:
        """Rebuild the replica table from what the replicas hold; with ``carry``, the token
        totals of the replicas that stay are carried over instead of summed again (a shift
        re-indexes every replica: summing what each runs made a shift O(sequences); the
        totals are integers in float64, so carried and summed agree exactly)."""
        carried = (
            {rid: self._tokens[i] for rid, i in self._pos.items() if rid in self._running}
            if carry
            else {}
        )
        self._ids = sorted(self._running)
        self._pos = {rid: i for i, rid in enumerate(self._ids)}
        self._load = np.array([len(self._running[r]) for r in self._ids], dtype=np.int64)
        self._tokens = np.array(
            [
                carried[r] if r in carried else sum(s.tokens for s in self._running[r].values())
                for r in self._ids
            ],
            dtype=np.float64,
        )
        self._oldest = np.array([self._first_placed(r) for r in self._ids], dtype=np.float64)
        self._remask()

    def _first_placed(self, replica_id: str) -> float:
        # held keeps dispatch order: its first sequence is its oldest
        held = self._running[replica_id]
        return next(iter(held.values())).placed_at if held else np.inf

    def _remask(self) -> None:
        if self._unroutable.isdisjoint(self._pos):
            self._closed = None
        else:
            self._closed = np.array([r in self._unroutable for r in self._ids])

    def set_unroutable(self, replicas: Iterable[str]) -> None:
        """Route nothing new to these replicas (cut or suspect) until set again without them."""
        self._unroutable = frozenset(replicas)
        self._remask()

    @property
    def replicas(self) -> list[str]:
        return list(self._ids)

    def add_replica(self, replica_id: str) -> None:
        if replica_id in self._running:
            raise ValueError(f"{self.role.value} replica {replica_id!r} is already registered")
        self._running[replica_id] = {}
        self.changed.add(replica_id)
        self._reindex(carry=True)

    def remove_replica(
        self, replica_id: str, generated: Mapping[int, int] | None = None
    ) -> list[Sequence]:
        """Shift-down: abort everything the replica runs, then forget the replica."""
        aborted = self.abort(replica_id, None, generated)
        del self._running[replica_id]
        self._reindex(carry=True)
        # its cache is gone with it (a replica registered later under this id starts cold)
        for session in self._sessions_on.pop(replica_id, ()):
            del self._affinity[session]
        return aborted

    def running_on(self, replica_id: str) -> list[Sequence]:
        return list(self._replica(replica_id).values())

    def runs(self, replica_id: str, seq_id: int) -> bool:
        """Whether the sequence is running on the replica (without listing what it runs)."""
        return seq_id in self._replica(replica_id)

    def loads(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """Replica ids (sorted) with their running counts and token totals."""
        return list(self._ids), self._load.copy(), self._tokens.copy()

    def _replica(self, replica_id: str) -> dict[int, Sequence]:
        try:
            return self._running[replica_id]
        except KeyError:
            raise KeyError(f"no {self.role.value} replica {replica_id!r}") from None

    # --- sequences ----------------------------------------------------------------------

    def submit(self, seq: Sequence) -> None:
        """A new sequence enters the role: the ledger learns it, the queue's back holds it."""
        self.ledger.submit(seq.id, self._owner)
        self.queue.push(seq)

    def accept(self, seq: Sequence) -> None:
        """A known sequence handed over from elsewhere (say, a rollout becoming a GenRM prompt)."""
        self.ledger.move(seq.id, self._owner)
        self.queue.push(seq)

    def _place(self, seq: Sequence, replica_id: str, now: float) -> Dispatch:
        i = self._pos[replica_id]
        held = self._running[replica_id]
        if not held:
            self._oldest[i] = now
        held[seq.id] = seq
        self.changed.add(replica_id)
        self._load[i] += 1
        self._tokens[i] += seq.tokens
        seq.placed_at = now
        if seq.first_wait_s is None and seq.queued_at is not None:
            seq.first_wait_s = max(now - seq.queued_at, 0.0)
        self.ledger.move(seq.id, Owner.replica(replica_id), expect=self._owner)
        reprefill = seq.attempts > 0
        if reprefill:
            self.reprefills += 1
            self.reprefill_tokens += seq.tokens
        return Dispatch(seq.id, replica_id, seq.tokens, reprefill)

    def protected(self, now: float) -> np.ndarray | None:
        """Which replicas (positions) take no new sequence at ``now`` because they decode the
        role's oldest sequences (the module docstring), or None when none does."""
        settings = self.router.settings
        after = settings.protect_after_s
        most = int(settings.protect_share * len(self._ids))
        if after <= 0 or most < 1:
            return None
        old = np.flatnonzero(now - self._oldest >= after)
        if not old.size:
            return None
        if old.size > most:  # the oldest first, ties in replica order (a stable sort)
            old = old[np.argsort(self._oldest[old], kind="stable")[:most]]
        mask = np.zeros(len(self._ids), dtype=bool)
        mask[old] = True
        return mask

    def dispatch(self, limit: int | None = None, *, now: float = 0.0) -> list[Dispatch]:
        """Route from the queue's head while the router admits (at most ``limit``); ``now``
        stamps the placements and decides which replicas are protected.

        Stops at the first sequence the router leaves queued, so the queue's order (aborted
        first, then FIFO) is also the order of service. A session's sequence goes to the
        replica of its last turn when that one is routable and under the cap.
        """
        sent: list[Dispatch] = []
        cap = self.router.settings.max_concurrent_per_replica
        closed = self._closed
        # with nothing queued nothing is routed: protection is not worked out
        protected = self.protected(now) if len(self.queue) else None
        if protected is not None:
            closed = protected if closed is None else closed | protected
        while limit is None or len(sent) < limit:
            seq = self.queue.peek()
            if seq is None:
                break
            i = self._hinted(seq.session, cap) if seq.session else -1
            if i >= 0:
                self.session_hits += 1
            else:
                load = self._load if closed is None else np.where(closed, cap, self._load)
                i = self.router.choose(load, self._tokens, seq.tokens)
                if i < 0:
                    break
                if seq.session and seq.session in self._affinity:
                    self.session_misses += 1
            self.queue.pop()
            sent.append(self._place(seq, self._ids[i], now))
        return sent

    def _hinted(self, session: str, cap: int) -> int:
        """The position of the session's remembered replica if it can take one more, else -1."""
        replica = self._affinity.get(session)
        if replica is None:
            return -1
        i = self._pos[replica]  # a removed replica's sessions are forgotten
        closed = self._closed
        return i if self._load[i] < cap and (closed is None or not closed[i]) else -1

    def dispatch_to(self, seq_id: int, replica_id: str, *, now: float = 0.0) -> Dispatch:
        """Send one queued sequence to a chosen replica (a planned migration's destination),
        stamped ``now``."""
        self._replica(replica_id)
        return self._place(self.queue.remove(seq_id), replica_id, now)

    def abort(
        self,
        replica_id: str,
        seq_ids: Iterable[int] | None = None,
        generated: Mapping[int, int] | None = None,
    ) -> list[Sequence]:
        """Take sequences off a replica, keeping their partial output, to the queue's front.

        ``generated`` carries the engine's final token counts for the aborted sequences.
        """
        held = self._replica(replica_id)
        ids = list(held) if seq_ids is None else list(seq_ids)
        i = self._pos[replica_id]
        self.changed.add(replica_id)
        out: list[Sequence] = []
        for seq_id in ids:
            seq = held.pop(seq_id, None)
            if seq is None:
                raise KeyError(f"sequence {seq_id} is not running on {replica_id!r}")
            self._load[i] -= 1
            self._tokens[i] -= seq.tokens
            if generated is not None and seq_id in generated:
                seq.generated_tokens = generated[seq_id]
            seq.attempts += 1
            self.ledger.move(seq_id, self._owner, expect=Owner.replica(replica_id))
            self.queue.push_aborted(seq)
            out.append(seq)
        self._oldest[i] = self._first_placed(replica_id)
        self.aborts += len(out)
        return out

    def progress(self, replica_id: str, seq_id: int, generated_tokens: int) -> None:
        seq = self._replica(replica_id)[seq_id]
        self.changed.add(replica_id)
        self._tokens[self._pos[replica_id]] += generated_tokens - seq.generated_tokens
        seq.generated_tokens = generated_tokens

    def _leave(self, replica_id: str, seq_id: int, generated_tokens: int | None) -> Sequence:
        """The sequence finished on its replica: off the replica, which its session remembers."""
        held = self._replica(replica_id)
        seq = held.pop(seq_id, None)
        if seq is None:
            raise KeyError(f"sequence {seq_id} is not running on {replica_id!r}")
        self.changed.add(replica_id)
        i = self._pos[replica_id]
        self._load[i] -= 1
        self._tokens[i] -= seq.tokens
        self._oldest[i] = self._first_placed(replica_id)
        if generated_tokens is not None:
            seq.generated_tokens = generated_tokens
        if seq.session:
            self._remember(seq.session, replica_id)
        return seq

    # --- sessions -----------------------------------------------------------------------

    def _remember(self, session: str, replica_id: str) -> None:
        affinity = self._affinity
        self._forget(session)  # re-inserted: now the most recently served
        affinity[session] = replica_id
        self._sessions_on.setdefault(replica_id, set()).add(session)
        if len(affinity) > self.max_sessions:
            self._forget(next(iter(affinity)))

    def _forget(self, session: str) -> str | None:
        replica = self._affinity.pop(session, None)
        if replica is not None:
            self._sessions_on[replica].discard(session)
        return replica

    def session_replica(self, session: str) -> str | None:
        """The replica the session's next sequence is routed toward, if any."""
        return self._affinity.get(session)

    def end_session(self, session: str) -> bool:
        """Forget the session's replica; False when it had none (unknown, or forgotten)."""
        return self._forget(session) is not None

    @property
    def sessions(self) -> int:
        return len(self._affinity)

    def complete(
        self, replica_id: str, seq_id: int, generated_tokens: int | None = None
    ) -> Sequence:
        """The sequence finished on its replica and is done."""
        seq = self._leave(replica_id, seq_id, generated_tokens)
        self.ledger.finish(seq_id, expect=Owner.replica(replica_id))
        return seq

    def hand_over(
        self,
        replica_id: str,
        seq_id: int,
        to: RoleScheduler,
        as_seq: Sequence | None = None,
    ) -> Sequence:
        """The sequence finished here and enters ``to``'s queue (as ``as_seq`` if given)."""
        seq = self._leave(replica_id, seq_id, None)
        nxt = seq if as_seq is None else as_seq
        if nxt.id != seq_id:
            raise ValueError(f"hand-over keeps the sequence id: {seq_id} became {nxt.id}")
        to.accept(nxt)
        return nxt

    # --- invariants ---------------------------------------------------------------------

    def holdings(self) -> dict[Owner, list[int]]:
        held = {Owner.replica(r): list(seqs) for r, seqs in self._running.items()}
        held[self._owner] = self.queue.ids()
        return held

    def check_invariants(self) -> None:
        """This role's own bookkeeping: cached loads match what the replicas hold."""
        for rid, seqs in self._running.items():
            i = self._pos[rid]
            tokens = sum(s.tokens for s in seqs.values())
            if self._load[i] != len(seqs) or self._tokens[i] != tokens:
                raise AssertionError(
                    f"{self.role.value} replica {rid!r}: cached load {self._load[i]} / "
                    f"{self._tokens[i]} tokens, holds {len(seqs)} / {tokens}"
                )
        if self.queue.tokens != sum(s.tokens for s in self.queue):
            raise AssertionError(f"{self.role.value} queue token total is out of date")


def check_ownership(ledger: SequenceLedger, *schedulers: RoleScheduler) -> None:
    """The whole-system check: every live sequence held exactly once, by its ledger owner."""
    holdings: dict[Owner, list[int]] = {}
    for scheduler in schedulers:
        scheduler.check_invariants()
        for owner, ids in scheduler.holdings().items():
            holdings.setdefault(owner, []).extend(ids)
    ledger.check_invariants(holdings)
