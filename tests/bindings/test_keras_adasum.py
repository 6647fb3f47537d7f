"""``spark_hvd.keras.DistributedOptimizer(..., op=Adasum)`` (the delta optimizer) against a single-process
computation: every rank's model and plain optimizer (its own slots) simulated in one process, each rank's local
step from the same variables on its own batches (``backward_passes_per_step`` passes summed), the changes combined
per variable with the numpy Adasum tree (``helpers.adasum``). Through ``model.fit`` and a custom loop
(``GradientTape`` + ``apply_gradients``), float64, on the Keras TensorFlow backend, with a process set; ``model.fit``
on the torch and JAX backends too; the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.adasum import tree
from helpers.ranks import run_ranks

pytest.importorskip("keras")
pytest.importorskip("tensorflow")

STEPS = 3
BATCH = 8
ENV = {"SPARK_HVD_TIMEOUT": "60", "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2",
       "JAX_ENABLE_X64": "1", "JAX_PLATFORMS": "cpu"}
# (backend, ranks): [(name, optimizer, backward_passes_per_step, loop, process set members or None)]
SCENARIOS = {
    ("tensorflow", 2): [("adam-fit", "adam", 1, "fit", None), ("sgd-bpps2-fit", "sgd", 2, "fit", None),
                        ("adam-bpps2-tape", "adam", 2, "tape", None), ("adam-fit-local", "adam", 1, "fit-local", None),
                        ("adamw-fit", "adamw", 1, "fit", None)],
    ("tensorflow", 3): [("adam-bpps2-fit-pset02", "adam", 2, "fit", [0, 2]), ("sgd-fit", "sgd", 1, "fit", None)],
    ("torch", 2): [("adam-fit", "adam", 1, "fit", None), ("sgd-bpps2-fit", "sgd", 2, "fit", None)],
    ("jax", 2): [("adam-fit", "adam", 1, "fit", None), ("sgd-bpps2-fit", "sgd", 2, "fit", None)],
}


def _setup() -> None:
    import os

    if os.environ["KERAS_BACKEND"] == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(2)
    elif os.environ["KERAS_BACKEND"] == "torch":
        import torch

        torch.set_num_threads(1)
    import keras

    keras.config.set_floatx("float64")


def _jit() -> bool:
    """Keras's compiled train step where the backend's collectives run inside it (JAX); TF's XLA cannot."""
    import keras

    return keras.backend.backend() == "jax"


def _model():
    import keras

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
    g = np.random.default_rng(1234)
    model.set_weights([g.normal(size=w.shape) * 0.5 for w in model.get_weights()])
    return model


def _optimizer(kind: str, passes: int = 1):
    """The plain optimizer; ``passes`` > 1 (SGD only): Keras's own accumulation of that many passes, whose average
    times a learning rate ``passes`` times larger makes the same update as the sum the distributed one applies."""
    import keras

    if kind == "adam":  # per-rank moments: the delta is not a linear function of the gradient
        assert passes == 1
        return keras.optimizers.Adam(learning_rate=0.05)
    if kind == "adamw":  # weight decay: part of each rank's local step, so of the change combined
        assert passes == 1
        return keras.optimizers.AdamW(learning_rate=0.05, weight_decay=0.5)
    return keras.optimizers.SGD(learning_rate=0.1 * passes, momentum=0.9,
                                gradient_accumulation_steps=passes if passes > 1 else None)


