"""The shift planner: given a snapshot, whether and how to move devices between roles.

Five steps (DESIGN.md, "The planner"; the authors' code as paper-notes.md section 2 reads it):

1. pick the bottleneck role: the smaller T/N (both on a tie; the loaded one if the other has
   no demand);
2. find where it can grow (``candidates.wake_groups``): free devices, then the trainer pool
   while the trainer waits, else devices of evictable replicas of the other role;
3. one cheapest plan per wake count (``candidates.best_plans``);
4. simulate each plan at request level (``evaluation.simulate_role``) and evaluate the
   objective T = (N_roll + N_rm) / (N_roll/T_roll + N_rm/T_rm);
5. score ``L = H*dT - Phi`` with ``Phi = sum over victims of (migrate_time + reprefill_s) /
   ITL * running`` and act on the best plan if L > min_gain. ``reprefill_s`` is the victim's
   context at its role's prefill rate: its sequences resume elsewhere only after a replica of
   the role re-prefilled them, and that replica decodes nothing meanwhile (the victim's own
   rate, running / ITL, stands in for it). A plan that rebalances the receiver pays the same
   for the sequences it moves, and rebalances only where that still wins.

Gates: one shift at a time, a cooldown after each action, immunity of newly woken replicas
from eviction, at most ``max_moves_per_action`` wakes per plan, and the rollout's latency
floor (``rollout_latency_floor``): the objective prices throughput, not the critical path,
and would pack the long responses onto a few crowded replicas, so no plan takes the rollout
below the replicas at which its mean load decodes within ``floor_itl_slack`` of one
sequence alone. Training moves as a whole and
ahead of everything else: a waiting trainer lends its pool, a ready one takes it all back, and
so does a waiting one whose batch is forecast ready within the time the reclaim takes,
unless that would leave work in flight with no replica to run it (``_strands``).
With ``moves.learn`` the Planner also times steps with its moves and with the split held
(``pivot.planning.moves``) and stops moving where moving does not pay; held, a role with work
and no replica still takes one (``shift_roles`` off).

The ``Planner`` refits each inference role's cost model online from measured decode
iterations (``cost.OnlineCostModel``), so that a wrong prior converges to what its replicas
measure (one layout per role: a role's replicas share one model).

Pure and synchronous: ``now`` comes in the snapshot, phase times from an injected timer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal

import msgspec
import numpy as np

from pivot.cluster import (
    INFERENCE_ROLES,
    ClusterSpec,
    Move,
    Role,
    other_inference_role,
    replica_id,
)
from pivot.config import (
    ConfigStruct,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    UnitInterval,
)
from pivot.planning.candidates import BLOCKED, FREE, CandidatePlan, best_plans, wake_groups
from pivot.planning.cost import CostModel, OnlineCostModel
from pivot.planning.evaluation import (
    RoleLoad,
    RoleOutcome,
    build_role_load,
    objective,
    simulate_role,
)
from pivot.planning.helpers import TrainerLoad, idle_until_step_ends, packed_tails
from pivot.planning.moves import MoveLearning, MoveLedger
from pivot.planning.plans import (
    TRAINER_ID,
    CandidateScore,
    Decision,
    DoneShift,
    HelperOffer,
    PhaseTimings,
    SequenceMigration,
    ShiftPlan,
)
from pivot.planning.routing import REWARD_ROUTER, ROLLOUT_ROUTER, RouterSettings, make_router
from pivot.planning.snapshot import ClusterSnapshot, ReplicaState, SnapshotError, TrainerPhase

_CODE = {role: i for i, role in enumerate(Role)}


class PlannerSettings(ConfigStruct, kw_only=True):
    """Defaults are the paper launchers' (reference/paper-notes.md, section 2.3)."""

    horizon_s: NonNegativeFloat = 60.0  # H
    min_gain: NonNegativeFloat = 0.05  # act only if L = H*dT - Phi exceeds this (tokens)
    cooldown_s: NonNegativeFloat = 10.0
    immunity_s: NonNegativeFloat = 10.0  # a newly woken replica is no victim for this long
    max_moves_per_action: PositiveInt = 32  # wakes per plan
    min_awake_per_role: NonNegativeInt = 0
    migrate_time_init_s: NonNegativeFloat = 5.0
    migrate_time_alpha: Fraction = 0.2
    # while the trainer trains and neither inference role has work (an on-policy job between
    # its judgments and its next batch), its idle reward replicas become rollout replicas, so
    # that the next batch is routed across them as it arrives instead of filling the one
    # rollout replica and waiting for a shift that must then migrate it (``_staged_rollout``)
    stage_rollout: bool = False
    # ablations
    policy: Literal["cost_model", "rule_based"] = "cost_model"
    rebalance: bool = True
    lend_trainer_pool: bool = True
    # False: no device moves between rollout and reward, except one replica to a role that
    # has work and none (the split held, as a static deployment's)
    shift_roles: bool = True
    price_reprefill: bool = True  # Phi charges re-prefilling moved sequences
    refit: bool = True  # cost models follow measured decode latencies
    # a role's model is refit from its latest ``refit_window`` decode samples at most every
    # ``refit_interval_s`` (snapshot time), once new samples came, and only while it misses
    # them by more than ``refit_tolerance`` (RMS relative ITL error): a fit costs milliseconds
    refit_interval_s: NonNegativeFloat = 10.0
    refit_window: PositiveInt = 1024
    refit_tolerance: NonNegativeFloat = 0.01
    # reclaim the lent pool once the batch is forecast ready within the reclaim's time, not
    # once it is ready (the reclaim then leaves the critical path)
    early_reclaim: bool = True
    # the share of each miss between a reclaimed pool and its batch the next lead corrects
    # (pivot.planning.forecast.ReclaimLead; 0: the reclaim's measured time alone)
    reclaim_lead_gain: Fraction = 0.5
    # inference replicas with nothing to run until the train step ends compute gradients
    # for it (pivot.planning.helpers), where the trainer's backend takes them
    gradient_helpers: bool = True
    # the run is trainer-bound once the trainer trained at least this share of the time (an
    # exponential average, time constant ``trainer_bound_window_s``); then an idle reward
    # replica helps while another serves (pivot.planning.helpers). 1: never
    trainer_bound_share: UnitInterval = 0.8
    trainer_bound_window_s: PositiveFloat = 900.0
    # in a trainer-bound run, also offer the lightest busy reward replicas while no judgment
    # queues, their sequences moved onto the others where each still decodes within
    # ``pack_itl_slack`` of one sequence alone (pivot.planning.helpers.packed_tails)
    pack_tails: bool = True
    pack_itl_slack: PositiveFloat = 0.8
    # rollout latency floor: the critical (longest) response decodes at its replica's ITL,
    # which grows with the sequences and tokens it shares the replica with. The floor is the
    # fewest rollout replicas at which one holding the mean load decodes within
    # ``floor_itl_slack`` of one sequence of the mean context alone (``rollout_latency_floor``); no
    # plan evicts the rollout below it
    rollout_floor: bool = True
    floor_itl_slack: PositiveFloat = 0.4
    # rule-based policy: KV-cache pressure thresholds
    kv_high: PositiveFloat = 0.8
    kv_low: NonNegativeFloat = 0.1
    # learning online whether the planner's moves pay here (pivot.planning.moves)
    moves: MoveLearning = msgspec.field(default_factory=MoveLearning)


