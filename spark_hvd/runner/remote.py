"""The remote end of ``spark-hvd-run -H``: what runs on a host, started through ssh, for one rank.

The launcher runs ``CMD [ssh options] HOST 'cd DIR; ... exec PYTHON -u -c BOOTSTRAP'`` (``remote_command``), where
``PYTHON`` is the first of its candidates that the host has (``--remote-python`` / ``SPARK_HVD_REMOTE_PYTHON``
alone, else the launcher's own interpreter path, else ``python3`` on the host's PATH); when it has none, the shell
writes ``NO_PYTHON_MARK`` and the candidates to stderr and exits 127, and a bootstrap that cannot import spark_hvd
writes ``NO_IMPORT_MARK``, its interpreter and the error, and exits 127: the launcher names the host with either.
Nothing about the job is on that command line: the bootstrap reads one JSON line from stdin holding the rank's
environment (its ``JobEnv``, the job secret among it, and the variables forwarded with ``-x``), the command and
the working directory, and hands it to ``serve``. Before reading anything it writes ``CONNECTED_MARK`` to stderr:
the launcher's proof that the remote shell answered (ssh connected and authenticated, the host's Python started),
which it expects within ``--ssh-connect-timeout`` whatever the remote-shell command is. ``serve``

* starts the rank's command with that environment (stdout and stderr inherited: they travel back through ssh, where
  the launcher prefixes them with ``[rank]``), with ``PR_SET_PDEATHSIG`` so the rank dies with it, a marker every
  descendant inherits (``SPARK_HVD_RANK_MARK``), and this process a child subreaper (``spark_hvd.runner.rank_tree``);
* with ``gate`` in the request, writes ``READY_MARK`` (spark_hvd imported: this host can run its rank) and waits
  for a ``go`` line on stdin, which the launcher sends once every host is ready, so no rank starts while a host
  lacks its Python (end of file instead: exit 0, nothing started);
* writes ``STARTED_MARK`` to stderr once the rank is started (the launcher's proof that the host was reached);
* keeps reading stdin: end of file (the launcher stopped the job, or ssh died) and SIGTERM/SIGHUP stop the rank
  (SIGTERM to every process of the rank: its process tree, which orphans re-join, and whatever carries its marker;
  SIGKILL after the grace period), so no rank outlives its launcher on any host;
* once the rank exited, SIGKILLs every process it left (even one that called ``setsid()``), within a bounded time,
  naming them on stderr with ``--verbose 2``;
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

from spark_hvd.runner import rank_tree

#: The first line the remote end writes to stderr, before it reads its request (the launcher drops it from the output).
CONNECTED_MARK = "\x1fspark-hvd-run: remote shell answered\x1f"
#: A line the remote end writes to stderr once the rank process exists (the launcher drops it from the output).
STARTED_MARK = "\x1fspark-hvd-run: rank started\x1f"
#: A line the remote end writes once it imported spark_hvd, before it waits for ``go`` (gated requests).
READY_MARK = "\x1fspark-hvd-run: ready\x1f"
#: The line the launcher writes to every host's stdin once all are ready (gated requests).
GO = b"go\n"
#: Begins the last line the remote end writes to stderr: ``EXIT_MARK <exit code> <time.time() of the exit>``, so the
#: launcher can tell which rank failed first even though ssh reorders the exits it sees.
EXIT_MARK = "\x1fspark-hvd-run: rank exited\x1f"
#: Begins the line the remote shell writes when none of the interpreters it was given exists: ``NO_PYTHON_MARK
#: candidate ...``.
NO_PYTHON_MARK = "\x1fspark-hvd-run: no python\x1f"
#: Begins the line the bootstrap writes when it cannot import spark_hvd: ``NO_IMPORT_MARK <interpreter>: <error>``.
NO_IMPORT_MARK = "\x1fspark-hvd-run: cannot import spark_hvd\x1f"
#: Names the interpreter a host runs the remote end with when ``--remote-python`` is not given.
REMOTE_PYTHON_ENV = "SPARK_HVD_REMOTE_PYTHON"

#: The remote end's first code: it imports ``spark_hvd.core`` too, so that an interpreter lacking spark_hvd's
#: dependencies (numpy ...) is named here rather than in the rank (``spark_hvd.runner`` itself imports them lazily).
_BOOTSTRAP = """import json,sys
sys.stderr.write("\\x1fspark-hvd-run: remote shell answered\\x1f\\n");sys.stderr.flush()
c=json.loads(sys.stdin.readline());sys.path[:0]=c["path"]
try:
    from spark_hvd.runner.remote import serve
    import spark_hvd.core
except Exception as e:
    m="\\x1fspark-hvd-run: cannot import spark_hvd\\x1f %s: %s: %s\\n"
    sys.stderr.write(m % (sys.executable, type(e).__name__, e));sys.stderr.flush();sys.exit(127)
serve(c)"""

_PR_SET_PDEATHSIG = 1


def python_candidates(remote_python: str | None, launcher_python: str) -> list[str]:
    """The interpreters a host tries, in order: ``remote_python`` alone when given, else the launcher's own path
    then ``python3`` on the host's PATH."""
    if remote_python:
        return [remote_python]
    return [launcher_python, "python3"] if launcher_python and launcher_python != "python3" else ["python3"]


