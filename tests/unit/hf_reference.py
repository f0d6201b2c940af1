"""What the engine-vs-transformers tests share (test_decoder_families, test_fallback_engine):
random weights peaky enough for greedy decoding to have no near-ties, transformers' own greedy
continuation as the reference, and the two checks against it: the same tokens over ``STEPS``
steps with log-probabilities within 1e-4, run straight through and across an abort and a
re-prefill on another engine."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pivot.engines.protocol import InferenceEngine, SamplingParams

STEPS = 64
PROMPT = [5, 17, 3, 42, 8, 11]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=STEPS, ignore_eos=True)
TOLERANCE = 1e-4


def randomize(model, norm: str = "norm"):
    """Wide random weights give peaky logits: no near-ties for float reordering to flip;
    parameters whose names contain ``norm`` (the model's norm weights) stay near 1."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=g)
            param.copy_(1.0 + 0.1 * noise if norm in name else 0.3 * noise)
    return model.eval()


def reference(model) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of PROMPT, each step a whole forward without a
    cache, and each chosen token's log-probability."""
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


def run_one(engine: InferenceEngine) -> tuple[list[int], list[float]]:
    """Step an engine holding one sequence until it finishes: its tokens and logprobs."""
    while engine.has_unfinished():
        out = engine.step()
        if out.finished:
            (done,) = out.finished
            return list(done.token_ids), list(done.logprobs)
    raise AssertionError("the engine held nothing")


def max_difference(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) for a, b in zip(got, want, strict=True))


def check_straight(make: Callable[[], InferenceEngine], model) -> float:
    """PROMPT greedily for STEPS steps gives transformers' tokens; the largest logprob
    difference, asserted within TOLERANCE, is returned."""
    want_tokens, want_logprobs = reference(model)
    engine = make()
    engine.add(0, PROMPT, sampling=GREEDY)
    tokens, logprobs = run_one(engine)
    assert tokens == want_tokens
    diff = max_difference(logprobs, want_logprobs)
    assert diff < TOLERANCE
    return diff


def check_across_abort(make: Callable[[], InferenceEngine], model) -> float:
    """Aborted a third of the way and re-prefilled on another engine, the sequence still
    gives transformers' tokens and logprobs (the largest difference is returned)."""
    want_tokens, want_logprobs = reference(model)
    first = make()
    first.add(0, PROMPT, sampling=GREEDY)
    for _ in range(STEPS // 3):
        first.step()
    (partial,) = first.abort([0])
    assert 0 < len(partial.token_ids) < STEPS
    second = make()
    second.add(0, PROMPT, partial.token_ids, GREEDY, generated_logprobs=list(partial.logprobs))
    tokens, logprobs = run_one(second)
    assert tokens == want_tokens
    diff = max_difference(logprobs, want_logprobs)
    assert diff < TOLERANCE
    return diff
