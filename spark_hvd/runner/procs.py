"""Supervising the processes of a launch: one ``RankProcess`` per rank (output pumped line by line), the wait for
the first failure by time (``wait_ranks``), and stopping every rank's process group (``stop_ranks``); shared by
``spark-hvd-run``'s local ranks (``launch``) and its ranks on other hosts (``multihost``).

The rank reported is the first to fail *by time*: a pidfd per rank in one epoll set, whose ready list is in the
order the kernel saw the processes exit, so a rank SIGKILLed mid-allreduce is blamed rather than the peer that exited
1 a moment later because its socket closed.
"""

from __future__ import annotations

import collections
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

from spark_hvd.runner import rank_tree
from spark_hvd.runner.client import Event
from spark_hvd.runner.errors import LaunchFailure

logger = logging.getLogger(__name__)

TIMEOUT_EXIT_CODE = 124
STDERR_TAIL_LINES = 20
#: Seconds the launcher waits for output pipes after every process group got SIGKILL.
PIPE_DRAIN_S = 1.0


@dataclass
class LaunchResult:
    """Outcome of ``launch.run_local`` / ``multihost.run_hosts``.

    ``returncode`` is 0 when every rank succeeded, else the failed rank's exit code (128+signal for a rank killed
    by a signal, 124 when the job ran past its timeout). ``stdout`` / ``stderr`` hold the prefixed lines when the
    output was captured.
    """

    returncode: int
    failure: LaunchFailure | None = None
    timed_out: bool = False
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    returncodes: list[int | None] = field(default_factory=list)


class RankOutput:
    """Where a launch's rank output goes: each line printed prefixed ``[rank]`` on the stream it came from (with
    ``capture``, kept in ``result.stdout`` / ``result.stderr`` instead); each progress event kept in
    ``result.events`` and handed to ``on_event``."""

    def __init__(self, result: LaunchResult, capture: bool, on_event: Callable[[Event], None] | None = None) -> None:
        self.result = result
        self.capture = capture
        self.on_event = on_event
        self._lock = threading.Lock()

    def line(self, rank: int, stream: str, line: str) -> None:
        text = f"[{rank}] {line}"
        with self._lock:
            if self.capture:
                (self.result.stderr if stream == "stderr" else self.result.stdout).append(text)
            else:
                out = sys.stderr if stream == "stderr" else sys.stdout
                out.write(text + "\n")
                out.flush()

    def event(self, event: Event) -> None:
        self.result.events.append(event)
        if self.on_event is not None:
            self.on_event(event)


def exit_code(returncode: int) -> int:
    """A ``Popen.returncode`` as a shell reports it (128 + the signal number for a signal)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL`` for a ``Popen.returncode``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {exit_code(returncode)})"
    return f"exited with code {returncode}"


class RankProcess:
    """One rank's process (a session of its own) and the threads that pump its output to ``sink``."""


    def __init__(self, rank: int, proc: subprocess.Popen, sink: Callable[[int, str, str], None]) -> None:
        self.rank = rank
        self.proc = proc
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self.readers = [
            threading.Thread(target=self._pump, args=(proc.stdout, "stdout", sink), daemon=True,
                             name=f"spark-hvd-run-{rank}-out"),
            threading.Thread(target=self._pump, args=(proc.stderr, "stderr", sink), daemon=True,
                             name=f"spark-hvd-run-{rank}-err"),
        ]
        for reader in self.readers:
            reader.start()

    def _pump(self, pipe: IO[bytes], stream: str, sink: Callable[[int, str, str], None]) -> None:
        try:
            for raw in iter(pipe.readline, b""):
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if stream == "stderr":
                    self.stderr_tail.append(line)
                sink(self.rank, stream, line)
        except (OSError, ValueError):
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def signal(self, signum: int) -> None:
        """Signal the rank's whole process group (it runs in a session of its own), even after the rank itself
        exited: its children stay in the group (Linux does not reuse a pid while a group of that id lives)."""
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            if self.proc.poll() is None:
                try:
                    self.proc.send_signal(signum)
                except ProcessLookupError:
                    pass

    def group_alive(self) -> bool:
        """Whether a live (not zombie) process of the rank's group remains."""
        return _group_alive(self.proc.pid)


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member that is not a zombie (orphans whose reaper is slow are
    zombies for a while; they hold nothing). Reads ``/proc`` where there is one, else asks ``killpg(pgid, 0)``."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


