"""A run's time account: where every device-second of a window went, integrated from events
(engine segments, shifts, training steps, who holds each device), not sampled.

Categories, in device-seconds, summing to devices x window (``ACCOUNT``, in this order):

* ``busy``: an inference replica prefilling new sequences, or decoding at or near its
  efficient batch (a batch whose tokens/s per device is within ``pivot.bounds.NEAR_EFFICIENT``
  of the efficient point's: ``running >= near_batch``, ``TimeAccount.thresholds``).
* ``under_filled``: decoding with fewer sequences than that.
* ``re_prefilling``: prefilling sequences that had output already (a migrated sequence, or one
  the KV cache preempted).
* ``idle``: holding an inference role with no sequence while another replica still runs one
  (batch tails, routing limits), or held by no role outside a shift.
* ``stalled_on_trainer``: holding an inference role with no sequence while no inference
  replica anywhere runs one: all the work submitted is done and the next batch waits on
  training (the staleness bound, or the synchronous loop).
* ``trainer_waiting``: held by the trainer, neither training nor shifting: a trainer pool
  waiting for a batch.
* ``training``: the trainer's devices in a training step (its GPS write included).
* ``in_transit``: named in a shift (from its start to its end: evacuation, release, acquire,
  register, the trainer's offload and reload), unless its engine still runs.

A device is in the first that applies of: engine work (busy, under-filled, re-prefilling),
training, in transit, then what it waits as (by who holds it). The engine categories are also
split by inference role (``TimeAccount.roles``, with the batch each role decoded at on
average), which says which role a run under-fills. ``Ledger`` records the events
(any source can feed it: the simulated agents, a real job's agent reports); ``account`` clips
them to a window and sums, exactly, with numpy.

    Ledger().segment(devices, role, start, end, running, prefill_s, reprefill_s)
            .transit(devices, start, end) .training(devices, start, end)
            .hold(devices, holder, at)
    account(ledger, window, devices, thresholds={role: near_batch}) -> TimeAccount
            .seconds {category: device-s}, .roles {role: RoleTime}
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Mapping
from typing import Literal

import msgspec
import numpy as np

ACCOUNT = (
    "busy",
    "under_filled",
    "re_prefilling",
    "idle",
    "stalled_on_trainer",
    "trainer_waiting",
    "training",
    "in_transit",
)

#: the categories of an engine's own time, which ``TimeAccount.roles`` splits by role
ENGINE = ACCOUNT[:3]

Holder = Literal["inference", "trainer", "free"]
_HOLDERS: dict[str, int] = {"inference": 0, "trainer": 1, "free": 2}


class RoleTime(msgspec.Struct, frozen=True, kw_only=True):
    """One inference role's share of the engine categories (device-seconds), and the batch it
    decoded at: running sequences a replica, the mean over its decode device-seconds (0 when
    it never decoded)."""

    busy: float
    under_filled: float
    re_prefilling: float
    decode_batch: float


class TimeAccount(msgspec.Struct, frozen=True, kw_only=True):
    """Device-seconds per category over ``window_s`` on ``devices`` devices."""

    devices: int
    window_s: float
    seconds: dict[str, float]  # ACCOUNT's categories, in its order
    thresholds: dict[str, int] = {}  # role -> the batch from which decoding counts as busy
    roles: dict[str, RoleTime] = {}  # inference role -> its engine time, summing to the total

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def fractions(self) -> dict[str, float]:
        whole = max(self.devices * self.window_s, 1e-12)
        return {k: v / whole for k, v in self.seconds.items()}


class Ledger:
    """The events a time account is made of, as they happen (appends only: cheap enough for
    every engine segment of a 1,024-device simulation)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[int, ...], int] = {}  # device tuples, interned
        self.group_devices: list[tuple[int, ...]] = []
        self._roles: dict[str, int] = {}
        # engine segments: [start, prefill end) busy, [.., re-prefill end) re-prefilling,
        # [.., end) decoding ``running`` sequences of a replica of role ``role``
        self._seg_group = array("q")
        self._seg = array("d")  # start, prefill end, re-prefill end, end (4 per segment)
        self._seg_running = array("q")
        self._seg_role = array("q")
        self._spans: dict[str, tuple[array, array]] = {
            "training": (array("q"), array("d")),
            "in_transit": (array("q"), array("d")),
        }
        self._holds = (array("q"), array("d"), array("q"))  # group, at, holder

    def group(self, devices: Iterable[int]) -> int:
        key = tuple(devices)
        found = self._groups.get(key)
        if found is None:
            found = self._groups[key] = len(self.group_devices)
            self.group_devices.append(key)
        return found

    def segment(
        self,
        devices: tuple[int, ...],
        role: str,
        start: float,
        end: float,
        running: int,
        prefill_s: float,
        reprefill_s: float,
    ) -> None:
        """An engine of ``role`` ran from ``start`` to ``end`` on ``devices``: first
        ``prefill_s`` of prefill (the last ``reprefill_s`` of it re-prefilling), then
        decoding ``running`` sequences."""
        group = self._groups.get(devices)
        self._seg_group.append(self.group(devices) if group is None else group)
        role_id = self._roles.get(role)
        if role_id is None:
            role_id = self._roles[role] = len(self._roles)
        self._seg_role.append(role_id)
        self._seg_running.append(running)
        prefilled = min(start + prefill_s, end)
        self._seg.extend(
            (start, min(start + max(prefill_s - reprefill_s, 0.0), end), prefilled, end)
        )

    def _span(self, kind: str, devices: Iterable[int], start: float, end: float) -> None:
        groups, times = self._spans[kind]
        groups.append(self.group(devices))
        times.extend((start, end))

    def training(self, devices: Iterable[int], start: float, end: float) -> None:
        self._span("training", devices, start, end)

    def transit(self, devices: Iterable[int], start: float, end: float) -> None:
        self._span("in_transit", devices, start, end)

    def hold(self, devices: Iterable[int], holder: Holder, at: float) -> None:
        """From ``at`` on, ``devices`` are held by ``holder`` (until the next ``hold``)."""
        groups, times, holders = self._holds
        groups.append(self.group(devices))
        times.append(at)
        holders.append(_HOLDERS[holder])

    # --- reading -----------------------------------------------------------------------------

    def _expand(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row of ``groups``: its devices, and the row each device came from."""
        sizes = np.array([len(d) for d in self.group_devices], dtype=np.int64)
        flat = np.array([d for g in self.group_devices for d in g], dtype=np.int64)
        offsets = np.concatenate(([0], np.cumsum(sizes)))
        counts = sizes[groups]
        rows = np.repeat(np.arange(groups.size), counts)
        within = np.arange(rows.size) - np.repeat(np.cumsum(counts) - counts, counts)
        return flat[offsets[groups[rows]] + within], rows

    def segments(self, near: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every segment's device group, its four times, and whether it decoded at or near
        the efficient batch (``near``: role -> the smallest such batch; a role not named has
        none, all of its decoding is busy)."""
        groups = _ints(self._seg_group)
        times = _floats(self._seg).reshape(-1, 4)
        limit = np.zeros(max(len(self._roles), 1), dtype=np.int64)
        for role, i in self._roles.items():
            limit[i] = near.get(role, 0)
        busy = _ints(self._seg_running) >= limit[_ints(self._seg_role)]
        return groups, times, busy

    def segment_roles(self) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
        """The roles' ids, and every segment's role id and running sequences."""
        return dict(self._roles), _ints(self._seg_role), _ints(self._seg_running)

    def spans(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        groups, times = self._spans[kind]
        return _ints(groups), _floats(times).reshape(-1, 2)

    def holds(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        groups, times, holders = self._holds
        return _ints(groups), _floats(times), _ints(holders)


def _ints(values: array) -> np.ndarray:
    return np.frombuffer(values, dtype=np.int64) if values else np.zeros(0, np.int64)


def _floats(values: array) -> np.ndarray:
    return np.frombuffer(values, dtype=np.float64) if values else np.zeros(0)


def _union(intervals: np.ndarray) -> np.ndarray:
    """The union of [start, end) intervals as sorted disjoint ones."""
    if not len(intervals):
        return intervals.reshape(0, 2)
    order = np.argsort(intervals[:, 0], kind="stable")
    s, e = intervals[order, 0], intervals[order, 1]
    reach = np.maximum.accumulate(e)
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    starts = s[new]
    ends = np.maximum.reduceat(reach, np.flatnonzero(new))
    return np.column_stack([starts, ends])


# sweep categories, in priority order; the last three are who holds a device, and "dry"
# marks the times no inference engine runs anything
_ENGINE, _TRAINING, _TRANSIT, _INFERENCE, _TRAINER, _FREE, _DRY = range(7)


def account(
    ledger: Ledger,
    window: tuple[float, float],
    devices: int,
    *,
    thresholds: Mapping[str, int] | None = None,
) -> TimeAccount:
    """The time account of ``devices`` devices (ids 0..devices-1) over ``window``."""
    t0, t1 = window
    span = max(t1 - t0, 0.0)
    groups, seg, busy = ledger.segments(thresholds or {})
    clipped = np.clip(seg, t0, t1)
    seconds = dict.fromkeys(ACCOUNT, 0.0)
    roles: dict[str, RoleTime] = {}
    sizes = np.array([len(d) for d in ledger.group_devices] or [0], dtype=np.float64)
    if groups.size:
        weight = sizes[groups]
        fresh = (clipped[:, 1] - clipped[:, 0]) * weight
        again = (clipped[:, 2] - clipped[:, 1]) * weight
        decode = (clipped[:, 3] - clipped[:, 2]) * weight
        roles = _by_role(ledger, fresh, again, decode, busy)
        for category in ENGINE:
            seconds[category] = sum(getattr(r, category) for r in roles.values())

    # every other category by a sweep over each device's intervals, in priority order
    dev_parts, t_parts, cat_parts = [], [], []

    def add(kind: int, group_rows: np.ndarray, times: np.ndarray) -> None:
        if not group_rows.size:
            return
        dev, rows = ledger._expand(group_rows)
        dev_parts.append(dev)
        t_parts.append(np.clip(times[rows], t0, t1))
        cat_parts.append(np.full(dev.size, kind, dtype=np.int64))

    add(_ENGINE, groups, seg[:, [0, 3]])
    for kind, name in ((_TRAINING, "training"), (_TRANSIT, "in_transit")):
        add(kind, *ledger.spans(name))
    # holds: each device's holder from one hold to its next (the last one to the window's end)
    hg, ht, hh = ledger.holds()
    if hg.size:
        dev, rows = ledger._expand(hg)
        at, holder = ht[rows], hh[rows]
        order = np.lexsort((np.arange(dev.size), at, dev))  # a device's holds in time order
        dev, at, holder = dev[order], at[order], holder[order]
        last = np.append(dev[1:] != dev[:-1], True)
        until = np.where(last, max(t1, t0), np.append(at[1:], 0.0))
        times = np.column_stack([at, until])
        dev_parts.append(dev)
        t_parts.append(np.clip(times, t0, t1))
        cat_parts.append(_INFERENCE + holder)
    dry = _dry(clipped[:, [0, 3]], t0, t1)
    if len(dry):
        dev = np.repeat(np.arange(devices, dtype=np.int64), len(dry))
        dev_parts.append(dev)
        t_parts.append(np.tile(dry, (devices, 1)))
        cat_parts.append(np.full(dev.size, _DRY, dtype=np.int64))
    waits = _sweep(dev_parts, t_parts, cat_parts)
    seconds["training"] = waits[_TRAINING]
    seconds["in_transit"] = waits[_TRANSIT]
    seconds["idle"] = waits[_INFERENCE] + waits[_FREE]
    seconds["stalled_on_trainer"] = waits[_DRY]
    seconds["trainer_waiting"] = waits[_TRAINER]
    return TimeAccount(
        devices=devices,
        window_s=span,
        seconds=seconds,
        thresholds=dict(thresholds or {}),
        roles=roles,
    )


def _by_role(
    ledger: Ledger, fresh: np.ndarray, again: np.ndarray, decode: np.ndarray, busy: np.ndarray
) -> dict[str, RoleTime]:
    """The engine categories per role, from the segments' clipped device-seconds."""
    ids, role, running = ledger.segment_roles()
    n = max(ids.values(), default=-1) + 1

    def per_role(values: np.ndarray) -> np.ndarray:
        return np.bincount(role, weights=values, minlength=n)

    busy_s = per_role(fresh + np.where(busy, decode, 0.0))
    under_s = per_role(np.where(busy, 0.0, decode))
    again_s = per_role(again)
    decode_s = per_role(decode)
    batch = per_role(decode * running)
    return {
        name: RoleTime(
            busy=float(busy_s[i]),
            under_filled=float(under_s[i]),
            re_prefilling=float(again_s[i]),
            decode_batch=float(batch[i] / decode_s[i]) if decode_s[i] > 0 else 0.0,
        )
        for name, i in sorted(ids.items())
    }


def _dry(engine: np.ndarray, t0: float, t1: float) -> np.ndarray:
    """The parts of [t0, t1) in which no engine runs."""
    busy = _union(engine[engine[:, 1] > engine[:, 0]])
    edges = np.concatenate(([t0], busy.ravel(), [t1]))
    gaps = edges.reshape(-1, 2)
    return gaps[gaps[:, 1] > gaps[:, 0]]


def _sweep(
    dev_parts: list[np.ndarray], t_parts: list[np.ndarray], cat_parts: list[np.ndarray]
) -> dict[int, float]:
    """Seconds each device spends in its highest-priority category, summed over devices. An
    inference-held device waiting while the inference side is dry counts under ``_DRY``; the
    engine's time is left out (``account`` splits it exactly)."""
    out = dict.fromkeys(range(7), 0.0)
    if not dev_parts:
        return out
    dev = np.concatenate(dev_parts)
    times = np.concatenate(t_parts)
    cat = np.concatenate(cat_parts)
    keep = times[:, 1] > times[:, 0]
    dev, times, cat = dev[keep], times[keep], cat[keep]
    n = dev.size
    ev_dev = np.concatenate([dev, dev])
    ev_t = np.concatenate([times[:, 0], times[:, 1]])
    ev_cat = np.concatenate([cat, cat])
    delta = np.concatenate([np.ones(n, np.int64), -np.ones(n, np.int64)])
    order = np.lexsort((ev_t, ev_dev))
    ev_dev, ev_t, ev_cat, delta = ev_dev[order], ev_t[order], ev_cat[order], delta[order]
    length = np.zeros(ev_t.size)
    same = ev_dev[1:] == ev_dev[:-1]
    length[:-1] = np.where(same, ev_t[1:] - ev_t[:-1], 0.0)
    active = np.zeros((7, ev_t.size), dtype=bool)
    for c in range(7):
        active[c] = np.cumsum(np.where(ev_cat == c, delta, 0)) > 0
    chosen = np.full(ev_t.size, -1, dtype=np.int64)
    for c in (_FREE, _TRAINER, _INFERENCE, _TRANSIT, _TRAINING, _ENGINE):  # lowest first
        chosen[active[c]] = c
    stalled = (chosen == _INFERENCE) & active[_DRY]
    chosen[stalled] = _DRY
    for c in out:
        out[c] = float(length[chosen == c].sum())
    return out


__all__ = ["ACCOUNT", "ENGINE", "Holder", "Ledger", "RoleTime", "TimeAccount", "account"]
