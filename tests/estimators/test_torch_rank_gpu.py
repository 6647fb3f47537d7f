"""TorchEstimator's training loop and TorchModel's inference on a GPU, against the same code on the CPU, without Spark.

``fit(df)`` prepares Parquet and runs ``train_on_rank`` in Spark's barrier tasks. Here the very same
``train_on_rank(TorchTrainer, spec)`` runs in ranks launched as ``spark-hvd-run`` launches them (``run_ranks``),
on Parquet written with pyarrow and described in place (what ``fit_on_parquet`` reads), with the spec the estimator
builds (``_spec``). So a GPU machine without a JVM runs the estimators' GPU path: the module, optimizer state and
batches moved to the rank's GPU, autocast and the fp16 ``GradScaler``, CUDA gradients averaged by the engine, the
final model saved from CPU copies. Each GPU run is compared with the same run on the CPU (same data order, same
initial weights): float32, bf16 and fp16 on one rank (NCCL), and two ranks sharing the one GPU with their CUDA
gradients staged through host memory (``SPARK_HVD_DEVICE_BACKEND=none``: NCCL refuses two ranks on one GPU).

Needs CUDA: every test here skips, saying why, without it. The Spark fits on GPUs are in ``test_torch_precision.py``
(two GPUs) and ``test_model.py`` (transform).
"""

from __future__ import annotations

import os
import sys

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

torch = pytest.importorskip("torch")

from helpers.ranks import run_ranks  # noqa: E402

from spark_hvd.data.parquet import describe_parquet  # noqa: E402
from spark_hvd.estimators import TorchEstimator, TorchModel  # noqa: E402
from spark_hvd.estimators.common.rank_run import train_on_rank  # noqa: E402
from spark_hvd.store import Store  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the metric travels by value to the ranks

_ROWS, _BATCH, _EPOCHS, _LR, _SEED = 512, 32, 3, 0.05, 3


def out_dtype(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """The bits of the model output's dtype (32 float32, 16 bf16/fp16): shows the forward ran under autocast."""
    return torch.tensor(float(output.dtype.itemsize * 8))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """(store, Parquet directory): y = x . w + b, x an array column of 8 values, 8 row groups."""
    store = Store.create(str(tmp_path_factory.mktemp("gpu_store")))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((_ROWS, 8)).astype(np.float32)
    y = (x @ rng.standard_normal(8) + 0.3).astype(np.float32)
    path = str(tmp_path_factory.mktemp("gpu_data"))
    table = pa.table({"features": pa.array(list(x), type=pa.list_(pa.float32())), "y": y})
    pq.write_table(table, os.path.join(path, "part-0.parquet"), row_group_size=_ROWS // 8)
    return store, path


def _rank_fit(spec):
    from spark_hvd.estimators.torch.rank import TorchTrainer

    return train_on_rank(TorchTrainer, spec)


def _fit(dataset, run_id: str, ranks: int, mode: str | None, use_gpu: bool, env: dict | None = None):
    """``train_on_rank`` on ``ranks`` ranks: (loss history, out_dtype history, the final module on the CPU)."""
    store, path = dataset
    net = _net()
    est = TorchEstimator(store=store, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=_LR), loss="mse",
                         feature_cols=["features"], label_cols=["y"], batch_size=_BATCH, epochs=_EPOCHS,
                         random_seed=_SEED, verbose=0, mixed_precision=mode, use_gpu=use_gpu, metrics=[out_dtype],
                         run_id=run_id)
    data = describe_parquet(store, path, ["features"], ["y"], num_proc=ranks)
    spec = est._spec(store, run_id, data, est._check_model(net))
    results = run_ranks(_rank_fit, ranks, env={"SPARK_HVD_TIMEOUT": "60", **(env or {})}, args=(spec,), timeout=300)
    history = results[0]["history"]
    return history["loss"], history["out_dtype"], est._load_trained_model(store, run_id, spec.model_bytes)


def _assert_close(gpu, cpu, rtol: float, atol: float) -> None:
    gpu_loss, gpu_bits, gpu_model = gpu
    cpu_loss, cpu_bits, cpu_model = cpu
    assert gpu_bits == cpu_bits
    assert gpu_loss[-1] * 3 <= gpu_loss[0], gpu_loss  # it trains
    np.testing.assert_allclose(gpu_loss, cpu_loss, rtol=rtol, atol=atol)
    assert all(p.device.type == "cpu" for p in gpu_model.parameters())  # saved from CPU copies
    for (name, got), want in zip(gpu_model.state_dict().items(), cpu_model.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("mode,bits,tol", [(None, 32, 1e-4), ("bf16", 16, 3e-2), ("fp16", 16, 1e-2)],
                         ids=["fp32", "bf16", "fp16"])
def test_one_rank_gpu_fit_equals_cpu_fit(dataset, mode, bits, tol):
    name = mode or "fp32"
    gpu = _fit(dataset, f"gpu1-{name}", 1, mode, use_gpu=True, env={"SPARK_HVD_GPU": "0"})
    cpu = _fit(dataset, f"cpu1-{name}", 1, mode, use_gpu=False)
    assert gpu[1] == [float(bits)] * _EPOCHS  # every training forward ran under this autocast
    _assert_close(gpu, cpu, rtol=tol, atol=tol)


def test_two_ranks_sharing_the_gpu_through_host_equal_cpu_fit(dataset):
    """Two ranks on GPU 0, CUDA gradients averaged through host memory and the ring, against two CPU ranks."""
    env = {"SPARK_HVD_GPU": "0", "SPARK_HVD_DEVICE_BACKEND": "none"}
    gpu = _fit(dataset, "gpu2-host", 2, None, use_gpu=True, env=env)
    cpu = _fit(dataset, "cpu2", 2, None, use_gpu=False)
    _assert_close(gpu, cpu, rtol=1e-4, atol=1e-4)


def test_gpu_inference_equals_the_module_on_the_cpu():
    """TorchModel's executor side with ``setUseGpu(True)``: the module is loaded on the GPU, and its outputs equal
    the module called directly on the CPU."""
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(6, 64), torch.nn.GELU(), torch.nn.Linear(64, 3))
    x = np.random.default_rng(3).standard_normal((1000, 6)).astype(np.float32)
    loaded = TorchModel._load_for_inference(TorchModel._serialize_model(net), use_gpu=True)
    assert next(loaded.parameters()).device.type == "cuda"
    got = TorchModel._predict_batches(loaded, [x], 128)[0]
    with torch.no_grad():
        want = net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
