"""``pivot simulate`` end to end on the toy workload: the comparison it prints, the run
directory it writes, and the same bytes for the same arguments."""

from __future__ import annotations

import argparse
import json
import re

import pytest
from toy import toy_workload

from pivot.cli import simulate


def _run(argv: list[str], capsys, err: list[str] | None = None) -> str:
    """stdout; ``err`` gets stderr's lines."""
    parser = argparse.ArgumentParser(prog="pivot")
    sub = parser.add_subparsers(dest="command", required=True)
    simulate.add_parser(sub)
    args = parser.parse_args(["simulate", *argv])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    if err is not None:
        err.extend(captured.err.splitlines())
    return captured.out


def test_json_comparison_is_the_same_bytes_for_the_same_seed(tmp_path, capsys):
    toy_workload(tmp_path, prompts=2, samples=4, sigma=0.8, response=200, per_running=0.005)
    argv = [str(tmp_path / "toy.toml"), "--gpus", "8", "--steps", "1", "--warmup", "1"]
    argv += ["--json", "--no-wall", "--no-plot", "--run-dir", str(tmp_path / "run")]
    progress: list[str] = []
    first = _run(argv, capsys, progress)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    second = _run(argv, capsys)
    assert first == second
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics
    report = json.loads(first)
    assert set(report["throughput"]) == {"pivot", "colocated", "disaggregated", "rr-colocated"}
    # stdout is the JSON object alone; how the runs went is said on stderr as they end
    for kind in report["throughput"]:
        table4 = report["splits"][kind]["table4"]
        line = f"{kind} {table4} (table 4): "
        said = [x for x in progress if x.startswith(line)]
        rate = report["splits"][kind]["table4_samples_per_s"]
        assert said == [f"{line}{rate:.3f} samples/s"], (kind, progress)
    for rates in report["throughput"].values():
        assert rates["samples_per_s"] > 0 and rates["tokens_per_s"] > 0
    assert set(report["speedup"]) == {"colocated", "disaggregated", "rr-colocated"}
    best = report["splits"]["disaggregated"]
    # the speedup is against the better of Table 4's split and the sweep's
    table4 = best["table4_samples_per_s"]
    assert report["throughput"]["disaggregated"]["samples_per_s"] >= table4
    pivot = report["throughput"]["pivot"]["samples_per_s"]
    assert report["speedup"]["disaggregated"] == pytest.approx(
        pivot / report["throughput"]["disaggregated"]["samples_per_s"], rel=1e-3
    )
    # the sweep's hill-climb starts at Table 4's split; every run is in the same regime
    assert best["tried"][0]["split"] == best["table4"] and report["wall_s"] is None
    assert {(r["measured_steps"], r["warmup"]["steps"]) for r in report["runs"]} == {(1, 1)}
    # the routers are stated, per deployment and per run: each deployment, pivot too, keeps
    # the rule its best split ran fastest with (each rule is tried at Table 4's split, and
    # again at the sweep's best when that is another; a tie keeps the rule kept before: the
    # first tried at Table 4's split, the one the sweep ran with at its best). PivotRL tries
    # each rule with its rollout/reward split shifted and held, and keeps the way too.
    paper = {"rollout": "throughput_optimal", "reward": "lowest_itl"}
    rules = {"paper": paper, "round_robin": {"rollout": "round_robin", "reward": "round_robin"}}
    held = {f"{rule}, roles held": rule for rule in rules}
    for kind in ("pivot", "colocated", "disaggregated", "rr-colocated"):
        tried = report["splits"][kind]["routers_tried"]
        assert set(tried) == (set(rules) | set(held) if kind == "pivot" else set(rules))
        assert report["splits"][kind]["table4_samples_per_s"] == max(tried.values())
        order = list(tried)
        kept = max(tried, key=lambda r: (tried[r], -order.index(r)))
        at_best = report["splits"][kind]["routers_tried_at_best"]
        if report["splits"][kind]["best"] != report["splits"][kind]["table4"]:
            # the other rules again, the way kept: the climb ran with it
            assert set(at_best) == (set(held) if kept in held else set(rules))
            best = report["throughput"][kind]["samples_per_s"]
            assert best == pytest.approx(max(at_best.values()), rel=1e-6)
            kept = max(at_best, key=lambda r, swept=kept: (at_best[r], r == swept))
        else:
            assert at_best == {}
        assert report["routers"][kind] == rules[held.get(kept, kept)]
        if kind == "pivot":
            assert report["pivot_roles"] == ("held" if kept in held else "shifted")
    runs = {r["deployment"]: r["routers"] for r in report["runs"]}
    assert runs == report["routers"]
    # pivot: the better of Table 4's trainer pool and the swept one, both reported
    mine = report["splits"]["pivot"]
    assert len(mine["tried"]) >= 1 and pivot >= mine["table4_samples_per_s"]
    for kind, at_table4 in report["speedup_pivot_at_table4"].items():
        assert at_table4 == pytest.approx(
            mine["table4_samples_per_s"] / report["throughput"][kind]["samples_per_s"], rel=1e-3
        )
    kinds = {json.loads(line)["record"] for line in metrics.splitlines()}
    assert kinds == {"run", "step", "sample", "shift", "train"}
    # each deployment's run: its fraction of each bound, and its time account summing to
    # devices x its window (the run the throughput names: same samples/s)
    deployments = set(report["throughput"])
    assert set(report["bound"]) == set(report["account"]) == deployments
    runs = {(r["deployment"], r["samples_per_s"]): r for r in report["runs"]}
    for kind, fractions in report["bound"].items():
        assert set(fractions) == {"work", "critical_path", "combined"}
        assert 0 < fractions["combined"] <= 1
        assert fractions["combined"] == max(fractions["work"], fractions["critical_path"])
        run = runs[(kind, report["throughput"][kind]["samples_per_s"])]
        assert run["bound"] == fractions and run["account"] == report["account"][kind]
        assert sum(run["account"].values()) == pytest.approx(8 * run["bound_window_s"], abs=1.0)
        assert run["bound_window_s"] >= run["seconds"]  # from the first measured step's start
        # its engine's time by role: both roles decoded, together the account's engine time
        roles = run["account_by_role"]
        assert roles == report["account_by_role"][kind] and set(roles) == {"rollout", "reward"}
        for category in ("busy", "under_filled", "re_prefilling"):
            together = sum(r[category] for r in roles.values())
            assert together == pytest.approx(run["account"][category], abs=0.2)
        assert all(r["decode_batch"] >= 1 for r in roles.values()), roles
        # a step from its batch's admission: no sooner trained than its chain alone and its
        # training on every device, its parts in order
        t = run["latency"]
        assert t == report["latency"][kind]
        assert t["rollout_s"] <= t["until_training_s"] <= t["step_s"]
        assert t["until_training_s"] + t["train_s"] == pytest.approx(t["step_s"], abs=2e-3)
        assert t["train_s"] >= t["train_bound_s"] > 0
        assert t["step_s"] >= t["chain_s"] + t["train_bound_s"] > t["chain_s"] > 0
        # the step's sample scored last: no stage of it faster than alone, both alone no
        # longer than the batch's longest chain, both as they took within its time to training
        assert t["critical_response_s"] >= t["critical_response_alone_s"] > 0
        assert t["critical_judgment_s"] >= t["critical_judgment_alone_s"] > 0
        assert 0 <= t["critical_judgment_queued_s"] <= t["critical_judgment_s"]
        alone = t["critical_response_alone_s"] + t["critical_judgment_alone_s"]
        assert alone <= t["chain_s"] + 1e-3
        took = t["critical_response_s"] + t["critical_judgment_s"]
        assert took <= t["until_training_s"] + 1e-3
        # gradient helpers join only PivotRL's steps: a baseline runs no planner
        assert run["helpers"] == report["helpers"][kind]
        if kind != "pivot":
            assert run["helpers"] == {}
        # a deployment whose steps took helpers says its figures owe them to the simulator
        owed = ["gradient_helpers"] if run["helpers"] else None
        assert report["simulated_only"].get(kind) == owed
    # the threshold of "busy": 2 sequences, where ITL = max(10 ms, 5 ms x running) stops rising
    assert report["busy_from_batch"] == {"rollout": 2, "reward": 2}


