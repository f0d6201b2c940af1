"""When the batch the trainer waits for will be ready: priced by the tail of the batch before.

The Driver tells ``TailForecast`` how many samples of each batch in flight are still unscored
each time the count changes, from the batch's submission on; the profile of the batch that
finished last (how long its last n samples took, for every n) prices any batch's count in
seconds. Consecutive batches share the workload and the cluster, so the time the last n
samples take is what the previous batch's last n took. A count above any the previous batch
reached, or no batch finished yet, has no forecast. Pure: the caller passes the time.
"""

from __future__ import annotations


class TailForecast:
    def __init__(self) -> None:
        self._profile: list[float] = []  # index n: seconds the last batch's last n samples took
        self._first: dict[int, dict[int, float]] = {}  # per batch: when each count was reached

    def left(self, batch: int, count: int, now: float) -> float | None:
        """``count`` samples of ``batch`` are still unscored at ``now``: seconds until it is
        ready (None: no forecast). At 0 it is ready: its profile prices the batches after it."""
        if count < 0:
            raise ValueError(f"a batch cannot have {count} samples left")
        first = self._first.setdefault(batch, {})
        seen = bool(first)
        first.setdefault(count, now)
        if count == 0:
            del self._first[batch]
            if seen:  # (one seen only once done tells nothing of its tail)
                self._done(first, now)
            return 0.0
        return self._profile[count] if count < len(self._profile) else None

    def _done(self, first: dict[int, float], now: float) -> None:
        profile = []
        earliest = now
        for count in range(max(first) + 1):
            # counts fall, several at once at times: "n left" began when the count first
            # reached n or less
            earliest = min(earliest, first.get(count, earliest))
            profile.append(now - earliest)
        self._profile = profile