def _data(rank: int, passes: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s batches, in order: step s, pass k is rows ``(s * passes + k) * BATCH``..."""
    g = np.random.default_rng([rank, passes])
    n = STEPS * passes * BATCH
    return g.normal(loc=0.3 * rank, size=(n, 5)), g.normal(size=(n, 3))


def _train(hvd, kind: str, passes: int, loop: str, members: list[int] | None, rank: int) -> list[np.ndarray]:
    import keras

    pset = hvd.add_process_set(members) if members is not None else None
    model = _model()
    settings = {"op": hvd.Adasum, "backward_passes_per_step": passes, "process_set": pset}
    if loop == "fit-local":  # the first layer's variables stay local to each rank
        opt = hvd.PartialDistributedOptimizer(_optimizer(kind), local_layers=[model.layers[0]], **settings)
    else:
        opt = hvd.DistributedOptimizer(_optimizer(kind), **settings)
    x, y = _data(rank, passes)
    if loop.startswith("fit"):
        model.compile(optimizer=opt, loss="mse", jit_compile=_jit())
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    else:
        import tensorflow as tf

        loss_fn = keras.losses.MeanSquaredError()
        for b in range(STEPS * passes):
            with tf.GradientTape() as tape:
                loss = loss_fn(y[b * BATCH:(b + 1) * BATCH], model(x[b * BATCH:(b + 1) * BATCH]))
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    if pset is not None:
        hvd.remove_process_set(pset)
    return [w.copy() for w in model.get_weights()]


def _reference(kind: str, passes: int, n: int, members: list[int] | None, local: bool = False,
               combine=tree) -> list[list[np.ndarray]]:
    """Every rank's variables after STEPS steps, computed in this one process (``combine``: how the members'
    changes of one variable are combined; Adasum's tree, or a mean to show the test tells them apart; ``local``:
    the first layer's variables keep each rank's own change)."""
    import keras
    import tensorflow as tf

    members = list(range(n)) if members is None else members
    models = [_model() for _ in range(n)]
    opts = [_optimizer(kind) for _ in range(n)]
    loss_fn = keras.losses.MeanSquaredError()
    data = [_data(r, passes) for r in range(n)]
    for s in range(STEPS):
        before = [m.get_weights() for m in models]
        deltas = []
        for r, (m, opt) in enumerate(zip(models, opts, strict=True)):
            x, y = data[r]
            total = None
            for k in range(passes):  # the passes' gradients summed (Horovod's default)
                b = s * passes + k
                with tf.GradientTape() as tape:
                    loss = loss_fn(y[b * BATCH:(b + 1) * BATCH], m(x[b * BATCH:(b + 1) * BATCH]))
                g = tape.gradient(loss, m.trainable_variables)
                total = g if total is None else [a + c for a, c in zip(total, g, strict=True)]
            # the distributed optimizer's ``iterations`` counts passes (Horovod's), and Adam's bias correction
            # reads it: the plain optimizer is given the same count
            opt.iterations.assign(s * passes + passes - 1)
            opt.apply_gradients(zip(total, m.trainable_variables, strict=True))
            deltas.append([w - b0 for w, b0 in zip(m.get_weights(), before[r], strict=True)])
        start = before[members[0]]  # the members' shared variables are equal
        combined = [combine([deltas[r][i].reshape(-1) for r in members]).reshape(start[i].shape)
                    for i in range(len(start))]
        for r in members:
            models[r].set_weights([before[r][i] + deltas[r][i] if local and i < 2 else start[i] + combined[i]
                                   for i in range(len(start))])
    return [m.get_weights() for m in models]


def _reference_fit(kind: str, n: int, passes: int) -> list[list[np.ndarray]]:
    """As :func:`_reference` on any backend: each rank's passes are ``train_on_batch`` calls with the plain
    optimizer (accumulating ``passes`` of them, see :func:`_optimizer`)."""
    models = [_model() for _ in range(n)]
    for m in models:
        m.compile(optimizer=_optimizer(kind, passes), loss="mse", jit_compile=_jit())
    data = [_data(r, passes) for r in range(n)]
    for s in range(STEPS):
        before = models[0].get_weights()
        deltas = []
        for r, m in enumerate(models):
            x, y = data[r]
            for b in range(s * passes, (s + 1) * passes):
                m.train_on_batch(x[b * BATCH:(b + 1) * BATCH], y[b * BATCH:(b + 1) * BATCH])
            deltas.append([w - b0 for w, b0 in zip(m.get_weights(), before, strict=True)])
        combined = [tree([d[i].reshape(-1) for d in deltas]).reshape(before[i].shape) for i in range(len(before))]
        for m in models:
            m.set_weights([b0 + c for b0, c in zip(before, combined, strict=True)])
    return [m.get_weights() for m in models]


def _job(n: int) -> dict:
    _setup()
    import keras

    import spark_hvd.keras as hvd

    backend = keras.backend.backend()
    hvd.init()
    try:
        r = hvd.rank()
        got = {name: _train(hvd, kind, passes, loop, members, r)
               for name, kind, passes, loop, members in SCENARIOS[backend, n]}
    finally:
        hvd.shutdown()
    if r != 0:
        return {"got": got}
    if backend != "tensorflow":
        return {"got": got, "want": {name: _reference_fit(kind, n, passes)
                                     for name, kind, passes, *_ in SCENARIOS[backend, n]}}
    want = {name: _reference(kind, passes, n, members, loop == "fit-local")
            for name, kind, passes, loop, members in SCENARIOS[backend, n]}
    averaged = {name: _reference(kind, passes, n, members, loop == "fit-local", combine=lambda v: sum(v) / len(v))
                for name, kind, passes, loop, members in SCENARIOS[backend, n]}
    return {"got": got, "want": want, "averaged": averaged}


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend,n", list(SCENARIOS), ids=[f"{b}-np{n}" for b, n in SCENARIOS])
def test_keras_adasum_matches_single_process(backend, n):
    if backend != "tensorflow":
        pytest.importorskip(backend)
    results = run_ranks(_job, n, env={**ENV, "KERAS_BACKEND": backend}, args=(n,), timeout=360)
    want = results[0]["want"]
    for name, _kind, _passes, loop, members in SCENARIOS[backend, n]:
        inside = list(range(n)) if members is None else members
        for r, res in enumerate(results):
            for i, (got, exp) in enumerate(zip(res["got"][name], want[name][r], strict=True)):
                np.testing.assert_allclose(got, exp, rtol=1e-9, atol=1e-12, err_msg=f"{name}: rank {r} variable {i}")
        first = results[inside[0]]["got"][name]
        shared = 2 if loop == "fit-local" else 0  # local variables (the first layer's) differ by rank
        for r in inside:
            for got, f in zip(results[r]["got"][name][shared:], first[shared:], strict=True):
                np.testing.assert_array_equal(got, f)
        if shared:
            assert not np.allclose(results[1]["got"][name][0], first[0])
        for r in set(range(n)) - set(inside):  # outside the set: trained alone
            assert not np.allclose(results[r]["got"][name][0], first[0])
        if "averaged" in results[0]:  # averaging the changes instead would give others (the comparison can fail)
            assert not np.allclose(first[-1], results[0]["averaged"][name][inside[0]][-1], rtol=1e-6)


def _errors_job() -> dict:
    _setup()
    import keras

    import spark_hvd.keras as hvd

    hvd.init()
    out: dict[str, str] = {}
    try:
        for key, kwargs in [("average_aggregated", {"average_aggregated_gradients": True,
                                                    "backward_passes_per_step": 2}),
                            ("predivide", {"gradient_predivide_factor": 2.0}),
                            ("loss_scale", {"optimizer": keras.optimizers.LossScaleOptimizer(
                                keras.optimizers.SGD(0.1))})]:
            args = {"optimizer": keras.optimizers.SGD(0.1), "op": hvd.Adasum, **kwargs}
            try:
                hvd.DistributedOptimizer(**args)
                out[key] = "no error"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out[key] = f"{type(exc).__name__}: {exc}"
        # horovod.tensorflow's DistributedOptimizer with a Keras optimizer takes the Keras path
        import spark_hvd.tensorflow as tfhvd
        from spark_hvd._keras_common.adasum_optimizer import DeltaAdasumMixin

        wrapped = tfhvd.DistributedOptimizer(keras.optimizers.SGD(0.1), op=tfhvd.Adasum)
        out["tensorflow"] = "delta" if isinstance(wrapped, DeltaAdasumMixin) else type(wrapped).__mro__[1].__name__
        return out
    finally:
        hvd.shutdown()


@pytest.mark.slow  # a rank process that imports Keras and TensorFlow
@pytest.mark.timeout(200)
def test_keras_adasum_refusals():
    out = run_ranks(_errors_job, 1, env=ENV, timeout=150)[0]
    assert out["average_aggregated"] == "ValueError: Adasum does not support average_aggregated_gradients == True"
    assert out["predivide"].startswith("ValueError: gradient_predivide_factor needs op=Average"), out
    assert out["tensorflow"] == "delta", out
    assert out["loss_scale"].startswith("NotImplementedError: DistributedOptimizer(op=Adasum) with loss scaling"), out