def test_text_output_plot_and_horizon_study(tmp_path, capsys):
    toy_workload(tmp_path, prompts=2, samples=4, sigma=0.8, response=200, per_running=0.005)
    run_dir = tmp_path / "run"
    out = _run(
        [
            str(tmp_path / "toy.toml"),
            "--gpus",
            "8",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--deployment",
            "pivot",
            "--run-dir",
            str(run_dir),
        ],
        capsys,
    )
    assert "pivot" in out and "wall time" in out
    # the engine time by role: a row per role, its shares and batch as numbers
    lines = out.splitlines()
    at = lines.index(next(line for line in lines if line.startswith("engine time by role")))
    rows = {line.split()[1]: line.split()[2:] for line in lines[at + 2 : at + 4]}
    assert set(rows) == {"rollout", "reward"} and all(len(v) == 4 for v in rows.values())
    assert all(float(rows[role][3]) >= 1 for role in rows), rows
    assert (run_dir / "plot-pivot-table4.png").stat().st_size > 10_000
    out = _run(
        [
            str(tmp_path / "toy.toml"),
            "--gpus",
            "8",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--study",
            "horizon",
            "--json",
            "--no-plot",
            "--run-dir",
            str(run_dir),
        ],
        capsys,
    )
    rows = json.loads(out)["results"]
    assert [r["label"] for r in rows] == ["H=5", "H=10", "H=20", "H=30", "H=60", "H=90"]
    assert all(r["samples_per_s"] > 0 for r in rows)


