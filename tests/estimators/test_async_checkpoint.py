"""Checkpoints uploaded in the background (``checkpoint_upload``): rank 0's ``RankRun`` over a real local store
whose uploads block on a gate (a slow store). Training steps go on while the upload runs, the manifest is
committed after the data, a failed upload is retried (and skipped with a warning when it keeps failing: training
goes on and the next checkpoint is written; the final model's write retries longer, then raises), a busy upload
makes the next checkpoint wait or be skipped, and the end of the run waits for the last one."""

from __future__ import annotations

import json
import logging
import os
import posixpath
import threading
import time
from types import SimpleNamespace

import pytest

from spark_hvd.estimators.common.rank_run import RankRun
from spark_hvd.store import RunDir, Store
from spark_hvd.store.background import UploadFailedError
from spark_hvd.store.local import LocalStore
from spark_hvd.store.manifest import MANIFEST

RUN = "async-run"


class SlowStore(LocalStore):
    """A local store whose directory uploads wait for ``gate`` (or fail ``fail`` times first), recording when each
    upload started and ended and when each manifest was written."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = 0
        self.uploads: list[tuple[float, float]] = []
        self.manifests: list[float] = []

    def __reduce__(self):  # pragma: no cover - never pickled here
        raise TypeError("not shipped")

    def upload_dir(self, local_dir: str, path: str) -> None:
        start = time.monotonic()
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        if self.fail:
            self.fail -= 1
            raise OSError("the store is unreachable (injected)")
        super().upload_dir(local_dir, path)
        self.uploads.append((start, time.monotonic()))

    def write_bytes(self, path: str, data: bytes) -> None:
        super().write_bytes(path, data)
        if os.path.basename(path) == MANIFEST:
            self.manifests.append(time.monotonic())


class Trainer:
    """What ``RankRun`` needs of a framework here: the state is a counter written as the checkpoint's file."""

    hvd = SimpleNamespace(broadcast_object=lambda value, root_rank: value)

    def __init__(self) -> None:
        self.weights = 0

    def save_checkpoint(self, directory: str) -> None:
        with open(os.path.join(directory, "weights.json"), "w") as f:
            json.dump({"weights": self.weights}, f)


def _run(store: Store, upload: str = "async", when_busy: str = "wait",
         keep: int | None = None) -> tuple[RankRun, Trainer]:
    spec = SimpleNamespace(store=store, run_id=RUN, best=None, checkpoint_upload=upload,
                           checkpoint_when_busy=when_busy, keep_checkpoints=keep)
    trainer = Trainer()
    run = RankRun(spec, trainer)
    run.writer.retry_pause_s = 0.01
    return run, trainer


def _steps(trainer: Trainer, n: int) -> list[float]:
    stamps = []
    for _ in range(n):
        trainer.weights += 1
        stamps.append(time.monotonic())
        time.sleep(0.005)
    return stamps


def _committed_weights(store: Store, epoch: int, tmp_path) -> int:
    path = posixpath.join(RunDir(store, RUN).checkpoint_path(epoch), "weights.json")
    return json.loads(store.read_bytes(path))["weights"]


def _latest(store: Store, tmp_path) -> int | None:
    """The epoch of the newest checkpoint that verifies (``RunDir.latest_checkpoint``), or None."""
    found = RunDir(store, RUN).latest_checkpoint(str(tmp_path / "latest"))
    return None if found is None else found.epoch


def test_steps_go_on_while_the_checkpoint_uploads_and_the_manifest_comes_last(tmp_path):
    store = SlowStore(str(tmp_path / "store"))
    run, trainer = _run(store)
    _steps(trainer, 3)
    store.gate.clear()
    run.end_epoch(0, {"loss": 1.0})  # snapshot (weights 3) taken; the upload blocks on the gate
    submitted = time.monotonic()
    stamps = _steps(trainer, 20)
    assert _latest(store, tmp_path) is None, "nothing may be committed before the upload finished"
    time.sleep(0.3)
    store.gate.set()
    run.writer.wait()
    (_, end), = store.uploads
    assert all(submitted < t < end for t in stamps), "the steps did not run during the upload"
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert max(gaps) < (end - submitted) / 2, "a step waited for the upload"
    assert store.manifests and min(store.manifests) > end, "the manifest must be written after the data"
    assert _latest(store, tmp_path) == 0
    assert _committed_weights(store, 0, tmp_path) == 3, "the checkpoint is the state at the step it was taken"


def test_sync_upload_blocks_the_steps(tmp_path):
    store = SlowStore(str(tmp_path / "store"))
    run, trainer = _run(store, upload="sync")
    store.gate.clear()
    threading.Timer(0.3, store.gate.set).start()
    run.end_epoch(0, {"loss": 1.0})
    stamps = _steps(trainer, 3)
    (start, end), = store.uploads
    assert min(stamps) > end and end - start >= 0.25


