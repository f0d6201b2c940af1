"""pivot: an RL post-training runtime that shifts devices between rollout, reward and training.

This package is the pure domain core: no sockets, no processes, no wall clock.
"""

__version__ = "0.1.0"
