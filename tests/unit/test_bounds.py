"""The physical bounds (``pivot.bounds``) and the time account (``pivot.account``) on cases
small enough to work out by hand."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from pivot.account import ACCOUNT, Ledger, RoleTime, account
from pivot.bounds import (
    InferenceCost,
    critical_path_end,
    efficient_point,
    run_bound,
    step_bound,
)
from pivot.cluster import Role
from pivot.engines.sim_engine import Hardware, ShiftCostModel, ShiftCosts, SimTrainer, TrainerCosts
from pivot.planning.cost import CostModel
from pivot.workload import StepLengths


def _flat(itl: float, max_running: int = 4) -> InferenceCost:
    # every step costs ``itl`` whatever runs; prefill is all but free
    return InferenceCost(CostModel(a=0.0, b=itl, c=0.0, d=0.0), 1, max_running, 10**9, 1e15)


def _trainer(devices: int) -> SimTrainer:
    # 8 FLOPs x 1e9 parameters per token at 0.5 x 1 TFLOP/s per device: 16 ms per token on one
    # device; 16 GB of state in 10 GB devices needs 2 of them; the GPS write is free
    costs = TrainerCosts(fixed_step_s=3.0, state_bytes_per_param=16.0)
    return SimTrainer(
        params_b=1.0,
        devices=devices,
        hardware=Hardware(memory_gb=10.0, peak_bf16_tflops=1.0, train_mfu=0.5),
        costs=costs,
        shift=ShiftCostModel(ShiftCosts(gps_write_gb_per_s=1e12), costs),
    )


def _one_sequence(step: int = 0) -> StepLengths:
    return StepLengths(
        step=step,
        samples_per_prompt=1,
        prompt_tokens=np.array([10]),
        response_tokens=np.array([100]),
        response_truncated=np.array([False]),
        judgment_tokens=np.array([50]),
        genrm_prompt_tokens=np.array([120]),
    )


def test_one_sequence_bounds_by_hand():
    inference = {Role.ROLLOUT: _flat(0.01), Role.REWARD: _flat(0.02)}
    bound = step_bound(_one_sequence(), inference, _trainer(4), devices=4)
    # the response alone: 100 x 10 ms, then its judgment: 50 x 20 ms
    assert bound.chain_s == pytest.approx(2.0, rel=1e-9)
    # 110 tokens trained on the whole cluster (4 devices: 4 ms each) after the fixed 3 s
    assert bound.train_s == pytest.approx(3.0 + 110 * 0.004, rel=1e-6)
    # the efficient batch is the largest (4): a token costs a quarter of a step; training on
    # the 2 devices that hold the state pays the fixed 3 s twice, the tokens' FLOPs once
    assert bound.work_device_s["rollout"] == pytest.approx(100 * 0.01 / 4, rel=1e-6)
    assert bound.work_device_s["reward"] == pytest.approx(50 * 0.02 / 4, rel=1e-6)
    assert bound.work_device_s["training"] == pytest.approx(2 * 3.0 + 110 * 0.016, rel=1e-6)
    run = run_bound([bound], devices=4, staleness=0, window=(0.0, 10.0))
    assert run.critical_path_s == pytest.approx(2.0 + 3.44, rel=1e-6)
    # the terms a step's latency is set against: its chain and its training, measured steps'
    assert (run.chain_s, run.train_s) == pytest.approx((2.0, 3.44), rel=1e-6)
    slower = msgspec.structs.replace(bound, step=1, chain_s=4.0, train_s=5.0)
    later = run_bound(
        [bound, slower, slower],
        devices=4,
        staleness=0,
        window=(5.44, 30.0),
        first_step=1,
        history=[(0.0, 5.44)],
    )
    assert (later.chain_s, later.train_s) == pytest.approx((4.0, 5.0), rel=1e-9)
    assert run.work_s == pytest.approx((0.25 + 0.25 + 7.76) / 4, rel=1e-6)
    fractions = run.fractions()
    assert fractions["combined"] == pytest.approx(0.544, rel=1e-6)
    assert fractions["work"] == pytest.approx(0.2065, rel=1e-6)


def test_staleness_lets_the_next_batch_start_before_training_ends():
    # C = 2 s to score a batch, T = 3 s to train it; two steps
    chain, train = [2.0, 2.0], [3.0, 3.0]
    # synchronous: step 1 starts when step 0 trained (5 s), ends at 10 s
    assert critical_path_end(chain, train, staleness=0) == pytest.approx(10.0)
    # staleness 1: both start at 0; step 1 is scored at 2 s but trains after step 0 (5 -> 8 s)
    assert critical_path_end(chain, train, staleness=1) == pytest.approx(8.0)
    # scoring the bottleneck: C = 5, T = 1 -> step 1 scored at 5, trained after 0's end (6 -> 7)
    assert critical_path_end([5.0, 5.0], [1.0, 1.0], staleness=1) == pytest.approx(7.0)
    # a warm-up step that actually ended at 6 s (not 5): step 1 starts there (synchronous)
    assert critical_path_end(
        chain, train, staleness=0, first_step=1, history=[(0.0, 6.0)]
    ) == pytest.approx(11.0)
    with pytest.raises(ValueError, match="need their times"):
        critical_path_end(chain, train, staleness=0, first_step=1)


def test_the_efficient_batch_stays_within_the_kv_capacity():
    # ITL = 1e-4 * tokens + 0.01: throughput b / (0.01 b + 0.01) grows with the batch, but at
    # a mean context of 100 tokens only 10 sequences fit in 1,000 tokens of KV cache
    cost = InferenceCost(CostModel(a=1e-4, b=0.01, c=0.0, d=0.0), 1, 64, 1000, 1e9)
    point = efficient_point(cost, context=100.0)
    assert point.batch == 10
    assert point.tokens_per_s == pytest.approx(10 / 0.11)
    # 90% of that: b / (b + 1) >= 0.818..., first reached at b = 5 (4 gives 0.8)
    assert point.near_batch == 5
    # a replica of 2 devices: the same batch, half the tokens/s per device
    wide = efficient_point(cost._replace(devices=2), context=100.0)
    assert (wide.batch, wide.tokens_per_s) == (10, pytest.approx(point.tokens_per_s / 2))
    # room for every sequence: the batch limit binds
    assert efficient_point(cost._replace(kv_capacity_tokens=10**6), context=100.0).batch == 64


def test_the_time_account_resolves_overlaps_and_sums_to_devices_times_window():
    ledger = Ledger()
    ledger.hold([0], "inference", -math.inf)
    ledger.hold([1], "trainer", -math.inf)
    # device 0 prefills 1 s (half of it re-prefilling), decodes 8 sequences (busy from 5)
    ledger.segment((0,), "rollout", 1.0, 4.0, 8, 1.0, 0.5)
    ledger.transit([0], 3.0, 6.0)  # its engine still runs for the first second of the shift
    # device 1: the trainer waits, trains, lends itself; then decodes 2 sequences (under-filled)
    ledger.training([1], 0.5, 2.0)
    ledger.transit([1], 2.0, 3.0)
    ledger.hold([1], "inference", 3.0)
    ledger.segment((1,), "rollout", 5.0, 7.0, 2, 0.0, 0.0)
    got = account(ledger, (0.0, 10.0), 2, thresholds={"rollout": 5})
    # no engine runs in [0, 1), [4, 5) and [7, 10): waiting then is stalled on the trainer
    assert got.seconds == pytest.approx(
        {
            "busy": 0.5 + 2.0,
            "under_filled": 2.0,
            "re_prefilling": 0.5,
            "idle": 1.0 + 1.0,  # device 0 in [6, 7), device 1 in [3, 4): the other one runs
            "stalled_on_trainer": (1.0 + 3.0) + (1.0 + 3.0),
            "trainer_waiting": 0.5,
            "training": 1.5,
            "in_transit": 2.0 + 1.0,
        }
    )
    assert list(got.seconds) == list(ACCOUNT)
    assert got.total_s == pytest.approx(2 * 10.0)
    # a window cuts every interval at its edges
    assert account(ledger, (2.5, 4.5), 2, thresholds={"rollout": 5}).total_s == pytest.approx(4.0)


def test_the_time_account_splits_engine_time_by_role_with_the_batch_each_decoded_at():
    ledger = Ledger()
    ledger.hold([0, 1, 2], "inference", -math.inf)
    # rollout: device 0 prefills 1 s (half re-prefilling), then decodes 8 (busy from 5) for
    # 3 s; later 2 (under-filled) for 2 s
    ledger.segment((0,), "rollout", 0.0, 4.0, 8, 1.0, 0.5)
    ledger.segment((0,), "rollout", 4.0, 6.0, 2, 0.0, 0.0)
    # reward: one two-device replica decodes 3 sequences for 4 s, the window cuts 1 s off
    ledger.segment((1, 2), "reward", 5.0, 10.0, 3, 0.0, 0.0)
    got = account(ledger, (0.0, 9.0), 3, thresholds={"rollout": 5, "reward": 4})
    assert got.roles == {
        "reward": RoleTime(busy=0.0, under_filled=8.0, re_prefilling=0.0, decode_batch=3.0),
        "rollout": RoleTime(
            busy=0.5 + 3.0,
            under_filled=2.0,
            re_prefilling=0.5,
            decode_batch=(8 * 3.0 + 2 * 2.0) / 5.0,
        ),
    }
    # the roles' engine time is the account's
    for category in ("busy", "under_filled", "re_prefilling"):
        assert sum(getattr(r, category) for r in got.roles.values()) == pytest.approx(
            got.seconds[category]
        )
    # a window with no engine time in it has each role at zero, decoding at no batch
    late = account(ledger, (20.0, 30.0), 3).roles["reward"]
    assert (late.under_filled, late.busy, late.decode_batch) == (0.0, 0.0, 0.0)


def test_warm_up_training_inside_the_window_counts_as_work():
    inference = {Role.ROLLOUT: _flat(0.01), Role.REWARD: _flat(0.02)}
    steps = [step_bound(_one_sequence(k), inference, _trainer(4), devices=4) for k in range(4)]
    train = steps[0].work_device_s["training"]
    measured = sum(s.work_s for s in steps[2:])

    def opened_at(t0: float):
        # warm-up steps 0 and 1 ended at 4 s and 6 s
        history = [(0.0, 4.0), (1.0, 6.0)]
        return run_bound(
            steps, devices=4, staleness=1, window=(t0, 20.0), first_step=2, history=history
        )

    # opened at 5 s, after step 0 ended: step 1 trained after 4 s, maybe before the window
    late = opened_at(5.0)
    assert late.carried_device_s == 0.0
    assert late.work_s == pytest.approx(measured / 4)
    # opened at 3 s, before step 0 ended: step 1's training lay wholly inside the window
    early = opened_at(3.0)
    assert early.carried_device_s == pytest.approx(train)
    assert early.work_s == pytest.approx((measured + train) / 4)
