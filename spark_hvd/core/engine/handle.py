"""Handles: the pending result of an operation that a caller submitted to the engine.

``Handle.wait()`` first lets the engine run the round in the calling thread (``Engine.drive``), then waits on a
latch that the engine releases when it finishes the operation.
"""

from __future__ import annotations

import _thread
import copy
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spark_hvd.core.engine.engine import Engine

_FINISH = threading.Lock()  # makes "finish a handle once" atomic between the engine and a shutting-down caller


class Handle:
    """The pending result of one enqueued operation. ``wait()`` returns it or raises the operation's error."""

    __slots__ = ("name", "kind", "_engine", "_latch", "_done", "_result", "_error")

    def __init__(self, name: str, kind: str, engine: Engine | None) -> None:
        self.name = name
        self.kind = kind
        self._engine = engine
        self._latch = _thread.allocate_lock()  # held until the operation finishes (cheaper than an Event)
        self._latch.acquire()
        self._done = False
        self._result: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the operation has finished (successfully or not); never blocks."""
        return self._done

    def wait(self) -> Any:
        """Block until the operation finishes; return its result or raise its error.

        The engine bounds every collective by the timeout, so this returns or raises; a tensor that other ranks
        never submit is reported by the engine's stall warnings while this waits.
        """
        if not self._done and self._engine is not None:
            self._engine.drive(self)
        while not self._done:
            if self._latch.acquire(timeout=0.5):
                self._latch.release()  # let any other waiter through
                break
            if self._engine is not None:
                self._engine.check_alive(self)
        if self._error is not None:
            raise copy_error(self._error)
        return self._result

    def _finish(self, result: Any, error: BaseException | None) -> None:
        with _FINISH:
            if self._done:
                return
            self._result = result
            self._error = error
            self._done = True
        self._latch.release()

    def _set_result(self, result: Any) -> None:
        self._finish(result, None)

    def _set_error(self, error: BaseException) -> None:
        self._finish(None, error)


def finish_all(results: list[tuple[Handle, Any]]) -> None:
    """``_set_result`` for many handles under one acquisition of the finish lock."""
    released = []
    with _FINISH:
        for handle, result in results:
            if not handle._done:
                handle._result = result
                handle._done = True
                released.append(handle._latch)
    for latch in released:
        latch.release()


class GroupHandle(Handle):
    """A handle over several handles (grouped allreduce); its result is the list of their results."""

    def __init__(self, name: str, handles: Sequence[Handle]) -> None:
        super().__init__(name, "grouped_allreduce", None)
        self.handles = list(handles)

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> list[Any]:
        return [h.wait() for h in self.handles]


def copy_error(error: BaseException) -> BaseException:
    try:
        return copy.copy(error)
    except Exception:  # an exception type that cannot be copied: raise the original
        return error
