"""Hugging Face checkpoint folders as pivot's engines read them, without torch: which engine
serves a folder, the parts of config.json it needs, validated with errors that name the file,
the key, what is supported and what was found, and the safetensors files that hold the
weights. ``pivot run`` checks every model folder this way before any child process starts.

Which engine: pivot's own torch engine serves the Llama-shaped ``FAMILIES`` (``DecoderSpec``).
Any other causal LM transformers has, and a family's checkpoint with a feature pivot's engine
lacks (rope scaling, a sliding window, MLP biases, another activation: ``UnsupportedFeature``),
runs on the transformers fallback (``FallbackSpec``, ``pivot.engines.hf_engine``), provided
config.json's ``architectures`` names that model type's causal-LM class. A malformed config
(a required value missing or wrong) is an error for both.

    inspect_checkpoint(folder) -> (DecoderSpec | FallbackSpec, [weight files])
                                                                   raises CheckpointError
    model_shape(folder) -> ModelShape      what the model's memory depends on (pivot.memory)
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import math
from pathlib import Path

import msgspec

from pivot.config import ConfigError

#: The decoder families pivot's engine serves itself (``DecoderSpec``).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class CheckpointError(ConfigError):
    """A checkpoint folder pivot cannot serve: the file, the key, what is supported and what
    was found, as a config error says them (``str()`` is the one line to show)."""


class UnsupportedFeature(CheckpointError):
    """A config pivot's own engine does not serve (another model type, or a family's feature
    it lacks), well formed: the transformers fallback may serve it."""


class DecoderSpec(msgspec.Struct, frozen=True, kw_only=True):
    """The parts of a config.json the forward of a Llama-shaped decoder needs: pre-norm
    blocks of rotary attention (grouped heads) and a SiLU-gated MLP, RMSNorm throughout. The
    families differ in what the attention carries: Qwen2 biases its q/k/v projections, Qwen3
    normalises each head's q and k (``qk_norm``), Llama and Mistral have neither."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    model_type: str = "qwen2"
    attention_bias: bool = True
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: dict, source: str = "config.json") -> DecoderSpec:
        """Validate a config dict of one of the ``FAMILIES``: another model type or a feature
        pivot's engine lacks is an ``UnsupportedFeature``, a malformed value a
        ``CheckpointError``, each naming the file, the key, what pivot's engine supports and
        what was found."""

        def need(key: str, kind: type = int):
            if key not in config or config[key] is None:
                raise CheckpointError(source, key, "a value", "none")
            value = config[key]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise CheckpointError(source, key, "an integer", repr(value))
            return value

        model_type = config.get("model_type")
        if model_type not in FAMILIES:
            raise UnsupportedFeature(
                source,
                "model_type",
                f"one of {', '.join(map(repr, FAMILIES))} (the families pivot's engine serves)",
                repr(model_type),
            )
        if config.get("mlp_bias"):
            raise UnsupportedFeature(source, "mlp_bias", "false (no MLP biases)", "true")
        window = config.get("sliding_window")
        if (
            model_type == "mistral"
            and window is not None
            and window < need("max_position_embeddings")
        ):
            raise UnsupportedFeature(
                source, "sliding_window", "none, or at least max_position_embeddings", repr(window)
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedFeature(source, "hidden_act", "'silu'", repr(act))
        if config.get("use_sliding_window"):
            raise UnsupportedFeature(
                source, "use_sliding_window", "false (no sliding window)", "true"
            )
        layer_types = config.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise UnsupportedFeature(
                source, "layer_types", "only 'full_attention'", repr(sorted(set(layer_types)))
            )
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedFeature(source, "rope_scaling", "the default rope", repr(rope_type))
        # transformers >= 5 keeps rope_theta in rope_parameters; 4.x at the top level
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv_heads = config.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise CheckpointError(
                source,
                "num_key_value_heads",
                f"a divisor of num_attention_heads ({heads})",
                repr(kv_heads),
            )
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=need("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=config.get("head_dim") or hidden // heads,
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=need("max_position_embeddings"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            eos_token_ids=eos_token_ids(config),
            model_type=model_type,
            # Qwen2 always biases q/k/v; the others only when their config says so
            attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
        )


class FallbackSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint the transformers fallback engine serves (``pivot.engines.hf_engine``): its
    model type, the causal-LM class config.json names (the class the engine builds), its eos
    tokens, and why pivot's own engine does not serve it (``reason``: that error's line)."""

    model_type: str
    architecture: str
    eos_token_ids: tuple[int, ...]
    reason: str
    vocab_size: int | None = None  # None: config.json keeps it elsewhere (e.g. text_config)

    @classmethod
    def from_config(cls, config: dict, source: str, reason: str) -> FallbackSpec:
        """Accept a config whose model type has a causal LM in transformers and whose
        ``architectures`` names it; otherwise a ``CheckpointError`` naming the key."""
        model_type = config.get("model_type")
        classes = causal_lm_classes()
        if not isinstance(model_type, str) or model_type not in classes:
            raise CheckpointError(
                source,
                "model_type",
                f"one of {', '.join(map(repr, FAMILIES))} (pivot's engine) or a model type "
                f"with a causal LM in transformers (its fallback engine)",
                repr(model_type),
            )
        named = config.get("architectures") or []
        wanted = classes[model_type]
        architecture = next((n for n in named if n in wanted), None)
        if architecture is None:
            raise CheckpointError(
                source,
                "architectures",
                f"{' or '.join(map(repr, wanted))} (the causal LM transformers has for "
                f"model_type {model_type!r})",
                repr(named) if named else "none",
            )
        return cls(
            model_type=model_type,
            architecture=architecture,
            eos_token_ids=eos_token_ids(config),
            reason=reason,
            vocab_size=vocab if isinstance(vocab := config.get("vocab_size"), int) else None,
        )


@functools.cache
def causal_lm_classes() -> dict[str, tuple[str, ...]]:
    """transformers' model types with a causal LM and the names of those classes, from its
    ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, read as data from its source: importing the module
    that holds it (or, in transformers 5, its config mapping) loads torch, which ``pivot
    run``'s parent must not. Empty without transformers."""
    found = importlib.util.find_spec("transformers")
    if found is None or found.origin is None:
        return {}
    source = Path(found.origin).parent / "models" / "auto" / "modeling_auto.py"
    for node in ast.parse(source.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and any(
                getattr(t, "id", None) == "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES" for t in node.targets
            )
            and isinstance(node.value, ast.Call)
            and node.value.args
        ):
            pairs = ast.literal_eval(node.value.args[0])
            return {k: (v,) if isinstance(v, str) else tuple(v) for k, v in pairs}
    return {}


def engine_spec(config: dict, source: str = "config.json") -> DecoderSpec | FallbackSpec:
    """Which engine serves a config: pivot's own (``DecoderSpec``) when it can, else the
    transformers fallback (``FallbackSpec``); a config neither serves is a CheckpointError."""
    try:
        return DecoderSpec.from_config(config, source=source)
    except UnsupportedFeature as own:
        return FallbackSpec.from_config(config, source, reason=str(own))


def eos_token_ids(config: dict) -> tuple[int, ...]:
    """A config's eos_token_id (none, one or a list) as a tuple."""
    eos = config.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))


