"""A pivot command stopped by SIGINT, SIGTERM or SIGHUP unwinds as Ctrl-C does, names the
signal and exits 128 + its number; the handlers from before come back, and a signal ignored
at the start (nohup) stays ignored."""

from __future__ import annotations

import signal

import pytest

import pivot.cli.journal
from pivot.cli.interrupts import Interrupted, exit_code, stop_signals
from pivot.cli.main import main


@pytest.mark.parametrize(
    ("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)]
)
def test_a_stop_signal_ends_the_command_with_128_plus_its_number(
    sig, code, monkeypatch, tmp_path, capsys
):
    unwound = []

    def command(args):
        try:
            signal.raise_signal(sig)
        finally:
            unwound.append(sig)  # finally blocks run: children stop, files close
        return 0

    monkeypatch.setattr(pivot.cli.journal, "main", command)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    assert main(["journal", str(tmp_path)]) == code
    assert unwound == [sig]
    assert capsys.readouterr().err.strip() == f"pivot: interrupted by {sig.name}"
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_a_signal_ignored_at_the_start_stays_ignored(monkeypatch, tmp_path):
    def command(args):
        signal.raise_signal(signal.SIGHUP)
        return 0

    monkeypatch.setattr(pivot.cli.journal, "main", command)
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        assert main(["journal", str(tmp_path)]) == 0
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, saved)


def test_interrupted_is_a_keyboard_interrupt_that_names_its_signal():
    with pytest.raises(KeyboardInterrupt) as caught, stop_signals():
        signal.raise_signal(signal.SIGTERM)
    assert isinstance(caught.value, Interrupted) and caught.value.signal is signal.SIGTERM
    assert exit_code(caught.value) == 143
    assert exit_code(KeyboardInterrupt()) == 130  # Python's own, from SIGINT
