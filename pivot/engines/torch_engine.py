"""The torch inference backend (CPU, or one CUDA GPU): a pure-torch forward of the Llama-shaped decoders
(Llama, Mistral, Qwen2, Qwen3; ``pivot.engines.checkpoint.DecoderSpec``) with a preallocated
KV cache and continuous batching, behind the ``pivot.engines.protocol.InferenceEngine``
protocol. Other checkpoints run on the transformers fallback (``pivot.engines.hf_engine``;
``pivot.engines.loading`` picks); the queue, abort, re-prefill, finish rules and sampling are
``pivot.engines.stepping``'s, shared with it.

It reads a Hugging Face checkpoint folder itself (config.json + safetensors), so a user's
local checkpoint and the project's tiny models take the same path, without importing
transformers. A plain decode loop over a static cache beats HF ``generate`` where per-step
overhead dominates: ~3x on a 2-layer, hidden-64 Qwen2 (reference/platform-notes.md §4),
~1.7x at batch 16 on the 4-layer tiny policy, about even at batch 64 where the matmuls and
attention dominate. It also gives what ``generate`` does not: abort, re-prefill, per-step
events, seeded per-position sampling.

Layout: the KV cache holds ``max_running`` slots of ``max_seq_len`` positions per layer.
Running sequences occupy slots 0..n-1 (a finished or aborted sequence's slot is refilled by
the last one), so a decode step attends over a plain slice of the cache. Sequences admitted
in a step are prefilled together (right-padded, causal) and sample their first token in that
step; the others decode one token. Parameters live in a few fused tensors (q|k|v and
gate|up per layer) and every checkpoint name is a view into them, which is what
``load_weights`` copies into.

On a GPU (``device="cuda:N"``) the parameters, KV cache and rotary tables live there, one GPU
per engine (no tensor parallelism); logits come back to the host, where sampling runs as on
CPU. Weights are copied in without blocking (from pinned host buffers when the caller pins
them) and the copy is awaited before ``load_weights`` returns, so the buffers may be reused.

Releasing on the host keeps the freed KV cache and parameter tensors as spares that the next
resume takes back: host memory is not what a shift frees on a CPU "device", and fresh pages
cost a page fault each (resuming the tiny policy: ~7 ms for fresh pages, ~0.1 ms reused). On a
GPU release frees them, which is what lets the other role's engine have the memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pivot.engines.checkpoint import CheckpointError, DecoderSpec, inspect_checkpoint
from pivot.engines.context import RoleContext
from pivot.engines.loading import read_tensors
from pivot.engines.protocol import NamedTensors
from pivot.engines.stepping import Held, SteppedEngine, generate

__all__ = ["DecoderSpec", "TorchEngine", "generate", "read_checkpoint"]


def read_checkpoint(path: str | Path) -> tuple[DecoderSpec, dict[str, torch.Tensor]]:
    """The spec and the tensors of a Hugging Face checkpoint folder of one of the decoder
    families this engine serves (see ``pivot.engines.checkpoint``: model.safetensors or the
    shards its index lists); any other folder is the CheckpointError that says why."""
    spec, files = inspect_checkpoint(path)
    if not isinstance(spec, DecoderSpec):
        raise CheckpointError(
            str(Path(path) / "config.json"),
            "",
            "a checkpoint of pivot's own engine",
            f"one for the transformers fallback ({spec.reason})",
        )
    return spec, read_tensors(files)


@dataclass
class _Layer:
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None  # Qwen2's q/k/v biases
    q_norm: torch.Tensor | None  # Qwen3's per-head RMSNorm of q and k
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor
    ln_attn: torch.Tensor
    ln_mlp: torch.Tensor


@dataclass
class _Weights:
    embed: torch.Tensor
    norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[_Layer]
    views: dict[str, torch.Tensor] = field(default_factory=dict)


class TorchEngine(SteppedEngine):
    """An inference engine for the Llama-shaped decoders (``DecoderSpec``: Llama, Mistral,
    Qwen2, Qwen3) on torch (CPU or a CUDA ``device``), continuous batching over a static
    KV cache; ``dtype`` is the weights' and the cache's.

    ``threads`` sets torch's intra-op threads (process-wide: the job pins one per device).
    ``clock`` (seconds, monotonic) measures step latency; without one latencies read 0.
    ``seed`` seeds sequences added without one.
    """

    def __init__(
        self,
        spec: DecoderSpec,
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
        super().__init__(
            vocab_size=spec.vocab_size,
            max_positions=spec.max_position_embeddings,
            max_running=max_running,
            max_seq_len=max_seq_len,
            eos_token_ids=spec.eos_token_ids if eos_token_ids is None else eos_token_ids,
            threads=threads,
            clock=clock,
            seed=seed,
            weights_version=weights_version,
        )
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._loaded: set[str] = set()
        # released tensors kept for the next resume (host only; see the module docstring),
        # and the version the spare weights hold whole (None: partly loaded, or not known)
        self._spare_weights: _Weights | None = None
        self._spare_version: int | None = None
        self._resumed_version: int | None = None  # the spare's, while nothing is loaded
        self._spare_kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._weights: _Weights | None = self._allocate_weights()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._allocate_kv()
        self._context = RoleContext(
            held_sequences=lambda: len(self._running) + len(self._waiting),
            free_transient=self._free_kv,
            allocate_transient=self._allocate_kv,
            free_weights=self._free_weights,
            allocate_weights=self._resume_weights,
            unloaded=self._unloaded,
            weights_loaded=False,
        )
        self._cos, self._sin = self._rope_tables()
        if tensors is not None:
            self.load_weights(tensors, weights_version)
            missing = sorted(set(self._weights.views) - self._loaded)
            if missing:
                raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs) -> TorchEngine:
        """An engine serving the Hugging Face checkpoint in folder ``path``."""
        spec, tensors = read_checkpoint(path)
        return cls(spec, tensors, **kwargs)

    # ---- context: weights and KV cache -------------------------------------------------------

    def _allocate_weights(self) -> _Weights:
        s = self.spec
        q, kv = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim

        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=self.dtype, device=self.device)

        embed = zeros(s.vocab_size, s.hidden_size)
        lm_head = embed if s.tie_word_embeddings else zeros(s.vocab_size, s.hidden_size)
        w = _Weights(embed=embed, norm=zeros(s.hidden_size), lm_head=lm_head, layers=[])
        w.views["model.embed_tokens.weight"] = embed
        w.views["model.norm.weight"] = w.norm
        if not s.tie_word_embeddings:
            w.views["lm_head.weight"] = lm_head
        for i in range(s.num_hidden_layers):
            layer = _Layer(
                qkv_w=zeros(q + 2 * kv, s.hidden_size),
                qkv_b=zeros(q + 2 * kv) if s.attention_bias else None,
                q_norm=zeros(s.head_dim) if s.qk_norm else None,
                k_norm=zeros(s.head_dim) if s.qk_norm else None,
                o_w=zeros(s.hidden_size, q),
                gate_up_w=zeros(2 * s.intermediate_size, s.hidden_size),
                down_w=zeros(s.hidden_size, s.intermediate_size),
                ln_attn=zeros(s.hidden_size),
                ln_mlp=zeros(s.hidden_size),
            )
            w.layers.append(layer)
            p = f"model.layers.{i}."
            bounds = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
            for name, (lo, hi) in bounds.items():
                w.views[f"{p}self_attn.{name}_proj.weight"] = layer.qkv_w[lo:hi]
                if layer.qkv_b is not None:
                    w.views[f"{p}self_attn.{name}_proj.bias"] = layer.qkv_b[lo:hi]
            if layer.q_norm is not None and layer.k_norm is not None:
                w.views[f"{p}self_attn.q_norm.weight"] = layer.q_norm
                w.views[f"{p}self_attn.k_norm.weight"] = layer.k_norm
            w.views[f"{p}self_attn.o_proj.weight"] = layer.o_w
            w.views[f"{p}mlp.gate_proj.weight"] = layer.gate_up_w[: s.intermediate_size]
            w.views[f"{p}mlp.up_proj.weight"] = layer.gate_up_w[s.intermediate_size :]
            w.views[f"{p}mlp.down_proj.weight"] = layer.down_w
            w.views[f"{p}input_layernorm.weight"] = layer.ln_attn
            w.views[f"{p}post_attention_layernorm.weight"] = layer.ln_mlp
        return w

    def _allocate_kv(self) -> None:
        if self._spare_kv is not None:
            # stale entries are finite values this engine wrote; decoding masks every
            # position past a sequence's length, as it does right padding's junk
            (self._k, self._v), self._spare_kv = self._spare_kv, None
            return
        s = self.spec
        shape = (
            s.num_hidden_layers,
            self.max_running,
            s.num_key_value_heads,
            self.max_seq_len,
            s.head_dim,
        )
        self._k = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        d = self.spec.head_dim
        inv_freq = 1.0 / (self.spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        freqs = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.device, self.dtype), emb.sin().to(self.device, self.dtype)

    def parameter_names(self) -> list[str]:
        """Checkpoint names ``load_weights`` accepts (with tied embeddings, lm_head.weight too)."""
        names = list(self._weights.views) if self._weights else list(self._allocate_weights().views)
        if self.spec.tie_word_embeddings:
            names.append("lm_head.weight")
        return names

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Copy tensors (checkpoint names, any subset) into the engine's parameters.

        With released weights this allocates them first; serving needs every parameter
        loaded since. Running sequences keep their KV cache (computed with older weights),
        as with partial rollout across a version change. Names or shapes that do not fit
        raise ValueError and nothing is copied. Nor is anything copied into host weights
        resumed from a release that held ``version`` whole: they hold it still.
        """
        items = list(named_tensors.items() if hasattr(named_tensors, "items") else named_tensors)
        self._context.before_load()
        views = self._weights.views
        plan: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        unknown = []
        for name, tensor in items:
            key = name
            if name == "lm_head.weight" and self.spec.tie_word_embeddings:
                key = "model.embed_tokens.weight"  # tied: the trainer's state dict has both
            target = views.get(key)
            if target is None:
                unknown.append(name)
                continue
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(
                    f"load_weights: '{name}' is a {type(tensor).__name__}, not a tensor"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_weights: '{name}' has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(target.shape)}"
                )
            plan.append((key, target, tensor))
        if unknown:
            raise ValueError(
                f"load_weights: unknown parameter names {unknown[:5]}"
                f"{' ...' if len(unknown) > 5 else ''} (expected Hugging Face decoder names "
                f"such as 'model.layers.0.self_attn.q_proj.weight')"
            )
        if not self._loaded and self._resumed_version == version:
            # the resumed spare holds this version whole: a shift back to the role within
            # one policy version (or onto the frozen GenRM) has nothing to copy
            self._loaded = set(views)
            self._context.loaded(True)
            self.weights_version = version
            return
        self._resumed_version = None
        with torch.no_grad():
            for key, target, tensor in plan:
                target.copy_(tensor.detach(), non_blocking=self._cuda)
                self._loaded.add(key)
            if self._cuda:  # the caller may refill its host buffers once this returns
                torch.cuda.synchronize(self.device)
        self._context.loaded(len(self._loaded) == len(views))
        self.weights_version = version

    def _free_kv(self) -> None:
        if not self._cuda and self._k is not None and self._v is not None:
            self._spare_kv = (self._k, self._v)
        self._k = self._v = None

    def _free_weights(self) -> None:
        if not self._cuda:
            self._spare_weights = self._weights
            whole = self._weights is not None and len(self._loaded) == len(self._weights.views)
            self._spare_version = self.weights_version if whole else None
        self._weights = None
        self._loaded = set()
        self._resumed_version = None

    def _resume_weights(self) -> None:
        # a spare's values are the released ones: serving still waits for every parameter
        # to be loaded again (``_loaded`` starts empty)
        spare, self._spare_weights = self._spare_weights, None
        self._resumed_version = self._spare_version if spare is not None else None
        self._spare_version = None
        self._weights = spare if spare is not None else self._allocate_weights()
        self._loaded = set()

    def _unloaded(self) -> str:
        missing = set(self._weights.views) - self._loaded
        return (
            f"{len(missing)} of {len(self._weights.views)} parameters not loaded since weights "
            f"were resumed (e.g. {sorted(missing)[0]!r})"
        )

    def _move(self, s: Held, slot: int) -> None:
        if self._k is not None:
            n = s.cache_len
            self._k[:, slot, :, :n] = self._k[:, s.slot, :, :n]
            self._v[:, slot, :, :n] = self._v[:, s.slot, :, :n]

    # ---- the forward --------------------------------------------------------------------------

    @torch.inference_mode()
    def prompt_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Logits (float32, [len, vocab]) at every position of one token sequence, computed
        without the KV cache: for checks against other implementations and for scoring."""
        self._context.check_weights("compute logits")
        ids = torch.tensor([list(token_ids)], dtype=torch.long).to(self.device)
        width = ids.shape[1]
        if not 1 <= width <= self.max_seq_len:
            raise ValueError(f"need 1..{self.max_seq_len} tokens, got {width}")
        cos, sin = self._cos[:width][None, None], self._sin[:width][None, None]
        h = F.embedding(ids, self._weights.embed)
        for layer in self._weights.layers:
            q, k, v = self._qkv(h, layer, cos, sin)
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = self._finish_layer(h, attn, layer)
        return self._logits(h[0])

    def _prefill(self, seqs: list[Held]) -> torch.Tensor:
        """Run prompt + generated of each sequence into its slot; logits of each last token."""
        contexts = [s.prompt_ids + s.output_ids for s in seqs]
        lengths = [len(c) for c in contexts]
        width = max(lengths)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long).to(self.device)
        ids = ids.to(self.device)
        cos, sin = self._cos[:width][None, None], self._sin[:width][None, None]
        w = self._weights
        h = F.embedding(ids, w.embed)
        for i, layer in enumerate(w.layers):
            q, k, v = self._qkv(h, layer, cos, sin)
            # right padding writes junk past each length; decoding masks it and overwrites it
            self._k[i, slots, :, :width] = k
            self._v[i, slots, :, :width] = v
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = self._finish_layer(h, attn, layer)
        last = torch.tensor(lengths, device=self.device) - 1
        h = h[torch.arange(len(seqs), device=self.device), last]
        for s, n in zip(seqs, lengths, strict=True):
            s.cache_len = n
        return self._logits(h)

    def _decode(self, seqs: list[Held]) -> torch.Tensor:
        """One token for each running sequence (slots 0..n-1), attending over its cache."""
        n = len(seqs)
        ids = torch.tensor([[s.output_ids[-1]] for s in seqs], dtype=torch.long).to(self.device)
        lengths = [s.cache_len for s in seqs]
        pos = torch.tensor(lengths, dtype=torch.long).to(self.device)
        width = max(lengths) + 1
        cos, sin = self._cos[pos][:, None, None], self._sin[pos][:, None, None]
        rows = torch.arange(n, device=self.device)
        mask = (torch.arange(width, device=self.device)[None, :] <= pos[:, None])[:, None, None, :]
        w = self._weights
        h = F.embedding(ids, w.embed)
        for i, layer in enumerate(w.layers):
            q, k, v = self._qkv(h, layer, cos, sin)
            self._k[i, rows, :, pos] = k[:, :, 0]
            self._v[i, rows, :, pos] = v[:, :, 0]
            keys, values = self._k[i, :n, :, :width], self._v[i, :n, :, :width]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            h = self._finish_layer(h, attn, layer)
        for s in seqs:
            s.cache_len += 1
        return self._logits(h[:, -1])

    def _qkv(
        self, h: torch.Tensor, layer: _Layer, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = self.spec
        b, t, _ = h.shape
        x = F.rms_norm(h, (s.hidden_size,), layer.ln_attn, s.rms_norm_eps)
        qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
        qd, kd = s.num_attention_heads * s.head_dim, s.num_key_value_heads * s.head_dim
        q = qkv[..., :qd].view(b, t, s.num_attention_heads, s.head_dim)
        k = qkv[..., qd : qd + kd].view(b, t, s.num_key_value_heads, s.head_dim)
        v = qkv[..., qd + kd :].view(b, t, s.num_key_value_heads, s.head_dim).transpose(1, 2)
        if layer.q_norm is not None:  # Qwen3: each head's q and k normalised before rotary
            q = F.rms_norm(q, (s.head_dim,), layer.q_norm, s.rms_norm_eps)
            k = F.rms_norm(k, (s.head_dim,), layer.k_norm, s.rms_norm_eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _finish_layer(self, h: torch.Tensor, attn: torch.Tensor, layer: _Layer) -> torch.Tensor:
        s = self.spec
        b, _, t, _ = attn.shape
        h = h + F.linear(attn.transpose(1, 2).reshape(b, t, -1), layer.o_w)
        x = F.rms_norm(h, (s.hidden_size,), layer.ln_mlp, s.rms_norm_eps)
        gate, up = F.linear(x, layer.gate_up_w).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, layer.down_w)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self._weights
        logits = F.linear(F.rms_norm(h, (s.hidden_size,), w.norm, s.rms_norm_eps), w.lm_head)
        return logits.float().cpu()  # sampling runs on the host (a no-op on CPU)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
