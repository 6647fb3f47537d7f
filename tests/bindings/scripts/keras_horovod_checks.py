"""Checks of Horovod's Keras contracts, run inside keras_worker.py's job (:func:`register` with its ``check``
decorator): ``DistributedOptimizer._compute_gradients`` (the gradients against numpy's per-rank gradients of the same
loss, one reduction per update, ``backward_passes_per_step`` summing or averaging the passes as Horovod does) and
``elastic.KerasState.sync()`` snapshotting the synced values."""

from __future__ import annotations

from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

import spark_hvd.core as core
import spark_hvd.keras as hvd


def _batch(r: int, p: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``r``'s data of pass ``p`` (every rank can build every rank's)."""
    rng = np.random.default_rng(7000 + 100 * p + r)
    return rng.uniform(-1, 1, (5, 3)), rng.uniform(-1, 1, (5, 1))


def _np_grad(w: np.ndarray, r: int, p: int) -> np.ndarray:
    """d/dw of mean((x @ w - y)^2), in float64."""
    x, y = _batch(r, p)
    return 2.0 / len(x) * x.T @ (x @ w - y)


class _CountReductions:
    """Counts the engine's gradient reductions while active: a blocking ``allreduce`` (one tensor, or a step's
    gradients packed into one buffer) counts 1, a ``grouped_allreduce_async`` its number of tensors."""

    def __enter__(self) -> list[int]:
        self.calls: list[int] = []
        self.real = core.grouped_allreduce_async, core.allreduce

        def counting(bufs, *args, **kwargs):
            self.calls.append(len(bufs))
            return self.real[0](bufs, *args, **kwargs)

        def counting_one(buf, *args, **kwargs):
            self.calls.append(1)
            return self.real[1](buf, *args, **kwargs)

        core.grouped_allreduce_async, core.allreduce = counting, counting_one
        return self.calls

    def __exit__(self, *exc: object) -> None:
        core.grouped_allreduce_async, core.allreduce = self.real


def _run_passes(opt, w: tf.Variable, passes: int, rank: int) -> list[np.ndarray]:
    """``passes`` rounds of _compute_gradients + apply_gradients in a tf.function (as model.fit traces them);
    returns the gradient each round handed back."""
    @tf.function
    def step(x, y):
        def loss():
            return tf.reduce_mean((tf.matmul(x, w) - y) ** 2)
        grads_and_vars = opt._compute_gradients(loss, var_list=[w])
        opt.apply_gradients(grads_and_vars)
        return grads_and_vars[0][0]

    out = []
    for p in range(passes):
        x, y = _batch(rank, p)
        out.append(step(tf.constant(x, tf.float32), tf.constant(y, tf.float32)).numpy().astype(np.float64))
    return out


def register(check: Callable, rank: int, size: int) -> None:
    """Run the checks now through ``check`` (keras_worker.py's decorator)."""

    @check("compute_gradients_reduced_once")
    def _once() -> None:
        w0 = np.array([[0.5], [-1.0], [0.25]])
        w = tf.Variable(w0.astype(np.float32))
        opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5))
        x, y = _batch(rank, 0)
        with tf.GradientTape() as tape:  # a loss tensor and its tape (eager), as Horovod's tests pass them
            loss = tf.reduce_mean((tf.matmul(tf.constant(x, tf.float32), w) - y) ** 2)
        with _CountReductions() as calls:
            (g, v), = opt._compute_gradients(loss, [w], tape=tape)
            opt.apply_gradients([(g, v)])
        want = np.mean([_np_grad(w0, r, 0) for r in range(size)], axis=0)
        assert v is w
        np.testing.assert_allclose(g.numpy(), want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(w.numpy(), w0 - 0.5 * want, rtol=1e-5, atol=1e-6)  # applied once, not re-reduced
        assert calls == ([1] if size > 1 else []), f"grouped allreduces for one compute+apply: {calls}"
        assert opt._agg_helper is None and int(np.asarray(opt.iterations)) == 1

    for average in (False, True):
        @check(f"compute_gradients_backward_passes_3_average_{average}")
        def _passes(average: bool = average) -> None:
            k, lr, updates = 3, 0.1, 2
            w0 = np.array([[0.5], [-1.0], [0.25]])
            w = tf.Variable(w0.astype(np.float32))
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=k,
                                           average_aggregated_gradients=average)
            with _CountReductions() as calls:
                got = _run_passes(opt, w, k * updates + 1, rank)
            want_w, local = w0.copy(), np.zeros_like(w0)
            for p in range(k * updates + 1):
                local += _np_grad(want_w, rank, p)
                if (p + 1) % k:  # not the last pass: the local sum so far, not reduced
                    np.testing.assert_allclose(got[p], local, rtol=1e-5, atol=1e-5, err_msg=f"pass {p}")
                    continue
                block = range(p + 1 - k, p + 1)
                summed = np.mean([sum(_np_grad(want_w, r, q) for q in block) for r in range(size)], axis=0)
                reduced = summed / k if average else summed
                np.testing.assert_allclose(got[p], reduced, rtol=1e-5, atol=1e-5, err_msg=f"pass {p}")
                want_w, local = want_w - lr * reduced, np.zeros_like(w0)
            np.testing.assert_allclose(w.numpy(), want_w, rtol=1e-5, atol=1e-5)
            assert calls == ([1] * updates if size > 1 else []), f"grouped allreduces: {calls}, one per update"
            passes = int(np.asarray(opt.iterations))
            assert passes == k * updates + 1, f"iterations counts passes: {passes}"
            assert int(opt._agg_helper.counter) == 1, f"passes since the reduction: {int(opt._agg_helper.counter)}"

    @check("elastic_keras_state_sync_snapshots")
    def _state_sync() -> None:
        model = keras.Sequential([keras.layers.Dense(2)])
        model.build((None, 2))
        mine = [np.full(w.shape, rank + 1.0, np.float32) for w in model.get_weights()]
        model.set_weights(mine)
        state = hvd.elastic.KerasState(model, keras.optimizers.Adam(0.01), batch=20 + rank)
        state.sync()
        for w in model.get_weights():  # rank 0's values everywhere
            np.testing.assert_array_equal(w, np.ones_like(w))
        model.set_weights([np.zeros_like(w) for w in mine])
        state.batch = 99
        state.restore()  # back to the synced values, not to this rank's values before sync
        for w in model.get_weights():
            np.testing.assert_array_equal(w, np.ones_like(w))
        assert state.batch == 20, state.batch
