"""The torch inference engine: agreement with Hugging Face Qwen2, continuous batching,
abort + re-dispatch, seeded sampling, finish rules, release/resume of context, validation."""

import pytest
import torch

from pivot.engines.protocol import (
    ContextKind,
    DuplicateSequence,
    EngineNotServing,
    FinishReason,
    InferenceEngine,
    SamplingParams,
)
from pivot.engines.torch_engine import DecoderSpec, TorchEngine, generate, read_checkpoint

VOCAB = 40
EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def _make_checkpoint(folder, tie: bool, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        eos_token_id=EOS,
        initializer_range=0.3,  # peaky random logits: no near-ties in greedy decoding
    )
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2")
    model = _make_checkpoint(folder, tie=request.param, seed=1)
    return folder, model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-tied")
    _make_checkpoint(folder, tie=True, seed=2)
    return folder


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            3, VOCAB, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def run_alone(folder, prompt, sampling, **kw):
    engine = TorchEngine.from_pretrained(folder, max_running=1, **kw)
    return generate(engine, [prompt], sampling)[0]


def test_engine_satisfies_the_protocol(folder):
    assert isinstance(TorchEngine.from_pretrained(folder), InferenceEngine)


def test_logits_match_hugging_face(checkpoint):
    folder, model = checkpoint
    engine = TorchEngine.from_pretrained(folder)
    ids = prompts(1, seed=3)[0] + prompts(1, seed=4)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    ours = engine.prompt_logits(ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def test_greedy_decode_matches_hugging_face_generate(checkpoint):
    folder, model = checkpoint
    engine = TorchEngine.from_pretrained(folder)
    prompt = prompts(1, seed=5)[0]
    out = generate(engine, [prompt], GREEDY)[0]
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert list(out.token_ids) == hf[0, len(prompt) :].tolist()
    # decode-step logprobs equal HF's log-softmax over the whole sequence
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(out.token_ids)])).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    expected = logp.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_read_checkpoint_names_and_spec(folder):
    spec, tensors = read_checkpoint(folder)
    assert spec.vocab_size == VOCAB and spec.eos_token_ids == (EOS,)
    engine = TorchEngine(spec, tensors)
    assert set(tensors) <= set(engine.parameter_names())


def test_continuous_batching_matches_decoding_alone(folder):
    ps = prompts(7, seed=6)
    lengths = [5, 24, 9, 17, 3, 12, 20]
    alone = [
        run_alone(folder, p, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
        for p, n in zip(ps, lengths, strict=True)
    ]
    # 3 slots for 7 sequences, added at different steps: slots are reused and compacted
    engine = TorchEngine.from_pretrained(folder, max_running=3)
    done = {}
    for step in range(200):
        if step < len(ps) * 2 and step % 2 == 0:
            i = step // 2
            engine.add(
                i,
                ps[i],
                sampling=SamplingParams(
                    temperature=0.0, max_new_tokens=lengths[i], ignore_eos=True
                ),
            )
        assert engine.stats().running <= 3
        for f in engine.step().finished:
            done[f.seq_id] = f
        if len(done) == len(ps):
            break
    assert [list(done[i].token_ids) for i in range(len(ps))] == [list(a.token_ids) for a in alone]
    for i, a in enumerate(alone):
        assert done[i].finish_reason == FinishReason.LENGTH
        assert max(abs(x - y) for x, y in zip(done[i].logprobs, a.logprobs, strict=True)) < 1e-4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_abort_and_redispatch_continues_like_uninterrupted(folder, temperature):
    sampling = SamplingParams(temperature=temperature, max_new_tokens=20, seed=11, ignore_eos=True)
    p = prompts(2, seed=7)
    whole = run_alone(folder, p[0], sampling)

    first = TorchEngine.from_pretrained(folder, max_running=4)
    first.add("a", p[0], sampling=sampling)
    first.add("b", p[1], sampling=sampling)
    for _ in range(8):
        first.step()
    partial = {o.seq_id: o for o in first.abort(["a", "missing"])}
    assert set(partial) == {"a"} and len(partial["a"].token_ids) == 8
    assert first.stats().running == 1  # b is still there

    # to a fresh engine, as if to another replica
    second = TorchEngine.from_pretrained(folder, max_running=4)
    second.add(
        "a", p[0], partial["a"].token_ids, sampling, generated_logprobs=partial["a"].logprobs
    )
    out = generate_until_done(second)["a"]
    assert out.token_ids == whole.token_ids
    assert len(out.logprobs) == 20
    assert max(abs(x - y) for x, y in zip(out.logprobs, whole.logprobs, strict=True)) < 1e-4


def generate_until_done(engine):
    done = {}
    while engine.has_unfinished():
        for f in engine.step().finished:
            done[f.seq_id] = f
    return done


def test_sampling_is_reproducible_and_independent_of_the_batch(folder):
    p = prompts(4, seed=8)
    params = [
        SamplingParams(temperature=1.0, max_new_tokens=16, seed=s, ignore_eos=True)
        for s in (1, 2, 3, 4)
    ]
    engine = TorchEngine.from_pretrained(folder, max_running=4)
    batched = generate(engine, p, params)
    again = generate(TorchEngine.from_pretrained(folder, max_running=4), p, params)
    assert [b.token_ids for b in batched] == [a.token_ids for a in again]
    assert batched[0].token_ids == run_alone(folder, p[0], params[0]).token_ids
    other = run_alone(
        folder, p[0], SamplingParams(temperature=1.0, max_new_tokens=16, seed=99, ignore_eos=True)
    )
    assert other.token_ids != batched[0].token_ids
    # engine-assigned seeds: reproducible given the engine seed
    one = generate(
        TorchEngine.from_pretrained(folder, seed=5),
        p,
        SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True),
    )
    two = generate(
        TorchEngine.from_pretrained(folder, seed=5),
        p,
        SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True),
    )
    assert [o.token_ids for o in one] == [t.token_ids for t in two]


