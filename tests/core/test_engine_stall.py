"""Stall shutdown: a tensor that some ranks never submit stops the job on every rank, naming it and those ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
from helpers.ranks import run_ranks

import spark_hvd.core as core
from spark_hvd.core.settings import Settings

STALL = {"SPARK_HVD_TIMEOUT": "60", "SPARK_HVD_CYCLE_TIME": "5", "SPARK_HVD_STALL_CHECK_TIME": "0.5",
         "SPARK_HVD_STALL_SHUTDOWN_TIME": "2"}


def _stalled_job() -> dict:
    core.init()
    try:
        start = time.monotonic()
        if core.rank() < core.size() - 1:  # the last rank never submits 'lonely'
            try:
                core.allreduce(np.ones(2), name="lonely", op=core.Sum)
            except core.StallError as exc:
                return {"elapsed": time.monotonic() - start, "name": exc.name, "ranks": exc.ranks, "text": str(exc)}
            raise AssertionError("the stalled allreduce returned")
        engine = core.get_engine()
        while engine.error is None and time.monotonic() - start < 50:
            time.sleep(0.05)  # busy elsewhere (the stall's cause); the engine thread takes part meanwhile
        try:
            core.allreduce(np.ones(2), name="later")
        except core.StallError as exc:
            return {"elapsed": time.monotonic() - start, "name": exc.name, "ranks": exc.ranks, "text": str(exc)}
        raise AssertionError("a call after the stall shutdown did not raise")
    finally:
        core.shutdown()


def test_stalled_tensor_stops_every_rank_naming_tensor_and_missing_ranks():
    results = run_ranks(_stalled_job, 3, env=STALL, timeout=120)
    for r, res in enumerate(results):
        assert res["name"] == "lonely" and res["ranks"] == [2], (r, res)
        assert "'lonely'" in res["text"] and "ranks [0, 1]" in res["text"] and "ranks [2]" in res["text"], res
        assert "SPARK_HVD_STALL_SHUTDOWN_TIME=2" in res["text"], res
        # after the shutdown time, and long before the 60 s collective timeout could have fired
        assert 1.5 < res["elapsed"] < 40, (r, res)


def test_issue_reproduction_exits_with_the_stall_error(tmp_path):
    """The issue's command (rank 1 sleeps for an hour) ends with the stall error, not the launcher's timeout."""
    code = ("import time, numpy as np, spark_hvd.core as hvd; hvd.init(); "
            "hvd.allreduce(np.ones(4), name='x') if hvd.rank() == 0 else time.sleep(3600)")
    env = dict(os.environ, SPARK_HVD_STALL_CHECK_TIME="0.4")  # shutdown time unset: three check periods, 1.2 s
    env.pop("SPARK_HVD_STALL_SHUTDOWN_TIME", None)
    env.pop("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", None)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "spark_hvd.runner", "-np", "2", "--timeout", "60", sys.executable,
                           "-c", code], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode not in (0, 124), proc
    out = proc.stdout + proc.stderr
    assert "StallError" in out and "'x'" in out and "ranks [1]" in out, out[-3000:]
    assert elapsed < 50, elapsed


def test_stall_shutdown_setting_alias_and_default():
    assert Settings().stall_shutdown_time_s == 180.0
    assert Settings.from_env({}).stall_shutdown_time_s == 180.0
    assert Settings.from_env({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "7"}).stall_shutdown_time_s == 7.0
    assert Settings.from_env({"SPARK_HVD_STALL_SHUTDOWN_TIME": "0"}).stall_shutdown_time_s == 0.0  # never
    # unset: three stall-check periods
    assert Settings.from_env({"SPARK_HVD_STALL_CHECK_TIME": "3"}).stall_shutdown_time_s == 9.0
    both = {"SPARK_HVD_STALL_CHECK_TIME": "3", "SPARK_HVD_STALL_SHUTDOWN_TIME": "4"}
    assert Settings.from_env(both).stall_shutdown_time_s == 4.0
