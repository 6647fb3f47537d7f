"""The executor is the one door (``spark_hvd.core.engine.executor``): every collective of every kind of round, the
speculative, fresh and blocking shortcuts and the negotiation's own exchanges included, reaches the backend through
its host group; autotune talks to a backend capability (``Backend.tunables`` / ``apply_tuning``); ``init()`` reads
the launch contract once."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

import spark_hvd.core as core
from spark_hvd.core.backend import ReduceOp
from spark_hvd.core.backends.local_backend import LocalBackend
from spark_hvd.core.engine import group
from spark_hvd.core.engine.autotune import Point
from spark_hvd.core.engine.engine import Engine
from spark_hvd.core.jobenv import JobEnv
from spark_hvd.core.settings import Settings

GROUP_FILE = str(Path(group.__file__).resolve())


class _CallersBackend(LocalBackend):
    """A single-process backend that records which file called each collective, and takes a tuning."""

    def __init__(self, tunable: bool = False) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []
        self.tuned: list[dict[str, int]] = []
        self._tunable = tunable

    def _called(self, what: str) -> None:
        self.calls.append((what, str(Path(sys._getframe(2).f_code.co_filename).resolve())))

    def allreduce(self, buf, op, *, bfloat16=False):
        self._called("allreduce")

    def allreduce_fused(self, bufs, op, *, bfloat16=False):
        self._called("allreduce_fused")

    def allgather(self, buf):
        self._called("allgather")
        return super().allgather(buf)

    def barrier(self):
        self._called("barrier")

    def tunables(self) -> dict[str, int]:
        return {"halving_doubling_bytes": 1 << 20} if self._tunable else {}

    def apply_tuning(self, values: Mapping[str, int]) -> None:
        self.tuned.append(dict(values))


def test_every_round_reaches_the_backend_through_the_executors_host_group():
    backend = _CallersBackend()
    engine = Engine(backend, Settings(cycle_time_ms=1))
    try:
        x = np.ones(16, np.float32)
        for _ in range(6):  # the same tensor: a full round, then speculative rounds run by the blocking call
            engine.allreduce(x, "steady", op=ReduceOp.SUM)
            engine.barrier()
        for k in range(6):  # a new name every call: then rounds of new names (fresh)
            engine.allreduce(x, f"new.{k}", op=ReduceOp.SUM)
        handles = [engine.enqueue("allreduce", np.ones(4, np.float32), f"async.{k}", op=ReduceOp.SUM)
                   for k in range(3)]
        for handle in handles:
            handle.wait()
        np.testing.assert_array_equal(x, np.ones(16, np.float32))
        stats = engine.stats
    finally:
        engine.shutdown()
    assert stats["speculative_rounds"] and stats["fresh_rounds"] and stats["fast_rounds"], dict(stats)
    assert backend.calls and {caller for _, caller in backend.calls} == {GROUP_FILE}, backend.calls


def test_autotune_switches_the_backends_own_thresholds_through_its_capability():
    for tunable in (False, True):
        backend = _CallersBackend(tunable)
        engine = Engine(backend, Settings())
        try:
            engine._switch(Point(4 << 20, 2.0, 256 << 10))
        finally:
            engine.shutdown()
        assert backend.tuned == ([{"halving_doubling_bytes": 256 << 10}] if tunable else [])
        assert engine.autotune_history[-1][1:] == (4 << 20, 2.0, 256 << 10)


def test_a_backend_without_tunables_refuses_a_tuning():
    backend = LocalBackend()
    assert backend.tunables() == {}
    backend.apply_tuning({})
    with pytest.raises(ValueError, match="the local backend has no tunable setting"):
        backend.apply_tuning({"halving_doubling_bytes": 1})


def test_init_reads_the_launch_contract_once_and_passes_it_down(monkeypatch):
    reads = []
    real = JobEnv.from_env.__func__

    def counted(cls, *args, **kwargs):
        reads.append(1)
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(JobEnv, "from_env", classmethod(counted))
    core.init(backend="local")
    try:
        engine = core.get_engine()
        assert engine.scope.job == core.job_env()
        assert (core.job_env().rank, core.job_env().size) == (0, 1)
    finally:
        core.shutdown()
    assert len(reads) == 1
