"""``HorovodStoreAPI``: the methods of Horovod's ``horovod.spark.common.store.Store`` that its users call and that
the store's own layout does not already give (``Store`` inherits them): ``get_runs_path``, ``get_test_data_path``,
``get_local_output_dir_fn`` / ``sync_fn`` (write a run's files locally, then copy them into the run's directory),
``read_serialized_keras_model`` (a Keras checkpoint in the store, loaded and returned base64-encoded). The
constructor arguments ``train_path`` / ``val_path`` / ``test_path`` / ``runs_path`` are ``Store._place``'s.
"""

from __future__ import annotations

import base64
import contextlib
import os
import posixpath
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["HorovodStoreAPI"]

#: the file a Keras checkpoint directory holds its model in (the Keras estimator's ``MODEL_FILE``)
_KERAS_MODEL_FILE = "model.keras"


class HorovodStoreAPI:
    """Horovod's Store methods over a ``Store``'s own (``run_path``, ``upload_dir``, ``read_bytes`` ...)."""

    def get_runs_path(self) -> str:
        """Horovod's name of ``runs_root``: where the runs' directories are."""
        return self.runs_root()

    def get_test_data_path(self, idx: int | None = None) -> str:
        """The constructor's ``test_path`` (default ``<prefix>/intermediate_test_data``, Horovod's), with ``.idx``
        appended for a dataset index, as Horovod names it; nothing here writes test data (Horovod's estimators do
        not either)."""
        path = self._roots.get("test") or self.path("intermediate_test_data")
        return f"{path}.{idx}" if idx is not None else path

    def get_local_output_dir_fn(self, run_id: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
        """``fn()`` -> a context manager giving a fresh local temporary directory for the run's output, deleted on
        exit (Horovod's: a rank writes checkpoints and logs there, then ``sync_fn`` copies them to the store)."""
        self.run_path(run_id)  # checks the name

        @contextlib.contextmanager
        def local_run_path() -> Iterator[str]:
            with tempfile.TemporaryDirectory(prefix=f"spark_hvd-{run_id}-") as tmp:
                yield tmp

        return local_run_path

    def sync_fn(self, run_id: str) -> Callable[[str], None]:
        """``fn(local_run_path)``: copy every file under the local directory into the run's directory in the store
        (``run_path(run_id)``), overwriting files of the same name and keeping others, as Horovod's does; call it as
        often as the local files change."""
        run_path = self.run_path(run_id)

        def sync(local_run_path: str) -> None:
            if not os.path.isdir(local_run_path):
                raise FileNotFoundError(f"sync_fn({run_id!r}): no local directory {local_run_path!r}")
            self.upload_dir(local_run_path, run_path)

        return sync

    def read_serialized_keras_model(self, ckpt_path: str, model: Any = None,
                                    custom_objects: dict | None = None) -> str:
        """The Keras model of the checkpoint at the store path (or URL) ``ckpt_path``, base64-encoded as Horovod
        returns it: the ``.keras`` file's bytes (``keras.saving.load_model`` reads them back from a file). A
        directory is read at its ``model.keras``; a weights file (``.weights.h5``) is loaded into ``model``.
        ``custom_objects`` are those the model needs to load."""
        import keras

        path = self.get_localized_path(ckpt_path)
        if self.fs.isdir(path):
            path = posixpath.join(path, _KERAS_MODEL_FILE)
        with tempfile.TemporaryDirectory() as tmp:
            local = os.path.join(tmp, posixpath.basename(path))
            with open(local, "wb") as f:
                f.write(self.read_bytes(path))
            with keras.saving.custom_object_scope(custom_objects or {}):
                if local.endswith(".weights.h5"):
                    if model is None:
                        raise ValueError(f"{ckpt_path!r} holds weights only: pass the model to load them into")
                    model.load_weights(local)
                    loaded = model
                else:
                    loaded = keras.saving.load_model(local, compile=True)
            out = os.path.join(tmp, "out.keras")
            loaded.save(out)
            with open(out, "rb") as f:
                return base64.b64encode(f.read()).decode("ascii")
