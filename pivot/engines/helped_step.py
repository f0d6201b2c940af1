"""A simulated train step that gradient helpers join: inference replicas with nothing to run
compute gradients for some of the step's remaining micro-batches and reduce them into the
trainer's shards; the optimizer state and the optimizer step stay on the trainer's pool.

The step's token work (``SimTrainer.token_work_s``, in device-seconds) is processed at one
device-second per second per device working on it: the pool's devices from the step's start,
each helper's from when it is ready. A step is many micro-batches, small against the whole, so
the split is taken as continuous. Once the work is done, if any helper computed, the helpers'
summed gradients are reduced into the trainer's shards; then the optimizer step
(``fixed_step_s``) and the GPS write of the new policy, as without helpers.

What a helper costs (the assumptions, from the workload's ``[shift]`` costs):

* joining: its engine releases its KV cache and engine memory (``engine_release_s``), then it
  reads the policy version the step differentiates from GPS in its own layout (bf16 bytes per
  device over ``gps_read_gb_per_s``). A rollout replica usually holds that version already;
  it pays the read anyway (the conservative choice). It computes from then on.
* the reduce: ``params * 2`` bytes (the bf16 gradient) at ``gps_write_gb_per_s``, once per
  step, on the critical path, however many helpers joined.
* returning: its engine wakes (``engine_wake_s``) and, where its role serves another model
  than the policy (the GenRM), reads that model back from GPS; this overlaps the optimizer
  step and the GPS write, and whatever of it is left after the write lengthens the step, so a
  helper is back before the batch after the step is admitted. A rollout helper reads the new
  policy when it next serves, as every rollout replica does after a step.

A helper joins only where it makes the step end sooner (``HelpedStep.join``), its costs
included. Pure: the times are the caller's.
"""

from __future__ import annotations

from typing import NamedTuple

from pivot.timeline import HelperSpan


class Helper(NamedTuple):
    replica: str
    devices: tuple[int, ...]
    joined_at: float
    ready_at: float  # released and holding the policy: computes from here
    return_s: float  # from the reduce's end until it serves its role again


class HelpedStep:
    """One step's timeline from ``start``: ``work_s`` device-seconds of token work on
    ``pool_devices``, then (with helpers) ``reduce_s``, then ``tail_s`` (the optimizer step and
    the GPS write)."""

    def __init__(
        self,
        *,
        start: float,
        work_s: float,
        pool_devices: int,
        reduce_s: float,
        tail_s: float,
    ) -> None:
        if pool_devices < 1:
            raise ValueError(f"a step needs >= 1 pool device, got {pool_devices}")
        if work_s < 0 or reduce_s < 0 or tail_s < 0:
            raise ValueError("work_s, reduce_s and tail_s must be >= 0")
        self.start = start
        self.work_s = work_s
        self.pool_devices = pool_devices
        self.reduce_s = reduce_s
        self.tail_s = tail_s
        self.helpers: tuple[Helper, ...] = ()

    def computed_at(self, helpers: tuple[Helper, ...] | None = None) -> float:
        """When the token work is done with ``helpers`` (default: those that joined)."""
        left, t, rate = self.work_s, self.start, float(self.pool_devices)
        for h in sorted(self.helpers if helpers is None else helpers, key=lambda h: h.ready_at):
            if h.ready_at >= t + left / rate:
                break
            if h.ready_at > t:
                left -= rate * (h.ready_at - t)
                t = h.ready_at
            rate += len(h.devices)
        return t + left / rate

    def _computing(self, helpers: tuple[Helper, ...], computed: float) -> list[Helper]:
        return [h for h in helpers if h.ready_at < computed]

    def end(self, helpers: tuple[Helper, ...] | None = None) -> float:
        """When the step is over (the new policy published, every helper back)."""
        helpers = self.helpers if helpers is None else helpers
        computed = self.computed_at(helpers)
        computing = self._computing(helpers, computed)
        if not computing:
            return computed + self.tail_s
        reduced = computed + self.reduce_s
        back = max(h.return_s for h in computing)
        return reduced + max(self.tail_s, back)

    def join(self, helper: Helper) -> bool:
        """Take ``helper`` if the step then ends sooner; whether it was taken."""
        with_it = (*self.helpers, helper)
        if self.end(with_it) >= self.end():
            return False
        self.helpers = with_it
        return True

    def spans(self) -> list[HelperSpan]:
        """Each helper that joined, over the step as it ran (one that never computed: in
        transit until the work was done)."""
        computed = self.computed_at()
        reduced = computed + self.reduce_s
        out = []
        for h in self.helpers:
            if h.ready_at < computed:
                out.append(
                    HelperSpan(
                        h.replica, h.devices, h.joined_at, h.ready_at, reduced, reduced + h.return_s
                    )
                )
            else:
                ready = max(h.joined_at, computed)
                out.append(HelperSpan(h.replica, h.devices, h.joined_at, ready, ready, ready))
        return out
