"""The driver of the Spark-standalone test, run inside the driver's simulated host: ``spark_driver.py MASTER STORE
[STEP...]``; with no STEP given, the steps are read from stdin, one a line, until it closes (the test sends each
when it needs it, so one driver, one SparkContext and one set of executors serve the whole module). Each step
prints one JSON line ``{"step": ..., ...}`` (or ``{"step": ..., "error": ...}``) for the test to check: ``run``
(ranks' hosts, topology, transport, allreduce vs numpy), ``torch`` (TorchEstimator fit -> transform -> save/load,
transform equal to the model called directly), ``keras`` (KerasEstimator fit -> transform), ``kill`` (a run while
the test kills a worker host's processes: it must fail or retry, naming what happened), ``iface`` (a run told to
carry its data on the worker hosts' second interface, eth1: the bytes each host sent on eth0 and eth1 during its
allreduce), ``linkdown`` (a run while the test takes a host's link down) and ``fitkill`` (a TorchEstimator fit
while the test kills one rank's process): both must fail naming the lost rank's host.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np


def _session(master: str):
    from pyspark.sql import SparkSession

    me = os.environ["SIM_DRIVER_ADDRESS"]
    return (SparkSession.builder.master(master).appName("spark_hvd-multihost")
            .config("spark.driver.host", me).config("spark.driver.bindAddress", me)
            .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
            .config("spark.driver.memory", "512m").config("spark.executor.cores", "1")
            .config("spark.cores.max", "2").config("spark.sql.shuffle.partitions", "2")
            .config("spark.python.worker.reuse", "true")
            .config("spark.executor.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")  # less CPU to start
            .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())


def _rank_fn(n: int) -> dict:
    import socket

    import spark_hvd.core as hvd

    rank = hvd.rank()
    mine = np.random.default_rng(rank).standard_normal(n)
    total = hvd.allreduce(mine, op=hvd.Sum)
    expected = sum(np.random.default_rng(r).standard_normal(n) for r in range(hvd.size()))
    backend = hvd.get_engine().backend
    return {"rank": rank, "hostname": socket.gethostname(), "local_size": hvd.local_size(),
            "cross_size": hvd.cross_size(), "transport": getattr(backend, "transport", None),
            "peers": sorted({p.where for p in getattr(backend, "peers", {}).values()}),
            "env": sorted(k for k in os.environ if k.startswith("SPARK_HVD_") and k not in _launch_vars()),
            "allreduce": bool(np.allclose(total, expected, rtol=1e-10, atol=1e-10))}


def _launch_vars() -> set[str]:
    """The launch contract's variables (``JobEnv``: rank, size, job, secret, ..., encrypt), which every launch
    sets; anything else named ``SPARK_HVD_*`` on a rank is a setting that reached it."""
    from spark_hvd.core.jobenv import env_names

    return set(env_names())


def _tx_bytes(iface: str) -> int:
    """This host's bytes sent on ``iface`` (the executor runs inside the host's ``ip netns exec``: its ``/sys``)."""
    with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
        return int(f.read())


def _rank_on_interface(n: int) -> dict:
    """An allreduce of ``n`` float64 (checked against numpy) and the bytes this host sent meanwhile, by interface."""
    import spark_hvd.core as hvd

    rank = hvd.rank()
    hvd.barrier()
    before = {i: _tx_bytes(i) for i in ("eth0", "eth1")}
    total = hvd.allreduce(np.random.default_rng(rank).standard_normal(n), op=hvd.Sum)
    hvd.barrier()  # every byte this rank sent has arrived (its last frames may still have been queued)
    sent = {i: _tx_bytes(i) - before[i] for i in ("eth0", "eth1")}
    expected = sum(np.random.default_rng(r).standard_normal(n) for r in range(hvd.size()))
    return {"rank": rank, "sent": sent, "allreduce": bool(np.allclose(total, expected, rtol=1e-10, atol=1e-10)),
            "peers": sorted({p.where for p in getattr(hvd.get_engine().backend, "peers", {}).values()})}


def step_iface(spark, store_dir: str) -> dict:
    """A run told its data interface (``SPARK_HVD_NETWORK_INTERFACE=eth1`` through ``run(env=...)``) on worker
    hosts with two: the ranks' 8 MiB allreduce must leave by eth1, the one the driver is not reached through."""
    from spark_hvd.runner import run

    results = run(_rank_on_interface, args=(1 << 20,), num_proc=2, spark=spark, verbose=0,
                  env={"SPARK_HVD_NETWORK_INTERFACE": "eth1"})
    return {"ranks": results}


