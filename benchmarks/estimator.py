"""TorchEstimator / TorchModel / LightningEstimator against their peers, in one invocation on one local[2] Spark.

transform: rows/s of ``TorchModel.transform`` (mapInArrow, batches of 1024) on a cached DataFrame, against
  (a) the same module called on in-memory tensors in batches of 1024 with as many torch threads as Spark has cores
      (target: transform >= 50% of it), and
  (b) a row-at-a-time ``rdd.mapPartitions`` that calls the module once per row (Horovod's way; target >= 10x),
  and, for reading them, (c) Spark's own Arrow round trip with no model (``arrow_floor_run``, timed alternately with the
  transform): the ceiling any batched Python transform can approach on this DataFrame.
fit: wall time of ``TorchEstimator.fit`` (num_proc=2) against
  (c) the same loop on in-memory tensors in 2 processes under ``spark-hvd-run`` (DistributedOptimizer, same model,
      optimizer, batch size, epochs, steps per epoch; target fit <= 1.25x + 15 s), and
  (d) pyspark's ``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)`` training the same model with
      DDP (gloo) for the same epochs on the same Parquet (the estimator's prepared files) read with pandas inside
      its function (target fit <= 1.0x).
lightning: wall time of ``LightningEstimator.fit`` (num_proc=2) of ``_LitModule`` (the same MLP, Adam, MSE)
  against (e) the same module trained by a Lightning ``Trainer`` in one process per rank under
  ``spark-hvd-run -np 2`` on the prepared Parquet (manual optimization around ``spark_hvd.torch``'s
  DistributedOptimizer, so gradients are averaged as in the fit; same batch size, epochs and steps; target <= 1.25x).

    .venv/bin/python benchmarks/estimator.py [--rows 200000] [--row-at-a-time-rows 20000] [--fit-rows 50000]
        [--epochs 3] [--batch 128] [--skip transform|fit|distributor|lightning] [--out results.json]

Each measured item is run ``--repeats`` times (median); fits are timed warm (a first fit prepares the data and
starts the Python workers; later fits reuse the prepared data, as a user re-fitting would).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared helpers, also under python -m / import
from _timing import (  # noqa: E402
    WIDTH,
    arrow_floor_run,
    features_df,
    finish,
    fit_vs_plain,
    median_time,
    paired_median_times,
    start,
)

log = logging.getLogger("benchmarks.estimator")


def _model(seed: int = 0, hidden: int = 64):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 1))


def _lit_module_class():
    """``_LitModule``: ``_model()`` as a LightningModule (defined lazily: lightning is an optional extra)."""
    import lightning.pytorch as pl
    import torch

    class _LitModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self(batch["features"]), batch["y"].float().reshape(-1, 1))
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    return _LitModule


# ------------------------------------------------------------------------------------------------ transform
def bench_transform(spark, rows: int, slow_rows: int, repeats: int, hidden: int = 64) -> dict:
    import numpy as np
    import torch

    from spark_hvd.estimators import TorchModel

    cores = spark.sparkContext.defaultParallelism
    df = features_df(spark, rows, seed=1).repartition(cores).cache()
    df.count()
    net = _model(hidden=hidden).eval()
    tm = TorchModel(model=net, feature_cols=["features"], label_cols=["y"], batch_size=1024)

    def run_transform():
        tm.transform(df).write.format("noop").mode("overwrite").save()

    t_first = median_time(run_transform, 1)
    run_floor = arrow_floor_run(df, "y__output")
    run_floor()  # warm
    t_transform, t_floor = paired_median_times(run_transform, run_floor, repeats)
    floor = rows / t_floor

    x = torch.from_numpy(np.asarray(df.select("features").toPandas()["features"].tolist(), dtype=np.float32))
    prev = torch.get_num_threads()
    torch.set_num_threads(cores)

    def run_memory():
        with torch.inference_mode():
            for i in range(0, len(x), 1024):
                net(x[i:i + 1024])

    t_memory = median_time(run_memory, repeats)
    torch.set_num_threads(prev)

    small = df.limit(slow_rows).repartition(cores).cache()
    small.count()

    def row_at_a_time(it):
        import torch as t

        t.set_num_threads(1)
        for row in it:
            with t.no_grad():
                out = net(t.tensor(row.features, dtype=t.float32).unsqueeze(0))
            yield (*row, float(out[0, 0]))

    from pyspark.sql.types import DoubleType, StructField, StructType

    schema = StructType(list(small.schema.fields) + [StructField("y__output", DoubleType())])

    def run_rows():
        spark.createDataFrame(small.rdd.mapPartitions(row_at_a_time), schema).write.format("noop") \
            .mode("overwrite").save()

    t_rows = median_time(run_rows, repeats)
    res = {
        "rows": rows,
        "transform_rows_per_s": rows / t_transform,
        "transform_first_call_s": t_first,
        "in_memory_rows_per_s": rows / t_memory,
        "row_at_a_time_rows": slow_rows,
        "row_at_a_time_rows_per_s": slow_rows / t_rows,
        "arrow_floor_rows_per_s": floor,
        "hidden": hidden,
    }
    res["transform_vs_arrow_floor"] = res["transform_rows_per_s"] / floor
    res["transform_vs_in_memory"] = res["transform_rows_per_s"] / res["in_memory_rows_per_s"]
    res["transform_vs_row_at_a_time"] = res["transform_rows_per_s"] / res["row_at_a_time_rows_per_s"]
    df.unpersist()
    small.unpersist()
    return res


# ------------------------------------------------------------------------------------------------ fit
_PLAIN_LOOP = r'''
import math, os, sys, time, json
import numpy as np, pyarrow.dataset as ds, torch
import spark_hvd.torch as hvd
sys.path.insert(0, {bench_dir!r})
from estimator import _model
from _timing import load_prepared
hvd.init()
torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
t0 = time.perf_counter()
feats, y = load_prepared({path!r})
rank, size, bs, epochs = hvd.rank(), hvd.size(), {batch}, {epochs}
x_r, y_r = torch.from_numpy(feats[rank::size].copy()), torch.from_numpy(y[rank::size].copy()).reshape(-1, 1)
steps = math.ceil(math.ceil(len(feats) / size) / bs)
t_load = time.perf_counter() - t0
model = _model()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
t1 = time.perf_counter()
g = torch.Generator().manual_seed(rank)
for epoch in range(epochs):
    perm = torch.randperm(len(x_r), generator=g)
    for s in range(steps):
        idx = perm[(s * bs) % len(x_r):(s * bs) % len(x_r) + bs]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x_r[idx]), y_r[idx])
        loss.backward()
        opt.step()
    avg = hvd.allreduce(loss.detach(), name=f"loss{{epoch}}")
t_train = time.perf_counter() - t1
if rank == 0:
    print("RESULT", json.dumps({{"load_s": t_load, "train_s": t_train, "loss": float(avg)}}), flush=True)
'''


def _distributor_train(path: str, epochs: int, batch: int) -> dict:
    """TorchDistributor's function: DDP (gloo) on the Parquet read with pandas, same loop as the others."""
    import math
    import os
    import time

    import numpy as np
    import pandas as pd
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    t0 = time.perf_counter()
    pdf = pd.read_parquet(path)
    feats = np.stack(pdf["features"].to_numpy()).astype(np.float32)
    y = pdf["y"].to_numpy().astype(np.float32)
    x_r, y_r = torch.from_numpy(feats[rank::size].copy()), torch.from_numpy(y[rank::size].copy()).reshape(-1, 1)
    steps = math.ceil(math.ceil(len(feats) / size) / batch)
    t_load = time.perf_counter() - t0
    model = torch.nn.parallel.DistributedDataParallel(_model())
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    t1 = time.perf_counter()
    g = torch.Generator().manual_seed(rank)
    for _ in range(epochs):
        perm = torch.randperm(len(x_r), generator=g)
        for s in range(steps):
            idx = perm[(s * batch) % len(x_r):(s * batch) % len(x_r) + batch]
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x_r[idx]), y_r[idx])
            loss.backward()
            opt.step()
    t_train = time.perf_counter() - t1
    dist.destroy_process_group()
    return {"load_s": t_load, "train_s": t_train, "loss": float(loss)}


