"""Ready decoders for ``transformation_fn``: encoded images (PNG, JPEG, ... in a ``binary`` column) to float tensors.

``ImageDecoder("content", size=(64, 64))`` is a ``transformation_fn``: it takes the pandas DataFrame of a batch
(the binary column holds Python ``bytes``) and returns it with that column replaced by float32 arrays of shape
``(channels, height, width)`` (``channels_last=True``: ``(height, width, channels)`` for Keras), decoded with
Pillow, resized and normalised: ``(pixel / 255 - mean) / std``. The same object is applied by the fitted model's
``transform``, so scoring decodes exactly as training did. It is a plain class (picklable, saved with the model).

Pillow is the decoder: it is maintained, wheels exist everywhere Spark runs, it releases the GIL while decoding (so
the reader's thread pool decodes several images at once), and ``Image.draft`` lets JPEG decode straight at a
reduced scale. Install it with ``pip install spark_hvd[images]``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np

from spark_hvd.data.errors import DataError

__all__ = ["ImageDecoder", "decode_images"]

_CHANNELS = {"L": 1, "RGB": 3, "RGBA": 4}


def decode_images(blobs: Sequence[bytes], size: tuple[int, int], mode: str = "RGB", mean: Any = None,
                  std: Any = None, channels_last: bool = False, column: str = "image") -> np.ndarray:
    """Encoded images -> one float32 array ``(n, C, H, W)`` (or ``(n, H, W, C)``), resized to ``size = (H, W)``.

    Raises:
        DataError: a blob that is not an image Pillow can read (naming ``column`` and the row).
    """
    from PIL import Image, UnidentifiedImageError

    height, width = int(size[0]), int(size[1])
    channels = _CHANNELS[mode]
    pixels = np.empty((len(blobs), height, width, channels), dtype=np.uint8)
    for i, blob in enumerate(blobs):
        try:
            with Image.open(io.BytesIO(blob)) as img:
                img.draft(mode, (width, height))  # JPEG: decode at the nearest scale >= size (much less work)
                if img.mode != mode:
                    img = img.convert(mode)
                if img.size != (width, height):
                    img = img.resize((width, height), Image.BILINEAR)
                pixels[i] = np.frombuffer(img.tobytes(), dtype=np.uint8).reshape(height, width, channels)
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise DataError(f"column {column!r}, row {i} of the batch: not an image Pillow can decode ({exc})") from exc
    return _normalise(pixels, mean, std, channels_last)


def _normalise(pixels: np.ndarray, mean: Any, std: Any, channels_last: bool) -> np.ndarray:
    """uint8 ``(n, H, W, C)`` -> contiguous float32 ``(pixel / 255 - mean) / std`` in the asked layout, written in
    one pass as ``pixel * scale + offset`` (per channel), transposed on the way for channels first."""
    channels = pixels.shape[-1]
    scale = np.full(channels, 1 / 255, dtype=np.float64)
    offset = np.zeros(channels, dtype=np.float64)
    if mean is not None:
        offset -= np.asarray(mean, dtype=np.float64).reshape(-1)
    if std is not None:
        inv = 1 / np.asarray(std, dtype=np.float64).reshape(-1)
        scale, offset = scale * inv, offset * inv
    if channels_last:
        src, shape = pixels, (1, 1, 1, channels)
    else:
        src, shape = pixels.transpose(0, 3, 1, 2), (1, channels, 1, 1)
    out = np.empty(src.shape, dtype=np.float32)
    np.multiply(src, scale.astype(np.float32).reshape(shape), out=out)
    if offset.any():
        out += offset.astype(np.float32).reshape(shape)
    return out


class ImageDecoder:
    """A ``transformation_fn`` that decodes the encoded images of ``column`` into float32 tensors.

    Args:
        column: the binary column (e.g. ``content`` of ``spark.read.format("binaryFile")``).
        size: ``(height, width)`` every image is resized to.
        mode: Pillow mode: ``"RGB"`` (3 channels), ``"L"`` (grey, 1 channel) or ``"RGBA"``.
        mean, std: per-channel normalisation after scaling to [0, 1] (e.g. ImageNet's); None: none.
        channels_last: ``(H, W, C)`` rows (Keras) instead of ``(C, H, W)`` (torch).
        output_col: the column to write (default: replace ``column``).

    Other columns pass through unchanged; at inference the DataFrame holds the feature columns only.

    ``prefers_processes`` (true for outputs of at most 128 x 128 pixels): the estimators' default pool
    (``reader_pool_type="auto"``) then runs it in worker processes. For small images about half of the time per
    image is Pillow's Python code (open, header parsing, ``load``), which holds the GIL; only the decode and the
    resize release it. So threads overlap little of the work and, on a busy machine, lose time to GIL hand-offs:
    on 2 cores with 32 x 32 outputs, 0.79-1.31x a one-thread loop over the same bytes, against 1.10-1.13x with
    processes (benchmarks/RESULTS.md). For large outputs the decode and resize dominate and release the GIL, and
    each decoded batch (37 MiB for 64 images at 224 x 224) costs a process pool a copy into shared memory: there
    threads did better than processes (loaded runs: about the one-thread loop's speed against two thirds of it).
    The 128 x 128 line between them is a judgement from those two sizes, not a measured crossover.
    """

    def __init__(self, column: str, size: tuple[int, int] = (224, 224), mode: str = "RGB", mean: Any = None,
                 std: Any = None, channels_last: bool = False, output_col: str | None = None) -> None:
        if mode not in _CHANNELS:
            raise ValueError(f"ImageDecoder: mode must be one of {sorted(_CHANNELS)}, got {mode!r}")
        if len(size) != 2 or min(int(s) for s in size) < 1:
            raise ValueError(f"ImageDecoder: size must be (height, width) > 0, got {size!r}")
        self.column, self.size, self.mode = column, (int(size[0]), int(size[1])), mode
        self.mean = None if mean is None else [float(m) for m in np.ravel(mean)]
        self.std = None if std is None else [float(s) for s in np.ravel(std)]
        self.channels_last = bool(channels_last)
        self.output_col = output_col or column

    @property
    def prefers_processes(self) -> bool:
        """Whether the default pool runs this decoder in worker processes (small outputs; see the class doc)."""
        return self.size[0] * self.size[1] <= 128 * 128

    @property
    def shape(self) -> tuple[int, int, int]:
        """The shape of one decoded row."""
        h, w = self.size
        c = _CHANNELS[self.mode]
        return (h, w, c) if self.channels_last else (c, h, w)

    def __call__(self, df: Any) -> Any:
        if self.column not in df.columns:
            raise DataError(f"ImageDecoder: column {self.column!r} is not in the batch (columns: {list(df.columns)})")
        images = decode_images(df[self.column].to_numpy(), self.size, self.mode, self.mean, self.std,
                               self.channels_last, self.column)
        out = df.copy(deep=False)
        out[self.output_col] = list(images)  # one (C, H, W) view per row; the reader stacks them again
        return out

    def __repr__(self) -> str:
        return (f"ImageDecoder({self.column!r}, size={self.size}, mode={self.mode!r}, mean={self.mean}, "
                f"std={self.std}, channels_last={self.channels_last})")
