"""spark_hvd.runner.run on the shared local[2] SparkSession: results, allreduce, failures, retries, output, events.

The tests taking ``any_spark`` run on the classic session and on a Spark Connect one (``tests/conftest.py``)."""

from __future__ import annotations

import io
import os
import signal
import sys
import time

import cloudpickle
import numpy as np
import pytest

from spark_hvd.runner import NotEnoughSlotsError, RankFailedError, last_events, report, run

pytestmark = pytest.mark.spark

# the executors' Python workers cannot import this test module: ship its functions by value
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _rank() -> int:
    import spark_hvd.core as hvd

    return hvd.rank()


def _allreduce_fn(seed: int) -> dict:
    import spark_hvd.core as hvd
    from spark_hvd.core.backend import ReduceOp

    hvd.init()  # a user's own init is harmless: the runner already joined the job
    rng = np.random.default_rng(seed + hvd.rank())
    data = rng.standard_normal(1000).astype(np.float64)
    summed = data.copy()
    hvd.allreduce(summed, op=ReduceOp.SUM)
    return {"rank": hvd.rank(), "size": hvd.size(), "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(), "data": data, "sum": summed, "pid": os.getpid()}


@pytest.mark.compat
def test_results_by_rank_and_allreduce_sum(any_spark):
    results = run(_allreduce_fn, args=(1234,), num_proc=2)  # finds the session: the thread's active one
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["local_size"] == 2 for r in results)
    assert sorted(r["local_rank"] for r in results) == [0, 1]
    assert results[0]["pid"] != results[1]["pid"]
    expected = results[0]["data"] + results[1]["data"]
    for r in results:
        np.testing.assert_allclose(r["sum"], expected, rtol=1e-12)


def _fails_on_rank_1() -> str:
    import spark_hvd.core as hvd

    rank = _rank()
    if rank == 1:
        raise ValueError(f"boom from rank {rank}")
    hvd.allreduce(np.ones(10))  # rank 0 waits in a collective that rank 1 never joins: it must be stopped
    return "ok"


def test_exception_in_rank_1_reaches_driver(any_spark):
    with pytest.raises(RankFailedError) as info:
        run(_fails_on_rank_1, num_proc=2, spark=any_spark)
    err = info.value
    assert err.rank == 1
    assert err.remote_type == "ValueError"
    assert "boom from rank 1" in err.remote_message
    # the function travels by value (spark_hvd.pickling): its frame names this file and shows the source line
    assert f'File "{__file__}", line' in err.remote_traceback and "in _fails_on_rank_1" in err.remote_traceback
    assert 'raise ValueError(f"boom from rank {rank}")' in err.remote_traceback
    assert "<dynamic-code>" not in err.remote_traceback
    assert "rank 1 failed: ValueError: boom from rank 1" in str(err)


def test_too_many_processes_fail_at_once_with_both_numbers(any_spark, monkeypatch):
    # local[2] never grows: without a start_timeout there is no wait (one given is waited: the test below)
    monkeypatch.delenv("SPARK_HVD_START_TIMEOUT", raising=False)
    monkeypatch.delenv("HOROVOD_SPARK_START_TIMEOUT", raising=False)
    with pytest.raises(NotEnoughSlotsError) as info:
        run(_rank, num_proc=3, spark=any_spark)
    message = str(info.value)
    # the total is what makes 3 impossible; the free count is a snapshot (a previous test's cancelled task may
    # still be winding down on a loaded machine)
    assert "num_proc=3" in message and "(2 in all)" in message
    assert info.value.num_proc == 3 and info.value.total_slots == 2 and info.value.free_slots <= 2
    assert f"only {info.value.free_slots} free task slots" in message


def test_with_a_start_timeout_too_few_slots_time_out_as_horovod_s_do_before_any_job(spark, monkeypatch):
    """Horovod's test_timeout_with_gloo: num_proc=4 on 2 cores with start_timeout given waits that long for
    slots, then "Timed out waiting for Spark tasks to start", here with both numbers and no stage launched."""
    import spark_hvd.runner.spark as runner_spark
    from spark_hvd.runner import SlotsTimeoutError

    def no_stage(*args, **kwargs):
        raise AssertionError("a stage was launched although the slots were too few")

    monkeypatch.setattr(runner_spark, "run_attempt", no_stage)
    with pytest.raises(SlotsTimeoutError, match="^Timed out waiting for Spark tasks to start.") as info:
        run(None, num_proc=4, start_timeout=1, use_gloo=True, verbose=0)  # Horovod's test passes fn=None
    assert isinstance(info.value, TimeoutError) and isinstance(info.value, NotEnoughSlotsError)
    assert info.value.num_proc == 4 and info.value.total_slots == 2
    assert "start_timeout=1 s" in str(info.value) and "(2 in all)" in str(info.value)


