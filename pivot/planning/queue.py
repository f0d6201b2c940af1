"""Sequences, the shared waiting queue of a role, and the ledger of who owns each sequence.

The waiting queue hands out aborted sequences first (they already hold generated tokens and
were interrupted by a shift or a rebalance), then new ones in arrival order. Every sequence
has exactly one owner at all times: a role's queue, a replica, or done. The ledger records
that owner; ``SequenceLedger.check_invariants`` compares it with what queues and replicas
actually hold and names every lost or duplicated sequence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal

import msgspec

from pivot.cluster import Role


class Sequence(msgspec.Struct, kw_only=True):
    """One sequence of a role: its prompt, what it generated so far, how often it was aborted."""

    id: int
    prompt_tokens: int
    generated_tokens: int = 0
    policy_version: int = 0
    attempts: int = 0  # aborts survived; > 0 means the next dispatch re-prefills
    session: str = ""  # a multi-turn session's id: routing prefers the replica of its last turn
    placed_at: float = 0.0  # when it was last dispatched to a replica (the scheduler's clock)
    # when it joined its role's queue (None: not said), and how long it waited there before
    # its first dispatch (None: not dispatched yet, or not said when it joined)
    queued_at: float | None = None
    first_wait_s: float | None = None

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


class WaitingQueue:
    """A role's shared waiting queue: aborted sequences first (FIFO among them), then FIFO."""

    def __init__(self, role: Role) -> None:
        self.role = role
        self._aborted: deque[tuple[int, int]] = deque()
        self._fresh: deque[tuple[int, int]] = deque()
        # id -> (sequence, generation); deque entries of an older generation are stale,
        # which makes remove() O(1) without scanning the deques
        self._members: dict[int, tuple[Sequence, int]] = {}
        self._generation = 0
        self.tokens = 0  # prompt + generated tokens of everything queued

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._members

    def _add(self, seq: Sequence, lane: deque[tuple[int, int]]) -> None:
        if seq.id in self._members:
            raise ValueError(f"sequence {seq.id} is already in the {self.role.value} queue")
        self._generation += 1
        self._members[seq.id] = (seq, self._generation)
        lane.append((seq.id, self._generation))
        self.tokens += seq.tokens

    def push(self, seq: Sequence) -> None:
        """A new sequence: to the back."""
        self._add(seq, self._fresh)

    def push_aborted(self, seq: Sequence) -> None:
        """An aborted sequence (keeps its partial output): ahead of every new one."""
        self._add(seq, self._aborted)

    def _head(self) -> tuple[deque[tuple[int, int]], Sequence] | None:
        for lane in (self._aborted, self._fresh):
            while lane:
                seq_id, generation = lane[0]
                member = self._members.get(seq_id)
                if member is not None and member[1] == generation:
                    return lane, member[0]
                lane.popleft()  # stale: removed, or re-queued since
        return None

    def peek(self) -> Sequence | None:
        head = self._head()
        return None if head is None else head[1]

    def pop(self) -> Sequence:
        head = self._head()
        if head is None:
            raise IndexError(f"the {self.role.value} queue is empty")
        lane, seq = head
        lane.popleft()
        del self._members[seq.id]
        self.tokens -= seq.tokens
        return seq

    def remove(self, seq_id: int) -> Sequence:
        member = self._members.pop(seq_id, None)
        if member is None:
            raise KeyError(f"sequence {seq_id} is not in the {self.role.value} queue")
        self.tokens -= member[0].tokens
        return member[0]

    def __iter__(self) -> Iterator[Sequence]:
        """Sequences in dispatch order."""
        for lane in (self._aborted, self._fresh):
            for seq_id, generation in lane:
                member = self._members.get(seq_id)
                if member is not None and member[1] == generation:
                    yield member[0]

    def ids(self) -> list[int]:
        return [seq.id for seq in self]


class Owner(msgspec.Struct, frozen=True):
    """Who holds a sequence: a role's queue (``name`` = role), a replica (``name`` = id), done."""

    kind: Literal["queue", "replica", "done"]
    name: str = ""

    @classmethod
    def queue(cls, role: Role) -> Owner:
        return cls("queue", role.value)

    @classmethod
    def replica(cls, replica_id: str) -> Owner:
        return cls("replica", replica_id)

    def __str__(self) -> str:
        return "done" if self.kind == "done" else f"{self.kind}:{self.name}"


