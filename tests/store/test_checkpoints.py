"""Durable checkpoints on every kind of store: manifests, a crash mid-replacement, fallback past bad epochs, cleanup.

Written as a crash would act: an exception (or ``os._exit``) at the worst moment of a replacement, files truncated
or altered after their commit, temporary directories left by a dead writer.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import subprocess
import sys
import tempfile
import textwrap

import pytest

from spark_hvd.store import RunDir, Store, StoreError
from spark_hvd.store.manifest import LEGACY_MARKER, MANIFEST


class Crash(BaseException):
    """Stands for the process dying: nothing in the store's code catches it."""


@pytest.fixture
def store(durable_store):
    return durable_store


def _local_checkpoint(tmp_path, name: str, payload: bytes) -> str:
    local = tmp_path / name
    (local / "opt").mkdir(parents=True)
    (local / "model.pt").write_bytes(payload)
    (local / "opt" / "state").write_bytes(b"state-" + payload[:4])
    return str(local)


def _raw(store, path):
    return store._raw_names(path)


def _latest(store):
    """``(epoch, store path)`` of the checkpoint ``RunDir.latest_checkpoint`` downloads and verifies, or None."""
    with tempfile.TemporaryDirectory() as tmp:
        found = RunDir(store, "r").latest_checkpoint(tmp)
    return None if found is None else (found.epoch, found.path)


def _fresh(store):
    """The same store as a new process opens it (no cached state)."""
    return Store.create(store.url, **store.storage_options)


def test_manifest_lists_sizes_and_checksums(store, tmp_path):
    import hashlib

    payload = os.urandom(3000)
    path = RunDir(store, "r").write_checkpoint(0, _local_checkpoint(tmp_path, "c0", payload))
    manifest = json.loads(store.read_bytes(posixpath.join(path, MANIFEST)))
    assert manifest["files"]["model.pt"] == {"size": 3000, "sha256": hashlib.sha256(payload).hexdigest()}
    assert set(manifest["files"]) == {"model.pt", "opt/state"}
    assert store.verify(path) is None
    out = RunDir(store, "r").latest_checkpoint(str(tmp_path / "back")).local_dir
    assert sorted(os.listdir(out)) == ["model.pt", "opt"]


