"""Socket folders: each names its owner, and a start removes exactly the folders whose owner
is dead, never a living owner's, never one without the owner file."""

from __future__ import annotations

import os
import subprocess
import sys

from pivot.bus.sockets import OWNER, make_socket_dir, remove_orphaned_socket_dirs


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid names no process now
    return child.pid


def _folder(root, name: str, owner: str | None):
    folder = root / name
    folder.mkdir()
    (folder / "driver.sock").write_text("")
    if owner is not None:
        (folder / OWNER).write_text(owner)
    return folder


def test_a_new_folder_names_this_process_and_survives_cleanup(tmp_path):
    folder = make_socket_dir(tmp_path)
    assert folder.name.startswith("pivot-")
    assert (folder / OWNER).read_text().split()[0] == str(os.getpid())
    assert remove_orphaned_socket_dirs(tmp_path) == []
    assert folder.is_dir()


def test_only_the_folders_of_dead_owners_are_removed(tmp_path):
    dead = _dead_pid()
    orphan = _folder(tmp_path, "pivot-dead", f"{dead}\n")
    living = _folder(tmp_path, "pivot-alive", f"{os.getppid()}\n")
    unmarked = _folder(tmp_path, "pivot-old", None)
    garbled = _folder(tmp_path, "pivot-garbled", "not a pid\n")
    other = _folder(tmp_path, "other-dead", f"{dead}\n")
    assert remove_orphaned_socket_dirs(tmp_path) == [orphan]
    assert not orphan.exists()
    assert all(f.is_dir() for f in (living, unmarked, garbled, other))


def test_a_reused_pid_is_told_apart_by_its_start_time(tmp_path):
    # this process's pid, but a start time it never had: a folder of an earlier process
    reused = _folder(tmp_path, "pivot-reused", f"{os.getpid()} 1\n")
    mine = make_socket_dir(tmp_path)
    assert remove_orphaned_socket_dirs(tmp_path) == [reused]
    assert mine.is_dir()
