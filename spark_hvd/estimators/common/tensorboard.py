"""TensorBoard event files without TensorBoard: per-epoch scalars written through the store (any fsspec URL).

TensorBoard reads ``events.out.tfevents.*`` files: TFRecord-framed ``Event`` protocol buffers. This module encodes
the few messages it needs by hand, so neither ``tensorboard`` nor TensorFlow is a dependency and the file can be
written through the store to S3, DBFS, HDFS or ``memory://`` (``tf.summary`` writes only through TensorFlow's own
file systems). Open a run's logs with ``tensorboard --logdir <store>/runs/<run_id>/logs``.

What is written (``tensorflow/core/util/event.proto`` and ``tensorflow/core/framework/summary.proto``)::

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }

The first event of a file is ``file_version: "brain.Event:2"``; then one event per epoch (``step`` = epoch, 0-based)
whose summary holds one scalar per metric: ``train/<name>`` for the training metrics and ``val/<name>`` for the
validation ones (``val_loss`` -> ``val/loss``). Each record is framed as TFRecord: the data length (uint64 little
endian), the masked CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data.

The store has no append, so :class:`EventFileWriter` rewrites the whole (small) file after every epoch with
``Store.write_bytes`` (which never shows readers a partial file). A resumed run finds the file of the earlier run,
keeps its name and the wall times of the epochs already in it, and rewrites it from the full history, so every
epoch is in it once.
"""

from __future__ import annotations

import logging
import posixpath
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["EventFileWriter", "crc32c", "masked_crc32c", "encode_event", "frame_record", "read_records",
           "decode_event", "scalar_tag", "FILE_VERSION"]

log = logging.getLogger(__name__)

#: the ``file_version`` of the first event of every file (what TensorBoard's loader expects)
FILE_VERSION = "brain.Event:2"

# ------------------------------------------------------------------------------------------------ CRC-32C


def _crc32c_table() -> tuple[int, ...]:
    poly = 0x82F63B78  # Castagnoli, bit-reversed
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ poly if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as TFRecord uses it (``crc32c(b"123456789") == 0xE3069283``)."""
    crc = 0xFFFFFFFF
    table = _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 bits and add a constant (mod 2**32)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ------------------------------------------------------------------------------------------------ protobuf


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 fields: two's complement in ten bytes
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint((field << 3) | wire_type)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _scalar_value(tag: str, value: float) -> bytes:
    return _length_delimited(1, tag.encode("utf-8")) + _key(2, 5) + struct.pack("<f", value)


def encode_event(wall_time: float, step: int = 0, *, file_version: str | None = None,
                 scalars: dict[str, float] | None = None) -> bytes:
    """One serialised ``Event``: a ``file_version`` event, or a summary of ``scalars`` (tag -> value) at ``step``."""
    out = _key(1, 1) + struct.pack("<d", float(wall_time))
    if step:
        out += _key(2, 0) + _varint(int(step))
    if file_version is not None:
        out += _length_delimited(3, file_version.encode("utf-8"))
    if scalars is not None:
        summary = b"".join(_length_delimited(1, _scalar_value(tag, float(v))) for tag, v in scalars.items())
        out += _length_delimited(5, summary)
    return out


def frame_record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord (length, masked CRC of the length, data, masked CRC of the data)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def read_records(data: bytes) -> Iterator[bytes]:
    """The payloads of a TFRecord file's records; raises ``ValueError`` on a truncated record or a bad CRC."""
    pos, n = 0, len(data)
    while pos < n:
        if pos + 12 > n:
            raise ValueError(f"truncated TFRecord header at byte {pos}")
        header = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", header)
        (crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
        if crc != masked_crc32c(header):
            raise ValueError(f"bad length CRC of the TFRecord at byte {pos}")
        end = pos + 12 + length
        if end + 4 > n:
            raise ValueError(f"truncated TFRecord at byte {pos} ({length} bytes announced)")
        payload = data[pos + 12:end]
        (crc,) = struct.unpack("<I", data[end:end + 4])
        if crc != masked_crc32c(payload):
            raise ValueError(f"bad data CRC of the TFRecord at byte {pos}")
        yield payload
        pos = end + 4


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of a serialised message: ints, floats as raw bytes, payload bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} (field {field})")
        yield field, wire, value