class _Phases:
    def __init__(self, timer: Callable[[], float] | None) -> None:
        self._timer = timer
        self._start = self._last = timer() if timer else 0.0
        self.spent: list[float] = []

    def mark(self) -> None:
        if self._timer:
            now = self._timer()
            self.spent.append(now - self._last)
            self._last = now

    def timings(self) -> PhaseTimings:
        if not self._timer:
            return PhaseTimings()
        total = self._timer() - self._start
        parts = (self.spent + [0.0, 0.0, 0.0])[:3]
        return PhaseTimings(*parts, total_s=total)


def _evict(replica: ReplicaState) -> Move:
    return Move("evict", replica.id, replica.role, replica.devices)


def _to_queue(replicas: list[ReplicaState]) -> tuple[SequenceMigration, ...]:
    return tuple(SequenceMigration(s, r.id, None) for r in replicas for s in r.seq_ids)


def _itl_of(replica: ReplicaState, model: CostModel) -> float:
    if replica.itl_s > 0:
        return replica.itl_s
    return model.itl_one(replica.running, sum(replica.seq_tokens))


def _victim_phi(
    replica: ReplicaState, model: CostModel, migrate: float, settings: PlannerSettings
) -> float:
    """Tokens ``replica``'s eviction costs: its rate over the shift and the re-prefill."""
    if not replica.running:
        return 0.0
    reprefill = model.prefill_s(sum(replica.seq_tokens)) if settings.price_reprefill else 0.0
    return (migrate + reprefill) / _itl_of(replica, model) * replica.running


