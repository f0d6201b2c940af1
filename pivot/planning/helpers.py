"""Which inference replicas may join the train step in flight as gradient helpers
(``pivot.engines.helped_step`` models what they cost and gain).

A replica helps only while no work can reach it before the step ends, so that no admitted
sequence ever waits for a helper: the trainer trains (holding its pool), its backend takes
helpers (``ClusterSnapshot.trainer_takes_helpers``), no shift is in flight, the replica holds
no sequence and the rollout queue is empty. The Driver admits a batch only when a step ends
(its staleness rule), so an empty rollout queue stays empty until then: an idle rollout
replica may help while others still decode their tails. A reward replica's work comes from
rollout, so an idle reward replica helps only once no rollout replica runs a sequence and the
reward queue is empty too, unless the run is **trainer-bound** (``TrainerLoad``: the trainer
trained most of the recent time, so batches wait for it, not it for them): then it helps while
the reward queue is empty and another reward replica still serves, which takes the judgments
still to come. Measured (simulated, PivotRL, 24 steps): the 32B group gains 2.1% / 1.9%
(shared64/pool64, round-robin, seeds 0 / 1: 4.833 -> 4.933, 4.762 -> 4.851 samples/s), where
the trainer trains ~97% of the time; the 1.5B, 7B and 72B groups, whose trainers wait for
batches, run as before. Without the trainer-bound condition the 1.5B group lost 3.4% (its
critical judgments land on loaded replicas). (The Controller plans no shift while helpers are
out, so no migration sends them work either.) A replica already helping is not offered again.

**Packed reward tails** (``packed_tails``, ``PlannerSettings.pack_tails``): in a trainer-bound
run the trainer's step is on the critical path and the judgments trickle in as responses end,
each reward replica running a few. Then the lightest busy reward replicas are offered too,
while no judgment queues, with where each of their sequences goes: onto the other busy reward
replicas, each still decoding within ``pack_itl_slack`` of one sequence of the mean context
alone (the rule of the rollout's latency floor, ``floor_itl_slack``). The Controller cuts the
routing to those the step takes and moves their sequences (``Rebalance``); one the step
refuses keeps them. Measured (simulated, 32B group, shared64/pool64, round-robin, split held,
63 steps): seed 0 4.936 -> 5.162 samples/s (0.863 -> 0.901 of the combined bound), seed 1
4.900 -> 5.032 (0.879 -> 0.902). The slack: 0.4 gave 5.125 / 5.007, 1.5 gave 5.133 (seed 0).
Rollout tails are not packed: packing them as well gave 4.976 (slack 0.4, seed 0), rollout
alone 4.916 (their re-prefill, at the policy's prefill rate, cost 43k device-seconds, and the
trainer waited 2.5x longer for its batches: the longest responses are the batch's critical
path). Pure.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from pivot.cluster import INFERENCE_ROLES, Role
from pivot.planning.cost import CostModel
from pivot.planning.plans import HelperOffer, SequenceMigration
from pivot.planning.snapshot import ClusterSnapshot, ReplicaState, TrainerPhase


class TrainerLoad:
    """The share of recent time the trainer spent training: an exponential average over the
    snapshots' clock with time constant ``window_s``, 0 at first (not trainer-bound until
    seen so)."""

    def __init__(self, window_s: float) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.share = 0.0
        self._at: float | None = None

    def observe(self, snapshot: ClusterSnapshot) -> None:
        at = self._at
        if at is not None and snapshot.now > at:
            weight = min((snapshot.now - at) / self.window_s, 1.0)
            training = 1.0 if snapshot.trainer is TrainerPhase.TRAINING else 0.0
            self.share += weight * (training - self.share)
        if at is None or snapshot.now > at:
            self._at = snapshot.now


def _step_may_take_helpers(snapshot: ClusterSnapshot) -> bool:
    return (
        snapshot.trainer is TrainerPhase.TRAINING
        and snapshot.trainer_takes_helpers
        and not snapshot.shift_in_flight
        and not snapshot.rollout_queue.length
    )


def idle_until_step_ends(
    snapshot: ClusterSnapshot, helping: Collection[str] = (), *, trainer_bound: bool = False
) -> tuple[ReplicaState, ...]:
    """The replicas that may help the step in flight now (see the module docstring);
    ``trainer_bound``: the run is (``TrainerLoad``)."""
    if not _step_may_take_helpers(snapshot):
        return ()
    rollout = [r for r in snapshot.replicas if r.role is Role.ROLLOUT]
    drained = not any(r.running for r in rollout)
    serving = any(
        r.running for r in snapshot.replicas if r.role is Role.REWARD and r.id not in helping
    )
    reward_quiet = not snapshot.reward_queue.length and (drained or (trainer_bound and serving))
    return tuple(
        r
        for r in snapshot.replicas
        if r.role in INFERENCE_ROLES
        and not r.running
        and r.id not in helping
        and (r.role is Role.ROLLOUT or reward_quiet)
    )


def packed_tails(
    snapshot: ClusterSnapshot,
    helping: Collection[str],
    cost: CostModel,
    max_running: int,
    slack: float,
) -> HelperOffer:
    """The busy reward replicas a trainer-bound run may empty to help the step in flight,
    lightest first, and where their sequences go (see the module docstring); ``cost`` and
    ``max_running``: a reward replica's. Only while idle replicas may help too and no
    judgment queues."""
    if not _step_may_take_helpers(snapshot) or snapshot.reward_queue.length:
        return HelperOffer()
    busy = [
        r for r in snapshot.replicas if r.role is Role.REWARD and r.running and r.id not in helping
    ]
    victims, moves = _pack(busy, cost, max_running, slack)
    return HelperOffer(tuple(victims), tuple(moves))


def _pack(
    busy: list[ReplicaState], cost: CostModel, max_running: int, slack: float
) -> tuple[list[ReplicaState], list[SequenceMigration]]:
    """Empty the lightest of ``busy`` one after another while the others take each of its
    sequences (longest first, each onto the replica it slows least) within the latency limit;
    stop at the first that does not fit."""
    if len(busy) < 2:
        return [], []
    running = np.array([r.running for r in busy], dtype=np.float64)
    tokens = np.array([sum(r.seq_tokens) for r in busy], dtype=np.float64)
    limit = (1.0 + slack) * cost.itl_one(1, float(tokens.sum() / running.sum()))
    open_ = np.ones(len(busy), dtype=bool)
    victims: list[ReplicaState] = []
    moves: list[SequenceMigration] = []
    for i in sorted(range(len(busy)), key=lambda i: (running[i], tokens[i])):
        if open_.sum() <= 1:
            break
        open_[i] = False
        took_running, took_tokens = running.copy(), tokens.copy()
        placed: list[SequenceMigration] = []
        for seq_id, seq_tokens in sorted(
            zip(busy[i].seq_ids, busy[i].seq_tokens, strict=True), key=lambda s: -s[1]
        ):
            fits = open_ & (took_running < max_running)
            after = np.where(fits, cost.itl(took_running + 1, took_tokens + seq_tokens), np.inf)
            j = int(np.argmin(after))
            if after[j] > limit:
                break
            took_running[j] += 1
            took_tokens[j] += seq_tokens
            placed.append(SequenceMigration(seq_id, busy[i].id, busy[j].id))
        if len(placed) < busy[i].running:
            break
        running, tokens = took_running, took_tokens
        victims.append(busy[i])
        moves += placed
    return victims, moves
