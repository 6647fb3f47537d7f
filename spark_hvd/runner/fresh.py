"""Code run in a fresh Python process beside this one: a ``FreshProcess`` helper, and ``run_rank_fresh`` for a
whole rank.

Spark reuses Python workers, so a task may find modules imported by an earlier task in a way that cannot be undone
in the same process (Keras fixes its backend when it is first imported). A ``FreshProcess`` is a child interpreter
(this one, with this ``sys.path`` and environment plus ``env``) that runs ``call(fn, *args)`` and returns the
result; an exception raised there is raised here with the child's traceback as a note. The child writes to the same
stdout/stderr (so a rank's output is still forwarded to the driver) and exits when this process goes away.

``run_rank_fresh(fn, args)`` is collective over the ranks of an initialised job: every rank starts a child that
joins a new ring of the same job (its rendezvous relayed through this process's ring, in short rounds, so a child
that starts slowly makes no peer time out), runs ``fn`` there and returns its result. A child that dies or fails
before joining makes its rank raise, and the others fail fast on the ring naming that rank.

The pipe carries pickles between this process and its own child only (nothing from the network).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from spark_hvd.runner.errors import RunnerError
from spark_hvd.runner.start_lines import quiet_imports

__all__ = ["FreshProcess", "FreshProcessDied", "run_rank_fresh", "ask"]

#: seconds between the relay rounds of ``run_rank_fresh`` while the children start
_ROUND_S = 0.2

_parent: Connection | None = None  # in a child: the pipe to the parent (for ``ask``)


class FreshProcess:
    """A child Python interpreter that runs functions for this process (see the module docstring).

    ``env`` is added to this process's environment for the child. ``close()`` (or leaving a ``with`` block) stops it.
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        child_r, parent_w = os.pipe()
        parent_r, child_w = os.pipe()
        environ = dict(os.environ)
        environ.update(env or {})
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(child_r), str(child_w)], stdin=subprocess.DEVNULL,
                pass_fds=(child_r, child_w), env=environ, close_fds=True)
        finally:
            os.close(child_r)
            os.close(child_w)
        self._send = Connection(parent_w, readable=False)
        self._recv = Connection(parent_r, writable=False)
        self._lock = threading.Lock()
        self._send.send_bytes(cloudpickle.dumps(list(sys.path)))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def call(self, fn: Callable[..., Any], *args: Any, on_ask: Callable[[str, Any], Any] | None = None,
             on_idle: Callable[[], None] | None = None, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in the child; its result, or its exception raised here. ``on_ask(name,
        payload)`` answers the child's ``ask()`` calls while ``fn`` runs (None: an ``ask`` fails there);
        ``on_idle()`` is called every ``_ROUND_S`` seconds in which the child says nothing."""
        with self._lock:
            self._send.send_bytes(cloudpickle.dumps(("call", fn, args, kwargs)))
            while True:
                if on_idle is not None and not self._recv.poll(_ROUND_S):
                    on_idle()
                    continue
                kind, *rest = self._receive()
                if kind == "ask":
                    try:
                        answer = ("ok", on_ask(*rest)) if on_ask is not None else \
                            ("error", f"nothing answers ask({rest[0]!r}) here")
                    except Exception as exc:  # noqa: BLE001 - the child raises it
                        answer = ("error", f"{type(exc).__name__}: {exc}")
                    self._send.send_bytes(cloudpickle.dumps(answer))
                    continue
                if kind == "ok":
                    return rest[0]
                raise _child_exception(*rest)

    def _receive(self) -> tuple:
        try:
            return cloudpickle.loads(self._recv.recv_bytes())
        except (EOFError, OSError):
            code = self._proc.wait(timeout=30)
            raise FreshProcessDied(self._proc.pid, code) from None

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the child (EOF on its pipe; killed if it is still there after ``timeout_s``)."""
        for conn in (self._send, self._recv):
            try:
                conn.close()
            except OSError:
                pass
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout=timeout_s)

    def __enter__(self) -> FreshProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FreshProcessDied(RunnerError):
    """The child process exited (or was killed) before it answered a call."""

    def __init__(self, pid: int, status: int | None) -> None:
        super().__init__(f"the fresh Python process {pid} exited with status {status} before answering (see its "
                         "output above)")
        self.pid, self.status = pid, status


