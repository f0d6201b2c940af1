"""The engine conformance suite against every engine pivot ships (torch on a tiny random Qwen2,
the simulated engine in each of its output modes, the scripted engine), and against engines
broken on purpose, which it must catch."""

from __future__ import annotations

import pytest

from pivot.engines.conformance import (
    ConformanceError,
    EngineFactory,
    check_abort,
    check_engine,
    check_release_resume,
    check_reprefill,
    check_stream,
)
from pivot.engines.protocol import PartialOutput, SamplingParams
from pivot.engines.scripted import ScriptedEngine
from pivot.engines.sim_engine import SimInferenceEngine
from pivot.planning.cost import CostModel

VOCAB = 40


def tiny_qwen2(seed: int = 0):
    """A random 2-layer Qwen2 (hidden 32): its spec and its tensors, in checkpoint names."""
    import torch

    from pivot.engines.torch_engine import DecoderSpec

    spec = DecoderSpec(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_ids=(2,),
    )
    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = 32, 48, 4 * 8, 2 * 8

    def rand(*shape: int) -> torch.Tensor:
        # wide weights give peaky logits: no near-ties for float reordering to flip
        return torch.randn(*shape, generator=g) * 0.3

    tensors = {
        "model.embed_tokens.weight": rand(VOCAB, h),
        "model.norm.weight": 1.0 + rand(h),
        "lm_head.weight": rand(VOCAB, h),
    }
    for layer in range(spec.num_hidden_layers):
        p = f"model.layers.{layer}."
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            tensors[f"{p}self_attn.{name}_proj.weight"] = rand(rows, h)
            tensors[f"{p}self_attn.{name}_proj.bias"] = rand(rows)
        tensors[f"{p}self_attn.o_proj.weight"] = rand(h, q)
        tensors[f"{p}mlp.gate_proj.weight"] = rand(i, h)
        tensors[f"{p}mlp.up_proj.weight"] = rand(i, h)
        tensors[f"{p}mlp.down_proj.weight"] = rand(h, i)
        tensors[f"{p}input_layernorm.weight"] = 1.0 + rand(h)
        tensors[f"{p}post_attention_layernorm.weight"] = 1.0 + rand(h)
    return spec, tensors


def torch_factory() -> EngineFactory:
    from pivot.engines.torch_engine import TorchEngine

    spec, tensors = tiny_qwen2()
    return EngineFactory(
        name="torch",
        make=lambda: TorchEngine(spec, tensors, max_running=4, max_seq_len=32, seed=1),
        weights=lambda: tensors,
    )


HAND = CostModel(a=0.001, b=0.01, c=0.004, d=0.002)


def sim_factory(**modes) -> EngineFactory:
    def make() -> SimInferenceEngine:
        return SimInferenceEngine(
            HAND, max_running=8, kv_capacity_tokens=10_000, prefill_tokens_per_s=1000.0, **modes
        )

    placeholders = modes.get("placeholders", False)
    return EngineFactory(
        name=f"sim {modes}",
        make=make,
        token_ids=not placeholders,
        logprobs=not placeholders,
        token_events=modes.get("token_events", True),
        stop_tokens=False,  # the workload sets each length: stop tokens are not read
    )


def counting_script(prompt: tuple[int, ...], sampling: SamplingParams) -> list[int]:
    """Tokens 1..50, a function of the prompt, the seed and the position."""
    start = sum(prompt) * 31 + sampling.seed * 7
    return [(start + 3 * i) % 50 + 1 for i in range(sampling.max_new_tokens)]


def scripted_factory(engine: type[ScriptedEngine] = ScriptedEngine, **kw) -> EngineFactory:
    return EngineFactory(name=engine.__name__, make=lambda: engine(counting_script, **kw))


@pytest.mark.parametrize(
    "factory",
    [
        torch_factory,
        sim_factory,
        lambda: sim_factory(placeholders=True),
        lambda: sim_factory(token_events=False),
        lambda: sim_factory(placeholders=True, token_events=False),
        scripted_factory,
        # as the controller tests build it: step latencies and prefill times reported
        lambda: scripted_factory(
            cost_model=HAND, prefill_s=0.001, max_running=4, eos_token_ids=[2]
        ),
    ],
    ids=[
        "torch",
        "sim",
        "sim-placeholders",
        "sim-no-events",
        "sim-counts-only",
        "scripted",
        "scripted-timed",
    ],
)
def test_engine_passes_the_conformance_suite(factory):
    check_engine(factory())


# --- engines broken on purpose: the suite must catch each ------------------------------------


class DropsPartials(ScriptedEngine):
    """Abort forgets what the sequences had generated."""

    def abort(self, seq_ids=None):
        return [PartialOutput(p.seq_id, (), ()) for p in super().abort(seq_ids)]


class RestartsDispatched(ScriptedEngine):
    """A dispatched sequence starts over instead of continuing its partial output (the
    output is the same: only the work it does tells)."""

    def add(self, seq_id, prompt_ids, generated_ids=(), sampling=None, generated_logprobs=None):
        super().add(seq_id, prompt_ids, (), sampling)


class ReleasesAnything(ScriptedEngine):
    """Release ignores the rules: it frees context whatever the engine holds."""

    def release(self, kinds):
        pass


class StreamsTwice(ScriptedEngine):
    """Each step lists every event twice."""

    def step(self):
        out = super().step()
        return type(out)(out.step, out.events * 2, out.finished)


class SkipsStopTokens(ScriptedEngine):
    """Stop tokens are ignored."""

    def add(self, seq_id, prompt_ids, generated_ids=(), sampling=None, generated_logprobs=None):
        import msgspec

        sampling = msgspec.structs.replace(sampling, stop_token_ids=())
        super().add(seq_id, prompt_ids, generated_ids, sampling, generated_logprobs)


@pytest.mark.parametrize(
    ("engine", "check", "broken"),
    [
        (DropsPartials, check_abort, "aborted mid-output with 0 tokens"),
        (RestartsDispatched, check_reprefill, "expected the 4 missing"),
        (ReleasesAnything, check_release_resume, r"release\(\['persistent'\]\): did not raise"),
        (StreamsTwice, check_stream, "extra event"),
        (SkipsStopTokens, check_engine, "stop token"),
    ],
    ids=["abort-drops-partials", "reprefill-restarts", "release-ignores-rules", "stream", "stop"],
)
def test_the_suite_catches_a_broken_engine(engine, check, broken):
    with pytest.raises(ConformanceError, match=broken):
        check(scripted_factory(engine))


def test_a_factory_states_what_it_can_check():
    with pytest.raises(ValueError, match="two non-empty prompts"):
        EngineFactory(make=lambda: ScriptedEngine(counting_script), prompts=((1, 2),))
    with pytest.raises(ValueError, match="stop tokens"):
        EngineFactory(make=lambda: ScriptedEngine(counting_script), token_ids=False)
