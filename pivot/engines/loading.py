"""The one place that picks the engine for a checkpoint folder: pivot's own torch engine for
the decoder families it serves (``DecoderSpec``), the transformers fallback for every other
causal LM transformers has (``FallbackSpec``), as ``pivot.engines.checkpoint`` decides; and
the weights of either, in Hugging Face names. Importing this module loads no torch.

    load_engine(folder, tensors=None, **engine_kwargs) -> TorchEngine | TransformersEngine
    read_weights(folder) -> {name: tensor}
    torch_dtype("bfloat16") -> torch.bfloat16    (``model.dtype``'s names)
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivot.engines.checkpoint import DecoderSpec, inspect_checkpoint

if TYPE_CHECKING:
    from pivot.engines.stepping import SteppedEngine


def read_tensors(files: Iterable[Path]) -> dict[str, Any]:
    """Every tensor of the safetensors files, by name (float32 or as stored)."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def torch_dtype(name: str) -> Any:
    """The torch dtype ``model.dtype`` names (``pivot.accelerator.DType``)."""
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def read_weights(path: str | Path) -> dict[str, Any]:
    """The tensors of a checkpoint folder either engine serves, in Hugging Face names (what
    ``load_weights`` takes); a folder neither serves is the ``CheckpointError`` saying why."""
    _, files = inspect_checkpoint(path)
    return read_tensors(files)


def load_engine(
    path: str | Path, tensors: dict[str, Any] | None = None, **kwargs: Any
) -> SteppedEngine:
    """An engine serving the checkpoint folder ``path``: a ``TorchEngine`` for pivot's decoder
    families, else a ``TransformersEngine``. ``tensors``: its weights when already read
    (``read_weights``), so that a caller who keeps them reads the files once. ``kwargs`` go to
    the engine (max_running, max_seq_len, threads, clock, seed, ...)."""
    spec, files = inspect_checkpoint(path)
    if tensors is None:
        tensors = read_tensors(files)
    if isinstance(spec, DecoderSpec):
        from pivot.engines.torch_engine import TorchEngine

        return TorchEngine(spec, tensors, **kwargs)
    from pivot.engines.hf_engine import TransformersEngine

    return TransformersEngine.from_pretrained(path, tensors, **kwargs)