def read_config(folder: Path) -> dict:
    """A checkpoint folder's config.json as a dict (eos from generation_config.json when
    config.json has none); a missing or unreadable one is a ``CheckpointError``."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(str(folder), "", "a Hugging Face checkpoint folder", "no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            str(config_path), "", "a JSON object", f"unreadable ({exc})"
        ) from None
    if not isinstance(config, dict):
        raise CheckpointError(str(config_path), "", "a JSON object", type(config).__name__)
    gen_path = folder / "generation_config.json"
    if config.get("eos_token_id") is None and gen_path.is_file():
        config["eos_token_id"] = json.loads(gen_path.read_text()).get("eos_token_id")
    return config


def inspect_checkpoint(path: str | Path) -> tuple[DecoderSpec | FallbackSpec, list[Path]]:
    """The spec of a Hugging Face checkpoint folder (``engine_spec``: which engine serves it)
    and the files of its weights.

    Reads config.json (eos from generation_config.json when config.json has none) and finds
    model.safetensors or the shards listed in model.safetensors.index.json.
    """
    folder = Path(path)
    config = read_config(folder)
    spec = engine_spec(config, source=str(folder / "config.json"))
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CheckpointError(str(index), "weight_map", "shards that exist", ", ".join(missing))
    elif (folder / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise CheckpointError(
            str(folder), "", "model.safetensors or model.safetensors.index.json", "neither"
        )
    files = [folder / n for n in names]
    for path in files:
        _check_header(path)
    return spec, files


def _check_header(path: Path) -> None:
    """A weights file's header (its tensor table) parses: a truncated or corrupt file is one
    line naming it here, not a child that dies while loading it. Reads the header only."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
    except Exception as exc:  # safetensors raises its own error types for a bad file
        raise CheckpointError(
            str(path), "", "a safetensors file", f"unreadable ({str(exc)[:120]})"
        ) from None


