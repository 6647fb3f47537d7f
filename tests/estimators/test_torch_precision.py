"""TorchEstimator ``mixed_precision`` and devices: a two-rank fit equals single-process training on the same batches.

The single-process replay reads every rank's shard of the prepared data with the reader the ranks use
(``ShardReaders``, same seed), and per step does what two data-parallel ranks do: each half's loss under the same
autocast, backward (scaled under fp16), the two gradients averaged, then (fp16) ``GradScaler`` unscale / step /
update. bf16 and fp16 autocast both run on the CPU with this torch. A metric that reports the dtype of the model's
output proves that the ranks really ran under autocast. The GPU fit (skipped without CUDA) must equal the CPU fit.
"""

from __future__ import annotations

import copy
import sys

import cloudpickle
import numpy as np
import pytest
import torch
from helpers.torch_replay import assert_fit_equals_replay, rank_shards, replay

from spark_hvd.estimators import TorchEstimator
from spark_hvd.store import Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the metrics travel by value to the ranks

_SEED, _BATCH, _EPOCHS, _LR = 3, 32, 3, 0.05
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, None: torch.float32}


def out_bf16(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """1 when the model's output is bfloat16 (the forward ran under bf16 autocast)."""
    return torch.tensor(float(output.dtype == torch.bfloat16))


def out_fp16(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """1 when the model's output is float16 (the forward ran under fp16 autocast)."""
    return torch.tensor(float(output.dtype == torch.float16))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return Store.create(str(tmp_path_factory.mktemp("precision_store")))


@pytest.fixture(scope="module")
def df(spark):
    """256 rows of y = x . w + b, x an array column of 4 values."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((256, 4))
    y = x @ np.array([1.5, -2.0, 0.5, 1.0]) + 0.3
    return spark.createDataFrame([([float(v) for v in r], float(t)) for r, t in zip(x, y, strict=True)],
                                 ["features", "y"])


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _fit(store, df, mode: str | None, **kw):
    net = _net()
    est = TorchEstimator(num_proc=2, store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=_LR),
                         loss="mse", feature_cols=["features"], label_cols=["y"], batch_size=_BATCH, epochs=_EPOCHS,
                         random_seed=_SEED, partitions_per_process=2, verbose=0, mixed_precision=mode,
                         metrics=[out_bf16, out_fp16], **kw)
    return est.fit(df)


def _replay(store, fitted, mode: str | None) -> tuple[torch.nn.Module, list[float], int]:
    """Single-process training on both ranks' batches (see the module docstring): (model, loss per epoch, steps
    the scaler skipped)."""
    shards = rank_shards(store, fitted, seed=_SEED, batch_size=_BATCH)
    model = copy.deepcopy(_net())
    opt = torch.optim.SGD(model.parameters(), lr=_LR)
    scaler = torch.amp.GradScaler("cpu") if mode == "fp16" else None
    skipped = []

    def batch_loss(model, batch):
        x, y = torch.from_numpy(batch["features"]), torch.from_numpy(batch["y"]).float()
        with torch.autocast("cpu", dtype=_DTYPES[mode], enabled=mode is not None):
            out = model(x)
            return torch.nn.functional.mse_loss(out, y.reshape(out.shape))

    def apply(opt):  # fp16: GradScaler unscale / step / update, counting the steps it skipped
        scaler.unscale_(opt)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)

    losses = replay(shards, model, opt, batch_loss, _EPOCHS,
                    backward=(lambda loss: scaler.scale(loss).backward()) if scaler else torch.Tensor.backward,
                    apply=apply if scaler else None)
    return model, losses, sum(skipped)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
def test_two_rank_mixed_precision_fit_equals_single_process(spark, store, df, mode):
    fitted = _fit(store, df, mode)
    history = fitted.getHistory()
    assert history[f"out_{mode}"] == [1.0] * _EPOCHS, history  # every training forward ran under autocast
    assert history["loss"][-1] * 3 <= history["loss"][0], history  # it converges (fp16 skips its first steps)
    model, losses, skipped = _replay(store, fitted, mode)
    if mode == "fp16":
        assert skipped >= 1  # the default initial scale overflows float16 at first: those steps must be skipped
    assert_fit_equals_replay(fitted, model, losses, atol=1e-4)


def test_fp16_with_train_minibatch_fn_is_refused(spark, store, df):
    with pytest.raises(ValueError, match="mixed_precision='fp16'.*train_minibatch_fn"):
        _fit(store, df, "fp16", train_minibatch_fn=lambda *args: None)
    with pytest.raises(ValueError, match="'bf16', 'fp16'.*'fp8'"):
        TorchEstimator(mixed_precision="fp8")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a two-rank GPU fit needs two CUDA devices (one per rank; "
                    f"this host has {torch.cuda.device_count()})")
@pytest.mark.parametrize("mode", [None, "bf16"])
def test_two_rank_gpu_fit_equals_cpu_fit(spark, store, df, mode):
    on_gpu = _fit(store, df, mode, use_gpu=True)
    on_cpu = _fit(store, df, mode, use_gpu=False)
    np.testing.assert_allclose(on_gpu.getHistory()["loss"], on_cpu.getHistory()["loss"], rtol=2e-2, atol=1e-3)
    for (name, got), want in zip(on_gpu.getModel().state_dict().items(), on_cpu.getModel().state_dict().values(),
                                 strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3, msg=lambda m, n=name: f"{n}: {m}")