def decode_event(data: bytes) -> dict[str, Any]:
    """The fields this module writes, from one serialised ``Event``: ``wall_time``, ``step``, and ``file_version``
    or ``scalars`` (tag -> float); other fields are skipped."""
    event: dict[str, Any] = {"wall_time": 0.0, "step": 0}
    for field, wire, value in _fields(data):
        if field == 1 and wire == 1:
            event["wall_time"] = struct.unpack("<d", value)[0]
        elif field == 2 and wire == 0:
            event["step"] = value - (1 << 64) if value >= 1 << 63 else value
        elif field == 3 and wire == 2:
            event["file_version"] = value.decode("utf-8")
        elif field == 5 and wire == 2:
            scalars = event.setdefault("scalars", {})
            for vfield, _, vvalue in _fields(value):
                if vfield != 1:
                    continue
                tag, number = None, None
                for f, w, v in _fields(vvalue):
                    if f == 1 and w == 2:
                        tag = v.decode("utf-8")
                    elif f == 2 and w == 5:
                        number = struct.unpack("<f", v)[0]
                if tag is not None and number is not None:
                    scalars[tag] = number
    return event


# ------------------------------------------------------------------------------------------------ the writer


def scalar_tag(metric: str) -> str:
    """A history key as a TensorBoard tag: ``val_<m>`` -> ``val/<m>``, any other ``<m>`` -> ``train/<m>``."""
    return f"val/{metric[4:]}" if metric.startswith("val_") else f"train/{metric}"


class EventFileWriter:
    """One TensorBoard event file of a run in ``logs_dir`` (a store path), rewritten from the history every epoch.

    Args:
        store: a ``spark_hvd.store.Store``; every read and write goes through it.
        logs_dir: the store path of the run's logs directory (``RunDir(store, run_id).logs_path``).
    """

    def __init__(self, store: Any, logs_dir: str) -> None:
        self.store = store
        self.logs_dir = logs_dir.rstrip("/")
        self._name: str | None = None
        self._start = 0.0
        self._times: dict[int, float] = {}
        self._records: dict[int, tuple[tuple, bytes]] = {}  # epoch -> (its scalars, its framed record)

    @property
    def path(self) -> str | None:
        """The store path of the event file (None until the first write)."""
        return posixpath.join(self.logs_dir, self._name) if self._name else None

    def _open(self) -> None:
        """Adopt an event file left by an earlier attempt of the run (its name and the epochs' wall times)."""
        existing = [n for n in self.store.listdir(self.logs_dir) if ".tfevents." in n]
        if not existing:
            self._start = time.time()
            self._name = f"events.out.tfevents.{int(self._start)}.{socket.gethostname() or 'localhost'}"
            return
        self._name = existing[0]
        if len(existing) > 1:
            log.warning("%s holds %d event files; rewriting %s only", self.logs_dir, len(existing), self._name)
        self._start = time.time()
        try:
            for payload in read_records(self.store.read_bytes(self.path)):
                event = decode_event(payload)
                if "file_version" in event:
                    self._start = event["wall_time"]
                elif "scalars" in event:
                    self._times[int(event["step"])] = event["wall_time"]
        except (ValueError, OSError) as exc:  # unreadable: written again from the history, with new wall times
            log.warning("event file %s could not be read (%s); rewriting it", self.path, exc)

    def write_history(self, history: dict[str, list[float]]) -> str:
        """Rewrite the event file with one event per epoch of ``history`` (``{metric: [value per epoch]}``);
        returns its store path."""
        if self._name is None:
            self._open()
        now = time.time()
        epochs = max((len(v) for v in history.values()), default=0)
        records = [frame_record(encode_event(self._start, 0, file_version=FILE_VERSION))]
        for epoch in range(epochs):
            scalars = {scalar_tag(k): float(v[epoch]) for k, v in sorted(history.items()) if epoch < len(v)}
            key = tuple(scalars.items())
            cached = self._records.get(epoch)
            if cached is None or cached[0] != key:  # encoded once per epoch (the CRC is pure Python)
                wall = self._times.setdefault(epoch, now)
                cached = (key, frame_record(encode_event(wall, epoch, scalars=scalars)))
                self._records[epoch] = cached
            records.append(cached[1])
        path = self.path
        assert path is not None
        self.store.write_bytes(path, b"".join(records))
        return path
