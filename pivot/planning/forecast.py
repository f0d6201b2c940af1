"""When the batch the trainer waits for will be ready, priced by the tail of the batch before
(``TailForecast``), and how far ahead of that the trainer pool is reclaimed (``ReclaimLead``).

The Driver tells ``TailForecast`` how many samples of each batch in flight are still unscored
each time the count changes, from the batch's submission on; the profile of the batch that
finished last (how long its last n samples took, for every n) prices any batch's count in
seconds. Consecutive batches share the workload and the cluster, so the time the last n
samples take is what the previous batch's last n took. A count above any the previous batch
reached, or no batch finished yet, has no forecast.

The forecast prices a tail that an early reclaim itself slows: the evicted replicas'
sequences of the batch go back to the queue and finish on the devices left. Where the pool
is most of the cluster (the 72B group's 96 of 128 devices) the batch then comes seconds after
the pool is back, and the next profile, priced on that slower tail, reclaims earlier still.
``ReclaimLead`` corrects the lead by what the trainer measures: how long the pool and the
batch missed each other. Pure: the caller passes the time.
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


class ReclaimLead:
    """How long before the forecast readiness the lent pool is reclaimed: the reclaim's own
    time, less a correction learnt from each reclaim that ended before or after its batch
    came (``observe``). ``gain``: the share of each miss corrected (0: the reclaim's time
    alone); the correction stays within the reclaim's time either way, so that a lead driven
    to 0 (no early reclaim) is still corrected back by the batches that wait for the pool."""

    def __init__(self, gain: float = 0.5) -> None:
        if not 0.0 <= gain <= 1.0:
            raise ValueError(f"gain must be within 0..1, got {gain}")
        self.gain = gain
        self.correction_s = 0.0  # > 0: reclaim that much later than the reclaim's time says

    def lead(self, reclaim_s: float) -> float:
        """Seconds ahead of the forecast readiness to start a reclaim that takes ``reclaim_s``."""
        return max(reclaim_s - self.correction_s, 0.0)

    def observe(self, slack_s: float, reclaim_s: float) -> None:
        """The pool came back ``slack_s`` seconds before its batch (< 0: the batch waited that
        long for it) on a reclaim that takes ``reclaim_s``."""
        bound = max(reclaim_s, 0.0)
        corrected = self.correction_s + self.gain * slack_s
        self.correction_s = min(max(corrected, -bound), bound)
