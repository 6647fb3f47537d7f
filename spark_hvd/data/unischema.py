"""A petastorm dataset's schema (its *Unischema*), read without petastorm installed.

petastorm's ``materialize_dataset`` pickles the dataset's ``Unischema`` into the key-value metadata of the
``_common_metadata`` Parquet file beside the data files, under ``dataset-toolkit.unischema.v1``. The pickle names
petastorm's own classes (``petastorm.unischema.Unischema`` / ``UnischemaField``, ``petastorm.codecs.*Codec``),
numpy scalar types (``numpy.float32``) and pyspark's ``DataType`` classes (a ``ScalarCodec``'s Spark type).

:func:`read_unischema` unpickles it with an unpickler that knows only those names and builds plain stand-ins
(:class:`PetastormField`, :class:`Codec`): nothing else can be constructed, so a tampered file cannot run code,
and neither petastorm nor pyspark need be importable. Names petastorm used before it was open-sourced
(``av.experimental.deepdrive.dataset_toolkit``) are taken as its current ones, as petastorm itself does.
"""

from __future__ import annotations

import io
import pickle
import posixpath
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from spark_hvd.data.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow.fs

__all__ = ["Codec", "PetastormField", "PetastormSchema", "UNISCHEMA_KEY", "UnischemaError", "read_unischema"]

#: The ``_common_metadata`` key that holds the pickled Unischema.
UNISCHEMA_KEY = b"dataset-toolkit.unischema.v1"
_LEGACY_PREFIX = "av.experimental.deepdrive.dataset_toolkit"

#: petastorm's codec classes, by the name the pickle gives, as the ``kind`` of :class:`Codec`.
CODEC_KINDS = {
    "ScalarCodec": "scalar",
    "NdarrayCodec": "ndarray",
    "CompressedNdarrayCodec": "compressed_ndarray",
    "CompressedImageCodec": "image",
}


class UnischemaError(DataError):
    """A petastorm ``_common_metadata`` whose Unischema cannot be read (names the file and what it held)."""


@dataclass
class Codec:
    """A petastorm codec as pickled: ``kind`` is ``"scalar"``, ``"ndarray"``, ``"compressed_ndarray"`` or
    ``"image"``; ``state`` the codec object's attributes (``_image_codec`` ``".png"`` / ``".jpeg"``, ``_quality``;
    ``_spark_type`` a :class:`SparkType` for a scalar)."""

    kind: str
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def image_format(self) -> str:
        """``"png"``, ``"jpeg"`` ... for an image codec."""
        return str(self.state.get("_image_codec", ".png")).lstrip(".").lower()

    def to_json(self) -> dict[str, Any]:
        """What the reader needs, JSON-able (kept in ``DatasetInfo.extra["codecs"]``)."""
        out: dict[str, Any] = {"kind": self.kind}
        if self.kind == "image":
            out["format"] = self.image_format
        return out


@dataclass
class SparkType:
    """A pyspark ``DataType`` as pickled: its class name (``"LongType"``) and attributes (a decimal's precision)."""

    name: str
    state: dict[str, Any] = field(default_factory=dict)


class PetastormField(NamedTuple):
    """One field of a Unischema: ``numpy_dtype`` is a numpy dtype; ``shape`` may hold ``None`` (any length)."""

    name: str
    numpy_dtype: np.dtype
    shape: tuple[int | None, ...]
    codec: Codec | None
    nullable: bool


@dataclass
class PetastormSchema:
    """A petastorm Unischema: its name and its fields in order."""

    name: str
    fields: dict[str, PetastormField]


def _stand_in(base: type, label: str) -> type:
    """A class the unpickler builds in place of a petastorm codec class (``base`` :class:`Codec`, ``label`` its kind)
    or of a pyspark type (``base`` :class:`SparkType`, ``label`` its name). pickle builds it with ``cls.__new__(cls)``
    and then ``__setstate__`` (where the object had attributes): no ``__init__`` runs."""

    def new(cls: type, *args: Any, **kwargs: Any) -> Any:
        obj = object.__new__(cls)
        base.__init__(obj, label)
        return obj

    def setstate(self: Any, state: Any) -> None:
        self.state = dict(state or {})

    return type(f"_{label}", (base,), {"__new__": new, "__init__": lambda self, *a, **k: None,
                                       "__setstate__": setstate})