def _reg_df(spark):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 3))
    y = x @ np.array([1.5, -2.0, 0.5]) + 0.3
    rows = [(float(a), float(b), float(c), float(t)) for (a, b, c), t in zip(x, y, strict=True)]
    from pyspark.ml.feature import VectorAssembler

    df = spark.createDataFrame(rows, ["a", "b", "c", "y"])
    return VectorAssembler(inputCols=["a", "b", "c"], outputCol="features").transform(df)


def step_run(spark, store_dir: str) -> dict:
    from spark_hvd.runner import run

    start = time.monotonic()
    results = run(_rank_fn, args=(1 << 18,), num_proc=2, spark=spark, verbose=0)
    return {"ranks": results, "seconds": time.monotonic() - start}


def step_torch(spark, store_dir: str) -> dict:
    import torch

    from spark_hvd.estimators import TorchEstimator, TorchModel
    from spark_hvd.store import Store

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 1))
    df = _reg_df(spark)
    est = TorchEstimator(num_proc=2, store=Store.create(store_dir), model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.1), loss="mse", feature_cols=["features"],
                         label_cols=["y"], batch_size=32, epochs=3, validation=0.2, random_seed=1, verbose=0)
    start = time.monotonic()
    model = est.fit(df)
    fit_s = time.monotonic() - start
    out = model.transform(df).select("a", "b", "c", "y__output").collect()
    x = torch.tensor([[r.a, r.b, r.c] for r in out], dtype=torch.float32)
    with torch.no_grad():
        direct = model.getModel()(x).numpy().reshape(-1)
    path = os.path.join(store_dir, "saved-torch-model")
    model.save(path)
    again = TorchModel.load(path)
    reloaded = again.transform(df).select("a", "b", "c", "y__output").collect()
    hist = model.getHistory()
    return {"loss": hist["loss"], "fit_seconds": fit_s,
            "transform_matches_model": bool(np.allclose([r.y__output for r in out], direct, rtol=1e-5, atol=1e-6)),
            "reloaded_equal": reloaded == out}


def step_keras(spark, store_dir: str) -> dict:
    import keras

    from spark_hvd.estimators import KerasEstimator
    from spark_hvd.store import Store

    keras.utils.set_random_seed(0)
    inp = keras.Input(shape=(3,))
    model = keras.Model(inp, keras.layers.Dense(1)(inp))
    df = _reg_df(spark)
    est = KerasEstimator(num_proc=2, store=Store.create(store_dir), model=model,
                         optimizer=keras.optimizers.SGD(learning_rate=0.05), loss="mse", feature_cols=["features"],
                         label_cols=["y"], batch_size=32, epochs=3, validation=0.2, random_seed=1, verbose=0)
    start = time.monotonic()
    fitted = est.fit(df)
    fit_s = time.monotonic() - start
    rows = fitted.transform(df).select("a", "b", "c", "y__output").collect()
    x = np.array([[r.a, r.b, r.c] for r in rows], dtype=np.float32)
    direct = np.asarray(fitted.getModel()(x)).reshape(-1)
    return {"loss": fitted.getHistory()["loss"], "fit_seconds": fit_s,
            "transform_matches_model": bool(np.allclose([r.y__output for r in rows], direct, rtol=1e-5,
                                                        atol=1e-5))}


def _slow_rank(seconds: float, marks: str) -> int:
    import spark_hvd.core as hvd

    hvd.allreduce(np.ones(8))
    with open(os.path.join(marks, f"rank-{hvd.rank()}-running"), "w"):
        pass  # the test kills a host only once every rank is in its loop
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        hvd.allreduce(np.ones(1 << 16))
    return hvd.rank()


