"""Helpers shared by the estimator tests: epoch logs and a rank killed mid-epoch, TensorBoard files read back, the
small linear-regression DataFrames of the elastic fit tests.

The training ranks cannot import the test modules, so this module travels by value (cloudpickle) with the
callbacks built on it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import cloudpickle
import numpy as np

from spark_hvd.store import RunDir

cloudpickle.register_pickle_by_value(sys.modules[__name__])

KILLED_MARKER = "killed"


class EpochRecorder:
    """What a framework callback does on every rank: append each epoch it begins to ``rank<r>.log`` in
    ``directory``; with ``kill_at_epoch``, rank 1 dies (``os._exit``) after batch ``kill_at_step`` of that epoch,
    once (a ``killed`` marker file stops the retry from dying again)."""

    def __init__(self, directory: str, kill_at_epoch: int | None = None, kill_at_step: int = 1) -> None:
        self.directory = directory
        self.kill_at_epoch = kill_at_epoch
        self.kill_at_step = kill_at_step

    def epoch_begin(self, rank: int, epoch: int) -> None:
        with open(os.path.join(self.directory, f"rank{rank}.log"), "a") as f:
            f.write(f"{epoch}\n")

    def batch_end(self, rank: int, epoch: int, step: int) -> None:
        marker = os.path.join(self.directory, KILLED_MARKER)
        if epoch == self.kill_at_epoch and step == self.kill_at_step and rank == 1 and not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(17)  # the process dies in the middle of the epoch


def die_once(directory: str, now: bool) -> None:
    """When ``now``, the calling rank dies (``os._exit(17)``) unless ``<directory>/killed`` exists; it writes that
    marker first, so that the relaunched rank does not die again."""
    marker = os.path.join(directory, KILLED_MARKER)
    if now and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(17)


def linear_df(spark: Any) -> Any:
    """256 rows of ``features array<float>`` (3 standard normals) and ``y double`` = features . (1.5, -2, 0.5) + 0.3."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 3)).astype(np.float32)
    y = x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.3
    return spark.createDataFrame([(x[i].tolist(), float(y[i])) for i in range(256)], "features array<float>, y double")


def tiny_df(spark: Any) -> Any:
    """8 rows of ``features array<double>`` and ``label double``, for fits that must fail before they run."""
    rows = [([float(i), 1.0], float(i)) for i in range(8)]
    return spark.createDataFrame(rows, "features array<double>, label double")


def epochs_begun(directory: Any, rank: int = 0) -> list[int]:
    """The epochs rank ``rank`` began, in order, as ``EpochRecorder`` logged them."""
    with open(os.path.join(directory, f"rank{rank}.log")) as f:
        return [int(line) for line in f]


def tf_events(path: Any) -> list:
    """The events of a local event file as TensorFlow's own reader (``summary_iterator``) decodes them."""
    import pytest

    tf = pytest.importorskip("tensorflow")
    return list(tf.compat.v1.train.summary_iterator(str(path)))


def tf_scalars(path: Any) -> tuple[dict[str, list[float]], dict[str, list[int]], str]:
    """(tag -> values, tag -> steps, file_version) of an event file, by TensorFlow's reader."""
    values: dict[str, list[float]] = {}
    steps: dict[str, list[int]] = {}
    version = ""
    for event in tf_events(path):
        if event.file_version:
            version = event.file_version
        for value in event.summary.value:
            values.setdefault(value.tag, []).append(value.simple_value)
            steps.setdefault(value.tag, []).append(event.step)
    return values, steps, version


def assert_events_match_history(store: Any, run_id: str, history: dict[str, list[float]], tmp_dir: Any) -> None:
    """The run's logs hold one TensorBoard event file whose scalars (read by TensorFlow) are ``history``:
    ``train/<m>`` / ``val/<m>`` per key, step = epoch, every epoch once."""
    logs = RunDir(store, run_id).logs_path
    names = [n for n in store.listdir(logs) if ".tfevents." in n]
    assert len(names) == 1, f"expected one event file in {logs}: {store.listdir(logs)}"
    local = os.path.join(str(tmp_dir), names[0])
    with open(local, "wb") as f:
        f.write(store.read_bytes(f"{logs}/{names[0]}"))
    values, steps, version = tf_scalars(local)
    assert version == "brain.Event:2"
    expect = {(f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}"): v for k, v in history.items()}
    assert set(values) == set(expect), (sorted(values), sorted(expect))
    for tag, vals in expect.items():
        assert values[tag] == [np.float32(v) for v in vals], tag
        assert steps[tag] == list(range(len(vals))), tag


def assert_fit_fails_before_anything_runs(spark: Any, estimator: Any, df: Any, root: Any, what: str,
                                          exc: type[BaseException], match: str) -> None:
    """``estimator.fit(df)`` raises ``exc`` matching ``match`` with no Spark job run (a job group tells) and
    nothing written under the store directory ``root``."""
    import pytest

    sc = spark.sparkContext
    group = f"bad-input-{type(estimator).__name__}-{abs(hash(what))}"
    sc.setJobGroup(group, what)
    try:
        with pytest.raises(exc, match=match):
            estimator.fit(df)
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    assert list(sc.statusTracker().getJobIdsForGroup(group)) == [], "a Spark job ran before the error"
    assert not root.exists() or not any(root.rglob("*")), "the store was written to"
