"""The simulated inference engine, trainer and shift costs: timings checked by hand on small
cases, the fast path against the plain protocol step, migration and context handling."""

from __future__ import annotations

import random

import pytest

from pivot.engines.protocol import (
    DuplicateSequence,
    EngineNotServing,
    FinishReason,
    InferenceEngine,
    SamplingParams,
)
from pivot.engines.sim_engine import (
    DUMMY_TOKEN,
    Hardware,
    Idealization,
    Placeholders,
    ShiftCostModel,
    ShiftCosts,
    SimInferenceEngine,
    SimTrainer,
    TrainerAsleep,
    TrainerCosts,
    sim_sampling,
)
from pivot.planning.cost import CostModel

# ITL = 0.001*tokens + max(0.01, 0.004*running) + 0.002; prefill at 1000 tokens/s
HAND = CostModel(a=0.001, b=0.01, c=0.004, d=0.002)


def engine(model: CostModel = HAND, **kw) -> SimInferenceEngine:
    kw.setdefault("max_running", 8)
    kw.setdefault("kv_capacity_tokens", 10_000)
    kw.setdefault("prefill_tokens_per_s", 1000.0)
    return SimInferenceEngine(model, **kw)


def add_two(e: SimInferenceEngine) -> None:
    e.add("a", [1] * 10, sampling=sim_sampling(2))
    e.add("b", [1] * 20, sampling=sim_sampling(4))


# step 1: admit both, prefill 30 tokens (0.030) + ITL(2, 30) = 0.030 + 0.010 + 0.002 -> 0.072
# step 2: ITL(2, 32) = 0.032 + 0.010 + 0.002 = 0.044; "a" has its 2 tokens and finishes
# step 3: ITL(1, 22) = 0.022 + 0.010 + 0.002 = 0.034 ("b" holds 20 + 2)
# step 4: ITL(1, 23) = 0.035; "b" has its 4 tokens and finishes
HAND_STEPS = [0.072, 0.044, 0.034, 0.035]


def test_decode_timing_matches_the_cost_model_by_hand():
    e = engine()
    add_two(e)
    costs, finished = [], []
    while e.has_unfinished():
        out = e.step()
        costs.append(out.cost_s)
        finished.append([(f.seq_id, len(f.token_ids)) for f in out.finished])
    assert costs == pytest.approx(HAND_STEPS)
    assert finished == [[], [("a", 2)], [], [("b", 4)]]
    stats = e.stats()
    assert stats.steps == 4 and stats.generated_tokens == 6
    assert stats.kv_tokens == 0 and stats.running == 0
    assert e.busy_s == pytest.approx(sum(HAND_STEPS))
    assert stats.last_step_s == pytest.approx(0.035)


def test_a_replica_that_leaves_batching_out_decodes_as_one_sequence_of_its_mean_context():
    e = engine(ideal=Idealization(batching=True))
    add_two(e)
    # step 1: prefill 30 tokens (0.030) + ITL(1, 30 / 2) = 0.015 + 0.010 + 0.002 -> 0.057;
    # step 2: ITL(1, 32 / 2) = 0.028; then "b" alone, as in HAND_STEPS
    alone = [0.057, 0.028, 0.034, 0.035]
    assert e.next_event() == (2, pytest.approx(alone[0] + alone[1]))
    # iterations start at 0 and 0.057 (< 0.06): two, in one call
    out = e.step(max_tokens=None, max_cost_s=0.06)
    assert out.step == 2 and out.cost_s == pytest.approx(alone[0] + alone[1])
    costs = [e.step().cost_s for _ in range(2)]
    assert costs == pytest.approx(alone[2:]) and not e.has_unfinished()


def test_a_replica_that_leaves_prefill_out_admits_for_nothing_and_re_prefill_only_resumes():
    free = engine(ideal=Idealization(prefill=True))
    add_two(free)
    # HAND_STEPS' first step without its 30 tokens of prefill
    assert free.step().cost_s == pytest.approx(0.072 - 0.030)
    handed = (5, 6, 7, 8)
    receiver = engine(ideal=Idealization(reprefill=True))
    receiver.add(7, [1] * 50, handed, sim_sampling(10), generated_logprobs=[0.0] * 4)
    receiver.add(8, [1] * 20, sampling=sim_sampling(3))
    out = receiver.step()
    # the resumed sequence's 54 tokens cost nothing, the new one's 20 prefill at 1000/s;
    # then ITL(2, 74) = 0.074 + 0.010 + 0.002
    assert out.prefill_tokens == 20
    assert out.cost_s == pytest.approx(0.020 + 0.086)


def test_plain_step_streams_one_event_per_running_sequence():
    e = engine()
    add_two(e)
    first = e.step()
    assert [ev.seq_id for ev in first.events] == ["a", "b"]
    assert first.prefilled == 2 and first.prefill_tokens == 30
    assert e.step().events and len(e.step().events) == 1  # "a" left after step 2


