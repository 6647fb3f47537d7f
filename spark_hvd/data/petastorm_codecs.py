"""Decoding the columns of a petastorm dataset as petastorm's codecs encoded them, without petastorm.

A codec (``spark_hvd.data.unischema.Codec``, kept JSON-able as ``{"kind": ..., "format": ...}`` in a dataset's
``DatasetInfo.extra["codecs"]``) says how a ``binary`` column holds its arrays:

- ``"ndarray"`` (``NdarrayCodec``): each value is ``np.save``'s bytes. Where every row has the same header (one
  dtype, one shape: the common case), the batch's values buffer is taken as a ``(rows, bytes)`` matrix, the header
  checked once against every row and the data columns viewed as the dtype: one copy, no Python loop per row.
- ``"compressed_ndarray"`` (``CompressedNdarrayCodec``): ``np.savez_compressed(arr=...)``, one ``np.load`` per row.
- ``"image"`` (``CompressedImageCodec``, png / jpeg ...): decoded with Pillow (petastorm encodes with OpenCV, which
  stores the pixels as RGB in the file: petastorm swaps the channels before encoding and after decoding, so Pillow's
  RGB is petastorm's). A greyscale image is ``(H, W)``. JPEG decoders differ by a few levels per pixel.
- ``"scalar"`` (``ScalarCodec``): stored natively by Spark, cast to the field's numpy dtype.

Nothing is unpickled: ``np.load`` runs with ``allow_pickle=False`` (an object array is refused, naming the column).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spark_hvd.data.errors import ReaderError

__all__ = ["DecodingTransform", "decode_column", "decode_value"]


def decode_value(codec: dict[str, Any], value: bytes, column: str = "column") -> np.ndarray:
    """One stored value of a codec column as petastorm's ``codec.decode`` returns it."""
    kind = codec["kind"]
    try:
        if kind == "ndarray":
            return np.load(io.BytesIO(value), allow_pickle=False)
        if kind == "compressed_ndarray":
            with np.load(io.BytesIO(value), allow_pickle=False) as z:
                return z["arr"]
        if kind == "image":
            from PIL import Image

            with Image.open(io.BytesIO(value)) as img:
                if img.mode not in ("L", "RGB", "I;16", "I"):
                    img = img.convert("RGB")
                return np.asarray(img)
    except Exception as exc:
        raise ReaderError(f"column {column!r}: a value the petastorm codec {kind!r} cannot decode: {exc}") from None
    raise ReaderError(f"column {column!r}: unknown petastorm codec {kind!r}")


def decode_column(codec: dict[str, Any], arr: Any, dtype: str, shape: Sequence[int], column: str,
                  where: str = "") -> np.ndarray:
    """A stored ``binary`` Arrow array (or a sequence of ``bytes``) of a codec column -> ``(rows, *shape)`` of
    ``dtype``; a ``"scalar"`` codec's column cast to ``dtype``.

    Raises:
        ReaderError: a value that does not decode, or decodes to another shape (naming ``column`` and ``where``).
    """
    import pyarrow as pa

    kind, n = codec["kind"], len(arr)
    if kind == "scalar":
        values = arr.to_numpy(zero_copy_only=False) if isinstance(arr, pa.Array) else np.asarray(arr)
        return values if values.dtype == object or dtype == "object" else values.astype(dtype, copy=False)
    if kind == "ndarray" and isinstance(arr, pa.Array) and n:
        fast = _ndarray_matrix(arr, dtype, shape)
        if fast is not None:
            return fast
    values = arr.to_pylist() if isinstance(arr, pa.Array) else list(arr)
    out = np.empty((n, *shape), dtype=dtype)
    for i, value in enumerate(values):
        decoded = decode_value(codec, value, column)
        if decoded.shape != tuple(shape):
            raise ReaderError(f"{where}: column {column!r} row {i} decodes to shape {list(decoded.shape)}, "
                              f"expected {list(shape)} (rows of varying shapes: decode them in transformation_fn)")
        out[i] = decoded
    return out


def _ndarray_matrix(arr: Any, dtype: str, shape: Sequence[int]) -> np.ndarray | None:
    """``np.save`` bytes of one length and one header on every row -> one array, else ``None`` (decode per row)."""
    import pyarrow as pa

    if not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        return None
    kind = np.int64 if pa.types.is_large_binary(arr.type) else np.int32
    offsets = np.frombuffer(arr.buffers()[1], dtype=kind)[arr.offset:arr.offset + len(arr) + 1]
    lengths = np.diff(offsets)
    if arr.null_count or lengths.min() != lengths.max():
        return None
    width = int(lengths[0])
    data = np.frombuffer(arr.buffers()[2], dtype=np.uint8)[offsets[0]:offsets[-1]].reshape(len(arr), width)
    head = io.BytesIO(data[0].tobytes())
    try:
        major, _ = np.lib.format.read_magic(head)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        stored_shape, fortran, stored_dtype = read_header(head)
    except Exception:
        return None
    start = head.tell()
    if (stored_dtype.hasobject or tuple(stored_shape) != tuple(shape)
            or width - start != stored_dtype.itemsize * int(np.prod(stored_shape, dtype=np.int64))
            or not (data[:, :start] == data[0, :start]).all()):
        return None
    values = np.ascontiguousarray(data[:, start:]).view(stored_dtype)
    if fortran:
        values = values.reshape(len(arr), *reversed(stored_shape)).transpose(0, *range(len(stored_shape), 0, -1))
    else:
        values = values.reshape(len(arr), *stored_shape)
    return values.astype(dtype, copy=False)


class DecodingTransform:
    """A ``transformation_fn`` that first decodes the codec columns of the pandas batch (each row's value becomes
    its numpy array, as petastorm hands them over), then calls the user's ``fn``. Picklable: it runs in the
    reader's thread or process pool as ``fn`` would."""

    def __init__(self, fn: Callable[[Any], Any], codecs: dict[str, dict[str, Any]]) -> None:
        self.fn, self.codecs = fn, dict(codecs)
        self.prefers_processes = bool(getattr(fn, "prefers_processes", False))

    def __call__(self, frame: Any) -> Any:
        frame = frame.copy(deep=False)
        for name, codec in self.codecs.items():
            if name in frame.columns and codec["kind"] != "scalar":
                frame[name] = [decode_value(codec, v, name) for v in frame[name]]
        return self.fn(frame)

    def __repr__(self) -> str:
        return f"DecodingTransform({self.fn!r}, codecs={sorted(self.codecs)})"
