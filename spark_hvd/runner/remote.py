"""The remote end of ``spark-hvd-run -H``: what runs on a host, started through ssh, for one rank.

The launcher runs ``CMD [ssh options] HOST 'cd DIR; exec PYTHON -c BOOTSTRAP'`` (``remote_command``). Nothing
about the job is on that command line: the bootstrap reads one JSON line from stdin holding the rank's
environment (its ``JobEnv``, the job secret among it, and the variables forwarded with ``-x``), the command and
the working directory, and hands it to ``serve``. Before reading anything it writes ``CONNECTED_MARK`` to stderr:
the launcher's proof that the remote shell answered (ssh connected and authenticated, the host's Python started),
which it expects within ``--ssh-connect-timeout`` whatever the remote-shell command is. ``serve``

* starts the rank's command with that environment (stdout and stderr inherited: they travel back through ssh, where
  the launcher prefixes them with ``[rank]``), in this process's group, and with ``PR_SET_PDEATHSIG`` so the rank
  dies with it;
* writes ``STARTED_MARK`` to stderr once the rank is started (the launcher's proof that the host was reached);
* keeps reading stdin: end of file (the launcher stopped the job, or ssh died) and SIGTERM/SIGHUP stop the rank
  (SIGTERM to the group, SIGKILL after the grace period), so no rank outlives its launcher on any host;
* exits with the rank's exit code (128 + the signal number for a signal), after writing ``EXIT_MARK`` with the
  code and the time of the rank's exit.
"""

from __future__ import annotations

import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

#: The first line the remote end writes to stderr, before it reads its request (the launcher drops it from the output).
CONNECTED_MARK = "\x1fspark-hvd-run: remote shell answered\x1f"
#: A line the remote end writes to stderr once the rank process exists (the launcher drops it from the output).
STARTED_MARK = "\x1fspark-hvd-run: rank started\x1f"
#: Begins the last line the remote end writes to stderr: ``EXIT_MARK <exit code> <time.time() of the exit>``, so the
#: launcher can tell which rank failed first even though ssh reorders the exits it sees.
EXIT_MARK = "\x1fspark-hvd-run: rank exited\x1f"

_BOOTSTRAP = ("import json,sys;sys.stderr.write('\\x1fspark-hvd-run: remote shell answered\\x1f\\n');"
              "sys.stderr.flush();c=json.loads(sys.stdin.readline());sys.path[:0]=c['path'];"
              "from spark_hvd.runner.remote import serve;serve(c)")

_PR_SET_PDEATHSIG = 1


def remote_command(python: str, cwd: str) -> str:
    """The shell command given to ssh: no job data on it (that comes on stdin)."""
    return f"cd {shlex.quote(cwd)} >/dev/null 2>&1; exec {shlex.quote(python)} -u -c {shlex.quote(_BOOTSTRAP)}"


def request(argv: Sequence[str], env: Mapping[str, str], cwd: str, grace_s: float,
            path: Sequence[str] = ()) -> bytes:
    """The JSON line sent on the ssh process's stdin: the rank's command, environment and directory."""
    return (json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd, "grace": grace_s,
                        "path": list(path)}) + "\n").encode()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def serve(config: Mapping[str, Any]) -> None:
    """Run one rank as ``config`` says (``request``) and exit with its exit code; see the module docstring."""
    env = dict(os.environ)
    env.update(config["env"])
    try:
        os.setpgid(0, 0)  # a group of our own, to stop the rank's children with it (a session leader has one)
    except OSError:
        pass
    own_group = os.getpgid(0) == os.getpid()
    try:
        os.chdir(config["cwd"])
    except OSError:
        pass
    grace = float(config.get("grace", 10.0))
    try:
        proc = subprocess.Popen(list(config["argv"]), env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    except OSError as exc:
        sys.stderr.write(f"spark-hvd-run: cannot start {config['argv'][0]!r}: {exc}\n")
        sys.stderr.flush()
        os._exit(127)
    sys.stderr.write(STARTED_MARK + "\n")
    sys.stderr.flush()
    stopping = threading.Event()

    def stop(*_: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        _stop_rank(proc, grace, own_group)

    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: threading.Thread(target=stop, daemon=True).start())

    def watch_stdin() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        if proc.poll() is None:
            stop()

    threading.Thread(target=watch_stdin, daemon=True, name="spark-hvd-run-stdin").start()
    code = proc.wait()
    exited_at = time.time()
    if own_group:  # the rank's children share this process group: none of them may outlive the rank
        _signal_group(signal.SIGKILL)
    code = 128 - code if code < 0 else code
    sys.stdout.flush()
    sys.stderr.write(f"{EXIT_MARK} {code} {exited_at:.6f}\n")
    sys.stderr.flush()
    os._exit(code)


def _signal_group(signum: int) -> None:
    """Signal every process of this process group but this one (the rank and its children)."""
    group, me = os.getpgid(0), os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            try:
                os.kill(int(entry), signum)
            except (ProcessLookupError, PermissionError):
                pass


def _stop_rank(proc: subprocess.Popen, grace_s: float, own_group: bool) -> None:
    """SIGTERM to the rank (and, in a group of our own, its children), SIGKILL after ``grace_s``."""
    def send(signum: int) -> None:
        if own_group:
            _signal_group(signum)
        elif proc.poll() is None:
            proc.send_signal(signum)

    send(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    send(signal.SIGKILL)