def test_fast_path_runs_to_each_event_with_the_summed_cost():
    e = engine()
    add_two(e)
    assert e.next_event() == (2, pytest.approx(0.072 + 0.044))
    out = e.step(max_tokens=None)
    assert out.step == 2 and out.cost_s == pytest.approx(0.072 + 0.044)
    assert [f.seq_id for f in out.finished] == ["a"] and out.events == ()
    out = e.step(max_tokens=None)
    assert out.step == 4 and out.cost_s == pytest.approx(0.034 + 0.035)
    assert [(f.seq_id, len(f.token_ids)) for f in out.finished] == [("b", 4)]
    assert e.next_event() == (0, 0.0)


def test_max_cost_runs_the_iterations_that_start_within_it():
    flat = CostModel(a=0.0, b=0.01, c=0.0, d=0.0)  # every iteration costs 0.01 s
    e = engine(flat)
    e.add(1, [1] * 5, sampling=sim_sampling(100))
    e.step()  # admit (prefill 0.005 s) outside the measured calls
    # iterations start at 0, 0.01, 0.02, 0.03 (< 0.035): four of them
    out = e.step(max_tokens=None, max_cost_s=0.035)
    assert out.step == 5 and out.cost_s == pytest.approx(0.04)
    assert e.step(max_tokens=3, max_cost_s=1.0).step == 8  # max_tokens binds first
    assert e.step(max_tokens=None, max_cost_s=0.0).step == 9  # always at least one


@pytest.mark.parametrize("seed", range(5))
def test_max_cost_equals_stepping_while_the_budget_lasts(seed):
    rng = random.Random(seed)
    model = CostModel(a=1e-4 * rng.random(), b=0.005, c=1e-3, d=0.002)

    def fresh() -> SimInferenceEngine:
        e = engine(model, max_running=16)
        for i in range(rng.randint(1, 6)):
            e.add(i, [1] * rng.randint(1, 300), sampling=sim_sampling(rng.randint(50, 400)))
        return e

    budget = rng.uniform(0.0, 2.0)
    state = rng.getstate()
    by_hand = fresh()
    elapsed, first = 0.0, True
    while elapsed < budget or first:  # iterations that start within the budget
        out = by_hand.step()
        elapsed += out.cost_s
        first = False
        if out.finished:
            break
    rng.setstate(state)
    fast = fresh()
    out = fast.step(max_tokens=None, max_cost_s=budget)
    assert out.step == by_hand.stats().steps
    assert out.cost_s == pytest.approx(elapsed)


def _drive(e: SimInferenceEngine, fast: bool, rng: random.Random, adds: list) -> tuple:
    """Run ``adds`` (per call index: sequences to add) through ``e``; collect what happened."""
    total, done, calls = 0.0, {}, 0
    pending = list(adds)
    while pending or e.has_unfinished():
        if pending:
            for seq_id, prompt, target in pending.pop(0):
                e.add(seq_id, [1] * prompt, sampling=sim_sampling(target))
        fast_now = fast and not pending
        if fast_now:
            before, (k, predicted) = e.stats().steps, e.next_event()
        out = e.step(max_tokens=None if fast_now else 1)
        if fast_now:  # next_event() foretold this call
            assert (out.step - before, out.cost_s) == (k, pytest.approx(predicted))
        calls += 1
        total += out.cost_s
        for f in out.finished:
            done[f.seq_id] = (len(f.token_ids), out.step)
    return total, done, e.stats().generated_tokens, e.preemptions


