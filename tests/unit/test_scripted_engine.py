"""The scripted engine's own promises, beyond the conformance suite: its outputs follow the
script and its finish rules, re-prefills must continue the script, and it records its calls."""

import pytest

from pivot.engines.protocol import EngineNotServing, FinishReason, SamplingParams
from pivot.engines.scripted import ScriptedEngine
from pivot.planning.cost import CostModel

EOS = 9


def script(prompt, sampling):
    return [sampling.seed, *prompt, EOS, 1, 1]  # everything after eos is never reached


def run(engine):
    done = {}
    while engine.has_unfinished():
        for f in engine.step().finished:
            done[f.seq_id] = f
    return done


def test_outputs_follow_the_script_and_its_finish_rules():
    engine = ScriptedEngine(script, eos_token_ids=[EOS], max_running=2)
    engine.add("eos", [5, 6], sampling=SamplingParams(seed=4))
    engine.add("length", [5, 6], sampling=SamplingParams(seed=4, max_new_tokens=2))
    engine.add("end", [5], sampling=SamplingParams(seed=3, ignore_eos=True))
    engine.add("stop", [5, 6], sampling=SamplingParams(seed=4, stop_token_ids=(6,)))
    first = engine.step()
    assert first.admitted == ("eos", "length") and first.prefill_tokens == 4
    assert engine.stats().waiting == 2  # max_running holds the others back
    done = run(engine)
    assert (done["eos"].token_ids, done["eos"].finish_reason) == ((4, 5, 6, EOS), "stop")
    assert (done["length"].token_ids, done["length"].finish_reason) == ((4, 5), "length")
    # ignore_eos: the script's own end stops it
    assert done["end"].token_ids == (3, 5, EOS, 1, 1)
    assert done["end"].finish_reason is FinishReason.STOP
    assert (done["stop"].token_ids, done["stop"].finish_reason) == ((4, 5, 6), "stop")
    assert done["eos"].logprobs == (-0.5,) * 4


def test_a_re_prefill_must_continue_the_script():
    engine = ScriptedEngine(script)
    with pytest.raises(ValueError, match="diverge from the script at position 1"):
        engine.add(1, [5, 6], [4, 6], SamplingParams(seed=4), generated_logprobs=[0.0, 0.0])
    with pytest.raises(ValueError, match="none left after the 6 handed in"):
        engine.add(1, [5, 6], [4, 5, 6, EOS, 1, 1], SamplingParams(seed=4), [0.0] * 6)
    engine.add(1, [5, 6], [4, 5], SamplingParams(seed=4), generated_logprobs=[-1.0, -2.0])
    assert run(engine)[1].logprobs == (-1.0, -2.0, -0.5, -0.5, -0.5, -0.5)


def test_seeds_come_from_the_engine_when_the_sampling_has_none():
    engine = ScriptedEngine(script, seed=1)
    engine.add(1, [5])
    engine.add(2, [5])
    seeds = [f.token_ids[0] for f in run(engine).values()]
    assert seeds == [1_000_003, 1_000_004]


def test_it_records_calls_reports_latency_and_can_stall():
    model = CostModel(a=0.001, b=0.01, c=0.004, d=0.002)
    engine = ScriptedEngine(script, cost_model=model, prefill_s=0.25)
    engine.add(1, [5, 6], sampling=SamplingParams(seed=4))
    engine.add(2, [5, 6], [4], SamplingParams(seed=4), generated_logprobs=[0.0])
    out = engine.step()
    assert out.prefill_s == 0.5 and out.cost_s == 0.0
    # ITL(2 running, 2 + 3 tokens) = 0.005 + max(0.01, 0.008) + 0.002
    assert engine.stats().last_step_s == pytest.approx(0.017)
    assert engine.added == [(1, 0), (2, 1)]
    engine.stalled = True
    assert not engine.has_unfinished() and engine.stats().running == 2
    engine.abort()
    engine.release(["transient", "weights"])
    engine.resume(["transient"])
    with pytest.raises(EngineNotServing, match="weights are released"):
        engine.add(3, [5])
    engine.load_weights({"w": 1.0}, 2)
    assert engine.loaded == [({"w": 1.0}, 2)] and engine.stats().weights_version == 2
