"""The host memory a job needs, estimated from its models and its limits before anything
starts; ``pivot run`` refuses a job whose estimate exceeds the memory available.

Every process of the job is on this host: ``pivot run``'s own, one role agent per agent
device and one DeepSpeed rank per trainer device (``JobConfig.plan``). Each costs its runtime
(Python, torch, DeepSpeed: the constants below, measured) and what its models hold, all fp32
as the engines and the trainer run them:

* an agent, per role whose engine it keeps: the weights (4 bytes a parameter; a rollout
  engine also keeps the checkpoint's tensors and a buffer to read new versions into, two more
  copies; a GenRM engine its checkpoint's tensors, one more) and the KV cache the engine allocates whole at start, ``max_running`` sequences of
  the model's ``max_position_embeddings`` positions, ``layers x 2 (k, v) x kv_heads x
  head_dim`` values each; and once, for the role with the largest, the activations of a
  prefill of ``max_running`` full-length sequences;
* a trainer rank: the weights (whole below ZeRO-3, a 1/ranks share at 3), the gradients (whole
  below ZeRO-3: they exist in full before they are reduced), the optimizer states partitioned
  over the ranks (DeepSpeed's fp32 copy of the rank's share and Adam's two moments), the
  reference policy when ``kl_coef > 0``, and the activations a micro-batch of full-length
  sequences keeps for its backward;
* the GPS host store: ``STORE_COPIES`` versions of the policy in shared memory.

A sequence is bounded by the model's positions, so a batch of long prompts reaches these
numbers; short sequences touch less of the activations (the KV cache is zeroed, so touched,
whole). Measured on ``configs/tiny.toml`` (4 agents, 2 ranks, ~0.8M parameters) with
``max_running`` 32: this estimates 2.80 GiB; with each child its own interpreter the run's
processes peaked at 2.46-2.60 GiB of RSS together (1.83-1.92 GiB PSS). Forked from the job's
fork server (``pivot run`` on CPU: ``pivot.bus.zygote``), the children share the server's pages:
1.22-1.24 GiB PSS at peak, though their RSS, each counting the shared pages, sums to 3.14 GiB
(one more process, the server). With its ``max_running`` of 128 (four times the KV caches and
decode activations): 3.34 GiB estimated, 1.50 GiB PSS and 3.42 GiB RSS at peak, forked.
The estimate keeps a runtime per process as if none were shared.

    estimate_memory(job, models) -> MemoryEstimate     models: {Role: ModelShape}
    MemoryEstimate.total, .parts, .largest(n), .describe()
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from pivot.cluster import Role
from pivot.engines.checkpoint import ModelShape
from pivot.job import JobConfig

MiB = 1 << 20
GiB = 1 << 30
FP32 = 4  # bytes a value: the engines and the trainer run fp32 on CPU

# Process runtimes, with no model: the resident memory of each kind of process in the tiny job
# (peak RSS: pivot run's own 326 MiB; an agent 325-336 MiB, of which its models' weights, KV
# caches and activations are ~57 MiB by the formulas here; a rank 546-550 MiB, of which ~250
# MiB by the formulas here). Importing torch alone is 227 MiB; with DeepSpeed and transformers,
# 272 MiB.
MAIN_RUNTIME = 330 * MiB
AGENT_RUNTIME = 270 * MiB
TRAINER_RUNTIME = 350 * MiB
#: Policy versions the GPS store may hold at once: the published one, a spare, and those
#: readers still copy out of (the tiny job peaked at 15.5 MiB of /dev/shm for a 3.2 MB policy).
STORE_COPIES = 5
#: Copies of a rollout engine's weights beyond the engine's own: the checkpoint's tensors (the
#: shape new versions are read into) and the buffers they are read into.
ROLLOUT_WEIGHT_COPIES = 2
#: ... and of a GenRM engine's: its checkpoint's tensors, kept to load at every shift to reward
#: (``CheckpointWeights(keep=True)``, on CPU).
REWARD_WEIGHT_COPIES = 1


class MemoryEstimate(msgspec.Struct, frozen=True):
    """Bytes by part, each summed over the job's processes."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        return sorted(self.parts.items(), key=lambda item: -item[1])[:n]

    def describe(self, n: int = 3) -> str:
        """``"12.30 GiB (trainer activations 8.00 GiB, KV caches 2.10 GiB, ...)"``."""
        parts = ", ".join(f"{name} {gib(size)}" for name, size in self.largest(n))
        return f"{gib(self.total)} ({parts})"


