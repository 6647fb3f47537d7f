"""``spark-hvd-run -np N [--timeout S] [--env K=V] command ...``: N local ranks of a spark_hvd job, no Spark.

The launcher starts the job's key-value rendezvous service (``spark_hvd.core.rendezvous.KVStoreServer``) and a
driver service for ``report(...)`` events, creates a fresh secret and job id, and starts N processes, each with
its ``JobEnv`` in the environment (``SPARK_HVD_*``: rank, size, local rank/size, cross rank/size, rendezvous,
secret, job id, driver service; a launching process's own launch variables are not handed on). Their
output lines are printed prefixed with ``[rank]``.

Failure. The rank reported is the first to fail *by time*: the launcher watches every rank through a pidfd in one
epoll set, whose ready list is in the order the kernel saw the processes exit, so a rank SIGKILLed mid-allreduce is
blamed rather than the peer that exited 1 a moment later because its socket closed. Its real exit status is
reported (``killed by SIGKILL`` for a signal; the exit code is 128 + the signal number, as a shell reports it).
Every rank runs in a session and process group of its own; stopping the job signals each *group* (SIGTERM, then
SIGKILL after the grace period), whether or not the rank itself is still alive, so processes a rank started (data
loader workers, a ``subprocess``) do not survive it. Output pipes that an escaped process may still hold are not
waited on for more than a moment, so the launcher exits promptly.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import secrets
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

from spark_hvd.core.jobenv import JobEnv, env_names
from spark_hvd.core.wire import make_secret
from spark_hvd.runner.client import Event
from spark_hvd.runner.errors import LaunchFailure
from spark_hvd.runner.service import DriverService

logger = logging.getLogger(__name__)

TIMEOUT_EXIT_CODE = 124
STDERR_TAIL_LINES = 20
#: Seconds the launcher waits for output pipes after every process group got SIGKILL.
PIPE_DRAIN_S = 1.0


@dataclass
class LaunchResult:
    """Outcome of ``run_local``.

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


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """``exited with code 3`` or ``was killed by SIGKILL`` for a ``Popen.returncode``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (exit code {_exit_code(returncode)})"
    return f"exited with code {returncode}"


class _Rank:
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

    def __init__(self, ranks: list[_Rank]) -> None:
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

    def wait(self, pending: dict[int, _Rank], timeout: float) -> list[int]:
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


def run_local(argv: Sequence[str], np: int, env: dict[str, str] | None = None, timeout: float | None = None,
              *, capture: bool = False, grace_s: float = 10.0, verbose: int = 1,
              on_event: Callable[[Event], None] | None = None) -> LaunchResult:
    """Run ``argv`` as ``np`` local ranks of one job and wait for them (the Python API of ``spark-hvd-run``).

    Args:
        argv: the command of every rank, e.g. ``[sys.executable, "train.py", "--epochs", "2"]``.
        np: number of ranks.
        env: extra environment variables for every rank (on top of this process's environment).
        timeout: seconds the whole job may run; past it every rank is stopped and the result's returncode is 124.
        capture: keep the prefixed output lines in the result instead of printing them.
        grace_s: seconds between SIGTERM and SIGKILL when stopping ranks.
        verbose: as in ``run``: 0 prints no progress events, 1 rank 0's per-epoch events, 2 all.
        on_event: called with each ``report(...)`` event.
    """
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    if not argv:
        raise ValueError("no command given to run")
    from spark_hvd.core.rendezvous import KVStoreServer

    secret = make_secret()
    job_id = secrets.token_hex(4)
    result = LaunchResult(returncode=0)
    print_lock = threading.Lock()

    def sink(rank: int, stream: str, line: str) -> None:
        text = f"[{rank}] {line}"
        with print_lock:
            if capture:
                (result.stderr if stream == "stderr" else result.stdout).append(text)
            else:
                out = sys.stderr if stream == "stderr" else sys.stdout
                out.write(text + "\n")
                out.flush()

    def add_event(event: Event) -> None:
        result.events.append(event)
        if on_event is not None:
            on_event(event)

    kv = KVStoreServer(secret)
    kv_host, kv_port = kv.start()
    service = DriverService(secret, np, job_id=job_id, verbose=0 if capture else verbose, on_event=add_event,
                            bind_host="127.0.0.1")
    _, service_port = service.start()
    ranks: list[_Rank] = []
    launch_vars = set(env_names())
    try:
        for rank in range(np):
            # a launcher started inside another job's rank must not hand that job's variables on
            child_env = {k: v for k, v in os.environ.items() if k not in launch_vars}
            child_env.update(env or {})
            job = JobEnv(rank=rank, size=np, local_rank=rank, local_size=np, job_id=job_id, secret=secret,
                         rendezvous=f"{kv_host}:{kv_port}", service_address=f"127.0.0.1:{service_port}")
            child_env.update(job.to_env())
            child_env["PYTHONUNBUFFERED"] = "1"
            proc = subprocess.Popen(list(argv), env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            ranks.append(_Rank(rank, proc, sink))
        _wait(ranks, result, timeout, grace_s)
    finally:
        for r in ranks:  # every group, even of ranks that succeeded: a child they left must not outlive the job
            r.signal(signal.SIGKILL)
        for r in ranks:
            try:
                r.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("rank %d (pid %d) did not exit after SIGKILL", r.rank, r.proc.pid)
        # A process that left its group (setsid) may still hold a pipe: wait a moment, not for it.
        drain = time.monotonic() + PIPE_DRAIN_S
        for r in ranks:
            for reader in r.readers:
                reader.join(timeout=max(0.0, drain - time.monotonic()))
        result.returncodes = [r.proc.returncode for r in ranks]
        service.wait_finished(5.0 if result.returncode == 0 else PIPE_DRAIN_S, only_started=True)
        service.stop()
        kv.stop()
    if result.failure is not None:
        result.failure.stderr_tail = list(ranks[result.failure.rank].stderr_tail)
    return result


def _wait(ranks: list[_Rank], result: LaunchResult, timeout: float | None, grace_s: float) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = {r.rank: r for r in ranks}
    exits = _ExitOrder(ranks)
    try:
        while pending:
            for rank in exits.wait(pending, 0.1):
                r = pending.pop(rank)
                code = r.proc.returncode
                if code != 0:
                    result.returncode = _exit_code(code)
                    result.failure = LaunchFailure(rank, result.returncode, description=describe_exit(code))
                    _stop(ranks, grace_s)
                    return
            if deadline is not None and time.monotonic() > deadline:
                result.timed_out = True
                result.returncode = TIMEOUT_EXIT_CODE
                _stop(ranks, grace_s)
                return
    finally:
        exits.close()


def _stop(ranks: list[_Rank], grace_s: float) -> None:
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


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spark-hvd-run",
        description="Run N local ranks of a spark_hvd job (no Spark needed): spark-hvd-run -np 2 python train.py")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds the whole job may run; past it every rank is stopped (exit code 124)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for every rank (repeatable)")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)")
    parser.add_argument("--verbose", type=int, default=1, help="0: no progress lines; 1: per epoch; 2: every report")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``spark-hvd-run`` and ``python -m spark_hvd.runner``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given (e.g. spark-hvd-run -np 2 python train.py)")
    if args.np < 1:
        parser.error(f"-np must be >= 1, got {args.np}")
    try:
        env = _parse_env(args.env)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.WARNING, format="spark-hvd-run: %(levelname)s %(message)s")

    def on_signal(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        result = run_local(command, args.np, env=env, timeout=args.timeout, grace_s=args.grace,
                           verbose=args.verbose)
    except KeyboardInterrupt:
        sys.stderr.write("spark-hvd-run: interrupted; all ranks stopped\n")
        return 130
    except FileNotFoundError as exc:
        sys.stderr.write(f"spark-hvd-run: cannot start {command[0]!r}: {exc}\n")
        return 127
    finally:
        signal.signal(signal.SIGTERM, previous)
    if result.timed_out:
        sys.stderr.write(f"spark-hvd-run: the job ran past --timeout {args.timeout:g} s; all ranks stopped "
                         f"(exit code {TIMEOUT_EXIT_CODE})\n")
    elif result.failure is not None:
        failure = result.failure
        sys.stderr.write(f"spark-hvd-run: rank {failure.rank} {failure.description}, the first rank to fail; "
                         f"the other ranks were stopped.\n")
        if failure.stderr_tail:
            sys.stderr.write(f"spark-hvd-run: last lines of rank {failure.rank}'s stderr:\n")
            sys.stderr.write("".join(f"    {line}\n" for line in failure.stderr_tail))
    sys.stderr.flush()
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
