"""Tensors as msgpack-able structs (``WireTensor``, ``WireBatch``): how a trainer's rank
commands and a gradient helper's requests and replies carry them. Only the dtypes a GRPO
batch or a gradient holds travel; anything else is refused, never guessed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields

import torch

from pivot.actors.trainer_messages import WireBatch, WireTensor
from pivot.grpo import GRPOBatch

DTYPES = {str(t).removeprefix("torch."): t for t in (torch.int64, torch.float32)}


def to_wire(tensor: torch.Tensor, what: str) -> WireTensor:
    """``tensor`` (on any device) as dtype, shape and raw bytes; ``what`` names it in the
    error for a dtype that does not travel."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise TypeError(f"{what} is {tensor.dtype}, which does not travel")
    data = tensor.detach().to("cpu").contiguous()
    return WireTensor(dtype, list(data.shape), data.view(torch.uint8).numpy().tobytes())


def from_wire(wire: WireTensor) -> torch.Tensor:
    dtype = DTYPES.get(wire.dtype)
    if dtype is None:
        raise ValueError(f"a tensor of dtype {wire.dtype!r} on the wire")
    raw = torch.frombuffer(bytearray(wire.data), dtype=torch.uint8) if wire.data else None
    flat = raw.view(dtype) if raw is not None else torch.empty(0, dtype=dtype)
    return flat.reshape(wire.shape)


def tensors_to_wire(tensors: Mapping[str, torch.Tensor]) -> dict[str, WireTensor]:
    return {name: to_wire(t, name) for name, t in tensors.items()}


def tensors_from_wire(wire: Mapping[str, WireTensor]) -> dict[str, torch.Tensor]:
    return {name: from_wire(t) for name, t in wire.items()}


def batch_to_wire(batch: GRPOBatch) -> WireBatch:
    tensors = {
        f.name: to_wire(getattr(batch, f.name), f"GRPOBatch.{f.name}")
        for f in fields(batch)
        if f.name != "pad_id"
    }
    return WireBatch(tensors, batch.pad_id)


def batch_from_wire(wire: WireBatch) -> GRPOBatch:
    return GRPOBatch(**tensors_from_wire(wire.tensors), pad_id=wire.pad_id)
