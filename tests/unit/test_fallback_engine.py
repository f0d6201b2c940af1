"""The transformers fallback engine on an architecture outside pivot's families (GPT-2:
learned positions, LayerNorm, GELU, a tied lm_head, a class named ...LMHeadModel), random
weights saved as a Hugging Face folder: transformers' greedy tokens over 64 steps with
log-probabilities within 1e-4, straight and across an abort and a re-prefill; the conformance
suite; inspect_checkpoint's verdicts (torch-free) and load_engine's choice; an agent's
engines built from such a folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from hf_reference import (
    GREEDY,
    PROMPT,
    STEPS,
    check_across_abort,
    check_straight,
    randomize,
    run_one,
)

from actors.agent import CheckpointWeights, engines_for
from pivot.engines.checkpoint import (
    CheckpointError,
    DecoderSpec,
    FallbackSpec,
    engine_spec,
    inspect_checkpoint,
)
from pivot.engines.conformance import EngineFactory, check_engine
from pivot.engines.hf_engine import TransformersEngine
from pivot.engines.loading import load_engine, read_weights
from pivot.engines.protocol import FinishReason, SamplingParams
from pivot.engines.torch_engine import TorchEngine

EOS = 2


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=128,
        bos_token_id=1,
        eos_token_id=EOS,
    )
    torch.manual_seed(0)
    return randomize(GPT2LMHeadModel(config), norm="ln_")  # GPT-2's LayerNorms: ln_1, ln_2, ln_f


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    model = _gpt2()
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder, safe_serialization=True)
    return model, folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    folder = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def _engine(folder, **kw) -> TransformersEngine:
    return TransformersEngine.from_pretrained(folder, max_running=kw.pop("max_running", 4), **kw)


def test_greedy_tokens_and_logprobs_match_transformers(gpt2):
    model, folder = gpt2
    diff = check_straight(lambda: _engine(folder), model)
    print(f"max logprob difference, straight: {diff:.2e}")
    # and transformers' own generate, cached as the engine is, gives the same tokens
    engine = _engine(folder)
    engine.add(0, PROMPT, sampling=GREEDY)
    tokens, _ = run_one(engine)
    want = model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=STEPS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(PROMPT) :]
    assert tokens == want.tolist()


def test_an_abort_and_a_reprefill_elsewhere_continue_exactly(gpt2):
    model, folder = gpt2
    diff = check_across_abort(lambda: _engine(folder), model)
    print(f"max logprob difference, across an abort: {diff:.2e}")


def test_the_fallback_passes_the_conformance_suite(gpt2):
    _, folder = gpt2
    tensors = read_weights(folder)
    check_engine(
        EngineFactory(
            name="gpt2 on transformers", make=lambda: _engine(folder), weights=lambda: tensors
        )
    )


def test_eos_and_the_sequence_length_limit_finish_as_on_the_torch_engine(gpt2):
    _, folder = gpt2
    engine = _engine(folder, max_seq_len=len(PROMPT) + 5)
    engine.add(0, PROMPT, sampling=SamplingParams(temperature=0.0, max_new_tokens=50))
    done = {}
    while engine.has_unfinished():
        done.update({f.seq_id: f for f in engine.step().finished})
    # the cache holds max_seq_len tokens at most: prompt + 5 fed, the sixth sampled last
    assert len(done[0].token_ids) == 6 and done[0].finish_reason is FinishReason.LENGTH
    assert engine.eos_token_ids == {EOS}  # the config's, as inspect_checkpoint read it
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add(2, PROMPT * 2)


def test_tied_and_unknown_names_in_load_weights(gpt2):
    _, folder = gpt2
    engine = _engine(folder)
    embed = engine.model.get_input_embeddings().weight
    engine.load_weights({"lm_head.weight": torch.zeros(64, 32)}, 1)  # the tied name
    assert float(embed.abs().sum()) == 0.0 and engine.weights_version == 1
    with pytest.raises(ValueError, match="unknown parameter names \\['model.norm.weight'\\]"):
        engine.load_weights(
            {"transformer.wte.weight": torch.ones(64, 32), "model.norm.weight": torch.ones(32)}, 2
        )
    assert float(embed.abs().sum()) == 0.0 and engine.weights_version == 1  # nothing copied
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({"transformer.wte.weight": torch.ones(32, 64)}, 2)


def test_inspect_checkpoint_accepts_the_folder_for_the_fallback_without_torch(gpt2):
    _, folder = gpt2
    spec, files = inspect_checkpoint(folder)
    assert isinstance(spec, FallbackSpec) and [f.name for f in files] == ["model.safetensors"]
    assert (spec.model_type, spec.architecture, spec.eos_token_ids) == (
        "gpt2",
        "GPT2LMHeadModel",
        (EOS,),
    )
    assert "key 'model_type'" in spec.reason and "found 'gpt2'" in spec.reason
    probe = (
        "import sys; from pivot.engines.checkpoint import inspect_checkpoint; "
        f"spec, _ = inspect_checkpoint({str(folder)!r}); "
        "print(type(spec).__name__, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["FallbackSpec", "False", "False"]


def test_inspect_checkpoint_rejects_what_neither_engine_serves(gpt2, tmp_path):
    _, folder = gpt2
    config = json.loads((folder / "config.json").read_text())
    cases = [
        ({"model_type": "no-such-model"}, "model_type", "found 'no-such-model'"),
        (
            {"architectures": ["GPT2ForSequenceClassification"]},
            "architectures",
            "expected 'GPT2LMHeadModel'",
        ),
        ({"architectures": None}, "architectures", "found none"),
    ]
    for change, key, what in cases:
        bad = tmp_path / key / what.replace(" ", "-").replace("'", "")
        shutil.copytree(folder, bad)
        (bad / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(CheckpointError) as caught:
            inspect_checkpoint(bad)
        [line] = str(caught.value).splitlines()
        assert line.startswith(f"{bad / 'config.json'}: key '{key}': expected "), line
        assert what in line, line
        if key == "model_type":  # what is supported: pivot's families or transformers' LMs
            assert "'llama'" in line and "causal LM in transformers" in line, line


def test_a_family_feature_pivots_engine_lacks_runs_on_the_fallback():
    base = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": 16,
    }
    assert isinstance(engine_spec(base), DecoderSpec)
    scaled = engine_spec({**base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert isinstance(scaled, FallbackSpec) and "key 'rope_scaling'" in scaled.reason
    assert isinstance(engine_spec({**base, "mlp_bias": True}), FallbackSpec)
    # malformed is an error for both engines; the fallback needs the class named
    with pytest.raises(CheckpointError, match="key 'vocab_size'"):
        engine_spec({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(CheckpointError, match="key 'architectures'.*'LlamaForCausalLM'"):
        engine_spec({**base, "mlp_bias": True, "architectures": []})


def test_load_engine_picks_the_engine_and_reads_sharded_weights(gpt2, llama, tmp_path):
    model, folder = gpt2
    assert type(load_engine(llama, max_running=1)) is TorchEngine
    engine = load_engine(folder, max_running=1)
    assert type(engine) is TransformersEngine
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="20KB")
    _, files = inspect_checkpoint(sharded)
    assert len(files) > 1 and (sharded / "model.safetensors.index.json").is_file()
    short = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    outputs = []
    for e in (engine, load_engine(sharded, max_running=1)):
        e.add(0, PROMPT, sampling=short)
        while e.has_unfinished():
            outputs += e.step().finished
    assert outputs[0].token_ids == outputs[1].token_ids
    assert read_weights(sharded).keys() == read_weights(folder).keys()


def test_an_agent_builds_the_fallback_engine_and_reloads_its_weights(gpt2):
    _, folder = gpt2
    engines, weights = engines_for({"rollout": folder}, {}, reader_name="agent", max_running=2)
    engine = engines["rollout"]
    assert type(engine) is TransformersEngine
    assert isinstance(weights["rollout"], CheckpointWeights)
    # a shift: weights dropped, then read back from the folder as an Acquire does
    engine.release(["transient", "weights"])
    engine.resume(["transient", "weights"])
    tensors, version = weights["rollout"]("policy", 0)
    engine.load_weights(tensors, version)
    engine.add(0, PROMPT, sampling=GREEDY)
    fresh = _engine(folder)
    fresh.add(0, PROMPT, sampling=GREEDY)
    assert run_one(engine) == run_one(fresh)
