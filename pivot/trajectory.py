"""What a rollout function works with and returns: the model's answer to one ``generate`` call
(``Generation``), and the trajectory the trainer learns from (``Trajectory``).

A trajectory is token-exact: its ``prompt_ids`` are the task's prompt and its ``response_ids``
everything after it, turn after turn, exactly as the engine read and wrote them. Each response
token carries a loss mask (1: the policy sampled it and is trained on it; 0: a tool's or the
environment's token, read by the model but never trained), the behaviour logprob it was
sampled with (0.0 where masked) and the policy version that sampled it (``NO_VERSION`` where
masked). Building one by ``add_generation`` / ``add_tokens`` keeps the four aligned; the next
turn's prompt is ``trajectory.token_ids``, so what the trainer sees is what the engine saw.

A simulated engine's ids are ``Placeholders`` (only their count is real); a trajectory of
them keeps empty masks, meaning every response token is the policy's.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pivot.engines.protocol import FinishReason
from pivot.engines.sim_engine import Placeholders

NO_VERSION = -1  # the version of a token no policy sampled (a tool's, the environment's)

TokenIds = list[int] | Placeholders


class Chunk(msgspec.Struct, frozen=True, array_like=True):
    """``tokens`` consecutive output tokens sampled by the policy of ``version``."""

    tokens: int
    version: int


def add_chunk(chunks: list[Chunk], tokens: int, version: int) -> None:
    """Append ``tokens`` sampled by ``version`` to run-length ``chunks`` in place: into the
    last chunk when it has that version (the list stays canonical), nothing for 0 tokens."""
    if tokens <= 0:
        return
    if chunks and chunks[-1].version == version:
        chunks[-1] = Chunk(chunks[-1].tokens + tokens, version)
    else:
        chunks.append(Chunk(tokens, version))


def chunk_tokens(chunks: Sequence[Chunk]) -> int:
    """The tokens run-length ``chunks`` cover."""
    return sum(c.tokens for c in chunks)


def chunk_versions(chunks: Sequence[Chunk]) -> list[int]:
    """One version per token of run-length ``chunks``."""
    out: list[int] = []
    for c in chunks:
        out.extend([c.version] * c.tokens)
    return out


class Generation(msgspec.Struct, frozen=True, kw_only=True):
    """One ``ctx.generate`` call's result. ``chunks`` say which policy version sampled which
    tokens: a call that spanned a weight update, or was moved to a replica that held a newer
    policy, has more than one. ``replica``: the one that finished it."""

    prompt_ids: TokenIds
    token_ids: TokenIds
    logprobs: list[float]
    chunks: list[Chunk]
    finish_reason: FinishReason
    text: str = ""
    replica: str = ""

    @property
    def versions(self) -> list[int]:
        return chunk_versions(self.chunks)


class TrajectoryError(ValueError):
    """A trajectory that cannot train: the message says which field is wrong and how."""


class Trajectory(msgspec.Struct, kw_only=True):
    """The tokens of one rollout and how to train on them; ``reward`` is set by the rollout
    function, or (when it leaves it None) by the job's reward. ``metrics`` are numbers the
    step reports as means."""

    prompt_ids: TokenIds
    response_ids: TokenIds = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    reward: float | None = None
    metrics: dict[str, float] = {}

    @classmethod
    def of(cls, generation: Generation, *, reward: float | None = None) -> Trajectory:
        """The single-turn trajectory of one generation."""
        return cls(prompt_ids=generation.prompt_ids, reward=reward).add_generation(generation)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and response as one sequence: the next turn's prompt."""
        return [*self.prompt_ids, *self.response_ids]

    def add_generation(self, generation: Generation) -> Trajectory:
        """Append the model's tokens of ``generation`` (trained on). Its prompt must be this
        trajectory's tokens so far (or the tokens so far followed by tokens added here since):
        a generation from another context breaks token-exactness and is refused."""
        if isinstance(generation.token_ids, Placeholders):
            if self.response_ids:
                raise TrajectoryError("placeholder generations make single-turn trajectories")
            self.response_ids = generation.token_ids
            return self
        n = len(self.prompt_ids) + len(self.response_ids)
        if len(generation.prompt_ids) != n or list(generation.prompt_ids) != self.token_ids:
            raise TrajectoryError(
                f"the generation's prompt ({len(generation.prompt_ids)} tokens) is not this "
                f"trajectory's {n} tokens so far: generate from trajectory.token_ids"
            )
        ids = list(generation.token_ids)
        self.response_ids = [*self.response_ids, *ids]
        self.loss_mask = [*self.loss_mask, *([1] * len(ids))]
        self.logprobs = [*self.logprobs, *generation.logprobs]
        self.versions = [*self.versions, *generation.versions]
        return self

    def add_tokens(self, token_ids: Sequence[int]) -> Trajectory:
        """Append tokens the policy did not sample (a tool's result, the environment's turn):
        the model reads them, the loss skips them."""
        ids = [int(t) for t in token_ids]
        self.response_ids = [*self.response_ids, *ids]
        self.loss_mask = [*self.loss_mask, *([0] * len(ids))]
        self.logprobs = [*self.logprobs, *([0.0] * len(ids))]
        self.versions = [*self.versions, *([NO_VERSION] * len(ids))]
        return self

    @property
    def trained_tokens(self) -> int:
        if isinstance(self.response_ids, Placeholders) or not self.loss_mask:
            return len(self.response_ids)
        return sum(self.loss_mask)

    def check(self) -> None:
        """Raise ``TrajectoryError`` unless the per-token fields align with the response."""
        if isinstance(self.response_ids, Placeholders):
            return
        n = len(self.response_ids)
        if not self.prompt_ids:
            raise TrajectoryError("empty prompt_ids")
        for name in ("loss_mask", "logprobs", "versions"):
            got = len(getattr(self, name))
            if got != n:
                raise TrajectoryError(f"{name} has {got} entries for {n} response tokens")
        if any(m not in (0, 1) for m in self.loss_mask):
            raise TrajectoryError("loss_mask holds values other than 0 and 1")