@pytest.mark.parametrize("seed", range(9))
def test_fast_path_equals_token_by_token_stepping(seed):
    rng = random.Random(seed)
    model = CostModel(a=2e-6, b=0.003, c=1e-4, d=0.001)
    adds = [
        [(f"{i}-{j}", rng.randint(1, 60), rng.randint(1, 80)) for j in range(rng.randint(0, 6))]
        for i in range(5)
    ]
    # batch limits and KV capacities from tight (preemptions) to ample
    kw = dict(max_running=(1, 3, 8)[seed % 3], kv_capacity_tokens=(150, 300, 10_000)[seed // 3])
    slow = _drive(engine(model, **kw), False, rng, adds)
    fast = _drive(engine(model, **kw), True, rng, adds)
    assert fast[1] == slow[1]  # every sequence finishes, at the same step, with its length
    assert fast[0] == pytest.approx(slow[0], rel=1e-9)
    assert fast[2] == slow[2] and fast[3] == slow[3]
    expected = {seq_id: target for batch in adds for seq_id, _, target in batch}
    assert {k: v[0] for k, v in fast[1].items()} == expected


def test_abort_returns_partial_output_and_dispatch_charges_the_re_prefill():
    source = engine()
    source.add(7, [1] * 50, sampling=sim_sampling(10))
    for _ in range(4):
        source.step()
    (partial,) = source.abort([7])
    assert partial.seq_id == 7 and len(partial.token_ids) == 4 == len(partial.logprobs)
    assert not source.has_unfinished() and source.stats().kv_tokens == 0
    # hand the partial output to another replica; give the tokens distinct ids to follow them
    handed = (5, 6, 7, 8)
    receiver = engine()
    receiver.add(7, [1] * 50, handed, sim_sampling(10), generated_logprobs=partial.logprobs)
    out = receiver.step()
    # re-prefill of 50 + 4 tokens at 1000/s, then ITL(1, 54) = 0.054 + 0.010 + 0.002
    assert out.prefill_tokens == 54
    assert out.cost_s == pytest.approx(0.054 + 0.066)
    rest = receiver.step(max_tokens=None)
    (done,) = rest.finished
    assert len(done.token_ids) == 10 and done.token_ids[:4] == handed
    assert done.token_ids[4:] == (DUMMY_TOKEN,) * 6
    assert receiver.stats().generated_tokens == 6  # only what it generated itself


def test_placeholder_outputs_count_what_ids_would_and_cost_the_same():
    ids, counts = engine(), engine(placeholders=True)
    for e in (ids, counts):
        e.add(7, [1] * 50, sampling=sim_sampling(10))
        for _ in range(4):
            e.step()
    (partial,) = counts.abort([7])
    assert partial.token_ids == Placeholders(4) and len(partial.token_ids) == 4
    assert list(partial.token_ids) == [DUMMY_TOKEN] * 4 and partial.logprobs == ()
    # the receiver takes the partial output as a count: no log-probabilities needed
    plain = engine()
    plain.add(7, [1] * 50, ids.abort([7])[0].token_ids, sim_sampling(10), (0.0,) * 4)
    counted = engine(placeholders=True)
    counted.add(7, Placeholders(50), partial.token_ids, sim_sampling(10))
    plain_out, counted_out = plain.step(max_tokens=None), counted.step(max_tokens=None)
    assert counted_out.cost_s == plain_out.cost_s and counted_out.step == plain_out.step
    (done,) = counted_out.finished
    assert done.token_ids == Placeholders(10) and done.logprobs == ()
    assert counted.stats() == plain.stats()


def test_abort_of_waiting_and_unknown_sequences():
    e = engine(max_running=1)
    add_two(e)
    e.step()  # "a" runs, "b" waits
    out = e.abort(["b", "nope"])
    assert [(p.seq_id, len(p.token_ids)) for p in out] == [("b", 0)]
    assert e.abort(["nope"]) == []
    rest = e.abort()
    assert [(p.seq_id, len(p.token_ids)) for p in rest] == [("a", 1)]
    assert not e.has_unfinished()


def test_kv_overflow_preempts_the_newest_and_re_prefills_it():
    # capacity 64: two sequences of 20 + 30 tokens fit (with 1% kept free), then grow
    e = engine(kv_capacity_tokens=64, max_running=4)
    e.add("old", [1] * 20, sampling=sim_sampling(30))
    e.add("new", [1] * 20, sampling=sim_sampling(30))
    first = e.step()
    assert first.prefilled == 2
    # 40 tokens + 2 per step: 64 is reached after 12 steps
    out = e.step(max_tokens=None)
    assert out.step == 12 and e.stats().kv_tokens == 64
    e.step()
    assert e.preemptions == 1 and e.stats().running == 1 and e.stats().waiting == 1
    done = {}
    while e.has_unfinished():
        out = e.step(max_tokens=None)
        done.update({f.seq_id: len(f.token_ids) for f in out.finished})
        if out.prefilled:
            # "new" comes back with its 12 tokens: prompt + partial output re-prefilled
            assert out.prefill_tokens == 20 + 12
    assert done == {"old": 30, "new": 30}
    assert e.prefill_tokens_total == 40 + 32


def test_batch_limit_holds_sequences_back():
    e = engine(max_running=1)
    add_two(e)
    assert e.step().prefilled == 1
    assert e.stats().running == 1 and e.stats().waiting == 1


def test_finish_reason_follows_ignore_eos():
    e = engine()
    e.add(1, [1], sampling=sim_sampling(3, truncated=True))
    e.add(2, [1], sampling=sim_sampling(3))
    out = e.step(max_tokens=None)
    reasons = {f.seq_id: f.finish_reason for f in out.finished}
    assert reasons == {1: FinishReason.LENGTH, 2: FinishReason.STOP}


def test_bad_sequences_are_refused():
    e = engine(kv_capacity_tokens=100)
    e.add(1, [1], sampling=sim_sampling(3))
    with pytest.raises(DuplicateSequence):
        e.add(1, [1], sampling=sim_sampling(3))
    with pytest.raises(ValueError, match="KV capacity"):
        e.add(2, [1] * 50, sampling=sim_sampling(51))
    with pytest.raises(ValueError, match="already has 3"):
        e.add(3, [1], [1, 2, 3], sim_sampling(3), generated_logprobs=[0.0] * 3)
    with pytest.raises(ValueError, match="empty prompt"):
        e.add(4, [], sampling=sim_sampling(3))
    with pytest.raises(ValueError, match="generated_logprobs"):
        e.add(5, [1], [1], sim_sampling(3))
    with pytest.raises(ValueError, match="zero-cost"):
        engine(CostModel(a=1.0, b=0.0, c=0.0, d=0.0))


def test_release_and_resume_like_the_torch_engine():
    e = engine()
    assert isinstance(e, InferenceEngine)
    e.add(1, [1], sampling=sim_sampling(3))
    with pytest.raises(EngineNotServing, match="abort them first"):
        e.release(["transient", "weights"])
    e.abort()
    e.release(["transient", "weights", "stateful"])
    assert [k.value for k in e.stats().released] == ["stateful", "transient", "weights"]
    with pytest.raises(EngineNotServing, match="KV cache"):
        e.add(1, [1], sampling=sim_sampling(3))
    e.resume(["transient", "weights", "stateful"])
    with pytest.raises(EngineNotServing, match="not loaded"):
        e.step()
    e.load_weights({}, version=3)
    assert e.stats().weights_version == 3 and e.stats().released == ()
    e.add(1, [1], sampling=sim_sampling(2))
    assert e.step(max_tokens=None).finished[0].seq_id == 1
    with pytest.raises(ValueError, match="persistent"):
        e.release(["persistent"])


def test_load_weights_on_released_weights_resumes_them():
    e = engine()
    e.release(["weights"])
    with pytest.raises(EngineNotServing, match="weights are released"):
        e.step()
    e.load_weights([], version=1)
    assert e.stats().released == () and e.step().step == 0  # idle: nothing to run


def test_itl_noise_is_seeded():
    def costs(seed: int) -> list[float]:
        e = engine(itl_noise=0.2, seed=seed)
        add_two(e)
        return [e.step().cost_s for _ in range(4)]

    assert costs(1) == costs(1)
    assert costs(1) != costs(2)
    assert costs(1) != pytest.approx(HAND_STEPS)


def test_sampling_default_is_the_protocol_default():
    e = engine()
    e.add(1, [1])
    assert len(e.step(max_tokens=None).finished[0].token_ids) == SamplingParams().max_new_tokens


# --- trainer and shifts ------------------------------------------------------------------------

SMALL_HW = Hardware(peak_bf16_tflops=100.0, train_mfu=0.5)


def test_trainer_step_time_by_hand():
    trainer = SimTrainer(params_b=1.0, devices=2, hardware=SMALL_HW, costs=TrainerCosts())
    # 8 FLOPs * 1e9 params per token / (2 devices * 0.5 * 100e12 FLOP/s) = 8e-5 s per token
    assert trainer.seconds_per_token == pytest.approx(8e-5)
    step = trainer.train_step(1000)
    assert step.cost_s == pytest.approx(5.0 + 0.08) and step.version == 1
    assert trainer.train_step(0).version == 2 and trainer.busy_s == pytest.approx(10.08)
    # GPS write: 2e9 bf16 bytes over 2 devices at 20 GB/s each
    assert trainer.write_s() == pytest.approx(0.05)


def test_trainer_offload_and_wake_by_hand():
    trainer = SimTrainer(params_b=1.0, devices=2, hardware=SMALL_HW)
    # 16 bytes * 1e9 params / 2 devices = 8 GB each, over 25 GB/s: 0.32 s
    down = trainer.offload()
    assert down.total_s == pytest.approx(2.0 + 0.32)
    assert trainer.offload().total_s == 0.0  # already offloaded
    with pytest.raises(TrainerAsleep):
        trainer.train_step(10)
    up = trainer.reload()
    assert up.total_s == pytest.approx(10.0 + 0.32) and up.seconds("wake") == 10.0
    assert trainer.train_step(10).version == 1


def test_inference_shift_phases_by_hand():
    costs = ShiftCostModel(ShiftCosts(gps_read_gb_per_s=10.0))
    up = costs.inference_up(params_b=7.5, tp=4)  # 15 GB of bf16 over 4 devices at 10 GB/s
    assert [p.name for p in up.phases] == ["wake", "read", "register"]
    assert up.seconds("read") == pytest.approx(0.375)
    assert up.total_s == pytest.approx(1.5 + 0.375 + 0.1)
    down = costs.inference_down()
    assert down.total_s == pytest.approx(0.1 + 1.0)
    with pytest.raises(KeyError):
        down.seconds("read")
