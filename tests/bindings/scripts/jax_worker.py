"""One rank of the spark_hvd.keras checks on Keras's JAX backend; run as
``spark-hvd-run -np 2 python jax_worker.py OUT_DIR``. Results go to ``OUT_DIR/jax-rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from checks import make_check  # noqa: E402 - the scripts' directory is on sys.path

import spark_hvd.keras as hvd  # noqa: E402

RESULTS: dict[str, str] = {}
OUT_DIR = sys.argv[1] if len(sys.argv) > 1 else "."
check = make_check(RESULTS, after=lambda: hvd.barrier())
hvd.init()
R, N = hvd.rank(), hvd.size()


def data(r: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(1000 * seed + r).standard_normal(shape).astype(np.float32)


def close(a: object, b: np.ndarray, tol: float = 1e-5) -> None:
    a = np.asarray(a)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


@check("backend_is_jax")
def _backend() -> None:
    assert keras.backend.backend() == "jax"


@check("collectives_against_numpy")
def _collectives() -> None:
    xs = [data(r, (5, 3), seed=1) for r in range(N)]
    x = jnp.asarray(xs[R])
    assert isinstance(hvd.allreduce(x), jax.Array)
    close(hvd.allreduce(x, op=hvd.Sum), np.stack(xs).sum(0))
    close(hvd.allreduce(x), np.stack(xs).mean(0))
    close(hvd.allreduce(x, op=hvd.Max, prescale_factor=2.0), 2 * np.stack(xs).max(0))
    close(hvd.allreduce(x, compression=hvd.Compression.fp16), np.stack(xs).mean(0), 3e-3)
    a, b = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
    close(b, 2 * np.stack(xs).sum(0))
    close(hvd.allgather(jnp.asarray(xs[R][:R + 1])), np.concatenate([xs[r][:r + 1] for r in range(N)]))
    close(hvd.broadcast(x, root_rank=1), xs[1])
    ev = [data(r, (2 * N, 2), seed=2) for r in range(N)]
    close(hvd.alltoall(jnp.asarray(ev[R])), np.concatenate([e[2 * R:2 * R + 2] for e in ev]))
    close(hvd.reducescatter(jnp.asarray(ev[R]), op=hvd.Sum), np.stack(ev).sum(0)[2 * R:2 * R + 2])


@check("allreduce_inside_jit")
def _jit() -> None:
    xs = [data(r, (4,), seed=3) for r in range(N)]

    @jax.jit
    def f(v: jax.Array) -> jax.Array:
        return hvd.allreduce(v * 2.0, op=hvd.Sum, name="jit.sum") + 1.0

    for _ in range(2):  # compiled once, the callback runs each call
        close(f(jnp.asarray(xs[R])), 2 * np.stack(xs).sum(0) + 1.0)


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


@check("fit_matches_single_process")
def _fit() -> None:
    b, steps = 4, 6
    xr = [data(r, (b * steps, 5), seed=10) for r in range(N)]
    yr = [data(r, (b * steps, 1), seed=11) for r in range(N)]
    model = make_model(20 + R)  # different starting weights: the broadcast callback fixes them
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), loss="mse")
    model.fit(xr[R], yr[R], batch_size=b, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    # one process on the combined batches: batch i of every rank, concatenated
    xc = np.concatenate([np.concatenate([x[i * b:(i + 1) * b] for x in xr]) for i in range(steps)])
    yc = np.concatenate([np.concatenate([y[i * b:(i + 1) * b] for y in yr]) for i in range(steps)])
    ref = make_model(20)
    ref.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    ref.fit(xc, yc, batch_size=b * N, epochs=2, shuffle=False, verbose=0)
    for w, rw in zip(model.get_weights(), ref.get_weights(), strict=True):
        close(w, rw, 1e-5)
    every = hvd.allgather_object([w.tolist() for w in model.get_weights()])
    assert all(e == every[0] for e in every), "ranks ended with different weights"


with open(os.path.join(OUT_DIR, f"jax-rank{R}.json"), "w") as f:
    json.dump({"rank": R, "size": N, "results": RESULTS}, f)
hvd.shutdown()
