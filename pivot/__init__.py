"""pivot: an RL post-training runtime that shifts devices between rollout, reward and training.

This package is the pure domain core: no sockets, no processes, no wall clock. Its public API
for users' code is exported here: what a rollout function works with (``Task``,
``RolloutContext``, ``Generation``, ``Trajectory``, ``single_turn``), and, imported when first
used because they run the job's actors, ``Run`` (a job from your own process) and ``attach``
(a running ``pivot run``) from ``pivot.cli.jobs``.
"""

from pivot.rewards import RewardFailed, RewardInput
from pivot.rollout import RolloutContext, Task, single_turn
from pivot.trajectory import Chunk, Generation, Trajectory

__version__ = "0.1.0"

__all__ = [
    "Chunk",
    "Generation",
    "RewardFailed",
    "RewardInput",
    "RolloutContext",
    "Run",
    "Task",
    "Trajectory",
    "attach",
    "single_turn",
]


def __getattr__(name: str):  # noqa: ANN202 - the lazily imported names of __all__
    if name in ("Run", "attach"):
        from pivot.cli import jobs

        return getattr(jobs, name)
    raise AttributeError(f"module 'pivot' has no attribute {name!r}")