def plan_shift(
    spec: ClusterSpec,
    snapshot: ClusterSnapshot,
    cost_models: Mapping[Role, CostModel],
    *,
    settings: PlannerSettings | None = None,
    routers: Mapping[Role, RouterSettings] | None = None,
    migrate_time_s: float | None = None,
    last_action_at: float | None = None,
    timer: Callable[[], float] | None = None,
) -> Decision:
    """One planner decision. Pure: the same arguments give the same decision."""
    settings = settings or PlannerSettings()
    routers = routers or {Role.ROLLOUT: ROLLOUT_ROUTER, Role.REWARD: REWARD_ROUTER}
    migrate = settings.migrate_time_init_s if migrate_time_s is None else migrate_time_s
    phases = _Phases(timer)

    def done(plan: ShiftPlan | None, reason: str, **extra) -> Decision:
        return Decision(plan=plan, reason=reason, timings=phases.timings(), **extra)

    if snapshot.shift_in_flight:
        return done(None, "a shift is in flight")
    now = snapshot.now
    by_role: dict[Role, list[ReplicaState]] = {r: [] for r in Role}
    local = np.empty(len(snapshot.replicas), dtype=np.int64)
    role_of = np.empty(len(snapshot.replicas), dtype=np.int64)
    for i, replica in enumerate(snapshot.replicas):
        same = by_role[replica.role]
        local[i] = len(same)
        role_of[i] = _CODE[replica.role]
        same.append(replica)

    holder_of_device = _device_owners(spec, snapshot)
    trainer = _trainer_plan(spec, snapshot, by_role, settings, cost_models, migrate)
    if trainer is not None:
        return done(trainer[0], trainer[1])
    if last_action_at is not None and now - last_action_at < settings.cooldown_s:
        left = settings.cooldown_s - (now - last_action_at)
        return done(None, f"cooldown: {left:.1f} s left")

    loads = {
        role: build_role_load(
            role,
            by_role[role],
            snapshot.queue(role),
            cost_models[role],
            make_router(routers[role], cost_models[role]),
        )
        for role in INFERENCE_ROLES
    }
    lendable = (
        settings.lend_trainer_pool
        and snapshot.trainer is TrainerPhase.WAITING
        and not by_role[Role.TRAINING]
    )
    if settings.stage_rollout and settings.shift_roles:
        staged = _staged_rollout(spec, snapshot, by_role, loads, settings.min_awake_per_role)
        if staged is not None:
            return done(staged, f"no inference work while training: rollout +{len(staged.wakes)}")
    if not settings.shift_roles and all(by_role[r] or not loads[r].demand for r in INFERENCE_ROLES):
        return done(None, "the split between rollout and reward is held")
    if settings.policy == "rule_based":
        phases.mark()
        return _rule_based(
            spec, snapshot, loads, holder_of_device, local, role_of, lendable, settings, done
        )

    baseline = {role: float(simulate_role(loads[role]).throughput[0]) for role in INFERENCE_ROLES}
    demand = tuple(loads[r].demand for r in INFERENCE_ROLES)
    before = objective(demand, tuple(baseline[r] for r in INFERENCE_ROLES))
    receivers = _bottleneck(loads, baseline)
    phases.mark()
    if not settings.shift_roles:  # held: only a role with work and no replica grows
        receivers = [r for r in receivers if not by_role[r]]
    if not receivers:
        return done(None, "no demand in either inference role")

    floor = {Role.ROLLOUT: 0, Role.REWARD: 0}
    if Role.REWARD in receivers:  # only a growing reward role takes rollout replicas
        rollout = loads[Role.ROLLOUT]
        floor[Role.ROLLOUT] = rollout_latency_floor(
            rollout.demand,
            float(kv_tokens_from_itl(rollout).sum()) + rollout.queue.tokens,
            rollout.model,
            rollout.router.settings.max_concurrent_per_replica,
            settings,
        )
    plans: list[tuple[Role, CandidatePlan]] = []
    for receiver in receivers:
        donor = other_inference_role(receiver)
        phi, evictable = _victim_table(loads[donor], now, settings, migrate, floor[donor])
        holder = _holders(
            spec, holder_of_device, local, role_of == _CODE[donor], evictable, lendable
        )
        groups = wake_groups(spec.slots(receiver), holder, spec.is_trainer_pool, phi)
        moves = settings.max_moves_per_action if settings.shift_roles else 1
        for plan in best_plans(groups, moves, phi):
            plans.append((receiver, plan))
    phases.mark()

    outcomes: dict[Role, RoleOutcome] = {}
    if plans:
        for role in INFERENCE_ROLES:
            grows = [receiver is role for receiver, _ in plans]
            outcomes[role] = simulate_role(
                loads[role],
                [() if g else p.victims for g, (_, p) in zip(grows, plans, strict=True)],
                [len(p.slots) if g else 0 for g, (_, p) in zip(grows, plans, strict=True)],
                [g and settings.rebalance for g in grows],
            )
    scores: list[CandidateScore] = []
    rebalanced: list[bool] = []
    horizon = settings.horizon_s
    for i, (receiver, plan) in enumerate(plans):
        after = {r: float(outcomes[r].throughput[i]) for r in INFERENCE_ROLES}
        gain = objective(demand, tuple(after.values())) - before
        phi = plan.phi
        grown = outcomes[receiver]
        moves = bool(grown.rebalanced[i])
        if moves and settings.price_reprefill:
            # the moved sequences' re-prefill stalls the replicas taking them
            rate = after[receiver] / max(int(grown.active[i].sum()), 1)
            price = float(loads[receiver].model.prefill_s(grown.moved_tokens[i])) * rate
            after[receiver] = float(grown.plain[i])
            plain = objective(demand, tuple(after.values())) - before
            if horizon * gain - price > horizon * plain:
                phi += price
            else:
                moves, gain = False, plain
        rebalanced.append(moves)
        scores.append(
            CandidateScore(
                receiver=receiver,
                wakes=len(plan.slots),
                victims=len(plan.victims),
                delta_throughput=gain,
                phi=phi,
                score=horizon * gain - phi,
            )
        )
    phases.mark()

    extra = {"bottleneck": tuple(receivers), "objective": before, "candidates": tuple(scores)}
    if not scores:
        names = " or ".join(r.value for r in receivers)
        return done(None, f"nowhere to grow {names}", **extra)

    def rank(i: int) -> tuple[float, int]:  # the highest L; of those, the fewest wakes
        return scores[i].score, -scores[i].wakes

    best = max(range(len(scores)), key=rank)
    top = scores[best]
    revived = ""
    if not top.score > settings.min_gain:
        # a role with work and no replica at all drains nothing, so the objective is 0 before
        # and after any plan that grows only the other one: with both starved (every replica
        # gone, the whole cluster lent to inference again) no plan would ever score, and the
        # job would hang; the best-ranked plan that gives a starved role a replica goes ahead
        # (once both roles drain, L ranks plans again)
        starved = {r for r in INFERENCE_ROLES if loads[r].demand and baseline[r] <= 0.0}
        reviving = [i for i, (receiver, _) in enumerate(plans) if receiver in starved]
        if not reviving:
            return done(
                None, f"best L = {top.score:.3g} tokens does not beat {settings.min_gain}", **extra
            )
        best = max(reviving, key=rank)
        top, revived = scores[best], " for a role with work and no replica"
    receiver, chosen = plans[best]
    grown = outcomes[receiver]
    moved = (grown.routed[best], grown.running[best]) if rebalanced[best] else None
    shift = _shift_plan(spec, snapshot, loads, receiver, chosen, moved, top, before)
    reason = (
        f"{receiver.value} +{top.wakes} (evicting {top.victims}): "
        f"dT = {top.delta_throughput:.4g} tok/s, Phi = {top.phi:.4g}, L = {top.score:.4g}"
        f"{revived}"
    )
    return done(shift, reason, **extra)


