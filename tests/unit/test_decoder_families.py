"""pivot's torch engine against transformers, for each decoder family it serves itself
(Llama, Mistral, Qwen2, Qwen3), on random weights saved as a Hugging Face folder: the same
greedy tokens over 64 steps, log-probabilities within 1e-4, also across an abort and a
re-prefill on another engine; and each family's engine passes the conformance suite."""

from __future__ import annotations

import pytest
import torch

from pivot.engines.checkpoint import inspect_checkpoint
from pivot.engines.conformance import EngineFactory, check_engine
from pivot.engines.protocol import SamplingParams
from pivot.engines.torch_engine import TorchEngine, read_checkpoint

STEPS = 64
PROMPT = [5, 17, 3, 42, 8, 11]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)


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
    model = model_class(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # wide weights give peaky logits: no near-ties for float reordering to flip;
            # norms stay near 1 (Qwen3's q/k norms too)
            noise = torch.randn(param.shape, generator=g)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.3 * noise)
    return model


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3"])
def family(request, tmp_path_factory):
    model = _model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    return request.param, model, folder


def _reference(model) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of PROMPT and each chosen token's log-probability."""
    ids = list(PROMPT)
    logprobs = []
    with torch.no_grad():
        for _ in range(STEPS):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            token = int(logp.argmax())
            ids.append(token)
            logprobs.append(float(logp[token]))
    return ids[len(PROMPT) :], logprobs


def _run(engine: TorchEngine) -> tuple[list[int], list[float]]:
    while engine.has_unfinished():
        out = engine.step()
        if out.finished:
            (done,) = out.finished
            return list(done.token_ids), list(done.logprobs)
    raise AssertionError("the engine held nothing")


def test_the_folder_reads_as_its_family(family):
    name, model, folder = family
    spec, files = inspect_checkpoint(folder)
    assert spec.model_type == name and [f.name for f in files] == ["model.safetensors"]
    assert spec.attention_bias == (name == "qwen2") and spec.qk_norm == (name == "qwen3")


def test_greedy_tokens_and_logprobs_match_transformers(family):
    _, model, folder = family
    want_tokens, want_logprobs = _reference(model)
    engine = TorchEngine.from_pretrained(folder, max_running=2)
    engine.add(0, PROMPT, sampling=GREEDY)
    tokens, logprobs = _run(engine)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def test_an_abort_and_a_reprefill_elsewhere_continue_exactly(family):
    _, model, folder = family
    want_tokens, want_logprobs = _reference(model)
    first = TorchEngine.from_pretrained(folder, max_running=2)
    first.add(0, PROMPT, sampling=GREEDY)
    for _ in range(STEPS // 3):
        first.step()
    (partial,) = first.abort([0])
    assert 0 < len(partial.token_ids) < STEPS
    second = TorchEngine.from_pretrained(folder, max_running=2)
    second.add(0, PROMPT, partial.token_ids, GREEDY, generated_logprobs=list(partial.logprobs))
    tokens, logprobs = _run(second)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


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
