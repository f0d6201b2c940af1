"""Temporary folders for ipc:// sockets, and the cleanup of those a killed run left behind.

An ipc path must stay under ~100 bytes, so sockets live in a short folder in the temp dir
(``pivot-XXXX``), not in the run dir. Its owner removes it on the way out; a run killed with
SIGKILL cannot, so each folder holds an ``owner`` file (the pid and, where ``/proc`` says, the
process's start time, which tells a reused pid apart), and the next start removes the folders
whose owner is dead. A folder without that file, of another user, or whose owner lives is
never touched.

    make_socket_dir() -> Path                       # a fresh folder, owned by this process
    owner_text(pid) -> str; owner_alive(text) -> bool   # a process named by pid + start time
    remove_orphaned_socket_dirs() -> list[Path]     # the dead owners' folders, removed
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "pivot-"
OWNER = "owner"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def owner_text(pid: int | None = None) -> str:
    """What an ``owner`` file says of ``pid`` (default this process): the pid and its start
    time; ``owner_alive`` reads it back. The run dir's job file records its job so too."""
    pid = os.getpid() if pid is None else pid
    return f"{pid} {_start_time(pid) or ''}".strip()


def make_socket_dir(root: str | Path | None = None, prefix: str = PREFIX) -> Path:
    """A new folder in ``root`` (default the temp dir) that names this process its owner."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    marker = folder / f"{OWNER}.new"
    marker.write_text(owner_text() + "\n")
    # renamed into place whole: a concurrent cleanup never reads half a pid
    marker.replace(folder / OWNER)
    return folder


def owner_alive(text: str) -> bool:
    """Whether the process an ``owner`` file names still runs (True when unsure)."""
    fields = text.split()
    try:
        pid = int(fields[0])
    except (IndexError, ValueError):
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process lives under that pid
    if len(fields) > 1:
        started = _start_time(pid)
        if started is not None and started != fields[1]:
            return False  # the pid was reused by a later process
    return True


def remove_orphaned_socket_dirs(root: str | Path | None = None, prefix: str = PREFIX) -> list[Path]:
    """Remove the ``prefix*`` folders in ``root`` (default the temp dir) that this user owns
    and whose owner process is dead; the ones removed."""
    root = Path(root) if root is not None else Path(tempfile.gettempdir())
    removed = []
    uid = os.getuid()
    for folder in root.glob(f"{prefix}*"):
        try:
            info = folder.lstat()
            if not folder.is_dir() or folder.is_symlink() or info.st_uid != uid:
                continue
            marker = folder / OWNER
            if marker.is_symlink() or not marker.is_file():
                continue
            text = marker.read_text()
        except OSError:
            continue
        if owner_alive(text):
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(folder)
            removed.append(folder)
    return removed