def _trainer_plan(
    spec: ClusterSpec,
    snapshot: ClusterSnapshot,
    by_role: dict[Role, list[ReplicaState]],
    settings: PlannerSettings,
    cost_models: Mapping[Role, CostModel],
    migrate: float,
) -> tuple[ShiftPlan, str] | None:
    """Training shifts as a whole, before anything else and past the cooldown."""
    if not spec.trainer_pool:
        return None
    held = by_role[Role.TRAINING]
    soon = _ready_soon(snapshot, settings) and not _strands(spec, snapshot, settings)
    if (snapshot.trainer is TrainerPhase.READY or soon) and not held:
        pool = set(spec.trainer_pool)
        victims = [
            r
            for r in snapshot.replicas
            if r.role in INFERENCE_ROLES and not pool.isdisjoint(r.devices)
        ]
        phi = sum(_victim_phi(r, cost_models[r.role], migrate, settings) for r in victims)
        moves = (
            *(_evict(r) for r in victims),
            Move("wake", TRAINER_ID, Role.TRAINING, spec.trainer_pool),
        )
        plan = ShiftPlan(
            kind="reclaim_trainer",
            receiver=Role.TRAINING,
            moves=moves,
            migrations=_to_queue(victims),
            phi=phi,
            expected_gain=-phi,
        )
        why = "trainer ready"
        if snapshot.trainer is not TrainerPhase.READY:
            why = f"batch ready in {snapshot.trainer_ready_in_s:.1f} s"
        return plan, f"{why}: reclaim its pool ({len(victims)} replicas evicted)"
    if (
        snapshot.trainer is TrainerPhase.WAITING
        and held
        and settings.lend_trainer_pool
        and not soon
    ):
        plan = ShiftPlan(kind="lend_trainer", receiver=Role.FREE, moves=(_evict(held[0]),))
        return plan, "trainer waiting: lend its pool"
    return None