DONE = Owner("done")


class OwnershipError(AssertionError):
    """A sequence was lost, duplicated, or held by someone the ledger does not name."""


class SequenceLedger:
    """Who owns every sequence ever submitted; moves are checked against the current owner."""

    def __init__(self) -> None:
        self._owner: dict[int, Owner] = {}
        self._held: dict[Owner, set[int]] = {}
        self.done = 0

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._owner

    def owner(self, seq_id: int) -> Owner:
        try:
            return self._owner[seq_id]
        except KeyError:
            raise OwnershipError(f"sequence {seq_id} was never submitted") from None

    def held_by(self, owner: Owner) -> frozenset[int]:
        return frozenset(self._held.get(owner, ()))

    def submit(self, seq_id: int, owner: Owner) -> None:
        if seq_id in self._owner:
            raise OwnershipError(
                f"sequence {seq_id} submitted twice (already owned by {self._owner[seq_id]})"
            )
        self._set(seq_id, owner)

    def move(self, seq_id: int, to: Owner, *, expect: Owner | None = None) -> None:
        """Hand ``seq_id`` to ``to``; with ``expect``, fail unless that is the current owner."""
        current = self.owner(seq_id)
        if current == DONE:
            raise OwnershipError(f"sequence {seq_id} is done; it cannot move to {to}")
        if expect is not None and current != expect:
            raise OwnershipError(
                f"sequence {seq_id} is owned by {current}, not {expect}; cannot move it to {to}"
            )
        self._held[current].discard(seq_id)
        self._set(seq_id, to)

    def finish(self, seq_id: int, *, expect: Owner | None = None) -> None:
        self.move(seq_id, DONE, expect=expect)

    def _set(self, seq_id: int, owner: Owner) -> None:
        self._owner[seq_id] = owner
        if owner == DONE:
            self.done += 1
        else:
            self._held.setdefault(owner, set()).add(seq_id)

    def counts(self) -> dict[str, int]:
        """submitted, done, queued, running (running = held by replicas)."""
        queued = sum(len(s) for o, s in self._held.items() if o.kind == "queue")
        running = sum(len(s) for o, s in self._held.items() if o.kind == "replica")
        return {
            "submitted": len(self._owner),
            "done": self.done,
            "queued": queued,
            "running": running,
        }

    def check_invariants(self, holdings: Mapping[Owner, Iterable[int]] | None = None) -> None:
        """Raise OwnershipError naming every broken sequence; return quietly when all is well.

        Always checks submitted = done + running + queued. With ``holdings`` (every queue and
        replica, with the ids it really holds) also checks that each sequence that is not
        done is held exactly once, by the owner the ledger names. A holder missing from
        ``holdings`` holds nothing: what the ledger gives it is reported lost.
        """
        problems: list[str] = []
        c = self.counts()
        if c["submitted"] != c["done"] + c["running"] + c["queued"]:
            problems.append(
                f"submitted {c['submitted']} != done {c['done']} + running {c['running']} "
                f"+ queued {c['queued']}"
            )
        if holdings is not None:
            seen: dict[int, list[Owner]] = {}
            for holder, ids in holdings.items():
                for seq_id in ids:
                    seen.setdefault(seq_id, []).append(holder)
            for seq_id, holders in sorted(seen.items()):
                owner = self._owner.get(seq_id)
                if len(holders) > 1:
                    where = ", ".join(str(h) for h in holders)
                    problems.append(f"sequence {seq_id} duplicated: held by {where}")
                elif owner is None:
                    problems.append(f"sequence {seq_id} held by {holders[0]} was never submitted")
                elif owner == DONE:
                    problems.append(f"sequence {seq_id} is done but still held by {holders[0]}")
                elif holders[0] != owner:
                    problems.append(
                        f"sequence {seq_id} held by {holders[0]} but the ledger says {owner}"
                    )
            lost = [
                (seq_id, owner)
                for owner, ids in self._held.items()
                for seq_id in ids
                if seq_id not in seen
            ]
            for seq_id, owner in sorted(lost, key=lambda x: x[0]):
                problems.append(f"sequence {seq_id} lost: the ledger says {owner}, held nowhere")
        if problems:
            shown = problems[:20]
            more = f" (and {len(problems) - 20} more)" if len(problems) > 20 else ""
            raise OwnershipError("sequence ownership broken: " + "; ".join(shown) + more)
