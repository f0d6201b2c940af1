"""`pivot journal RUN_DIR [--json]`: a run's shift journal (``RUN_DIR/shift.journal``), one
record a line.

A line says when (seconds since the journal's first record, on the Controller's clock),
which transaction, the record's kind (``planned``) or the phase it reached, and for a plan its
kind, receiver, moves and expected gain; ``--json`` prints each record as one JSON object
(its ``type`` "planned" or "phase", the fields of ``pivot.shift.ShiftPlanned`` /
``PhaseReached``). The file is only read: every intact record is printed, past a damaged
one, and each damaged record (a torn tail from a Controller killed mid-append, a flipped byte)
is named on stderr with the bytes skipped; the Controller's reopening is what repairs the file.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import msgspec

from pivot.config import ConfigError
from pivot.journal import Skipped, recover_records
from pivot.shift import PhaseReached, ShiftPlanned, ShiftRecord

JOURNAL_NAME = "shift.journal"


def _moves(plan: Any) -> str:
    return ", ".join(
        f"{m.kind} {m.replica_id} [{' '.join(str(d) for d in m.devices)}]" for m in plan.moves
    )


def record_line(record: ShiftPlanned | PhaseReached, origin: float) -> str:
    """One record, readable."""
    head = f"{record.at - origin:9.3f} s  txn {record.txn:<4d}"
    if isinstance(record, ShiftPlanned):
        p = record.plan
        text = f"{head} planned      {p.kind} -> {p.receiver.value}: {_moves(p)}"
        if p.expected_gain:
            text += f"; expected gain {p.expected_gain:.1f} tokens"
        if p.migrations:
            text += f"; {len(p.migrations)} migrations"
        return text
    if record.failed:
        return f"{head} {record.phase.value:<12} failed {', '.join(record.failed)}"
    return f"{head} {record.phase.value}"


def read_journal(
    run_dir: str | Path,
) -> tuple[list[ShiftPlanned | PhaseReached], list[Skipped]]:
    """The journal's intact records and the damaged ones skipped (none: the whole file)."""
    path = Path(run_dir) / JOURNAL_NAME
    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(
            str(path), "", "a shift journal (a pivot run under deployment pivot)", "no such file"
        ) from None
    recovery = recover_records(data, ShiftRecord)
    return recovery.records, recovery.skipped


def main(args: argparse.Namespace) -> int:
    records, skipped = read_journal(args.run_dir)
    origin = records[0].at if records else 0.0
    encoder = msgspec.json.Encoder()
    try:
        for record in records:
            if args.json:
                sys.stdout.write(encoder.encode(record).decode() + "\n")
            else:
                print(record_line(record, origin))
        sys.stdout.flush()
    except BrokenPipeError:
        # `pivot journal RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    for skip in skipped:
        print(f"pivot journal: damaged, not printed: {skip}", file=sys.stderr)
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``journal`` on the ``pivot`` command's subparsers."""
    p = subparsers.add_parser(
        "journal", help="print a run's shift journal", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holds shift.journal)")
    p.add_argument("--json", action="store_true", help="one JSON object per record")
    p.set_defaults(func=main)
    return p
