"""One rank of the Keras mixed-precision checks; run as ``spark-hvd-run -np 2 python keras_mixed_worker.py OUT_DIR``.
Results go to ``OUT_DIR/keras-rank<r>.json``, one entry per check.

Each fit is compared with one process training on the global batches under the same dtype policy. Rank r trains on
slice r of every global batch, so the averaged gradient is the global batch's up to the policy's rounding.
"""

from __future__ import annotations

import json
import os
import sys

from checks import expect_errors, make_check, setup_tensorflow  # the scripts' directory is on sys.path

setup_tensorflow()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import spark_hvd.core as core  # noqa: E402
import spark_hvd.keras as hvd  # noqa: E402

RESULTS: dict[str, str] = {}
OUT_DIR = sys.argv[1] if len(sys.argv) > 1 else "."
IN, OUT_F, B, STEPS = 8, 2, 16, 6


check = make_check(RESULTS, after=lambda: keras.mixed_precision.set_global_policy("float32"))


hvd.init()
R, N = hvd.rank(), hvd.size()


def make_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((IN,)), keras.layers.Dense(16, activation="tanh"),
                             keras.layers.Dense(OUT_F, dtype="float32")])  # float32 outputs, as Keras advises


def data(seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(STEPS * B, IN)).astype(np.float32)
    w = rng.normal(size=(IN, OUT_F)).astype(np.float32)
    return x, (np.tanh(x @ w) + 0.1 * rng.normal(size=(len(x), OUT_F))).astype(np.float32)


def shard(x: np.ndarray) -> np.ndarray:
    """Rank R's slice of every global batch of B rows."""
    return x.reshape(STEPS, N, B // N, *x.shape[1:])[:, R].reshape(-1, *x.shape[1:])


def fit(model: keras.Model, opt, x, y, batch: int, epochs: int = 2) -> keras.callbacks.History:
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    return model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)


def assert_equal_on_all_ranks(values: list) -> None:
    flat = np.concatenate([np.asarray(v, dtype=np.float32).reshape(-1) for v in values])
    gathered = hvd.allgather(flat[None, :]).numpy()
    for r in range(N):
        assert np.array_equal(gathered[r], flat), f"rank {r}'s values differ from rank {R}'s"


def assert_close_weights(a: keras.Model, b: keras.Model, tol: float) -> None:
    for va, vb in zip(a.weights, b.weights, strict=True):
        np.testing.assert_allclose(np.asarray(va), np.asarray(vb), rtol=tol, atol=tol, err_msg=va.path)


def distributed_vs_single(policy: str, make_opt, tol: float) -> tuple[keras.Model, keras.Model]:
    keras.mixed_precision.set_global_policy(policy)
    x, y = data()
    model = make_model(0)
    hist = fit(model, hvd.DistributedOptimizer(make_opt()), shard(x), shard(y), B // N)
    ref = make_model(0)
    ref_hist = fit(ref, make_opt(), x, y, B)
    assert model.layers[0].compute_dtype == policy.split("_")[1], model.layers[0].compute_dtype
    assert_close_weights(model, ref, tol)
    losses = hvd.allreduce(np.asarray(hist.history["loss"], np.float64)).numpy()  # the ranks' mean per epoch
    np.testing.assert_allclose(losses, ref_hist.history["loss"], rtol=tol, atol=tol)
    assert losses[-1] < losses[0], losses
    assert_equal_on_all_ranks(model.weights)
    return model, ref


@check("mixed_bfloat16_matches_single_process")
def _bf16() -> None:
    distributed_vs_single("mixed_bfloat16", lambda: keras.optimizers.SGD(0.1, momentum=0.9), tol=3e-2)


@check("mixed_float16_loss_scale_matches_single_process")
def _fp16() -> None:
    calls: list[int] = []  # tensors per collective: a blocking allreduce (one tensor, or a packed step) counts 1
    real = core.grouped_allreduce_async, core.allreduce

    def counting(bufs, *args, **kwargs):
        calls.append(len(bufs))
        return real[0](bufs, *args, **kwargs)

    def counting_one(buf, *args, **kwargs):
        calls.append(1)
        return real[1](buf, *args, **kwargs)

    core.grouped_allreduce_async, core.allreduce = counting, counting_one
    try:  # a plain optimizer: DistributedOptimizer puts the LossScaleOptimizer around it, as compile would
        model, ref = distributed_vs_single("mixed_float16", lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                                           tol=1e-2)
    finally:
        core.grouped_allreduce_async, core.allreduce = real
    opt, ref_opt = model.optimizer, ref.optimizer
    assert isinstance(opt, keras.optimizers.LossScaleOptimizer), type(opt).__mro__
    assert isinstance(ref_opt, keras.optimizers.LossScaleOptimizer), type(ref_opt).__mro__
    assert type(opt.inner_optimizer) is keras.optimizers.SGD, type(opt.inner_optimizer).__mro__  # reduced once
    # the scaling intact: the same scale, growth counter and number of applied updates as one process
    assert float(opt.dynamic_scale) == float(ref_opt.dynamic_scale), (float(opt.dynamic_scale),
                                                                       float(ref_opt.dynamic_scale))
    assert int(opt.step_counter) == int(ref_opt.step_counter)
    assert int(np.asarray(opt.iterations)) == int(np.asarray(ref_opt.iterations))
    # one collective per step (not two: the step's gradients packed into one buffer), then this check's own
    # allreduce of the losses
    assert calls == ([1] * 2 * STEPS if N > 1 else []) + [1], calls


@check("overflow_on_one_rank_skips_the_step_everywhere")
def _overflow() -> None:
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = data(seed=9)
    x, y = shard(x)[: B // N], shard(y)[: B // N]  # one step
    if R == N - 1:
        x = x * 3e4  # this rank's float16 activations and gradients overflow; the others' do not
    model = make_model(0)
    before = [np.asarray(v).copy() for v in model.trainable_variables]
    opt = hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                                       initial_scale=2.0**10))
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=B // N, epochs=1, shuffle=False, verbose=0)
    assert float(opt.dynamic_scale) == 2.0**9, float(opt.dynamic_scale)  # halved on every rank
    assert int(np.asarray(opt.iterations)) == 0, int(np.asarray(opt.iterations))  # no update anywhere
    for var, old in zip(model.trainable_variables, before, strict=True):
        np.testing.assert_array_equal(np.asarray(var), old, err_msg=var.path)
    assert_equal_on_all_ranks([opt.dynamic_scale, *model.trainable_variables])


@check("refused_combinations")
def _refused() -> None:
    inner = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
    expect_errors(((lambda: hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(inner)),
                    "wraps a DistributedOptimizer"),
                   (lambda: hvd.DistributedOptimizer(keras.optimizers.LossScaleOptimizer(
                       keras.optimizers.SGD(0.1)), backward_passes_per_step=2), "backward_passes_per_step=2")))


with open(os.path.join(OUT_DIR, f"keras-rank{R}.json"), "w") as f:
    json.dump({"rank": R, "size": N, "results": RESULTS}, f)
hvd.shutdown()
