"""Steps 2 and 3 of the planner: where a role can grow, and the cheapest way to grow by n.

A *slot* is a device group where a replica of the receiving role may start (see
``ClusterSpec.slots``). A slot is wakeable when each of its devices is free (in the shared
pool, or in the trainer pool while the trainer lends it) or held by an evictable replica of
the other inference role: a *victim*. Wakeable slots that share the same victims form a
*group*: evicting one 4-device reward replica frees four 1-device rollout slots, and its
penalty is paid once however many of them wake.

``best_plans`` returns one cheapest plan per wake count. Cost is the penalty Phi of the
victims, with tiny tie-breakers so that free devices come first, then shared-pool before
trainer-pool devices, then the lowest Phi. With groups of one size and disjoint victims, the
cheapest groups in order are optimal (a sorted greedy prefix); otherwise a dynamic program
over groups runs, one best state per count, victim sets as bit masks so that a victim shared
by two groups is charged once.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np

EPS_VICTIM = 1e-6  # tokens: waking on free devices beats evicting even an idle replica
EPS_TRAINER = 1e-9  # tokens: shared-pool devices beat borrowed trainer-pool ones

FREE = -1  # holder code of a device nobody holds and the receiver may use
BLOCKED = -2  # holder code of a device the receiver may not use


@dataclass(slots=True)
class WakeGroup:
    slots: list[int]  # rows of the slot table, shared-pool slots first
    trainer: list[bool]  # per slot: it touches the trainer pool
    victims: tuple[int, ...]  # indices into the donor role's replicas
    mask: int
    phi: float


@dataclass(slots=True)
class CandidatePlan:
    slots: list[int]
    victims: list[int]
    phi: float
    cost: float


def wake_groups(
    slot_table: np.ndarray,
    holder: np.ndarray,
    trainer_device: np.ndarray,
    phi: np.ndarray,
) -> list[WakeGroup]:
    """Group the wakeable slots by the victims they need.

    ``holder`` per device: FREE, BLOCKED, or the index of the evictable donor replica that
    holds it; ``phi`` per donor replica.
    """
    if slot_table.size == 0:
        return []
    held = holder[slot_table]
    wakeable = np.flatnonzero((held != BLOCKED).all(axis=1))
    if wakeable.size == 0:
        return []
    on_trainer = trainer_device[slot_table[wakeable]].any(axis=1)
    rows = held[wakeable]
    by_victims: dict[tuple[int, ...], list[tuple[bool, int]]] = {}
    if rows.shape[1] == 1:
        keys = [() if v < 0 else (v,) for v in rows[:, 0].tolist()]
    else:
        keys = [tuple(sorted({v for v in row if v >= 0})) for row in rows.tolist()]
    for key, slot, trainer in zip(keys, wakeable.tolist(), on_trainer.tolist(), strict=True):
        by_victims.setdefault(key, []).append((trainer, slot))
    groups = []
    for key, members in by_victims.items():
        members.sort()  # shared-pool slots (False) first, then by position
        groups.append(
            WakeGroup(
                slots=[s for _, s in members],
                trainer=[t for t, _ in members],
                victims=key,
                mask=sum(1 << v for v in key),
                phi=float(sum(phi[v] for v in key)),
            )
        )
    return groups


def _phi_of(mask: int, phi: np.ndarray) -> float:
    total = 0.0
    while mask:
        low = mask & -mask
        total += float(phi[low.bit_length() - 1])
        mask ^= low
    return total


def _plan(groups: list[WakeGroup], picks: list[tuple[int, int]], phi: np.ndarray) -> CandidatePlan:
    slots: list[int] = []
    victims: set[int] = set()
    trainer_slots = 0
    for g, j in picks:
        slots.extend(groups[g].slots[:j])
        trainer_slots += sum(groups[g].trainer[:j])
        victims.update(groups[g].victims)
    ordered = sorted(victims)
    cost = float(sum(phi[v] for v in ordered))
    return CandidatePlan(
        slots=slots,
        victims=ordered,
        phi=cost,
        cost=cost + EPS_VICTIM * len(ordered) + EPS_TRAINER * trainer_slots,
    )


def _greedy(groups: list[WakeGroup], max_count: int, phi: np.ndarray) -> list[CandidatePlan]:
    """Equal group sizes, disjoint victims: the cheapest full groups plus the best partial one."""
    size = len(groups[0].slots)
    # cost[g][j]: taking the first j slots of group g (its victims, its trainer-pool slots)
    cost = [
        list(
            itertools.accumulate(
                (EPS_TRAINER if t else 0.0 for t in g.trainer),
                initial=g.phi + EPS_VICTIM * len(g.victims),
            )
        )
        for g in groups
    ]
    order = sorted(range(len(groups)), key=lambda g: cost[g][size])
    plans = []
    for count in range(1, max_count + 1):
        full, part = divmod(count, size)
        fulls = order[:full]
        if not part:
            plans.append(_plan(groups, [(g, size) for g in fulls], phi))
            continue
        # the partial group may be one of the cheapest full ones; then the next one is full
        prefix = sum(cost[g][size] for g in fulls)
        best: tuple[float, int] | None = None
        for rank, g in enumerate(order):
            if rank < full:
                if full >= len(order):
                    continue
                total = prefix - cost[g][size] + cost[order[full]][size] + cost[g][part]
            else:
                if best is not None and prefix + cost[g][size] - EPS_TRAINER * size >= best[0]:
                    break  # later groups cost at least this much, even partly taken
                total = prefix + cost[g][part]
            if best is None or total < best[0]:
                best = (total, rank)
        assert best is not None
        rank = best[1]
        partial = order[rank]
        if rank < full:
            fulls = [g for g in order[: full + 1] if g != partial]
        plans.append(_plan(groups, [(g, size) for g in fulls] + [(partial, part)], phi))
    return plans


def best_plans(groups: list[WakeGroup], max_count: int, phi: np.ndarray) -> list[CandidatePlan]:
    """The cheapest plan for each wake count 1..n (n <= max_count, as far as slots allow)."""
    total_slots = sum(len(g.slots) for g in groups)
    max_count = min(max_count, total_slots)
    if max_count <= 0:
        return []
    victim_groups = [g for g in groups if g.victims]
    free_slots = sorted(
        (t, s) for g in groups if not g.victims for t, s in zip(g.trainer, g.slots, strict=True)
    )
    union = 0
    for g in victim_groups:
        union |= g.mask
    disjoint = sum(len(g.victims) for g in victim_groups) == union.bit_count()
    sizes = {len(g.slots) for g in victim_groups}
    if disjoint and (sizes <= {1} or (not free_slots and len(sizes) == 1)):
        singles = victim_groups + [WakeGroup([s], [t], (), 0, 0.0) for t, s in free_slots]
        return _greedy(singles, max_count, phi)
    return _dynamic(victim_groups, free_slots, max_count, phi)


def _dynamic(
    victim_groups: list[WakeGroup],
    free_slots: list[tuple[bool, int]],
    max_count: int,
    phi: np.ndarray,
) -> list[CandidatePlan]:
    # only the cheapest few groups of each size can appear in a best plan of <= max_count
    by_size: dict[int, list[WakeGroup]] = {}
    for g in victim_groups:
        by_size.setdefault(len(g.slots), []).append(g)
    kept: list[WakeGroup] = []
    for size, same in by_size.items():
        same.sort(key=lambda g: (g.phi + EPS_VICTIM * len(g.victims), sum(g.trainer)))
        kept.extend(same[: math.ceil(max_count / size) + 1])
    groups = kept
    if free_slots:
        groups = [
            WakeGroup([s for _, s in free_slots], [t for t, _ in free_slots], (), 0, 0.0)
        ] + kept
    # state per count: (cost, victim mask, picks)
    best: list[tuple[float, int, tuple[tuple[int, int], ...]] | None] = [None] * (max_count + 1)
    best[0] = (0.0, 0, ())
    for gi, group in enumerate(groups):
        nxt = list(best)
        for count in range(max_count):
            state = best[count]
            if state is None:
                continue
            cost, mask, picks = state
            new_bits = group.mask & ~mask
            add = group.phi if new_bits == group.mask else _phi_of(new_bits, phi)
            add += EPS_VICTIM * new_bits.bit_count()
            for j in range(1, min(len(group.slots), max_count - count) + 1):
                if group.trainer[j - 1]:
                    add += EPS_TRAINER
                candidate = cost + add
                current = nxt[count + j]
                if current is None or candidate < current[0]:
                    nxt[count + j] = (candidate, mask | group.mask, (*picks, (gi, j)))
        best = nxt
    return [_plan(groups, list(s[2]), phi) for s in best[1:] if s is not None]