class _Unischema:
    """What ``petastorm.unischema.Unischema`` unpickles into (its ``__dict__``: ``_name``, ``_fields``)."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def _field(f: Any, where: str) -> PetastormField:
    """A field as unpickled (``numpy_dtype`` a numpy type class, ``shape`` a tuple) in its normal form."""
    if not isinstance(f, PetastormField) or (f.codec is not None and not isinstance(f.codec, Codec)):
        raise UnischemaError(f"{where}: a Unischema field is {f!r}, not a UnischemaField")
    return PetastormField(str(f.name), np.dtype(f.numpy_dtype), tuple(f.shape or ()), f.codec, bool(f.nullable))


class _Unpickler(pickle.Unpickler):
    """Builds stand-ins for the names a Unischema pickle holds; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith(_LEGACY_PREFIX):
            module = "petastorm" + module[len(_LEGACY_PREFIX):]
        if module == "petastorm.unischema" and name == "Unischema":
            return _Unischema
        if module == "petastorm.unischema" and name == "UnischemaField":
            return PetastormField  # a NamedTuple, as petastorm's: NEWOBJ builds it from the same arguments
        if module == "petastorm.codecs" and name in CODEC_KINDS:
            return _stand_in(Codec, CODEC_KINDS[name])
        if module.startswith("pyspark.sql.types") and name.endswith("Type"):
            return _stand_in(SparkType, name)
        if module in ("numpy", "numpy.core.numerictypes", "numpy._core.numerictypes") and name.isidentifier():
            legacy = {"string_": "bytes_", "unicode_": "str_", "bool": "bool_", "object": "object_"}
            kind = getattr(np, legacy.get(name, name), None)
            if isinstance(kind, type) and issubclass(kind, np.generic):
                return kind
        if module == "numpy" and name == "dtype":
            return np.dtype
        if (module, name) in (("collections", "OrderedDict"), ("builtins", "object"), ("copyreg", "_reconstructor"),
                              ("builtins", "str"), ("builtins", "bytes"), ("builtins", "int"), ("builtins", "float"),
                              ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"), ("builtins", "set"),
                              ("builtins", "frozenset"), ("builtins", "bool")):
            return pickle.Unpickler.find_class(self, module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a petastorm Unischema")


def parse_unischema(data: bytes, where: str = "_common_metadata") -> PetastormSchema:
    """The :class:`PetastormSchema` of a pickled Unischema (``where`` names its file in errors)."""
    try:
        obj = _Unpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise UnischemaError(f"the petastorm Unischema in {where} cannot be read: {exc}") from None
    fields = getattr(obj, "_fields", None)
    if not isinstance(obj, _Unischema) or not isinstance(fields, dict):
        raise UnischemaError(f"{where} holds {type(obj).__name__} under {UNISCHEMA_KEY.decode()}, not a Unischema")
    return PetastormSchema(str(getattr(obj, "_name", "")), {str(k): _field(v, where) for k, v in fields.items()})


def read_unischema(path: str, filesystem: pyarrow.fs.FileSystem | None = None) -> PetastormSchema | None:
    """The Unischema of the petastorm dataset at ``path``, or ``None`` where ``path`` has no ``_common_metadata``
    holding one (a plain Parquet directory).

    Raises:
        UnischemaError: the file holds a Unischema that cannot be read.
    """
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    if filesystem is None:
        filesystem, path = pafs.FileSystem.from_uri(path) if "://" in path else (pafs.LocalFileSystem(), path)
    meta_path = posixpath.join(path.rstrip("/"), "_common_metadata")
    if filesystem.get_file_info(meta_path).type != pafs.FileType.File:
        return None
    try:
        with filesystem.open_input_file(meta_path) as f:
            metadata = pq.read_schema(f).metadata or {}
    except Exception as exc:
        raise UnischemaError(f"{meta_path} is not a Parquet metadata file: {exc}") from None
    data = metadata.get(UNISCHEMA_KEY)
    return None if data is None else parse_unischema(data, meta_path)
