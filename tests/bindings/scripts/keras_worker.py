"""One rank of the Keras binding checks; run as ``spark-hvd-run -np 2 python keras_worker.py OUT_DIR`` (or
plainly, size 1). Results go to ``OUT_DIR/keras-rank<r>.json``, one entry per check."""

from __future__ import annotations

import json
import os
import sys

from checks import expect_errors, make_check, setup_tensorflow  # the scripts' directory is on sys.path

setup_tensorflow()

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import spark_hvd.keras as hvd  # noqa: E402

RESULTS: dict[str, str] = {}
OUT_DIR = sys.argv[1] if len(sys.argv) > 1 else "."


# with "quick" as second argument only these run (the one-rank launch: the size-1 paths, not every feature)
QUICK = {"before_init_error", "collectives_float32_eager", "collectives_bfloat16_eager",
         "collectives_float32_tf_function", "objects_barrier", "fit_matches_single_process", "save_and_load_model"}
ONLY_QUICK = len(sys.argv) > 2 and sys.argv[2] == "quick"


check = make_check(RESULTS, only=QUICK if ONLY_QUICK else None)


@check("before_init_error")
def _before_init() -> None:
    calls = (hvd.rank, lambda: hvd.allreduce(np.ones(2, np.float32)),
             lambda: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
    expect_errors([(call, "init()") for call in calls], hvd.NotInitializedError)


hvd.init()
R, N = hvd.rank(), hvd.size()

# --------------------------------------------------------------------------------------------- collectives
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "int64": np.int64}
TOL = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 2e-2, "int64": 0}


def _data(r: int, dt: str, rows: int = 6, cols: int = 4) -> np.ndarray:
    rng = np.random.default_rng(2000 + r)
    if dt == "int64":
        return rng.integers(-50, 50, size=(rows, cols)).astype(np.int64)
    return rng.uniform(-4, 4, size=(rows, cols)).astype(DTYPES[dt])


def _wide(a: np.ndarray) -> np.ndarray:
    return a if a.dtype == np.int64 else a.astype(np.float64)


def _close(got, want: np.ndarray, dt: str, what: str) -> None:
    got_np = got.numpy() if hasattr(got, "numpy") else np.asarray(got)
    assert got_np.dtype == np.dtype(DTYPES[dt]), f"{what}: dtype {got_np.dtype} != {dt}"
    assert got_np.shape == want.shape, f"{what}: shape {got_np.shape} != {want.shape}"
    if TOL[dt] == 0:
        np.testing.assert_array_equal(got_np, want, err_msg=what)
    else:
        np.testing.assert_allclose(_wide(got_np), want, rtol=TOL[dt], atol=4 * TOL[dt], err_msg=what)