def test_a_failed_upload_is_retried_and_an_outage_longer_than_the_retries_skips_checkpoints(tmp_path, caplog):
    store = SlowStore(str(tmp_path / "store"))
    run, trainer = _run(store)
    store.fail = 2  # two failures, then it works (3 retries allowed)
    with caplog.at_level(logging.WARNING, logger="spark_hvd.store.background"):
        run.end_epoch(0, {"loss": 1.0})
        run.writer.wait()
    assert _latest(store, tmp_path) == 0
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 2
    store.fail = 8  # an outage of two checkpoints' 4 tries each: both skipped, training goes on
    for epoch, weights in ((1, 7), (2, 9)):
        trainer.weights = weights
        with caplog.at_level(logging.WARNING, logger="spark_hvd.store.background"):
            run.end_epoch(epoch, {"loss": 0.5})
            run.writer.wait()
        assert _latest(store, tmp_path) == 0  # the last committed checkpoint stays the recovery point
    path = RunDir(store, RUN).checkpoint_path(1)
    skipped = [r.getMessage() for r in caplog.records if "skipped, training goes on" in r.getMessage()]
    assert len(skipped) == 2 and path in skipped[0] and "OSError: the store is unreachable" in skipped[0]
    assert run.writer.skipped_failures == 2
    trainer.weights = 11  # the store is back: the next checkpoint is written as usual
    run.end_epoch(3, {"loss": 0.4})
    run.writer.wait()
    assert RunDir(store, RUN).list_checkpoints() == [0, 3] and _latest(store, tmp_path) == 3
    assert _committed_weights(store, 3, tmp_path) == 11
    leftovers = [p for p in os.listdir(tmp_path / "store" / "runs" / RUN / "checkpoints") if "epoch-" not in p]
    assert leftovers == [], "a failed upload left files behind"


def test_the_final_model_write_retries_longer_then_fails_naming_its_path(tmp_path, caplog):
    from spark_hvd.store.background import write_with_retries

    store = SlowStore(str(tmp_path / "store"))
    local = tmp_path / "model"
    local.mkdir()
    (local / "weights.json").write_text('{"weights": 11}')
    run_dir = RunDir(store, RUN)
    store.fail = 5  # beyond the checkpoints' 3 retries, within the final model's
    with caplog.at_level(logging.WARNING, logger="spark_hvd.store.background"):
        write_with_retries(lambda: run_dir.write_model(str(local)), "the final model", retries=6, pause_s=0.01,
                           max_pause_s=0.02)
    assert json.loads(run_dir.read_model_file("weights.json")) == {"weights": 11}
    assert caplog.text.count("retrying in") == 5
    store.fail = 100
    with pytest.raises(UploadFailedError, match=r"final model \(.*/model\) failed 3 times.*unreachable"):
        write_with_retries(lambda: run_dir.write_model(str(local)), f"the final model ({run_dir.model_path})",
                           retries=2, pause_s=0.01)


def test_a_busy_upload_makes_the_next_checkpoint_wait_or_be_skipped(tmp_path):
    store = SlowStore(str(tmp_path / "store"))
    run, trainer = _run(store, when_busy="skip")
    store.gate.clear()
    run.end_epoch(0, {"loss": 1.0})
    trainer.weights = 5
    run.end_epoch(1, {"loss": 0.5})  # skipped: epoch 0 is still uploading
    assert run.writer.skipped == 1
    store.gate.set()
    run.writer.wait()
    assert RunDir(store, RUN).list_checkpoints() == [0]
    metrics = store.read_bytes(f"{RunDir(store, RUN).logs_path}/metrics.jsonl").decode().splitlines()
    assert [json.loads(line)["epoch"] for line in metrics] == [0, 1]  # the metrics of the skipped epoch are kept

    store2 = SlowStore(str(tmp_path / "store2"))
    run, trainer = _run(store2, when_busy="wait")
    store2.gate.clear()
    run.end_epoch(0, {"loss": 1.0})
    threading.Timer(0.3, store2.gate.set).start()
    t0 = time.monotonic()
    trainer.weights = 5
    run.end_epoch(1, {"loss": 0.5})  # waits until epoch 0's upload is done, then snapshots
    assert time.monotonic() - t0 > 0.2 and len(store2.uploads) >= 1
    run.writer.wait()
    assert RunDir(store2, RUN).list_checkpoints() == [0, 1] and _committed_weights(store2, 1, tmp_path) == 5


def test_keep_checkpoints_keeps_the_newest_and_resumes_from_the_last(tmp_path):
    store = SlowStore(str(tmp_path / "store"))
    run, trainer = _run(store, keep=2)
    for epoch in range(5):
        trainer.weights = 10 + epoch
        run.end_epoch(epoch, {"loss": 1.0 / (epoch + 1)})
    run.writer.wait()
    assert RunDir(store, RUN).list_checkpoints() == [3, 4]
    assert _latest(store, tmp_path) == 4 and _committed_weights(store, 4, tmp_path) == 14
    metrics = store.read_bytes(f"{RunDir(store, RUN).logs_path}/metrics.jsonl").decode().splitlines()
    assert len(metrics) == 5  # retention drops checkpoints, never the metrics
