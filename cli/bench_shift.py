"""`pivot bench shift`: what a shift costs in a real job, and what the job gains from it.

Runs the tiny job (the config's, with ``--steps`` steps) once under each deployment, one after
the other, and reports (medians):

* ``shift_s``: the pivot run's shifts between rollout and reward, by phase of the journaled
  transaction: ``release`` (engines release their KV cache and weights), ``gps_read`` (the
  receiving engines resume and Read weights: the policy from GPS, the frozen GenRM from its
  checkpoint), ``register`` (replicas join their scheduler), ``total`` (plan to done,
  including cutting routes and evacuating sequences).
* ``migration_s``: per migrated sequence (one aborted with partial output and re-dispatched),
  ``abort`` (the evacuation or abort request that returned its partial output),
  ``dispatch`` (from then until a replica accepted it) and ``reprefill`` (the receiving
  engine's prefill of prompt + partial output): the seed's Table 3 columns.
* ``samples_per_s``: samples scored and trained per second over the steps (startup
  excluded), per deployment.
* ``pivot_vs_best``: pivot's samples/s over the best static baseline's (null unless both
  ran), and ``best_baseline``, which one that was.
* ``pin_cores``: whether every deployment ran pinned (``cluster.pin_cores``).

A key with no observation (e.g. no sequence migrated) is null.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pivot.cli.flags import positive
from pivot.deployment import BASELINES, DeploymentKind

if TYPE_CHECKING:  # the job's modules load torch: only when a bench runs
    from pivot.actors.scheduler import MigrationTiming
    from pivot.timeline import ShiftMark

#: pivot first: the others are compared with it
DEPLOYMENTS = (DeploymentKind.PIVOT.value, *(k.value for k in BASELINES))


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def shift_medians(shifts: list[ShiftMark]) -> dict[str, float | None]:
    """Medians over shifts between rollout and reward (not trainer lending) by phase."""
    role_shifts = [m for m in shifts if m.kind == "shift" and m.phase_s]
    return {
        "release": _median([m.phase_s.get("released", 0.0) for m in role_shifts]),
        "gps_read": _median([m.phase_s.get("acquired", 0.0) for m in role_shifts]),
        "register": _median([m.phase_s.get("registered", 0.0) for m in role_shifts]),
        "total": _median([m.seconds for m in role_shifts]),
    }


def migration_medians(migrations: list[MigrationTiming]) -> dict[str, float | None]:
    return {
        "abort": _median([m.abort_s for m in migrations]),
        "dispatch": _median([m.dispatch_s for m in migrations]),
        "reprefill": _median([m.reprefill_s for m in migrations]),
    }


def versus_best(runs: dict[str, DeploymentRun]) -> dict[str, float | str | None]:
    """Pivot's samples/s over the best baseline's, and which baseline that was."""
    baselines = {k: r.samples_per_s for k, r in runs.items() if k != DeploymentKind.PIVOT.value}
    pivot = runs.get(DeploymentKind.PIVOT.value)
    if pivot is None or not baselines or max(baselines.values()) <= 0:
        return {"pivot_vs_best": None, "best_baseline": None}
    best = max(baselines, key=baselines.__getitem__)
    return {"pivot_vs_best": round(pivot.samples_per_s / baselines[best], 3), "best_baseline": best}


class DeploymentRun:
    """One deployment's run of the job: throughput, shifts and migrations."""

    def __init__(  # noqa: ANN001
        self, kind: str, reports, shifts, migrations, wall_s: float, pin_cores: bool = False
    ) -> None:
        self.pin_cores = pin_cores
        self.kind = kind
        self.reports = reports
        self.shifts = shifts
        self.migrations = migrations
        self.wall_s = wall_s

    @property
    def samples_per_s(self) -> float:
        if not self.reports:
            return 0.0
        first, last = self.reports[0], self.reports[-1]
        seconds = last.started_s + last.seconds - first.started_s
        return sum(r.samples for r in self.reports) / max(seconds, 1e-9)


def run_deployment(
    config: str,
    kind: str,
    steps: int,
    seed: int | None,
    root: Path,
    overrides: list[str] | None = None,
):
    from rich.console import Console

    from pivot.bus import run_real
    from pivot.cli.run import Job, logs_to, prepare

    job, policy, genrm, inputs = prepare(
        config, overrides=overrides or [], seed=seed, deployment=kind, steps=steps
    )
    run_dir = root / kind
    run_dir.mkdir(parents=True, exist_ok=True)
    runner = Job(job, policy, genrm, inputs, run_dir, Console(file=io.StringIO()))
    started = time.perf_counter()
    with logs_to(run_dir / "actors.log"):
        reports, monitor = run_real(runner.run())
    migrations = [m for s in runner.assembly.schedulers.values() for m in s.migrations]
    return DeploymentRun(
        kind,
        reports,
        monitor.shifts,
        migrations,
        time.perf_counter() - started,
        pin_cores=job.cluster.pin_cores,
    )


def main(args: argparse.Namespace) -> int:
    kinds = args.deployments or list(DEPLOYMENTS)
    # every deployment runs under the same pinning
    overrides = [] if args.pin_cores is None else [f"cluster.pin_cores={args.pin_cores}"]
    root = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="pivot-bench-"))
    runs: dict[str, DeploymentRun] = {}
    pinned = None
    for kind in kinds:
        if not args.json:
            print(f"running {kind} ({args.steps} steps) ...", flush=True)
        runs[kind] = run_deployment(args.config, kind, args.steps, args.seed, root, overrides)
        pinned = runs[kind].pin_cores
    pivot_run = runs.get("pivot")
    result = {
        "shift_s": shift_medians(pivot_run.shifts if pivot_run else []),
        "migration_s": migration_medians(pivot_run.migrations if pivot_run else []),
        "samples_per_s": {k: round(r.samples_per_s, 3) for k, r in runs.items()},
        **versus_best(runs),
        "pin_cores": pinned,
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
        print(f"pivot shifts: {kinds_seen}; migrated sequences: {len(pivot_run.migrations)}")
        print("shift latency (median over rollout<->reward shifts)")
        for key, v in result["shift_s"].items():
            print(f"  {key:10s} {fmt(v)}")
        print("per migrated sequence (median)")
        for key, v in result["migration_s"].items():
            print(f"  {key:10s} {fmt(v)}")
    print(f"throughput (samples/s over the steps, startup excluded; pinned: {pinned})")
    base = runs["pivot"].samples_per_s if pivot_run else None
    for kind, r in runs.items():
        ratio = f"  pivot {base / r.samples_per_s:4.2f}x" if base and kind != "pivot" else ""
        print(f"  {kind:14s} {r.samples_per_s:6.2f}{ratio}  (wall {r.wall_s:5.1f} s)")
    return 0


def add_parser(bench_sub) -> None:  # noqa: ANN001 - argparse's private subparsers type
    p = bench_sub.add_parser(
        "shift", help="shift and migration latency; the tiny job's samples/s per deployment"
    )
    p.add_argument("config", nargs="?", default="configs/tiny.toml")
    p.add_argument("--steps", type=positive, default=5, help="RL steps per deployment (default 5)")
    p.add_argument(
        "--deployments",
        nargs="+",
        choices=DEPLOYMENTS,
        default=None,
        help="which deployments (default all four)",
    )
    p.add_argument("--seed", type=int, default=None)
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
