"""Where a job's tensors live: the one place that maps ``cluster.accelerator`` and
``model.dtype`` to a torch device, a dtype name and a process-group backend, and that says
why this host cannot run a config that names CUDA. Pure: the host's facts (whether CUDA is
available, how many GPUs) are arguments, so the caller asks torch once.

On ``cpu`` a device is a process pinned to its threads, and with ``cluster.pin_cores`` to its
own share of the host's cores (``device_cores``); on ``cuda`` it is one GPU, by index
(``cuda:N``). The torch engine and each trainer rank use one GPU; SGLang may span several
(``tp_size``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Accelerator = Literal["cpu", "cuda"]
DType = Literal["float32", "bfloat16"]


def torch_device(accelerator: str, index: int | None) -> str:
    """The torch device string of job device ``index`` (``cpu``, or ``cuda:N``)."""
    if accelerator == "cuda":
        return f"cuda:{index or 0}"
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
    accelerator: str, devices: int, *, available: bool, count: int, cpu_build: bool
) -> tuple[str, str, str] | None:
    """Why this host cannot run ``devices`` job devices on ``accelerator``, as the config key,
    what it needs and what was found (None: it can). ``available``, ``count``: torch's
    ``cuda.is_available()`` and ``cuda.device_count()``; ``cpu_build``: torch has no CUDA."""
    if accelerator != "cuda":
        return None
    if not available:
        why = "this torch is the CPU build" if cpu_build else "no GPU visible to this CUDA torch"
        return "cluster.accelerator", "a CUDA device (torch.cuda.is_available())", f"none: {why}"
    if devices > count:
        return (
            "cluster.devices",
            f"at most the {count} CUDA devices here (torch.cuda.device_count())",
            f"int {devices}",
        )
    return None