def _child_exception(payload: bytes | None, kind: str, text: str, tb: str) -> BaseException:
    exc: BaseException
    try:
        exc = cloudpickle.loads(payload) if payload is not None else RunnerError(f"{kind}: {text}")
    except Exception:  # noqa: BLE001 - a type that does not unpickle here
        exc = RunnerError(f"{kind}: {text}")
    exc.add_note(f"raised in a fresh Python process:\n{tb}")
    return exc


def ask(name: str, payload: Any = None) -> Any:
    """In a ``FreshProcess`` child, while a ``call`` runs: the parent's ``on_ask(name, payload)``."""
    if _parent is None:
        raise RunnerError("ask() is only for code run by a FreshProcess")
    send, recv = _parent
    send.send_bytes(cloudpickle.dumps(("ask", name, payload)))
    status, value = cloudpickle.loads(recv.recv_bytes())
    if status != "ok":
        raise RunnerError(f"ask({name!r}) failed in the parent process: {value}")
    return value


# ------------------------------------------------------------------------------------------------ a whole rank


def run_rank_fresh(fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None,
                   env: dict[str, str] | None = None) -> Any:
    """``fn(*args, **kwargs)`` as this rank, in a fresh Python process that joins a new ring of the same job
    (collective: every rank of the job calls it). ``env`` is added to the child's environment.

    Under ``run_elastic`` (this process has a driver link, ``spark_hvd.core.elastic.get_link``) the child gets a
    link relayed through this process (its growth checks and commits reach the driver), and a child that dies takes
    this process with it (``os._exit`` with its status): the rank's process is lost, as when it runs here, so the
    driver relaunches the job instead of failing it on a rank's error."""
    import spark_hvd.core as core
    from spark_hvd.core.elastic import get_link

    if not core.is_initialized():
        raise RunnerError("run_rank_fresh() is collective over an initialised job; call it on a rank of run()")
    relay, link = _Relay(), get_link()

    def on_ask(name: str, payload: Any) -> Any:
        if name == _LINK_ASK and link is not None:
            method, method_args = payload
            if method not in _LINK_METHODS:
                raise RunnerError(f"the fresh process asked for the driver link's {method!r}")
            return getattr(link, method)(*method_args)
        return relay.answer(name, payload)

    with FreshProcess(env) as proc:
        try:
            return proc.call(_rank_main, fn, tuple(args), dict(kwargs or {}), link is not None, on_ask=on_ask,
                             on_idle=relay.idle)
        except FreshProcessDied as exc:
            if link is None:
                raise
            sys.stderr.write(f"spark_hvd: rank {core.rank()}: {exc}; this rank is lost\n")
            sys.stderr.flush()
            os._exit(exc.status if exc.status and exc.status > 0 else 1)


#: the ``ask`` name of the relayed driver link, and the ``DriverLink`` methods it relays
_LINK_ASK = "elastic.link"
_LINK_METHODS = frozenset({"put", "commit", "committed", "get", "hosts_updated"})


class _RelayedLink:
    """In a fresh child under ``run_elastic``: the parent's driver link, each call asked of the parent."""

    def put(self, commit_id: str, seq: int, data: bytes) -> None:
        ask(_LINK_ASK, ("put", (commit_id, seq, data)))

    def commit(self, commit_id: str, sizes: list[int]) -> bool:
        return bool(ask(_LINK_ASK, ("commit", (commit_id, list(sizes)))))

    def committed(self) -> list[int] | None:
        return ask(_LINK_ASK, ("committed", ()))

    def get(self, offset: int, nbytes: int) -> bytes:
        return ask(_LINK_ASK, ("get", (offset, nbytes)))

    def hosts_updated(self) -> bool:
        return bool(ask(_LINK_ASK, ("hosts_updated", ())))


