"""Every process a remote rank left on its host, found from ``/proc`` and killed, for ``spark-hvd-run -H``.

A rank's children may leave its process group (a daemon that calls ``setsid()``, a DataLoader worker started in a
session of its own), so signalling a group misses them. The remote end (``spark_hvd.runner.remote``) therefore

* makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``, :func:`become_subreaper`): a descendant whose parent
  exits (a double fork, the rank killed first) is re-parented to it rather than to the host's init, so it stays in
  its process tree;
* gives the rank a marker in its environment (``SPARK_HVD_RANK_MARK``, :data:`MARK_ENV`: the job id, the rank and
  the remote end's pid), which every descendant inherits unless it drops its environment;

and at stop time :func:`rank_processes` takes both: the descendants of the remote end (read from every
``/proc/PID/stat``) and any process whose ``/proc/PID/environ`` holds the marker (one that escaped the tree).
:func:`kill_until_gone` SIGKILLs them until none is left, within a bounded time, and says which it killed.
Zombies are left out; the remote end's own zombie children (other than the rank, whose status ``subprocess``
waits for) are reaped (:func:`reap_children`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Iterable

#: The environment variable that marks every process of one remote rank.
MARK_ENV = "SPARK_HVD_RANK_MARK"

#: Seconds :func:`kill_until_gone` keeps killing (a process may fork while it is being killed).
KILL_WITHIN_S = 3.0

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants of this process are re-parented to it (Linux 3.4+); False where that is unavailable."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _table() -> dict[int, tuple[int, str, str]]:
    """pid -> (parent pid, state, command name) of every process ``/proc`` shows."""
    table: dict[int, tuple[int, str, str]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:  # no /proc (not Linux): nothing found; the remote end still signals the rank itself
        return table
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        head, _, tail = raw.rpartition(b")")
        fields = tail.split()
        if len(fields) < 2:
            continue
        name = head.partition(b"(")[2].decode(errors="replace")
        table[int(entry)] = (int(fields[1]), fields[0].decode(), name)
    return table


def _has_marker(pid: int, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in b"\0" + f.read()
    except OSError:  # gone, or another user's
        return False


def _netns(pid: int | str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return None


def job_processes(var: str, value: str) -> dict[int, str]:
    """pid -> command name of every live process of this host (this network namespace: the host identity
    spark_hvd uses) whose environment holds ``var=value``, this process left out: under ``spark-hvd-run`` the local
    ranks' job id (``SPARK_HVD_JOB_ID``), which the processes they started inherit even after ``setsid()``."""
    table, me, here = _table(), os.getpid(), _netns("self")
    needle = f"\0{var}={value}\0".encode()
    return {pid: name for pid, (_, state, name) in sorted(table.items())
            if pid != me and state not in ("Z", "X") and _has_marker(pid, needle) and _netns(pid) == here}


def rank_processes(root: int, marker: str) -> dict[int, str]:
    """pid -> command name of every live process below ``root`` (descendants) or carrying ``MARK_ENV=marker`` in
    its environment; ``root`` itself and zombies left out."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    needle = f"\0{MARK_ENV}={marker}\0".encode()
    found.update(pid for pid in table if pid not in found and pid != root and _has_marker(pid, needle))
    return {pid: table[pid][2] for pid in sorted(found) if table[pid][1] not in ("Z", "X")}


def signal_all(pids: Iterable[int], signum: int) -> None:
    """``signum`` to each of ``pids`` (those already gone are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def reap_children(keep: int) -> None:
    """Reap this process's zombie children except ``keep`` (the rank, which ``subprocess`` waits for)."""
    me = os.getpid()
    for pid, (ppid, state, _) in _table().items():
        if ppid == me and state == "Z" and pid != keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def kill_until_gone(root: int, marker: str, keep: int,
                    within_s: float = KILL_WITHIN_S) -> tuple[dict[int, str], list[int]]:
    """SIGKILL every process of :func:`rank_processes` until none is left or ``within_s`` passed (a process may
    fork while it is being killed). Returns (pid -> name of every process killed, pids still alive at the end)."""
    killed: dict[int, str] = {}
    deadline = time.monotonic() + within_s
    while True:
        found = rank_processes(root, marker)
        if not found or time.monotonic() > deadline:
            return killed, sorted(found)
        killed.update(found)
        signal_all(found, signal.SIGKILL)
        time.sleep(0.02)
        reap_children(keep)
