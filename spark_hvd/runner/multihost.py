"""``spark-hvd-run -H host1:2,host2:2`` (or ``--hostfile``): ranks on several hosts, started through ssh.

``run_hosts`` places the ranks in host order (``spark_hvd.runner.hosts``), starts the job's rendezvous and driver
services on an address the hosts can reach (the named interface's, else the one routed towards the first remote
host), and starts each rank's remote end (``spark_hvd.runner.remote``): through ``sh`` when its host is this
machine, else as ``CMD [ssh options] HOST 'shell command'`` (``CMD`` is ``ssh`` or ``--ssh-command``; options
``-p PORT``, ``-i FILE`` and, for ssh itself, ``-o BatchMode=yes -o ConnectTimeout=N``). No rank starts before
every host's remote end is ready (its Python found, spark_hvd imported: ``READY_MARK``); then each gets ``go``.
The shell command carries nothing of the job: the rank's environment, the job secret among it, goes on the ssh
process's stdin (``spark_hvd.runner.remote``), which stays open while the rank runs; closing it stops the rank, and
every process it started, on its host.

Output lines keep the ``[rank]`` prefix. The first rank to fail is named with its host; the launcher then stops
every rank through its remote end's stdin (the ssh or sh process's; SIGKILL to its process group only after the
grace period and the remote end's own sweep, ``_remote_stop_s``).

A host is named in a clear error when its ssh exits with 255 (unreachable, refused, authentication failed), when its
remote shell does not answer within ``connect_timeout`` seconds (``--ssh-connect-timeout``, 10 by default: the
bootstrap's first line, written before it reads anything, proves that the command connected and the host's Python
started), or when it does not start its rank within ``start_timeout`` (a wrong path, a hung import). That watch is
the equivalent of ssh's ``ConnectTimeout`` for any ``--ssh-command``; and whatever the command, it runs with no
terminal (a session of its own) and ``SSH_ASKPASS_REQUIRE=never`` (unless set), the equivalent of ``BatchMode``: an
ssh anywhere inside it that would ask for a password or a passphrase fails at once (exit 255) instead of waiting.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from spark_hvd.core import torchrun
from spark_hvd.core.jobenv import JobEnv, encrypt_requested, env_names
from spark_hvd.core.transport.addresses import (
    NETWORK_INTERFACE_ENV,
    AddressError,
    interface_address,
    non_loopback_address,
    route_towards,
)
from spark_hvd.runner import rank_tree
from spark_hvd.runner.client import Event
from spark_hvd.runner.errors import LaunchFailure
from spark_hvd.runner.hosts import Placement, is_local_host
from spark_hvd.runner.job_services import JobServices
from spark_hvd.runner.procs import (
    LaunchResult,
    RankProcess,
    describe_exit,
    kill_and_drain,
    wait_ranks,
)
from spark_hvd.runner.remote import (
    CONNECTED_MARK,
    EXIT_MARK,
    GO,
    NO_IMPORT_MARK,
    NO_PYTHON_MARK,
    READY_MARK,
    REMOTE_PYTHON_ENV,
    STARTED_MARK,
    python_candidates,
    remote_command,
    request,
)

logger = logging.getLogger(__name__)

#: ssh's exit status when it could not connect (or authenticate).
SSH_FAILED = 255
#: Seconds a remote shell has to answer by default (ssh's ``ConnectTimeout``, and the launcher's own watch).
CONNECT_TIMEOUT_S = 10.0
#: MASTER_PORT of the ranks (torchrun's default).
TORCHRUN_PORT = 29500


def ssh_argv(command: Sequence[str], host: str, shell_command: str, port: int | None = None,
             identity_file: str | None = None, connect_timeout_s: float = 10.0) -> list[str]:
    """``CMD [ssh options] HOST 'shell command'``; the ``-o`` options only for ssh itself."""
    argv = list(command)
    if os.path.basename(argv[0]) == "ssh":
        argv += ["-o", "BatchMode=yes", "-o", f"ConnectTimeout={max(1, int(connect_timeout_s))}",
                 "-o", "StrictHostKeyChecking=accept-new"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity_file:
        argv += ["-i", identity_file]
    return argv + [host, shell_command]


def rendezvous_host(placements: Sequence[Placement], remote: Sequence[bool],
                    environ: Mapping[str, str] | None = None) -> str:
    """The address this launcher's services publish: the named interface's, else the route towards the first
    remote host, else a non-loopback address of this host; loopback when every rank is local."""
    env = os.environ if environ is None else environ
    if not any(remote):
        return "127.0.0.1"
    names = [n.strip() for n in (env.get(NETWORK_INTERFACE_ENV) or "").split(",") if n.strip()]
    first = next(p.host for p, r in zip(placements, remote, strict=True) if r)
    if names:
        try:
            return interface_address(names)
        except AddressError as exc:  # the launcher's host may sit outside the data network: route to the hosts
            logger.warning("%s; the launcher's services use the route towards %s instead", exc, first)
    return route_towards(first) or non_loopback_address()


class _Marks:
    """Which remote ranks' remote shells answered (``CONNECTED_MARK``), for the connect timeout, which have started
    (their ``STARTED_MARK`` line arrived), for the start timeout, when remote ranks exited with which code
    (``EXIT_MARK``), to name the first that failed, and which hosts have no usable Python (``NO_PYTHON_MARK``,
    ``NO_IMPORT_MARK``)."""

    def __init__(self) -> None:
        self.connected: set[int] = set()
        self.ready: set[int] = set()  # imported spark_hvd, waiting for GO
        self.started: set[int] = set()
        self.exits: dict[int, tuple[float, int]] = {}
        self.unusable: dict[int, str] = {}  # rank -> why its host cannot run the remote end (no Python, no spark_hvd)
        self.lock = threading.Lock()


def run_hosts(argv: Sequence[str], placements: Sequence[Placement], *, ssh_command: Sequence[str] = ("ssh",),
              ssh_port: int | None = None, identity_file: str | None = None,
              env: Mapping[str, str] | None = None, forward: Sequence[str] = (),
              network_interface: str | None = None, timeout: float | None = None, start_timeout: float = 30.0,
              connect_timeout: float = CONNECT_TIMEOUT_S, remote_python: str | None = None,
              capture: bool = False, grace_s: float = 10.0, verbose: int = 1,
              on_event: Callable[[Event], None] | None = None, encrypt: bool | None = None) -> LaunchResult:
    """Run ``argv`` as one rank per placement (``hosts.place``) and wait for them.

    Args:
        argv: every rank's command.
        placements: where each rank runs.
        ssh_command: the remote-shell command (``ssh``, or any command called as ssh is).
        ssh_port / identity_file: ssh's ``-p`` / ``-i``.
        env: variables for every rank (on every host).
        forward: names of this process's environment variables to hand to every rank (``-x``; ``NAME=VALUE``
            sets one); remote ranks otherwise get their login environment, not this one.
        network_interface: interface(s) the ranks (and these services) use: sets ``SPARK_HVD_NETWORK_INTERFACE``.
        timeout: seconds the whole job may run (exit code 124 past it).
        start_timeout: seconds a remote host has to start its rank.
        connect_timeout: seconds the remote shell has to answer (connect, authenticate, start the host's Python),
            whatever ``ssh_command`` is; ssh itself also gets ``-o ConnectTimeout``. The remote shell runs with no
            terminal and ``SSH_ASKPASS_REQUIRE=never`` (unless set), so a host that asks for a password fails at
            once instead of waiting for an answer.
        remote_python: the interpreter that runs the remote end on every host (a path, or a name looked up on the
            host's PATH); by default ``SPARK_HVD_REMOTE_PYTHON``, else this interpreter's path where the host has
            it, else ``python3`` on the host's PATH. A host with none of them, or whose interpreter cannot import
            spark_hvd, is named before any rank starts there. The ranks' own command runs as given.
        capture, grace_s, verbose, on_event, encrypt: as in ``launch.run_local``.
    """
    if not argv:
        raise ValueError("no command given to run")
    np = len(placements)
    remote = [not is_local_host(p.host) for p in placements]
    extra = dict(env or {})
    for item in forward:
        key, sep, value = item.partition("=")
        if sep:
            extra[key] = value
        elif key in os.environ:
            extra[key] = os.environ[key]
    if network_interface:
        extra[NETWORK_INTERFACE_ENV] = network_interface
    host = rendezvous_host(placements, remote, {**os.environ, **extra})
    bind = "" if any(remote) else "127.0.0.1"
    if encrypt is None:
        encrypt = encrypt_requested({**os.environ, **extra})
    job = JobServices.start(np, kv_host=bind or "0.0.0.0", bind_host=bind, encrypt=encrypt, capture=capture,
                            verbose=verbose, on_event=on_event)
    result, output = job.result, job.output
    marks = _Marks()

    def sink(rank: int, stream: str, line: str) -> None:
        if stream == "stderr" and line == CONNECTED_MARK:
            with marks.lock:
                marks.connected.add(rank)
            return
        if stream == "stderr" and line == READY_MARK:
            with marks.lock:
                marks.ready.add(rank)
            return
        if stream == "stderr" and line == STARTED_MARK:
            with marks.lock:
                marks.started.add(rank)
            return
        if stream == "stderr" and line.startswith((NO_PYTHON_MARK, NO_IMPORT_MARK)):
            with marks.lock:
                marks.unusable[rank] = _unusable_reason(line, placements[rank].host)
            return
        if stream == "stderr" and line.startswith(EXIT_MARK):
            code, at = line[len(EXIT_MARK):].split()
            with marks.lock:
                marks.exits[rank] = (float(at), int(code))
            return
        output.line(rank, stream, line)

    ranks: list[RankProcess] = []
    launch_vars = set(env_names()) | set(torchrun.TORCHRUN_VARS)
    # torchrun's variables too; MASTER_ADDR is rank 0's host, MASTER_PORT torchrun's default (only code that opens
    # its own TCPStore binds it: ``env://`` is answered over the job's store, through ``pyrun``)
    master = (placements[0].host if remote[0] else host, TORCHRUN_PORT)
    from spark_hvd.runner.pyrun import wrap  # not at import: ``python -m spark_hvd.runner.pyrun`` imports launch

    argv = wrap(argv)
    started_at = time.monotonic()
    cwd = os.getcwd()
    pythonpath = [p for p in extra.get("PYTHONPATH", "").split(os.pathsep) if p]
    # no terminal (a session of its own) and no askpass program: a remote shell cannot wait for a password
    shell_env = {**os.environ, "SSH_ASKPASS_REQUIRE": os.environ.get("SSH_ASKPASS_REQUIRE", "never")}
    pythons = python_candidates(remote_python or os.environ.get(REMOTE_PYTHON_ENV), sys.executable)
    try:
        for p, is_remote in zip(placements, remote, strict=True):
            contract = JobEnv(rank=p.rank, size=np, local_rank=p.local_rank, local_size=p.local_size,
                              cross_rank=p.cross_rank, cross_size=p.cross_size, job_id=job.job_id, secret=job.secret,
                              rendezvous=f"{host}:{job.kv_port}", service_address=f"{host}:{job.service_port}",
                              encrypt=encrypt)
            rank_env = {**extra, **contract.to_env(), **torchrun.torchrun_env(contract, *master),
                        "PYTHONUNBUFFERED": "1"}
            if is_remote:
                shell_argv = ssh_argv(ssh_command, p.host, remote_command(pythons, cwd), ssh_port, identity_file,
                                      min(connect_timeout, start_timeout))
                popen_env = shell_env
            else:  # this host's ranks run under the same remote end, through sh: gated, and their processes tracked
                shell_argv = ["sh", "-c", remote_command([sys.executable], cwd)]
                popen_env = {k: v for k, v in os.environ.items() if k not in launch_vars}
            proc = subprocess.Popen(shell_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True, env=popen_env)
            _send(proc, request(argv, rank_env, cwd, grace_s, pythonpath, verbose, gate=True))
            ranks.append(RankProcess(p.rank, proc, sink))
        released = False

        def check() -> LaunchFailure | None:
            nonlocal released
            if not released and len(marks.ready) == np:  # every host can run its rank: start them all
                released = True
                for r in ranks:
                    _send(r.proc, GO)
            for r in ranks:
                code = r.proc.poll()
                if code is not None and r.rank in marks.unusable:
                    return LaunchFailure(r.rank, code, description=marks.unusable[r.rank])
                if remote[r.rank] and code == SSH_FAILED and r.rank not in marks.started:
                    return _unreachable(r, placements[r.rank].host, f"{ssh_command[0]} exited with code {code}")
            waited = time.monotonic() - started_at
            if waited >= connect_timeout:
                with marks.lock:
                    silent = [r for r in ranks if r.rank not in marks.connected]
                if silent:
                    return _unreachable(silent[0], placements[silent[0].rank].host,
                                        f"its remote shell did not answer within {connect_timeout:g} s "
                                        "(--ssh-connect-timeout)")
            if waited < start_timeout:
                return None
            with marks.lock:  # a host not ready first (the others wait for it), then one that did not start
                late = ([r for r in ranks if r.rank not in marks.ready]
                        or [r for r in ranks if r.rank not in marks.started])
            if late:
                return _unreachable(late[0], placements[late[0].rank].host,
                                    f"its rank did not start within {start_timeout:g} s")
            return None

        wait_ranks(ranks, result, timeout, _remote_stop_s(grace_s), check=check)
    finally:
        _stop_all(ranks, grace_s, job.job_id)
        job.finish(ranks)
    if result.failure is not None and marks.unusable:  # a host that could not run the remote end comes first
        rank = min(marks.unusable)
        code = ranks[rank].proc.returncode or 127
        result.failure = LaunchFailure(rank, code, description=marks.unusable[rank])
        result.returncode = code
    elif result.failure is not None and not result.failure.description.startswith("could not be started"):
        # ssh hands exits on in its own order: the first failure by the ranks' own exit times wins
        failed = sorted((at, rank, code) for rank, (at, code) in marks.exits.items() if code != 0)
        if failed and failed[0][1] != result.failure.rank:
            _, rank, code = failed[0]
            result.failure = LaunchFailure(rank, code, description=describe_exit(code if code < 128 else 128 - code))
            result.returncode = code
    if result.failure is not None:
        failure = result.failure
        if (remote[failure.rank] and failure.returncode == SSH_FAILED and failure.rank not in marks.started
                and not failure.description.startswith("could not be started")):
            failure.description = _unreachable(ranks[failure.rank], placements[failure.rank].host,
                                               f"{ssh_command[0]} exited with code {SSH_FAILED}").description
        failure.stderr_tail = [line for line in ranks[failure.rank].stderr_tail
                               if line != STARTED_MARK and not line.startswith(EXIT_MARK)]
        where = placements[failure.rank].host
        if f"host {where}" not in failure.description:
            failure.description = f"on host {where} {failure.description}"
    return result


def _unreachable(r: RankProcess, host: str, why: str) -> LaunchFailure:
    return LaunchFailure(r.rank, SSH_FAILED, description=f"could not be started on host {host} ({why}): check "
                         "that the host is reachable and accepts ssh without a password (-p, -i, --ssh-command)")


def _remote_stop_s(grace_s: float) -> float:
    """How long the launcher lets a remote end stop its rank before it SIGKILLs the ssh (or sh) process: the rank's
    grace period, then up to ``KILL_WITHIN_S`` to kill what it left; killing it sooner would only cut the channel."""
    return grace_s + rank_tree.KILL_WITHIN_S + 1.0


def _send(proc: subprocess.Popen, data: bytes) -> None:
    """``data`` to a remote end's stdin, which stays open (its end stops the rank); a remote shell that already
    exited (unreachable host, no Python) is left to its exit code and stderr to explain."""
    assert proc.stdin is not None
    try:
        proc.stdin.write(data)
        proc.stdin.flush()
    except BrokenPipeError:
        pass


def _unusable_reason(line: str, host: str) -> str:
    """The failure's description for a host whose remote end could not run (``NO_PYTHON_MARK`` /
    ``NO_IMPORT_MARK`` line)."""
    remedy = (f"install spark_hvd there, or name an interpreter that has it with --remote-python PATH "
              f"(or {REMOTE_PYTHON_ENV})")
    if line.startswith(NO_PYTHON_MARK):
        tried = line[len(NO_PYTHON_MARK):].split()
        return (f"could not be started on host {host} (no Python interpreter there: tried "
                f"{', '.join(tried) or 'none'}): {remedy}")
    what = line[len(NO_IMPORT_MARK):].strip()
    return f"could not be started on host {host} (cannot import spark_hvd with {what}): {remedy}"


def _stop_all(ranks: Sequence[RankProcess], grace_s: float, job_id: str) -> None:
    """Every rank down: stdin of the ssh processes closed (their remote end stops the rank and whatever it
    started), then every local process group SIGKILLed after the grace period, with what local ranks started in
    sessions of their own (``kill_and_drain``); output pumps given a moment."""
    for r in ranks:
        if r.proc.stdin is not None:
            try:
                r.proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + _remote_stop_s(grace_s)
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    kill_and_drain(ranks, grace_s, job_id)
