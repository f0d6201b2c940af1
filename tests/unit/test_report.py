"""`pivot report RUN_DIR`: a run directory's records as one self-contained HTML page, and one
line with exit code 2 for a directory it cannot read."""

from __future__ import annotations

import json
import re

import msgspec
import pytest

from pivot.cli.main import main
from pivot.cli.report import shift_stats
from pivot.timeline import RoleSample, ShiftMark


def _step(step: int, reward: float) -> dict:
    return {
        "type": "step",
        "step": step,
        "policy_version": step,
        "samples": 8,
        "scores": {
            "samples": 8,
            "reward_mean": reward,
            "accuracy": reward,
            "genrm_agreement": None,
            "reward_failures": 0,
            "failures_by_cause": {},
            "reward_metrics": {},
        },
        "response_tokens": 100,
        "judgment_tokens": 50,
        "started_s": 1000.0 + 2 * step,
        "rollout_s": 1.0,
        "seconds": 2.0,
        "train_s": 0.5,
        "samples_per_s": 4.0,
        "tokens_per_s": 75.0,
        "rollout_by_replica": {},
        "reward_by_replica": {},
        "train": {"version": step + 1, "loss": 0.25 - step / 100, "grad_norm": 1.5, "lr": 1e-4},
    }


def _marks() -> list[ShiftMark]:
    return [
        ShiftMark(
            t=0.5 + i,
            kind="shift",
            allocation={"rollout": 1 + i % 2, "reward": 2 - i % 2},
            seconds=float(i + 1),
            phase_s={"aborted": 0.1 * (i + 1), "done": 0.0},
        )
        for i in range(10)
    ] + [ShiftMark(t=11.0, kind="lend_trainer", allocation={"rollout": 3}, seconds=0.2)]


@pytest.fixture
def run_dir(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    steps = [_step(k, 0.1 * k) for k in range(4)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    samples = [
        RoleSample(t=0.1 * i, role=role, tokens_per_s=50.0, outstanding=2)
        for i in range(120)
        for role in ("rollout", "reward")
    ]
    lines = [msgspec.json.encode(r) for r in (*samples, *_marks())]
    (folder / "timeline.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    (folder / "config.toml").write_text("seed = 7\n[rollout]\nprompts_per_step = 4\n")
    return folder


def test_report_holds_its_plots_step_table_shift_statistics_and_config(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    out = run_dir / "report.html"
    assert capsys.readouterr().out.strip() == str(out)
    html = out.read_text()
    assert len(re.findall(r'src="data:image/png;base64,[A-Za-z0-9+/=]{1000,}"', html)) == 2
    assert "<script" not in html and 'src="http' not in html  # nothing fetched from outside
    table = html.split('<table class="steps">')[1].split("</table>")[0]
    rows = re.findall(r"<tr><td>(\d+)</td><td>v\d+</td><td>([\d.]+)</td>", table)
    assert rows == [("0", "0.000"), ("1", "0.100"), ("2", "0.200"), ("3", "0.300")]
    assert "+0.2500" in table and "1.00e-04" in table  # loss and lr of the trainer
    assert "seed = 7" in html and "prompts_per_step = 4" in html
    assert "shift transactions" not in html  # no journal in this run dir: not claimed


def test_output_flag_writes_elsewhere(run_dir, tmp_path, capsys):
    target = tmp_path / "elsewhere.html"
    assert main(["report", str(run_dir), "-o", str(target)]) == 0
    assert target.read_text().startswith("<!doctype html>")
    assert not (run_dir / "report.html").exists()


def test_shift_statistics_by_kind_and_phase():
    rows = {(r["kind"], r["phase"]): r for r in shift_stats(_marks())}
    total = rows[("shift", "total")]
    # seconds 1..10: median 5.5, p90 (inclusive) 9.1
    assert total["count"] == 10
    assert total["median"] == pytest.approx(5.5) and total["p90"] == pytest.approx(9.1)
    assert rows[("shift", "aborted")]["median"] == pytest.approx(0.55)
    lend = rows[("lend_trainer", "total")]
    assert (lend["count"], lend["median"], lend["p90"]) == (1, 0.2, 0.2)
    assert ("lend_trainer", "aborted") not in rows  # a phase it never recorded


@pytest.mark.parametrize("case", ["missing", "empty", "file", "garbled", "unwritable"])
def test_a_bad_run_dir_is_one_line_and_exit_2(run_dir, tmp_path, capsys, case):
    target, argv = tmp_path / "bad", []
    if case == "empty":
        target.mkdir()
    elif case == "file":
        target.write_text("not a folder")
    elif case == "garbled":
        target.mkdir()
        (target / "metrics.jsonl").write_text('not json\n{"type": "step"}\n')
    elif case == "unwritable":
        target, argv = run_dir, ["-o", str(tmp_path / "no" / "such" / "folder.html")]
    assert main(["report", str(target), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pivot report: ")
    assert str(target) in err or "folder.html" in err


def test_events_place_training_and_give_the_first_allocation(run_dir, capsys):
    from pivot.cli.report import read_run_dir
    from pivot.events import EVENTS_FILE, DeviceMap, StepDone

    events = [DeviceMap(t=0.0, roles={0: "rollout", 1: "rollout", 2: "reward", 3: "training"})]
    events += [StepDone(t=3.0 + 2 * k, step=k, report={}) for k in range(4)]
    (run_dir / EVENTS_FILE).write_bytes(b"\n".join(msgspec.json.encode(e) for e in events))
    [run], _, kind = read_run_dir(run_dir)
    assert kind == "run"
    assert run.initial == {"rollout": 2, "reward": 1, "training": 1}
    # each step trained for its last train_s (0.5 s) before its event
    assert [(s.start, s.end) for s in run.trains] == [
        (2.5, 3.0),
        (4.5, 5.0),
        (6.5, 7.0),
        (8.5, 9.0),
    ]
    assert main(["report", str(run_dir)]) == 0
    assert "placed by the events&#39; step times" in (run_dir / "report.html").read_text()
