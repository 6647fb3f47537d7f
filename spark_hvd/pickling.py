"""Shipping code by value with its file names and source lines, so a rank's traceback shows the user's code.

cloudpickle pickles the functions and classes of ``__main__``, notebooks and modules registered with
``register_pickle_by_value`` by value: their code objects travel, not an import path. Since cloudpickle 3.1.3 it
renames every such code object's file to ``<dynamic-code>`` (for deterministic payloads), so a traceback raised on a
rank names no file and shows no source line for the user's own frames, the ones that matter. And where the file
does not exist on the rank's host (a notebook cell, a script on the driver only), no cloudpickle could show a line.

``dumps`` pickles with cloudpickle but reduces each code object itself: the code keeps its own file name (it is
marshalled whole, as a ``.pyc`` holds it), and the source lines of that file, as the driver's ``linecache`` sees
them (notebook cells included), travel once per file in the payload. ``loads`` (or any unpickler, since the
payload names only this module's importable ``_rebuild_code``) registers those lines with the rank's
``linecache``, so ``traceback`` renders the frames as it would on the driver. Objects pickled by reference are
untouched: their modules are imported on the rank and their files read there as usual.
"""

from __future__ import annotations

import linecache
import marshal
import pickle
import types
from io import BytesIO
from typing import Any

import cloudpickle

_MAX_SOURCE_BYTES = 1 << 20  # a larger source file is not shipped: the frames keep their file and line numbers


def dumps(obj: Any, protocol: int | None = None) -> bytes:
    """``cloudpickle.dumps``, with code objects that keep their file name and carry their file's source lines."""
    buffer = BytesIO()
    _SourceKeepingPickler(buffer, protocol=protocol).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """Unpickles what ``dumps`` (or cloudpickle) wrote; the shipped source lines land in ``linecache``."""
    return pickle.loads(data)


class _SourceKeepingPickler(cloudpickle.Pickler):
    """A cloudpickle pickler whose code objects keep ``co_filename`` and ship the file's lines once per payload."""

    def __init__(self, file: BytesIO, protocol: int | None = None) -> None:
        super().__init__(file, protocol=protocol)
        self._sources: dict[str, tuple[str, ...] | None] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.CodeType):
            try:
                code = marshal.dumps(obj)
            except ValueError:  # a hand-made code object with unmarshallable constants: cloudpickle's way
                return super().reducer_override(obj)
            return _rebuild_code, (code, obj.co_filename, self._source_lines(obj.co_filename))
        return super().reducer_override(obj)

    def _source_lines(self, filename: str) -> tuple[str, ...] | None:
        """The file's lines, one tuple object per file, so the pickle memo writes them once."""
        if filename not in self._sources:
            lines = linecache.getlines(filename)
            self._sources[filename] = tuple(lines) if 0 < sum(map(len, lines)) <= _MAX_SOURCE_BYTES else None
        return self._sources[filename]


def _rebuild_code(code: bytes, filename: str, lines: tuple[str, ...] | None) -> types.CodeType:
    """Unpickling side: the code object as marshalled; its source lines registered for ``traceback``."""
    if lines:
        # mtime None: linecache.checkcache keeps the entry (it cannot be stale against a file it did not read)
        linecache.cache[filename] = (sum(map(len, lines)), None, list(lines), filename)
    return marshal.loads(code)
