"""The dependency-free TensorBoard event writer, checked with TensorFlow's own reader (an independent decoder)."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.estimators import tf_events, tf_scalars

from spark_hvd.estimators.common.tensorboard import (
    FILE_VERSION,
    EventFileWriter,
    crc32c,
    decode_event,
    encode_event,
    frame_record,
    masked_crc32c,
    read_records,
    scalar_tag,
)
from spark_hvd.store import RunDir, Store


def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(b"") == 0
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of 0xff
    assert masked_crc32c(b"123456789") == ((((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def test_encoded_events_read_by_tensorflow(tmp_path):
    rng = np.random.default_rng(0)
    scalars = {f"train/m{i}": float(v) for i, v in enumerate(rng.standard_normal(5))}
    data = frame_record(encode_event(1.5e9, file_version=FILE_VERSION))
    for step in (0, 1, 7, 300, 2**40):
        data += frame_record(encode_event(1.5e9 + step, step, scalars=scalars))
    path = tmp_path / "events.out.tfevents.1.test"
    path.write_bytes(data)

    events = tf_events(path)
    assert events[0].file_version == FILE_VERSION and events[0].wall_time == 1.5e9
    assert [e.step for e in events[1:]] == [0, 1, 7, 300, 2**40]
    assert [e.wall_time for e in events[1:]] == [1.5e9 + s for s in (0, 1, 7, 300, 2**40)]
    for event in events[1:]:
        assert [v.tag for v in event.summary.value] == list(scalars)
        assert [v.simple_value for v in event.summary.value] == [np.float32(v) for v in scalars.values()]
    # our own decoder agrees (the writer uses it to keep wall times on resume)
    decoded = [decode_event(r) for r in read_records(data)]
    assert decoded[0]["file_version"] == FILE_VERSION
    assert decoded[3] == {"wall_time": 1.5e9 + 7, "step": 7,
                          "scalars": {k: float(np.float32(v)) for k, v in scalars.items()}}
    with pytest.raises(ValueError, match="CRC"):
        list(read_records(data[:20] + bytes([data[20] ^ 1]) + data[21:]))
    # TensorFlow checks both CRCs too: reading the file above back means they were right
    import tensorflow as tf

    bad = tmp_path / "events.out.tfevents.2.bad"
    bad.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(tf.errors.DataLossError, match="corrupted record"):
        tf_events(bad)


def test_writer_rewrites_per_epoch_and_resumes_without_duplicates(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    logs = RunDir(store, "run-a").logs_path
    history = {"loss": [1.0, 0.5], "val_loss": [1.2, 0.6], "val_accuracy": [0.25, 0.5], "mae": [0.9, 0.4]}
    first = EventFileWriter(store, logs)
    first.write_history({k: v[:1] for k, v in history.items()})
    path = first.write_history(history)
    assert [n for n in store.listdir(logs) if "tfevents" in n] == [path.rsplit("/", 1)[1]]
    wall = [e.wall_time for e in tf_events(path)]

    # a resumed run (a new writer, as in a new process) continues the same file: every epoch once
    history = {k: [*v, v[-1] / 2] for k, v in history.items()}
    again = EventFileWriter(store, logs)
    assert again.write_history(history) == path
    assert [n for n in store.listdir(logs) if "tfevents" in n] == [path.rsplit("/", 1)[1]]
    values, steps, version = tf_scalars(path)
    assert version == FILE_VERSION
    assert set(values) == {"train/loss", "val/loss", "val/accuracy", "train/mae"}
    for key, vals in history.items():
        assert values[scalar_tag(key)] == [np.float32(v) for v in vals]
        assert steps[scalar_tag(key)] == [0, 1, 2]
    assert [e.wall_time for e in tf_events(path)][:3] == wall, "the earlier epochs keep their wall times"


def test_writer_through_a_memory_store(tmp_path):
    store = Store.create("memory://tb-test")
    history = {"loss": [3.0, 2.0, 1.0]}
    path = EventFileWriter(store, RunDir(store, "mem").logs_path).write_history(history)
    local = tmp_path / "events.out.tfevents.copy"
    local.write_bytes(store.read_bytes(path))
    values, steps, _ = tf_scalars(local)
    assert values == {"train/loss": [3.0, 2.0, 1.0]} and steps == {"train/loss": [0, 1, 2]}
