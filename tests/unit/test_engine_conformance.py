"""The engine conformance suite against the simulated engine in each of its output modes, the
scripted engine and the SGLang backend on the test kit's fake SGLang (the torch engine runs it once per decoder family, on checkpoints saved by
transformers: test_decoder_families.py), and against engines broken on purpose, which it must
catch."""

from __future__ import annotations

import pytest

from pivot.actors import fake_sglang
from pivot.actors.sglang_engine import SGLangEngine
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


def sglang_factory(incremental: bool = False) -> EngineFactory:
    """The SGLang backend on the test kit's fake SGLang, its requests paced so that aborts
    reach running ones; ``incremental``: streamed chunks are deltas."""
    weights = {"model.embed_tokens.weight": [0.5], "lm_head.weight": [0.25]}

    def make() -> SGLangEngine:
        # wait_s: generous; a step returns as soon as every running sequence has its token
        fake = fake_sglang.api(incremental=incremental, iteration_s=0.001)
        return SGLangEngine.launch("fake/tiny", api=fake, wait_s=30.0, param_names=weights)

    return EngineFactory(
        name=f"sglang (fake, incremental={incremental})", make=make, weights=lambda: dict(weights)
    )


@pytest.mark.parametrize(
    "factory",
    [
        sim_factory,
        lambda: sim_factory(placeholders=True),
        lambda: sim_factory(token_events=False),
        lambda: sim_factory(placeholders=True, token_events=False),
        scripted_factory,
        # as the controller tests build it: step latencies and prefill times reported
        lambda: scripted_factory(
            cost_model=HAND, prefill_s=0.001, max_running=4, eos_token_ids=[2]
        ),
        sglang_factory,
        lambda: sglang_factory(incremental=True),
    ],
    ids=[
        "sim",
        "sim-placeholders",
        "sim-no-events",
        "sim-counts-only",
        "scripted",
        "scripted-timed",
        "sglang-fake",
        "sglang-fake-incremental",
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