class _ExitOrder:
    """Ranks in the order their processes exited: a pidfd per rank in one epoll set (its ready list is FIFO, so
    the order is the kernel's, not the order in which this thread got to look). Falls back to polling in rank
    order where pidfds are missing (not Linux, or an old kernel)."""

    def __init__(self, ranks: list[RankProcess]) -> None:
        self.ranks = ranks
        self.epoll: select.epoll | None = None
        self.fds: dict[int, int] = {}
        try:
            self.epoll = select.epoll()
            for r in ranks:
                fd = os.pidfd_open(r.proc.pid)
                self.fds[fd] = r.rank
                self.epoll.register(fd, select.EPOLLIN)
        except (AttributeError, OSError):
            self.close()

    def wait(self, pending: dict[int, RankProcess], timeout: float) -> list[int]:
        """Ranks of ``pending`` that exited (reaped), oldest exit first; waits at most ``timeout`` for one."""
        if self.epoll is None:
            done = [rank for rank, r in pending.items() if r.proc.poll() is not None]
            if not done and pending:
                try:
                    next(iter(pending.values())).proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
                done = [rank for rank, r in pending.items() if r.proc.poll() is not None]
            return done
        order = []
        for fd, _ in self.epoll.poll(timeout):
            self.epoll.unregister(fd)
            rank = self.fds.pop(fd)
            os.close(fd)
            if rank in pending:
                pending[rank].proc.wait()
                order.append(rank)
        return order

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        if self.epoll is not None:
            self.epoll.close()
            self.epoll = None


def wait_ranks(ranks: list[RankProcess], result: LaunchResult, timeout: float | None, grace_s: float,
          check: Callable[[], LaunchFailure | None] | None = None) -> None:
    """Until every rank exited, one failed (the others are then stopped) or the timeout passed; ``check`` may
    declare a failure of its own (a remote host that did not start its rank)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = {r.rank: r for r in ranks}
    exits = _ExitOrder(ranks)
    try:
        while pending:
            failure = check() if check is not None else None
            if failure is not None:
                result.returncode = failure.returncode
                result.failure = failure
                stop_ranks(ranks, grace_s)
                return
            for rank in exits.wait(pending, 0.1):
                r = pending.pop(rank)
                code = r.proc.returncode
                if code != 0:
                    result.returncode = exit_code(code)
                    result.failure = LaunchFailure(rank, result.returncode, description=describe_exit(code))
                    stop_ranks(ranks, grace_s)
                    return
            if deadline is not None and time.monotonic() > deadline:
                result.timed_out = True
                result.returncode = TIMEOUT_EXIT_CODE
                stop_ranks(ranks, grace_s)
                return
    finally:
        exits.close()


def stop_ranks(ranks: list[RankProcess], grace_s: float) -> None:
    """SIGTERM to every rank's process group, then SIGKILL to the groups still alive after ``grace_s``."""
    for r in ranks:
        r.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    while time.monotonic() < deadline and any(r.group_alive() for r in ranks):
        time.sleep(0.05)  # the ranks' children, still handling SIGTERM
    for r in ranks:
        r.signal(signal.SIGKILL)


def kill_and_drain(ranks: Sequence[RankProcess], grace_s: float, job_id: str | None = None) -> None:
    """SIGKILL every rank's process group (even of ranks that succeeded: a child they left must not outlive the
    job), and with ``job_id`` every process of this host whose environment carries ``SPARK_HVD_JOB_ID=job_id``
    (what a rank started, even in a session of its own: ``rank_tree.job_processes``; named in debug logging); reap
    the ranks, then give the output pumps a moment."""
    for r in ranks:
        r.signal(signal.SIGKILL)
    if job_id and sys.platform == "linux":
        deadline = time.monotonic() + 3.0
        found = rank_tree.job_processes("SPARK_HVD_JOB_ID", job_id)
        while found and time.monotonic() < deadline:
            logger.debug("SIGKILL to processes left by the job's local ranks: %s",
                         ", ".join(f"{pid} ({name})" for pid, name in found.items()))
            rank_tree.signal_all(found, signal.SIGKILL)
            time.sleep(0.02)
            found = rank_tree.job_processes("SPARK_HVD_JOB_ID", job_id)
    for r in ranks:
        try:
            r.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("rank %d (pid %d) did not exit after SIGKILL", r.rank, r.proc.pid)
    drain = time.monotonic() + PIPE_DRAIN_S
    for r in ranks:
        for reader in r.readers:
            reader.join(timeout=max(0.0, drain - time.monotonic()))
