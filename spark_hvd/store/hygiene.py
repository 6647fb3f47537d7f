"""Store hygiene: prepared datasets that no fit has used for a while are deleted by :meth:`Store.clean`.

The rule: every ``fit`` that prepares a dataset or reuses a prepared one records the time under
``data/_used/<key>``. ``store.clean(unused_for_days=7)`` deletes each committed dataset whose last recorded use is
older than that (a dataset with no record yet, e.g. prepared before records existed, gets one now and so lives
another full period), keeps those named in ``keep``, and deletes stale temporary directories under ``data/``
(left by a writer that was killed). Runs (checkpoints, logs, models) are never touched here.
"""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from spark_hvd.store import atomic

if TYPE_CHECKING:  # pragma: no cover
    from spark_hvd.store.base import Store

logger = logging.getLogger(__name__)

USED_DIR = "_used"


def _used_path(store: Store, key: str) -> str:
    store.data_path(key)  # checks the key is a plain name
    return posixpath.join(store.data_root(), USED_DIR, key)


def mark_dataset_used(store: Store, key: str, now: float | None = None) -> None:
    """Record that a fit used the dataset ``key`` now (what :func:`clean` measures age from)."""
    store.write_bytes(_used_path(store, key), repr(time.time() if now is None else now).encode())


def last_used(store: Store, key: str) -> float | None:
    """When a fit last used the dataset ``key`` (seconds since the epoch), or None without a record."""
    try:
        return float(store.read_bytes(_used_path(store, key)).decode())
    except (FileNotFoundError, ValueError):
        return None


def clean(store: Store, unused_for_days: float = 7.0, keep: Iterable[str] = (), dry_run: bool = False) -> list[str]:
    """Delete the prepared datasets no fit has used for ``unused_for_days`` days; return their keys.

    Args:
        store: the store to clean.
        unused_for_days: the age of the last recorded use beyond which a dataset goes (0: every unkept one).
        keep: dataset keys never deleted.
        dry_run: only return what would go.
    """
    if unused_for_days < 0:
        raise ValueError(f"unused_for_days must be >= 0, got {unused_for_days}")
    keep = set(keep)
    now = time.time()
    gone = []
    for key in store.list_datasets():
        if key in keep:
            continue
        used = last_used(store, key)
        if used is None:
            if not dry_run:
                mark_dataset_used(store, key, now)  # start its clock: it may be in use by a fit we cannot see
            continue
        if now - used < unused_for_days * 86400.0:
            continue
        gone.append(key)
        if not dry_run:
            logger.info("deleting prepared dataset %s in %r: unused for %.1f days", key, store, (now - used) / 86400)
            store.delete(store.data_path(key))
            store.delete(_used_path(store, key))
    if not dry_run:
        atomic.recover(store, store.data_root())
    return gone