def step_kill(spark, store_dir: str) -> dict:
    """A run whose worker host the test kills: it must end (failing, naming what happened) in bounded time."""
    from spark_hvd.runner import run

    marks = os.path.join(store_dir, "kill-marks")
    os.makedirs(marks, exist_ok=True)
    print(json.dumps({"step": "kill", "marks": marks}), flush=True)
    start = time.monotonic()
    try:
        run(_slow_rank, args=(120.0, marks), num_proc=2, spark=spark, verbose=0, start_timeout=120)
        return {"outcome": "finished", "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - the test reads the error
        return {"outcome": "failed", "type": type(exc).__name__, "error": str(exc)[:3000],
                "seconds": time.monotonic() - start}


def _rank_until_failure(seconds: float, marks: str) -> int:
    """Loop allreduces; on failure leave ``failed-<host>`` (the error) for the test, then re-raise."""
    import socket

    import spark_hvd.core as hvd

    hvd.allreduce(np.ones(8))
    with open(os.path.join(marks, f"rank-{hvd.rank()}-running"), "w"):
        pass
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            hvd.allreduce(np.ones(1 << 16))
    except Exception as exc:
        with open(os.path.join(marks, f"failed-{socket.gethostname()}"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        raise
    return hvd.rank()


def step_linkdown(spark, store_dir: str) -> dict:
    """A run whose host link the test takes down: the rank left behind fails within SPARK_HVD_TIMEOUT naming the
    other rank's host; the test brings the link back once it has (``failed-<host>``)."""
    from spark_hvd.runner import run

    marks = os.path.join(store_dir, "linkdown-marks")
    os.makedirs(marks, exist_ok=True)
    print(json.dumps({"step": "linkdown", "marks": marks}), flush=True)
    start = time.monotonic()
    try:
        run(_rank_until_failure, args=(300.0, marks), num_proc=2, spark=spark, verbose=0, start_timeout=120,
            env={"SPARK_HVD_TIMEOUT": "8"})
        return {"outcome": "finished", "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - the test reads the error
        return {"outcome": "failed", "type": type(exc).__name__, "error": str(exc)[:6000],
                "seconds": time.monotonic() - start}


class _MarkingLoss:
    """MSE that leaves ``fitting-<host>`` (holding this process's pid) on its first call: the test kills that
    process once every rank is in its training loop."""

    def __init__(self, marks: str) -> None:
        self.marks = marks
        self.marked = False

    def __call__(self, pred, target):
        import socket

        import torch

        if not self.marked and "SPARK_HVD_RANK" in os.environ:  # a rank (the driver's checks call it too)
            self.marked = True
            path = os.path.join(self.marks, f"fitting-{socket.gethostname()}")
            with open(path + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(path + ".tmp", path)
        return torch.nn.functional.mse_loss(pred, target)


def step_fitkill(spark, store_dir: str) -> dict:
    """A TorchEstimator fit one of whose rank processes the test kills: it must fail naming the lost rank's host."""
    import torch

    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    marks = os.path.join(store_dir, "fitkill-marks")
    os.makedirs(marks, exist_ok=True)
    print(json.dumps({"step": "fitkill", "marks": marks}), flush=True)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 1))
    est = TorchEstimator(num_proc=2, store=Store.create(store_dir), model=net,
                         optimizer=torch.optim.SGD(net.parameters(), lr=0.01), loss=_MarkingLoss(marks),
                         feature_cols=["features"], label_cols=["y"], batch_size=8, epochs=500, random_seed=1,
                         verbose=0)
    start = time.monotonic()
    try:
        est.fit(_reg_df(spark))
        return {"outcome": "finished", "seconds": time.monotonic() - start}
    except Exception as exc:  # noqa: BLE001 - the test reads the error
        return {"outcome": "failed", "type": type(exc).__name__, "error": str(exc)[:6000],
                "seconds": time.monotonic() - start}


def main() -> None:
    master, store_dir, *steps = sys.argv[1:]
    spark = _session(master)
    try:
        for step in steps or (line.strip() for line in sys.stdin if line.strip()):
            try:
                row = {"step": step, **globals()[f"step_{step}"](spark, store_dir)}
            except Exception as exc:  # noqa: BLE001 - reported to the test, which fails naming it
                row = {"step": step, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(json.dumps(row), flush=True)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