def _killed_mid_fn(pid_dir: str) -> int:
    rank = _rank()
    with open(os.path.join(pid_dir, f"pid-{rank}.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(pid_dir, f"pid-{rank}.tmp"), os.path.join(pid_dir, f"pid-{rank}"))
    deadline = time.monotonic() + 300
    if rank == 1:
        while not os.path.exists(os.path.join(pid_dir, "pid-0")) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    while time.monotonic() < deadline:  # rank 0: busy in user code, not in a collective
        time.sleep(0.1)
    return rank


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(240)
def test_sigkilled_rank_fails_the_run_and_leaves_no_worker(spark, tmp_path):
    with pytest.raises(RankFailedError) as info:
        run(_killed_mid_fn, args=(str(tmp_path),), num_proc=2)
    assert info.value.rank == 1
    assert info.value.remote_type == "ProcessLost"
    survivor = int((tmp_path / "pid-0").read_text())
    deadline = time.monotonic() + 120
    while _alive(survivor) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(survivor), f"rank 0's Python worker (pid {survivor}) is still running"


def _fails_first_attempt(marker_dir: str) -> tuple[int, str]:
    rank = _rank()
    marker = os.path.join(marker_dir, "failed-once")
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError("transient failure on the first attempt")
    return rank, os.environ["SPARK_HVD_RUN_ATTEMPT"]


def test_max_retries_reruns_after_a_failure(spark, tmp_path):
    assert run(_fails_first_attempt, args=(str(tmp_path),), num_proc=2, max_retries=1) == [(0, "1"), (1, "1")]


def test_without_retries_the_first_failure_is_final(spark, tmp_path):
    with pytest.raises(RankFailedError, match="transient failure"):
        run(_fails_first_attempt, args=(str(tmp_path),), num_proc=2, max_retries=0)


def _env_and_output(key: str) -> str:
    rank = _rank()
    print(f"stdout line of rank {rank}")
    print(f"stderr line of rank {rank}", file=sys.stderr)
    os.write(1, f"fd-level line of rank {rank}\n".encode())
    return os.environ.get(key, "<unset>")


def test_env_passed_and_output_prefixed(spark, capsys):
    assert run(_env_and_output, args=("MY_RUNNER_VAR",), num_proc=2, env={"MY_RUNNER_VAR": "42"}) == ["42", "42"]
    out, err = capsys.readouterr()
    for rank in (0, 1):
        assert f"[{rank}] stdout line of rank {rank}" in out
        assert f"[{rank}] fd-level line of rank {rank}" in out
        assert f"[{rank}] stderr line of rank {rank}" in err
    # the environment is restored afterwards: the Python workers are reused. Horovod's stdout / stderr streams get
    # the lines in Horovod's format whatever verbose says; the driver's own streams get none with verbose=0
    streams = io.StringIO(), io.StringIO()
    assert run(_env_and_output, args=("MY_RUNNER_VAR",), num_proc=2, verbose=0, stdout=streams[0],
               stderr=streams[1], use_gloo=True) == ["<unset>", "<unset>"]
    out, err = capsys.readouterr()
    assert "[0] stdout line" not in out and "stderr line" not in err
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:stdout line of rank {rank}\n" in streams[0].getvalue()
        assert f"[{rank}]<stdout>:fd-level line of rank {rank}\n" in streams[0].getvalue()
        assert f"[{rank}]<stderr>:stderr line of rank {rank}\n" in streams[1].getvalue()
    assert "stderr line" not in streams[0].getvalue()


def _reports(epochs: int) -> None:
    rank = _rank()
    for epoch in range(epochs):
        report(epoch=epoch, step=None, loss=np.float32(1.0 / (epoch + 1)), rank_metric=rank)


def test_report_events_reach_the_driver(any_spark, capsys):
    seen = []
    run(_reports, args=(3,), num_proc=2, on_event=seen.append, spark=any_spark)
    assert len(seen) == 6
    assert last_events() == seen
    for rank in (0, 1):
        mine = [e for e in seen if e.rank == rank]
        assert [e.epoch for e in mine] == [0, 1, 2]
        assert [e.metrics["rank_metric"] for e in mine] == [rank] * 3
        assert isinstance(mine[1].metrics["loss"], float) and mine[1].metrics["loss"] == pytest.approx(0.5)
    out, _ = capsys.readouterr()
    assert "[spark_hvd] rank 0 epoch 3: loss=0.3333" in out  # on screen epochs count from 1


@pytest.mark.timeout(240)
def test_ranks_that_cannot_start_time_out_with_their_names(spark, monkeypatch):
    import threading

    import spark_hvd.runner.slots as runner_slots
    from spark_hvd.runner import StartTimeoutError

    sc = spark.sparkContext
    holder = threading.Thread(target=lambda: _run_in_group(sc, "runner-test-hold-slot"), daemon=True)
    holder.start()
    try:
        deadline = time.monotonic() + 120
        while runner_slots.slots(sc)[0] > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert runner_slots.slots(sc)[0] == 1
        # pretend the slot check passed (a slot taken between the check and the launch)
        monkeypatch.setattr(runner_slots, "check_slots", lambda *a, **k: 2)
        with pytest.raises(StartTimeoutError) as info:
            run(_rank, num_proc=2, start_timeout=5)
        assert info.value.missing == [0, 1]
        assert "did not start within start_timeout=5 s" in str(info.value)
    finally:
        sc.cancelJobGroup("runner-test-hold-slot")
        holder.join(120)
        runner_slots.wait_tasks_gone(sc, "runner-test-hold-slot", 60)


def _run_in_group(sc, group: str) -> None:
    def hold_slot(_partition):  # nested: Spark's own cloudpickle ships it by value
        import time

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(0.1)
        yield 0

    sc.setJobGroup(group, "holds one task slot", interruptOnCancel=True)
    try:
        sc.parallelize([0], 1).mapPartitions(hold_slot).collect()
    except Exception:  # cancelled by the test
        pass


def test_connect_stage_that_cannot_get_its_slots_fails_fast(spark_connect, monkeypatch):
    """Over Connect the driver cannot see the slots of a cluster (only a local[N] master tells its total): the
    stage itself is the check, and a stage none of whose ranks starts is cancelled with a clear error."""
    import spark_hvd.runner.cluster as cluster
    import spark_hvd.runner.stage as runner_stage
    from spark_hvd.runner import StartTimeoutError
    from spark_hvd.runner.errors import StageNotStartedError

    monkeypatch.setattr(cluster, "total_slots", lambda _spark: None)  # as for a remote cluster
    monkeypatch.setattr(runner_stage, "CONNECT_START_WAIT_S", 3.0)
    began = time.monotonic()
    with pytest.raises(StageNotStartedError) as info:
        run(_rank, num_proc=3, spark=spark_connect)
    assert isinstance(info.value, StartTimeoutError)
    assert "no rank of the num_proc=3 barrier stage started within 3 s" in str(info.value)
    assert time.monotonic() - began < 60
    assert run(_rank, num_proc=2, spark=spark_connect) == [0, 1]  # the cancelled stage left the slots free


def test_start_timeout_falls_back_to_horovods_variable(monkeypatch):
    from spark_hvd.runner.errors import RunnerError
    from spark_hvd.runner.spark import start_timeout_s

    monkeypatch.delenv("SPARK_HVD_START_TIMEOUT", raising=False)
    monkeypatch.delenv("HOROVOD_SPARK_START_TIMEOUT", raising=False)
    assert start_timeout_s(None) == 600.0
    monkeypatch.setenv("HOROVOD_SPARK_START_TIMEOUT", "42")
    assert start_timeout_s(None) == 42.0
    assert start_timeout_s(7) == 7.0  # the argument wins
    monkeypatch.setenv("SPARK_HVD_START_TIMEOUT", "9")
    assert start_timeout_s(None) == 9.0  # spark_hvd's own name before Horovod's
    monkeypatch.setenv("SPARK_HVD_START_TIMEOUT", "soon")
    with pytest.raises(RunnerError, match="SPARK_HVD_START_TIMEOUT='soon' is not a number"):
        start_timeout_s(None)
