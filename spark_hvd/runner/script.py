"""``run("train.py", args=[...])``: a script run as ``__main__`` on every rank, as torchrun and TorchDistributor do.

The driver reads and compiles the file (a missing file or a syntax error is raised there, before any task
starts) and ships its source with the job, so executors need no copy of it. On each rank ``Script()`` runs the
code in a fresh ``__main__`` module with ``__file__`` set, ``sys.argv = [path, *args]`` and the script's folder
first on ``sys.path`` (as ``python train.py`` would), then puts all three back (Spark reuses Python workers).
Tracebacks show the script's lines (its source is registered with ``linecache``).

``sys.exit(0)`` / ``sys.exit()`` / falling off the end is success: the rank's result is 0. Any other exit status
raises ``ScriptExitError`` on the rank, so the driver's ``RankFailedError`` names the rank and carries the
status (``RankFailedError.exit_code``); an exception raised by the script reaches the driver with its traceback.
"""

from __future__ import annotations

import builtins
import linecache
import os
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spark_hvd.runner.errors import RunnerError, ScriptExitError


@dataclass(frozen=True)
class Script:
    """A Python file to run as ``__main__`` with ``sys.argv = [path, *args]``; calling it runs it (see module)."""

    path: str
    args: tuple[str, ...]
    source: str

    @classmethod
    def load(cls, path: str | os.PathLike, args: Sequence[Any] = ()) -> Script:
        """Read and compile ``path`` on the driver; ``RunnerError`` naming the file or argument at fault."""
        path = os.fspath(path)
        if isinstance(args, (str, bytes)):
            raise RunnerError(f"args of the script {path} must be a list of strings, got the string {args!r}")
        bad = [a for a in args if not isinstance(a, str)]
        if bad:
            raise RunnerError(f"args of the script {path} must be strings (they become sys.argv); got {bad[0]!r}")
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
        except OSError as exc:
            raise RunnerError(f"cannot read the script {path!r} on the driver: {exc}") from None
        absolute = os.path.abspath(path)
        try:
            compile(source, absolute, "exec")
        except SyntaxError as exc:
            raise RunnerError(f"the script {path} does not compile: {exc}") from None
        return cls(absolute, tuple(args), source)

    def __call__(self) -> int:
        """Run the script on this rank; 0, or ``ScriptExitError`` for a non-zero exit status."""
        code = compile(self.source, self.path, "exec")
        linecache.cache[self.path] = (len(self.source), None, self.source.splitlines(True), self.path)
        module = types.ModuleType("__main__")
        module.__file__ = self.path
        module.__builtins__ = builtins  # type: ignore[attr-defined]
        saved_main, saved_argv, saved_path = sys.modules.get("__main__"), sys.argv, list(sys.path)
        sys.modules["__main__"] = module
        sys.argv = [self.path, *self.args]
        sys.path.insert(0, os.path.dirname(self.path))
        try:
            exec(code, module.__dict__)
        except SystemExit as exc:
            status = exc.code
            if status is None or status == 0:
                return 0
            if not isinstance(status, int):  # sys.exit("message"): Python prints it and exits with 1
                print(status, file=sys.stderr)
                status = 1
            raise ScriptExitError(os.path.basename(self.path), status) from None
        finally:
            if saved_main is not None:
                sys.modules["__main__"] = saved_main
            sys.argv = saved_argv
            sys.path[:] = saved_path
        return 0


def as_callable(target: Callable[..., Any] | str | os.PathLike, args: Sequence[Any],
                kwargs: dict[str, Any] | None) -> tuple[Callable[..., Any], tuple, dict[str, Any]]:
    """``run()``'s first argument as ``(fn, args, kwargs)``: a function as given; a path as a ``Script`` whose
    ``args`` are the script's command-line arguments (no kwargs)."""
    if isinstance(target, (str, os.PathLike)):
        if kwargs:
            raise RunnerError(f"kwargs cannot be passed to the script {os.fspath(target)}: give its command-line "
                              "arguments as args=[...]")
        return Script.load(target, args), (), {}
    if not callable(target):
        raise RunnerError(f"run() takes a function or the path of a Python script, got {target!r}")
    return target, tuple(args), dict(kwargs or {})