def test_sampling_logprobs_follow_the_temperature(folder):
    p = prompts(1, seed=9)[0]
    engine = TorchEngine.from_pretrained(folder)
    out = generate(
        engine, [p], SamplingParams(temperature=0.5, max_new_tokens=6, seed=3, ignore_eos=True)
    )[0]
    logits = engine.prompt_logits(p + list(out.token_ids))[len(p) - 1 : -1]
    expected = torch.log_softmax(logits / 0.5, dim=-1).gather(
        1, torch.tensor(out.token_ids)[:, None]
    )[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)


def test_tiny_top_p_is_greedy(folder):
    p = prompts(3, seed=10)
    engine = TorchEngine.from_pretrained(folder, max_running=3)
    nucleus = generate(
        engine,
        p,
        SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=12, seed=4, ignore_eos=True),
    )
    greedy = generate(
        engine, p, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    )
    assert [n.token_ids for n in nucleus] == [g.token_ids for g in greedy]


def test_stops_at_eos_stop_tokens_and_length(folder):
    p = prompts(1, seed=12)[0]
    free = run_alone(folder, p, GREEDY)
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = run_alone(
        folder,
        p,
        SamplingParams(
            temperature=0.0, max_new_tokens=24, ignore_eos=True, stop_token_ids=(stop_at,)
        ),
    )
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids == free.token_ids[: first + 1]
    # eos ends a sequence unless ignore_eos; the engine takes it from the config
    out = run_alone(
        folder, p, SamplingParams(temperature=0.0, max_new_tokens=24), eos_token_ids=[stop_at]
    )
    assert out.finish_reason == FinishReason.STOP and out.token_ids[-1] == stop_at
    # the KV cache's length limit ends a sequence too
    out = run_alone(folder, p, GREEDY, max_seq_len=len(p) + 5)
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 6


def test_step_events_stream_the_output(folder):
    engine = TorchEngine.from_pretrained(folder, max_running=2)
    engine.add(
        0,
        prompts(1, seed=13)[0],
        sampling=SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True),
    )
    streamed, finished = [], None
    while engine.has_unfinished():
        out = engine.step()
        streamed += [e.token_id for e in out.events]
        finished = out.finished or finished
    assert finished[0].token_ids == tuple(streamed) and len(streamed) == 5


def test_abort_returns_waiting_and_running_sequences(folder):
    engine = TorchEngine.from_pretrained(folder, max_running=1)
    p = prompts(3, seed=14)
    for i in range(3):
        engine.add(i, p[i], sampling=GREEDY)
    engine.step()
    engine.step()
    assert (engine.stats().running, engine.stats().waiting) == (1, 2)
    parts = engine.abort()
    assert [(o.seq_id, len(o.token_ids)) for o in parts] == [(1, 0), (2, 0), (0, 2)]
    assert not engine.has_unfinished() and engine.abort() == []