def _collectives(dt: str, graph: bool) -> None:
    run = tf.function(lambda f, *a: f(*a), autograph=False) if graph else (lambda f, *a: f(*a))
    mine = tf.constant(_data(R, dt))
    stack = np.stack([_wide(_data(r, dt)) for r in range(N)])
    _close(run(lambda t: hvd.allreduce(t, op=hvd.Sum), mine), stack.sum(0), dt, "allreduce sum")
    _close(run(lambda t: hvd.allreduce(t, op=hvd.Min), mine), stack.min(0), dt, "allreduce min")
    _close(run(lambda t: hvd.allreduce(t, op=hvd.Max), mine), stack.max(0), dt, "allreduce max")
    if dt != "int64":
        _close(run(lambda t: hvd.allreduce(t), mine), stack.mean(0), dt, "allreduce average")
    other = tf.constant(_data(R + 5, dt, rows=3, cols=2))
    g = run(lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum), mine, other)
    _close(g[0], stack.sum(0), dt, "grouped 0")
    _close(g[1], np.stack([_wide(_data(r + 5, dt, 3, 2)) for r in range(N)]).sum(0), dt, "grouped 1")
    rows = tf.constant(_data(R, dt, rows=R + 1))
    _close(run(hvd.allgather, rows), np.concatenate([_wide(_data(r, dt, rows=r + 1)) for r in range(N)]), dt,
           "allgather")
    _close(run(lambda t: hvd.broadcast(t, N - 1), mine), stack[N - 1], dt, "broadcast")
    splits = [s + 1 for s in range(N)]
    send = tf.constant(_data(R + 20, dt, rows=sum(splits)))
    out, rsplits = run(lambda t: hvd.alltoall(t, splits=splits), send)
    start = sum(splits[:R])
    want = np.concatenate([_wide(_data(r + 20, dt, rows=sum(splits)))[start:start + splits[R]] for r in range(N)])
    _close(out, want, dt, "alltoall")
    assert list(np.asarray(rsplits)) == [splits[R]] * N, f"alltoall received splits {rsplits}"
    rs = tf.constant(_data(R + 40, dt, rows=2 * N + 1))
    total = np.stack([_wide(_data(r + 40, dt, rows=2 * N + 1)) for r in range(N)]).sum(0)
    counts = [(2 * N + 1) // N + (1 if r < (2 * N + 1) % N else 0) for r in range(N)]
    lo = sum(counts[:R])
    _close(run(lambda t: hvd.reducescatter(t, op=hvd.Sum), rs), total[lo:lo + counts[R]], dt, "reducescatter")


for _dt in DTYPES:
    check(f"collectives_{_dt}_eager")(lambda _dt=_dt: _collectives(_dt, graph=False))
check("collectives_float32_tf_function")(lambda: _collectives("float32", graph=True))
check("collectives_bfloat16_tf_function")(lambda: _collectives("bfloat16", graph=True))


@check("objects_barrier")
def _objects() -> None:
    assert hvd.broadcast_object([R], root_rank=0) == [0]
    assert hvd.allgather_object(R) == list(range(N))
    hvd.barrier()


# --------------------------------------------------------------------------------------------- training
IN, OUT_F, B, STEPS = 8, 2, 16, 6


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(OUT_F)])


def data(global_batch: int, steps: int = STEPS, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * global_batch, IN)).astype(np.float32)
    w = rng.normal(size=(IN, OUT_F)).astype(np.float32)
    return x, (np.tanh(x @ w) + 0.1 * rng.normal(size=(len(x), OUT_F))).astype(np.float32)


def shard(x: np.ndarray, global_batch: int, parts: int, part: int) -> np.ndarray:
    """Rows of ``part`` of ``parts`` equal slices of every global batch, in batch order."""
    steps = len(x) // global_batch
    return x.reshape(steps, parts, global_batch // parts, *x.shape[1:])[:, part].reshape(-1, *x.shape[1:])


def fit(model: keras.Model, opt, x, y, batch: int, epochs: int = 1, callbacks=()) -> keras.callbacks.History:
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    return model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks))


def assert_same_weights(a: keras.Model, b: keras.Model, rtol: float = 1e-5) -> None:
    for va, vb in zip(a.weights, b.weights, strict=True):
        np.testing.assert_allclose(np.asarray(va), np.asarray(vb), rtol=rtol, atol=1e-6, err_msg=va.path)


def assert_equal_on_all_ranks(model: keras.Model) -> None:
    flat = np.concatenate([np.asarray(v).reshape(-1) for v in model.weights])
    gathered = hvd.allgather(flat[None, :]).numpy()
    for r in range(N):
        assert np.array_equal(gathered[r], flat), f"weights of rank {r} differ from rank {R}'s"


def single_process(x, y, batch: int, epochs: int = 1) -> tuple[keras.Model, keras.callbacks.History]:
    model = make_model(0)
    return model, fit(model, keras.optimizers.SGD(0.1, momentum=0.9), x, y, batch, epochs)


BASELINE: dict[str, float] = {}


