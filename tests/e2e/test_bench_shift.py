"""`pivot bench shift`: its medians from hand-made observations, and one short real run of the
two deployments no other test runs (colocated, rollout-reward colocated) through the bench."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pivot.actors.scheduler import MigrationTiming
from pivot.cli.bench_shift import (
    DeploymentRun,
    HostCpu,
    bench_order,
    migration_medians,
    proc_stat_jiffies,
    shift_medians,
    versus_best,
)
from pivot.timeline import ShiftMark


def _mark(
    kind: str,
    seconds: float,
    released: float,
    acquired: float,
    registered: float,
    done: float = 0.0,
    t: float = 0.0,
):
    phases = {"routing_cut": 0.001, "aborted": 0.002, "released": released}
    phases |= {"acquired": acquired, "registered": registered, "done": done}
    return ShiftMark(t=t, kind=kind, allocation={}, seconds=seconds, phase_s=phases)


def test_shift_medians_take_role_shifts_by_phase():
    shifts = [
        _mark("shift", 0.3, 0.01, 0.10, 0.02, done=0.15),
        _mark("shift", 0.5, 0.03, 0.30, 0.04),
        _mark("shift", 0.4, 0.02, 0.20, 0.06, done=0.1),
        # trainer lending is not a role shift: its offload would skew the medians
        _mark("lend_trainer", 9.0, 5.0, 5.0, 5.0),
    ]
    got = shift_medians(shifts)
    # serving: until the receivers serve (0.15, 0.5, 0.3), rebalance: moving sequences to them
    assert got == pytest.approx(
        {"release": 0.02, "gps_read": 0.2, "register": 0.04}
        | {"serving": 0.3, "rebalance": 0.1, "total": 0.4, "shifts": 3}
    )
    assert shift_medians([]) == dict.fromkeys(
        ("release", "gps_read", "register", "serving", "rebalance", "total")
    ) | {"shifts": 0}


def test_migration_medians_per_sequence():
    timings = [
        MigrationTiming(seq_id=i, tokens=5, abort_s=a, dispatch_s=d, reprefill_s=r)
        for i, (a, d, r) in enumerate([(0.1, 0.5, 0.02), (0.3, 0.1, 0.04), (0.2, 0.2, 0.03)])
    ]
    assert migration_medians(timings) == pytest.approx(
        {"abort": 0.2, "dispatch": 0.2, "reprefill": 0.03}
    )


def test_pivot_is_compared_with_the_best_baseline():
    # each deployment's rounds: the host slower in round 2, pivot's median 120 against 100
    each = {"pivot": [130.0, 100.0, 120.0], "rr-colocated": [125.0, 80.0, 100.0]}
    runs = {
        k: SimpleNamespace(samples_per_s=v, each=each.get(k, [v, v, v])) for k, v in PER_S.items()
    }
    assert versus_best(runs) == {
        "pivot_vs_best": 1.2,
        "best_baseline": "rr-colocated",
        "pivot_vs_best_rounds": [1.04, 1.25, 1.2],
    }
    del runs["pivot"]
    assert versus_best(runs) == {
        "pivot_vs_best": None,
        "best_baseline": None,
        "pivot_vs_best_rounds": None,
    }


PER_S = {"pivot": 120.0, "colocated": 90.0, "rr-colocated": 100.0, "disaggregated": 80.0}


def test_rounds_alternate_the_order_of_the_deployments():
    assert bench_order(["a", "b", "c"], 3) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"), (2, "a"), (2, "b"), (2, "c")
    ]  # fmt: skip


def test_warmup_steps_are_left_out_of_the_throughput():
    # a slow first step (start-up), then 10 samples/s
    steps = [
        SimpleNamespace(samples=10, started_s=t, seconds=d) for t, d in ((0, 5), (5, 1), (6, 1))
    ]
    assert DeploymentRun("pivot", steps, [], [], 0.0, warmup=1).samples_per_s == 10.0
    assert DeploymentRun("pivot", steps, [], [], 0.0).samples_per_s == pytest.approx(30 / 7)


def test_shifts_are_measured_in_the_steps_throughput_is():
    # the monitor's origin is clock 100: the warm-up step ends at 105, the last at 107
    steps = [
        SimpleNamespace(samples=10, started_s=t, seconds=d)
        for t, d in ((100, 5), (105, 1), (106, 1))
    ]
    shifts = [_mark("shift", 0.1, 0.01, 0.05, 0.0, t=t) for t in (2.0, 5.5, 6.9, 7.5)]
    run = DeploymentRun("pivot", steps, shifts, [], 0.0, warmup=1, origin=100.0)
    assert [m.t for m in run.measured_shifts] == [5.5, 6.9]
    assert [m.t for m in DeploymentRun("pivot", steps, shifts, [], 0.0, origin=100.0)
            .measured_shifts] == [2.0, 5.5, 6.9]  # fmt: skip


def test_the_hosts_busy_share_is_read_between_the_samples_in_a_window():
    now = [0.0]
    jiffies = iter([(0, 100), (50, 200), (90, 300), (190, 400), (200, 500)])
    cpu = HostCpu(clock=lambda: now[0], read=lambda: next(jiffies))
    for t in (0.0, 1.0, 2.0, 3.0, 4.0):
        now[0] = t
        cpu.sample()
    assert cpu.busy(1.0, 3.0) == pytest.approx(140 / 200)
    assert cpu.busy(0.5, 3.5) == pytest.approx(140 / 200)  # the samples inside the window
    assert cpu.busy(2.5, 2.9) is None  # no two samples in it
    busy, total = proc_stat_jiffies()  # this host's: Linux
    assert 0 < busy < total
    run = DeploymentRun("pivot", [SimpleNamespace(samples=1, started_s=0.0, seconds=4.0)],
                        [], [], 0.0, cpu=cpu)  # fmt: skip
    assert run.cpu_busy == pytest.approx(200 / 400)


def test_bench_shift_runs_the_time_sharing_baselines(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pivot.cli.main", "bench", "shift", "--steps", "2", "--json"]
        + ["--deployments", "colocated", "rr-colocated", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {
        "shift_s",
        "migration_s",
        "samples_per_s",
        "pivot_vs_best",
        "best_baseline",
        "pivot_vs_best_rounds",
        "pin_cores",
        "cpu_busy",
        "samples_per_s_rounds",
        "rounds",
        "warmup_steps",
    }
    assert result["pivot_vs_best"] is None and result["pin_cores"] is False  # pivot did not run
    assert set(result["samples_per_s"]) == {"colocated", "rr-colocated"}
    assert result["rounds"] == 1 and result["warmup_steps"] == 1  # step 1 measured
    assert result["samples_per_s_rounds"] == {k: [v] for k, v in result["samples_per_s"].items()}
    assert all(v > 0 for v in result["samples_per_s"].values())
    assert set(result["cpu_busy"]) == {"colocated", "rr-colocated"}
    assert all(0 < v <= 1 for v in result["cpu_busy"].values())
    # both switched stages every step: rollout -> reward (and colocated: -> training) and back
    for kind, least in (("colocated", 5), ("rr-colocated", 3)):
        journal = (tmp_path / kind / "shift.journal").read_bytes()
        assert journal.count(b"planned") >= least, kind
        metrics = (tmp_path / kind / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [0, 1]
