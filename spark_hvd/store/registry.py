"""URL scheme -> store class: the table :meth:`Store.create <spark_hvd.store.base.Store.create>` looks up.

fsspec's pattern (``fsspec.registry.register_implementation``): entries are dotted ``"module.Class"`` paths imported
on first use, so :mod:`spark_hvd.store.base` imports no implementation and a store's dependencies load only when a
URL needs them. A scheme not in the table goes to :class:`~spark_hvd.store.fsspec_store.FsspecStore`, which accepts
every protocol fsspec knows. Users add their own::

    from spark_hvd.store import Store, register_store
    register_store("lakefs", "my_package.stores.LakeFSStore")   # or the class itself
    Store.create("lakefs://repo/branch/prefix")

A registered class is constructed as ``cls(url, **storage_options)`` and must subclass ``Store``. Training
processes find a class by pickle reference (``module.Class``), so it must be importable there; the registration
itself is needed only where ``Store.create`` runs.
"""

from __future__ import annotations

import importlib
import threading
from typing import TYPE_CHECKING

from spark_hvd.store.errors import StoreURLError

if TYPE_CHECKING:  # pragma: no cover
    from spark_hvd.store.base import Store

#: The class for any scheme not registered.
DEFAULT_STORE = "spark_hvd.store.fsspec_store.FsspecStore"

_lock = threading.Lock()
_registry: dict[str, str | type[Store]] = {
    "": "spark_hvd.store.local.LocalStore",
    "file": "spark_hvd.store.local.LocalStore",
    "dbfs": "spark_hvd.store.dbfs.DBFSStore",
    "volumes": "spark_hvd.store.volumes.VolumesStore",
    "hdfs": "spark_hvd.store.hdfs.HDFSStore",
    "viewfs": "spark_hvd.store.hdfs.HDFSStore",
}


def register_store(scheme: str, cls: str | type[Store], clobber: bool = False) -> None:
    """Make :meth:`Store.create` use ``cls`` (a ``Store`` subclass or its dotted ``"module.Class"`` path) for URLs
    of ``scheme`` (lower case, without ``://``; ``""`` is a plain local path).

    Raises:
        StoreURLError: ``scheme`` is taken by another class and ``clobber`` is false.
    """
    scheme = scheme.lower()
    with _lock:
        current = _registry.get(scheme)
        if current is not None and current != cls and not clobber:
            raise StoreURLError(f"store scheme {scheme!r} is already registered to {class_name(current)}; "
                                "pass clobber=True to replace it")
        _registry[scheme] = cls


def registered_schemes() -> dict[str, str]:
    """Scheme -> dotted class name of every registered store (the fsspec fallback not included)."""
    with _lock:
        return {scheme: class_name(cls) for scheme, cls in sorted(_registry.items())}


def store_class(scheme: str) -> type[Store]:
    """The store class for ``scheme``, importing it on first use (``Store.create`` checks it is a ``Store``).

    Raises:
        StoreURLError: the registered dotted path cannot be imported or is not a class.
    """
    with _lock:
        entry = _registry.get(scheme.lower(), DEFAULT_STORE)
    if isinstance(entry, str):
        module, _, name = entry.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise StoreURLError(
                f"the store registered for scheme {scheme!r}, {entry!r}, cannot be imported: {e}"
            ) from e
    else:
        cls = entry
    if not isinstance(cls, type):
        raise StoreURLError(f"the store registered for scheme {scheme!r}, {class_name(entry)}, is not a Store "
                            "subclass")
    return cls


def class_name(cls: str | type) -> str:
    """The dotted name of a registry entry (a class or its ``"module.Class"`` path)."""
    return cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