@check("fit_matches_single_process")
def _fit_equal() -> None:
    x, y = data(B)
    model = make_model(0)
    hist = fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
               shard(x, B, N, R), shard(y, B, N, R), B // N, epochs=2,
               callbacks=[hvd.callbacks.MetricAverageCallback()])
    BASELINE["loss"] = hist.history["loss"][-1]
    ref, _ = single_process(x, y, B, epochs=2)
    assert_same_weights(model, ref)
    assert_equal_on_all_ranks(model)
    assert len(hist.history["loss"]) == 2


@check("one_grouped_collective_per_step")
def _one_collective() -> None:
    """A step's gradients (one dtype) go out packed in one buffer, by one blocking allreduce."""
    import spark_hvd.core as core

    calls: list[int] = []
    real = core.allreduce

    def counting(buf, *args, **kwargs):
        calls.append(buf.size)
        return real(buf, *args, **kwargs)

    core.allreduce = counting
    try:
        x, y = data(B)
        model = make_model(0)
        fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), shard(x, B, N, R), shard(y, B, N, R), B // N)
    finally:
        core.allreduce = real
    from spark_hvd.tensorflow.host_memory import ALIGN

    # each gradient at an ALIGN-byte offset of the buffer (so each result is a tensor over its part of it)
    step = ALIGN // np.dtype(model.trainable_variables[0].dtype).itemsize
    n_values = sum(-(-int(np.prod(v.shape)) // step) * step for v in model.trainable_variables)
    want = [n_values] * STEPS if N > 1 else []
    assert calls == want, f"allreduces (sizes) per fit of {STEPS} steps: {calls}, expected {want}"


@check("backward_passes_per_step_2")
def _bpps() -> None:
    x, y = data(2 * B)
    model = make_model(0)
    # each rank: 2 micro-batches of 2B/(2N) per global batch of 2B, in order
    steps = len(x) // (2 * B)
    per = (2 * B) // (2 * N)
    idx = np.concatenate([np.arange(s * 2 * B + (R * 2 + j) * per, s * 2 * B + (R * 2 + j + 1) * per)
                          for s in range(steps) for j in range(2)])
    fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=2,
                                        average_aggregated_gradients=True), x[idx], y[idx], per)
    ref, _ = single_process(x, y, 2 * B)
    assert_same_weights(model, ref)
    # Horovod's default sums the two passes: the update of the averaged gradient times 2, i.e. SGD at lr 0.2
    summed = make_model(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), backward_passes_per_step=2)
    fit(summed, opt, x[idx], y[idx], per)
    ref2 = make_model(0)
    fit(ref2, keras.optimizers.SGD(0.2, momentum=0.9), x, y, 2 * B)
    assert_same_weights(summed, ref2)
    passes = int(np.asarray(opt.iterations))
    assert passes == 2 * steps, f"iterations counts passes: {passes} != {2 * steps}"
    assert int(opt._agg_helper.counter) == 0, "every pass of the epoch was reduced and applied"


@check("horovod_optimizer_arguments")
def _opt_args() -> None:
    # Horovod's positional order (optimizer, name, device_dense, device_sparse, compression, ...) and keywords
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), "dist", "", "", hvd.Compression.none,
                                   num_groups=2, groups=None, sparse_as_dense=False)
    assert opt.name == "dist"
    for kwargs, err in (({"process_set": type("PS", (), {"process_set_id": 1})()}, TypeError),
                        ({"process_set": hvd.ProcessSet([0])}, ValueError),  # not registered
                        ({"num_groups": -1}, ValueError), ({"groups": "all"}, ValueError),
                        ({"no_such_argument": 1}, TypeError)):
        expect_errors([(lambda kw=kwargs: hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), **kw),
                        next(iter(kwargs)))], err)


