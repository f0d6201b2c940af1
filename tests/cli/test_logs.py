"""`pivot logs RUN --actor NAME` on a run's actors.log: that actor's lines, readable; an actor
with no line there is named in one line (exit 2) with the actors that have some."""

from __future__ import annotations

import json

from pivot.cli.main import main


def _record(actor: str, event: str) -> str:
    stamp = "2026-12-07T12:00:00.000000Z"
    return json.dumps({"actor": actor, "event": event, "level": "info", "timestamp": stamp})


def test_an_actors_lines_and_an_actor_without_any_named_with_those_that_have(tmp_path, capsys):
    lines = [_record("driver", "admitted"), "a library's own text", _record("trainer", "trained")]
    (tmp_path / "actors.log").write_text("\n".join(lines) + "\n")
    assert main(["logs", str(tmp_path), "--actor", "trainer"]) == 0
    out = capsys.readouterr()
    [line] = out.out.splitlines()
    assert "trainer" in line and "trained" in line and "driver" not in line
    assert main(["logs", str(tmp_path), "--actor", "controller"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.endswith("no line of actor 'controller'; its actors: driver, trainer")
    assert main(["logs", str(tmp_path)]) == 0  # no filter: every line, the library's too
    assert len(capsys.readouterr().out.splitlines()) == 3
