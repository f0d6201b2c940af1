"""`pivot bench shift`: what a shift costs in a real job, and what the job gains from it.

Runs the tiny job (the config's, with ``--steps`` steps) under each deployment, one after the
other, ``--rounds`` times (every other round in reverse order, so that a load from outside
that drifts during the bench weighs on every deployment about alike), and reports (medians):

* ``shift_s``: the pivot runs' shifts between rollout and reward that finished in the
  measured steps (as ``samples_per_s``: a warm-up shift pays first-time costs, such as an
  agent's first mapping of a GPS slot), by phase of the journaled transaction: ``release``
  (engines release their KV cache and weights), ``gps_read`` (the receiving engines resume
  and Read weights: the policy from GPS, the frozen GenRM from its checkpoint; a one-device
  replica then registers with its scheduler in the same request), ``register`` (the
  registered phase: what is left of joining the scheduler, nothing for a one-device
  replica), ``serving`` (plan to the receiving replicas serving: cutting routes, evacuating
  sequences, release, read, register; the paper's shift, from router pause to router
  resume), ``rebalance`` (then moving running sequences onto them: aborted at their
  sources and placed on the new replicas, whose Assigns follow as any dispatch's; the
  per-sequence costs, Assign included, are ``migration_s``), ``total`` (plan to done:
  ``serving`` + ``rebalance``); ``shifts``: how many.
* ``migration_s``: per migrated sequence (one aborted with partial output and re-dispatched),
  ``abort`` (the evacuation or abort request that returned its partial output),
  ``dispatch`` (from then until a replica accepted it) and ``reprefill`` (the receiving
  engine's prefill of prompt + partial output): the seed's Table 3 columns.
* ``samples_per_s``: samples scored and trained per second over the steps after the first
  ``--warmup`` (start-up and warm-up excluded, as ``pivot simulate`` measures steady state),
  per deployment: the median over its rounds, each round's in ``samples_per_s_rounds``.
* ``pivot_vs_best``: pivot's samples/s over the best static baseline's (null unless both
  ran), and ``best_baseline``, which one that was; ``pivot_vs_best_rounds``: the same ratio
  within each round, pivot's run over that baseline's (the two ran minutes apart, so a host
  whose speed drifts between rounds weighs on both alike).
* ``cpu_busy``: per deployment, the share of the host's CPU time that was busy (any process,
  from ``/proc/stat``; null elsewhere) over the window ``samples_per_s`` measures, the median
  over its rounds: what is left of the cores for any deployment to gain (a CPU device is a
  process, not a core, unless pinned).
* ``pin_cores``: whether every deployment ran pinned (``cluster.pin_cores``); ``rounds`` and
  ``warmup_steps`` as run.

A key with no observation (e.g. no sequence migrated) is null.
"""

from __future__ import annotations

import argparse
import bisect
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pivot.cli.flags import make_dir, non_negative, positive
from pivot.deployment import BASELINES, DeploymentKind
from pivot.timeline import steady_window

if TYPE_CHECKING:  # the job's modules load torch: only when a bench runs
    from pivot.actors.scheduler import MigrationTiming
    from pivot.timeline import ShiftMark

