"""Import alias ``horovod`` -> ``spark_hvd``, for running Horovod's own Spark integration tests against spark_hvd
(``tools/horovod_spark_tests.py``).

Horovod's public names map to spark_hvd's (``horovod.spark.run`` -> ``spark_hvd.runner.run``, its stores, estimators
and models, ``horovod.torch`` -> ``spark_hvd.torch``); ``pytorch_lightning`` -> ``lightning.pytorch`` and ``mock``
-> ``unittest.mock``. Every other ``horovod`` name imports fine as a stub that raises ``HorovodInternal`` when it is
used (called, subclassed), so a test that uses one of Horovod's internals fails with that error and is counted as
testing Horovod's internals, not as a spark_hvd failure.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import unittest.mock
from typing import Any

#: the Horovod release whose tests the harness runs
HOROVOD_VERSION = "0.28.1"


class HorovodInternal(NotImplementedError):
    """A test used a Horovod internal that spark_hvd has no counterpart of."""


class _Stub:
    """Any attribute of a Horovod internal: itself a stub; calling or subclassing one raises HorovodInternal."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise HorovodInternal(f"Horovod internal {self._name} (no spark_hvd counterpart)")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple) -> tuple:
        raise HorovodInternal(f"subclassing Horovod internal {self._name}")


def _public() -> dict[str, Any]:
    """Horovod module -> the spark_hvd module, or a dict of the names it has here."""
    import spark_hvd.estimators as est
    import spark_hvd.runner as runner
    import spark_hvd.store as store
    import spark_hvd.torch as torch_hvd
    import spark_hvd.torch.elastic as torch_elastic

    stores = {"Store": store.Store, "LocalStore": store.LocalStore, "HDFSStore": store.HDFSStore,
              "DBFSLocalStore": store.DBFSStore, "FilesystemStore": store.LocalStore}
    return {
        "horovod": {"__version__": HOROVOD_VERSION},
        "horovod.spark": {"run": runner.run, "run_elastic": runner.run_elastic},
        "horovod.spark.common": {},
        "horovod.spark.common.store": stores,
        "horovod.spark.common.backend": {"SparkBackend": runner.SparkBackend},
        "horovod.spark.torch": {"TorchEstimator": est.TorchEstimator, "TorchModel": est.TorchModel},
        "horovod.spark.keras": {"KerasEstimator": est.KerasEstimator, "KerasModel": est.KerasModel},
        "horovod.spark.lightning": {"TorchEstimator": est.LightningEstimator, "TorchModel": est.LightningModel},
        "horovod.spark.lightning.estimator": {"MIN_PL_VERSION": "1.3.8"},
        "horovod.torch": torch_hvd,
        "horovod.torch.elastic": torch_elastic,
        "horovod.common": {},
        "horovod.common.util": {"gloo_built": lambda: True, "mpi_built": lambda: False},
    }


def _missing(module: str) -> Any:
    def getattr_(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{module}.{attr}")

    return getattr_


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers the imports of ``horovod``, ``horovod.*``, ``pytorch_lightning.*`` and ``mock``."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in ("horovod", "pytorch_lightning") or name.startswith(("horovod.", "pytorch_lightning.")):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if name == "mock":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        name = spec.name
        if name == "mock":
            return unittest.mock
        if name.startswith("pytorch_lightning"):
            return importlib.import_module("lightning.pytorch" + name[len("pytorch_lightning"):])
        target = _public().get(name)
        if isinstance(target, types.ModuleType):
            return target
        module = types.ModuleType(name)
        module.__path__ = []
        for key, value in (target or {}).items():
            setattr(module, key, value)
        module.__getattr__ = _missing(name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
