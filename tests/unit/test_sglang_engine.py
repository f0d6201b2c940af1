"""The SGLang backend on the test kit's fake SGLang, beyond the conformance suite (which runs
it in test_engine_conformance.py): what it asks of SGLang around weight updates and releases,
errors and figures it takes from SGLang, and the fake's signatures against the table the
source check reads (``pivot.actors.sglang_surface``)."""

from __future__ import annotations

import dataclasses
import inspect
import sys

import pytest

from pivot.actors import fake_sglang, sglang_surface
from pivot.actors.sglang_engine import SGLangEngine, SGLangMissing, _place, real_api
from pivot.engines.protocol import EngineError, SamplingParams

WEIGHTS = {"model.embed_tokens.weight": [0.5], "lm_head.weight": [0.25]}


def launch(**fake) -> SGLangEngine:
    # wait_s: generous, a step returns as soon as every running sequence has its token
    return SGLangEngine.launch(
        "fake/tiny", api=fake_sglang.api(**fake), wait_s=30.0, param_names=WEIGHTS
    )


def _sampling(n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, seed=3, ignore_eos=True)


def _tm(engine: SGLangEngine) -> fake_sglang.TokenizerManager:
    return engine._tm


def test_a_weight_update_with_sequences_running_is_made_while_paused_in_retract_mode():
    engine = launch(iteration_s=0.001)
    engine.add(0, [3, 4, 5], sampling=_sampling())
    engine.step()
    engine.load_weights(WEIGHTS, 4)
    assert _tm(engine).calls == [
        "pause:retract",
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
        "continue",
    ]
    assert _tm(engine).weight_version == "4" and engine.stats().weights_version == 4
    # idle: no pause, SGLang's writer lock orders the update after any request
    while engine.has_unfinished():
        engine.step()
    engine.load_weights(WEIGHTS, 5)
    assert _tm(engine).calls[5:] == [
        "begin_weight_update",
        "update_weights_from_tensor",
        "end_weight_update",
    ]


def test_a_weight_update_sends_one_payload_per_tensor_parallel_rank():
    engine = SGLangEngine.launch("fake/tiny", api=fake_sglang.api(), tp_size=2)
    engine.load_weights(WEIGHTS, 1)  # the fake refuses a payload count other than tp_size
    assert engine.stats().weights_version == 1 and _tm(engine).weight_version == "1"


def test_weights_resumed_serve_only_once_every_parameter_is_loaded():
    engine = launch()
    engine.release(["weights"])
    engine.resume(["weights"])
    engine.load_weights({"lm_head.weight": [0.25]}, 1)
    assert not engine.stats().weights_ready
    engine.load_weights({"model.embed_tokens.weight": [0.5]}, 1)
    assert engine.stats().weights_ready
    assert _tm(engine).calls[:2] == ["release:weights", "resume:weights"]


def test_a_stateful_release_with_sequences_held_reaches_sglang_once_idle():
    engine = launch(iteration_s=0.001)
    engine.add(0, [3, 4, 5], sampling=_sampling(4))
    engine.step()
    engine.release(["stateful"])
    assert not any(c.startswith("release") for c in _tm(engine).calls)
    while engine.has_unfinished():
        engine.step()
    assert _tm(engine).calls == ["release:cuda_graph"]
    engine.resume(["stateful"])
    assert _tm(engine).calls == ["release:cuda_graph", "resume:cuda_graph"]


def test_releasing_the_kv_cache_then_resuming_flushes_it():
    engine = launch()
    engine.release(["transient"])
    engine.resume(["transient"])
    assert _tm(engine).calls == ["release:kv_cache", "resume:kv_cache", "flush_cache"]


def test_a_request_sglang_aborts_on_its_own_is_an_error_naming_the_sequence():
    engine = launch(iteration_s=0.01)
    engine.add(7, [3, 4, 5], sampling=_sampling(64))
    engine.step()
    tm = _tm(engine)
    engine._loop.call_soon_threadsafe(lambda: tm.abort_request(abort_all=True))
    with pytest.raises(EngineError, match="sequence 7: SGLang ended it: Abort"):
        for _ in range(100):
            engine.step()
    assert not engine.has_unfinished()


def test_memory_and_load_figures_come_from_sglang():
    engine = launch()
    memory = engine.memory
    assert (memory.weights_gb, memory.kv_cache_gb, memory.cuda_graph_gb) == (0.25, 1.5, 0.125)
    stats = engine.stats()
    assert stats.kv_capacity_tokens == memory.kv_capacity_tokens == 16 * 256
    assert stats.max_running == 16
    engine.add(0, [3, 4, 5], sampling=_sampling())
    engine.step()
    assert (engine.stats().running, engine.stats().kv_tokens) == (1, 4)