#: pivot first: the others are compared with it
DEPLOYMENTS = (DeploymentKind.PIVOT.value, *(k.value for k in BASELINES))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def proc_stat_jiffies() -> tuple[int, int] | None:
    """The host's (busy, total) CPU time so far, in jiffies, from /proc/stat's first line
    (idle and iowait are not busy); None where there is no /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = sum(fields[3:5])
    return sum(fields) - idle, sum(fields)


class HostCpu:
    """Samples the host's CPU time every ``interval`` seconds on a thread, stamped with
    ``clock`` (the job's: time.monotonic), so that the busy share of any window in between
    can be read afterwards."""

    def __init__(
        self,
        interval: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], tuple[int, int] | None] = proc_stat_jiffies,
    ) -> None:
        self.interval = interval
        self.clock = clock
        self.read = read
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        jiffies = self.read()
        if jiffies is not None:
            self.samples.append((self.clock(), *jiffies))

    def __enter__(self) -> HostCpu:
        def loop() -> None:
            while not self._stop.wait(self.interval):
                self.sample()

        self.sample()
        self._thread = threading.Thread(target=loop, name="host-cpu", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def busy(self, begin: float, end: float) -> float | None:
        """The busy share of the host's CPU time between the samples nearest ``begin`` and
        ``end`` (None without two distinct samples in the window)."""
        times = [t for t, _, _ in self.samples]
        i = bisect.bisect_left(times, begin)
        j = bisect.bisect_right(times, end) - 1
        if j <= i:
            return None
        (_, busy0, total0), (_, busy1, total1) = self.samples[i], self.samples[j]
        return (busy1 - busy0) / (total1 - total0) if total1 > total0 else None


def shift_medians(shifts: list[ShiftMark]) -> dict[str, float | int | None]:
    """Medians over shifts between rollout and reward (not trainer lending) by phase."""
    role_shifts = [m for m in shifts if m.kind == "shift" and m.phase_s]
    rebalance = [m.phase_s.get("done", 0.0) for m in role_shifts]
    return {
        "release": _median([m.phase_s.get("released", 0.0) for m in role_shifts]),
        "gps_read": _median([m.phase_s.get("acquired", 0.0) for m in role_shifts]),
        "register": _median([m.phase_s.get("registered", 0.0) for m in role_shifts]),
        "serving": _median([m.seconds - r for m, r in zip(role_shifts, rebalance, strict=True)]),
        "rebalance": _median(rebalance),
        "total": _median([m.seconds for m in role_shifts]),
        "shifts": len(role_shifts),
    }


def migration_medians(migrations: list[MigrationTiming]) -> dict[str, float | None]:
    return {
        "abort": _median([m.abort_s for m in migrations]),
        "dispatch": _median([m.dispatch_s for m in migrations]),
        "reprefill": _median([m.reprefill_s for m in migrations]),
    }


def versus_best(runs: dict[str, Rounds]) -> dict[str, Any]:
    """Pivot's samples/s over the best baseline's (median over the rounds, and within each
    round), and which baseline that was."""
    baselines = {k: r.samples_per_s for k, r in runs.items() if k != DeploymentKind.PIVOT.value}
    pivot = runs.get(DeploymentKind.PIVOT.value)
    if pivot is None or not baselines or max(baselines.values()) <= 0:
        return {"pivot_vs_best": None, "best_baseline": None, "pivot_vs_best_rounds": None}
    best = max(baselines, key=baselines.__getitem__)
    return {
        "pivot_vs_best": round(pivot.samples_per_s / baselines[best], 3),
        "best_baseline": best,
        "pivot_vs_best_rounds": [
            round(p / b, 3) if b > 0 else None
            for p, b in zip(pivot.each, runs[best].each, strict=True)
        ],
    }


class DeploymentRun:
    """One deployment's run of the job: throughput, shifts and migrations. ``warmup``: the
    first steps, left out of the throughput."""

    def __init__(  # noqa: ANN001
        self,
        kind: str,
        reports,
        shifts,
        migrations,
        wall_s: float,
        pin_cores: bool = False,
        warmup: int = 0,
        origin: float = 0.0,
        cpu: HostCpu | None = None,
    ) -> None:
        """``origin``: the clock reading the shifts' times count from (the monitor's).
        ``cpu``: the host's CPU time, sampled while the job ran."""
        self.pin_cores = pin_cores
        self.origin = origin
        self.cpu = cpu
        self.kind = kind
        self.reports = reports
        self.shifts = shifts
        self.migrations = migrations
        self.wall_s = wall_s
        self.warmup = warmup

    def _window(self) -> tuple[float, float] | None:
        if len(self.reports) <= self.warmup:
            return None
        spans = [(r.started_s, r.started_s + r.seconds) for r in self.reports]
        return steady_window(spans, self.warmup)

    @property
    def samples_per_s(self) -> float:
        """The measured steps' samples over their window (``pivot.timeline.steady_window``,
        as ``pivot simulate`` measures)."""
        window = self._window()
        if window is None:
            return 0.0
        begin, end = window
        return sum(r.samples for r in self.reports[self.warmup :]) / max(end - begin, 1e-9)

    @property
    def cpu_busy(self) -> float | None:
        """The host's busy CPU share over the window ``samples_per_s`` measures."""
        window = self._window()
        if window is None or self.cpu is None:
            return None
        return self.cpu.busy(*window)

    @property
    def measured_shifts(self) -> list:
        """The shifts that finished in the window ``samples_per_s`` measures."""
        window = self._window()
        if window is None:
            return []
        begin, end = window
        return [m for m in self.shifts if begin <= self.origin + m.t <= end]


