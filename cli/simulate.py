"""``pivot simulate``: the real actors on a simulated cluster under the virtual clock, PivotRL
against the colocated, disaggregated and rollout-reward colocated deployments.

    pivot simulate CONFIG [--deployment D] [--gpus N] [--steps K] [--warmup W] [--seed S]
                          [--json] [--run-dir DIR] [--horizon H] [--ablation A ...]
                          [--study horizon|ablation|headroom] [--no-sweep] [--router R]
                          [--roles best|shift|held] [--split SPLIT]
                          [--prior-itl-scale ROLE=X ...] [--jobs J]

Steady state: every run does W warm-up steps, reported apart, then K measured steps; its
throughput is the measured steps' samples over the window from the end of the last warm-up
step to the end of the last step. Each deployment, PivotRL included, routes by the rule that
serves it best, the paper's (rollout throughput-optimal, reward lowest-ITL) or round-robin,
as its Table 4 split (and its sweep's best split) measures them (``--router``); the rules are
stated per run. PivotRL's planner either shifts devices between rollout and reward or holds
that split and only lends the trainer pool (``--roles``; by default both are tried at Table
4's split and the better is kept, as for the rules: neither serves every workload best), and
the report says which. Every static baseline (and PivotRL's trainer pool) runs at the
seed's Table 4 split scaled to N devices and at the best split a hill-climb over the sweep
grid finds, in the same regime (``--no-sweep``: Table 4 only; ``--jobs``: worker processes,
default one per CPU it may use, running a deployment's configurations and a sweep's next
candidates side by side with the same result); PivotRL's speedup over a
baseline is against the better of the two. For the run each comparison uses (PivotRL's best,
each baseline's best) it prints the fraction of the physical bounds reached by the measured
steps, from the first one's start (work-conserving, critical-path, combined: ``pivot.bounds``) and the time account
(device-seconds busy, under-filled, re-prefilling, idle, stalled on the trainer, trainer
waiting, training, in transit: ``pivot.account``), with the engine's part split by inference
role and the batch each role decoded at; ``--json`` has them under ``bound``, ``account`` and
``account_by_role``, keyed by deployment, and every run's summary has its own (stdout holds that
one object; each run's line goes to stderr as the run ends, as without ``--json``). The run
directory gets
``metrics.jsonl`` (one line per run, step, timeline sample, shift and training span),
``summary.json`` (the report it prints),
one Figure-10-style plot per deployment, ``report.html`` (``pivot report``: every run on one
page) and the Controller's shift journals; Ctrl-C leaves the same of the runs done so far.
Each metrics line has ``record`` (run | step | sample | shift | train) and ``run``
(deployment-label).

``--split shared32/pool96`` (a split as the report labels it: ``RO16/RM64/TR48``,
``RO+RM96/TR32``, ``all128``, ``shared32/pool96``) runs its deployment alone at that split,
not swept, instead of Table 4's; with ``--study`` PivotRL's split. Its pools' sum is the
cluster (``--gpus``, when given, must agree).

``--study`` runs PivotRL alone, at Table 4's split or ``--split``'s, once per variant: ``horizon``
at each planner horizon H, ``ablation`` with each mechanism off in turn, ``headroom`` on
what-if clusters that leave out one kind of cost each (``free-prefill``: admitting a
sequence; ``free-reprefill``: only resuming a migrated one, as if its KV cache moved with
it; ``free-batching``: each replica decodes as one sequence of its mean context alone;
``free-training``: the trainer steps as fast as on every device, without gradient helpers;
``all``: every one of them), where the bounds still price the workload as it is: how far
each run's fractions move says how much of the distance from the bounds that cost accounts
for, and ``all`` what the schedule itself leaves (a what-if may pass 1.0). Each study's
table has every run's bound fractions, and its ``--json`` each run's ``latency``.

``--prior-itl-scale rollout=1.5`` starts PivotRL's planner from a cost model 1.5x too slow
for rollout while the engines run the true one: the online refit's test (with ``--study
ablation``, ``no-refit`` keeps the wrong prior; with the true prior the refit never fires).

Output is the same byte for byte for the same arguments, except ``wall_s`` (the real time the
command took): ``--no-wall`` prints it as null.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from pivot.cli.flags import make_dir, non_negative, non_negative_float, positive, positive_float
from pivot.deployment import KIND_NAMES, DeploymentKind

DEPLOYMENTS = ("all", *KIND_NAMES)
PIVOT = DeploymentKind.PIVOT.value
# The default regime (issue 16, measured at 128 devices): with staleness 2 the steps come in
# rounds of three batches that start and end together, so the warm-up is the first round and
# the measured steps are whole rounds. The run's pace is set by each batch's longest response
# and judgment, whose spread between batches is wide (the critical-path bound of the 1.5B
# group's steps has a coefficient of variation of ~12%), so the workload itself needs many
# steps to settle: seeds 0 and 1 differ in that bound by 7.5% over 24 measured steps and 2.2%
# over 63 (the other groups: 2.5% or less at 63), and PivotRL's samples/s at Table 4's split
# agree within 0.3-2.3% at 63-64 in every group, where over 24 the 1.5B group's differed by 8%.
# (Over four seeds the 1.5B bound still spreads 7% at 63 steps and 3% at ~128.)
WARMUP_STEPS = 3
MEASURED_STEPS = 63
STUDIES = ("horizon", "ablation", "headroom")
# the keys of pivot.actors.simulation.ABLATIONS, named here so that building the parser imports
# nothing heavy (``pivot --help`` stays instant)
ABLATION_NAMES = (
    "no-lending",
    "no-rebalance",
    "no-refit",
    "no-reprefill-price",
    "no-early-reclaim",
    "no-lead-correction",
    "no-gradient-helpers",
    "no-trainer-bound-helpers",
    "no-tail-packing",
    "no-rollout-floor",
    "no-protection",
    "rule-based",
)
# --router: "best" runs each deployment's Table 4 split with each rule and keeps the better
# one (measured: neither serves every deployment best, PivotRL included)
ROUTER_RULES = ("paper", "round_robin")
ROUTER_CHOICES = ("best", *ROUTER_RULES)
# --roles: "best" runs PivotRL's Table 4 split with its planner shifting devices between
# rollout and reward and with that split held (only the trainer pool lent), and keeps the
# better (``pivot.actors.simulation.configurations``)
ROLES_CHOICES = ("best", "shift", "held")


def default_jobs() -> int:
    """A worker per CPU this process may use: the runs are CPU-bound, and a run beyond the
    CPUs (a climb's guess of what it reads next) slows the ones it will read for certain:
    a deployment's rules at Table 4's split, then a round of the climb's candidates."""
    return len(os.sched_getaffinity(0))


def role_scale(text: str) -> tuple[str, float]:
    """``ROLE=X``: an inference role and a factor > 0 (``--prior-itl-scale``)."""
    role, _, factor = text.partition("=")
    if role not in ("rollout", "reward"):
        raise argparse.ArgumentTypeError(f"want rollout=X or reward=X, not {text!r}")
    try:
        value = float(factor)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{role}: {factor!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{role}: the factor must be > 0, not {value}")
    return role, value


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` (and its flags) on the ``pivot`` command's subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="PivotRL vs colocated / disaggregated / rollout-reward colocated, simulated",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("config", help="a workload, e.g. configs/sim/qwen2.5-7b_qwen3-30b-a3b.toml")
    p.add_argument("--deployment", choices=DEPLOYMENTS, default="all")
    p.add_argument(
        "--gpus", type=positive, default=None, help="simulated devices (default 128, or --split's)"
    )
    p.add_argument(
        "--steps",
        type=positive,
        default=MEASURED_STEPS,
        help=f"measured RL steps per run, after the warm-up (default {MEASURED_STEPS})",
    )
    p.add_argument(
        "--warmup",
        type=non_negative,
        default=WARMUP_STEPS,
        help=f"warm-up steps per run, excluded from the throughput (default {WARMUP_STEPS})",
    )
    p.add_argument("--seed", type=non_negative, default=0)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object on stdout (each run's line still goes to stderr as it ends)",
    )
    p.add_argument("--run-dir", default=None, help="default runs/simulate/<workload>-<N>gpus-s<S>")
    p.add_argument(
        "--horizon", type=non_negative_float, default=None, help="planner horizon H in seconds"
    )
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
        help="horizon: H in 5..90 s; ablation: each mechanism off in turn; headroom: "
        "clusters that leave out prefill, re-prefill, batching or training costs, each in "
        "turn, then all of them",
    )
    p.add_argument("--no-sweep", action="store_true", help="baselines at Table 4's split only")
    p.add_argument(
        "--split",
        help="run one deployment at this split, not swept (e.g. shared32/pool96, RO16/RM64/TR48)",
    )
    p.add_argument(
        "--router",
        choices=ROUTER_CHOICES,
        default="best",
        help="how every deployment routes: best (of the paper's rules and round-robin, tried "
        "at Table 4's split and the sweep's best; default), paper, round_robin",
    )
    p.add_argument(
        "--roles",
        choices=ROLES_CHOICES,
        default="best",
        help="whether PivotRL's planner shifts devices between rollout and reward: best (both "
        "tried at Table 4's split, the better kept; default), shift, held (only the trainer "
        "pool is lent)",
    )
    p.add_argument(
        "--interval",
        type=positive_float,
        default=None,
        help="Controller planning period in seconds (default 1, the paper's)",
    )
    p.add_argument(
        "--prior-itl-scale",
        type=role_scale,
        action="append",
        default=[],
        metavar="ROLE=X",
        help="the planner's prior cost model is ROLE's true ITL times X (repeatable): "
        "a wrong prior for the online refit to correct",
    )
    p.add_argument(
        "--jobs",
        type=positive,
        default=None,
        help="worker processes for a comparison's runs: a deployment's configurations and a "
        "sweep's next candidates run side by side, the same result (default: one per CPU "
        "this process may use; "
        "1: one run at a time, in process)",
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
        headroom_study,
        horizon_study,
        pivot_settings,
    )
    from pivot.bus import configure_logging
    from pivot.deployment import DeploymentError
    from pivot.workload import load_workload

    started = time.perf_counter()
    configure_logging("warning")
    workload = load_workload(args.config)
    split = None
    if args.split is not None:
        try:
            split = _given_split(args, workload)
        except DeploymentError as exc:
            print(f"pivot simulate: --split {args.split}: {exc}", file=sys.stderr)
            return 2
    args.gpus = split.gpus if split is not None else args.gpus or 128
    try:
        deployments = _deployments(args, workload, split)
    except DeploymentError as exc:  # (a --split's were checked above)
        print(f"pivot simulate: --gpus {args.gpus}: {exc}", file=sys.stderr)
        return 2
    misplaced = _misplaced_flag(args, split, deployments)
    if misplaced is not None:
        print(f"pivot simulate: {misplaced}", file=sys.stderr)
        return 2
    planner: dict[str, Any] = {}
    if args.horizon is not None:
        planner["horizon_s"] = args.horizon
    for name in args.ablation:
        planner.update(ABLATIONS[name])
    rule = "paper" if args.router == "best" else args.router
    settings = SimulationSettings(
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        router=rule,
        prior_itl_scale=dict(args.prior_itl_scale),
    )
    if args.interval is not None:
        settings = msgspec.structs.replace(settings, controller_interval_s=args.interval)
    if args.roles == "held":
        planner["shift_roles"] = False
    if planner:
        settings = pivot_settings(settings, **planner)
    name = workload.config.name
    run_dir = make_dir(
        args.run_dir or f"runs/simulate/{name}-{args.gpus}gpus-s{args.seed}", "--run-dir"
    )
    journals = run_dir / "journals"

    def progress(line: str) -> None:
        # on stderr, with --json too: a default comparison runs for tens of minutes, and its
        # one JSON object is stdout's alone
        print(line, file=sys.stderr, flush=True)

    finished: list[Any] = []  # the runs done so far: what Ctrl-C leaves in the run dir

    def study_run(run: Any) -> None:
        finished.append(run)
        combined = run.bound_fractions().get("combined")
        bound = "" if combined is None else f", {combined:.3f} of the combined bound"
        progress(f"{run.label}: {run.samples_per_s:.3f} samples/s{bound}")

    # what was simulated, resolved (the workload with its defaults, the settings), for the report
    resolved = {
        "source": str(args.config),
        "workload": msgspec.to_builtins(workload.config),
        "settings": msgspec.to_builtins(settings),
        "gpus": args.gpus,
        "deployment": args.deployment,
        "study": args.study,
        "sweep": not args.no_sweep,
        "router": args.router,
        "roles": args.roles,
    }
    try:
        if args.study is not None:
            study = {
                "horizon": horizon_study,
                "ablation": ablation_study,
                "headroom": headroom_study,
            }[args.study]
            results = study(
                workload,
                args.gpus,
                settings,
                journal_dir=journals,
                on_run=study_run,
                split=split,
            )
            report = _study_report(args.study, results, args, name)
        else:
            deployments = None if args.deployment == "all" else [args.deployment]
            comparison = compare(
                workload,
                args.gpus,
                settings,
                deployments=deployments,
                sweep=not args.no_sweep,
                routers=ROUTER_RULES if args.router == "best" else None,
                roles=(True, False) if args.roles == "best" else None,
                journal_dir=journals,
                progress=progress,
                on_run=finished.append,
                jobs=args.jobs or default_jobs(),
                split=split,
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
            partial["warmup"] = args.warmup
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


def _deployments(args: argparse.Namespace, workload: Any, split: Any) -> dict[str, Any]:
    """Where each deployment the command runs starts, by kind: ``split``'s (``--split``), or
    at Table 4's split on ``--gpus`` devices PivotRL's (a study) or ``--deployment``'s. Planned
    here so that a device count that cannot hold one is named before anything runs
    (``DeploymentError``)."""
    from pivot.actors.simulation import simulation_deployment
    from pivot.deployment import table4_split

    if split is not None:
        splits = [split]
    else:
        if args.study is not None:
            kinds = [PIVOT]
        elif args.deployment == "all":
            kinds = list(KIND_NAMES)
        else:
            kinds = [args.deployment]
        sizes = workload.replica_sizes()
        splits = [table4_split(DeploymentKind(k), args.gpus, sizes) for k in kinds]
    return {s.kind.value: simulation_deployment(workload, s) for s in splits}


def _misplaced_flag(
    args: argparse.Namespace, split: Any, deployments: dict[str, Any]
) -> str | None:
    """A flag that none of this command's ``deployments`` takes, said in one line (None:
    none)."""
    if args.study == "horizon" and args.horizon is not None:
        return "--horizon: --study horizon runs PivotRL at each H of 5..90 s itself"
    runs = args.deployment if split is None else f"--split {split.label()}"
    pivot_only = {"--ablation": bool(args.ablation), "--roles": args.roles != "best"}
    for flag, given in pivot_only.items():
        if given and PIVOT not in deployments:
            return f"{flag} sets PivotRL's planner, and {runs} runs no PivotRL"
    controller = {
        "--horizon": args.horizon is not None,
        "--interval": args.interval is not None,
        "--prior-itl-scale": bool(args.prior_itl_scale),
    }
    for flag, given in controller.items():
        if given and not any(d.managed for d in deployments.values()):  # (0: no Controller)
            return f"{flag} is the Controller's, and {runs} runs no Controller"
    return None


def _given_split(args: argparse.Namespace, workload: Any) -> Any:
    """``--split``'s split, checked against the other flags and deployable for ``workload``
    (``DeploymentError`` says what is wrong: before anything runs)."""
    from pivot.actors.simulation import simulation_deployment
    from pivot.deployment import DeploymentError, DeploymentKind, parse_split

    split = parse_split(args.split)
    if args.gpus is not None and args.gpus != split.gpus:
        raise DeploymentError(f"its pools make {split.gpus} devices, --gpus says {args.gpus}")
    if args.study is not None and split.kind is not DeploymentKind.PIVOT:
        raise DeploymentError(f"--study {args.study} runs PivotRL, this is {split.kind.value}")
    if args.deployment not in ("all", split.kind.value):
        raise DeploymentError(f"it is {split.kind.value}, --deployment says {args.deployment}")
    simulation_deployment(workload, split)  # raises where the replicas do not fit
    return split


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

# what the report's numbers mean, stated in it
WINDOW = (
    "samples of the measured steps over the virtual seconds from the end of the last warm-up "
    "step to the end of the last step"
)
SWEEP = (
    "hill-climb over the sweep grid from Table 4's split (pools in eighths of the cluster, "
    "each up to all the devices the others leave), first better neighbour, every split in the "
    "full regime"
)


def _rate(result: Any) -> dict[str, float]:
    return {
        "samples_per_s": round(result.samples_per_s, 6),
        "tokens_per_s": round(result.tokens_per_s, 3),
    }


def _comparison_report(comparison: Any, args: argparse.Namespace) -> dict[str, Any]:
    throughput: dict[str, dict[str, float]] = {}
    splits: dict[str, dict[str, Any]] = {}
    deployments = dict(comparison.baselines)
    if comparison.pivot_runs is not None:
        deployments = {"pivot": comparison.pivot_runs, **deployments}
    used = {}
    for kind, runs in deployments.items():
        used[kind] = runs.best
        throughput[kind] = _rate(runs.best)
        first = runs.table4.label  # "table4", or "split" (--split)
        splits[kind] = {
            first: runs.table4.split.label(),
            f"{first}_samples_per_s": round(runs.table4.samples_per_s, 6),
            "best": runs.best.split.label(),
            "tried": runs.tried,
            "routers_tried": runs.routers_tried,
            "routers_tried_at_best": runs.routers_tried_at_best,
        }
    speedup = {k: round(v, 4) for k, v in comparison.speedups().items()}
    at_table4 = {k: round(v, 4) for k, v in comparison.speedups_at_table4().items()}
    pivot = comparison.pivot
    return {
        "workload": comparison.workload,
        "gpus": comparison.gpus,
        "steps": comparison.steps,
        "warmup": comparison.warmup,
        "seed": comparison.seed,
        "window": WINDOW,
        "sweep": SWEEP if not args.no_sweep else None,
        "routers": comparison.routers,
        "pivot_roles": (
            ("shifted" if comparison.pivot_shifts_roles else "held")
            if comparison.pivot is not None
            else None
        ),
        "throughput": throughput,
        "speedup": speedup,
        "speedup_pivot_at_table4": at_table4,
        "shifts_per_step": round(pivot.shifts_per_step, 3) if pivot is not None else None,
        "bound": {kind: run.bound_fractions() for kind, run in used.items()},
        "account": {kind: run.account_seconds() for kind, run in used.items()},
        "account_by_role": {kind: run.account_by_role() for kind, run in used.items()},
        "latency": {kind: run.latency() for kind, run in used.items()},
        "helpers": {kind: run.helpers() for kind, run in used.items()},
        "simulated_only": {
            kind: names for kind, run in used.items() if (names := run.simulated_only())
        },
        # the batch from which decoding counts as busy (the same batches: the same for all)
        "busy_from_batch": next(
            (dict(r.account.thresholds) for r in used.values() if r.account is not None), {}
        ),
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
        row["bound"] = r.bound_fractions()
        row["account"] = r.account_seconds()
        row["account_by_role"] = r.account_by_role()
        row["latency"] = r.latency()
        rows.append(row)
    return {
        "workload": name,
        "gpus": args.gpus,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "window": WINDOW,
        "study": study,
        # PivotRL's split: Table 4's, or --split's
        "split": results[0].split.label() if results else None,
        "results": rows,
    }


def _format(report: dict[str, Any], plots: list[Path]) -> str:
    lines = [
        f"pivot simulate: {report['workload']} on {report['gpus']} simulated devices, "
        f"{report['warmup']} warm-up + {report['steps']} measured steps, seed {report['seed']}",
        f"throughput: {report['window']}",
    ]
    rules = {
        kind: ", ".join(f"{role} {rule}" for role, rule in sorted(r.items()))
        for kind, r in report.get("routers", {}).items()
    }
    if len(set(rules.values())) == 1:
        lines.append(f"routing: every deployment, {next(iter(rules.values()))}")
    else:
        lines.extend(f"routing: {kind}, {rule}" for kind, rule in rules.items())
    if report.get("pivot_roles"):
        lines.append(f"PivotRL's rollout/reward split: {report['pivot_roles']}")
    if "study" in report:
        lines.append(f"PivotRL at {report['split']}")
        lines.append(
            f"{'run':<20}{'samples/s':>11}{'tokens/s':>12}{'shifts/step':>13}{'shift s':>9}"
            f"{'migrated':>10}{'work':>7}{'path':>7}{'bound':>7}"
        )
        for row in report["results"]:
            m, b = row["migration"], row["bound"]
            lines.append(
                f"{row['label']:<20}{row['samples_per_s']:>11.3f}{row['tokens_per_s']:>12.0f}"
                f"{row['shifts_per_step']:>13.2f}{m['shift_s']:>9.1f}{m['aborted']:>10}"
                + "".join(
                    f"{b[k]:>7.3f}" if k in b else f"{'-':>7}"
                    for k in ("work", "critical_path", "combined")
                )
            )
    else:
        lines.append(
            f"{'deployment':<15}{'run':<8}{'split':<20}{'samples/s':>10}{'tokens/s':>10}"
            f"{'s/step':>8}{'shifts/step':>12}{'shift s':>9}{'migrated':>9}{'reprefill s':>12}"
            f"{'warm-up/s':>10}"
        )
        for run in report["runs"]:
            m = run["migration"]
            steps = max(report["steps"], 1)
            lines.append(
                f"{run['deployment']:<15}{run['label']:<8}{run['split']:<20}"
                f"{run['samples_per_s']:>10.3f}{run['tokens_per_s']:>10.0f}"
                f"{run['seconds'] / steps:>8.1f}{run['shifts_per_step']:>12.2f}"
                f"{m['shift_s']:>9.1f}{m['aborted']:>9}{m['reprefill_s']:>12.1f}"
                f"{run['warmup']['samples_per_s']:>10.3f}"
            )
        if report["speedup"]:
            parts = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(report["speedup"].items()))
            lines.append(f"PivotRL speedup over the better split of each baseline: {parts}")
            at_table4 = report.get("speedup_pivot_at_table4") or {}
            if at_table4:
                parts = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(at_table4.items()))
                lines.append(f"  (PivotRL at Table 4's trainer pool, not swept: {parts})")
        lines.extend(_bounds_table(report.get("bound") or {}, report.get("account") or {}))
        lines.extend(_role_table(report.get("account_by_role") or {}, report.get("account") or {}))
        lines.extend(_latency_table(report.get("latency") or {}))
        lines.extend(_helper_lines(report.get("helpers") or {}))
        lines.extend(_simulated_only_lines(report.get("simulated_only") or {}))
        busy_from = report.get("busy_from_batch") or {}
        if busy_from:
            from pivot.bounds import NEAR_EFFICIENT

            parts = ", ".join(f"{role} {n}" for role, n in sorted(busy_from.items()))
            lines.append(
                f"  busy: decoding at least {parts} sequences a replica (at least "
                f"{NEAR_EFFICIENT:.0%} of the efficient batch's tokens/s per device); "
                "under: fewer"
            )
    lines.append(f"run directory: {report['run_dir']}")
    for plot in plots:
        lines.append(f"  {'report' if plot.suffix == '.html' else 'plot'}: {plot}")
    if report["wall_s"] is not None:
        lines.append(f"wall time: {report['wall_s']:.1f} s")
    return "\n".join(lines)


def _bounds_table(bounds: dict[str, dict], accounts: dict[str, dict]) -> list[str]:
    """Each deployment's fraction of the bounds and its time account (% of device time)."""
    from pivot.account import ACCOUNT

    if not any(bounds.values()):
        return []
    short = {
        "busy": "busy",
        "under_filled": "under",
        "re_prefilling": "reprefill",
        "idle": "idle",
        "stalled_on_trainer": "stalled",
        "trainer_waiting": "tr.wait",
        "training": "train",
        "in_transit": "transit",
    }
    lines = [
        "fraction of the bounds (work-conserving, critical-path, combined) and the time "
        "account (% of device time):",
        f"{'deployment':<15}{'work':>7}{'path':>7}{'comb':>7}"
        + "".join(f"{short[k]:>10}" for k in ACCOUNT),
    ]
    for kind, b in bounds.items():
        if not b:
            continue
        seconds = accounts.get(kind) or {}
        whole = sum(seconds.values()) or 1.0
        lines.append(
            f"{kind:<15}{b['work']:>7.2f}{b['critical_path']:>7.2f}{b['combined']:>7.2f}"
            + "".join(f"{100 * seconds.get(k, 0.0) / whole:>10.1f}" for k in ACCOUNT)
        )
    return lines


def _role_table(by_role: dict[str, dict], accounts: dict[str, dict]) -> list[str]:
    """Each deployment's engine time by inference role (% of device time) and the mean batch
    each role decoded at (``RunResult.account_by_role``)."""
    if not any(by_role.values()):
        return []
    lines = [
        "engine time by role (% of device time) and the batch it decoded at (mean sequences "
        "a replica):",
        f"{'deployment':<15}{'role':<9}{'busy':>8}{'under':>8}{'reprefill':>10}{'batch':>8}",
    ]
    for kind, roles in by_role.items():
        whole = sum((accounts.get(kind) or {}).values()) or 1.0
        for role, t in roles.items():
            lines.append(
                f"{kind:<15}{role:<9}{100 * t['busy'] / whole:>8.1f}"
                f"{100 * t['under_filled'] / whole:>8.1f}{100 * t['re_prefilling'] / whole:>10.1f}"
                f"{t['decode_batch']:>8.1f}"
            )
    return lines


def _latency_table(latencies: dict[str, dict]) -> list[str]:
    """Each deployment's mean step from its batch's admission, beside the critical path's
    terms (``RunResult.latency``)."""
    if not any(latencies.values()):
        return []
    lines = [
        "a step from its batch's admission (mean s): to its last response, to training, "
        "training, to trained; the bound's longest chain alone and training on every device:",
        f"{'deployment':<15}{'rollout':>9}{'to train':>9}{'train':>9}{'step':>9}"
        f"{'chain':>9}{'train*':>9}",
    ]
    keys = ("rollout_s", "until_training_s", "train_s", "step_s", "chain_s", "train_bound_s")
    for kind, t in latencies.items():
        if not t:
            continue
        # a run without drawn batches has no bound: its terms show as "-", not as 0 s
        lines.append(
            f"{kind:<15}" + "".join(f"{t[k]:>9.1f}" if k in t else f"{'-':>9}" for k in keys)
        )
    critical = {kind: t for kind, t in latencies.items() if "critical_response_s" in t}
    if critical:
        lines += [
            "the step's sample scored last (mean s): its rollout and its judgment, each beside "
            "the same alone, and of the judgment its wait in the reward queue:",
            f"{'deployment':<15}{'rollout':>9}{'alone':>9}{'judgment':>9}{'alone':>9}{'queued':>9}",
        ]
        keys = (
            "response_s",
            "response_alone_s",
            "judgment_s",
            "judgment_alone_s",
            "judgment_queued_s",
        )
        for kind, t in critical.items():
            lines.append(f"{kind:<15}" + "".join(f"{t['critical_' + k]:>9.1f}" for k in keys))
    return lines


def _helper_lines(helpers: dict[str, dict]) -> list[str]:
    """Each deployment's gradient helpers per measured step (``RunResult.helpers``)."""
    lines = []
    for kind, roles in helpers.items():
        if roles:
            parts = "; ".join(
                f"{role} {h['joins']:.1f} joined, {h['devices']:.1f} devices"
                for role, h in roles.items()
            )
            lines.append(
                f"{kind} gradient helpers per step (devices: added over its training): {parts}"
            )
    return lines


def _simulated_only_lines(simulated_only: dict[str, list[str]]) -> list[str]:
    """What a deployment's figures owe to the simulated backend alone (``simulated_only``:
    gradient helpers, the one such mechanism today)."""
    return [
        f"  {kind}'s figures include its gradient helpers, which only the simulated trainer "
        "takes on GPUs (the DeepSpeed trainer takes them on CPU only): --ablation "
        "no-gradient-helpers runs it without them"
        for kind, names in simulated_only.items()
        if "gradient_helpers" in names
    ]


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
