"""The driver of the lost-host tests, run inside the driver's simulated host:
``lost_host_driver.py MASTER STORE MARKS CONFIG_JSON``.

One ``TorchEstimator`` fit on the standalone cluster, elastic (``{"elastic": true}``: ``num_proc`` ranks first,
``min_num_proc``..``max_num_proc``) or not (``max_retries``), with step checkpoints every ``every`` steps
(uploaded synchronously: a checkpoint is committed before the next batch). A callback on every rank:

* rank 0 appends ``attempt epoch step size unix_time`` to ``MARKS/batches.log`` after every batch, and every rank
  leaves ``MARKS/rank-<attempt>-<rank>`` holding its host name and pid (the test picks its victim from them);
* until the test writes ``MARKS/lost``, every batch sleeps ``throttle`` seconds (so the loss lands mid-epoch);
* ``pace``: every batch also sleeps that long (the soak's fit lasts until the test writes ``MARKS/stop``, then
  ends after the epoch; with ``hold`` the driver keeps its application until ``MARKS/done``);
* with ``regrow``, an attempt below ``max_num_proc`` waits, after ``gate_after`` batches, until the driver says
  the job can grow (rank 0 asks the driver service, as the step checkpoint will; the others wait for its
  ``grow-ready-<attempt>`` file): the fit cannot end before the returning host has rejoined.

After the fit it prints one JSON line: the history, the fitted weights and the weights of a one-process replay of
exactly the committed batches at each size (``committed_batches``: each attempt's batches up to the checkpoint the
next attempt resumed from, found by mapping each candidate checkpoint as the estimator maps a resume), or
``{"error": ...}``.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import sys
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/: helpers

#: how long the gate waits for the driver to say the job can grow
GATE_S = 600.0


class HostLossLog:
    """The callback of the module docstring (pickled by value to the ranks: no import of this script there)."""

    def __init__(self, marks: str, throttle: float, regrow: bool, gate_after: int, max_num_proc: int,
                 pace: float = 0.0) -> None:
        self.marks, self.throttle, self.regrow = marks, throttle, regrow
        self.gate_after, self.max_num_proc, self.pace = gate_after, max_num_proc, pace
        self.done = 0
        self.context = None

    def on_train_begin(self, context) -> None:
        self.context = context

    def on_epoch_end(self, epoch: int, logs: dict) -> None:
        if self.context is not None and os.path.exists(os.path.join(self.marks, "stop")):
            self.context.stop_training = True  # the soak's end: rank 0's wish is every rank's

    def on_batch_end(self, epoch: int, step: int, loss: float) -> None:
        import socket

        import spark_hvd.torch as hvd

        attempt = int(os.environ.get("SPARK_HVD_RUN_ATTEMPT", "0"))
        rank, size = hvd.rank(), hvd.size()
        if self.done == 0:
            with open(os.path.join(self.marks, f"rank-{attempt}-{rank}"), "w") as f:
                f.write(f"{socket.gethostname()} {os.getpid()}")
        self.done += 1
        if rank == 0:
            with open(os.path.join(self.marks, "batches.log"), "a") as f:
                f.write(f"{attempt} {epoch} {step} {size} {time.time():.3f}\n")
        if not os.path.exists(os.path.join(self.marks, "lost")):
            time.sleep(self.throttle)
        time.sleep(self.pace)
        if self.regrow and size < self.max_num_proc and self.done == self.gate_after:
            self._gate(attempt, rank)

    def _gate(self, attempt: int, rank: int) -> None:
        from spark_hvd.core.elastic import get_link

        ready = os.path.join(self.marks, f"grow-ready-{attempt}")
        deadline = time.monotonic() + GATE_S
        while time.monotonic() < deadline:
            if rank == 0 and get_link().hosts_updated():
                open(ready, "w").close()
            if os.path.exists(ready):
                return
            time.sleep(0.5)
        raise TimeoutError(f"the job could not grow within {GATE_S:g} s (no free task slot came back)")


def _session(master: str, conf: dict):
    from pyspark.sql import SparkSession

    me = os.environ["SIM_DRIVER_ADDRESS"]
    builder = (SparkSession.builder.master(master).appName("spark_hvd-lost-host")
               .config("spark.driver.host", me).config("spark.driver.bindAddress", me)
               .config("spark.ui.enabled", "false").config("spark.executor.memory", "512m")
               .config("spark.driver.memory", "512m").config("spark.executor.cores", "1")
               .config("spark.sql.shuffle.partitions", "2").config("spark.python.worker.reuse", "true")
               .config("spark.executor.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _wait_executors(spark, n: int, within_s: float = 300.0) -> None:
    """Until ``n`` executors have registered (the fit's first launch wants all of them)."""
    sc, deadline = spark.sparkContext, time.monotonic() + within_s
    while time.monotonic() < deadline:
        if len(sc._jsc.sc().statusTracker().getExecutorInfos()) - 1 >= n:  # the driver is listed too
            return
        time.sleep(0.5)
    raise RuntimeError(f"{n} executors did not register within {within_s:g} s")


def read_log(marks: str) -> list[tuple[int, int, int, int, float]]:
    """``batches.log``: ``(attempt, epoch, step, size, time)`` per batch rank 0 trained."""
    with open(os.path.join(marks, "batches.log")) as f:
        rows = [line.split() for line in f if line.strip()]
    return [(int(a), int(e), int(s), int(n), float(t)) for a, e, s, n, t in rows]


def _resume_point(epoch: int, done: int, steps_then: int, steps_now: int) -> tuple[int, int]:
    """Where a resume from the checkpoint after ``done`` batches of ``epoch`` (``steps_then`` a epoch) starts on
    ``steps_now`` a epoch: the next epoch after an epoch's last batch, else the same fraction of the epoch
    (``RankRun._map_resume_step``)."""
    if done >= steps_then:
        return epoch + 1, 0
    return epoch, done if steps_then == steps_now else min(steps_now, round(done * steps_now / steps_then))


def attempt_cuts(log: list, steps: dict[int, int], every: int) -> dict[int, tuple[list, int]]:
    """Each attempt's ``(batches, kept)``: its ``(epoch, step, size)`` rows and how many of them the fit kept: up
    to the last checkpoint (a step checkpoint every ``every`` batches, or an epoch's end) whose resume point is
    where the next attempt started; all of the last attempt's."""
    attempts: dict[int, list] = {}
    for a, e, s, n, _ in log:
        attempts.setdefault(a, []).append((e, s, n))
    order = sorted(attempts)
    out: dict[int, tuple[list, int]] = {}
    for i, a in enumerate(order):
        rows = attempts[a]
        if i == len(order) - 1:
            out[a] = (rows, len(rows))
            break
        first = attempts[order[i + 1]][0]
        cut = None if first[:2] != (0, 0) else 0  # nothing committed at all: the next attempt starts afresh
        for j, (e, s, n) in enumerate(rows):
            at_checkpoint = (e * steps[n] + s + 1) % every == 0 or s + 1 == steps[n]
            if at_checkpoint and _resume_point(e, s + 1, steps[n], steps[first[2]]) == first[:2]:
                cut = j + 1
        if cut is None:
            raise AssertionError(f"attempt {a} (size {rows[0][2]}) has no checkpoint that resumes at epoch "
                                 f"{first[0]} batch {first[1]} on {first[2]} ranks: {rows}")
        out[a] = (rows, cut)
    return out


def committed_batches(log: list, steps: dict[int, int], every: int) -> list[tuple[int, int, int]]:
    """``(epoch, step, size)`` of exactly the batches whose training the fit kept (``attempt_cuts``), in order."""
    return [row for rows, cut in attempt_cuts(log, steps, every).values() for row in rows[:cut]]


def replay(store, fitted, initial, kept: list, seed: int, batch_size: int, lr: float) -> dict:
    """Train ``initial`` in one process on the ``kept`` batches: per step the mean over the ranks' batches of the
    MSE gradient, then SGD (what ``DistributedOptimizer`` does)."""
    import torch
    from helpers.torch_replay import rank_shards

    sizes = sorted({n for _, _, n in kept})
    shards = {n: rank_shards(store, fitted, seed=seed, batch_size=batch_size, num_proc=n) for n in sizes}
    cache: dict = {}
    model = copy.deepcopy(initial)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for e, s, n in kept:
        if (n, e) not in cache:
            cache[(n, e)] = list(zip(*(r.epoch("train", e) for r in shards[n]), strict=True))
        opt.zero_grad()
        for batch in cache[(n, e)][s]:
            out = model(torch.from_numpy(batch["features"]))
            loss = torch.nn.functional.mse_loss(out, torch.from_numpy(batch["y"]).float().reshape(out.shape))
            (loss / n).backward()
        opt.step()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def fit(spark, store_dir: str, marks: str, cfg: dict) -> dict:
    import torch
    from helpers.estimators import linear_df

    from spark_hvd.estimators import TorchEstimator
    from spark_hvd.store import Store

    store = Store.create(store_dir)
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    initial = copy.deepcopy(net)
    seed, batch, lr, every = 1, cfg.get("batch_size", 8), 0.05, cfg["every"]
    kw: dict = dict(num_proc=cfg["num_proc"], max_retries=cfg.get("max_retries", 0))
    if cfg.get("elastic"):
        kw = dict(num_proc=cfg["num_proc"], elastic=True, min_num_proc=cfg["min_num_proc"],
                  max_num_proc=cfg["max_num_proc"], reset_limit=cfg.get("reset_limit", 4))
    callback = HostLossLog(marks, cfg.get("throttle", 0.2), bool(cfg.get("regrow")), cfg.get("gate_after", 5),
                           cfg.get("max_num_proc", cfg["num_proc"]), cfg.get("pace", 0.0))
    est = TorchEstimator(store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=lr), loss="mse",
                         feature_cols=["features"], label_cols=["y"], batch_size=batch, epochs=cfg["epochs"],
                         random_seed=seed, partitions_per_process=1, verbose=0, checkpoint_every_steps=every,
                         checkpoint_upload="sync", callbacks=[callback], **kw)
    df = linear_df(spark).repartition(2)
    _wait_executors(spark, cfg.get("executors", cfg["num_proc"]))
    print(json.dumps({"started": time.time()}), flush=True)
    start = time.monotonic()
    fitted = est.fit(df)
    fit_s = time.monotonic() - start
    log = read_log(marks)
    from helpers.torch_replay import rank_shards

    steps = {n: rank_shards(store, fitted, seed=seed, batch_size=batch, num_proc=n)[0].steps("train")
             for n in sorted({row[3] for row in log})}
    kept = committed_batches(log, steps, every)
    return {"history": fitted.getHistory(), "fit_s": fit_s, "steps": steps, "kept": kept,
            "weights": {k: v.tolist() for k, v in fitted.getModel().state_dict().items()},
            "replay": replay(store, fitted, initial, kept, seed, batch, lr)}


def main() -> None:
    master, store_dir, marks, cfg = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("spark_hvd.runner.elastic").setLevel(logging.INFO)
    spark = _session(master, cfg.get("conf", {}))
    try:
        try:
            row = fit(spark, store_dir, marks, cfg)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails naming it
            row = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        print(json.dumps(row), flush=True)
        if cfg.get("hold"):  # the test looks for leaks while the application still runs, then writes "done"
            deadline = time.monotonic() + 300
            while not os.path.exists(os.path.join(marks, "done")) and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        spark.stop()


if __name__ == "__main__":
    np.set_printoptions(precision=6)
    main()
