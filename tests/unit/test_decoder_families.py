"""pivot's torch engine against transformers, for each decoder family it serves itself
(Llama, Mistral, Qwen2, Qwen3), on random weights saved as a Hugging Face folder: the same
greedy tokens over 64 steps, log-probabilities within 1e-4, also across an abort and a
re-prefill on another engine; and each family's engine passes the conformance suite."""

from __future__ import annotations

import pytest
import torch
from hf_reference import check_across_abort, check_straight, randomize

from pivot.engines.checkpoint import inspect_checkpoint
from pivot.engines.conformance import EngineFactory, check_engine
from pivot.engines.torch_engine import TorchEngine, read_checkpoint


def _model(family: str):
    import transformers as tf

    classes = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 16}),
    }
    config_class, model_class, extra = classes[family]
    config = config_class(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        **extra,
    )
    torch.manual_seed(0)
    return randomize(model_class(config))  # Qwen3's q/k norms stay near 1 too


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    model = _model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, model, folder


def test_the_folder_reads_as_its_family(family):
    name, model, folder = family
    spec, files = inspect_checkpoint(folder)
    assert spec.model_type == name and [f.name for f in files] == ["model.safetensors"]
    assert spec.attention_bias == (name == "qwen2") and spec.qk_norm == (name == "qwen3")


def test_greedy_tokens_and_logprobs_match_transformers(family):
    _, model, folder = family
    check_straight(lambda: TorchEngine.from_pretrained(folder, max_running=2), model)


def test_an_abort_and_a_reprefill_elsewhere_continue_exactly(family):
    _, model, folder = family
    check_across_abort(lambda: TorchEngine.from_pretrained(folder, max_running=2), model)


def test_each_family_passes_the_conformance_suite(family):
    name, _, folder = family
    _, tensors = read_checkpoint(folder)
    check_engine(
        EngineFactory(
            name=name,
            make=lambda: TorchEngine.from_pretrained(folder, max_running=4),
            weights=lambda: tensors,
        )
    )
