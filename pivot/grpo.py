"""GRPO, the training half of the RL step: the math (group-normalised advantages, the clipped
token-level policy loss), the padded training batch built from scored completions, the
trainer's settings, and the ``TrainingEngine`` protocol every training backend implements
(DESIGN.md, "Engines").

The algorithm is the one the paper's launchers run (reference/paper-notes.md §2.7): GRPO
without KL, PPO-style ratio against the behaviour logprobs recorded at rollout, clip
0.2 / 0.28 (asymmetric, "clip-higher"), dual clip at 10 for negative advantages, loss averaged
over every response token of the batch ("token-mean"), gradient clipping at 1.0. A KL term
against a reference policy is available but off by default.

Token-mean across micro-batches and data-parallel ranks: each micro-batch's loss is the sum
of its token losses divided by one denominator given by the caller (the batch's token count,
divided by the data-parallel world size when ranks average their gradients), so that the
gradients added up over micro-batches (and averaged over ranks) are the gradient of the
whole batch's token mean, however the rows were split.

Which response tokens train (``build_batch``). A token whose loss mask is 0 (a tool's or the
environment's, in a multi-turn trajectory) is read by the model but never trained on: it is
out of the loss and its logprob is ignored. The staleness rule: a token sampled by a policy
older than ``version - max_staleness`` (``version``: the policy the step trains from) is masked
out of the loss too, and counted (``TrainStats.stale_tokens``). That is a guard, not a filter:
the Driver admits a rollout only while its policy is within the bound, so a healthy run masks
none. Every other token trains with the PPO ratio against the behaviour logprob it was
sampled with, whichever policy sampled it: that ratio is the importance correction for a
token of an older policy, and the clip bounds it. A sample whose tokens are all masked
trains nothing (its reward still counts in its group's advantages).

Pure and synchronous: torch tensors in, tensors out, no clock (a backend measures its own
time), no processes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

import torch

from pivot.training import RolloutSample, TrainingSettings, TrainStats

# re-exported: the trainer's data types live in the torch-free pivot.training
__all__ = ["BatchError", "RolloutSample", "TrainStats", "TrainingSettings"]


class BatchError(ValueError):
    """Samples that cannot make a training batch; the message names the sample and why."""


# ---- advantages -------------------------------------------------------------------------------


def group_advantages(
    rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: per prompt group, (reward - group mean) / (group std + eps).

    The std is the sample one (Bessel-corrected, as ``torch.std``). A group whose rewards are
    all equal (std 0) carries no signal and gets advantage 0 exactly; so does a group of one
    sample (its std is undefined).
    """
    if rewards.shape != groups.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and groups must be 1-d and of one shape, found {tuple(rewards.shape)} "
            f"and {tuple(groups.shape)}"
        )
    rewards = rewards.to(torch.float64)
    out = torch.zeros_like(rewards)
    for group in torch.unique(groups):
        members = groups == group
        r = rewards[members]
        if r.numel() < 2:
            continue
        std = r.std()
        if std.item() <= 0.0:
            continue
        out[members] = (r - r.mean()) / (std + eps)
    return out.to(torch.float32)