class Rounds:
    """A deployment's runs over the rounds: the median throughput, every round's, and the
    shifts and migrations of all of them."""

    def __init__(self, runs: list[DeploymentRun]) -> None:
        self.runs = runs
        self.kind = runs[0].kind
        self.pin_cores = runs[0].pin_cores
        self.each = [r.samples_per_s for r in runs]
        self.samples_per_s = statistics.median(self.each)
        busy = [b for r in runs if (b := r.cpu_busy) is not None]
        self.cpu_busy = round(statistics.median(busy), 3) if busy else None
        self.shifts = [m for r in runs for m in r.measured_shifts]
        self.migrations = [m for r in runs for m in r.migrations]
        self.wall_s = sum(r.wall_s for r in runs)


def bench_order(kinds: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, deployment) in the order they run: every other round reversed (A B C, C B A,
    A B C, ...), so no deployment always runs first or last."""
    return [(r, kind) for r in range(rounds) for kind in (kinds if r % 2 == 0 else kinds[::-1])]


def run_deployment(
    config: str,
    kind: str,
    steps: int,
    seed: int | None,
    root: Path,
    overrides: list[str] | None = None,
    warmup: int = 0,
    run_dir: Path | None = None,
):
    from rich.console import Console

    from pivot.bus import run_real
    from pivot.cli.run import Job, logs_to, prepare

    job, policy, genrm, inputs = prepare(
        config, overrides=overrides or [], seed=seed, deployment=kind, steps=steps
    )
    run_dir = run_dir or root / kind
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with logs_to(run_dir / "actors.log"), HostCpu() as cpu:  # the Job's fork server logs there
        runner = Job(job, policy, genrm, inputs, run_dir, Console(file=io.StringIO()))
        reports, monitor = run_real(runner.run())
    migrations = [m for s in runner.assembly.schedulers.values() for m in s.migrations]
    return DeploymentRun(
        kind,
        reports,
        monitor.shifts,
        migrations,
        time.perf_counter() - started,
        pin_cores=job.cluster.pin_cores,
        warmup=warmup,
        origin=monitor.origin,
        cpu=cpu,
    )


def main(args: argparse.Namespace) -> int:
    if args.warmup >= args.steps:
        print(
            f"pivot bench shift: --warmup {args.warmup} leaves none of --steps {args.steps} "
            "to measure",
            file=sys.stderr,
        )
        return 2
    kinds = args.deployments or list(DEPLOYMENTS)
    # every deployment runs under the same pinning
    overrides = [] if args.pin_cores is None else [f"cluster.pin_cores={args.pin_cores}"]
    if args.run_dir:
        root = make_dir(args.run_dir, "--run-dir")
    else:
        root = Path(tempfile.mkdtemp(prefix="pivot-bench-"))
    done: dict[str, list[DeploymentRun]] = {kind: [] for kind in kinds}
    for r, kind in bench_order(kinds, args.rounds):
        if not args.json:
            print(f"running {kind} ({args.steps} steps, round {r + 1}) ...", flush=True)
        run_dir = root / (kind if r == 0 else f"{kind}.{r}")
        done[kind].append(
            run_deployment(
                args.config, kind, args.steps, args.seed, root, overrides, args.warmup, run_dir
            )
        )
    runs = {kind: Rounds(done[kind]) for kind in kinds}
    pinned = runs[kinds[-1]].pin_cores
    pivot_run = runs.get("pivot")
    result = {
        "shift_s": shift_medians(pivot_run.shifts if pivot_run else []),
        "migration_s": migration_medians(pivot_run.migrations if pivot_run else []),
        "samples_per_s": {k: round(r.samples_per_s, 3) for k, r in runs.items()},
        "samples_per_s_rounds": {k: [round(x, 3) for x in r.each] for k, r in runs.items()},
        **versus_best(runs),
        "cpu_busy": {k: r.cpu_busy for k, r in runs.items()},
        "pin_cores": pinned,
        "rounds": args.rounds,
        "warmup_steps": args.warmup,
    }
    if args.json:
        print(json.dumps(result))
        return 0

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:8.1f} ms"

    print(f"\nrun dirs under {root}")
    if pivot_run:
        kinds_seen: dict[str, int] = {}
        for m in pivot_run.shifts:
            kinds_seen[m.kind] = kinds_seen.get(m.kind, 0) + 1
        print(
            f"pivot shifts in the measured steps: {kinds_seen}; "
            f"migrated sequences: {len(pivot_run.migrations)}"
        )
        print(
            f"shift latency (median over the {result['shift_s']['shifts']} rollout<->reward "
            "shifts of the measured steps)"
        )
        for key, v in result["shift_s"].items():
            if key != "shifts":
                print(f"  {key:10s} {fmt(v)}")
        print("per migrated sequence (median)")
        for key, v in result["migration_s"].items():
            print(f"  {key:10s} {fmt(v)}")
    print(
        f"throughput (samples/s over the steps after {args.warmup} warm-up, median of "
        f"{args.rounds} rounds; pinned: {pinned})"
    )
    base = runs["pivot"].samples_per_s if pivot_run else None
    for kind, r in runs.items():
        ratio = f"  pivot {base / r.samples_per_s:4.2f}x" if base and kind != "pivot" else ""
        busy = "-" if r.cpu_busy is None else f"{r.cpu_busy:.0%}"
        print(
            f"  {kind:14s} {r.samples_per_s:6.2f}{ratio}  (host CPU busy {busy}, "
            f"wall {r.wall_s:5.1f} s)"
        )
    if result["pivot_vs_best_rounds"]:
        each = ", ".join(f"{x:.2f}" for x in result["pivot_vs_best_rounds"])
        print(f"  pivot over {result['best_baseline']} within each round: {each}")
    return 0


def add_parser(bench_sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    p = bench_sub.add_parser(
        "shift", help="shift and migration latency; the tiny job's samples/s per deployment"
    )
    p.add_argument("config", nargs="?", default="configs/tiny.toml")
    p.add_argument(
        "--steps", type=positive, default=10, help="RL steps per deployment (default 10)"
    )
    p.add_argument(
        "--deployments",
        nargs="+",
        choices=DEPLOYMENTS,
        default=None,
        help="which deployments (default all four)",
    )
    p.add_argument(
        "--warmup",
        type=non_negative,
        default=1,
        help="first steps of each run left out of samples/s (default 1)",
    )
    p.add_argument(
        "--rounds",
        type=positive,
        default=1,
        help="runs of every deployment, every other round in reverse order; samples/s is "
        "the median (default 1)",
    )
    p.add_argument("--seed", type=non_negative, default=None)
    pin = p.add_mutually_exclusive_group()
    pin.add_argument(
        "--pin-cores",
        dest="pin_cores",
        action="store_const",
        const="true",
        default=None,
        help="pin each device to its share of the cores, for every deployment "
        "(cluster.pin_cores; default: the config's)",
    )
    pin.add_argument("--no-pin-cores", dest="pin_cores", action="store_const", const="false")
    p.add_argument("--run-dir", default=None, help="where each deployment's run dir goes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=main)
