"""Where a job's tensors live: the one place that maps ``cluster.accelerator``,
``cluster.gpus`` and ``model.dtype`` to torch devices, a dtype name, a process-group backend,
the trainer's ranks and each SGLang engine's share of its GPU, and that says why this host
cannot run a config that names CUDA. Pure: the host's facts (whether CUDA is available, how
many GPUs) are arguments, so the caller asks torch once.

On ``cpu`` a job device is a process pinned to its threads, and with ``cluster.pin_cores``
to its own share of the host's cores (``device_cores``); on ``cuda`` it runs on one GPU,
by index (``cuda:N``): GPU N for job device N, or ``cluster.gpus[N]``, which may name one GPU
for several job devices (colocation, as verl and slime colocate rollout and training on the
same GPUs). The torch engine and each trainer rank use one GPU; SGLang may span several
(``tp_size``).

Sharing a GPU:

* **Memory.** SGLang sizes its KV cache at launch and keeps it (``mem_fraction_static``);
  pivot's torch engine allocates as it goes and needs no share. ``model.mem_fraction_static``
  is the fraction of each GPU pivot's static allocations take together; where a trainer rank
  is on the GPU, ``cluster.trainer_gpu_fraction`` of it is the trainer's, and the rest is
  split evenly among the SGLang engines there (an agent keeps one engine per role it may
  serve). The rest of the GPU stays free for activations, CUDA graphs and NCCL. SGLang takes
  its fraction of the memory *free* when it launches, so an engine launched after its GPU's
  other engines gets less than its share, never more: the shares add up whatever the order.
* **The trainer.** NCCL refuses two ranks of one group on the same GPU ("Duplicate GPU
  detected"); a gloo group would copy every collective of CUDA tensors through host memory,
  and ranks sharing a GPU share its compute while each holds its own copy of the weights and
  gradients (below ZeRO-3). So the trainer has one rank per distinct GPU of its devices: the
  first trainer device on each GPU hosts it, and the other trainer devices on that GPU are
  still the trainer's (lent to inference with the pool) but run no rank. On CPU every
  trainer device is a rank, as before.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

Accelerator = Literal["cpu", "cuda"]
DType = Literal["float32", "bfloat16"]

#: ``model.mem_fraction_static``'s default: the share of a GPU pivot's static allocations
#: (SGLang's weights and KV caches, a trainer rank's share) take together
MEM_FRACTION_STATIC = 0.8
#: ``cluster.trainer_gpu_fraction``'s default: the trainer rank's part of that share on its GPU
TRAINER_GPU_FRACTION = 0.3


class PlacementError(ValueError):
    """A placement that cannot work, as the config key, what it needs and what was found."""

    def __init__(self, key: str, expected: str, found: str) -> None:
        super().__init__(key, expected, found)
        self.key, self.expected, self.found = key, expected, found


class GpuLayout(msgspec.Struct, frozen=True, kw_only=True):
    """Where each job device's work runs (see the module docstring).

    ``gpus``: the GPU of each job device on ``cuda`` (empty on ``cpu``). ``trainer_devices``:
    the job device of each trainer rank, in rank order. ``mem_fraction``: by agent device, the
    ``mem_fraction_static`` of each of its SGLang engines (empty without SGLang).
    """

    accelerator: Accelerator = "cpu"
    gpus: tuple[int, ...] = ()
    trainer_devices: tuple[int, ...] = ()
    mem_fraction: dict[int, float] = {}

    def gpu(self, device: int) -> int | None:
        """The GPU job device ``device`` runs on (None on CPU)."""
        return self.gpus[device] if self.gpus else None

    @property
    def trainer_gpus(self) -> list[int] | None:
        """The GPU of each trainer rank (None on CPU)."""
        return [self.gpus[d] for d in self.trainer_devices] if self.gpus else None


def place(
    accelerator: str,
    devices: int,
    *,
    trainer_devices: Sequence[int],
    engines: Mapping[int, int] | None = None,
    gpus: Sequence[int] = (),
    mem_fraction_static: float = MEM_FRACTION_STATIC,
    trainer_gpu_fraction: float = TRAINER_GPU_FRACTION,
) -> GpuLayout:
    """The layout of ``devices`` job devices on ``accelerator``: ``gpus`` is
    ``cluster.gpus`` (empty: job device N on GPU N), ``trainer_devices`` the trainer pool's
    job devices, ``engines`` the SGLang engines of each agent device (None: no SGLang).
    Raises ``PlacementError`` for a ``cluster.gpus`` of the wrong length or on CPU, and for
    shares that leave an SGLang engine nothing."""
    if accelerator != "cuda":
        if gpus:
            raise PlacementError(
                "cluster.gpus", "no value unless cluster.accelerator = 'cuda'", f"{list(gpus)}"
            )
        return GpuLayout(trainer_devices=tuple(trainer_devices))
    if gpus and len(gpus) != devices:
        raise PlacementError(
            "cluster.gpus",
            f"one GPU index per job device ({devices}, cluster.devices)",
            f"{len(gpus)} indices {list(gpus)}",
        )
    of = tuple(gpus) if gpus else tuple(range(devices))
    ranks: dict[int, int] = {}  # GPU -> the job device of its trainer rank
    for device in trainer_devices:
        ranks.setdefault(of[device], device)
    per_gpu = Counter()
    for device, count in (engines or {}).items():
        per_gpu[of[device]] += count
    left = {}
    for gpu, count in per_gpu.items():
        left[gpu] = mem_fraction_static - (trainer_gpu_fraction if gpu in ranks else 0.0)
        if count and left[gpu] <= 0:
            raise PlacementError(
                "cluster.trainer_gpu_fraction",
                f"less than model.mem_fraction_static = {mem_fraction_static}, on GPU {gpu} "
                f"with a trainer rank and {count} SGLang engines",
                f"float {trainer_gpu_fraction}",
            )
    return GpuLayout(
        accelerator="cuda",
        gpus=of,
        trainer_devices=tuple(ranks.values()),
        mem_fraction={
            device: round(left[of[device]] / per_gpu[of[device]], 4)
            for device, count in (engines or {}).items()
            if count
        },
    )


def torch_device(accelerator: str, gpu: int | None) -> str:
    """The torch device string of a job device on GPU ``gpu`` (``cpu``, or ``cuda:N``)."""
    if accelerator == "cuda":
        return f"cuda:{gpu or 0}"
    return "cpu"


def device_cores(device: int, devices: int, cores: Sequence[int]) -> tuple[int, ...]:
    """The cores job device ``device`` (of ``devices``) is pinned to: its disjoint, contiguous
    share of ``cores`` (the host's usable cores, in order). With at least as many cores as
    devices each device gets ``len(cores) // devices`` of them (the remainder serve no device);
    with fewer, ``devices // len(cores)`` neighbouring devices share each core (device d on core
    ``d * len(cores) // devices``): 4 devices on 2 cores are devices 0-1 on the first core and
    2-3 on the second, so a device is half a core whose neighbour gets it whole while idle."""
    if not 0 <= device < devices:
        raise ValueError(f"device {device} is not one of {devices} devices")
    if not cores:
        raise ValueError("no cores to pin devices to")
    n = len(cores)
    if n >= devices:
        each = n // devices
        return tuple(cores[device * each : (device + 1) * each])
    return (cores[device * n // devices],)


def dist_backend(accelerator: str) -> str:
    """The trainer's torch.distributed backend: NCCL between GPUs, gloo between CPU ranks."""
    return "nccl" if accelerator == "cuda" else "gloo"


def cuda_missing(
    accelerator: str,
    devices: int,
    *,
    available: bool,
    count: int,
    cpu_build: bool,
    gpus: Sequence[int] = (),
) -> tuple[str, str, str] | None:
    """Why this host cannot run ``devices`` job devices on ``accelerator`` (on the GPUs
    ``gpus`` names; empty: GPU N for job device N), as the config key, what it needs and what
    was found (None: it can). ``available``, ``count``: torch's ``cuda.is_available()`` and
    ``cuda.device_count()``; ``cpu_build``: torch has no CUDA."""
    if accelerator != "cuda":
        return None
    if not available:
        why = "this torch is the CPU build" if cpu_build else "no GPU visible to this CUDA torch"
        return "cluster.accelerator", "a CUDA device (torch.cuda.is_available())", f"none: {why}"
    if gpus and max(gpus) >= count:
        return (
            "cluster.gpus",
            f"GPU indices below the {count} CUDA devices here (torch.cuda.device_count())",
            f"GPU {max(gpus)} in {list(gpus)}",
        )
    if not gpus and devices > count:
        return (
            "cluster.devices",
            f"at most the {count} CUDA devices here (torch.cuda.device_count()), or "
            "cluster.gpus to share them",
            f"int {devices}",
        )
    return None