def test_crash_while_replacing_a_committed_checkpoint_loses_nothing(store, tmp_path, monkeypatch):
    """Re-committing epoch 3 dies between taking the old copy away and putting the new one in place: a fresh
    process still finds epoch 3 committed (the new copy, which was complete) and no temporary directory is left."""
    RunDir(store, "r").write_checkpoint(3, _local_checkpoint(tmp_path, "old", b"old" * 100))
    if store.supports_rename:
        real_rename, calls = store._rename, []

        def rename(src, dst):  # 1st: the old copy moved aside; 2nd: the new one renamed in -> dies before it
            calls.append((src, dst))
            if len(calls) == 2:
                raise Crash
            real_rename(src, dst)

        monkeypatch.setattr(store, "_rename", rename)
    else:
        def copy(src, dst, *args, **kwargs):  # the old copy is deleted; dies while copying the new one in
            raise Crash

        monkeypatch.setattr(store.fs, "copy", copy)
    with pytest.raises(Crash):
        RunDir(store, "r").write_checkpoint(3, _local_checkpoint(tmp_path, "new", b"new" * 100))
    monkeypatch.undo()
    reopened = _fresh(store)
    found = RunDir(reopened, "r").latest_checkpoint(str(tmp_path / "back"))
    assert (found.epoch, found.path) == (3, RunDir(reopened, "r").checkpoint_path(3))
    out = found.local_dir
    with open(os.path.join(out, "model.pt"), "rb") as f:
        assert f.read() == b"new" * 100
    assert _raw(reopened, RunDir(reopened, "r").checkpoints_path) == ["epoch-3"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs a child process to kill")
def test_killed_between_rename_aside_and_rename_in_loses_nothing(tmp_path):
    """The same crash as a real process death (``os._exit``, no handler runs) on a local store."""
    root = tmp_path / "store"
    store = Store.create(str(root))
    RunDir(store, "r").write_checkpoint(1, _local_checkpoint(tmp_path, "old", b"old"))
    new = _local_checkpoint(tmp_path, "new", b"new")
    script = textwrap.dedent(f"""
        import os
        from spark_hvd.store import RunDir, Store
        store = Store.create({str(root)!r})
        real, calls = store._rename, []
        def rename(src, dst):
            calls.append(dst)
            if len(calls) == 2:
                os._exit(9)
            real(src, dst)
        store._rename = rename
        RunDir(store, "r").write_checkpoint(1, {new!r})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert "epoch-1" not in os.listdir(root / "runs" / "r" / "checkpoints")  # the moment of danger was reached
    assert _latest(store) == (1, RunDir(store, "r").checkpoint_path(1))
    assert (root / "runs" / "r" / "checkpoints" / "epoch-1" / "model.pt").read_bytes() == b"new"
    assert os.listdir(root / "runs" / "r" / "checkpoints") == ["epoch-1"]


def _overwrite_object(store, path: str, data: bytes) -> None:
    """Change a committed file behind the store's back (a torn write, bit rot, a half-uploaded object)."""
    store.fs.pipe_file(path, data)
    store._invalidate(path)


def test_newest_checkpoints_that_fail_verification_are_skipped_with_the_reason(store, tmp_path, caplog):
    for epoch in range(3):
        RunDir(store, "r").write_checkpoint(epoch, _local_checkpoint(tmp_path, f"c{epoch}",
                                                                     bytes([epoch]) * 500))
    _overwrite_object(store, posixpath.join(RunDir(store, "r").checkpoint_path(2), "model.pt"), bytes([2]) * 123)
    _overwrite_object(store, posixpath.join(RunDir(store, "r").checkpoint_path(1), "opt", "state"),
                      b"state-\xff\xff\xff\xff")
    with caplog.at_level(logging.WARNING, logger="spark_hvd.store.run_dir"):
        assert _latest(_fresh(store)) == (0, RunDir(store, "r").checkpoint_path(0))
    skipped = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(skipped) == 2
    assert "epoch 2" in skipped[0] and "model.pt has 123 bytes, the manifest says 500" in skipped[0]
    assert "epoch 1" in skipped[1] and "opt/state does not match its SHA-256" in skipped[1]
    # the bad epochs stay (evidence) until written again; writing epoch 1 again replaces it
    RunDir(store, "r").write_checkpoint(1, _local_checkpoint(tmp_path, "c1b", b"again"))
    assert _latest(store) == (1, RunDir(store, "r").checkpoint_path(1))


def test_legacy_marker_and_broken_manifest_do_not_count(store, tmp_path, caplog):
    RunDir(store, "r").write_checkpoint(0, _local_checkpoint(tmp_path, "c0", b"zero"))
    legacy = RunDir(store, "r").checkpoint_path(1)
    store.write_bytes(posixpath.join(legacy, "model.pt"), b"x")
    store.write_bytes(posixpath.join(legacy, LEGACY_MARKER), b"")
    broken = RunDir(store, "r").checkpoint_path(2)
    store.write_bytes(posixpath.join(broken, "model.pt"), b"y")
    store.write_bytes(posixpath.join(broken, MANIFEST), b'{"format": "spark_hvd.manif')
    assert not store.is_committed(legacy) and not store.is_committed(broken)
    assert RunDir(store, "r").list_checkpoints() == [0]
    with caplog.at_level(logging.WARNING, logger="spark_hvd.store.run_dir"):
        assert _latest(store)[0] == 0
    text = caplog.text
    assert "epoch 2" in text and "manifest is unreadable" in text
    assert "epoch 1" in text and "_COMMITTED marker of a spark_hvd without manifests" in text


def test_stale_temporary_and_partial_directories_are_cleaned_when_a_run_starts(store, tmp_path):
    root = RunDir(store, "r").checkpoints_path
    RunDir(store, "r").write_checkpoint(0, _local_checkpoint(tmp_path, "c0", b"zero"))
    store.write_bytes(posixpath.join(root, "._tmp-epoch-1.new-0123456789ab", "model.pt"), b"dead writer")
    store.write_bytes(posixpath.join(root, "._tmp-epoch-0-0123456789ab", "model.pt"), b"older spark_hvd temp")
    store.write_bytes(posixpath.join(root, "epoch-2", "model.pt"), b"partial, never committed")
    assert len(_raw(store, root)) == 4
    assert _latest(store) == (0, RunDir(store, "r").checkpoint_path(0))
    assert _raw(store, root) == ["epoch-0"]


def test_step_checkpoints_are_read_once_verified_and_the_newest_wins(store, tmp_path, caplog, monkeypatch):
    run = RunDir(store, "r")
    for epoch, step in ((0, 3), (1, 2)):
        run.write_step_checkpoint(epoch, step, _local_checkpoint(tmp_path, f"s{epoch}{step}", bytes([step]) * 300))
    assert [p for p, _ in run.step_checkpoints()] == [(1, 2)]  # a newer one deletes the older
    run.write_step_checkpoint(1, 4, _local_checkpoint(tmp_path, "s14", bytes([4]) * 300))
    _overwrite_object(store, posixpath.join(run.step_checkpoint_path(1, 4), "model.pt"), bytes([4]) * 7)
    store.write_bytes(posixpath.join(run.step_checkpoint_path(1, 9), "model.pt"), b"partial, never committed")
    monkeypatch.setattr(type(store), "verify", lambda *a: pytest.fail("read twice: verify, then download"))
    reads = []
    download = type(store).download_dir
    monkeypatch.setattr(type(store), "download_dir", lambda s, path, local: (reads.append(path),
                                                                             download(s, path, local))[1])
    with caplog.at_level(logging.WARNING, logger="spark_hvd.store.run_dir"):
        assert RunDir(_fresh(store), "r").latest_step_checkpoint(str(tmp_path / "back"), after=(1, 0)) is None
    assert "after batch 4 of epoch 1" in caplog.text and "model.pt has 7 bytes, the manifest says 300" in caplog.text
    assert reads == [run.step_checkpoint_path(1, 4)]  # the one candidate, downloaded once and checked locally
    assert [p for p, _ in run.step_checkpoints()] == [(1, 4)]  # the partial step-1-9 deleted, the bad one kept
    run.write_step_checkpoint(1, 5, _local_checkpoint(tmp_path, "s15", b"five"))
    found = RunDir(_fresh(store), "r").latest_step_checkpoint(str(tmp_path / "back"), after=(1, 0))
    assert (found.epoch, found.step, found.path) == (1, 5, run.step_checkpoint_path(1, 5))
    assert (tmp_path / "back" / "model.pt").read_bytes() == b"five"
    assert RunDir(store, "r").latest_step_checkpoint(str(tmp_path / "none"), after=(2, 0)) is None
    run.delete_step_checkpoints(before=(2, 0))  # the end of epoch 1 supersedes them
    assert run.step_checkpoints() == []


def test_failed_write_leaves_the_previous_version(store, tmp_path):
    path = RunDir(store, "r").write_checkpoint(0, _local_checkpoint(tmp_path, "c0", b"first"))
    with pytest.raises(OSError, match="disk full"), store.atomic_dir(path) as target:
        store.write_bytes(posixpath.join(target, "model.pt"), b"second, half")
        raise OSError("disk full")
    assert store.verify(path) is None
    assert store.read_bytes(posixpath.join(path, "model.pt")) == b"first"
    assert _raw(store, RunDir(store, "r").checkpoints_path) == ["epoch-0"]


def test_torn_write_is_not_committed(store):
    final = store.path("things", "d")
    with pytest.raises(StoreError, match="torn write"), store.atomic_dir(final) as target:
        store.write_bytes(posixpath.join(target, "a.bin"), b"1234567890")
        store.fs.pipe_file(posixpath.join(target, "a.bin"), b"12345")  # what actually landed
    assert not store.is_committed(final)


def test_local_commit_fsyncs_files_and_directories(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("names fds through /proc")
    monkeypatch.setattr(os, "fsync", fsync)
    store = Store.create(str(tmp_path / "s"))
    path = RunDir(store, "r").write_checkpoint(0, _local_checkpoint(tmp_path, "c0", b"zero"))
    tmp_names = [p for p in synced if "._tmp-epoch-0.new-" in p]
    assert any(p.endswith("/model.pt") for p in tmp_names) and any(p.endswith("/opt/state") for p in tmp_names)
    assert any(f"/{MANIFEST}.tmp-" in p for p in tmp_names)  # written to a temporary name, fsynced, renamed
    assert RunDir(store, "r").checkpoints_path in synced  # the parent, after the rename
    assert store.verify(path) is None


def test_s3_streams_a_file_in_one_put_and_hands_a_larger_one_to_put_file(s3_endpoint, s3_bucket, tmp_path,
                                                                         monkeypatch):
    """Up to ``s3_single_put_max`` a file goes up as one PutObject read from the open file (not through s3fs's
    ``put_file``, which reads it into memory first); above it, ``put_file``. Both commit a manifest that verifies."""
    from helpers.moto_s3 import s3_options

    store = Store.create(f"s3://{s3_bucket}/{tmp_path.name}", **s3_options(s3_endpoint))
    local = _local_checkpoint(tmp_path, "ckpt", os.urandom(300_000))
    put_file = store.fs.put_file
    through_put_file = []
    monkeypatch.setattr(store.fs, "put_file", lambda lpath, rpath, **kw: (through_put_file.append(rpath),
                                                                           put_file(lpath, rpath, **kw)))
    small, large = store.path("small"), store.path("large")
    with store.atomic_dir(small) as target:
        store.upload_dir(local, target)
    assert through_put_file == [] and store.verify(small) is None
    monkeypatch.setattr(store, "s3_single_put_max", 1000)  # model.pt (300 kB) is now too large for one put
    with store.atomic_dir(large) as target:
        store.upload_dir(local, target)
    assert [posixpath.basename(p) for p in through_put_file] == ["model.pt"] and store.verify(large) is None
    with tempfile.TemporaryDirectory() as back:
        store.download_dir(large, back)
        assert open(os.path.join(back, "model.pt"), "rb").read() == open(os.path.join(local, "model.pt"), "rb").read()
