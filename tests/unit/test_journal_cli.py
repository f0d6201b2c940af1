"""`pivot journal RUN_DIR`: a shift journal the Controller's journal code wrote, printed one
record a line (readable or JSON), read without changing the file."""

from __future__ import annotations

import json

import msgspec

from pivot.actors.controller import open_journal
from pivot.cli.main import main
from pivot.cluster import Move, Role
from pivot.journal import encode_record
from pivot.planning.plans import ShiftPlan
from pivot.shift import Phase, PhaseReached, ShiftPlanned, ShiftRecord

PLAN = ShiftPlan(
    kind="shift",
    receiver=Role.REWARD,
    moves=(
        Move("evict", "rollout@1", Role.ROLLOUT, (1,)),
        Move("wake", "reward@1", Role.REWARD, (1, 2)),
    ),
    expected_gain=42.0,
)
RECORDS = [
    ShiftPlanned(txn=1, at=100.0, plan=PLAN),
    PhaseReached(txn=1, phase=Phase.ROUTING_CUT, at=100.25),
    PhaseReached(txn=1, phase=Phase.ACQUIRED, at=100.5, failed=("reward@1",)),
    PhaseReached(txn=1, phase=Phase.DONE, at=101.0, failed=("reward@1",)),
]


def _journal(run_dir) -> None:
    with open_journal(run_dir / "shift.journal", fsync=False) as journal:
        for record in RECORDS:
            journal.append(record)


def test_each_record_is_one_readable_line(tmp_path, capsys):
    _journal(tmp_path)
    assert main(["journal", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(RECORDS)
    planned, cut, acquired, done = lines
    # times since the first record; the plan's moves with their devices
    assert "0.000 s" in planned and "txn 1" in planned and "planned" in planned
    assert "shift -> reward: evict rollout@1 [1], wake reward@1 [1 2]" in planned
    assert "expected gain 42.0 tokens" in planned
    assert "0.250 s" in cut and cut.endswith("routing_cut")
    assert "0.500 s" in acquired and "acquired" in acquired and "failed reward@1" in acquired
    assert "1.000 s" in done and "done" in done


def test_json_is_one_object_per_record_that_decodes_back(tmp_path, capsys):
    _journal(tmp_path)
    assert main(["journal", str(tmp_path), "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line)["type"] for line in lines] == ["planned", "phase", "phase", "phase"]
    decoder = msgspec.json.Decoder(ShiftRecord)
    assert [decoder.decode(line) for line in lines] == RECORDS


def test_a_torn_tail_is_reported_and_left_in_the_file(tmp_path, capsys):
    _journal(tmp_path)
    path = tmp_path / "shift.journal"
    torn = path.read_bytes()[:-3]
    path.write_bytes(torn)
    assert main(["journal", str(tmp_path)]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == len(RECORDS) - 1
    [problem] = out.err.splitlines()
    assert "record 3" in problem and "torn" in problem
    assert path.read_bytes() == torn


def test_a_damaged_record_mid_file_is_named_and_the_records_after_it_printed(tmp_path, capsys):
    _journal(tmp_path)
    path = tmp_path / "shift.journal"
    data = bytearray(path.read_bytes())
    first = len(encode_record(RECORDS[0]))
    data[first + 9] ^= 0xFF  # inside record 1's payload
    path.write_bytes(bytes(data))
    assert main(["journal", str(tmp_path), "--json"]) == 0
    out = capsys.readouterr()
    decoder = msgspec.json.Decoder(ShiftRecord)
    assert [decoder.decode(line) for line in out.out.splitlines()] == [RECORDS[0], *RECORDS[2:]]
    [problem] = out.err.splitlines()
    assert f"record 1 at byte {first}" in problem and "CRC mismatch" in problem
    assert f"skipped {len(encode_record(RECORDS[1]))} bytes" in problem
    assert path.read_bytes() == bytes(data)


def test_a_missing_journal_is_one_line(tmp_path, capsys):
    assert main(["journal", str(tmp_path / "nothing")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert str(tmp_path / "nothing" / "shift.journal") in line and "no such file" in line
