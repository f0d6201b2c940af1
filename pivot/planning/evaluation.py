"""The planner's what-if: each role's throughput after each candidate shift, and the objective.

For one inference role, ``RoleLoad`` holds the snapshot as arrays (per replica: running
count, token total, the ascending cumulative token sums of its sequences). A candidate
takes some replicas away (evicts them) and adds empty ones (wakes them). ``simulate_role``
then, for every candidate of a decision at once (numpy over candidates x replicas x k):

1. routes the displaced sequences (of evicted replicas) and the queued ones with the role's
   live routing rule, as sequences of the candidate's mean waiting length: the rule's slot
   scores (``Router.slot_scores``) fall along each replica's row, so routing them one by one
   hands out the highest scores, found by one sort shared by all candidates;
2. rebalances (the scale-up role only): running sequences move from the fastest replicas to
   the slowest, shortest first, while that raises the role's summed throughput (the planner
   weighs that against re-prefilling what moves: ``plain`` and ``moved_tokens``). With one
   cost model per role, replica throughput is concave in its load, so this pairwise greedy
   ends with loads within one of each other; we compute that end state directly and keep it
   only if it beats no rebalance. Routing comes first, so running sequences move only where
   the queue cannot fill the new replicas (the authors rebalance first; with a backlog that
   pays re-prefills for sequences the queue would replace for free);
3. sums replica throughputs.

The ranking of slots uses one mean length per role for all candidates (the tokens each
candidate adds use its own mean): that is what lets one sort serve every candidate.

``objective`` combines the two roles as the authors' code does (the paper's Eq. 1):
T = (N_roll + N_rm) / (N_roll/T_roll + N_rm/T_rm), N = outstanding sequences per role.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pivot.cluster import Role
from pivot.planning.cost import CostModel
from pivot.planning.routing import Router
from pivot.planning.snapshot import QueueState, ReplicaState


@dataclass(slots=True)
class RoleLoad:
    role: Role
    replicas: list[ReplicaState]
    running: np.ndarray  # int64 per replica
    tokens: np.ndarray  # float64 per replica
    seq_start: np.ndarray  # where each replica's sequences start in ``cum_tokens``
    cum_tokens: np.ndarray  # [0, cumsum of tokens sorted ascending within each replica]
    queue: QueueState
    model: CostModel
    router: Router

    @property
    def demand(self) -> int:
        """Outstanding sequences: running plus queued."""
        return int(self.running.sum()) + self.queue.length


def build_role_load(
    role: Role,
    replicas: list[ReplicaState],
    queue: QueueState,
    model: CostModel,
    router: Router,
) -> RoleLoad:
    lengths = np.fromiter((len(r.seq_tokens) for r in replicas), np.int64, len(replicas))
    total = int(lengths.sum())
    flat = np.fromiter(
        itertools.chain.from_iterable(r.seq_tokens for r in replicas), np.float64, total
    )
    owner = np.repeat(np.arange(len(replicas)), lengths)
    ordered = flat[np.lexsort((flat, owner))]
    starts = np.zeros(len(replicas), dtype=np.int64)
    if len(replicas) > 1:
        np.cumsum(lengths[:-1], out=starts[1:])
    return RoleLoad(
        role=role,
        replicas=replicas,
        running=lengths,
        tokens=np.bincount(owner, weights=flat, minlength=len(replicas)).astype(np.float64),
        seq_start=starts,
        cum_tokens=np.concatenate([[0.0], np.cumsum(ordered)]),
        queue=queue,
        model=model,
        router=router,
    )


@dataclass(slots=True)
class RoleOutcome:
    """Per candidate: rows are the existing replicas in order, then the new ones."""

    throughput: np.ndarray  # (candidates,)
    active: np.ndarray  # (candidates, rows) the replica exists after the candidate
    routed: np.ndarray  # (candidates, rows) running count after routing
    running: np.ndarray  # (candidates, rows) running count after routing and rebalance
    tokens: np.ndarray  # (candidates, rows) token total after routing and rebalance
    rebalanced: np.ndarray  # (candidates,)
    plain: np.ndarray  # (candidates,) throughput after routing alone
    moved_tokens: np.ndarray  # (candidates,) context of the sequences the rebalance moves


def _route(
    load: RoleLoad,
    r0: np.ndarray,
    t0: np.ndarray,
    active: np.ndarray,
    waiting: np.ndarray,
    waiting_tokens: np.ndarray,
) -> np.ndarray:
    """Sequences each replica admits, per candidate: (candidates, rows)."""
    cands, rows = active.shape
    admitted = np.zeros((cands, rows), dtype=np.int64)
    most = int(waiting.max(initial=0))
    if most == 0 or rows == 0:
        return admitted
    cap = load.router.settings.max_concurrent_per_replica
    smallest = max(int(active.sum(axis=1).min()), 1)
    level = math.ceil((int(r0.sum()) + most) / smallest)
    # slots per replica to score: enough to lift the emptiest replica to the fill level, plus
    # slack; if a replica still takes all of them (very uneven tokens), score more and redo
    k_max = max(1, min(most, cap, level - int(r0.min()) + 2 + level // 4))
    mean_ref = float(waiting_tokens.sum()) / float(waiting.sum())
    while True:
        admitted = _route_top(load.router, r0, t0, active, waiting, k_max, mean_ref)
        limit = np.minimum(most, cap - r0)  # what a row could take with unbounded k_max
        if not ((admitted == k_max) & (limit > k_max)[None, :]).any():
            return admitted
        k_max = min(2 * k_max, most, cap)


def _route_top(
    router: Router,
    r0: np.ndarray,
    t0: np.ndarray,
    active: np.ndarray,
    waiting: np.ndarray,
    k_max: int,
    mean_ref: float,
) -> np.ndarray:
    """Per candidate, each row's share of the candidate's ``waiting`` best slot scores."""
    cands, rows = active.shape
    admitted = np.zeros((cands, rows), dtype=np.int64)
    score = router.slot_scores(r0, t0, k_max, mean_ref)
    flat = score.ravel()
    eligible = np.flatnonzero(np.isfinite(flat))
    if eligible.size == 0:
        return admitted
    # one ranking for all candidates; the stable sort hands ties to the lower row first,
    # as one-by-one routing does
    ranked_rows = (eligible // k_max)[np.argsort(-flat[eligible], kind="stable")]
    taken = np.cumsum(active[:, ranked_rows], axis=1, dtype=np.int32)
    # each candidate routes along the ranking up to its waiting-th slot on a live replica
    ends = [
        min(int(np.searchsorted(taken[c], waiting[c])) + 1, ranked_rows.size)
        if waiting[c] > 0
        else 0
        for c in range(cands)
    ]
    counts = np.zeros(rows, dtype=np.int64)
    done = 0
    for c in sorted(range(cands), key=ends.__getitem__):  # prefixes nest: count once
        if ends[c] > done:
            counts += np.bincount(ranked_rows[done : ends[c]], minlength=rows)
            done = ends[c]
        admitted[c] = counts
    return admitted * active


def _rebalance(
    load: RoleLoad, r: np.ndarray, t: np.ndarray, active: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Loads within one of each other per candidate, moving donors' shortest sequences; also
    the tokens moved per candidate.

    Only sequences that ran before the shift (their lengths are known) may move; rows of
    new replicas have none.
    """
    cands, rows = r.shape
    existing = load.running.size
    size = np.maximum(active.sum(axis=1), 1)
    total = (r * active).sum(axis=1)
    base, extra = total // size, total % size
    # rank rows by load, heaviest first, inactive rows last
    key = np.where(active, r, -1)
    rank = np.empty_like(r)
    np.put_along_axis(
        rank, np.argsort(-key, axis=1, kind="stable"), np.arange(rows)[None, :], axis=1
    )
    target = (base[:, None] + (rank < extra[:, None])) * active
    movable = np.zeros_like(r)
    movable[:, :existing] = load.running[None, :]
    give = np.minimum(np.maximum(r - target, 0), movable) * active
    moved = give.sum(axis=1)
    deficit = np.maximum(target - r, 0) * active
    order = np.argsort(np.where(active, r, np.iinfo(np.int64).max), axis=1, kind="stable")
    sorted_deficit = np.take_along_axis(deficit, order, axis=1)
    before = np.cumsum(sorted_deficit, axis=1) - sorted_deficit
    take = np.empty_like(r)
    np.put_along_axis(take, order, np.clip(moved[:, None] - before, 0, sorted_deficit), axis=1)
    start = load.seq_start[None, :]
    g = give[:, :existing]
    removed = load.cum_tokens[start + g] - load.cum_tokens[start]
    mean_moved = removed.sum(axis=1) / np.maximum(moved, 1)
    t2 = t + take * mean_moved[:, None]
    t2[:, :existing] -= removed
    return r - give + take, t2, removed.sum(axis=1)