@check("fp16_compression_loss_within_5pct")
def _fp16() -> None:
    x, y = data(B)  # the run of fit_matches_single_process, with fp16 compression
    model = make_model(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), compression=hvd.Compression.fp16)
    hist = fit(model, opt, shard(x, B, N, R), shard(y, B, N, R), B // N, epochs=2,
               callbacks=[hvd.callbacks.MetricAverageCallback()])
    loss, ref = hist.history["loss"][-1], BASELINE["loss"]
    assert abs(loss - ref) <= 0.05 * ref, f"fp16 loss {loss} vs uncompressed {ref}"


@check("broadcast_callback_and_metric_average")
def _bcast_cb() -> None:
    x, y = data(B)
    model = make_model(300 + R)  # different initial weights on every rank
    hist = fit(model, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), shard(x, B, N, R), shard(y, B, N, R),
               B // N, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                  hvd.callbacks.MetricAverageCallback()])
    assert_equal_on_all_ranks(model)
    losses = hvd.allgather_object(hist.history["loss"])
    assert all(v == losses[0] for v in losses), f"averaged metrics differ by rank: {losses}"


@check("broadcast_callback_optimizer_state")
def _bcast_opt() -> None:
    x, y = data(B)
    model = make_model(0)
    opt = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    opt.build(model.trainable_variables)
    for v in opt.variables:  # rank-specific optimizer state (as if only root restored a checkpoint)
        if "iteration" not in v.path:
            v.assign(np.full(v.shape, 0.01 * (R + 1), dtype=v.dtype))
    cb = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    cb.set_model(model)
    cb.on_train_begin()
    for v in opt.variables:
        gathered = hvd.allgather_object(np.asarray(v))
        assert all(np.array_equal(g, gathered[0]) for g in gathered), f"{v.path} differs by rank"


@check("lr_warmup")
def _warmup() -> None:
    x, y = data(B, steps=4)
    model = make_model(0)
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(np.asarray(self.model.optimizer.learning_rate)))

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    fit(model, opt, shard(x, B, N, R), shard(y, B, N, R), B // N, epochs=3,
        callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.4, warmup_epochs=2), Spy()])
    assert len(seen) == 12, seen
    assert abs(seen[0] - 0.4 / N * (1 + 0.25 * (N - 1) / 2)) < 1e-6, seen  # Horovod's ramp, first batch
    assert all(a <= b + 1e-9 for a, b in zip(seen, seen[1:], strict=False)), f"warmup not increasing: {seen}"
    assert all(abs(v - 0.4) < 1e-6 for v in seen[8:]), f"LR after warmup: {seen[8:]}"


@check("lr_schedule_best_checkpoint_local_variables")
def _schedule() -> None:
    x, y = data(B, steps=4)
    seen = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(np.asarray(self.model.optimizer.learning_rate)))

    model = make_model(0)
    fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), shard(x, B, N, R), shard(y, B, N, R), B // N,
        epochs=4, callbacks=[hvd.callbacks.LearningRateScheduleCallback(0.4, lambda e: 0.5 ** e, start_epoch=1,
                                                                         end_epoch=3), Spy()])
    want = [0.1] * 4 + [0.2] * 4 + [0.1] * 8  # before start_epoch: unchanged; after end_epoch: left as it was
    np.testing.assert_allclose(seen, want, rtol=1e-6, err_msg="staircase schedule")
    seen.clear()
    model = make_model(0)
    fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), shard(x, B, N, R), shard(y, B, N, R), B // N,
        epochs=1, callbacks=[hvd.callbacks.LearningRateScheduleCallback(1.0, lambda e: 1 + e, staircase=False),
                             Spy()])
    np.testing.assert_allclose(seen, [1.0, 1.25, 1.5, 1.75], rtol=1e-6, err_msg="per-batch schedule")
    # BestModelCheckpoint keeps improvements only
    cb = hvd.callbacks.BestModelCheckpoint(monitor="loss")
    assert cb.save_best_only and cb.monitor == "loss" and isinstance(cb, keras.callbacks.ModelCheckpoint)
    # local variables are left out of the broadcast
    model = make_model(500 + R)
    local = model.layers[1].kernel
    before = np.asarray(local).copy()
    fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), shard(x, B, N, R), shard(y, B, N, R), B // N,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[local])])
    np.testing.assert_array_equal(np.asarray(local), before, err_msg="a local variable was broadcast")
    kernel0 = hvd.broadcast(model.layers[0].kernel.value, 0)
    np.testing.assert_array_equal(np.asarray(model.layers[0].kernel), np.asarray(kernel0))
    try:
        hvd.broadcast_global_variables(0)
    except NotImplementedError as e:
        assert "BroadcastGlobalVariablesCallback" in str(e), str(e)
    else:
        raise AssertionError("broadcast_global_variables did not raise")
    assert hvd.nccl_built() == 0 and not hvd.ccl_built() and hvd.gloo_enabled() and not hvd.mpi_enabled()