def test_release_and_resume_weights(folder):
    spec, tensors = read_checkpoint(folder)
    engine = TorchEngine(spec, tensors, weights_version=3)
    p = prompts(1, seed=15)[0]
    before = generate(engine, [p], GREEDY)[0]
    engine.release([ContextKind.WEIGHTS])
    assert engine.stats().released == (ContextKind.WEIGHTS,)
    with pytest.raises(EngineNotServing, match="weights are released"):
        engine.step()
    with pytest.raises(EngineNotServing, match="weights are released"):
        engine.add(0, p)
    engine.resume(["weights"])
    assert not engine.stats().weights_ready
    with pytest.raises(EngineNotServing, match="not loaded"):
        engine.step()
    names = sorted(tensors)
    engine.load_weights({n: tensors[n] for n in names[:3]}, version=4)
    with pytest.raises(EngineNotServing, match="not loaded"):
        engine.add(0, p)
    engine.load_weights(tensors.items(), version=4)
    stats = engine.stats()
    assert stats.weights_version == 4 and stats.released == () and stats.weights_ready
    assert generate(engine, [p], GREEDY)[0].token_ids == before.token_ids
    # load_weights alone also brings released weights back
    engine.release(["weights"])
    engine.load_weights(tensors, version=5)
    assert generate(engine, [p], GREEDY)[0].token_ids == before.token_ids


def test_release_and_resume_kv_cache(folder):
    engine = TorchEngine.from_pretrained(folder)
    p = prompts(1, seed=16)[0]
    engine.add(0, p, sampling=GREEDY)
    engine.step()
    with pytest.raises(EngineNotServing, match="abort them first"):
        engine.release(["transient"])
    engine.abort()
    engine.release(["transient", "stateful"])
    assert set(engine.stats().released) == {ContextKind.TRANSIENT, ContextKind.STATEFUL}
    with pytest.raises(EngineNotServing, match="KV cache"):
        engine.add(0, p)
    engine.resume(["transient", "stateful"])
    assert generate(engine, [p], GREEDY)[0].token_ids == run_alone(folder, p, GREEDY).token_ids


def test_a_host_engine_resumes_into_the_tensors_it_released(folder):
    engine = TorchEngine.from_pretrained(folder)
    weights, kv = engine._weights, engine._k.data_ptr()
    engine.release(["transient", "weights"])
    engine.resume(["transient", "weights"])
    # no fresh pages: the same storage (the values are reloaded before serving)
    assert engine._weights is weights and engine._k.data_ptr() == kv
    assert not engine.stats().weights_ready


def test_a_host_engine_resumed_at_the_version_it_released_copies_nothing(folder):
    import torch

    spec, tensors = read_checkpoint(folder)
    engine = TorchEngine(spec, tensors, weights_version=3)
    name = "model.embed_tokens.weight"
    zeros = {n: torch.zeros_like(t) for n, t in tensors.items()}
    engine.release(["weights"])
    engine.resume(["weights"])
    # version 3 is what the released weights held: loading it again copies nothing
    engine.load_weights(zeros, version=3)
    stats = engine.stats()
    assert stats.weights_ready and stats.weights_version == 3
    assert torch.equal(engine._weights.views[name], tensors[name])
    # names that do not fit are refused all the same
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.release(["weights"])
        engine.resume(["weights"])
        engine.load_weights({"nope": zeros[name]}, version=3)
    # another version is copied
    engine.load_weights(zeros, version=4)
    assert torch.equal(engine._weights.views[name], zeros[name])
    # weights released partly loaded hold no version whole: the next load copies
    engine.release(["weights"])
    engine.resume(["weights"])
    engine.load_weights({name: tensors[name]}, version=5)
    engine.release(["weights"])
    engine.resume(["weights"])
    engine.load_weights(tensors, version=5)
    assert all(torch.equal(v, tensors[n]) for n, v in engine._weights.views.items() if n in tensors)


def test_release_rejects_persistent_and_unknown_kinds(folder):
    engine = TorchEngine.from_pretrained(folder)
    with pytest.raises(ValueError, match="persistent"):
        engine.release(["persistent"])
    with pytest.raises(ValueError, match="unknown context kind 'kv'"):
        engine.release(["kv"])


