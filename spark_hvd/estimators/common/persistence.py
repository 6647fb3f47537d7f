"""Spark ML persistence (``MLWritable``/``MLReadable``) of a stage whose params hold objects (model, optimizer ...).

A stage saved at ``path`` is ``path/metadata`` (Spark's JSON metadata with the JSON-able params, as
``DefaultParamsWriter`` writes it, so ``Pipeline``/``PipelineModel.load`` find the class) plus ``path/data`` (one
Parquet file of ``(name, bytes)`` rows: the framework's model bytes and a cloudpickle of every other object param).
Both go through Spark's own file system layer, so any path Spark can write (local, HDFS, S3, DBFS) works. The
metadata records the concrete stage's class (``spark_hvd.estimators.torch.TorchModel`` ...), never this module's.
"""

from __future__ import annotations

from typing import Any

import cloudpickle
from pyspark.ml.util import DefaultParamsReader, MLReadable, MLReader, MLWritable, MLWriter

from spark_hvd import pickling
from spark_hvd.estimators.common import compat
from spark_hvd.estimators.common.params import OBJECT_PARAMS

__all__ = ["PersistableStage", "rebuild_stage"]


class _StageWriter(MLWriter):
    """Writes ``path/metadata`` (JSON params) and ``path/data`` (model bytes + pickled object params)."""

    def __init__(self, instance: PersistableStage) -> None:
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:  # noqa: N802 (Spark's name)
        inst = self.instance
        blobs = inst._dump_objects()
        compat.save_metadata(
            inst, path, self.sparkSession, paramMap=inst._json_params(),
            extraMetadata={"spark_hvd": {"objects": sorted(blobs), "format": 1}},
        )
        rows = sorted(blobs.items())
        df = self.sparkSession.createDataFrame(rows, schema="name string, data binary")
        df.coalesce(1).write.parquet(f"{path.rstrip('/')}/data")


class _StageReader(MLReader):
    """Reads what ``_StageWriter`` wrote and rebuilds the stage of class ``cls``."""

    def __init__(self, cls: type) -> None:
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        metadata = compat.load_metadata(path, self.sparkSession)
        names = metadata.get("spark_hvd", {}).get("objects", [])
        blobs: dict[str, bytes] = {}
        if names:
            for row in self.sparkSession.read.parquet(f"{path.rstrip('/')}/data").collect():
                blobs[row["name"]] = bytes(row["data"])
            missing = set(names) - set(blobs)
            if missing:
                raise OSError(f"{path}/data lacks the saved objects {sorted(missing)}")
        return rebuild_stage(metadata, blobs, self.cls, path)


def rebuild_stage(metadata: dict[str, Any], blobs: dict[str, bytes], expected: type, where: str) -> Any:
    """The stage that ``metadata`` (``class``, ``uid``, ``paramMap``: Spark's JSON metadata, or the same keys
    written elsewhere) and ``blobs`` (the object params' bytes, ``model`` among them) describe; ``where`` names
    their source in the error raised when the class is not an ``expected``."""
    module, _, name = metadata["class"].rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    if not issubclass(cls, expected):
        raise TypeError(f"{where} holds a {metadata['class']}, not a {expected.__name__}")
    instance = cls()
    instance._resetUid(metadata["uid"])
    if "sparkVersion" in metadata:  # Spark ML's own metadata (its defaults section too)
        DefaultParamsReader.getAndSetParams(instance, metadata)
    else:
        for name, value in metadata["paramMap"].items():
            instance.set(instance.getParam(name), value)
    objects = instance._load_objects(blobs)
    if objects:
        instance._set(**objects)
    return instance


class PersistableStage(MLWritable, MLReadable):
    """Mixin: Spark ML persistence for a stage with object params (see the module docstring)."""

    def write(self) -> MLWriter:
        """An ``MLWriter`` saving this stage (``.save(path)``, ``.overwrite()``)."""
        return _StageWriter(self)

    @classmethod
    def read(cls) -> MLReader:
        """An ``MLReader`` loading a stage saved by ``write()``."""
        return _StageReader(cls)

    def _opt(self, param: Any) -> Any:
        """The value of ``param``, or None when it was never set and has no default."""
        return self.getOrDefault(param) if self.isDefined(param) else None

    def _json_params(self) -> dict[str, Any]:
        """The set params that Spark's JSON metadata holds: all but the object ones. A runner given as ``backend``
        (Horovod's param) holds the live Spark session: not saved (a loaded stage runs on num_proc); the Keras
        estimator's backend name is JSON."""
        return {p.name: v for p, v in self._paramMap.items() if p.name not in OBJECT_PARAMS
                and not (p.name == "backend" and not isinstance(v, str | type(None)))}

    # Hooks a framework overrides for its model/optimizer; the default pickles each object param with cloudpickle.
    def _dump_objects(self, skip: frozenset[str] = frozenset()) -> dict[str, bytes]:
        """The object params' bytes by name, but those in ``skip``."""
        out = {}
        for param, value in self._paramMap.items():
            if param.name in OBJECT_PARAMS and param.name not in skip and value is not None:
                out[param.name] = self._dump_object(param.name, value)
        return out

    def _dump_object(self, name: str, value: Any) -> bytes:
        if name == "model":
            return self._serialize_model(value)
        if name == "store" and hasattr(value, "without_secrets"):
            value = value.without_secrets()  # saved files keep no credentials (see spark_hvd.store.secrets)
        try:
            return pickling.dumps(value)
        except Exception as exc:  # noqa: BLE001 - re-raised with the param's name
            raise TypeError(f"param {name!r} of {type(self).__name__} cannot be pickled: {exc}") from exc

    def _load_objects(self, blobs: dict[str, bytes]) -> dict[str, Any]:
        """The object params from their bytes. The others are set on ``self`` before the model is deserialised,
        so a framework's ``_deserialize_model`` may use them (e.g. Keras ``custom_objects``)."""
        out = {name: cloudpickle.loads(data) for name, data in blobs.items() if name != "model"}
        if out:
            self._set(**out)
        if "model" in blobs:
            out["model"] = self._deserialize_model(blobs["model"])
        return out

    # A framework may define these two as instance methods instead (to use params such as custom_objects).
    @classmethod
    def _serialize_model(cls, model: Any) -> bytes:
        """The model -> bytes (also what ``transform`` broadcasts to the executors)."""
        raise NotImplementedError

    @classmethod
    def _deserialize_model(cls, data: bytes) -> Any:
        """The inverse of ``_serialize_model``."""
        raise NotImplementedError
