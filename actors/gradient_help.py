"""Gradient helpers for the DeepSpeed trainer: inference replicas with nothing to run compute
the gradients of some of the step's micro-batches while the trainer's ranks compute the rest
(the simulated trainer models the same, ``pivot.engines.helped_step``).

How a step is shared. Each rank runs its share of the batch in micro-batches; round ``j`` is
micro-batch ``j`` on every rank. Before each round, rank 0 names the round every rank runs
next (``HelpedRounds.next_round``, broadcast to the others). A helper the Controller offers
mid-step claims rounds no rank has started, from the last one back, in proportion to its
devices against the ranks' (``claim``): the helper then computes every rank's micro-batch of
those rounds. Once no round is left, rank 0 waits for the helpers' gradients (``settle``), at
most as long as the ranks would take to run the helpers' rounds themselves; a helper that
failed or is late gives its rounds back, and the ranks run them (its gradient, if it comes
later, is dropped). Then every rank runs one more backward, of ``sum(p * g)`` over the
parameters with ``g`` the helpers' summed gradient on rank 0 and zero elsewhere: DeepSpeed
averages it with the ranks' as it does every micro-batch's, so the step's gradient is the
batch's, without reaching into DeepSpeed's gradient buffers. A helper's loss is divided by
the same denominator as a rank's (the batch's tokens over the world size), so its gradient
counts as one rank's share of that work would.

Limits (``DeepSpeedTrainer.takes_helpers``): CPU only, since a helper reads the policy from
GPS into a Hugging Face model of the policy's folder on its host (built once per agent, so a
job's first help is usually too late and dropped) and keeps its engine loaded, which on a
GPU that serves another model would not fit; no ZeRO-3 (its parameters are partitioned
outside the forward), nor a loss with a KL term (the helper holds no reference policy).

    GradientWorker().compute(ComputeGradients) -> HelperGradients   (an agent; blocking)
    HelpedRounds(micro_batches, denominator=...)                     (rank 0 of the step)
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from pivot.actors.tensor_wire import batch_from_wire, tensors_from_wire, tensors_to_wire
from pivot.actors.trainer_messages import ComputeGradients, HelperGradients
from pivot.grpo import GRPOBatch, LossSums, micro_batch_loss
from pivot.timeline import HelperSpan


class GradientWorker:
    """An agent's side of gradient help: the policy's model, built on first use. One request
    at a time: the agent's device computes one, and transformers' loading patches module
    globals, so two models built at once on two threads come out half on the meta device."""

    def __init__(self) -> None:
        self._models: dict[str, torch.nn.Module] = {}
        self._lock = threading.Lock()

    def _model(self, policy: str) -> torch.nn.Module:
        model = self._models.get(policy)
        if model is None:
            from transformers import AutoConfig

            from pivot.engines.hf_engine import causal_lm_class

            config = AutoConfig.from_pretrained(policy)
            config.use_cache = False
            model = causal_lm_class(config).from_pretrained(
                policy, config=config, dtype=torch.float32
            )
            model.train()  # as the trainer's engine runs it
            self._models[policy] = model
        return model

    def compute(self, msg: ComputeGradients) -> HelperGradients:
        with self._lock:
            return self._compute(msg)

    def _compute(self, msg: ComputeGradients) -> HelperGradients:
        from pivot.actors.param_store import ParameterReader

        model = self._model(msg.policy)
        with ParameterReader(msg.store, name="gradient-helper") as reader:
            version = reader.read(model.state_dict())
        if version != msg.version:
            # the step has ended (its version is published): an answer, not an error, since
            # a helper's first request, which builds the model, is often that late
            return HelperGradients(grads={}, sums=[], stale=True)
        model.zero_grad(set_to_none=True)
        sums = LossSums()
        for wire in msg.batches:
            loss, part = micro_batch_loss(
                model, batch_from_wire(wire), msg.settings, denominator=msg.denominator
            )
            loss.backward()
            sums = sums + part
        grads = {
            name: (p.grad if p.grad is not None else torch.zeros_like(p))
            for name, p in model.named_parameters()
            if p.requires_grad
        }
        model.zero_grad(set_to_none=True)
        return HelperGradients(grads=tensors_to_wire(grads), sums=sums.as_tensor().tolist())


@dataclass
class _Claim:
    replica: str
    devices: tuple[int, ...]
    rounds: list[int]
    joined_at: float
    result: concurrent.futures.Future[HelperGradients] = field(
        default_factory=concurrent.futures.Future
    )
    ended_at: float | None = None
    dropped: bool = False  # failed or late: its rounds went back to the ranks


class HelpedRounds:
    """The rounds of one step on rank 0: ``micro_batches[r][j]`` is rank ``r``'s micro-batch
    of round ``j``; ``denominator``: what the ranks divide their token losses by.
    ``next_round`` and ``settle`` run on the ranks' thread, ``claim`` and ``deliver`` on the
    event loop's; ``clock``: seconds on the trainer's scale."""

    def __init__(
        self,
        micro_batches: Sequence[Sequence[GRPOBatch]],
        *,
        denominator: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.micro_batches = micro_batches
        self.denominator = denominator
        self.world_size = len(micro_batches)
        rounds = len(micro_batches[0]) if micro_batches else 0
        self.clock = clock
        self._lock = threading.Lock()
        self._open = list(range(rounds))  # rounds no rank started and no helper holds
        self._claims: list[_Claim] = []
        self._ran = 0  # rounds the ranks ran
        self._started = clock()
        self._closed = False

    def next_round(self) -> int | None:
        """The round the ranks run next (the lowest open one); None: none is open."""
        with self._lock:
            if not self._open:
                return None
            self._ran += 1
            return self._open.pop(0)

    def claim(self, replica: str, devices: Sequence[int]) -> list[int]:
        """The rounds a helper of ``devices`` takes (none once the ranks are done): of those
        open, its devices' share against the ranks' and the helpers' already out, from the
        last round back; the ranks keep at least one."""
        with self._lock:
            if self._closed:
                return []
            out = sum(len(c.devices) for c in self._claims if not c.dropped and not c.result.done())
            share = len(devices) / (self.world_size + out + len(devices))
            k = round(len(self._open) * share)
            if k < 1 or k >= len(self._open):
                return []
            taken, self._open = self._open[-k:], self._open[:-k]
            self._claims.append(_Claim(replica, tuple(devices), taken, self.clock()))
            return taken

    def batches(self, rounds: Sequence[int]) -> list[GRPOBatch]:
        """Every rank's micro-batch of ``rounds``."""
        return [per_rank[j] for j in rounds for per_rank in self.micro_batches]

    def deliver(
        self, replica: str, reply: HelperGradients | None, error: BaseException | None = None
    ) -> None:
        """A helper's gradient (or its failure) came back."""
        for c in self._claims:
            if c.replica == replica and not c.result.done():
                if error is not None:
                    c.result.set_exception(error)
                else:
                    c.result.set_result(reply)  # type: ignore[arg-type]
                return

    def settle(self) -> bool:
        """Once no round is open: wait for the helpers, each at most as long as the ranks
        would take to run its rounds; a helper that failed or is late gives its rounds back.
        Whether rounds are open again (then the ranks run them and settle once more);
        False: the step is closed to helpers."""
        with self._lock:
            pending = [c for c in self._claims if not c.dropped and c.ended_at is None]
        per_round = (self.clock() - self._started) / max(self._ran, 1)
        for c in pending:
            try:
                c.result.result(timeout=max(len(c.rounds) * per_round, 0.05))
            except Exception:  # noqa: BLE001 - any failure: the ranks do its work
                c.dropped = True
            c.ended_at = self.clock()
        with self._lock:
            for c in pending:
                if c.dropped:
                    self._open.extend(c.rounds)
            self._open.sort()
            if self._open:
                return True
            self._closed = True
            return False

    def gradients(self) -> tuple[dict[str, torch.Tensor] | None, LossSums]:
        """The helpers' summed gradient (None: no helper's came) and loss sums."""
        total: dict[str, torch.Tensor] | None = None
        sums = LossSums()
        for c in self._claims:
            if c.dropped or not c.result.done() or c.result.exception() is not None:
                continue
            reply = c.result.result()
            grads = tensors_from_wire(reply.grads)
            total = grads if total is None else _add(total, grads)
            sums = sums + LossSums.from_tensor(torch.tensor(reply.sums, dtype=torch.float64))
        return total, sums

    def spans(self) -> tuple[HelperSpan, ...]:
        """Each helper the step took, computing from when it was taken until its gradient
        came (or it was given up)."""
        spans = []
        for c in self._claims:
            end = c.ended_at if c.ended_at is not None else self.clock()
            spans.append(HelperSpan(c.replica, c.devices, c.joined_at, c.joined_at, end, end))
        return tuple(spans)


def _add(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: a[name] + b[name] for name in a}