def gib(size: int) -> str:
    return f"{size / GiB:.2f} GiB"


def kv_cache_bytes(model: ModelShape, max_running: int) -> int:
    """One engine's KV cache: ``max_running`` slots of every position, k and v per layer."""
    per_position = model.layers * 2 * model.kv_heads * model.head_dim * FP32
    return max_running * model.max_positions * per_position


def prefill_activation_bytes(model: ModelShape, max_running: int) -> int:
    """A prefill of ``max_running`` full-length sequences, one layer at a time: per token the
    hidden state and its norm, q/k/v, the gated MLP's two halves, a row of attention scores,
    and the logits."""
    q_kv = (model.heads + 2 * model.kv_heads) * model.head_dim
    per_token = (
        2 * model.hidden_size
        + q_kv
        + 2 * model.intermediate_size
        + model.heads * model.max_positions
        + model.vocab_size
    )
    return max_running * model.max_positions * per_token * FP32


def training_activation_bytes(model: ModelShape, micro_batch: int) -> int:
    """What a micro-batch of full-length sequences keeps for its backward: per token and layer
    ~10 hidden-sized values (norms, q/k/v/o inputs and outputs, residuals), 4 MLP-sized ones
    (gate, up, their activation and product) and two rows of attention (scores, softmax); per
    token the logits, their log-softmax and its gradient."""
    per_layer = (
        10 * model.hidden_size + 4 * model.intermediate_size + 2 * model.heads * model.max_positions
    )
    per_token = model.layers * per_layer + 3 * model.vocab_size
    return micro_batch * model.max_positions * per_token * FP32


def estimate_memory(job: JobConfig, models: Mapping[Role, ModelShape]) -> MemoryEstimate:
    """The memory ``job`` needs on this host, by part (see the module docstring). ``models``:
    the shape of each inference role's model (the policy's is also the trainer's)."""
    deployment = job.plan()
    max_running = job.model.max_running
    parts = {
        "process runtimes": MAIN_RUNTIME
        + AGENT_RUNTIME * len(deployment.agent_devices)
        + TRAINER_RUNTIME * len(deployment.trainer_devices),
        "inference weights": 0,
        "KV caches": 0,
        "inference activations": 0,
    }
    for device in deployment.agent_devices:
        roles = [r for r in deployment.engine_roles(device) if r in models]
        for role in roles:
            model = models[role]
            copies = 1 + (ROLLOUT_WEIGHT_COPIES if role is Role.ROLLOUT else REWARD_WEIGHT_COPIES)
            parts["inference weights"] += copies * model.parameters * FP32
            parts["KV caches"] += kv_cache_bytes(model, max_running)
        if roles:
            parts["inference activations"] += max(
                prefill_activation_bytes(models[r], max_running) for r in roles
            )
    policy = models[Role.ROLLOUT]
    weights = policy.parameters * FP32
    ranks = len(deployment.trainer_devices)
    stage = job.training.zero_stage
    whole_below_3 = weights if stage < 3 else weights // ranks
    parts["trainer weights"] = ranks * whole_below_3
    parts["trainer gradients"] = ranks * whole_below_3
    # DeepSpeed's fp32 copy of the rank's share, and Adam's two moments of it
    parts["trainer optimizer states"] = 3 * weights
    parts["reference policy"] = ranks * weights if job.training.kl_coef > 0 else 0
    parts["trainer activations"] = ranks * training_activation_bytes(
        policy, job.training.micro_batch_size
    )
    parts["GPS store"] = STORE_COPIES * weights
    return MemoryEstimate(parts)
