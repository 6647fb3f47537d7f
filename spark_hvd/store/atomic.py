"""Directories that are complete or absent, and survive a crash: how :meth:`Store.atomic_dir` commits.

Writing ``path``:

1. Files go to a hidden sibling ``._tmp-<name>.new-<id>`` (on a store that renames directories, always; on one that
   cannot, only when a committed ``path`` is being replaced; otherwise straight into ``path``).
2. Commit: the files are fsynced where the filesystem supports it, then the manifest (sizes, checksums; see
   :mod:`spark_hvd.store.manifest`) is written last and fsynced.
3. Replace, never leaving a moment without a committed copy: a renaming store moves the old ``path`` aside
   (``._tmp-<name>.old-<id>``), renames the new one in, fsyncs the parent, then deletes the old one; a store that
   cannot rename deletes the old ``path`` only once the new copy is committed beside it, copies it in (manifest
   last) and deletes the copy.

A crash at any step leaves a committed copy: in ``path``, or in a hidden sibling. :func:`recover`, run on a run's
checkpoint directory when the run starts (:meth:`Store.latest_checkpoint`), finishes such a replacement and deletes
hidden siblings that were never committed (stale partial writes). It is not run before other writes: a directory
such as a prepared dataset may be written by two fits at once, and one must not take the other's work for stale.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import re
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

from spark_hvd.store.errors import StoreError
from spark_hvd.store.manifest import MANIFEST, Manifest

if TYPE_CHECKING:  # pragma: no cover
    from spark_hvd.store.base import Store

logger = logging.getLogger(__name__)

#: Prefix of hidden sibling directories (left out of listings).
TMP_PREFIX = "._tmp-"
_HIDDEN_RE = re.compile(r"^\._tmp-(?P<name>.+)\.(?P<kind>new|old)-[0-9a-f]{12}$")


def hidden_sibling(path: str, kind: str) -> str:
    """A fresh hidden sibling of ``path``: ``kind`` is ``new`` (being written) or ``old`` (being replaced)."""
    parent, name = posixpath.split(path)
    return posixpath.join(parent, f"{TMP_PREFIX}{name}.{kind}-{uuid.uuid4().hex[:12]}")


@contextlib.contextmanager
def atomic_dir(store: Store, path: str, overwrite: bool = True) -> Iterator[str]:
    """The body of :meth:`Store.atomic_dir` (see the module docstring)."""
    path = path.rstrip("/")
    committed = store.is_committed(path)
    if committed and not overwrite:
        raise StoreError(f"{path!r} already exists in {store!r}; pass overwrite=True to replace it")
    if store.supports_rename or committed:
        target = hidden_sibling(path, "new")
    else:
        store.delete(path)  # leftovers of an earlier failed write: nothing committed
        target = path
    store._makedirs(target)
    try:
        yield target
        commit(store, target)
    except BaseException:
        _discard(store, target)
        raise
    if target != path:
        try:
            replace(store, target, path)
        except BaseException:
            logger.warning("replacing %s in %r was interrupted; the committed new copy stays at %s (a run's "
                           "start finishes the replacement of its checkpoints)", path, store, target)
            raise


def commit(store: Store, target: str) -> None:
    """fsync what is under ``target``, then write its manifest last (and fsync that)."""
    store._fsync_tree(target)
    sizes = store._file_sizes(target)
    sizes.pop(MANIFEST, None)
    recorded = store._take_recorded(target)
    files = {}
    for rel, size in sizes.items():
        known = recorded.get(rel)
        if known is not None and known[0] != size:
            raise StoreError(f"{posixpath.join(target, rel)!r} in {store!r} has {size} bytes after writing "
                             f"{known[0]}: a torn write; not committing")
        files[rel] = (size, known[1] if known is not None else None)
    store.write_bytes(posixpath.join(target, MANIFEST), Manifest(files).dumps())
    store._take_recorded(target)
    store._fsync_tree(target, files=False)


def replace(store: Store, target: str, path: str) -> None:
    """Put the committed directory ``target`` at ``path``; a committed copy exists at every moment."""
    if store.supports_rename:
        old = None
        if store.exists(path):
            old = hidden_sibling(path, "old")
            store._rename(path, old)
        store._rename(target, path)
        store._fsync_tree(posixpath.dirname(path), files=False, recursive=False)
        if old is not None:
            store.delete(old)
        store._invalidate(path)
        return
    manifest = store.read_bytes(posixpath.join(target, MANIFEST))
    store.delete(posixpath.join(path, MANIFEST))  # the old copy stops counting; the new one is committed beside it
    store.delete(path)
    for rel in Manifest.loads(manifest).files:
        dst = posixpath.join(path, rel)
        store._makedirs(posixpath.dirname(dst))
        store.fs.copy(posixpath.join(target, rel), dst)
    store.write_bytes(posixpath.join(path, MANIFEST), manifest)
    store._take_recorded(path)
    store.delete(target)


def recover(store: Store, parent: str, name: str | None = None) -> None:
    """Finish interrupted replacements and delete stale hidden siblings in ``parent`` (of ``name`` only, if given).

    A hidden copy that is committed while its final path is not is put in place (the newest kind first: ``new``
    before ``old``); every other hidden sibling is deleted.
    """
    hidden = []
    for entry in store._raw_names(parent):
        if not entry.startswith(TMP_PREFIX):
            continue
        m = _HIDDEN_RE.match(entry)
        final = m.group("name") if m else None
        if name is not None and final != name and not entry.startswith(f"{TMP_PREFIX}{name}-"):
            continue
        hidden.append((0 if m and m.group("kind") == "new" else 1, entry, final))
    for _, entry, final in sorted(hidden):
        path = posixpath.join(parent, entry)
        if final is not None and not store.is_committed(posixpath.join(parent, final)) and store.is_committed(path):
            logger.warning("finishing an interrupted replacement: %s becomes %s in %r", entry, final, store)
            store.delete(posixpath.join(parent, final))  # an uncommitted partial, if any
            replace(store, path, posixpath.join(parent, final))
            continue
        logger.info("deleting %s in %r: a stale temporary directory", path, store)
        _discard(store, path)


def verify(store: Store, path: str) -> str | None:
    """What is wrong with the committed directory ``path`` (``None``: its files match its manifest)."""
    try:
        manifest = Manifest.loads(store.read_bytes(posixpath.join(path, MANIFEST)))
    except FileNotFoundError:
        return "no manifest (an unfinished write, or one by a spark_hvd without manifests)"
    except ValueError as e:
        return f"its manifest is unreadable: {e}"

    def sha256(rel: str) -> str:
        return store._sha256(posixpath.join(path, rel))

    return manifest.problem(store._file_sizes(path), sha256)


def _discard(store: Store, path: str) -> None:
    try:
        store.delete(path)
    except Exception:  # pragma: no cover - best effort cleanup
        logger.warning("could not delete the incomplete directory %s in %r", path, store, exc_info=True)
    store._take_recorded(path)