def remote_command(pythons: str | Sequence[str], cwd: str) -> str:
    """The POSIX shell command given to ssh: run the bootstrap with the first of ``pythons`` the host has (a path
    that is an executable file, or a name found on the host's PATH), else write ``NO_PYTHON_MARK`` and exit 127.
    No job data on it (that comes on stdin)."""
    names = [pythons] if isinstance(pythons, str) else list(pythons)
    quoted = " ".join(shlex.quote(n) for n in names)
    tried = shlex.quote(" ".join(names))
    return (f"cd {shlex.quote(cwd)} >/dev/null 2>&1; b={shlex.quote(_BOOTSTRAP)}; for p in {quoted}; do "
            'case $p in */*) [ -f "$p" ] && [ -x "$p" ] && exec "$p" -u -c "$b";; '
            '*) command -v "$p" >/dev/null 2>&1 && exec "$p" -u -c "$b";; esac; done; '
            f"printf '\\037spark-hvd-run: no python\\037 %s\\n' {tried} >&2; exit 127")


def request(argv: Sequence[str], env: Mapping[str, str], cwd: str, grace_s: float,
            path: Sequence[str] = (), verbose: int = 1, gate: bool = False) -> bytes:
    """The JSON line sent on the ssh process's stdin: the rank's command, environment and directory; with
    ``gate``, the rank starts only when a ``GO`` line follows."""
    return (json.dumps({"argv": list(argv), "env": dict(env), "cwd": cwd, "grace": grace_s,
                        "path": list(path), "verbose": verbose, "gate": gate}) + "\n").encode()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def serve(config: Mapping[str, Any]) -> None:
    """Run one rank as ``config`` says (``request``) and exit with its exit code; see the module docstring."""
    env = dict(os.environ)
    env.update(config["env"])
    me = os.getpid()
    marker = f"{env.get('SPARK_HVD_JOB_ID', '')}.{env.get('SPARK_HVD_RANK', '')}.{me}"
    env[rank_tree.MARK_ENV] = marker
    rank_tree.become_subreaper()
    try:
        os.setpgid(0, 0)  # a group of our own (a session leader has one already)
    except OSError:
        pass
    try:
        os.chdir(config["cwd"])
    except OSError:
        pass
    grace = float(config.get("grace", 10.0))
    verbose = int(config.get("verbose", 1))
    if config.get("gate"):
        sys.stderr.write(READY_MARK + "\n")
        sys.stderr.flush()
        if sys.stdin.readline().strip() != GO.decode().strip():  # the job stopped before every host was ready
            os._exit(0)
    try:
        proc = subprocess.Popen(list(config["argv"]), env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    except OSError as exc:
        sys.stderr.write(f"spark-hvd-run: cannot start {config['argv'][0]!r}: {exc}\n")
        sys.stderr.flush()
        os._exit(127)
    sys.stderr.write(STARTED_MARK + "\n")
    sys.stderr.flush()
    stopping = threading.Event()
    rank = env.get("SPARK_HVD_RANK", "?")

    def stop(*_: object) -> None:
        if stopping.is_set():
            return
        stopping.set()
        _stop_rank(proc, grace, marker, rank, verbose)

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

    def reap() -> None:  # orphans re-parented to this subreaper must not stay zombies while the rank runs
        while proc.poll() is None:
            time.sleep(5.0)
            rank_tree.reap_children(keep=proc.pid)

    threading.Thread(target=watch_stdin, daemon=True, name="spark-hvd-run-stdin").start()
    threading.Thread(target=reap, daemon=True, name="spark-hvd-run-reaper").start()
    code = proc.wait()
    exited_at = time.time()
    _kill_left(marker, proc.pid, rank, verbose)  # none of the rank's processes may outlive it
    code = 128 - code if code < 0 else code
    sys.stdout.flush()
    sys.stderr.write(f"{EXIT_MARK} {code} {exited_at:.6f}\n")
    sys.stderr.flush()
    os._exit(code)


def _kill_left(marker: str, keep: int, rank: str, verbose: int) -> None:
    """SIGKILL every process the rank left (``rank_tree.kill_until_gone``), naming them with ``--verbose 2``."""
    killed, alive = rank_tree.kill_until_gone(os.getpid(), marker, keep)
    if verbose >= 2 and killed:
        sys.stderr.write(f"spark-hvd-run: rank {rank}: SIGKILL to {_named(killed)} it left\n")
    if alive:
        sys.stderr.write(f"spark-hvd-run: rank {rank}: process(es) {alive} still alive after SIGKILL\n")
    sys.stderr.flush()


def _named(found: Mapping[int, str]) -> str:
    return f"{len(found)} process(es): " + ", ".join(f"{pid} ({name})" for pid, name in found.items())


def _rank_and_its(proc: subprocess.Popen, me: int, marker: str) -> dict[int, str]:
    """The rank while it runs (even where ``/proc`` cannot be read) and every process of it ``/proc`` shows."""
    alive = {proc.pid: "rank"} if proc.poll() is None else {}
    return {**alive, **rank_tree.rank_processes(me, marker)}


def _stop_rank(proc: subprocess.Popen, grace_s: float, marker: str, rank: str, verbose: int) -> None:
    """SIGTERM to every process of the rank (``rank_tree.rank_processes``), named with ``--verbose 2``; SIGKILL
    to them if the rank is still alive after ``grace_s``."""
    me = os.getpid()
    found = _rank_and_its(proc, me, marker)
    if verbose >= 2 and found:  # first: once the rank is gone, ``serve`` writes its last line and exits
        sys.stderr.write(f"spark-hvd-run: rank {rank}: stopping, SIGTERM to {_named(found)}\n")
        sys.stderr.flush()
    rank_tree.signal_all(found, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    if proc.poll() is None:  # once it exits, ``serve`` kills whatever it left (``_kill_left``)
        found = _rank_and_its(proc, me, marker)
        if verbose >= 2 and found:
            sys.stderr.write(f"spark-hvd-run: rank {rank}: grace period over, SIGKILL to {_named(found)}\n")
            sys.stderr.flush()
        rank_tree.signal_all(found, signal.SIGKILL)