def test_decode_samples_come_from_the_streamed_chunks_of_the_running_batch():
    """The cost-model refit's sample (EngineStats.decode_*): none until a sequence streamed
    two one-token chunks, then the batch, its KV tokens and a gap no shorter than the fake's
    iteration; none while a sequence waits for its first token."""
    engine = launch(iteration_s=0.01)
    for i in range(2):
        engine.add(i, [3, 4, 5], sampling=_sampling(6))
    engine.step()  # both admitted: each one's first chunk
    assert engine.stats().decode_itl_s == 0.0
    engine.step()
    engine.step()
    stats = engine.stats()
    # the context the iteration attended over: before the step's two tokens
    assert (stats.decode_running, stats.decode_tokens) == (2, stats.kv_tokens - 2)
    assert stats.decode_itl_s >= 0.01
    engine.add(9, [3, 4], sampling=_sampling(2))
    engine.step()  # the newcomer's first token or not, its prefill shared the iteration
    assert engine.stats().decode_itl_s == 0.0
    engine.abort(None)


def test_chunks_are_placed_by_where_they_end():
    held = [1, 2, 3]
    _place(held, [4], 4)  # a delta, or an abort chunk collapsed to the last token
    assert held == [1, 2, 3, 4]
    _place(held, [1, 2, 3, 4, 5], 5)  # cumulative
    assert held == [1, 2, 3, 4, 5]
    with pytest.raises(EngineError, match="does not follow"):
        _place(held, [9], 7)


def test_shutdown_closes_sglang():
    engine = launch()
    sglang = engine._engine
    engine.close()
    assert sglang.closed and not engine._thread.is_alive()


def test_without_sglang_installed_the_backend_says_so_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(SGLangMissing) as err:
        real_api()
    message = str(err.value)
    assert "\n" not in message and sglang_surface.PIN in message and "GPU (SGLang)" in message


# --- the fake mirrors the table ---------------------------------------------------------------

_FAKE_OWNERS = {
    "Engine": fake_sglang.Engine,
    "TokenizerManager": fake_sglang.TokenizerManager,
    "MultiprocessingSerializer": fake_sglang.MultiprocessingSerializer,
}


@pytest.mark.parametrize("call", sglang_surface.CALLS, ids=lambda c: f"{c.owner}.{c.name}")
def test_the_fake_has_each_call_of_the_table_with_its_signature(call):
    fn = getattr(_FAKE_OWNERS[call.owner], call.name)
    params = tuple(p for p in inspect.signature(fn).parameters if p != "self")
    assert params == call.params
    is_async = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
    assert is_async == call.is_async


def test_the_fake_has_each_request_field_and_name_of_the_table():
    fake = fake_sglang.api()
    assert set(vars(fake)) == set(sglang_surface.MODULES)
    for name, wanted in sglang_surface.REQUESTS.items():
        fields = {f.name for f in dataclasses.fields(getattr(fake, name))}
        assert set(wanted) <= fields, name


def test_the_fake_refuses_engine_keywords_the_table_does_not_list():
    with pytest.raises(TypeError, match="not in sglang_surface"):
        fake_sglang.api().Engine(model_path="m", skip_tokenizer_init=True, tp_sise=2)


def test_an_agent_of_engine_sglang_serves_each_role_with_sglang_on_its_gpu(monkeypatch):
    from pivot.actors import sglang_engine
    from pivot.actors.agent import engines_for
    from pivot.assets import ASSETS

    monkeypatch.setattr(sglang_engine, "real_api", lambda: fake_sglang.api(vocab_size=512))
    folders = {"rollout": ASSETS / "tiny-policy", "reward": ASSETS / "tiny-genrm"}
    engines, _ = engines_for(
        folders, {}, reader_name="agent-3", engine="sglang", device=3, max_running=8, seed=1
    )
    for role, engine in engines.items():
        assert isinstance(engine, SGLangEngine)
        args = engine._engine.server_args
        assert args["model_path"] == str(folders[role])
        assert (args["base_gpu_id"], args["mem_fraction_static"]) == (3, 0.4)
        assert args["max_running_requests"] == 8 and args["enable_memory_saver"]
        engine.close()


def test_fresh_engines_on_one_sglang_engine_pass_the_conformance_suite():
    # as scripts/gpu_conformance.py runs the suite on a GPU, where a launch takes a minute
    from pivot.engines.conformance import EngineFactory, check_engine

    engines = [launch(iteration_s=0.001)]

    def make() -> SGLangEngine:
        engines.append(engines[-1].fresh())
        return engines[-1]

    check_engine(EngineFactory(name="sglang (fake, fresh)", make=make, weights=lambda: WEIGHTS))
    assert len({id(e._engine) for e in engines}) == 1 and len(engines) > 10


def test_fresh_needs_an_engine_holding_all_its_context():
    from pivot.engines.protocol import EngineNotServing

    engine = launch()
    engine.release(["weights"])
    with pytest.raises(EngineNotServing, match="holds all its context"):
        engine.fresh()


def test_the_gpu_conformance_script_dry_runs_on_the_fake(capsys):
    import importlib.util
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_conformance.py"
    spec = importlib.util.spec_from_file_location("gpu_conformance", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--fake"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and set(out["checks"]) == {
        "check_generate",
        "check_stream",
        "check_abort",
        "check_reprefill",
        "check_release_resume",
        "check_load_weights",
    }
