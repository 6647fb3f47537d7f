"""The flat layout's module names (``spark_hvd.estimators.torch_rank`` ...) as aliases of the modules they became.

Pickles name a class or function by its module: a Pipeline saved before the estimators moved into ``common/`` and
one sub-package per framework holds, e.g., an ``EarlyStopping`` callback pickled as
``spark_hvd.estimators.rank_run.EarlyStopping``. The finder below answers for those old names only, with the new
module itself (one module object under two names), so such pickles load and old imports keep working.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType

_PACKAGE = "spark_hvd.estimators"

#: old module (under spark_hvd.estimators) -> its module now
MOVED = {
    **{name: f"common.{name}" for name in (
        "arrow", "classifier", "compat", "errors", "export", "fit", "mlflow_log", "model", "params", "persistence",
        "preflight", "pyfunc", "rank_data", "rank_run", "retention", "spec", "step_checkpoint", "tensorboard")},
    "torch_rank": "torch.rank", "torch_serde": "torch.serde", "torch_precision": "torch.precision",
    "keras_backend": "keras.backend", "keras_inference": "keras.inference", "keras_rank": "keras.rank",
    "keras_serde": "keras.serde",
    "lightning_checks": "lightning.checks", "lightning_env": "lightning.env", "lightning_rank": "lightning.rank",
    "lightning_steps": "lightning.steps",
}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``spark_hvd.estimators.<old>`` and loads it as the module it moved to."""

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        if package != _PACKAGE or name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(f"{_PACKAGE}.{MOVED[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module ran when ``create_module`` imported it under its own name."""


def install() -> None:
    """Puts the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