def simulate_role(
    load: RoleLoad,
    evicted: Sequence[Sequence[int]] = ((),),
    new_replicas: Sequence[int] = (0,),
    rebalance: Sequence[bool] = (False,),
) -> RoleOutcome:
    """The role after each candidate: ``evicted[c]`` replica indices gone, ``new_replicas[c]``
    empty replicas added, rebalanced if ``rebalance[c]``. Defaults: one candidate, no change.
    """
    cands = len(evicted)
    if not (len(new_replicas) == len(rebalance) == cands):
        raise ValueError("evicted, new_replicas and rebalance need one entry per candidate")
    existing = load.running.size
    new = np.asarray(new_replicas, dtype=np.int64)
    rows = existing + int(new.max(initial=0))
    active = np.ones((cands, rows), dtype=bool)
    active[:, existing:] = np.arange(rows - existing)[None, :] < new[:, None]
    lens = np.fromiter((len(e) for e in evicted), np.int64, cands)
    if lens.any():
        flat = np.fromiter(itertools.chain.from_iterable(evicted), np.int64, int(lens.sum()))
        active[np.repeat(np.arange(cands), lens), flat] = False
    gone = ~active[:, :existing]
    waiting = (gone * load.running).sum(axis=1) + load.queue.length
    waiting_tokens = (gone * load.tokens).sum(axis=1) + load.queue.tokens
    r0 = np.concatenate([load.running, np.zeros(rows - existing, dtype=np.int64)])
    t0 = np.concatenate([load.tokens, np.zeros(rows - existing)])
    admitted = _route(load, r0, t0, active, waiting, waiting_tokens)
    mean = np.where(waiting > 0, waiting_tokens / np.maximum(waiting, 1), 0.0)
    routed = (r0[None, :] + admitted) * active
    tokens = (t0[None, :] + admitted * mean[:, None]) * active
    model = load.model
    throughput = plain = model.throughput(routed, tokens).sum(axis=1)
    running = routed
    done = np.zeros(cands, dtype=bool)
    moved = np.zeros(cands)
    wanted = np.asarray(rebalance, dtype=bool)
    if wanted.any():
        r2, t2, shifted = _rebalance(load, routed, tokens, active)
        balanced = model.throughput(r2, t2).sum(axis=1)
        done = wanted & (balanced > throughput)
        moved = np.where(done, shifted, 0.0)
        throughput = np.where(done, balanced, throughput)
        running = np.where(done[:, None], r2, routed)
        tokens = np.where(done[:, None], t2, tokens)
    return RoleOutcome(
        throughput=throughput,
        active=active,
        routed=routed,
        running=running,
        tokens=tokens,
        rebalanced=done,
        plain=plain,
        moved_tokens=moved,
    )


def objective(demand: tuple[int, int], throughput: tuple[float, float]) -> float:
    """Sequences over the time to drain them; a starved role (no demand) drops out."""
    total = demand[0] + demand[1]
    if total == 0:
        return 0.0
    drain = 0.0
    for n, t in zip(demand, throughput, strict=True):
        if n == 0:
            continue
        if t <= 0.0:
            return 0.0
        drain += n / t
    return total / drain
