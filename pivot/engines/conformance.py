"""The engine conformance suite: checks that an inference engine keeps the promises of
``pivot.engines.protocol``, in the style of trio's stream checkers
(``trio.testing.check_two_way_stream``). Every backend runs it (the torch, sim and scripted
engines in ``tests/unit/test_engine_conformance.py``), and so can a user's own engine.

Each ``check_*`` takes an ``EngineFactory``, which makes fresh engines of one kind (same
weights, same seed) and says what may be expected of them where engines legitimately differ,
and raises ``ConformanceError`` naming the broken promise. ``check_engine`` runs them all:
generate, stream, abort with partial output, dispatch with re-prefill continuing exactly,
release/resume of each context kind, load weights. Pure: engines are driven by hand, no bus,
no clock, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pivot.engines.protocol import (
    ContextKind,
    DuplicateSequence,
    EngineNotServing,
    FinishedSequence,
    FinishReason,
    InferenceEngine,
    NamedTensors,
    PartialOutput,
    SamplingParams,
    SeqId,
    StepOutput,
)

_ALL_KINDS = (ContextKind.TRANSIENT, ContextKind.WEIGHTS, ContextKind.STATEFUL)


class ConformanceError(AssertionError):
    """An engine broke a promise of the protocol; the message says which, and where."""


def _no_tensors() -> dict:
    return {}


@dataclass(frozen=True, kw_only=True)
class EngineFactory:
    """How the suite makes engines of one kind, and what it may expect of them.

    ``make``: a fresh, idle, serving engine on every call, with the same weights and seed, so
    that two engines give the same output for the same sequence. ``weights``: tensors its
    ``load_weights`` takes as all of its parameters, the ones it was made with (engines that
    read none: the default, no tensors). ``prompts``: token ids valid for its vocabulary (two
    at least); every sequence asks for ``max_new_tokens`` (four at least) and the engine must
    hold all the prompts at once (``max_running``, KV capacity).

    Where engines legitimately differ: ``token_ids`` False: outputs carry placeholders for
    token ids (only their count is checked); ``logprobs`` False: outputs carry no
    log-probabilities; ``token_events`` False: a step lists no ``TokenEvent``; ``stop_tokens``
    False: the engine does not read ``stop_token_ids`` (a simulated one, whose workload sets
    each length). ``logprob_tolerance``: how far a log-probability may move when the same
    token is computed another way (batched rather than alone, re-prefilled rather than
    decoded), which reorders float sums: 1e-4 covers float32 with room (such differences are
    ~1e-6 there; a wrong position, seed or cache moves a log-probability by ~0.1 and more);
    a bf16 engine needs more.
    """

    make: Callable[[], InferenceEngine]
    weights: Callable[[], NamedTensors] = _no_tensors
    prompts: tuple[tuple[int, ...], ...] = ((3, 4, 5), (6, 7, 8, 9, 10), (11, 12))
    max_new_tokens: int = 8
    token_ids: bool = True
    logprobs: bool = True
    token_events: bool = True
    stop_tokens: bool = True
    logprob_tolerance: float = 1e-4
    name: str = "engine"  # how errors name the engine

    def __post_init__(self) -> None:
        if len(self.prompts) < 2 or not all(self.prompts):
            raise ValueError("EngineFactory needs two non-empty prompts at least")
        if self.max_new_tokens < 4:
            raise ValueError(f"max_new_tokens must be >= 4, got {self.max_new_tokens}")
        if self.stop_tokens and not self.token_ids:
            raise ValueError("stop tokens can only be checked on an engine that emits token ids")
        if not self.logprob_tolerance >= 0.0:
            raise ValueError(f"logprob_tolerance must be >= 0, got {self.logprob_tolerance}")

    def __call__(self) -> InferenceEngine:
        return self.make()


# ---- helpers --------------------------------------------------------------------------------


def _fail(factory: EngineFactory, check: str, message: str) -> ConformanceError:
    return ConformanceError(f"{factory.name}, {check}: {message}")


def _sampling(
    factory: EngineFactory, seed: int, temperature: float = 1.0, **kw: object
) -> SamplingParams:
    # ignore_eos: every engine then runs each sequence to exactly max_new_tokens
    kw.setdefault("ignore_eos", True)
    return SamplingParams(
        max_new_tokens=factory.max_new_tokens, temperature=temperature, seed=seed, **kw
    )


def _step_limit(factory: EngineFactory) -> int:
    return 4 * (factory.max_new_tokens + len(factory.prompts)) + 16


def _run(
    factory: EngineFactory, check: str, engine: InferenceEngine
) -> tuple[dict[SeqId, FinishedSequence], list[StepOutput]]:
    """Step until nothing is left; every sequence must finish once."""
    done: dict[SeqId, FinishedSequence] = {}
    steps: list[StepOutput] = []
    for _ in range(_step_limit(factory)):
        if not engine.has_unfinished():
            return done, steps
        out = engine.step()
        steps.append(out)
        for f in out.finished:
            if f.seq_id in done:
                raise _fail(factory, check, f"sequence {f.seq_id!r} finished twice")
            done[f.seq_id] = f
    raise _fail(factory, check, f"still unfinished after {_step_limit(factory)} steps")


def _expect_raises(
    factory: EngineFactory,
    check: str,
    error: type[BaseException],
    what: str,
    call: Callable[..., object],
    *args: object,
    **kwargs: object,
) -> None:
    try:
        call(*args, **kwargs)
    except error:
        return
    except Exception as exc:  # noqa: BLE001 - reported as the broken promise
        raise _fail(factory, check, f"{what}: raised {exc!r}, expected {error.__name__}") from exc
    raise _fail(factory, check, f"{what}: did not raise {error.__name__}")


def _same_output(
    factory: EngineFactory,
    check: str,
    what: str,
    ids: Sequence[int],
    logprobs: Sequence[float],
    want_ids: Sequence[int],
    want_logprobs: Sequence[float],
    *,
    exact: bool = False,
) -> None:
    """``ids``/``logprobs`` equal the expected ones: ids exactly (their count when the engine
    emits placeholders), log-probabilities within the tolerance (``exact``: bit for bit)."""
    if len(ids) != len(want_ids):
        raise _fail(factory, check, f"{what}: {len(ids)} tokens, expected {len(want_ids)}")
    if factory.token_ids and tuple(ids) != tuple(want_ids):
        raise _fail(factory, check, f"{what}: tokens {list(ids)}, expected {list(want_ids)}")
    if not factory.logprobs:
        if len(logprobs):
            raise _fail(factory, check, f"{what}: log-probabilities from an engine without them")
        return
    if len(logprobs) != len(ids):
        raise _fail(factory, check, f"{what}: {len(logprobs)} log-probabilities for {len(ids)}")
    tol = 0.0 if exact else factory.logprob_tolerance
    for i, (got, want) in enumerate(zip(logprobs, want_logprobs, strict=True)):
        if not abs(got - want) <= tol:
            raise _fail(
                factory, check, f"{what}: log-probability {i} is {got}, expected {want} (+-{tol})"
            )


def _head(ids: Sequence[int], n: int) -> tuple[int, ...]:
    # token ids may be placeholders, which count and iterate but do not slice
    return tuple(ids)[:n]


def _check_finished(factory: EngineFactory, check: str, f: FinishedSequence) -> None:
    """A sequence run with ``_sampling``: exactly max_new_tokens, LENGTH, sane logprobs."""
    if len(f.token_ids) != factory.max_new_tokens:
        raise _fail(
            factory,
            check,
            f"sequence {f.seq_id!r} (ignore_eos) produced {len(f.token_ids)} tokens, "
            f"expected max_new_tokens = {factory.max_new_tokens}",
        )
    if f.finish_reason is not FinishReason.LENGTH:
        raise _fail(
            factory,
            check,
            f"sequence {f.seq_id!r} ran to max_new_tokens but finished with "
            f"{f.finish_reason.value!r}, expected 'length'",
        )
    if factory.logprobs:
        if len(f.logprobs) != len(f.token_ids):
            raise _fail(
                factory,
                check,
                f"sequence {f.seq_id!r}: {len(f.logprobs)} log-probabilities for "
                f"{len(f.token_ids)} tokens",
            )
        bad = [x for x in f.logprobs if not (math.isfinite(x) and x <= factory.logprob_tolerance)]
        if bad:
            raise _fail(factory, check, f"sequence {f.seq_id!r}: log-probabilities {bad[:3]}")


def _reference(
    factory: EngineFactory, check: str, index: int, sampling: SamplingParams
) -> FinishedSequence:
    """Prompt ``index`` run alone on a fresh engine."""
    engine = factory()
    engine.add(index, factory.prompts[index], sampling=sampling)
    done, _ = _run(factory, check, engine)
    if set(done) != {index}:
        raise _fail(factory, check, f"one sequence added, finished: {sorted(done, key=str)}")
    _check_finished(factory, check, done[index])
    return done[index]


def _check_idle(factory: EngineFactory, check: str, engine: InferenceEngine) -> None:
    stats = engine.stats()
    if engine.has_unfinished() or stats.running or stats.waiting:
        raise _fail(
            factory,
            check,
            f"engine not idle: has_unfinished={engine.has_unfinished()}, "
            f"running={stats.running}, waiting={stats.waiting}",
        )


# ---- the checks -----------------------------------------------------------------------------


def check_generate(factory: EngineFactory) -> None:
    """Each prompt runs to its length alone, and to the same output batched with the others
    (sampling depends only on the seed and the position, greedy or sampled); duplicate ids
    are refused; stop tokens end a sequence with STOP, the stop token last."""
    check = "generate"
    for temperature in (0.0, 1.0):
        params = [_sampling(factory, 100 + i, temperature) for i in range(len(factory.prompts))]
        alone = [_reference(factory, check, i, p) for i, p in enumerate(params)]
        engine = factory()
        for i, (prompt, p) in enumerate(zip(factory.prompts, params, strict=True)):
            engine.add(i, prompt, sampling=p)
        _expect_raises(
            factory,
            check,
            DuplicateSequence,
            "adding a sequence id the engine holds",
            engine.add,
            0,
            factory.prompts[0],
            sampling=params[0],
        )
        done, _ = _run(factory, check, engine)
        if set(done) != set(range(len(params))):
            raise _fail(factory, check, f"finished {sorted(done)}, expected all of the batch")
        for i, ref in enumerate(alone):
            _check_finished(factory, check, done[i])
            _same_output(
                factory,
                check,
                f"sequence {i} batched vs alone (temperature {temperature})",
                done[i].token_ids,
                done[i].logprobs,
                ref.token_ids,
                ref.logprobs,
            )
        _check_idle(factory, check, engine)
        generated = engine.stats().generated_tokens
        if generated != factory.max_new_tokens * len(params):
            raise _fail(
                factory,
                check,
                f"stats().generated_tokens is {generated} after generating "
                f"{factory.max_new_tokens * len(params)} tokens",
            )
    if factory.stop_tokens:
        ref = _reference(factory, check, 0, _sampling(factory, 7))
        stop = ref.token_ids[len(ref.token_ids) // 2]
        end = list(ref.token_ids).index(stop) + 1
        engine = factory()
        engine.add(0, factory.prompts[0], sampling=_sampling(factory, 7, stop_token_ids=(stop,)))
        done, _ = _run(factory, check, engine)
        f = done[0]
        if f.finish_reason is not FinishReason.STOP:
            raise _fail(factory, check, f"stop token {stop}: finished with {f.finish_reason}")
        _same_output(
            factory,
            check,
            f"stop token {stop}",
            f.token_ids,
            f.logprobs,
            ref.token_ids[:end],
            ref.logprobs[:end],
        )


def check_stream(factory: EngineFactory) -> None:
    """Steps stream the output: one event per running sequence per step (none for a sequence
    before it is admitted or after it finished) and a sequence's events are its finished
    output; step numbers grow; an idle step produces nothing."""
    check = "stream"
    engine = factory()
    idle = engine.step()
    if idle.events or idle.finished:
        raise _fail(factory, check, "a step of an idle engine produced events or finishes")
    for i, prompt in enumerate(factory.prompts):
        engine.add(i, prompt, sampling=_sampling(factory, 200 + i))
    streamed: dict[SeqId, tuple[list[int], list[float]]] = {}
    finished: set[SeqId] = set()
    last_step = idle.step
    for _ in range(_step_limit(factory)):
        if not engine.has_unfinished():
            break
        out = engine.step()
        if out.step <= last_step:
            raise _fail(factory, check, f"step number {out.step} after {last_step}")
        last_step = out.step
        if not factory.token_events:
            if out.events:
                raise _fail(factory, check, "token events from an engine built without them")
        else:
            seen = set()
            for e in out.events:
                if e.seq_id in seen or e.seq_id in finished:
                    raise _fail(factory, check, f"step {out.step}: extra event for {e.seq_id!r}")
                seen.add(e.seq_id)
                ids, lps = streamed.setdefault(e.seq_id, ([], []))
                ids.append(e.token_id)
                lps.append(e.logprob)
            running = engine.stats().running + len(out.finished)
            if len(out.events) != running:
                raise _fail(
                    factory,
                    check,
                    f"step {out.step}: {len(out.events)} events for {running} running sequences",
                )
        for f in out.finished:
            if f.seq_id in finished:
                raise _fail(factory, check, f"sequence {f.seq_id!r} finished twice")
            finished.add(f.seq_id)
            _check_finished(factory, check, f)
            if factory.token_events:
                ids, lps = streamed.get(f.seq_id, ([], []))
                _same_output(
                    factory,
                    check,
                    f"sequence {f.seq_id!r}: its events vs its finished output",
                    ids,
                    lps if factory.logprobs else (),
                    f.token_ids,
                    f.logprobs,
                    exact=True,
                )
    if finished != set(range(len(factory.prompts))):
        raise _fail(factory, check, f"finished {sorted(finished, key=str)} of every prompt")
    _check_idle(factory, check, engine)


def check_abort(factory: EngineFactory) -> None:
    """Abort returns what a sequence had (the tokens it streamed, a prefix of its output),
    skips ids it does not hold, leaves the others running to their outputs; abort of all
    empties the engine, waiting sequences included."""
    check = "abort"
    n = len(factory.prompts)
    params = [_sampling(factory, 300 + i) for i in range(n)]
    refs = [_reference(factory, check, i, p) for i, p in enumerate(params)]
    k = factory.max_new_tokens // 2
    engine = factory()
    for i, (prompt, p) in enumerate(zip(factory.prompts, params, strict=True)):
        engine.add(i, prompt, sampling=p)
    streamed = 0
    for _ in range(k):
        out = engine.step()
        streamed += sum(1 for e in out.events if e.seq_id == 0)
        if out.finished:
            raise _fail(factory, check, f"finished before max_new_tokens: {out.finished}")
    partials = engine.abort([0, "not-held"])
    if [p.seq_id for p in partials] != [0]:
        raise _fail(factory, check, f"abort([0, 'not-held']) returned {partials}")
    _check_partial(factory, check, partials[0], refs[0], streamed)
    if engine.abort(["not-held"]) != []:
        raise _fail(factory, check, "abort of an id the engine does not hold returned partials")
    done, _ = _run(factory, check, engine)
    if set(done) != set(range(1, n)):
        raise _fail(factory, check, f"after aborting 0, finished {sorted(done, key=str)}")
    for i in range(1, n):
        _same_output(
            factory,
            check,
            f"sequence {i} next to an aborted one",
            done[i].token_ids,
            done[i].logprobs,
            refs[i].token_ids,
            refs[i].logprobs,
        )
    # abort of everything: running sequences mid-output, and ones still waiting
    engine = factory()
    for i, (prompt, p) in enumerate(zip(factory.prompts, params, strict=True)):
        engine.add(i, prompt, sampling=p)
    for _ in range(k):
        engine.step()
    engine.add("late", factory.prompts[0], sampling=params[0])
    partials = engine.abort(None)
    got = {p.seq_id: p for p in partials}
    if len(got) != len(partials) or set(got) != {*range(n), "late"}:
        raise _fail(factory, check, f"abort(None) returned {[p.seq_id for p in partials]}")
    for i in range(n):
        _check_partial(factory, check, got[i], refs[i], None)
    if len(got["late"].token_ids) or len(got["late"].logprobs):
        raise _fail(factory, check, f"a sequence never stepped aborted with {got['late']}")
    _check_idle(factory, check, engine)
    if engine.step().finished:
        raise _fail(factory, check, "a step after abort(None) finished sequences")


def _check_partial(
    factory: EngineFactory,
    check: str,
    partial: PartialOutput,
    ref: FinishedSequence,
    streamed: int | None,
) -> None:
    count = len(partial.token_ids)
    if not 0 < count < factory.max_new_tokens:
        raise _fail(
            factory,
            check,
            f"sequence {partial.seq_id!r} aborted mid-output with {count} tokens "
            f"(expected 1..{factory.max_new_tokens - 1})",
        )
    if factory.token_events and streamed is not None and count != streamed:
        raise _fail(
            factory,
            check,
            f"sequence {partial.seq_id!r} streamed {streamed} tokens, its partial has {count}",
        )
    _same_output(
        factory,
        check,
        f"partial output of {partial.seq_id!r} vs the uninterrupted output",
        partial.token_ids,
        partial.logprobs,
        _head(ref.token_ids, count),
        ref.logprobs[:count],
    )


def check_reprefill(factory: EngineFactory) -> None:
    """Dispatch: a sequence aborted mid-output on one engine and added with its partial
    output to a fresh one (idle or busy) re-prefills and continues with exactly the output it
    would have had uninterrupted (tokens; log-probabilities within the tolerance, the handed-in
    ones returned as handed), generating only the missing tokens; a partial that already
    has max_new_tokens is refused."""
    check = "re-prefill"
    others = range(1, len(factory.prompts))
    for temperature in (0.0, 1.0):
        p = _sampling(factory, 400, temperature)
        ref = _reference(factory, check, 0, p)
        source = factory()
        source.add(0, factory.prompts[0], sampling=p)
        for i in others:
            source.add(i, factory.prompts[i], sampling=_sampling(factory, 400 + i, temperature))
        for _ in range(factory.max_new_tokens // 2):
            source.step()
        (partial,) = source.abort([0])
        _check_partial(factory, check, partial, ref, None)
        missing = factory.max_new_tokens - len(partial.token_ids)
        # onto an idle engine: it generates only what is missing
        idle = factory()
        _dispatch(factory, idle, partial, p)
        done, steps = _run(factory, check, idle)
        _check_continued(factory, check, done[0], partial, ref, f"temperature {temperature}")
        generated = idle.stats().generated_tokens
        if generated != missing:
            raise _fail(
                factory,
                check,
                f"a partial of {len(partial.token_ids)} tokens continued by generating "
                f"{generated} tokens, expected the {missing} missing",
            )
        if factory.token_events:
            events = sum(1 for out in steps for e in out.events if e.seq_id == 0)
            if events != missing:
                raise _fail(factory, check, f"{events} events for {missing} missing tokens")
        # onto a busy engine, mid-way through other sequences
        busy = factory()
        for i in others:
            busy.add(i, factory.prompts[i], sampling=_sampling(factory, 500 + i, temperature))
        busy.step()
        _dispatch(factory, busy, partial, p)
        done, _ = _run(factory, check, busy)
        _check_continued(
            factory, check, done[0], partial, ref, f"busy engine, temperature {temperature}"
        )
        # a dispatched sequence aborted before it ran again still has what it was handed
        again = factory()
        _dispatch(factory, again, partial, p)
        (back,) = again.abort([0])
        _same_output(
            factory,
            check,
            "abort of a dispatched sequence before it ran",
            back.token_ids,
            back.logprobs,
            partial.token_ids,
            partial.logprobs,
            exact=True,
        )
    engine = factory()
    _expect_raises(
        factory,
        check,
        ValueError,
        "a partial output that already has max_new_tokens tokens",
        engine.add,
        0,
        factory.prompts[0],
        ref.token_ids,
        p,
        generated_logprobs=ref.logprobs,
    )


def _dispatch(
    factory: EngineFactory, engine: InferenceEngine, partial: PartialOutput, p: SamplingParams
) -> None:
    engine.add(0, factory.prompts[0], partial.token_ids, p, generated_logprobs=partial.logprobs)


def _check_continued(
    factory: EngineFactory,
    check: str,
    f: FinishedSequence,
    partial: PartialOutput,
    ref: FinishedSequence,
    where: str,
) -> None:
    _check_finished(factory, check, f)
    n = len(partial.token_ids)
    _same_output(
        factory,
        check,
        f"continued output ({where}), handed-in part",
        _head(f.token_ids, n),
        f.logprobs[:n],
        partial.token_ids,
        partial.logprobs,
        exact=True,
    )
    _same_output(
        factory,
        check,
        f"continued output ({where}) vs the uninterrupted output",
        f.token_ids,
        f.logprobs,
        ref.token_ids,
        ref.logprobs,
    )


def check_release_resume(factory: EngineFactory) -> None:
    """Role context (DESIGN.md, "Shifting a device group"): persistent context and unknown
    kinds are refused; transient and weights context need an idle engine (refusing changes
    nothing), stateful context does not; released transient or weights context stops
    ``add`` and ``step`` (EngineNotServing) until resumed, and resumed weights until loaded;
    ``stats().released`` and ``weights_ready`` say what is held; the engine then serves the
    same outputs again."""
    check = "release/resume"
    p = _sampling(factory, 600)
    ref = _reference(factory, check, 0, p)
    engine = factory()

    def serves_again(what: str) -> None:
        engine.add(0, factory.prompts[0], sampling=p)
        done, _ = _run(factory, check, engine)
        _same_output(
            factory,
            check,
            f"output {what}",
            done[0].token_ids,
            done[0].logprobs,
            ref.token_ids,
            ref.logprobs,
        )

    def released(want: set[ContextKind], ready: bool, what: str) -> None:
        stats = engine.stats()
        if set(stats.released) != want or len(stats.released) != len(want):
            raise _fail(
                factory,
                check,
                f"{what}: stats().released is {stats.released}, expected {sorted(want)}",
            )
        if stats.weights_ready != ready:
            raise _fail(factory, check, f"{what}: stats().weights_ready is {stats.weights_ready}")

    def refuses_work(what: str) -> None:
        _expect_raises(
            factory,
            check,
            EngineNotServing,
            f"add {what}",
            engine.add,
            0,
            factory.prompts[0],
            sampling=p,
        )
        _expect_raises(factory, check, EngineNotServing, f"step {what}", engine.step)

    for bad in (["persistent"], [ContextKind.PERSISTENT, ContextKind.STATEFUL], ["kv"]):
        _expect_raises(factory, check, ValueError, f"release({bad!r})", engine.release, bad)
    released(set(), True, "after refused releases")
    # with sequences held (waiting, then running), transient and weights stay
    engine.add(0, factory.prompts[0], sampling=p)
    for stage in ("waiting", "running"):
        for kinds in (["transient"], ["weights"], ["transient", "weights", "stateful"]):
            _expect_raises(
                factory,
                check,
                EngineNotServing,
                f"release({kinds}) with a sequence {stage}",
                engine.release,
                kinds,
            )
        released(set(), True, f"after refused releases with a sequence {stage}")
        engine.step()
    engine.release(["stateful"])
    released({ContextKind.STATEFUL}, True, "release(['stateful']) with a sequence running")
    engine.step()  # stateful context released: still serving
    engine.resume(["stateful"])
    released(set(), True, "resume(['stateful'])")
    done, _ = _run(factory, check, engine)
    _same_output(
        factory,
        check,
        "output of a sequence held through refused releases",
        done[0].token_ids,
        done[0].logprobs,
        ref.token_ids,
        ref.logprobs,
    )
    # transient: the KV cache goes, comes back empty
    engine.release(["transient"])
    engine.release([ContextKind.TRANSIENT])  # again: nothing more to free
    released({ContextKind.TRANSIENT}, True, "release(['transient'])")
    refuses_work("with transient context released")
    engine.resume(["transient"])
    released(set(), True, "resume(['transient'])")
    serves_again("after transient context was released and resumed")
    # weights: resumed, they serve only once loaded
    engine.release(["weights"])
    released({ContextKind.WEIGHTS}, False, "release(['weights'])")
    refuses_work("with weights released")
    engine.resume(["weights"])
    released(set(), False, "resume(['weights']) before load_weights")
    refuses_work("with weights resumed but not loaded")
    engine.load_weights(factory.weights(), 5)
    released(set(), True, "load_weights after resume(['weights'])")
    if engine.stats().weights_version != 5:
        raise _fail(factory, check, f"weights_version {engine.stats().weights_version}, not 5")
    serves_again("after weights were released, resumed and loaded")
    # everything that may go, then back
    engine.release(list(_ALL_KINDS))
    released(set(_ALL_KINDS), False, f"release({[k.value for k in _ALL_KINDS]})")
    refuses_work("with all context released")
    engine.resume([k.value for k in _ALL_KINDS])
    released(set(), False, "resume of every kind")
    refuses_work("with every kind resumed but weights not loaded")
    engine.load_weights(factory.weights(), 6)
    serves_again("after every kind was released, resumed and weights loaded")
    # load_weights on released weights resumes them
    engine.release(["weights"])
    engine.load_weights(factory.weights(), 7)
    released(set(), True, "load_weights on released weights")
    serves_again("after load_weights on released weights")


def check_load_weights(factory: EngineFactory) -> None:
    """``load_weights`` sets the weights version and serves with what it loaded; sequences
    running across it keep running (partial rollout across a version change)."""
    check = "load weights"
    p = _sampling(factory, 700)
    ref = _reference(factory, check, 0, p)
    engine = factory()
    engine.load_weights(factory.weights(), 3)
    stats = engine.stats()
    if stats.weights_version != 3 or not stats.weights_ready or stats.released:
        raise _fail(
            factory,
            check,
            f"after load_weights(version=3): weights_version {stats.weights_version}, "
            f"weights_ready {stats.weights_ready}, released {stats.released}",
        )
    engine.add(0, factory.prompts[0], sampling=p)
    for _ in range(factory.max_new_tokens // 2):
        engine.step()
    engine.load_weights(factory.weights(), 4)
    if engine.stats().weights_version != 4:
        raise _fail(factory, check, "load_weights with a sequence running did not set version 4")
    done, _ = _run(factory, check, engine)
    if set(done) != {0}:
        raise _fail(factory, check, "a sequence running across load_weights did not finish")
    _same_output(
        factory,
        check,
        "output across load_weights of the same weights",
        done[0].token_ids,
        done[0].logprobs,
        ref.token_ids,
        ref.logprobs,
    )


CHECKS: tuple[Callable[[EngineFactory], None], ...] = (
    check_generate,
    check_stream,
    check_abort,
    check_reprefill,
    check_release_resume,
    check_load_weights,
)


def check_engine(factory: EngineFactory) -> None:
    """Run every check of the suite against engines from ``factory``."""
    for check in CHECKS:
        check(factory)