class _Relay:
    """The parent's side of a child's joining: rounds of ``allgather_object`` over this process's ring, in which
    every rank says what its child asks (``exchange`` a rendezvous value, ``joined``) or that it is still
    starting (``waiting``); a request is answered in the first round in which every child has made it. The
    rounds stop when every child has joined (in the same round on every rank)."""

    def __init__(self) -> None:
        self.round = 0
        self.joined = False

    def idle(self) -> None:
        if not self.joined:
            self._round(("waiting", None))

    def answer(self, name: str, payload: Any) -> Any:
        if name not in ("exchange", "joined"):
            raise RunnerError(f"unknown request {name!r} from the fresh process")
        kind = "pending" if name == "exchange" else "joined"
        while True:
            states = self._round((kind, payload))
            if all(s[0] == kind for s in states):
                self.joined = kind == "joined"
                return [s[1] for s in states] if kind == "pending" else None
            time.sleep(_ROUND_S)

    def _round(self, mine: tuple[str, Any]) -> list[tuple[str, Any]]:
        import spark_hvd.core as core

        self.round += 1
        return core.allgather_object(mine, name=f"spark_hvd.fresh.{self.round}")


def _rank_main(fn: Callable[..., Any], args: tuple, kwargs: dict, elastic: bool = False) -> Any:
    """In the child: join a new ring of the job described by the environment, run ``fn`` (with the parent's
    driver link relayed when ``elastic``), leave."""
    import spark_hvd.core as core
    from spark_hvd.core import torchrun
    from spark_hvd.core.backend import Rendezvous
    from spark_hvd.core.elastic import set_link
    from spark_hvd.core.jobenv import JobEnv

    class _AskRendezvous(Rendezvous):
        def exchange(self, rank: int, size: int, value: bytes) -> list[bytes]:
            return ask("exchange", value)

    job = JobEnv.from_env()
    if job is None:
        raise RunnerError("run_rank_fresh: the child has no job environment (SPARK_HVD_RANK ...)")
    core.init(rendezvous=_AskRendezvous(), rank=job.rank, size=job.size, secret=job.secret, job_id=job.job_id)
    try:
        ask("joined")
        torchrun.install()
        if elastic:
            set_link(_RelayedLink())
        return fn(*args, **kwargs)
    finally:
        set_link(None)
        torchrun.destroy_default_group()
        core.shutdown()


# ------------------------------------------------------------------------------------------------ the child


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent is gone (a killed Spark task must not leave its training running)."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def _serve(recv: Connection, send: Connection) -> None:
    global _parent
    sys.path[:] = cloudpickle.loads(recv.recv_bytes())
    threading.Thread(target=_watch_parent, args=(os.getppid(),), name="spark_hvd-fresh-watch", daemon=True).start()
    _parent = (send, recv)
    while True:
        try:
            data = recv.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            with quiet_imports():  # the frameworks the call's objects need are imported here (start_lines.py)
                _kind, fn, args, kwargs = cloudpickle.loads(data)
            reply: tuple = ("ok", fn(*args, **kwargs))
            out = cloudpickle.dumps(reply)
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            try:
                payload: bytes | None = cloudpickle.dumps(exc)
                cloudpickle.loads(payload)
            except Exception:  # noqa: BLE001
                payload = None
            out = cloudpickle.dumps(("error", payload, type(exc).__name__, str(exc), tb))
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                send.send_bytes(out)
                return
        send.send_bytes(out)


if __name__ == "__main__":  # the child: serve through the module itself (``ask`` reads its ``_parent``)
    from spark_hvd.runner import fresh

    fresh._serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