def test_headroom_study_runs_pivotrl_on_clusters_that_leave_each_cost_out(tmp_path, capsys):
    # a GenRM that prefills slowly, replicas that slow down with more sequences and a trainer
    # whose step shrinks with more devices: prefill, batching and training each cost time
    toy_workload(
        tmp_path,
        prompts=2,
        samples=4,
        sigma=0.8,
        response=200,
        per_running=0.005,
        genrm_prefill_tokens_per_s=500.0,
        hardware={"peak_bf16_tflops": 0.001, "train_mfu": 0.5},
    )
    argv = [str(tmp_path / "toy.toml"), "--gpus", "8", "--steps", "2", "--warmup", "1"]
    argv += ["--study", "headroom", "--json", "--no-plot", "--run-dir", str(tmp_path / "run")]
    progress: list[str] = []
    rows = {r["label"]: r for r in json.loads(_run(argv, capsys, progress))["results"]}
    labels = ["full", "free-prefill", "free-reprefill", "free-batching", "free-training", "all"]
    assert list(rows) == labels
    assert progress == [
        f"{k}: {r['samples_per_s']:.3f} samples/s, {r['bound']['combined']:.3f} of the "
        "combined bound"
        for k, r in rows.items()
    ]
    assert all(set(r["bound"]) == {"work", "critical_path", "combined"} for r in rows.values())

    def judging_s(label: str) -> float:  # the reward role's engine device-seconds
        role = rows[label]["account_by_role"]["reward"]
        return role["busy"] + role["under_filled"] + role["re_prefilling"]

    for label in ("free-prefill", "free-reprefill", "free-batching", "all"):
        assert judging_s(label) < judging_s("full"), label
    assert judging_s("free-training") == judging_s("full")
    # a run whose replicas re-prefill for free reports no re-prefill time
    assert rows["full"]["migration"]["reprefill_s"] > 0
    for label in ("free-prefill", "free-reprefill", "all"):
        assert rows[label]["migration"]["reprefill_s"] == 0, label
    # the trainer steps on its pool, or as fast as the bound's trainer on every device
    train = {label: rows[label]["latency"]["train_s"] for label in ("full", "free-training")}
    bound = rows["full"]["latency"]["train_bound_s"]
    assert train["full"] > 1.05 * bound and train["free-training"] == pytest.approx(bound)


def test_the_parser_names_every_ablation_and_router_rule_and_imports_nothing_heavy():
    import typing

    from pivot.actors.simulation import ABLATIONS, SimulationSettings

    assert sorted(simulate.ABLATION_NAMES) == sorted(ABLATIONS)
    rule = typing.get_type_hints(SimulationSettings)["router"]
    assert simulate.ROUTER_RULES == typing.get_args(rule)


def _steps_of(html: str, section: str) -> list[str]:
    """The step numbers of a report's step table in the section of run ``section``."""
    part = html.split(f"<h2>{section}</h2>")[1].split("</section>")[0]
    table = part.split('<table class="steps">')[1].split("</table>")[0]
    return re.findall(r"<tr><td>(\d+)</td>", table)


