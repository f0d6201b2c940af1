"""``pivot simulate``: the real actors on a simulated cluster under the virtual clock, PivotRL
against the colocated, disaggregated and rollout-reward colocated deployments.

    pivot simulate CONFIG [--deployment D] [--gpus N] [--steps K] [--seed S] [--json]
                          [--run-dir DIR] [--horizon H] [--ablation A ...]
                          [--study horizon|ablation] [--no-sweep] [--sweep-steps K]

Every static baseline runs at the seed's Table 4 split scaled to N devices and at the best
split a sweep finds (``--no-sweep``: Table 4 only); PivotRL's speedup over a baseline is
against the better of the two. The run directory gets ``metrics.jsonl`` (one line per run,
step, timeline sample, shift and training span), ``summary.json`` (the report it prints),
one Figure-10-style plot per deployment, ``report.html`` (``pivot report``: every run on one
page) and the Controller's shift journals; Ctrl-C leaves the same of the runs done so far. Each metrics line has ``record`` (run | step | sample | shift |
train) and ``run`` (deployment-label).

Output is the same byte for byte for the same arguments, except ``wall_s`` (the real time the
command took): ``--no-wall`` prints it as null.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from pivot.cli.flags import positive
from pivot.deployment import KIND_NAMES

DEPLOYMENTS = ("all", *KIND_NAMES)
STUDIES = ("horizon", "ablation")
# the keys of pivot.actors.simulation.ABLATIONS, named here so that building the parser imports
# nothing heavy (``pivot --help`` stays instant)
ABLATION_NAMES = ("no-lending", "no-rebalance", "rule-based", "no-early-reclaim")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` (and its flags) on the ``pivot`` command's subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="PivotRL vs colocated / disaggregated / rollout-reward colocated, simulated",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("config", help="a workload, e.g. configs/sim/qwen2.5-7b_qwen3-30b-a3b.toml")
    p.add_argument("--deployment", choices=DEPLOYMENTS, default="all")
    p.add_argument("--gpus", type=positive, default=128, help="simulated devices (default 128)")
    p.add_argument("--steps", type=positive, default=5, help="RL steps per run (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--run-dir", default=None, help="default runs/simulate/<workload>-<N>gpus-s<S>")
    p.add_argument("--horizon", type=float, default=None, help="planner horizon H in seconds")
    p.add_argument(
        "--ablation",
        action="append",
        choices=ABLATION_NAMES,
        default=[],
        help="switch a PivotRL mechanism off (repeatable)",
    )
    p.add_argument(
        "--study",
        choices=STUDIES,
        default=None,
        help="horizon: H in 5..90 s; ablation: each mechanism off in turn",
    )
    p.add_argument("--no-sweep", action="store_true", help="baselines at Table 4's split only")
    p.add_argument(
        "--sweep-steps", type=positive, default=3, help="steps per run while sweeping (default 3)"
    )
    p.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="Controller planning period in seconds (default 1, the paper's)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the plots")
    p.add_argument("--no-wall", action="store_true", help="print wall_s as null")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    from pivot.actors.simulation import (
        ABLATIONS,
        SimulationError,
        SimulationSettings,
        ablation_study,
        compare,
        horizon_study,
        pivot_settings,
    )
    from pivot.bus import configure_logging
    from pivot.deployment import DeploymentError
    from pivot.workload import load_workload

    started = time.perf_counter()
    configure_logging("warning")
    workload = load_workload(args.config)
    planner: dict[str, Any] = {}
    if args.horizon is not None:
        planner["horizon_s"] = args.horizon
    for name in args.ablation:
        planner.update(ABLATIONS[name])
    settings = SimulationSettings(
        steps=args.steps, seed=args.seed, controller_interval_s=args.interval
    )
    if planner:
        settings = pivot_settings(settings, **planner)
    name = workload.config.name
    run_dir = Path(args.run_dir or f"runs/simulate/{name}-{args.gpus}gpus-s{args.seed}")
    run_dir.mkdir(parents=True, exist_ok=True)
    journals = run_dir / "journals"

    def progress(line: str) -> None:
        if not args.json:
            print(line, file=sys.stderr, flush=True)

    finished: list[Any] = []  # the runs done so far: what Ctrl-C leaves in the run dir
    # what was simulated, resolved (the workload with its defaults, the settings), for the report
    resolved = {
        "source": str(args.config),
        "workload": msgspec.to_builtins(workload.config),
        "settings": msgspec.to_builtins(settings),
        "gpus": args.gpus,
        "deployment": args.deployment,
        "study": args.study,
        "sweep": not args.no_sweep,
        "sweep_steps": args.sweep_steps,
    }
    try:
        if args.study == "horizon":
            results = horizon_study(
                workload, args.gpus, settings, journal_dir=journals, on_run=finished.append
            )
            report = _study_report("horizon", results, args, name)
        elif args.study == "ablation":
            results = ablation_study(
                workload, args.gpus, settings, journal_dir=journals, on_run=finished.append
            )
            report = _study_report("ablation", results, args, name)
        else:
            deployments = None if args.deployment == "all" else [args.deployment]
            comparison = compare(
                workload,
                args.gpus,
                settings,
                deployments=deployments,
                sweep=not args.no_sweep,
                sweep_steps=args.sweep_steps,
                journal_dir=journals,
                progress=progress,
                on_run=finished.append,
            )
            results = comparison.runs()
            report = _comparison_report(comparison, args)
    except (SimulationError, DeploymentError) as exc:
        print(f"pivot simulate: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # what ran, as a finished command leaves it; it must not hide the interrupt
        with contextlib.suppress(Exception):
            partial = {"workload": name, "gpus": args.gpus, "steps": args.steps}
            partial |= {"seed": args.seed, "interrupted": True}
            partial["runs"] = [r.summary() for r in finished]
            _write_run_dir(run_dir, finished, name, partial, resolved, plot=not args.no_plot)
            print(
                f"interrupted: {len(finished)} runs finished; what ran is in {run_dir}",
                file=sys.stderr,
            )
        raise
    report["run_dir"] = str(run_dir)
    report["wall_s"] = None if args.no_wall else round(time.perf_counter() - started, 2)
    plots = _write_run_dir(run_dir, results, name, report, resolved, plot=not args.no_plot)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        print(_format(report, plots))
    return 0


def _write_run_dir(
    run_dir: Path,
    results: list[Any],
    name: str,
    report: dict[str, Any],
    resolved: dict[str, Any],
    *,
    plot: bool,
) -> list[Path]:
    """metrics.jsonl, summary.json (the printed report and what was simulated), the plots
    and report.html; the paths of the plots and the report."""
    from pivot.cli.report import SUMMARY_NAME, write_report

    _write_metrics(run_dir / "metrics.jsonl", results)
    summary = {"report": report, "resolved": resolved}
    (run_dir / SUMMARY_NAME).write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n")
    if not plot:
        return []
    return [*_plot(run_dir, results, name), write_report(run_dir)]


# --- reports ----------------------------------------------------------------------------------


def _rate(result: Any) -> dict[str, float]:
    return {
        "samples_per_s": round(result.samples_per_s, 6),
        "tokens_per_s": round(result.tokens_per_s, 3),
    }


def _comparison_report(comparison: Any, args: argparse.Namespace) -> dict[str, Any]:
    throughput: dict[str, dict[str, float]] = {}
    splits: dict[str, dict[str, Any]] = {}
    if comparison.pivot is not None:
        throughput["pivot"] = _rate(comparison.pivot)
        runs = comparison.pivot_runs
        splits["pivot"] = {
            "table4": runs.table4.split.label(),
            "table4_samples_per_s": round(runs.table4.samples_per_s, 6),
            "best": runs.best.split.label(),
            "tried": runs.tried,
        }
    for kind, runs in comparison.baselines.items():
        throughput[kind] = _rate(runs.best)
        splits[kind] = {
            "table4": runs.table4.split.label(),
            "table4_samples_per_s": round(runs.table4.samples_per_s, 6),
            "best": runs.best.split.label(),
            "tried": runs.tried,
        }
    speedup = {k: round(v, 4) for k, v in comparison.speedups().items()}
    at_table4 = {k: round(v, 4) for k, v in comparison.speedups_at_table4().items()}
    pivot = comparison.pivot
    return {
        "workload": comparison.workload,
        "gpus": comparison.gpus,
        "steps": comparison.steps,
        "seed": comparison.seed,
        "throughput": throughput,
        "speedup": speedup,
        "speedup_pivot_at_table4": at_table4,
        "shifts_per_step": round(pivot.shifts_per_step, 3) if pivot is not None else None,
        "splits": splits,
        "runs": [r.summary() for r in comparison.runs()],
    }


def _study_report(
    study: str, results: list[Any], args: argparse.Namespace, name: str
) -> dict[str, Any]:
    rows = []
    for r in results:
        row = {"label": r.label, **_rate(r), "shifts_per_step": round(r.shifts_per_step, 3)}
        row["migration"] = msgspec.to_builtins(r.migration)
        rows.append(row)
    return {
        "workload": name,
        "gpus": args.gpus,
        "steps": args.steps,
        "seed": args.seed,
        "study": study,
        "results": rows,
    }


def _format(report: dict[str, Any], plots: list[Path]) -> str:
    lines = [
        f"pivot simulate: {report['workload']} on {report['gpus']} simulated devices, "
        f"{report['steps']} steps, seed {report['seed']}"
    ]
    if "study" in report:
        lines.append(
            f"{'run':<16}{'samples/s':>11}{'tokens/s':>12}{'shifts/step':>13}{'shift s':>9}"
            f"{'migrated':>10}"
        )
        for row in report["results"]:
            m = row["migration"]
            lines.append(
                f"{row['label']:<16}{row['samples_per_s']:>11.3f}{row['tokens_per_s']:>12.0f}"
                f"{row['shifts_per_step']:>13.2f}{m['shift_s']:>9.1f}{m['aborted']:>10}"
            )
    else:
        lines.append(
            f"{'deployment':<15}{'run':<8}{'split':<20}{'samples/s':>10}{'tokens/s':>10}"
            f"{'s/step':>8}{'shifts/step':>12}{'shift s':>9}{'migrated':>9}{'reprefill s':>12}"
        )
        for run in report["runs"]:
            m = run["migration"]
            steps = max(report["steps"], 1)
            lines.append(
                f"{run['deployment']:<15}{run['label']:<8}{run['split']:<20}"
                f"{run['samples_per_s']:>10.3f}{run['tokens_per_s']:>10.0f}"
                f"{run['seconds'] / steps:>8.1f}{run['shifts_per_step']:>12.2f}"
                f"{m['shift_s']:>9.1f}{m['aborted']:>9}{m['reprefill_s']:>12.1f}"
            )
        if report["speedup"]:
            parts = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(report["speedup"].items()))
            lines.append(f"PivotRL speedup over the better split of each baseline: {parts}")
            at_table4 = report.get("speedup_pivot_at_table4") or {}
            if at_table4:
                parts = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(at_table4.items()))
                lines.append(f"  (PivotRL at Table 4's trainer pool, not swept: {parts})")
    lines.append(f"run directory: {report['run_dir']}")
    for plot in plots:
        lines.append(f"  {'report' if plot.suffix == '.html' else 'plot'}: {plot}")
    if report["wall_s"] is not None:
        lines.append(f"wall time: {report['wall_s']:.1f} s")
    return "\n".join(lines)


# --- run directory ----------------------------------------------------------------------------


def _run_name(result: Any) -> str:
    label = result.label or "run"
    return f"{result.deployment.value}-{label}".replace("=", "")


def _write_metrics(path: Path, results: list[Any]) -> None:
    encoder = msgspec.json.Encoder()
    with path.open("wb") as out:
        for r in results:
            run = _run_name(r)
            head = {"record": "run", "run": run, "checks": r.checks} | r.summary()
            out.write(encoder.encode(head) + b"\n")
            for s in r.steps:
                out.write(encoder.encode({"record": "step", "run": run, **msgspec.to_builtins(s)}))
                out.write(b"\n")
            for s in r.timeline:
                out.write(
                    encoder.encode({"record": "sample", "run": run, **msgspec.to_builtins(s)})
                )
                out.write(b"\n")
            for m in r.marks:
                out.write(encoder.encode({"record": "shift", "run": run, **msgspec.to_builtins(m)}))
                out.write(b"\n")
            for t in r.trains:
                out.write(encoder.encode({"record": "train", "run": run, **msgspec.to_builtins(t)}))
                out.write(b"\n")


def _plot(run_dir: Path, results: list[Any], name: str) -> list[Path]:
    from pivot.cli.plot import plot_run

    out = []
    for r in results:
        path = run_dir / f"plot-{_run_name(r)}.png"
        title = f"{name}: {r.deployment.value} {r.split.label()} ({r.label})"
        out.append(plot_run(r.timeline, r.marks, r.trains, path, title=title))
    return out