@check("partial_distributed_optimizer")
def _partial() -> None:
    x, y = data(B, steps=1, seed=600 + R)  # one step on different data per rank
    model = make_model(0)
    opt = hvd.PartialDistributedOptimizer(keras.optimizers.SGD(0.1), local_layers=[model.layers[1]])
    fit(model, opt, x, y, B)
    # the reduced layer is the same everywhere; the local one moved by lr * (own gradient) / size (Horovod's
    # scale_local_gradients), i.e. as a plain SGD(0.1 / size) step on this rank's data
    gathered0 = hvd.allgather(np.asarray(model.layers[0].kernel)[None]).numpy()
    assert all(np.array_equal(k, gathered0[0]) for k in gathered0)
    ref = make_model(0)
    fit(ref, keras.optimizers.SGD(0.1 / N), x, y, B)
    for a, b in zip(model.layers[1].weights, ref.layers[1].weights, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=a.path)
    kernels = hvd.allgather(np.asarray(model.layers[1].kernel)[None]).numpy()
    assert N == 1 or not np.array_equal(kernels[0], kernels[1]), "the local layer was reduced"


@check("save_and_load_model")
def _save_load() -> None:
    x, y = data(B)
    model = make_model(0)
    fit(model, hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), shard(x, B, N, R), shard(y, B, N, R), B // N)
    path = os.path.join(OUT_DIR, f"model-rank{R}.keras")
    model.save(path)
    plain = keras.saving.load_model(path)  # readable without spark_hvd
    assert type(plain.optimizer) is keras.optimizers.Adam, type(plain.optimizer)
    loaded = hvd.load_model(path)
    opt = loaded.optimizer
    assert isinstance(opt, keras.optimizers.Adam) and type(opt) is not keras.optimizers.Adam, type(opt).__mro__
    assert int(np.asarray(opt.iterations)) == int(np.asarray(model.optimizer.iterations))
    for a, b in zip(opt.variables, model.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=a.path)
    # continue training: the reloaded optimizer still averages (weights stay equal on every rank)
    loaded.fit(shard(x, B, N, R), shard(y, B, N, R), batch_size=B // N, shuffle=False, verbose=0)
    assert_equal_on_all_ranks(loaded)
    cfg = opt.get_config()
    assert type(opt).from_config(cfg).get_config() == cfg


@check("join_uneven_batches")
def _join() -> None:
    x, y = data(B // N, steps=3 + 2 * R, seed=60 + R)  # rank r has 3 + 2r batches
    model = make_model(0)
    fit(model, hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)), x, y, B // N)
    last = hvd.join()
    assert 0 <= last < N, f"join returned {last}"
    hvd.barrier()


if not ONLY_QUICK:
    import keras_horovod_checks  # noqa: E402 - the scripts' directory is on sys.path

    keras_horovod_checks.register(check, R, N)

with open(os.path.join(OUT_DIR, f"keras-rank{R}.json"), "w") as f:
    json.dump({"rank": R, "size": N, "results": RESULTS}, f)
hvd.shutdown()