class ModelShape(msgspec.Struct, frozen=True, kw_only=True):
    """What a model's memory depends on (``pivot.memory``): its parameters, and the sizes
    that set what a cached position and a token in a forward cost. ``model_shape`` reads it."""

    parameters: int
    layers: int
    hidden_size: int
    intermediate_size: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int


def decoder_parameters(spec: DecoderSpec) -> int:
    """The parameters of a ``DecoderSpec`` model, counted from its config as pivot's engine
    lays them out (embedding, untied head, per layer q/k/v/o, gated MLP, norms)."""
    q = spec.num_attention_heads * spec.head_dim
    kv = spec.num_key_value_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    per_layer = (q + 2 * kv) * h + h * q + 3 * h * i + 2 * h
    if spec.attention_bias:
        per_layer += q + 2 * kv
    if spec.qk_norm:
        per_layer += 2 * spec.head_dim
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * h
    return spec.vocab_size * h + head + spec.num_hidden_layers * per_layer + h


def model_shape(path: str | Path) -> ModelShape:
    """A checkpoint folder's ``ModelShape``. Pivot's engine families are counted from
    config.json alone (the weights are not read); a fallback model's parameters are counted
    from its weight files' headers, its sizes read from config.json (or its ``text_config``),
    a size it does not give counting 0."""
    folder = Path(path)
    spec, files = inspect_checkpoint(folder)
    if isinstance(spec, DecoderSpec):
        return ModelShape(
            parameters=decoder_parameters(spec),
            layers=spec.num_hidden_layers,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            heads=spec.num_attention_heads,
            kv_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
            vocab_size=spec.vocab_size,
            max_positions=spec.max_position_embeddings,
        )
    config = read_config(folder)
    text = config.get("text_config")
    if isinstance(text, dict) and "hidden_size" not in config:
        config = text

    def size(key: str, default: int = 0) -> int:
        for name in (key, *_SIZE_ALIASES.get(key, ())):
            value = config.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return default

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    return ModelShape(
        parameters=_header_parameters(files),
        layers=size("num_hidden_layers"),
        hidden_size=hidden,
        intermediate_size=size("intermediate_size", 4 * hidden),
        heads=heads,
        kv_heads=size("num_key_value_heads", heads),
        head_dim=size("head_dim", hidden // heads if heads else 0),
        vocab_size=size("vocab_size", spec.vocab_size or 0),
        max_positions=size("max_position_embeddings"),
    )


# other names transformers' configs give the sizes (their ``attribute_map``s: GPT-2's, T5's...)
_SIZE_ALIASES = {
    "hidden_size": ("n_embd", "d_model"),
    "num_hidden_layers": ("n_layer", "num_layers"),
    "num_attention_heads": ("n_head", "num_heads"),
    "intermediate_size": ("n_inner", "ffn_dim"),
    "max_position_embeddings": ("n_positions", "n_ctx"),
}


def _header_parameters(files: list[Path]) -> int:
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                total += math.prod(f.get_slice(name).get_shape())
    return total