def test_a_simulate_run_dir_gets_its_report_and_pivot_report_reads_it(tmp_path, capsys):
    from pivot.cli.main import main

    toy_workload(tmp_path, prompts=2, samples=4, sigma=0.8, response=200, per_running=0.005)
    run_dir = tmp_path / "run"
    argv = [str(tmp_path / "toy.toml"), "--gpus", "16", "--steps", "2", "--warmup", "0"]
    argv += ["--deployment", "pivot"]
    out = _run([*argv, "--no-sweep", "--run-dir", str(run_dir)], capsys)
    assert f"report: {run_dir / 'report.html'}" in out
    assert main(["report", str(run_dir), "-o", str(tmp_path / "again.html")]) == 0
    html = (tmp_path / "again.html").read_text()
    assert html == (run_dir / "report.html").read_text()  # the same records, the same page
    assert len(re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', html)) == 1
    assert _steps_of(html, "pivot-table4") == ["0", "1"]
    assert "sequences aborted (taken off a replica)" in html  # the run's migration costs
    assert "What was simulated" in html and "&#34;gpus&#34;: 16" in html
    # the engine time by role, a row per role with its mean decode batch
    by_role = re.findall(
        r'<tr><td class="l">(rollout|reward)</td>(?:<td>[\d.]+</td>){4}</tr>', html
    )
    assert sorted(by_role) == ["reward", "rollout"]


def test_ctrl_c_leaves_the_runs_done_so_far_with_their_plot_and_report(
    tmp_path, capsys, monkeypatch
):
    from pivot.actors import simulation

    toy_workload(tmp_path, prompts=2, samples=4, sigma=0.8, response=200, per_running=0.005)
    real = simulation.simulate
    calls = []

    def interrupted_second(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(simulation, "simulate", interrupted_second)
    run_dir = tmp_path / "run"
    argv = [str(tmp_path / "toy.toml"), "--gpus", "8", "--steps", "1", "--warmup", "0"]
    argv += ["--no-sweep", "--router", "paper"]  # one run per deployment
    with pytest.raises(KeyboardInterrupt):
        _run([*argv, "--run-dir", str(run_dir)], capsys)
    summary = json.loads((run_dir / "summary.json").read_text())["report"]
    assert summary["interrupted"] and len(summary["runs"]) == 1
    first = summary["runs"][0]
    name = f"{first['deployment']}-{first['label']}"
    assert (run_dir / f"plot-{name}.png").read_bytes()[:4] == b"\x89PNG"
    html = (run_dir / "report.html").read_text()
    assert _steps_of(html, name) == ["0"]
    assert "interrupted: 1 runs finished" in capsys.readouterr().err


def test_prior_itl_scale_takes_a_role_and_a_positive_factor():
    assert simulate.role_scale("rollout=1.5") == ("rollout", 1.5)
    for bad, why in (("trainer=2", "rollout=X or reward=X"), ("reward=x", "not a number")):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            simulate.role_scale(bad)
    with pytest.raises(argparse.ArgumentTypeError, match="must be > 0"):
        simulate.role_scale("reward=0")


def test_split_runs_its_deployment_alone_there_and_a_split_that_disagrees_exits_2(tmp_path, capsys):
    from pivot.actors.simulation import SimulationSettings
    from pivot.actors.simulation import simulate as simulate_split
    from pivot.deployment import DeploymentKind, sweep_splits, table4_split
    from pivot.workload import load_workload

    toy_workload(tmp_path, prompts=2, samples=4, sigma=0.8, response=200, per_running=0.005)
    toy = str(tmp_path / "toy.toml")
    workload = load_workload(toy)
    sizes = workload.replica_sizes()
    table4 = table4_split(DeploymentKind.PIVOT, 8, sizes)
    split = next(s for s in sweep_splits(DeploymentKind.PIVOT, 8, sizes) if s != table4)
    argv = [toy, "--split", split.label(), "--steps", "1", "--warmup", "1", "--json"]
    argv += ["--no-wall", "--no-plot", "--run-dir", str(tmp_path / "run")]
    report = json.loads(_run(argv, capsys))
    assert set(report["throughput"]) == {"pivot"} and report["speedup"] == {}
    mine = report["splits"]["pivot"]
    assert mine["split"] == mine["best"] == split.label() and "table4" not in mine
    assert [r["label"] for r in report["runs"]] == ["split"] and mine["tried"] == []
    # both rules tried there, the faster kept: the same run as simulating that split
    rule = max(mine["routers_tried"], key=mine["routers_tried"].get)
    alone = simulate_split(
        workload, split, SimulationSettings(steps=1, warmup=1, seed=0, router=rule)
    )
    assert report["throughput"]["pivot"]["samples_per_s"] == round(alone.samples_per_s, 6)

    parser = argparse.ArgumentParser(prog="pivot")
    simulate.add_parser(parser.add_subparsers(dest="command", required=True))
    for wrong, says in [
        (["--split", split.label(), "--deployment", "disaggregated"], "--deployment says"),
        (["--split", split.label(), "--gpus", "16"], "--gpus says"),
        (["--split", "shared8"], "none of the forms"),
    ]:
        args = parser.parse_args(["simulate", toy, *wrong, "--run-dir", str(tmp_path / "bad")])
        assert args.func(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0] and err[0].startswith("pivot simulate: --split")
    assert not (tmp_path / "bad").exists()  # refused before anything ran
