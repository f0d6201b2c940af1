"""The transformers fallback engine (CPU, or one CUDA GPU): any causal LM transformers has, behind the
``pivot.engines.protocol.InferenceEngine`` protocol, for the checkpoints pivot's own torch
engine does not serve (``pivot.engines.checkpoint.FallbackSpec``).

Same protocol, same semantics as ``TorchEngine``: both are a ``SteppedEngine``
(``pivot.engines.stepping``), which owns the queue, ``add``'s validation, abort with partial
outputs, re-prefill of handed-in tokens, the finish rules and sampling by (seed, position);
only the forward differs. Here it is transformers' own model, run on one sequence at a time,
each with its own ``past_key_values``: slower than the torch engine's batched static cache
(no batching across sequences), but exact for whatever transformers implements. Parameters
are the model's own, named as in its state dict (Hugging Face checkpoint names), which is
what ``load_weights`` copies into; tied ones (an lm_head sharing the embedding) answer to
both names.

Importing this module loads torch, not transformers; building an engine loads transformers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from pivot.engines.checkpoint import causal_lm_classes, eos_token_ids, inspect_checkpoint
from pivot.engines.context import RoleContext
from pivot.engines.loading import read_tensors
from pivot.engines.protocol import NamedTensors
from pivot.engines.stepping import Held, SteppedEngine


def causal_lm_class(config: Any) -> type:
    """The causal-LM class for a transformers config: the first class config.json's
    ``architectures`` names that is one of transformers' causal LMs for its model type (or
    any ``...ForCausalLM``, as the trainer has always taken), else the one
    ``AutoModelForCausalLM`` maps it to. By name first: importing transformers' auto-model
    mapping loads torch._dynamo, whose Tensor polyfills break DeepSpeed's zero.Init at
    ZeRO-3."""
    import transformers

    wanted = causal_lm_classes().get(config.model_type, ())
    for name in config.architectures or ():
        if (name in wanted or name.endswith("ForCausalLM")) and hasattr(transformers, name):
            return getattr(transformers, name)
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING  # a checkpoint that names none

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]


class TransformersEngine(SteppedEngine):
    """An inference engine over a transformers causal LM (``model``, a ``PreTrainedModel``),
    in eval mode, one forward per sequence per step, on ``device`` in ``dtype`` (logits come
    back to the host, where sampling runs).

    ``tensors``: its weights (checkpoint names, every parameter); without them the model's
    own parameter values are its weights. ``max_seq_len`` defaults to the config's
    ``max_position_embeddings`` and is needed where the config has none. ``eos_token_ids``
    default to the config's. ``threads``, ``clock``, ``seed``, ``weights_version``: as for
    ``TorchEngine``.
    """

    def __init__(
        self,
        model: Any,
        tensors: NamedTensors | None = None,
        *,
        max_running: int = 64,
        max_seq_len: int | None = None,
        eos_token_ids: Iterable[int] | None = None,
        threads: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        clock: Callable[[], float] | None = None,
        seed: int = 0,
        weights_version: int = 0,
    ) -> None:
        config = model.config
        limit = getattr(config, "max_position_embeddings", None) or max_seq_len
        if limit is None:
            raise ValueError(
                f"{type(model).__name__}'s config has no max_position_embeddings: give max_seq_len"
            )
        super().__init__(
            vocab_size=model.get_input_embeddings().num_embeddings,
            max_positions=limit,
            max_running=max_running,
            max_seq_len=max_seq_len,
            eos_token_ids=(_config_eos(config) if eos_token_ids is None else eos_token_ids),
            threads=threads,
            clock=clock,
            seed=seed,
            weights_version=weights_version,
        )
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.model.requires_grad_(False)
        # transformers 5 renamed past_key_values to cache (the old name warns, then goes)
        forward = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        # every name a parameter answers to (tied ones under both), and each one's shape,
        # which stays known while released weights hold no storage
        self._params: dict[str, torch.nn.Parameter] = dict(
            self.model.named_parameters(remove_duplicate=False)
        )
        self._shapes = {n: tuple(p.shape) for n, p in self._params.items()}
        self._unique = {id(p): (n, p) for n, p in self.model.named_parameters()}
        self._buffers = {
            n: b for n, b in self.model.state_dict(keep_vars=True).items() if n not in self._params
        }
        self._loaded: set[int] = set(self._unique) if tensors is None else set()
        self._context = RoleContext(
            held_sequences=lambda: len(self._running) + len(self._waiting),
            free_weights=self._free_weights,
            allocate_weights=self._allocate_weights,
            unloaded=self._unloaded,
            weights_loaded=tensors is None,
        )
        if tensors is not None:
            self.load_weights(tensors, weights_version)
            if not self._context.weights_ready:
                missing = sorted(n for i, (n, _) in self._unique.items() if i not in self._loaded)
                raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")

    @classmethod
    def from_pretrained(
        cls, path: str | Path, tensors: NamedTensors | None = None, **kwargs: Any
    ) -> TransformersEngine:
        """An engine serving the Hugging Face checkpoint in folder ``path`` (any folder
        ``inspect_checkpoint`` accepts; ``tensors``: its weights when already read)."""
        from transformers import AutoConfig

        spec, files = inspect_checkpoint(path)
        config = AutoConfig.from_pretrained(path)
        # built with random values, each replaced by the checkpoint's (a missing one is an error)
        model = causal_lm_class(config)(config)
        kwargs.setdefault("eos_token_ids", spec.eos_token_ids)
        return cls(model, read_tensors(files) if tensors is None else tensors, **kwargs)

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy tensors (checkpoint names, any subset) into the model's parameters (and
        persistent buffers).

        With released weights this allocates them first; serving needs every parameter
        loaded since. Running sequences keep their KV caches (computed with older weights),
        as with partial rollout across a version change. Names or shapes that do not fit
        raise ValueError and nothing is copied.
        """
        items = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        self._context.before_load()
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        unknown = []
        for name, tensor in items:
            target = self._params.get(name)
            if target is None:
                target = self._buffers.get(name)
            if target is None:
                unknown.append(name)
                continue
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(
                    f"load_weights: '{name}' is a {type(tensor).__name__}, not a tensor"
                )
            shape = self._shapes.get(name, tuple(target.shape))
            if tuple(tensor.shape) != shape:
                raise ValueError(
                    f"load_weights: '{name}' has shape {tuple(tensor.shape)}, expected {shape}"
                )
            plan.append((target, tensor))
        if unknown:
            example = next(iter(self._params))
            raise ValueError(
                f"load_weights: unknown parameter names {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''} (expected {type(self.model).__name__}'s "
                f"names such as {example!r})"
            )
        with torch.no_grad():
            for target, tensor in plan:
                target.copy_(tensor.detach(), non_blocking=self._cuda)
                self._loaded.add(id(target))
            if self._cuda:  # the caller may refill its (pinned) host buffers once this returns
                torch.cuda.synchronize(self.device)
        self._context.loaded(all(i in self._loaded for i in self._unique))
        self.weights_version = version

    def _free_weights(self) -> None:
        for _, p in self._unique.values():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self._loaded = set()

    def _allocate_weights(self) -> None:
        for name, p in self._unique.values():
            p.data = torch.zeros(self._shapes[name], dtype=p.dtype, device=self.device)
        self._loaded = set()

    def _unloaded(self) -> str:
        missing = sorted(n for i, (n, _) in self._unique.items() if i not in self._loaded)
        return (
            f"{len(missing)} of {len(self._unique)} parameters not loaded since weights were "
            f"resumed (e.g. {missing[0]!r})"
        )

    # ---- the forward --------------------------------------------------------------------------
    # Each sequence's cache lives on it (``Held.cache``) and goes when it leaves; an idle
    # engine holds no KV cache, so releasing transient context has nothing more to free.

    def _prefill(self, seqs: list[Held]) -> torch.Tensor:
        rows = []
        for s in seqs:
            ids = torch.tensor([s.prompt_ids + s.output_ids], dtype=torch.long).to(self.device)
            out = self.model(input_ids=ids, use_cache=True)
            s.cache, s.cache_len = _cache_of(out), ids.shape[1]
            rows.append(out.logits[0, -1])
        return torch.stack(rows).float().cpu()  # a no-op on CPU

    def _decode(self, seqs: list[Held]) -> torch.Tensor:
        rows = []
        for s in seqs:
            ids = torch.tensor([[s.output_ids[-1]]], dtype=torch.long).to(self.device)
            out = self.model(input_ids=ids, use_cache=True, **{self._cache_arg: s.cache})
            s.cache = _cache_of(out)
            s.cache_len += 1
            rows.append(out.logits[0, -1])
        return torch.stack(rows).float().cpu()  # a no-op on CPU


def _cache_of(out: Any) -> Any:
    return out["cache"] if "cache" in out else out.past_key_values


def _config_eos(config: Any) -> tuple[int, ...]:
    return eos_token_ids({"eos_token_id": getattr(config, "eos_token_id", None)})
