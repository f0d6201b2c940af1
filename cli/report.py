"""`pivot report RUN_DIR [-o FILE]`: a run directory as one self-contained HTML file.

It reads what the run left: for `pivot run`, ``metrics.jsonl`` (step records),
``summary.json`` (the measured time account), ``timeline.jsonl`` (throughput samples and
shifts), ``config.toml``, ``shift.journal``, ``actors.log`` (replicas removed and sequences
requeued) and ``events.jsonl`` when the job wrote one; for `pivot simulate`, its
``metrics.jsonl`` (run, step, sample, shift and train records of every simulated run) and
``summary.json``. The page holds the Figure-10-style throughput plot with its lane strip, the
reward curve (accuracy, eval and loss when recorded), shift statistics by kind and phase,
migration costs, a simulated run's fraction of the physical bounds, the time account (a real
run's measured one), the step table and the resolved config; plots are embedded PNGs, so the
file can be mailed or archived alone.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import statistics
import sys
from pathlib import Path
from typing import Any

REPORT_NAME = "report.html"
# `pivot simulate`'s printed report, kept in its run dir; `pivot run`'s whole-run figures
SUMMARY_NAME = "summary.json"


class ReportError(Exception):
    """RUN_DIR is not a run directory this command can read; the message says why."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report",
        help="a run directory (pivot run or pivot simulate) as one self-contained HTML file",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("-o", "--output", default=None, help=f"default RUN_DIR/{REPORT_NAME}")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    try:
        path = write_report(args.run_dir, args.output)
    except ReportError as exc:
        print(f"pivot report: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def write_report(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """Read ``run_dir`` and write its report (default ``run_dir/report.html``)."""
    run_dir = Path(run_dir)
    runs, config, kind = read_run_dir(run_dir)
    html = render(run_dir, runs, config, kind)
    out = Path(output) if output is not None else run_dir / REPORT_NAME
    try:
        out.write_text(html, encoding="utf-8")
    except OSError as exc:
        raise ReportError(f"{out}: cannot write it ({exc.strerror})") from None
    return out


# --- reading a run directory ------------------------------------------------------------------


class RunData:
    """One run's records, as the report needs them (a simulate dir holds several)."""

    def __init__(self, name: str) -> None:
        from pivot.timeline import RoleSample, ShiftMark, TrainSpan

        self.name = name
        self.steps: list[dict[str, Any]] = []
        self.samples: list[RoleSample] = []
        self.shifts: list[ShiftMark] = []
        self.trains: list[TrainSpan] = []
        self.initial: dict[str, int] | None = None  # the allocation before the first shift
        self.fixed: dict[str, int] = {}  # devices no shift moves
        self.migration: dict[str, Any] = {}  # what moving devices cost, as recorded
        self.bound: dict[str, float] = {}  # fraction of each physical bound (simulated runs)
        self.account: dict[str, float] = {}  # device-seconds per time-account category
        self.account_by_role: dict[str, dict[str, float]] = {}  # role -> its engine time
        self.summary: dict[str, Any] = {}  # a simulated run's own numbers
        self.notes: list[str] = []  # how a figure was derived, where it is an estimate


def _json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # a run killed mid-write leaves a torn last line; anything else is not a run's file
            if n == len(lines):
                continue
            raise ReportError(f"{path}: line {n} is not JSON") from None
        if isinstance(record, dict):
            out.append(record)
    return out


def read_run_dir(run_dir: Path) -> tuple[list[RunData], str, str]:
    """The runs of ``run_dir``, its resolved config's text and its kind (run | simulate)."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run directory")
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ReportError(f"{run_dir}: not a run directory (no metrics.jsonl)")
    records = _json_lines(metrics)
    if any("record" in r for r in records):
        return _read_simulate(run_dir, records), _simulate_config(run_dir), "simulate"
    config = run_dir / "config.toml"
    text = config.read_text(encoding="utf-8") if config.is_file() else ""
    return [_read_pivot_run(run_dir, records, config)], text, "run"


def _read_simulate(run_dir: Path, records: list[dict[str, Any]]) -> list[RunData]:
    import msgspec

    from pivot.timeline import RoleSample, ShiftMark, TrainSpan

    runs: dict[str, RunData] = {}
    for r in records:
        name = r.get("run", "run")
        run = runs.setdefault(name, RunData(name))
        fields = {k: v for k, v in r.items() if k not in ("record", "run")}
        match r.get("record"):
            case "run":
                run.summary = fields
                run.migration = dict(fields.get("migration", {}))
                run.bound = dict(fields.get("bound") or {})
                run.account = dict(fields.get("account") or {})
                run.account_by_role = dict(fields.get("account_by_role") or {})
            case "step":
                run.steps.append(fields)
            case "sample":
                run.samples.append(msgspec.convert(fields, RoleSample))
            case "shift":
                run.shifts.append(msgspec.convert(fields, ShiftMark))
            case "train":
                run.trains.append(msgspec.convert(fields, TrainSpan))
    return list(runs.values())


def _simulate_config(run_dir: Path) -> str:
    """What was simulated: the workload with its defaults and the settings (summary.json's
    ``resolved``), as indented JSON."""
    summary = run_dir / SUMMARY_NAME
    if not summary.is_file():
        return ""
    try:
        resolved = json.loads(summary.read_text(encoding="utf-8")).get("resolved", {})
    except (json.JSONDecodeError, AttributeError):
        return ""
    return json.dumps(resolved, indent=1, sort_keys=True)


def _read_pivot_run(run_dir: Path, records: list[dict[str, Any]], config: Path) -> RunData:
    import msgspec

    from pivot.timeline import ShiftMark, TimelineRecord, TrainSpan

    run = RunData(run_dir.name)
    run.steps = [r for r in records if r.get("type") == "step"]
    summary = run_dir / SUMMARY_NAME
    if summary.is_file():  # the measured time account (a resumed run's: its last start's)
        with contextlib.suppress(json.JSONDecodeError, AttributeError, TypeError):
            account = json.loads(summary.read_text(encoding="utf-8")).get("account") or {}
            run.account = dict(account.get("seconds") or {})
            run.account_by_role = dict(account.get("roles") or {})
    timeline = run_dir / "timeline.jsonl"
    if timeline.is_file():
        decoder = msgspec.json.Decoder(TimelineRecord)
        for line in timeline.read_bytes().splitlines():
            try:
                record = decoder.decode(line)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue  # a torn last line of a killed run
            (run.shifts if isinstance(record, ShiftMark) else run.samples).append(record)
    run.initial, run.fixed = _config_allocation(config)
    events = _read_events(run_dir)
    maps = [e for e in events if e.get("type") == "devices" and isinstance(e.get("roles"), dict)]
    if maps:  # the job's own first device map beats one worked out from its config
        counts: dict[str, int] = {}
        for role in maps[0]["roles"].values():
            counts[role] = counts.get(role, 0) + 1
        run.initial = counts
    step_ends = {e["step"]: e["t"] for e in events if e.get("type") == "step" and "step" in e}
    if step_ends:
        origin_note = "training intervals placed by the events' step times"
        ends = {s["step"]: step_ends.get(s["step"]) for s in run.steps}
    else:
        # the Driver's clock is not the timeline's: line the first step's submission up with
        # the first rollout demand the Monitor saw
        demand = [s.t for s in run.samples if s.role == "rollout" and s.outstanding > 0]
        ends = {}
        if demand and run.steps:
            offset = run.steps[0]["started_s"] - demand[0]
            ends = {s["step"]: s["started_s"] + s["seconds"] - offset for s in run.steps}
        origin_note = (
            "training intervals placed by lining the first step up with the first rollout "
            "demand (no events.jsonl)"
        )
    for s in run.steps:
        end = ends.get(s["step"])
        if s.get("train") and end is not None:
            run.trains.append(
                TrainSpan(start=end - s["train_s"], end=end, version=s["policy_version"] + 1)
            )
    if run.trains:
        run.notes.append(origin_note)
    run.migration = _run_migration(run_dir, run.shifts)
    return run


def _read_events(run_dir: Path) -> list[dict[str, Any]]:
    from pivot.events import EVENTS_FILE

    path = run_dir / EVENTS_FILE
    return _json_lines(path) if path.is_file() else []


def _config_allocation(config: Path) -> tuple[dict[str, int] | None, dict[str, int]]:
    """The allocation a `pivot run` started with and its fixed devices, from its resolved
    config (None, {}: the config is missing or no longer reads)."""
    if not config.is_file():
        return None, {}
    from pivot.config import ConfigError, load_toml
    from pivot.job import JobConfig

    try:
        deployment = load_toml(config, JobConfig).plan()
    except (ConfigError, ValueError):
        return None, {}
    return starting_allocation(deployment)


def starting_allocation(deployment: Any) -> tuple[dict[str, int], dict[str, int]]:
    """Devices per role a deployment (``pivot.deployment.Deployment``) starts with, and those
    the Controller never moves (a trainer pool that is not lent)."""
    from pivot.cluster import Role

    ranks = len(deployment.trainer_devices)
    allocation: dict[str, int] = {"training": ranks}
    for device in deployment.agent_devices:
        placed = deployment.placement(device)
        if placed is not None and placed.role is not Role.TRAINING:
            allocation[placed.role.value] = allocation.get(placed.role.value, 0) + 1
    return allocation, ({} if deployment.lends_trainer else {"training": ranks})


def _run_migration(run_dir: Path, shifts: list[Any]) -> dict[str, Any]:
    """What `pivot run` records of migration: the schedulers' ``replica removed`` lines in
    actors.log (sequences requeued to run elsewhere, finished before the abort), the
    journal's planned migrations and the shifts' ``aborted`` phase seconds."""
    out: dict[str, Any] = {
        "shifts": len(shifts),
        "shift_s": round(sum(m.seconds for m in shifts), 3),
        "aborted_phase_s": round(sum(m.phase_s.get("aborted", 0.0) for m in shifts), 3),
    }
    log = run_dir / "actors.log"
    if log.is_file():
        removed = requeued = completed = 0
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            if '"replica removed"' not in line:
                continue
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            removed += 1
            requeued += int(e.get("requeued", 0))
            completed += int(e.get("completed", 0))
        out |= {
            "replicas_removed": removed,
            "requeued": requeued,
            "completed_before_abort": completed,
        }
    if (run_dir / "shift.journal").is_file():
        from pivot.cli.journal import read_journal
        from pivot.config import ConfigError
        from pivot.shift import ShiftPlanned

        try:
            journal, _ = read_journal(run_dir)
        except ConfigError:
            journal = []
        plans = [r for r in journal if isinstance(r, ShiftPlanned)]
        out |= {
            "planned": len(plans),
            "planned_migrations": sum(len(p.plan.migrations) for p in plans),
        }
    return out


#: what each migration figure means (a simulated run's ``MigrationCost``; `pivot run`'s own)
MIGRATION_LABELS = {
    "shifts": "shifts finished",
    "shift_s": "seconds shifting (planned to done, summed)",
    "trainer_s": "of which offloading and reloading the trainer (s)",
    "aborted": "sequences aborted (taken off a replica)",
    "reprefills": "dispatches that re-prefilled a partial output",
    "reprefill_tokens": "tokens re-prefilled",
    "reprefill_s": "seconds re-prefilling (replica time)",
    "aborted_phase_s": "seconds in the shifts' abort phase (summed)",
    "replicas_removed": "replicas removed from a scheduler (actors.log)",
    "requeued": "sequences requeued to run elsewhere (aborted)",
    "completed_before_abort": "sequences finished on their replica before its abort",
    "planned": "shift transactions planned (shift.journal)",
    "planned_migrations": "sequence migrations planned (rebalancing)",
}


# --- statistics -------------------------------------------------------------------------------


def _p90(values: list[float]) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def shift_stats(shifts: list[Any]) -> list[dict[str, Any]]:
    """Per shift kind, its seconds and each phase's (``phase_s``): count, median, p90."""
    rows = []
    kinds = sorted({m.kind for m in shifts})
    for kind in kinds:
        marks = [m for m in shifts if m.kind == kind]
        columns = [("total", [m.seconds for m in marks])]
        phases: list[str] = []
        for m in marks:
            phases += [p for p in m.phase_s if p not in phases]
        columns += [(p, [m.phase_s[p] for m in marks if p in m.phase_s]) for p in phases]
        for phase, values in columns:
            rows.append(
                {
                    "kind": kind,
                    "phase": phase,
                    "count": len(values),
                    "median": statistics.median(values),
                    "p90": _p90(values),
                }
            )
    return rows


def step_rows(steps: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The step table: a `pivot run`'s step records or a simulated run's."""

    def num(v: Any, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    if steps and "scores" in steps[0]:
        head = ["step", "policy", "reward", "accuracy", "failed", "loss", "grad norm", "lr"]
        head += ["train s", "step s", "rollout s", "samples/s", "tokens/s", "eval"]
        rows = []
        for s in steps:
            sc, tr, ev = s["scores"], s.get("train") or {}, s.get("eval")
            rows.append(
                [
                    str(s["step"]),
                    f"v{s['policy_version']}",
                    num(sc.get("reward_mean"), ".3f"),
                    num(sc.get("accuracy"), ".3f"),
                    str(sc.get("reward_failures", 0) or ""),
                    num(tr.get("loss"), "+.4f"),
                    num(tr.get("grad_norm"), ".3g"),
                    num(tr.get("lr"), ".2e"),
                    num(s.get("train_s"), ".2f"),
                    num(s.get("seconds"), ".2f"),
                    num(s.get("rollout_s"), ".2f"),
                    num(s.get("samples_per_s"), ".1f"),
                    num(s.get("tokens_per_s"), ".0f"),
                    num(ev["scores"].get("reward_mean"), ".3f") if ev else "",
                ]
            )
        return head, rows
    head = ["step", "started s", "step s", "rollout s", "train s", "samples", "tokens"]
    rows = [
        [
            str(s["step"]),
            num(s.get("started_s"), ".1f"),
            num(s.get("seconds"), ".2f"),
            num(s.get("rollout_s"), ".2f"),
            num(s.get("train_s"), ".2f"),
            str(s.get("samples", "")),
            str(s.get("tokens", "")),
        ]
        for s in steps
    ]
    return head, rows


# --- figures ----------------------------------------------------------------------------------


def _png(fig: Any) -> str:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def throughput_png(run: RunData, title: str) -> str:
    from pivot.cli.plot import figure

    fig = figure(
        run.samples, run.shifts, run.trains, title=title, initial=run.initial, fixed=run.fixed
    )
    return _png(fig)


def reward_png(steps: list[dict[str, Any]]) -> str | None:
    """Reward per step, with accuracy and eval where recorded, and the loss beneath."""
    if not steps or "scores" not in steps[0]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = [
        (s["step"], s["train"]["loss"])
        for s in steps
        if (s.get("train") or {}).get("loss") is not None
    ]
    fig, axes = plt.subplots(
        2 if losses else 1,
        1,
        sharex=True,
        figsize=(10, 5 if losses else 3),
        constrained_layout=True,
        squeeze=False,
    )
    ax = axes[0][0]
    for key, label in (("reward_mean", "reward"), ("accuracy", "accuracy")):
        points = [(s["step"], s["scores"][key]) for s in steps if s["scores"].get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", ms=3, label=label)
    for key, label in (("reward_mean", "eval reward"), ("accuracy", "eval accuracy")):
        points = [
            (s["step"], s["eval"]["scores"][key])
            for s in steps
            if s.get("eval") and s["eval"]["scores"].get(key) is not None
        ]
        if points:
            ax.plot(*zip(*points, strict=True), marker="s", ls="--", label=label)
    ax.set_ylabel("per step")
    ax.legend(fontsize=8)
    if losses:
        axes[1][0].plot(*zip(*losses, strict=True), color="black", marker="o", ms=3)
        axes[1][0].set_ylabel("loss")
    axes[-1][0].set_xlabel("step")
    return _png(fig)


# --- the page ---------------------------------------------------------------------------------

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>pivot report: {{ title }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
th { background: #f2f2f2; }
td.l, th.l { text-align: left; }
img { max-width: 100%; }
pre { background: #f7f7f7; padding: 1em; overflow-x: auto; font-size: 0.85em; }
.note { color: #666; font-size: 0.9em; }
</style></head><body>
<h1>pivot report: {{ title }}</h1>
<p>{{ kind_line }}</p>
{% for run in runs %}
<section>
<h2>{{ run.name }}</h2>
{% if run.summary %}<p>{% for k, v in run.summary.items() %}{{ k }} <b>{{ v }}</b>{% if not loop.last %}; {% endif %}{% endfor %}</p>{% endif %}
<h3>Throughput and allocation</h3>
<img alt="throughput of {{ run.name }}" src="data:image/png;base64,{{ run.throughput }}">
<p class="note">Curves: trailing mean (window in the plot's title), raw samples faint. Lane
strip: devices per role over time as stacked bands; ticks above it: one per shift, by kind.
{% for n in run.notes %}{{ n }}. {% endfor %}</p>
{% if run.reward %}<h3>Reward</h3>
<img alt="reward of {{ run.name }}" src="data:image/png;base64,{{ run.reward }}">{% endif %}
<h3>Shifts</h3>
{% if run.shift_stats %}<table><tr><th class="l">kind</th><th class="l">phase</th><th>count</th><th>median s</th><th>p90 s</th></tr>
{% for r in run.shift_stats %}<tr><td class="l">{{ r.kind }}</td><td class="l">{{ r.phase }}</td><td>{{ r.count }}</td><td>{{ "%.3f"|format(r.median) }}</td><td>{{ "%.3f"|format(r.p90) }}</td></tr>
{% endfor %}</table>
<p class="note">total: planned to done; a phase: the seconds since the phase before (ShiftMark.phase_s).</p>
{% else %}<p>no shifts</p>{% endif %}
<h3>Migration costs</h3>
{% if run.migration %}<table>{% for k, v in run.migration.items() %}<tr><th class="l">{{ labels.get(k, k) }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
{% if run.kind == "run" %}<p class="note">pivot run records no per-sequence re-prefill time; pivot simulate does.</p>{% endif %}{% else %}<p>none recorded</p>{% endif %}
{% if run.bound or run.account %}<h3>{{ "Bounds and time account" if run.bound else "Time account" }}</h3>{% endif %}
{% if run.bound %}<table><tr><th class="l">fraction of the bound</th><th>work-conserving</th><th>critical path</th><th>combined</th></tr>
<tr><td class="l">this run</td><td>{{ "%.3f"|format(run.bound.work) }}</td><td>{{ "%.3f"|format(run.bound.critical_path) }}</td><td>{{ "%.3f"|format(run.bound.combined) }}</td></tr></table>{% endif %}
{% if run.account %}<table><tr><th class="l">device time</th><th>device-s</th><th>%</th></tr>
{% for k, v in run.account.items() %}<tr><td class="l">{{ k }}</td><td>{{ "%.1f"|format(v) }}</td><td>{{ "%.1f"|format(100 * v / run.account_total) }}</td></tr>
{% endfor %}</table>{% endif %}
{% if run.account_by_role %}<table><tr><th class="l">engine time by role</th><th>busy</th><th>under-filled</th><th>re-prefilling</th><th>mean decode batch</th></tr>
{% for role, t in run.account_by_role.items() %}<tr><td class="l">{{ role }}</td><td>{{ "%.1f"|format(t.busy) }}</td><td>{{ "%.1f"|format(t.under_filled) }}</td><td>{{ "%.1f"|format(t.re_prefilling) }}</td><td>{{ "%.1f"|format(t.decode_batch) }}</td></tr>
{% endfor %}</table>{% endif %}
{% if run.bound %}<p class="note">Bound time over the run's time for the same steps (pivot.bounds); the account sums to devices x the same window (pivot.account says what each category holds).</p>
{% elif run.account %}<p class="note">Measured: the devices' time from the first step's submission to the last step's end, summing to devices x that window (pivot.account says what each category holds).</p>{% endif %}
<h3>Steps</h3>
<table class="steps"><tr>{% for h in run.step_head %}<th>{{ h }}</th>{% endfor %}</tr>
{% for row in run.step_rows %}<tr>{% for c in row %}<td>{{ c }}</td>{% endfor %}</tr>
{% endfor %}</table>
</section>
{% endfor %}
<h2>{{ config_title }}</h2>
{% if config %}<pre>{{ config }}</pre>{% else %}<p>not recorded</p>{% endif %}
</body></html>
"""


def render(run_dir: Path, runs: list[RunData], config: str, kind: str) -> str:
    import jinja2

    pages = []
    for run in runs:
        head, rows = step_rows(run.steps)
        pages.append(
            {
                "name": run.name,
                "summary": {
                    k: v
                    for k, v in run.summary.items()
                    if k not in ("migration", "bound", "account", "account_by_role")
                },
                "throughput": throughput_png(run, f"{run_dir.name}: {run.name}"),
                "reward": reward_png(run.steps),
                "shift_stats": shift_stats(run.shifts),
                "migration": run.migration,
                "bound": run.bound,
                "account": run.account,
                "account_total": sum(run.account.values()) or 1.0,
                "account_by_role": run.account_by_role,
                "step_head": head,
                "step_rows": rows,
                "notes": run.notes,
                "kind": kind,
            }
        )
    steps = sum(len(r.steps) for r in runs)
    kind_line = (
        f"pivot run: {steps} steps recorded, {sum(len(r.shifts) for r in runs)} shifts; run dir {run_dir}"
        if kind == "run"
        else f"pivot simulate: {len(runs)} simulated runs; run dir {run_dir}"
    )
    env = jinja2.Environment(autoescape=True, undefined=jinja2.StrictUndefined)
    return env.from_string(TEMPLATE).render(
        title=run_dir.name,
        kind_line=kind_line,
        runs=pages,
        labels=MIGRATION_LABELS,
        config=config,
        config_title="Resolved config" if kind == "run" else "What was simulated",
    )