def bench_fit(spark, rows: int, epochs: int, batch: int, repeats: int, distributor: bool) -> dict:
    import torch

    from spark_hvd.estimators import TorchEstimator

    def estimator(store):
        net = _model()
        return TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.Adam(net.parameters(), lr=1e-3),
                              loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=batch,
                              epochs=epochs, shuffle=True, random_seed=0, partitions_per_process=4, verbose=0)

    res, train_path, df = fit_vs_plain(spark, estimator, _PLAIN_LOOP, "plain_loop.py", rows, epochs, batch, repeats,
                                       "bench_estimator_")
    t_fit = res["fit_s"]
    if distributor:
        from pyspark.ml.torch.distributor import TorchDistributor

        detail = {}

        def run_distributor():
            d = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
            detail.update(d.run(_distributor_train, train_path, epochs, batch) or {})

        try:
            res["torch_distributor_s"] = median_time(run_distributor, repeats)
            res["torch_distributor_detail"] = detail
            res["fit_vs_torch_distributor"] = t_fit / res["torch_distributor_s"]
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            log.exception("TorchDistributor failed")
            res["torch_distributor_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    df.unpersist()
    return res


_PLAIN_LIGHTNING = r'''
import math, os, sys, time, json
import numpy as np, torch, lightning.pytorch as pl
import spark_hvd.torch as hvd
sys.path.insert(0, {bench_dir!r})
from estimator import _lit_module_class
from _timing import load_prepared
hvd.init()
torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
t0 = time.perf_counter()
feats, y = load_prepared({path!r})
rank, size, bs, epochs = hvd.rank(), hvd.size(), {batch}, {epochs}
x_r, y_r = torch.from_numpy(feats[rank::size].copy()), torch.from_numpy(y[rank::size].copy())
perm = torch.randperm(len(x_r), generator=torch.Generator().manual_seed(rank))
batches = [{{"features": x_r[i], "y": y_r[i]}} for i in perm.split(bs)]
t_load = time.perf_counter() - t0

class Manual(_lit_module_class()):
    """The benchmark's module with spark_hvd's DistributedOptimizer in Lightning's manual optimization."""
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        return loss
    def configure_optimizers(self):
        return hvd.DistributedOptimizer(super().configure_optimizers(), named_parameters=self.named_parameters())

model = Manual()
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
t1 = time.perf_counter()
trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
t_train = time.perf_counter() - t1
if rank == 0:
    print("RESULT", json.dumps({{"load_s": t_load, "train_s": t_train, "steps": len(batches)}}), flush=True)
'''


def bench_lightning(spark, rows: int, epochs: int, batch: int, repeats: int) -> dict:
    from spark_hvd.estimators import LightningEstimator

    def estimator(store):
        return LightningEstimator(num_proc=2, store=store, model=_lit_module_class()(), feature_cols=["features"],
                                  label_cols=["y"], batch_size=batch, epochs=epochs, shuffle=True, random_seed=0,
                                  partitions_per_process=4, verbose=0)

    res, _, df = fit_vs_plain(spark, estimator, _PLAIN_LIGHTNING, "plain_lightning.py", rows, epochs, batch, repeats,
                              "bench_lightning_")
    df.unpersist()
    return res


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--row-at-a-time-rows", type=int, default=20_000)
    parser.add_argument("--fit-rows", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transform-hidden", type=int, default=64,
                        help="width of the MLP's hidden layers in the transform measurement (a costlier model)")
    parser.add_argument("--skip", choices=["transform", "fit", "distributor", "lightning"], action="append",
                        default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    spark, results = start("bench-estimator", __name__)  # TorchDistributor's function pickles _model by value
    if "transform" not in args.skip:
        results["transform"] = bench_transform(spark, args.rows, args.row_at_a_time_rows, args.repeats,
                                               args.transform_hidden)
        log.info("transform: %s", json.dumps(results["transform"]))
    if "fit" not in args.skip:
        results["fit"] = bench_fit(spark, args.fit_rows, args.epochs, args.batch, args.repeats,
                                   "distributor" not in args.skip)
        log.info("fit: %s", json.dumps(results["fit"]))
    if "lightning" not in args.skip:
        results["lightning"] = bench_lightning(spark, args.fit_rows, args.epochs, args.batch, args.repeats)
        log.info("lightning: %s", json.dumps(results["lightning"]))
    finish(results, args.out)
    spark.stop()
    return results


if __name__ == "__main__":
    main()
