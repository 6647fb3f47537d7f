"""``spark-hvd-run -np N [--timeout S] [--env K=V] command ...``: N local ranks of a spark_hvd job, no Spark.

With ``-H host:slots,...`` or ``--hostfile`` the ranks run on several hosts, started through ssh
(``spark_hvd.runner.multihost``).

The launcher starts the job's key-value rendezvous service (``spark_hvd.core.transport.rendezvous.KVStoreServer``) and a
driver service for ``report(...)`` events, creates a fresh secret and job id, and starts N processes, each with
its ``JobEnv`` in the environment (``SPARK_HVD_*``: rank, size, local rank/size, cross rank/size, rendezvous,
secret, job id, driver service; a launching process's own launch variables are not handed on) and torchrun's
variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` ...: ``spark_hvd.core.torchrun``). A command
``python train.py ...`` / ``python -m mod ...`` on this interpreter starts through ``spark_hvd.runner.pyrun``, so
its ``dist.init_process_group()`` meets over the job's authenticated store. Their output lines are printed
prefixed with ``[rank]``.

Failure. The rank reported is the first to fail *by time*: the launcher watches every rank through a pidfd in one
epoll set, whose ready list is in the order the kernel saw the processes exit, so a rank SIGKILLed mid-allreduce is
blamed rather than the peer that exited 1 a moment later because its socket closed. Its real exit status is
reported (``killed by SIGKILL`` for a signal; the exit code is 128 + the signal number, as a shell reports it).
Every rank runs in a session and process group of its own; stopping the job signals each *group* (SIGTERM, then
SIGKILL after the grace period), whether or not the rank itself is still alive, so processes a rank started (data
loader workers, a ``subprocess``) do not survive it; at the end, any process of this host that still carries the
job's ``SPARK_HVD_JOB_ID`` in its environment (one that left the group: ``setsid()``, a daemon) is SIGKILLed too.
Output pipes that an escaped process may still hold are not waited on for more than a moment, so the launcher exits
promptly.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence

from spark_hvd import __version__
from spark_hvd.core import torchrun
from spark_hvd.core.jobenv import JobEnv, encrypt_requested, env_names
from spark_hvd.runner import hosts
from spark_hvd.runner.client import Event
from spark_hvd.runner.horovod_flags import add_horovod_flags
from spark_hvd.runner.job_services import JobServices
from spark_hvd.runner.multihost import run_hosts
from spark_hvd.runner.procs import (  # noqa: F401 - LaunchResult, describe_exit: part of this module's API
    TIMEOUT_EXIT_CODE,
    LaunchResult,
    RankProcess,
    describe_exit,
    kill_and_drain,
    wait_ranks,
)

logger = logging.getLogger(__name__)


def run_local(argv: Sequence[str], np: int, env: dict[str, str] | None = None, timeout: float | None = None,
              *, capture: bool = False, grace_s: float = 10.0, verbose: int = 1,
              on_event: Callable[[Event], None] | None = None, encrypt: bool | None = None) -> LaunchResult:
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
        encrypt: encrypt every frame between the ranks and with these services (``spark-hvd-run --encrypt``;
            None: ``SPARK_HVD_ENCRYPT`` of ``env`` or of this process's environment).
    """
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    if not argv:
        raise ValueError("no command given to run")
    if encrypt is None:
        encrypt = encrypt_requested({**os.environ, **(env or {})})
    job = JobServices.start(np, kv_host="127.0.0.1", bind_host="127.0.0.1", encrypt=encrypt, capture=capture,
                            verbose=verbose, on_event=on_event)
    result, sink = job.result, job.output.line
    ranks: list[RankProcess] = []
    launch_vars = set(env_names()) | set(torchrun.TORCHRUN_VARS)
    master = torchrun.master_address("127.0.0.1:0")  # local ranks: MASTER_ADDR is loopback
    from spark_hvd.runner.pyrun import launcher_python, wrap  # not at import: ``python -m ...pyrun`` imports launch

    argv = wrap(launcher_python(argv))
    try:
        for rank in range(np):
            # a launcher started inside another job's rank must not hand that job's variables on
            child_env = {k: v for k, v in os.environ.items() if k not in launch_vars}
            child_env.update(env or {})
            contract = JobEnv(rank=rank, size=np, local_rank=rank, local_size=np, job_id=job.job_id, secret=job.secret,
                              rendezvous=f"{job.kv_host}:{job.kv_port}",
                              service_address=f"127.0.0.1:{job.service_port}", encrypt=encrypt)
            child_env.update(contract.to_env())
            child_env.update(torchrun.torchrun_env(contract, *master))
            child_env["PYTHONUNBUFFERED"] = "1"
            proc = subprocess.Popen(list(argv), env=child_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
            ranks.append(RankProcess(rank, proc, sink))
        wait_ranks(ranks, result, timeout, grace_s)
    finally:
        kill_and_drain(ranks, grace_s, job.job_id)
        job.finish(ranks)
    if result.failure is not None:
        result.failure.stderr_tail = list(ranks[result.failure.rank].stderr_tail)
    return result


def _parse_env(items: Sequence[str]) -> dict[str, str]:
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``spark-hvd-run``."""
    parser = argparse.ArgumentParser(
        prog="spark-hvd-run",
        description="Run the ranks of a spark_hvd job (no Spark needed): spark-hvd-run -np 2 python train.py, or "
                    "across hosts through ssh: spark-hvd-run -np 4 -H host1:2,host2:2 python train.py")
    parser.add_argument("-v", "--version", action="version", version=f"spark_hvd {__version__}")
    parser.add_argument("-np", "--num-proc", dest="np", type=int, default=None,
                        help="number of ranks (default with -H/--hostfile: every slot)")
    parser.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
                        help="hosts and their slots, e.g. host1:2,host2:2; ranks fill them in this order")
    parser.add_argument("--hostfile", "-hostfile", default=None, metavar="FILE",
                        help="a file of 'host slots=N' lines (instead of -H)")
    parser.add_argument("--ssh-command", default="ssh", metavar="CMD",
                        help="the remote shell, called as ssh is: CMD [ssh options] HOST 'shell command' "
                             "(default ssh)")
    parser.add_argument("-p", "--ssh-port", type=int, default=None, help="ssh port of the hosts")
    parser.add_argument("-i", "--ssh-identity-file", default=None, metavar="FILE", help="ssh identity file")
    parser.add_argument("--network-interface", "--network-interfaces", default=None, metavar="IFACE[,IFACE]",
                        help="the network interface(s) the ranks use (sets SPARK_HVD_NETWORK_INTERFACE)")
    parser.add_argument("-x", dest="forward", action="append", default=[], metavar="VAR[=VALUE]",
                        help="hand this environment variable to every rank (repeatable); remote ranks otherwise "
                             "get their login environment")
    parser.add_argument("--remote-python", default=None, metavar="PYTHON",
                        help="the interpreter that starts each rank on the other hosts (a path, or a name on their "
                             "PATH; default SPARK_HVD_REMOTE_PYTHON, else this interpreter's path where a host has "
                             "it, else python3 there); it must import spark_hvd. The command itself runs as given")
    parser.add_argument("--start-timeout", type=float, default=30.0,
                        help="seconds a host has to start its ranks (default 30)")
    parser.add_argument("--ssh-connect-timeout", type=float, default=10.0, metavar="S",
                        help="seconds a host's remote shell has to answer, whatever --ssh-command is (default 10; "
                             "ssh's ConnectTimeout); it runs with no terminal, so a password prompt fails at once")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds the whole job may run; past it every rank is stopped (exit code 124)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for every rank (repeatable)")
    parser.add_argument("--encrypt", action="store_true", default=None,
                        help="encrypt every frame between the ranks and with the launcher's services (AES-256-GCM; "
                             "shared memory within a host is unchanged); default: SPARK_HVD_ENCRYPT")
    parser.add_argument("--grace", type=float, default=10.0,
                        help="seconds between SIGTERM and SIGKILL when stopping ranks (default 10)")
    parser.add_argument("--verbose", type=int, default=1,
                        help="0: no progress lines; 1: per epoch; 2: every report, and each process the other "
                             "hosts killed when a rank ended")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs")
    add_horovod_flags(parser)  # horovodrun's other flags: an error naming what to write instead
    return parser


def _placements(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[hosts.Placement] | None:
    """The ranks' hosts from -H / --hostfile (None: every rank local, ``run_local``)."""
    if args.hosts and args.hostfile:
        parser.error("give -H or --hostfile, not both")
    try:
        if args.hostfile:
            with open(args.hostfile) as f:
                listed = hosts.parse_hostfile(f.read(), args.hostfile)
        elif args.hosts:
            listed = hosts.parse_hosts(args.hosts)
        else:
            return None
        return hosts.place(listed, args.np)
    except OSError as exc:
        parser.error(f"cannot read --hostfile: {exc}")
    except ValueError as exc:
        parser.error(str(exc))
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``spark-hvd-run`` and ``python -m spark_hvd.runner``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        parser.error("no command given (e.g. spark-hvd-run -np 2 python train.py)")
    placements = _placements(parser, args)
    if placements is None and args.np is None:
        parser.error("give -np N (or -H host:slots,... / --hostfile)")
    if placements is None and args.np < 1:
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
        if placements is None:
            if args.network_interface:
                env["SPARK_HVD_NETWORK_INTERFACE"] = args.network_interface
            for item in args.forward:
                key, sep, value = item.partition("=")
                if sep:
                    env[key] = value
            result = run_local(command, args.np, env=env, timeout=args.timeout, grace_s=args.grace,
                               verbose=args.verbose, encrypt=args.encrypt)
        else:
            result = run_hosts(command, placements, ssh_command=shlex.split(args.ssh_command),
                               ssh_port=args.ssh_port, identity_file=args.ssh_identity_file, env=env,
                               forward=args.forward, network_interface=args.network_interface,
                               timeout=args.timeout, start_timeout=args.start_timeout,
                               connect_timeout=args.ssh_connect_timeout, remote_python=args.remote_python,
                               grace_s=args.grace, verbose=args.verbose, encrypt=args.encrypt)
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
