"""Starting a local Ray cluster in a test, tried again when Ray does not come up: Ray gives a node 30 s to register
with its GCS (fixed in ``ray._private.node``), which a loaded 2-core machine has exceeded (CI, 2026-12-08: "The
current node timed out during startup")."""

from __future__ import annotations

import glob
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

START_TRIES = 3


def start_ray(start: Callable[[str], None], stop: Callable[[], None], temp_dir: str, tries: int = START_TRIES) -> str:
    """Call ``start(attempt_dir)`` up to ``tries`` times, each in a fresh folder under ``temp_dir``, and give the
    folder of the try that returned. A try that raises is stopped (``stop()``, then every process still naming its
    folder killed, the tails of its logs printed for the test's report) before the next; the last try's error is
    raised with the tries counted."""
    for attempt in range(1, tries + 1):
        attempt_dir = os.path.join(temp_dir, f"try{attempt}")
        os.makedirs(attempt_dir)
        try:
            start(attempt_dir)
            return attempt_dir
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when a node does not register
            try:
                stop()
            finally:
                _kill_processes_naming(attempt_dir)
            print(f"Ray did not start (try {attempt} of {tries}): {exc}\n{_log_tails(attempt_dir)}",
                  file=sys.stderr)
            if attempt == tries:
                raise RuntimeError(f"Ray did not start in {tries} tries (logs above): {exc}") from exc
    raise AssertionError("unreachable")


def add_node(cluster: Any, tries: int = START_TRIES, **node_args: Any) -> Any:
    """``cluster.add_node(**node_args)`` (a ``ray.cluster_utils.Cluster``), tried up to ``tries`` times: the
    processes a failed try started (this process's new children and their descendants: the node's raylet and agents;
    not the new workers of the nodes already up, which are their raylets' children) are killed before the next, and
    the error printed for the test's report."""
    for attempt in range(1, tries + 1):
        before = set(_children(os.getpid()))
        try:
            return cluster.add_node(**node_args)
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception when a node does not register
            started = [pid for pid in _children(os.getpid()) if pid not in before]
            _kill_until_gone(lambda new=started: [p for pid in new for p in [pid, *_descendants(pid)] if _alive(p)])
            print(f"a Ray node did not start (try {attempt} of {tries}): {exc}", file=sys.stderr)
            if attempt == tries:
                raise RuntimeError(f"a Ray node did not start in {tries} tries: {exc}") from exc
    raise AssertionError("unreachable")


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process ``/proc`` shows."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rpartition(b")")[2].split()
                table[int(entry)] = (int(fields[1]), fields[0].decode())
            except (OSError, IndexError, ValueError):
                pass
    return table


def _children(parent: int) -> list[int]:
    """The live (not zombie) children of ``parent``."""
    return [pid for pid, (ppid, state) in _processes().items() if ppid == parent and state != "Z"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _descendants(root: int) -> list[int]:
    """The live (not zombie) descendants of ``root``."""
    table = _processes()
    found, todo = [], [root]
    while todo:
        parent = todo.pop()
        children = [pid for pid, (ppid, _) in table.items() if ppid == parent]
        found += [pid for pid in children if table[pid][1] != "Z"]
        todo += children
    return found


def _naming(folder: str) -> list[int]:
    """The processes (not this one) whose command line names ``folder``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if folder.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def _kill_processes_naming(folder: str) -> None:
    """SIGKILL every process whose command line names ``folder`` (a failed cluster's GCS, raylets and agents)."""
    _kill_until_gone(lambda: _naming(folder))


def _kill_until_gone(find: Callable[[], list[int]], timeout_s: float = 10.0) -> None:
    """SIGKILL the processes ``find()`` gives until it gives none (or ``timeout_s`` passed)."""
    deadline = time.monotonic() + timeout_s
    while (pids := find()) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.1)


def _log_tails(folder: str, lines: int = 15) -> str:
    """The last ``lines`` lines of the GCS's and raylets' logs under ``folder``."""
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "**", "logs", "*"), recursive=True)):
        if os.path.basename(path).startswith(("gcs_server", "raylet")) and path.endswith((".out", ".err")):
            with open(path, errors="replace") as f:
                tail = f.readlines()[-lines:]
            if tail:
                out.append(f"--- {path}\n{''.join(tail)}")
    return "\n".join(out)