def _ready_soon(snapshot: ClusterSnapshot, settings: PlannerSettings) -> bool:
    """Whether the batch the waiting trainer needs is forecast ready within the reclaim's
    time: then a lent pool comes back now, so that the reclaim ends as the batch is ready, and
    a held one is not lent (it would be reclaimed at once). Once reclaimed, the Controller
    reads the trainer as ready, so a forecast that moves later does not lend it out again."""
    ready_in = snapshot.trainer_ready_in_s
    return (
        settings.early_reclaim
        and snapshot.trainer is TrainerPhase.WAITING
        and ready_in is not None
        and snapshot.trainer_reclaim_s > 0
        and ready_in <= snapshot.trainer_reclaim_s
    )


def _strands(spec: ClusterSpec, snapshot: ClusterSnapshot, settings: PlannerSettings) -> bool:
    """Whether reclaiming the pool now would leave work in flight that no replica can run: a
    role with sequences queued or running (and reward while rollout has any: its judgments
    are still to come) that has no replica off the pool, nor (where the planner shifts roles)
    a slot off the pool to wake one in. An early reclaim holds the pool until its batch
    trains (the Controller reads the trainer as ready), so a batch stranded by it never
    trains: with every inference device in the pool (``shared0/pool128``) the job hung."""
    replicas = snapshot.replicas

    def busy(role: Role, queued: int) -> bool:
        return queued > 0 or any(r.running for r in replicas if r.role is role)

    needs = set()
    if busy(Role.ROLLOUT, snapshot.rollout_queue.length):
        needs = {Role.ROLLOUT, Role.REWARD}
    elif busy(Role.REWARD, snapshot.reward_queue.length):
        needs = {Role.REWARD}
    pool = spec.is_trainer_pool
    for role in needs:
        if any(r.role is role and not pool[list(r.devices)].any() for r in replicas):
            continue
        if settings.shift_roles and (~pool[spec.slots(role)].any(axis=1)).any():
            continue
        return True
    return False


def _device_owners(spec: ClusterSpec, snapshot: ClusterSnapshot) -> np.ndarray:
    """Per device, the index of the snapshot replica holding it, or -1."""
    lengths = np.fromiter((len(r.devices) for r in snapshot.replicas), np.int64)
    devices = np.fromiter(
        itertools.chain.from_iterable(r.devices for r in snapshot.replicas),
        np.int64,
        int(lengths.sum()),
    )
    if devices.size and (devices.min() < 0 or devices.max() >= spec.size):
        raise SnapshotError(f"a replica names a device outside 0..{spec.size - 1}")
    counts = np.bincount(devices, minlength=spec.size)
    if (counts > 1).any():
        raise SnapshotError(f"devices held twice: {np.flatnonzero(counts > 1).tolist()}")
    owner = np.full(spec.size, -1, dtype=np.int64)
    owner[devices] = np.repeat(np.arange(len(snapshot.replicas)), lengths)
    return owner


def _holders(
    spec: ClusterSpec,
    owner: np.ndarray,
    local: np.ndarray,
    donor_rows: np.ndarray,
    evictable: np.ndarray,
    lendable: bool,
) -> np.ndarray:
    """Per device: FREE, BLOCKED, or the donor-role index of the evictable replica on it.

    ``owner``: snapshot replica per device (-1 free); ``local``: a snapshot replica's index
    within its role; ``donor_rows``: which snapshot replicas belong to the donor role.
    """
    holder = np.full(spec.size, BLOCKED, dtype=np.int64)
    # the trainer pool takes new replicas only while it may be lent: not while the trainer
    # needs it back (a batch is ready), nor with lending switched off, even where inference
    # already holds some of its devices
    usable = np.ones(spec.size, dtype=bool) if lendable else ~spec.is_trainer_pool
    holder[(owner < 0) & usable] = FREE
    devices = np.flatnonzero((owner >= 0) & usable)
    devices = devices[donor_rows[owner[devices]]]
    idx = local[owner[devices]]
    ok = evictable[idx]
    holder[devices[ok]] = idx[ok]
    return holder


def rollout_latency_floor(
    demand: int, tokens: float, model: CostModel, max_running: int, settings: PlannerSettings
) -> int:
    """Rollout replicas the latency floor wants for ``demand`` outstanding sequences holding
    ``tokens`` KV tokens (0 with the floor off): the fewest at which an even
    share, at most ``max_running`` a replica, decodes within ``floor_itl_slack`` of one
    sequence of the mean context alone."""
    if not settings.rollout_floor or demand <= 0:
        return 0
    context = tokens / demand
    share = np.arange(1, max(max_running, 1) + 1, dtype=np.float64)
    limit = (1.0 + settings.floor_itl_slack) * model.itl_one(1, context)
    fits = np.flatnonzero(model.itl(share, share * context) <= limit)
    most = int(share[fits[-1]]) if fits.size else 1
    return math.ceil(demand / most)