def test_load_weights_rejects_bad_names_and_shapes(folder):
    spec, tensors = read_checkpoint(folder)
    partial = {n: t for n, t in tensors.items() if "layers.1." not in n}
    with pytest.raises(ValueError, match="checkpoint lacks"):
        TorchEngine(spec, partial)
    engine = TorchEngine(spec, tensors)
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.load_weights({"model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="has shape"):
        engine.load_weights({"model.norm.weight": torch.zeros(3)}, version=1)
    assert engine.stats().weights_version == 0
    # a new version's weights change what the engine generates
    p = prompts(1, seed=17)[0]
    before = generate(engine, [p], GREEDY)[0]
    engine.load_weights({n: t * 1.5 for n, t in tensors.items()}, version=2)
    assert generate(engine, [p], GREEDY)[0].token_ids != before.token_ids


def test_add_validates_its_input(folder):
    engine = TorchEngine.from_pretrained(folder, max_seq_len=32)
    engine.add("x", [5, 6])
    with pytest.raises(DuplicateSequence):
        engine.add("x", [5, 6])
    with pytest.raises(ValueError, match="empty prompt"):
        engine.add("e", [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add("v", [5, VOCAB])
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.add("l", [5] * 33)
    with pytest.raises(ValueError, match="generated_logprobs"):
        engine.add("g", [5], [6, 7])
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.add("m", [5], [6, 7], SamplingParams(max_new_tokens=2), generated_logprobs=[0, 0])
    with pytest.raises(ValueError, match="stop token"):
        engine.add("s", [5], [EOS], generated_logprobs=[0.0])
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_stats_count_load_and_measure_steps(folder):
    ticks = iter(x * 0.5 for x in range(1000))
    engine = TorchEngine.from_pretrained(folder, max_running=2, clock=lambda: next(ticks))
    p = prompts(3, seed=18)
    for i in range(3):
        engine.add(i, p[i], sampling=GREEDY)
    s = engine.stats()
    assert (s.running, s.waiting, s.kv_tokens, s.steps) == (0, 3, 0, 0)
    # every clock reading advances 0.5 s: step start, prefill start and end, step end
    out = engine.step()
    assert out.admitted == (0, 1) and out.prefill_s == 0.5
    s = engine.stats()
    assert (s.running, s.waiting, s.steps, s.generated_tokens) == (2, 1, 1, 2)
    assert s.kv_tokens == len(p[0]) + len(p[1])
    assert s.last_step_s == 1.5 and s.mean_step_s == 1.5
    assert s.kv_capacity_tokens == 2 * 64
    assert (s.decode_running, s.decode_itl_s) == (0, 0.0)  # it prefilled: no decode sample
    out = engine.step()  # decode only: no prefill, two clock readings
    assert out.admitted == () and out.prefill_s == 0.0
    s = engine.stats()
    assert s.last_step_s == 0.5
    assert s.kv_tokens == len(p[0]) + len(p[1]) + 2
    # the refit's sample: the batch, the context it attended over, the step's latency
    assert (s.decode_running, s.decode_tokens, s.decode_itl_s) == (2, s.kv_tokens - 2, 0.5)


def test_spec_rejects_unsupported_configs():
    base = {
        "model_type": "qwen2",
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 16,
    }
    assert DecoderSpec.from_config(base).rope_theta == 10000.0
    assert DecoderSpec.from_config({**base, "rope_theta": 5.0}).rope_theta == 5.0
    with pytest.raises(ValueError, match="key 'model_type': expected one of 'llama'.*found 'gpt2'"):
        DecoderSpec.from_config({**base, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="key 'mlp_bias'"):
        DecoderSpec.from_config({**base, "model_type": "llama", "mlp_bias": True})
    with pytest.raises(ValueError, match="key 'sliding_window'"):
        DecoderSpec.from_config({**base, "model_type": "mistral", "sliding_window": 8})
    # the families' attention: Qwen2 biases q/k/v, Qwen3 normalises q and k, Llama neither
    assert DecoderSpec.from_config(base).attention_bias
    llama = DecoderSpec.from_config({**base, "model_type": "llama"})
    assert not llama.attention_bias and not llama.qk_norm
    qwen3 = DecoderSpec.from_config({**base, "model_type": "qwen3"})
    assert qwen3.qk_norm and not qwen3.attention_bias
    with pytest.raises(ValueError, match="key 'use_sliding_window'"):
        DecoderSpec.from_config({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="key 'rope_scaling'.*found 'yarn'"):
        DecoderSpec.from_config({**base, "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(ValueError, match="key 'vocab_size': expected a value"):
        DecoderSpec.from_config({k: v for k, v in base.items() if k != "vocab_size"})
    with pytest.raises(ValueError, match="divisor of num_attention_heads"):
        DecoderSpec.from_config({**base, "num_key_value_heads": 3})


def test_threads_setting(folder):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the suite runs one thread (conftest): start elsewhere
        TorchEngine.from_pretrained(folder, threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads"):
        TorchEngine.from_pretrained(folder, threads=0)
