"""SIGINT (Ctrl-C) during a real fit in a fresh driver process: the one-line resume hint on stderr, under a short
traceback and without Spark's warnings for the killed tasks, and no process of the job (ranks, Python workers, the
JVM) left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import torch
    from pyspark.sql import SparkSession
    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    marker, root = sys.argv[1], sys.argv[2]

    class SleepAfterFirstEpoch:
        def on_epoch_begin(self, epoch):
            if epoch == 1:  # epoch 0's checkpoint is committed (checkpoint_upload='sync')
                open(marker, "w").close()
                time.sleep(600)

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "2").getOrCreate())
    df = spark.createDataFrame([([float(i), 1.0], float(i)) for i in range(16)], "x array<float>, y double")
    net = torch.nn.Linear(2, 1)
    TorchEstimator(num_proc=2, store=Store.create(root), model=net, optimizer=torch.optim.SGD(net.parameters(), 0.01),
                   loss="mse", feature_cols=["x"], label_cols=["y"], batch_size=4, epochs=3, verbose=0,
                   run_id="run-sigint", checkpoint_upload="sync", partitions_per_process=1,
                   callbacks=[SleepAfterFirstEpoch()]).fit(df)
""")


def _alive(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "-g", str(pgid)], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.strip()]


def test_sigint_during_fit_prints_the_resume_hint_and_leaves_nothing(tmp_path):
    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    marker = tmp_path / "epoch1"
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, str(script), str(marker), str(tmp_path / "store")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert marker.exists(), proc.communicate(timeout=60)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # one line to act on, under a traceback of the script's frame and fit's; no Spark warning about the killed
    # tasks, no runner frame
    tail = err[err.index("Traceback (most recent call last):"):].splitlines()
    assert tail[-1] == ("KeyboardInterrupt: TorchEstimator: interrupted; run 'run-sigint' has a checkpoint after "
                        "epoch 1; resume it with setRunId('run-sigint') (or run_id='run-sigint') and fit again"), tail
    assert len(tail) <= 8 and "stage.py" not in err, tail
    for noise in ("TaskSetManager", "Lost task", "Attempting to kill Python Worker", "Failed to cancel job group"):
        assert noise not in err, err[-3000:]
    assert err.count("KeyboardInterrupt") == 1, err[-3000:]
    deadline = time.monotonic() + 60
    while _alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _alive(proc.pid), _alive(proc.pid)