def kv_tokens_from_itl(load: RoleLoad) -> np.ndarray:
    """Per replica, its KV tokens: the larger of the scheduler's count, which knows each
    sequence's length only as of its last dispatch, and what the replica's measured ITL at
    its batch says through the cost model (``CostModel.tokens_at``)."""
    itl = np.array([r.itl_s for r in load.replicas], dtype=np.float64)
    if load.model.a <= 0 or not itl.size:
        return load.tokens
    implied = load.model.tokens_at(load.running, itl)
    return np.where((itl > 0) & (load.running > 0), np.maximum(load.tokens, implied), load.tokens)


def _victim_table(
    donor: RoleLoad, now: float, settings: PlannerSettings, migrate: float, floor: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Phi per donor replica, and which ones may be evicted (not immune, above min awake
    and above ``floor``, the rollout's latency floor)."""
    replicas = donor.replicas
    itl = np.array([r.itl_s for r in replicas], dtype=np.float64)
    modelled = donor.model.itl(donor.running, donor.tokens)
    itl = np.where(itl > 0, itl, modelled)
    hold = migrate + (donor.model.prefill_s(donor.tokens) if settings.price_reprefill else 0.0)
    phi = hold / itl * donor.running
    woken = np.array(
        [-np.inf if r.woken_at is None else r.woken_at for r in replicas], dtype=np.float64
    )
    evictable = now - woken >= settings.immunity_s
    keep = max(settings.min_awake_per_role, floor)
    if keep:
        # protect the most productive replicas; the rest may go
        productive = np.argsort(-donor.model.throughput(donor.running, donor.tokens), kind="stable")
        evictable[productive[:keep]] = False
    return phi, evictable


def _bottleneck(loads: dict[Role, RoleLoad], baseline: dict[Role, float]) -> list[Role]:
    ratio = {
        role: baseline[role] / loads[role].demand
        for role in INFERENCE_ROLES
        if loads[role].demand > 0
    }
    if not ratio:
        return []
    if len(ratio) == 1:
        return list(ratio)
    low = min(ratio.values())
    high = max(ratio.values())
    if high - low <= 1e-9 * max(high, 1e-300):
        return list(INFERENCE_ROLES)
    return [min(ratio, key=ratio.__getitem__)]


def _new_ids(role: Role, slots: list[tuple[int, ...]], taken: set[str]) -> list[str]:
    ids = []
    for devices in slots:
        name = base = replica_id(role, devices)
        n = 1
        while name in taken:
            n += 1
            name = f"{base}#{n}"
        taken.add(name)
        ids.append(name)
    return ids


def _staged_rollout(
    spec: ClusterSpec,
    snapshot: ClusterSnapshot,
    by_role: dict[Role, list[ReplicaState]],
    loads: dict[Role, RoleLoad],
    keep: int,
) -> ShiftPlan | None:
    """The idle reward replicas as rollout replicas on the same devices, while the trainer
    trains and neither inference role holds or queues a sequence: the next work to come is
    the next batch's rollout (its judgments come only from its responses). ``keep`` reward
    replicas stay (``min_awake_per_role``), and so does one whose devices no rollout
    replicas tile (another layout)."""
    if snapshot.trainer is not TrainerPhase.TRAINING or any(
        loads[r].demand for r in INFERENCE_ROLES
    ):
        return None
    slots = [tuple(row.tolist()) for row in spec.slots(Role.ROLLOUT)]
    victims, devices = [], []
    for replica in by_role[Role.REWARD][keep:]:
        held = set(replica.devices)
        inside = [s for s in slots if held.issuperset(s)]  # aligned blocks: disjoint
        if sum(map(len, inside)) == len(held):
            victims.append(replica)
            devices += inside
    if not victims:
        return None
    ids = _new_ids(Role.ROLLOUT, devices, {r.id for r in snapshot.replicas})
    wakes = (Move("wake", i, Role.ROLLOUT, d) for i, d in zip(ids, devices, strict=True))
    return ShiftPlan(
        kind="shift", receiver=Role.ROLLOUT, moves=(*(_evict(r) for r in victims), *wakes)
    )


def _shift_plan(
    spec: ClusterSpec,
    snapshot: ClusterSnapshot,
    loads: dict[Role, RoleLoad],
    receiver: Role,
    chosen: CandidatePlan,
    rebalance: tuple[np.ndarray, np.ndarray] | None,
    score: CandidateScore,
    before: float,
) -> ShiftPlan:
    donor = loads[other_inference_role(receiver)]
    victims = [donor.replicas[v] for v in chosen.victims]
    table = spec.slots(receiver)
    slot_devices = [tuple(table[s].tolist()) for s in chosen.slots]
    new_ids = _new_ids(receiver, slot_devices, {r.id for r in snapshot.replicas})
    moves = (
        *(_evict(r) for r in victims),
        *(Move("wake", i, receiver, d) for i, d in zip(new_ids, slot_devices, strict=True)),
    )
    migrations = list(_to_queue(victims))
    if rebalance is not None:
        migrations.extend(_rebalance_moves(loads[receiver], new_ids, *rebalance))
    return ShiftPlan(
        kind="shift",
        receiver=receiver,
        moves=moves,
        migrations=tuple(migrations),
        delta_throughput=score.delta_throughput,
        phi=score.phi,
        expected_gain=score.score,
        objective_before=before,
        objective_after=before + score.delta_throughput,
    )


def _rebalance_moves(
    load: RoleLoad, new_ids: list[str], routed: np.ndarray, final: np.ndarray
) -> list[SequenceMigration]:
    """Shortest running sequences of the replicas that lose load go to those that gain it."""
    ids = [r.id for r in load.replicas] + new_ids
    change = (final - routed)[: len(ids)]  # rows past these belong to no replica here
    takers = [(ids[i], int(n)) for i, n in enumerate(change) if n > 0]
    out: list[SequenceMigration] = []
    slot = 0
    for i in np.flatnonzero(change < 0).tolist():
        replica = load.replicas[i]
        order = np.argsort(np.asarray(replica.seq_tokens), kind="stable")[: int(-change[i])]
        for k in order.tolist():
            name, room = takers[slot]
            out.append(SequenceMigration(replica.seq_ids[k], replica.id, name))
            takers[slot] = (name, room - 1)
            if room == 1:
                slot += 1
    return out


def _rule_based(
    spec: ClusterSpec,
    snapshot: ClusterSnapshot,
    loads: dict[Role, RoleLoad],
    owner: np.ndarray,
    local: np.ndarray,
    role_of: np.ndarray,
    lendable: bool,
    settings: PlannerSettings,
    done: Callable[..., Decision],
) -> Decision:
    """The ablation baseline: KV-cache pressure thresholds, growing onto idle devices only."""
    pressure = {}
    for role in INFERENCE_ROLES:
        load = loads[role]
        want = float(load.tokens.sum()) + load.queue.tokens
        room = len(load.replicas) * spec.roles[role].kv_capacity_tokens
        pressure[role] = 0.0 if want == 0 else (np.inf if room == 0 else want / room)
    receiver = max(INFERENCE_ROLES, key=lambda r: pressure[r])
    if pressure[receiver] < settings.kv_high:
        return done(None, "rule-based: no role above the KV threshold")
    donor = loads[other_inference_role(receiver)]
    idle = donor.running == 0
    if pressure[donor.role] > settings.kv_low:
        idle[:] = False
    woken = np.array([-np.inf if r.woken_at is None else r.woken_at for r in donor.replicas])
    idle &= snapshot.now - woken >= settings.immunity_s
    spare = len(donor.replicas) - settings.min_awake_per_role
    if idle.sum() > max(spare, 0):
        idle[np.flatnonzero(idle)[max(spare, 0) :]] = False
    phi = np.zeros(len(donor.replicas))
    holder = _holders(spec, owner, local, role_of == _CODE[donor.role], idle, lendable)
    groups = wake_groups(spec.slots(receiver), holder, spec.is_trainer_pool, phi)
    plans = best_plans(groups, settings.max_moves_per_action, phi)
    if not plans:
        return done(None, f"rule-based: no idle devices for {receiver.value}")
    chosen = plans[-1]
    score = CandidateScore(receiver, len(chosen.slots), len(chosen.victims), 0.0, 0.0, 0.0)
    plan = _shift_plan(spec, snapshot, loads, receiver, chosen, None, score, 0.0)
    return done(
        plan,
        f"rule-based: {receiver.value} +{len(chosen.slots)} onto idle devices",
        bottleneck=(receiver,),
    )


class Planner:
    """``plan_shift`` with the state it needs between decisions.

    Holds the cooldown clock (``now`` of the last shift it returned), the running average
    of observed shift time that prices Phi, and per inference role the online refit of its
    cost model. The executor reports each finished shift through ``record_shift_time``; the
    monitor feeds measured decode iterations through ``observe_decode``. ``cost_models`` are
    the priors; ``set_cost_model`` replaces one (and restarts its refit from it).
    """

    def __init__(
        self,
        spec: ClusterSpec,
        cost_models: Mapping[Role, CostModel],
        settings: PlannerSettings | None = None,
        routers: Mapping[Role, RouterSettings] | None = None,
        timer: Callable[[], float] | None = None,
    ) -> None:
        self.spec = spec
        self.settings = settings or PlannerSettings()
        self.cost_models = dict(cost_models)
        for role in INFERENCE_ROLES:
            if role not in self.cost_models:
                raise ValueError(f"no cost model for role {role.value!r}")
        self.routers = dict(routers or {Role.ROLLOUT: ROLLOUT_ROUTER, Role.REWARD: REWARD_ROUTER})
        self.timer = timer
        self.migrate_time_s = self.settings.migrate_time_init_s
        self.last_action_at: float | None = None
        self.online: dict[Role, OnlineCostModel] = {}
        self._refit_at: dict[Role, float] = {}
        for role in INFERENCE_ROLES:
            self.set_cost_model(role, self.cost_models[role])
        self.moves = MoveLedger(self.settings.moves)
        self.trainer_load = TrainerLoad(self.settings.trainer_bound_window_s)

    def set_cost_model(self, role: Role, model: CostModel) -> None:
        self.cost_models[role] = model
        if role in INFERENCE_ROLES:
            self.online[role] = OnlineCostModel(model, window=self.settings.refit_window)
            self._refit_at.pop(role, None)

    def observe_decode(self, role: Role, running: int, tokens: int, itl_s: float) -> None:
        """One measured decode iteration of a ``role`` replica: ``running`` sequences over
        ``tokens`` KV tokens took ``itl_s``; the next refit uses it (ignored with refit off)."""
        online = self.online.get(role)
        if online is not None and self.settings.refit:
            online.observe(running, tokens, itl_s)

    def _refit(self, now: float) -> None:
        for role, online in self.online.items():
            last = self._refit_at.get(role)
            if not online.fresh or online.samples < online.min_samples:
                continue
            if last is not None and now - last < self.settings.refit_interval_s:
                continue
            self._refit_at[role] = now
            if online.error() > self.settings.refit_tolerance:
                self.cost_models[role] = online.refit()

    def record_shift_time(self, seconds: float) -> None:
        """Fold one observed shift duration (shift-down + shift-up) into the average."""
        if seconds < 0:
            raise ValueError(f"a shift cannot take {seconds} s")
        alpha = self.settings.migrate_time_alpha
        self.migrate_time_s = (1 - alpha) * self.migrate_time_s + alpha * seconds

    def resume(self, done: Sequence[DoneShift]) -> None:
        """A restarted Controller's planner continues where the journal leaves it: the
        shift-time average over the shifts done, and the cooldown from the last role shift
        (its plan's time: when the planner returned it)."""
        for shift in done:
            self.record_shift_time(max(shift.done_at - shift.started_at, 0.0))
        shifts = [s for s in done if s.kind == "shift"]
        if shifts:
            self.last_action_at = shifts[-1].started_at

    def helpers(self, snapshot: ClusterSnapshot, helping: Collection[str] = ()) -> HelperOffer:
        """The inference replicas to offer the train step in flight as gradient helpers
        (``pivot.planning.helpers``): the idle ones, and in a trainer-bound run the reward
        tails it packs; none with ``gradient_helpers`` off."""
        self.trainer_load.observe(snapshot)
        if not self.settings.gradient_helpers:
            return HelperOffer()
        bound = self._trainer_bound()
        idle = idle_until_step_ends(snapshot, helping, trainer_bound=bound)
        if not (bound and self.settings.pack_tails):
            return HelperOffer(idle)
        packed = packed_tails(
            snapshot,
            helping,
            self.cost_models[Role.REWARD],
            self.routers[Role.REWARD].max_concurrent_per_replica,
            self.settings.pack_itl_slack,
        )
        return HelperOffer(idle + packed.replicas, packed.migrations)

    def _trainer_bound(self) -> bool:
        bound = self.settings.trainer_bound_share
        return bound < 1.0 and self.trainer_load.share >= bound

    def decide(self, snapshot: ClusterSnapshot) -> Decision:
        settings = self.settings
        self.trainer_load.observe(snapshot)
        if settings.refit:
            self._refit(snapshot.now)
        if settings.moves.learn:
            self.moves.observe(snapshot)
            if not self.moves.moving:
                settings = msgspec.structs.replace(
                    settings, lend_trainer_pool=False, shift_roles=False
                )
        decision = plan_shift(
            self.spec,
            snapshot,
            self.cost_models,
            settings=settings,
            routers=self.routers,
            migrate_time_s=self.migrate_time_s,
            last_action_at=self.last_action_at,
            timer=self.timer,
        )
        if decision.plan is not None and decision.plan.kind == "shift":
            self.last_action_at = snapshot.now
        return decision
