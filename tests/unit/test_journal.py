"""Journal framing (pure) and the journal file: what replay returns after torn writes,
flipped bits and garbage is exactly the intact prefix of records; what recovery returns is
every intact record, and opening a damaged journal keeps the damaged bytes aside."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pivot.actors.journal import Journal
from pivot.cluster import Move, Role
from pivot.journal import HEADER, JournalError, decode_records, encode_record, recover_records
from pivot.planning.plans import ShiftPlan
from pivot.shift import Phase, PhaseReached, ShiftPlanned, ShiftRecord

values = st.one_of(
    st.none(),
    st.integers(-(2**63), 2**63 - 1),
    st.text(max_size=20),
    st.binary(max_size=40),
    st.lists(st.integers(0, 1000), max_size=6),
    st.dictionaries(st.text(max_size=5), st.integers(-1000, 1000), max_size=3),
)
record_lists = st.lists(values, min_size=0, max_size=8)


def _frames(records: list) -> tuple[bytes, list[int]]:
    """The encoded journal and the byte offset where each record ends."""
    data, ends = b"", []
    for record in records:
        data += encode_record(record)
        ends.append(len(data))
    return data, ends


@settings(max_examples=40)
@given(record_lists)
def test_records_round_trip(records):
    data, _ = _frames(records)
    replay = decode_records(data)
    assert replay.records == records
    assert replay.valid_bytes == len(data) and replay.problem is None


@settings(max_examples=80)
@given(record_lists, st.data())
def test_truncation_at_any_byte_keeps_exactly_the_whole_records(records, data):
    encoded, ends = _frames(records)
    cut = data.draw(st.integers(0, len(encoded)))
    replay = decode_records(encoded[:cut])
    whole = sum(end <= cut for end in ends)
    assert replay.records == records[:whole]
    assert replay.valid_bytes == (ends[whole - 1] if whole else 0)
    assert (replay.problem is None) == (cut in (0, *ends))


@settings(max_examples=80)
@given(st.lists(values, min_size=1, max_size=8), st.data())
def test_a_flipped_bit_ends_replay_at_the_record_it_hit(records, data):
    encoded, ends = _frames(records)
    bit = data.draw(st.integers(0, len(encoded) * 8 - 1))
    damaged = bytearray(encoded)
    damaged[bit // 8] ^= 1 << (bit % 8)
    hit = next(i for i, end in enumerate(ends) if bit // 8 < end)
    replay = decode_records(bytes(damaged))
    assert replay.records == records[:hit]
    assert replay.valid_bytes == (ends[hit - 1] if hit else 0)
    assert replay.problem is not None and f"record {hit} " in replay.problem


@settings(max_examples=60)
@given(st.lists(values, min_size=1, max_size=6), st.data())
def test_garbage_after_a_record_boundary_is_reported_not_replayed(records, data):
    encoded, ends = _frames(records)
    keep = data.draw(st.sampled_from([0, *ends[:-1]]))
    garbage = data.draw(st.binary(min_size=1, max_size=64))
    replay = decode_records(encoded[:keep] + garbage)
    whole = sum(end <= keep for end in ends)
    # CRC32 lets random garbage through with probability 2**-32 per attempt
    assert replay.records == records[:whole]
    assert replay.problem is not None


def test_an_absurd_length_is_corruption_not_a_wait_for_more_bytes():
    replay = decode_records(HEADER.pack(0xFFFFFFFF, 0) + b"x" * 16)
    assert replay.records == [] and "corrupt" in replay.problem


def test_unencodable_records_are_refused_with_their_type():
    with pytest.raises(JournalError, match="object"):
        encode_record(object())


def _plan() -> ShiftPlan:
    return ShiftPlan(
        kind="shift",
        receiver=Role.REWARD,
        moves=(
            Move("evict", "rollout@1", Role.ROLLOUT, (1,)),
            Move("wake", "reward@1", Role.REWARD, (1,)),
        ),
    )


def test_shift_records_decode_into_their_types():
    records = [
        ShiftPlanned(txn=1, at=0.5, plan=_plan()),
        PhaseReached(txn=1, phase=Phase.ROUTING_CUT, at=0.6),
        PhaseReached(txn=1, phase=Phase.ACQUIRED, at=0.7, failed=("reward@1",)),
    ]
    replay = decode_records(b"".join(encode_record(r) for r in records), ShiftRecord)
    assert replay.records == records
    assert replay.records[0].plan.moves[0].role is Role.ROLLOUT


def test_a_record_of_another_schema_stops_a_typed_replay():
    data = encode_record(PhaseReached(txn=1, phase=Phase.DONE, at=1.0)) + encode_record(
        {"type": "phase", "txn": "one"}
    )
    replay = decode_records(data, ShiftRecord)
    assert len(replay.records) == 1 and "undecodable" in replay.problem


# --- the file ---------------------------------------------------------------------------------


def test_journal_file_appends_and_replays(tmp_path):
    path = tmp_path / "run" / "journal"
    with Journal(path) as journal:
        assert journal.opened.records == [] and journal.opened.problem is None
        journal.append({"n": 1})
        journal.append({"n": 2})
        assert journal.replay().records == [{"n": 1}, {"n": 2}]
    with Journal(path) as again:
        assert again.opened.records == [{"n": 1}, {"n": 2}]
        again.append({"n": 3})
    assert decode_records(path.read_bytes()).records == [{"n": 1}, {"n": 2}, {"n": 3}]


def test_a_record_no_action_waits_on_is_written_in_order_without_its_own_fsync(tmp_path):
    path = tmp_path / "journal"
    with Journal(path) as journal:
        journal.append({"n": 1}, durable=False)
        assert journal.replay().records == [{"n": 1}]  # handed to the OS already
        journal.append({"n": 2})
    assert decode_records(path.read_bytes()).records == [{"n": 1}, {"n": 2}]


def test_reopening_cuts_a_torn_tail_so_new_records_are_readable(tmp_path):
    path = tmp_path / "journal"
    with Journal(path) as journal:
        journal.append("first")
        journal.append("second")
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # killed while writing "second"
    with Journal(path) as journal:
        assert journal.opened.records == ["first"]
        assert "torn" in journal.opened.problem
        journal.append("third")
    with Journal(path) as journal:
        assert journal.opened.records == ["first", "third"]
        assert journal.opened.problem is None


def test_a_flipped_byte_mid_file_keeps_the_original_aside_and_every_intact_record(tmp_path):
    path = tmp_path / "shift.journal"
    with Journal(path) as journal:
        for i in range(341):
            journal.append({"n": i, "pad": "x" * (i % 7)})
    whole = path.read_bytes()
    ends = _frames([{"n": i, "pad": "x" * (i % 7)} for i in range(341)])[1]
    damaged = bytearray(whole)
    damaged[ends[169] + HEADER.size + 2] ^= 0xFF  # inside record 170's payload
    path.write_bytes(bytes(damaged))
    with Journal(path) as journal:
        opened = journal.opened
        assert [r["n"] for r in opened.records] == [i for i in range(341) if i != 170]
        [skip] = journal.skipped
        assert (skip.index, skip.offset, skip.length) == (170, ends[169], ends[170] - ends[169])
        assert "record 170 at byte" in opened.problem and "CRC mismatch" in opened.problem
        assert journal.kept_aside == tmp_path / "shift.journal.damaged-1"
        assert "shift.journal.damaged-1" in opened.problem
        journal.append({"n": 341})
    assert (tmp_path / "shift.journal.damaged-1").read_bytes() == bytes(damaged)
    again = decode_records(path.read_bytes())
    assert again.problem is None
    assert [r["n"] for r in again.records] == [*(i for i in range(341) if i != 170), 341]


def test_a_damaged_length_field_is_skipped_to_the_next_intact_record(tmp_path):
    path = tmp_path / "journal"
    with Journal(path) as journal:
        for i in range(5):
            journal.append(i)
    data = bytearray(path.read_bytes())
    record = len(encode_record(0))
    data[2 * record] ^= 0x01  # record 2's length: its frame's end is unknown
    path.write_bytes(bytes(data))
    with Journal(path) as journal:
        assert journal.opened.records == [0, 1, 3, 4]
        assert [(s.index, s.offset, s.length) for s in journal.skipped] == [(2, 2 * record, record)]


def test_a_second_damage_keeps_the_first_copy_and_numbers_the_next(tmp_path):
    path = tmp_path / "journal"
    with Journal(path) as journal:
        for i in range(4):
            journal.append(i)
    record = len(encode_record(0))
    copies = []
    for hit in (1, 1):
        data = bytearray(path.read_bytes())
        data[hit * record + HEADER.size] ^= 0x10
        path.write_bytes(bytes(data))
        copies.append(bytes(data))
        Journal(path).close()
    assert (tmp_path / "journal.damaged-1").read_bytes() == copies[0]
    assert (tmp_path / "journal.damaged-2").read_bytes() == copies[1]
    assert decode_records(path.read_bytes()).records == [0, 3]


def test_a_torn_tail_is_cut_off_and_its_bytes_kept(tmp_path):
    path = tmp_path / "journal"
    with Journal(path) as journal:
        journal.append("first")
        journal.append("second")
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])
    with Journal(path) as journal:
        assert journal.opened.records == ["first"]
        assert journal.kept_aside == tmp_path / "journal.tail-1"
        assert "torn" in journal.opened.problem and "journal.tail-1" in journal.opened.problem
    cut = len(encode_record("first"))
    assert path.read_bytes() == whole[:cut]
    assert (tmp_path / "journal.tail-1").read_bytes() == whole[cut:-3]
    assert not (tmp_path / "journal.damaged-1").exists()


@settings(max_examples=80)
@given(st.lists(values, min_size=1, max_size=8), st.data())
def test_recovery_loses_only_the_record_a_flipped_bit_hit(records, data):
    encoded, ends = _frames(records)
    bit = data.draw(st.integers(0, len(encoded) * 8 - 1))
    damaged = bytearray(encoded)
    damaged[bit // 8] ^= 1 << (bit % 8)
    hit = next(i for i, end in enumerate(ends) if bit // 8 < end)
    recovery = recover_records(bytes(damaged))
    assert recovery.records == records[:hit] + records[hit + 1 :]
    start = ends[hit - 1] if hit else 0
    assert [(s.index, s.offset, s.length) for s in recovery.skipped] == [
        (hit, start, ends[hit] - start)
    ]
    kept = b"".join(bytes(damaged[a:b]) for a, b in recovery.frames)
    assert decode_records(kept).records == recovery.records


def test_recovery_of_whole_data_skips_nothing():
    encoded, ends = _frames(["a", "b"])
    recovery = recover_records(encoded)
    assert recovery.records == ["a", "b"] and recovery.skipped == []
    assert recovery.frames == [(0, ends[0]), (ends[0], ends[1])]


def test_a_record_of_another_schema_is_skipped_by_its_own_length():
    good = encode_record(PhaseReached(txn=1, phase=Phase.DONE, at=1.0))
    other = encode_record({"type": "phase", "txn": "one"})
    recovery = recover_records(good + other + good, ShiftRecord)
    assert len(recovery.records) == 2
    [skip] = recovery.skipped
    assert (skip.index, skip.offset, skip.length) == (1, len(good), len(other))
    assert "undecodable" in skip.problem