# ---- the loss ---------------------------------------------------------------------------------


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Logprob of each next token: position t of the result scores ``input_ids[:, t + 1]``
    under softmax(logits[:, t] / temperature). Shape [B, T - 1], float32."""
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)


@dataclass
class LossSums:
    """Token counts and sums over response tokens, added up over micro-batches and ranks
    and turned into means once (``mean``)."""

    tokens: float = 0.0
    loss: float = 0.0  # the token losses' sum
    clipped: float = 0.0
    ratio: float = 0.0
    kl: float = 0.0

    def __add__(self, other: LossSums) -> LossSums:
        return LossSums(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, values: torch.Tensor) -> LossSums:
        return cls(*(float(v) for v in values.tolist()))

    def mean(self, name: str) -> float:
        return getattr(self, name) / self.tokens if self.tokens else 0.0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 10.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    denominator: float | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """The clipped GRPO policy loss over response tokens, and its sums for statistics.

    Per token, with ratio r = exp(logprob - old_logprob) and advantage A (per token, or per
    sequence broadcast over its tokens):
        loss = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        with A < 0 and a dual clip c: loss = min(loss, -A c)
    plus ``kl_coef`` * k3(ref || new) when a reference is given (k3 = e^d - d - 1 with
    d = ref_logprob - logprob). The result is the masked sum divided by ``denominator``
    (default: the mask's token count, i.e. the token mean of these rows).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    advantages = advantages.to(logprobs.dtype)
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    was_clipped = clipped > unclipped
    if dual_clip is not None:
        floor = -advantages * dual_clip
        dual = (advantages < 0) & (losses > floor)
        losses = torch.where(dual, floor, losses)
        was_clipped = was_clipped | dual
    kl_sum = 0.0
    if ref_logprobs is not None and kl_coef > 0.0:
        d = ref_logprobs - logprobs
        kl = torch.exp(d) - d - 1.0
        losses = losses + kl_coef * kl
        kl_sum = float((kl.detach() * mask).sum())
    tokens = float(mask.sum())
    if denominator is None:
        denominator = max(tokens, 1.0)
    loss = (losses * mask).sum() / denominator
    with torch.no_grad():
        sums = LossSums(
            tokens=tokens,
            loss=float((losses * mask).sum()),
            clipped=float((was_clipped.to(mask.dtype) * mask).sum()),
            ratio=float((ratio * mask).sum()),
            kl=kl_sum,
        )
    return loss, sums


def micro_batch_loss(
    model: torch.nn.Module,
    micro: GRPOBatch,
    settings: TrainingSettings,
    *,
    denominator: float,
    ref_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossSums]:
    """``policy_loss`` of one micro-batch under ``model`` (a causal LM, or an engine that
    wraps one), with ``settings``' temperature and clips: what a trainer rank and a gradient
    helper each run."""
    logits = model(input_ids=micro.input_ids, use_cache=False).logits
    logprobs = token_logprobs(logits, micro.input_ids, settings.temperature)
    return policy_loss(
        logprobs,
        micro.old_logprobs,
        micro.advantages,
        micro.response_mask,
        clip_low=settings.clip_low,
        clip_high=settings.clip_high,
        dual_clip=settings.dual_clip,
        ref_logprobs=ref_logprobs,
        kl_coef=settings.kl_coef,
        denominator=denominator,
    )


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The learning-rate multiplier of optimizer step ``step`` (0-based): linear from
    1 / warmup_steps up to 1 at step warmup_steps - 1, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


# ---- the batch --------------------------------------------------------------------------------


@dataclass
class GRPOBatch:
    """Scored completions as padded tensors.

    Rows are prompt + response, right-padded with ``pad_id``. Column t of the [B, T - 1]
    tensors is about the token at t + 1 (the one position t predicts): ``response_mask`` is
    1 where that token is a response token the loss trains on, ``old_logprobs`` holds its
    behaviour logprob (0 elsewhere). ``advantages`` is per sequence, and so are ``masked``
    and ``stale``: the response tokens left out of the loss for their loss mask and for the
    staleness rule. Right padding needs no attention mask: under causal attention no real
    token sees a pad, and pads are masked out of the loss.
    """

    input_ids: torch.Tensor  # [B, T] int64
    response_mask: torch.Tensor  # [B, T - 1] float32
    old_logprobs: torch.Tensor  # [B, T - 1] float32
    advantages: torch.Tensor  # [B] float32
    rewards: torch.Tensor  # [B] float32
    groups: torch.Tensor  # [B] int64
    masked: torch.Tensor  # [B] int64
    stale: torch.Tensor  # [B] int64
    pad_id: int = 0

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def tokens(self) -> int:
        """Response tokens the loss trains on: what it averages over."""
        return int(self.response_mask.sum().item())

    @property
    def masked_tokens(self) -> int:
        return int(self.masked.sum().item())

    @property
    def stale_tokens(self) -> int:
        return int(self.stale.sum().item())

    def rows(self, index: torch.Tensor | Sequence[int] | slice) -> GRPOBatch:
        """The batch of the given rows, trimmed to the longest of them."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        ids = self.input_ids[index]
        mask = self.response_mask[index]
        used = mask.any(dim=0).nonzero()
        # column t needs tokens up to t + 1; two columns at least, so that rows without
        # response tokens still run a (zero-loss) forward like the others
        width = min(max(int(used[-1]) + 2 if used.numel() else 0, 2), ids.shape[1])
        return GRPOBatch(
            input_ids=ids[:, :width],
            response_mask=mask[:, : width - 1],
            old_logprobs=self.old_logprobs[index][:, : width - 1],
            advantages=self.advantages[index],
            rewards=self.rewards[index],
            groups=self.groups[index],
            masked=self.masked[index],
            stale=self.stale[index],
            pad_id=self.pad_id,
        )

    def to(self, device: torch.device | str) -> GRPOBatch:
        """The batch's tensors on ``device`` (this batch when they are there already)."""
        if self.input_ids.device == torch.device(device):
            return self
        return GRPOBatch(
            input_ids=self.input_ids.to(device),
            response_mask=self.response_mask.to(device),
            old_logprobs=self.old_logprobs.to(device),
            advantages=self.advantages.to(device),
            rewards=self.rewards.to(device),
            groups=self.groups.to(device),
            masked=self.masked.to(device),
            stale=self.stale.to(device),
            pad_id=self.pad_id,
        )

    def padded_to(self, size: int) -> GRPOBatch:
        """The batch with empty rows appended up to ``size`` rows: a pad token each, no
        response tokens, so they add nothing to the loss (ranks that must run the same number
        of micro-batches get them)."""
        extra = size - self.size
        if extra <= 0:
            return self
        width = self.input_ids.shape[1]
        return GRPOBatch(
            input_ids=torch.cat(
                [self.input_ids, torch.full((extra, width), self.pad_id, dtype=torch.long)]
            ),
            response_mask=torch.cat([self.response_mask, torch.zeros(extra, width - 1)]),
            old_logprobs=torch.cat([self.old_logprobs, torch.zeros(extra, width - 1)]),
            advantages=torch.cat([self.advantages, torch.zeros(extra)]),
            rewards=torch.cat([self.rewards, torch.zeros(extra)]),
            groups=torch.cat([self.groups, torch.full((extra,), -1, dtype=torch.long)]),
            masked=torch.cat([self.masked, torch.zeros(extra, dtype=torch.long)]),
            stale=torch.cat([self.stale, torch.zeros(extra, dtype=torch.long)]),
            pad_id=self.pad_id,
        )

    def shard(self, rank: int, world_size: int) -> GRPOBatch:
        """This rank's rows of a data-parallel split: every ``world_size``-th row from
        ``rank`` (striding spreads long and short rows evenly), padded with empty rows so
        that every rank holds the same number."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        per_rank = -(-self.size // world_size)
        return self.padded_to(per_rank * world_size).rows(slice(rank, None, world_size))

    def micro_batches(self, size: int) -> list[GRPOBatch]:
        """Consecutive micro-batches of at most ``size`` rows, each trimmed to its own
        longest row."""
        return [self.rows(slice(i, i + size)) for i in range(0, self.size, size)]


def build_batch(
    samples: Sequence[RolloutSample],
    *,
    pad_id: int,
    advantage_eps: float = 1e-6,
    vocab_size: int | None = None,
    max_len: int | None = None,
    version: int = 0,
    max_staleness: int | None = None,
) -> GRPOBatch:
    """Pad scored completions into a ``GRPOBatch`` with group-normalised advantages; the
    tokens each sample's loss mask excludes, and with ``max_staleness`` those sampled by a
    policy older than ``version - max_staleness`` (``version``: the policy the step trains
    from), are out of the loss (the module docstring states the rule).

    Raises ``BatchError`` naming the first bad sample: an empty prompt or response,
    logprobs, loss mask or versions not one per response token, a loss mask other than
    0 / 1, a trained token without a version, a non-finite reward or a trained token's
    logprob not finite and <= 0, a token id outside the vocabulary, or a sequence longer
    than ``max_len``.
    """
    if not samples:
        raise BatchError("no samples: a training batch needs at least one")
    if max_staleness is not None and max_staleness < 0:
        raise BatchError(f"max_staleness must be >= 0, got {max_staleness}")
    for i, s in enumerate(samples):
        _check_sample(i, s, vocab_size, max_len)
    oldest = version - max_staleness if max_staleness is not None else None
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    response_mask = torch.zeros(n, width - 1)
    old_logprobs = torch.zeros(n, width - 1)
    masked = torch.zeros(n, dtype=torch.long)
    stale = torch.zeros(n, dtype=torch.long)
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        # column t predicts token t + 1: response tokens p .. p + r - 1 sit in columns p - 1 ..
        columns = slice(p - 1, p - 1 + r)
        logprobs = torch.tensor(s.logprobs, dtype=torch.float32)
        if not s.loss_mask and (oldest is None or not s.versions):
            response_mask[i, columns] = 1.0
            old_logprobs[i, columns] = logprobs
            continue
        trained = torch.ones(r, dtype=torch.bool)
        if s.loss_mask:
            trained = torch.tensor(s.loss_mask, dtype=torch.bool)
            masked[i] = r - int(trained.sum())
        if oldest is not None and s.versions:
            too_old = trained & (torch.tensor(s.versions, dtype=torch.long) < oldest)
            stale[i] = int(too_old.sum())
            trained &= ~too_old
        response_mask[i, columns] = trained.float()
        # a left-out token's logprob is ignored: 0, like a pad's, keeps its ratio finite
        old_logprobs[i, columns] = torch.where(trained, logprobs, 0.0)
    rewards = torch.tensor([float(s.reward) for s in samples], dtype=torch.float32)
    groups = torch.tensor([s.group for s in samples], dtype=torch.long)
    return GRPOBatch(
        input_ids=input_ids,
        response_mask=response_mask,
        old_logprobs=old_logprobs,
        advantages=group_advantages(rewards, groups, advantage_eps),
        rewards=rewards,
        groups=groups,
        masked=masked,
        stale=stale,
        pad_id=pad_id,
    )


def _check_sample(i: int, s: RolloutSample, vocab_size: int | None, max_len: int | None) -> None:
    def bad(why: str) -> BatchError:
        return BatchError(f"sample {i} (group {s.group}): {why}")

    if not s.prompt_ids:
        raise bad("empty prompt_ids")
    r = len(s.response_ids)
    if not r:
        raise bad("empty response_ids (nothing to train on)")
    if len(s.logprobs) != r:
        raise bad(
            f"{len(s.logprobs)} logprobs for {r} response tokens "
            "(need one behaviour logprob per response token)"
        )
    for name, per_token in (("loss_mask", s.loss_mask), ("versions", s.versions)):
        if per_token and len(per_token) != r:
            raise bad(f"{name} has {len(per_token)} entries for {r} response tokens (or none)")
    if any(m not in (0, 1) for m in s.loss_mask):
        raise bad("loss_mask holds values other than 0 and 1")
    mask = s.loss_mask or [1] * r
    if s.versions and any(v < 0 for v, m in zip(s.versions, mask, strict=True) if m):
        raise bad("a trained token (loss mask 1) has no policy version (< 0)")
    if not math.isfinite(s.reward):
        raise bad(f"reward is {s.reward}")
    if not all(math.isfinite(x) and x <= 0.0 for x, m in zip(s.logprobs, mask, strict=True) if m):
        raise bad("logprobs must be finite and <= 0 where the loss mask is 1")
    if vocab_size is not None:
        ids = s.prompt_ids + s.response_ids
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise bad(f"token id out of the vocabulary [0, {vocab_size})")
    if max_len is not None and len(s.prompt_ids) + len(s.response_ids) > max_len:
        raise bad(
            f"{len(s.prompt_ids) + len(s.response_ids)} tokens, more than the model's "
            f"{max_len} positions"
        )


# ---- the protocol -----------------------------------------------------------------------------


@runtime_checkable
class TrainingEngine(Protocol):
    """A policy's trainer on one device group (every rank runs the same calls, SPMD).

    ``version`` is the policy version its parameters are: 0 as loaded, +1 per step.
    ``train_step`` takes the whole batch (a data-parallel backend trains each rank on its
    share). While offloaded, ``train_step`` and ``export`` raise until ``reload``.
    ``export`` returns the full parameters in checkpoint (Hugging Face) names, tied ones
    under both names, as GPS stores them; the tensors may be views of live parameters, valid
    until the next ``train_step``.
    """

    @property
    def version(self) -> int: ...

    @property
    def offloaded(self) -> bool: ...

    def train_step(self, batch: GRPOBatch) -> TrainStats: ...

    def offload(self) -> None:
        """Move optimizer state (and parameters, gradients) off the device (stateful
        context: DESIGN.md, "Shifting a device group")."""
        ...

    def reload(self) -> None: ...

    def export(self) -> Mapping[str, torch.Tensor]: ...
